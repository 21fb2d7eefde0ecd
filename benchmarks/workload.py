"""The requests every side runs: the same token ids, handed to each side as ids (no tokenizer differences).

- single stream: real text (a built-in paragraph, tokenized with the checkpoint's tokenizer and repeated to the
  prompt length), so greedy decoding is confident and ours-vs-HF token equality is a meaningful check;
- concurrent: random token ids from a seeded generator, lengths uniform in [min, max]. Random ids share no
  prefix, so the engine's prefix cache cannot serve any of them (the run reports its hit count to show it) and
  every side does the same prefill work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Decode settings the per-setting benchmarks (bench_decode, perplexity) compare: name -> (dtype of embeddings,
# activations and KV cache; weight quantization). "int8-bf16": int8 weights with bfloat16 activations in decode.
SETTINGS: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, "none"),
    "bfloat16": (torch.bfloat16, "none"),
    "int8": (torch.float32, "int8"),
    "int8-bf16": (torch.bfloat16, "int8"),
    "int4": (torch.float32, "int4"),
}

PARAGRAPH = (
    "The lighthouse stood at the end of a long stone pier, and every evening the keeper climbed its spiral stairs "
    "to light the lamp. Ships passing in the dark relied on its steady beam to find the harbour entrance, and the "
    "fishermen of the town said they could tell the hour by the rhythm of its turning. In winter the storms came "
    "in from the west, throwing spray over the lantern room, but the light never failed. "
)


@dataclass
class WorkloadSizes:
    single_prompt_len: int = 128
    single_max_tokens: int = 128
    num_requests: int = 32
    min_prompt_len: int = 32
    max_prompt_len: int = 512
    max_tokens: int = 128
    seed: int = 0

    @classmethod
    def quick(cls) -> WorkloadSizes:
        return cls(single_prompt_len=16, single_max_tokens=16, num_requests=4, min_prompt_len=8, max_prompt_len=32,
                   max_tokens=8)

    def validate(self) -> None:
        if min(self.single_prompt_len, self.single_max_tokens, self.num_requests, self.min_prompt_len,
               self.max_tokens) < 1:
            raise ValueError("every workload size must be >= 1")
        if self.max_prompt_len < self.min_prompt_len:
            raise ValueError(f"max prompt length {self.max_prompt_len} < min prompt length {self.min_prompt_len}")


@dataclass
class Workload:
    sizes: WorkloadSizes
    single_prompt: list[int]  # (single_prompt_len,)
    prompts: list[list[int]]  # (num_requests, len_i)

    def describe(self) -> dict:
        s = self.sizes
        lens = [len(p) for p in self.prompts]
        return {
            "single_stream": {"prompt_tokens": s.single_prompt_len, "new_tokens": s.single_max_tokens,
                              "prompt": "built-in English paragraph, repeated", "decoding": "greedy, EOS ignored"},
            "concurrent": {"num_requests": s.num_requests, "prompt_len_range": [s.min_prompt_len, s.max_prompt_len],
                           "prompt_lens": lens, "prompt_tokens_total": sum(lens), "new_tokens": s.max_tokens,
                           "prompt": f"random token ids, seed {s.seed}", "decoding": "greedy, EOS ignored",
                           "arrival": "all submitted at t=0"},
        }


def make_workload(tokenizer, vocab_size: int, sizes: WorkloadSizes) -> Workload:
    sizes.validate()
    reps = -(-sizes.single_prompt_len // len(tokenizer.encode(PARAGRAPH, add_bos=False)))
    single = tokenizer.encode(PARAGRAPH * reps)[: sizes.single_prompt_len]  # BOS, if the checkpoint adds one
    g = torch.Generator().manual_seed(sizes.seed)
    lens = torch.randint(sizes.min_prompt_len, sizes.max_prompt_len + 1, (sizes.num_requests,), generator=g)
    prompts = [torch.randint(0, vocab_size, (int(n),), generator=g).tolist() for n in lens]
    return Workload(sizes, single, prompts)
