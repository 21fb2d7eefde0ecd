"""The peer: Hugging Face transformers on the same checkpoint file, dtype, device and thread count.

Three ways of running it:
- `generate`: `model.generate(do_sample=False, max_new_tokens=n)`, what most users call; per-token times come from
  a StoppingCriteria, which generate calls once per step right after the new token is appended (so it measures
  the same moment as a streamer would, and works for batches too).
- `forward_loop`: a hand-written greedy loop over `model(...)` with a DynamicCache: the model's own speed without
  generate's per-step machinery (single stream only).
- batched: one left-padded `generate` over all requests (static batching: every row pays for the longest prompt,
  and no row can leave early).

EOS is disabled in the model's generation config: the same as the engine's `ignore_eos`. `min_new_tokens=n` would
also force n tokens, but by masking EOS logits, which changes the greedy token wherever EOS is the argmax; ours
would then not be doing the same work, and the token-equality check would fail for a reason unrelated to speed.
"""

from __future__ import annotations

import inspect
import math
import tempfile
from typing import TYPE_CHECKING
from pathlib import Path

import torch

from benchmarks.measure import Clock, ConcurrentResult, StreamResult

if TYPE_CHECKING:
    from model.config import ModelConfig


def load_hf(path: Path, dtype: torch.dtype, device: torch.device | str):
    """A GGUF file (transformers dequantizes it, as our loader does) or an HF directory -> eval model on device."""
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        # transformers reads a GGUF as `gguf_file=` inside a directory; link the file into a throwaway one.
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / path.name).symlink_to(path.resolve())
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=path.name, dtype=dtype)
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos; see the module docstring
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = 0  # any id: left padding is masked out by the attention mask
    return model


def _mark_each_token(clock: Clock):
    """A StoppingCriteria that marks the clock each time generate has appended a token; it never stops anything."""
    from transformers import StoppingCriteria

    class MarkEachToken(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            clock.mark()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # (B,)

    return MarkEachToken()


def _generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_tokens: int, clock: Clock):
    from transformers import StoppingCriteriaList

    criteria = StoppingCriteriaList([_mark_each_token(clock)])
    clock.start()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=max_tokens,
            stopping_criteria=criteria,
        )
    clock.mark()  # generate has returned: the end of the request as its caller sees it
    times = clock.times()
    return out[:, input_ids.shape[1]:].tolist(), times[:-1], times[-1]  # (B, n), token times, end


def generate_single(model, prompt: list[int], max_tokens: int, clock: Clock) -> StreamResult:
    ids = torch.tensor([prompt], device=model.device)  # (1, P)
    tokens, times, _ = _generate(model, ids, torch.ones_like(ids), max_tokens, clock)
    return StreamResult.from_token_times(tokens[0], times)


def forward_loop(model, prompt: list[int], max_tokens: int, clock: Clock) -> StreamResult:
    """Greedy with transformers' own KV cache and nothing else around the forward."""
    from transformers import DynamicCache

    # The cache argument is `cache` from transformers 5.x on, `past_key_values` before; DynamicCache fills in place.
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache()
    tokens: list[int] = []
    clock.start()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt], device=model.device), use_cache=True, **{kw: cache}).logits
        for _ in range(max_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
            tokens.append(int(nxt))  # a host sync on CUDA, as the engine's sampler has too
            clock.mark()
            if len(tokens) < max_tokens:
                logits = model(nxt, use_cache=True, **{kw: cache}).logits
    return StreamResult.from_token_times(tokens, clock.times())


def run_batched(model, prompts: list[list[int]], max_tokens: int, clock: Clock) -> ConcurrentResult:
    """All requests in one left-padded generate; every row's first token comes with the same (whole-batch)
    prefill, and every row finishes when generate returns."""
    B, width = len(prompts), max(len(p) for p in prompts)
    pad = model.generation_config.pad_token_id
    ids = torch.full((B, width), pad, dtype=torch.long)  # (B, L)
    mask = torch.zeros((B, width), dtype=torch.long)  # (B, L)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    tokens, times, end = _generate(model, ids.to(model.device), mask.to(model.device), max_tokens, clock)
    return ConcurrentResult(
        ttft_s=[times[0]] * B, latency_s=[end] * B, num_output_tokens=B * max_tokens, wall_s=end, token_ids=tokens,
        notes={"method": f"one generate over all {B} prompts, left-padded to {width} tokens"},
    )


def run_sequential(model, prompts: list[list[int]], max_tokens: int, clock: Clock,
                   max_measured: int | None = None) -> ConcurrentResult:
    """One generate per request, in submission order: request i waits for all earlier ones, so its TTFT counts
    their whole run time plus its own prefill.

    To bound the run time, only `max_measured` requests may be run: chosen evenly over the prompt-length range,
    each one's own TTFT and duration are fitted by a straight line in prompt length (prefill grows with it,
    decode does not) and the line predicts the requests not run. The queue is then replayed in order.
    """
    n = len(prompts)
    k = n if not max_measured or max_measured >= n else max(2, max_measured)
    by_len = sorted(range(n), key=lambda i: len(prompts[i]))
    chosen = sorted({by_len[round(j * (n - 1) / max(1, k - 1))] for j in range(k)}) if k < n else list(range(n))
    own_ttft: dict[int, float] = {}
    duration: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    for i in chosen:
        ids = torch.tensor([prompts[i]], device=model.device)
        toks, times, end = _generate(model, ids, torch.ones_like(ids), max_tokens, clock)
        own_ttft[i], duration[i], tokens[i] = times[0], end, toks[0]
    if len(chosen) < n:
        lens = [len(prompts[i]) for i in chosen]
        fit_ttft = _line(lens, [own_ttft[i] for i in chosen])
        fit_dur = _line(lens, [duration[i] for i in chosen])
        for i in set(range(n)) - set(chosen):
            own_ttft[i], duration[i] = fit_ttft(len(prompts[i])), fit_dur(len(prompts[i]))
    ttft, latency, t = [], [], 0.0
    for i in range(n):  # replay the queue: request i starts when request i - 1 ends
        ttft.append(t + own_ttft[i])
        t += duration[i]
        latency.append(t)
    notes = {"method": "one generate per request, in order; later requests wait for earlier ones",
             "measured_requests": len(chosen), "extrapolated": len(chosen) < n}
    if len(chosen) < n:
        notes["extrapolation"] = (f"{len(chosen)} of {n} requests run (spread over prompt lengths); the rest's TTFT "
                                  "and duration from a least-squares line in prompt length")
    return ConcurrentResult(ttft, latency, n * max_tokens, t,
                            token_ids=[tokens[i] for i in range(n)] if len(chosen) == n else None, notes=notes)


def _line(xs: list[int], ys: list[float]):
    """Least-squares y = a + b x; a constant when the xs do not vary."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return lambda x: max(0.0, my + b * (x - mx)) if math.isfinite(b) else my


def warm_up(model) -> None:
    """As the engine's warm-up: a short single and batched generate, so one-time costs stay out of the timings."""
    g = torch.Generator().manual_seed(12345)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (24, 40)]
    clock = Clock(model.device)
    generate_single(model, prompts[0], 4, clock)
    forward_loop(model, prompts[0], 4, clock)
    run_batched(model, prompts, 4, clock)


def random_twin(config: "ModelConfig", dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A random-weight HF LlamaForCausalLM of `config`'s shape and our Transformer over the same tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from model.loaders.assemble import ModelAssembler
    from model.loaders.hf import hf_to_ours

    hf_cfg = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta,
        tie_word_embeddings=config.tie_embeddings,
    )
    with torch.device("meta"):
        hf = LlamaForCausalLM(hf_cfg).to(dtype)
    hf = hf.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.fill_(1.0) if p.ndim == 1 else p.normal_(0, 0.02, generator=g)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg).to(device)  # to_empty left its inv_freq buffer empty
    hf.tie_weights()  # to_empty gave the tied head its own (separately initialized) storage
    hf = hf.eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    asm = ModelAssembler(config, "random weights", dtype, device, "assemble")
    for name, t in hf.state_dict().items():
        ours_name = hf_to_ours(name)
        if ours_name is not None and ours_name in asm.expected:
            asm.add(ours_name, t, name)
    return hf, asm.finish()
