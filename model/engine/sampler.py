"""Batched sampler: one call turns the last-position logits of every scheduled sequence into its next token.

Order of operations, as in vLLM v1 (`vllm/v1/sample/sampler.py`, `ops/penalties.py`, `ops/topk_topp_sampler.py`):
    0. masks           done before this call: the rows a per-row feature constrains come with -inf at the tokens
                       it forbids (`Part.mask_logits`, model/features/protocol.py; vLLM applies its bitmask to the
                       logits before its sampler too), so everything below, logprobs included, sees the masked logits.
    1. logprobs        log_softmax of the RAW model logits (vLLM's default `logprobs_mode`): what the model
                       believed, not what the processed distribution was; the processed one would report -inf
                       for every token top-k/top-p removed and change with temperature.
    2. logit_bias      added to the logits (OpenAI API reference, `logit_bias`: -100..100).
    3. min_tokens      stop ids (EOS + stop_token_ids, chosen by the engine) -> -inf while the output is shorter.
    4. penalties       repetition (CTRL, Keskar et al. 2019, "CTRL: A Conditional Transformer Language Model for
                       Controllable Generation", sec. 4.1; prompt + output tokens, HF/vLLM sign rule), then
                       frequency and presence (OpenAI API reference, "Frequency and presence penalties":
                       logit -= count * frequency_penalty + (count > 0) * presence_penalty; output tokens only).
    5. greedy rows     argmax here; nothing below touches them.
    6. temperature     logits / T.
    7. top-k, top-p    one descending sort for the whole batch; top-p (Holtzman et al. 2020, "The Curious Case
                       of Neural Text Degeneration") keeps the smallest head whose mass reaches p, measured on
                       the top-k-renormalised distribution, as HF and vLLM do.
       min-p           drop tokens with prob < min_p * max prob (Nguyen et al. 2024, "Turning Up the Heat:
                       Min-p Sampling for Creative and Coherent LLM Outputs").
    8. sample          exponential race: argmax(p_i / q_i), q_i ~ Exp(1) i.i.d., equal in law to Gumbel-max and
                       to multinomial, without a cumsum; the noise of a seeded row comes from its own generator.

All arithmetic is float32 with -inf masks. Per-row Python work only builds the small parameter tensors and draws
seeded rows' noise; no loop ever runs over tokens or vocabulary entries.

Nothing left to sample: a row whose processed logits have no finite maximum (every token masked, e.g. min_tokens
with every id a stop id, or non-finite model logits) takes the argmax of its raw logits (NaN read as -inf)
instead of raising: one bad row must not fail the step of every other request in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from torch import Tensor

from model.engine.sampling_params import SamplingParams
from model.kernels import ops

_NEG_INF = float("-inf")


def _put(values, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small host list as a tensor on `device`: on a GPU through pinned memory and a non-blocking copy, so the host
    never waits for the device to take it (a plain `torch.tensor(..., device=cuda)` copies from pageable memory and
    blocks until the copy is done)."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


@dataclass
class SamplingRow:
    """One sequence's view for this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None  # required when params.seed is not None
    stop_ids: frozenset[int] = frozenset()  # EOS ids (unless ignore_eos) + stop_token_ids


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely; ties count against the token (vLLM: number of tokens with logprob >= its own)
    top: list[tuple[int, float]]  # top-k (id, logprob), most likely first
    scored: list[float] | None = None  # the logprobs of params.score_token_ids, in their order (activation patching)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # (B,)
    logprobs: list[TokenLogprobs | None]  # per row; None where params.logprobs is None


class _BatchParams:
    """Per-row parameters as (B,) tensors, built once per call, plus flags that let a step skip unused work."""

    def __init__(self, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> None:
        ps = [r.params for r in rows]
        self.greedy = [p.greedy for p in ps]
        self.all_greedy = all(self.greedy)
        # Greedy rows get neutral values so one batched op can run over every row.
        floats = [
            (1.0, 1.0, 0.0, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
            if g
            else (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
            for p, g in zip(ps, self.greedy)
        ]
        f = _put(floats, torch.float32, device).reshape(len(ps), 6)  # (B, 6): one copy
        self.temperature, self.top_p, self.min_p, self.repetition, self.presence, self.frequency = f.unbind(1)
        ks = [vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size) for p, g in zip(ps, self.greedy)]
        self.top_k = _put(ks, torch.long, device)  # (B,)
        self.any_top_k = any(k < vocab_size for k in ks)
        self.max_top_k = max((k for k in ks if k < vocab_size), default=1)
        self.any_top_p = any(p.top_p < 1.0 and not g for p, g in zip(ps, self.greedy))
        self.any_min_p = any(p.min_p > 0.0 and not g for p, g in zip(ps, self.greedy))
        self.uses_repetition = [p.repetition_penalty != 1.0 for p in ps]
        self.uses_penalty = [
            r or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p, r in zip(ps, self.uses_repetition)
        ]
        self.any_bias = any(p.logit_bias for p in ps)
        self.min_tokens_rows = [
            i for i, r in enumerate(rows) if r.stop_ids and len(r.output_token_ids) < r.params.min_tokens
        ]
        self.seeded = [i for i, (p, g) in enumerate(zip(ps, self.greedy)) if p.seed is not None and not g]
        for i in self.seeded:
            if rows[i].generator is None:
                raise ValueError(f"row {i} has seed={ps[i].seed} but no generator; create it once per sequence "
                                 "with SamplingParams.make_generator(device)")


def _plain_greedy(row: SamplingRow) -> bool:
    """A greedy row that no processing step would change and that wants no logprobs."""
    p = row.params
    return (p.greedy and p.logprobs is None and not p.logit_bias and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and not (row.stop_ids and len(row.output_token_ids) < p.min_tokens))


def _pad_ids(seqs: list[Sequence[int]], pad: int, device: torch.device) -> Tensor:
    """Ragged id lists -> (B, L) long, padded with `pad` (the vocabulary size: a bin that is dropped)."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)  # (B,)
    width = int(lengths.max()) if len(seqs) else 0
    flat = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long)  # (sum L_b,)
    padded = torch.full((len(seqs), width), pad, dtype=torch.long)  # (B, L)
    padded[torch.arange(width) < lengths.unsqueeze(1)] = flat
    return padded if device.type == "cpu" else padded.pin_memory().to(device, non_blocking=True)


def _bin_counts(ids: Tensor, vocab_size: int) -> Tensor:
    """(B, L) padded ids -> (B, V) float32 occurrence counts (scatter_add, as vLLM's get_token_bin_counts_and_mask)."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)  # (B, V + 1)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=ids.device))
    return counts[:, :vocab_size]


def _apply_top_k_top_p(x: Tensor, bp: _BatchParams) -> Tensor:
    """x (B, V), in place: tokens outside each row's top-k, then top-p, set to -inf.

    Each filter becomes a per-row threshold value, and x is masked where it falls below it: no scatter back from
    sorted order, and tokens tied with the last one kept are kept too (top-k does so in vLLM), so the kept set
    never depends on how a sort orders equal values."""
    B, V = x.shape
    off = torch.full((B, 1), _NEG_INF, device=x.device)  # (B, 1): the threshold of a row with the filter off
    if not bp.any_top_p:  # top-k alone: the k-th largest from topk(max k), not a full sort (vLLM's apply_top_k_only)
        on = (bp.top_k < V).unsqueeze(1)  # (B, 1)
        k = torch.where(on, bp.top_k.unsqueeze(1), 1)  # (B, 1)
        kth = x.topk(bp.max_top_k, dim=-1).values.gather(1, k - 1)  # (B, 1)
        return x.masked_fill_(x < torch.where(on, kth, off), _NEG_INF)
    xs = x.sort(dim=-1, descending=True).values  # (B, V): the one sort for the batch
    thresh = xs.gather(1, (bp.top_k - 1).unsqueeze(1)) if bp.any_top_k else off  # (B, 1); k = V when off
    xs.masked_fill_(xs < thresh, _NEG_INF)
    probs = xs.softmax(dim=-1)  # (B, V), descending, renormalised over the top-k
    # Mass of the strictly more likely tokens (exclusive cumsum, monotone): keep a token while it is below p, so the
    # head kept is the smallest whose mass reaches p. Rows at p = 1 are left alone, since a float32 cumsum can reach
    # 1.0 before the tail and would cut tokens of tiny but nonzero probability.
    mass_before = torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))  # (B, V)
    # (B, 1), >= 1: a p > 0 too small for float32 (1e-300) rounds to 0 here, and keeps the top token like any tiny p
    n_keep = (mass_before < bp.top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(min=1)
    # The max: with p just below 1, the float32 mass of the top-k can stay under p and n_keep run into the -inf tail.
    top_p_thresh = torch.maximum(xs.gather(1, n_keep - 1), thresh)  # (B, 1)
    thresh = torch.where((bp.top_p < 1.0).unsqueeze(1), top_p_thresh, thresh)  # (B, 1)
    return x.masked_fill_(x < thresh, _NEG_INF)


def _token_logprobs(logprobs: Tensor, token_ids: Tensor, ks: Sequence[int]) -> list[TokenLogprobs]:
    """logprobs (N, V), token_ids (N,), ks: alternatives per row -> one TokenLogprobs per row."""
    return _LogprobTensors.of(logprobs, token_ids, ks).read(token_ids.tolist())


@dataclass
class _LogprobTensors:
    """The logprobs of some rows where they were computed (the logits' device): the chosen token's, its rank and
    the top alternatives; `scored` the raw logprobs of named tokens, flat (per row the params' score_token_ids)."""

    ks: list[int]  # alternatives per row
    chosen: Tensor  # (N,) float32
    ranks: Tensor  # (N,) int64
    top_v: Tensor  # (N, max k) float32
    top_i: Tensor  # (N, max k) int64
    scored: Tensor | None = None  # (sum of the rows' score ids,) float32
    score_counts: list[int] | None = None

    @classmethod
    def of(cls, logprobs: Tensor, token_ids: Tensor, ks: Sequence[int]) -> "_LogprobTensors":
        chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # (N, 1)
        ranks = (logprobs >= chosen).sum(dim=-1)  # (N,): ties count against the token
        kmax = max(ks, default=0)
        top_v, top_i = logprobs.topk(kmax, dim=-1) if kmax else (logprobs[:, :0], token_ids[:, None][:, :0])
        return cls(list(ks), chosen.squeeze(1), ranks, top_v, top_i)

    def parts(self) -> list[Tensor]:
        """Every value as int64, for one packed copy (float32 bits carried in the low 32 bits)."""
        floats = [self.chosen, self.top_v.flatten()] + ([self.scored] if self.scored is not None else [])
        return [self.ranks, self.top_i.flatten(), torch.cat(floats).contiguous().view(torch.int32).long()]

    def size(self) -> int:
        n, k = self.top_v.shape
        return n + n * k + n + n * k + (self.scored.numel() if self.scored is not None else 0)

    def unpack(self, packed: np.ndarray, token_ids: list[int]) -> list[TokenLogprobs]:
        """`packed`: what `parts` gave, read back on the host (int64)."""
        n, k = self.top_v.shape
        ranks = packed[:n]
        top_i = packed[n : n + n * k].reshape(n, k)
        floats = packed[n + n * k :].astype(np.int32).view(np.float32)
        return self._build(token_ids, floats[:n].tolist(), ranks.tolist(), floats[n : n + n * k].reshape(n, k).tolist(),
                           top_i.tolist(), floats[n + n * k :])

    def read(self, token_ids: list[int]) -> list[TokenLogprobs]:
        """The same, read with ordinary copies (the caller syncs anyway)."""
        scored = self.scored.cpu().numpy() if self.scored is not None else None
        return self._build(token_ids, self.chosen.tolist(), self.ranks.tolist(), self.top_v.tolist(),
                           self.top_i.tolist(), scored)

    def _build(self, token_ids, chosen, ranks, tv, ti, scored) -> list[TokenLogprobs]:
        out = [TokenLogprobs(tok, lp, rank, list(zip(ti[j][:k], tv[j][:k])))
               for j, (tok, lp, rank, k) in enumerate(zip(token_ids, chosen, ranks, self.ks))]
        if self.score_counts is not None:
            at = 0
            for tl, c in zip(out, self.score_counts):
                if c:
                    tl.scored = scored[at : at + c].tolist()
                at += c
        return out


@dataclass
class SampledTensors:
    """One sampling call's results on the logits' device, nothing read back yet: each row's token, and the logprobs
    of the rows that asked (`lp_rows`). `pack` puts everything in one int64 tensor, so a step reads its results with
    one asynchronous copy (model/engine/model_runner.py); `unpack` turns that copy into the `SamplerOutput`."""

    tokens: Tensor  # (B,) int64
    lp_rows: list[int]
    logprobs: _LogprobTensors | None = None

    def pack(self) -> Tensor:  # (P,) int64
        if self.logprobs is None:
            return self.tokens
        return torch.cat([self.tokens, *self.logprobs.parts()])

    @property
    def packed_size(self) -> int:
        return self.tokens.numel() + (self.logprobs.size() if self.logprobs is not None else 0)

    def unpack(self, packed: np.ndarray) -> SamplerOutput:
        """`packed`: `pack()`'s values on the host."""
        B = self.tokens.numel()
        token_ids = packed[:B].tolist()
        out: list[TokenLogprobs | None] = [None] * B
        if self.logprobs is not None:
            for i, tl in zip(self.lp_rows, self.logprobs.unpack(packed[B:], [token_ids[i] for i in self.lp_rows])):
                out[i] = tl
        return SamplerOutput(token_ids=token_ids, logprobs=out)

    def read(self) -> SamplerOutput:
        """Read back now, with one blocking copy."""
        return self.unpack(self.pack().cpu().numpy())


@torch.no_grad()
def prompt_logprobs(logits: Tensor, next_token_ids: Tensor, k: int) -> list[TokenLogprobs]:
    """Logprobs of the prompt (echo): logits (T, V) at positions 0..T-1, next_token_ids (T,) the tokens 1..T they
    predict; raw log_softmax as for generated tokens, with top-k alternatives per position."""
    if logits.dim() != 2 or next_token_ids.shape != logits.shape[:1]:
        raise ValueError(f"need logits (T, V) and next_token_ids (T,), got {tuple(logits.shape)} "
                         f"and {tuple(next_token_ids.shape)}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    lp = torch.log_softmax(logits.float(), dim=-1)  # (T, V)
    return _token_logprobs(lp, next_token_ids.to(lp.device, torch.long), [k] * logits.shape[0])


def replay_noise(generator: torch.Generator, params: SamplingParams, vocab_size: int, num_rows: int) -> None:
    """Advance a seeded sequence's generator as `num_rows` sampled rows of it would (`Sampler._sample` draws one
    (V,) uniform vector per seeded, non-greedy row). Speculative decoding restores the generator to its state before
    a drafting step and replays the rows it kept, so that a seeded request draws the same noise for each token as it
    would decoding one token at a time, whatever was drafted."""
    if params.seed is None or params.greedy:
        return
    u = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(num_rows):
        u.uniform_(generator=generator)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", sync_free: bool = False) -> None:
        """`sync_free`: never read a tensor back to decide anything (the engine's overlapped steps on a device,
        where such a read would wait for the device to finish the step)."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.sync_free = sync_free

    @torch.no_grad()
    def __call__(self, logits: Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """logits (B, V) of any float dtype, one row per sequence (masked where a feature constrains it: step 0
        above) -> next token and optional logprobs per row."""
        return self.sample(logits, rows).read()

    @torch.no_grad()
    def sample(self, logits: Tensor, rows: Sequence[SamplingRow] | None,
               plain_greedy: bool | None = None) -> SampledTensors:
        """`__call__` without reading the results back: they stay on the logits' device. With `sync_free` (the
        engine's overlapped steps) nothing here waits for the device; `plain_greedy`: every row is known to be
        `_plain_greedy` (None: checked here); then `rows` may be None, as nothing of them is read."""
        assert rows is not None or plain_greedy, "rows are read unless every row is plain greedy"
        self._check(logits, rows if rows is not None else range(logits.shape[0]))
        if plain_greedy or (plain_greedy is None and all(_plain_greedy(r) for r in rows)):
            return SampledTensors(ops.greedy_pick(logits), [])  # (B,): argmax of the raw logits, no copy
        bp = _BatchParams(rows, self.vocab_size, logits.device)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        at = _put(want, torch.long, logits.device) if want and len(want) < len(rows) else None  # (B_lp,)
        # (B_lp, V), before anything
        raw_lp = torch.log_softmax((logits if at is None else logits[at]).float(), dim=-1) if want else None

        x = self._process(logits, rows, bp)  # (B, V) float32
        tokens = self._sample(x, rows, bp)  # (B,)
        no_choice = ~torch.isfinite(x.amax(dim=-1))  # (B,): nothing left to sample: the raw logits' argmax
        if self.sync_free or bool(no_choice.any()):  # (on a device, computed rather than asked: no sync)
            tokens = torch.where(no_choice, ops.greedy_pick(logits.float()), tokens)

        lp = None
        if raw_lp is not None:
            lp = _LogprobTensors.of(raw_lp, tokens if at is None else tokens[at], [rows[i].params.logprobs for i in want])
            counts = [len(rows[i].params.score_token_ids) for i in want]
            if any(counts):  # raw logprobs of named tokens (model/probes/patching.py's metric)
                ids = [t for i in want for t in rows[i].params.score_token_ids]
                at = [j for j, c in enumerate(counts) for _ in range(c)]
                lp.scored = raw_lp[_put(at, torch.long, raw_lp.device), _put(ids, torch.long, raw_lp.device)]
                lp.score_counts = counts
        return SampledTensors(tokens, want, lp)

    @torch.no_grad()
    def process(self, logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
        """The logits the draw sees: (B, V) float32, -inf where masked; greedy rows stop after the penalties
        (unscaled, no top-*). Exposed for tests; the input is never modified."""
        self._check(logits, rows)
        return self._process(logits, rows, _BatchParams(rows, self.vocab_size, logits.device))

    def _check(self, logits: Tensor, rows: Sequence[SamplingRow]) -> None:
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be (B={len(rows)}, V={self.vocab_size}), got {tuple(logits.shape)}")
        if not logits.is_floating_point():
            raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
        if logits.device.type != self.device.type:  # seeded rows' generators are made for the sampler's device
            raise ValueError(f"logits are on {logits.device}, the sampler on {self.device}")

    def _process(self, logits: Tensor, rows: Sequence[SamplingRow], bp: _BatchParams) -> Tensor:
        # (B, V): a private copy, worked on in place (on CPU every fresh (B, V) temporary costs page faults),
        # so the caller's raw logits stay raw
        x = logits.to(torch.float32, copy=True)
        dev = x.device
        if bp.any_bias:
            r, t, v = [], [], []
            for i, row in enumerate(rows):
                if row.params.logit_bias:
                    r += [i] * len(row.params.logit_bias)
                    t += row.params.logit_bias.keys()
                    v += row.params.logit_bias.values()
            idx = (_put(r, torch.long, dev), _put(t, torch.long, dev))  # (N,), (N,)
            x.index_put_(idx, _put(v, torch.float32, dev), accumulate=True)
        if bp.min_tokens_rows:
            r = list(chain.from_iterable([i] * len(rows[i].stop_ids) for i in bp.min_tokens_rows))
            t = list(chain.from_iterable(rows[i].stop_ids for i in bp.min_tokens_rows))
            x[_put(r, torch.long, dev), _put(t, torch.long, dev)] = _NEG_INF
        if any(bp.uses_penalty):
            x = self._apply_penalties(x, rows, bp)
        if bp.all_greedy:
            return x
        x.div_(bp.temperature.unsqueeze(1))  # greedy rows divide by 1
        if bp.any_top_k or bp.any_top_p:
            _apply_top_k_top_p(x, bp)
        if bp.any_min_p:
            probs = x.softmax(dim=-1)  # (B, V); the ratio test is the same before or after renormalising
            x.masked_fill_(probs < bp.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), _NEG_INF)
        return x

    def _apply_penalties(self, x: Tensor, rows: Sequence[SamplingRow], bp: _BatchParams) -> Tensor:
        """As vLLM's apply_penalties. Rows without penalties count nothing (empty id lists): their neutral values
        (1, 0, 0) leave them unchanged whatever the counts."""
        V = self.vocab_size
        out_ids = _pad_ids([r.output_token_ids if u else () for r, u in zip(rows, bp.uses_penalty)], V, x.device)
        out_counts = _bin_counts(out_ids, V)  # (B, V)
        out_seen = out_counts > 0  # (B, V)
        if any(bp.uses_repetition):
            pr_ids = _pad_ids([r.prompt_token_ids if u else () for r, u in zip(rows, bp.uses_repetition)], V, x.device)
            seen = out_seen | (_bin_counts(pr_ids, V) > 0)  # (B, V)
            rep = torch.where(seen, bp.repetition.unsqueeze(1), 1.0)  # (B, V)
            # CTRL divides the logit by the penalty; HF/vLLM multiply negative logits instead so a penalty > 1
            # always lowers the token's probability.
            x = torch.where(x > 0, x / rep, x * rep)
        x -= bp.frequency.unsqueeze(1) * out_counts
        x -= bp.presence.unsqueeze(1) * out_seen
        return x

    def _sample(self, x: Tensor, rows: Sequence[SamplingRow], bp: _BatchParams) -> Tensor:
        """x (B, V) processed logits -> (B,) long token ids."""
        if bp.all_greedy:
            return x.argmax(dim=-1)
        probs = x.softmax(dim=-1)  # (B, V)
        u = torch.empty_like(probs).uniform_()  # (B, V) ~ U[0, 1): torch's default generator, one call
        for i in bp.seeded:  # a seeded row's noise depends only on its own generator, whatever its neighbours
            u[i].uniform_(generator=rows[i].generator)
        # q = -log(u) ~ Exp(1) (inverse CDF), cheaper on CPU than exponential_. u = 0 gives q = inf, a score of 0;
        # the clamp guards q = 0 (a backend returning u = 1), where a masked token would score 0/0 = NaN, which
        # argmax prefers.
        q = u.log_().neg_().clamp_min_(torch.finfo(torch.float32).tiny)  # (B, V)
        tokens = probs.div_(q).argmax(dim=-1)  # (B,)
        if any(bp.greedy):
            greedy = _put(bp.greedy, torch.bool, x.device)  # (B,)
            tokens = torch.where(greedy, x.argmax(dim=-1), tokens)
        return tokens
