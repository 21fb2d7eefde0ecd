"""N-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM's `ngram` method, vllm/v1/spec_decode/
ngram_proposer.py): the sequence's last n tokens are looked up in its earlier tokens, longest n first, and the tokens
that followed the most recent earlier occurrence are the drafts. Free to propose (no model runs), and right wherever
the output copies its input: summaries, edits, extraction, code."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from model.engine.request import Sequence


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self._tokens: dict[Sequence, np.ndarray] = {}  # each sequence's prompt + output so far (grown in place)
        self._lens: dict[Sequence, int] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = self._history(seq)
        return lookup(tokens, k, self.lookup_min, self.lookup_max)

    def release(self, seq: Sequence) -> None:
        self._tokens.pop(seq, None)
        self._lens.pop(seq, None)

    def _history(self, seq: Sequence) -> np.ndarray:
        """seq's prompt + output as an int array, appending only what is new since the last call."""
        n = seq.num_prompt_tokens + len(seq.output_token_ids)
        buf, have = self._tokens.get(seq), self._lens.get(seq, 0)
        if buf is None or len(buf) < n:
            grown = np.empty(max(2 * n, 64), dtype=np.int64)
            if buf is not None:
                grown[:have] = buf[:have]
            buf = self._tokens[seq] = grown
        if have < n:
            buf[have:n] = seq.token_ids(have, n)
            self._lens[seq] = n
        return buf[:n]


def lookup(tokens: np.ndarray, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """tokens (L,) -> up to k tokens that followed the latest earlier occurrence of tokens' longest suffix n-gram
    (lookup_max >= n >= lookup_min); [] when no suffix of those lengths occurred before."""
    L = len(tokens)
    for n in range(min(lookup_max, L - 1), lookup_min - 1, -1):
        windows = sliding_window_view(tokens[: L - 1], n)  # (L - n, n): every earlier n-gram with a token after it
        hits = np.flatnonzero((windows == tokens[L - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
