"""`EngineSizes`: an engine's sizes once resolved against its model and its KV pool (`Engine.__init__`), handed
whole to what is built over them (the runner's buffers, a speculator's draft model and its pool) instead of one
argument each."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSizes:
    num_blocks: int  # KV blocks the manager hands out (a draft model's pool holds as many)
    block_size: int  # tokens a block
    max_num_seqs: int  # rows a step
    max_num_batched_tokens: int  # tokens a step
    max_model_len: int  # prompt + max_tokens: the model's context clamped to the pool (resolve_max_model_len)
    max_logprobs: int = 20  # alternatives a row may ask a token: the width of the host copy of a step's samples

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)
