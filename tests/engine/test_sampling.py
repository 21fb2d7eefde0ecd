"""The batched sampler against a per-row, loop-based reference; draws against their distribution; seeded rows
reproducible whatever their batch neighbours; logprobs from the raw logits; validation of every field."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from model.engine.sampler import Sampler, SamplingRow, prompt_logprobs

from model.engine.sampling_params import SamplingParams

V = 64
INF = float("inf")


def make_row(params: SamplingParams, prompt=(), output=(), stop_ids=(), device="cpu") -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), params.make_generator(device), frozenset(stop_ids))


def reference_process(logits: torch.Tensor, rows) -> torch.Tensor:
    """One row at a time, token by token: the definitions, not the batched code. Values in float32 (penalties and
    temperatures in the tests are dyadic, so both sides round identically); top-p and min-p probabilities in
    float64, so the masks are checked against an independent computation."""
    out, v = [], logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        x = logits[i].float().clone()
        for tok, bias in (p.logit_bias or {}).items():
            x[tok] = x[tok] + bias
        if len(row.output_token_ids) < p.min_tokens:
            for tok in row.stop_ids:
                x[tok] = -INF
        seen = set(row.prompt_token_ids) | set(row.output_token_ids)
        counts = Counter(row.output_token_ids)
        for tok in range(v):
            if tok in seen:
                x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
            if counts[tok]:
                x[tok] = x[tok] - p.frequency_penalty * counts[tok] - p.presence_penalty
        if p.temperature == 0:
            out.append(x)
            continue
        x = x / p.temperature
        if p.top_k > 0:
            kth = sorted(x.tolist(), reverse=True)[min(p.top_k, v) - 1]
            x = torch.where(x >= kth, x, -INF)
        if p.top_p < 1:
            probs = torch.softmax(x.double(), -1).tolist()
            mass, keep = 0.0, set()
            for tok in sorted(range(v), key=lambda t: -probs[t]):
                keep.add(tok)
                mass += probs[tok]
                if mass >= p.top_p:
                    break
            x = torch.tensor([v if t in keep else -INF for t, v in enumerate(x.tolist())])
        if p.min_p > 0:
            probs = torch.softmax(x.double(), -1).tolist()
            x = torch.tensor([v if probs[t] >= p.min_p * max(probs) else -INF for t, v in enumerate(x.tolist())])
        out.append(x)
    return torch.stack(out)


def random_rows(rng: random.Random, n: int, **fixed) -> list[SamplingRow]:
    """Rows with random histories; `fixed` maps a field to a list of values drawn per row."""
    rows = []
    for _ in range(n):
        kw = {k: rng.choice(vs) for k, vs in fixed.items()}
        if kw.pop("bias", False):
            kw["logit_bias"] = {rng.randrange(V): rng.choice([-100.0, -2.5, 0.75, 3.0, 100.0]) for _ in range(5)}
        prompt = [rng.randrange(V) for _ in range(rng.randrange(0, 12))]
        output = [rng.randrange(V // 2) for _ in range(rng.randrange(0, 20))]  # repeats, so counts above 1
        stop = {rng.randrange(V) for _ in range(3)}
        rows.append(make_row(SamplingParams(**kw), prompt, output, stop))
    return rows


CASES = {
    "logit_bias": dict(bias=[True, False], temperature=[0.0, 1.0]),
    "repetition": dict(repetition_penalty=[1.0, 1.25, 2.0, 0.5], temperature=[0.0, 1.0]),
    "presence": dict(presence_penalty=[0.0, 0.5, -1.5, 2.0]),
    "frequency": dict(frequency_penalty=[0.0, 0.25, -0.75, 2.0]),
    "min_tokens": dict(min_tokens=[0, 5, 15, 25]),
    "temperature": dict(temperature=[0.0, 0.25, 0.75, 1.0, 1.5]),
    "top_k": dict(top_k=[0, -1, 1, 3, 17, 100], temperature=[0.0, 0.5, 1.0]),
    "top_p": dict(top_p=[1.0, 0.9, 0.5, 0.1, 1e-6], temperature=[0.5, 1.0, 2.0]),
    "min_p": dict(min_p=[0.0, 0.05, 0.3, 1.0], temperature=[0.5, 1.0, 2.0]),
    "everything": dict(
        bias=[True, False], repetition_penalty=[1.0, 1.25], presence_penalty=[0.0, 0.5], frequency_penalty=[0.0, 0.25],
        min_tokens=[0, 10], temperature=[0.0, 0.5, 1.5], top_k=[0, 5, 20], top_p=[1.0, 0.75], min_p=[0.0, 0.1],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_process_matches_reference(case):
    rng = random.Random(case)
    torch.manual_seed(len(case))
    rows = random_rows(rng, 16, **CASES[case])
    logits = torch.randn(16, V) * 3
    before = logits.clone()
    got = Sampler(V).process(logits, rows)
    want = reference_process(logits, rows)
    assert torch.equal(logits, before), "process must not modify its input"
    assert got.dtype == torch.float32
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got, want)


@pytest.mark.parametrize("top_p,kept", [(0.3, 2), (0.8, 2), (0.85, 5), (0.99, 5), (0.999, 6), (1.0, 6)])
def test_top_p_keeps_ties_at_the_boundary(top_p, kept):
    logits = torch.full((1, V), -INF)
    logits[0, [3, 10]] = 1.0  # ~0.42 each
    logits[0, [20, 40, 50]] = -1.0  # tied: kept or dropped together
    logits[0, 60] = -4.0
    got = Sampler(V).process(logits, [make_row(SamplingParams(top_p=top_p))])
    assert int(torch.isfinite(got).sum()) == kept


def test_top_p_stops_at_the_head_whose_mass_reaches_p_exactly():
    torch.manual_seed(8)
    logits = torch.randn(1, V)
    mass = logits.sort(dim=-1, descending=True).values.softmax(-1).cumsum(-1)  # the sampler's own float32 sums
    got = Sampler(V).process(logits, [make_row(SamplingParams(top_p=mass[0, 2].item()))])
    assert int(torch.isfinite(got).sum()) == 3  # Holtzman et al.: the smallest set with mass >= p


def test_top_p_just_below_one_keeps_the_top_k_mask():
    torch.manual_seed(0)
    logits = torch.randn(500, V) * 3
    p = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()  # the float32 top-k mass can fall short of it
    got = Sampler(V).process(logits, [make_row(SamplingParams(top_k=5, top_p=p)) for _ in range(500)])
    assert torch.isfinite(got).sum(-1).tolist() == [5] * 500


@pytest.mark.parametrize("top_k,kept", [(1, 1), (2, 3), (3, 3), (4, 4)])
def test_top_k_keeps_ties_at_the_boundary(top_k, kept):
    logits = torch.full((1, V), -9.0)
    logits[0, 3], logits[0, [10, 11]], logits[0, 12] = 2.0, 1.0, 0.5
    got = Sampler(V).process(logits, [make_row(SamplingParams(top_k=top_k))])
    assert int(torch.isfinite(got).sum()) == kept


def test_no_op_params_leave_logits_alone():
    logits = torch.randn(3, V)
    rows = [make_row(SamplingParams(), [1, 2], [3, 3]) for _ in range(3)]
    assert torch.equal(Sampler(V).process(logits, rows), logits)


def test_greedy_is_argmax_and_input_dtype_is_free():
    torch.manual_seed(0)
    logits = torch.randn(8, V)
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(8)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x = logits.to(dtype)
        assert Sampler(V)(x, rows).token_ids == x.float().argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.0, 0.1, 1.0, 5.0])
def test_top_k_one_is_greedy(temperature):
    torch.manual_seed(1)
    logits = torch.randn(32, V)
    rows = [make_row(SamplingParams(temperature=temperature, top_k=1, seed=s)) for s in range(32)]
    assert Sampler(V)(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_and_sampled():
    torch.manual_seed(2)
    logits = torch.randn(6, V).repeat(50, 1)  # (300, V)
    greedy = [i % 2 == 0 for i in range(300)]
    rows = [make_row(SamplingParams(temperature=0.0 if g else 1.0, top_k=0 if g else 10)) for g in greedy]
    tokens = torch.tensor(Sampler(V)(logits, rows).token_ids)
    g = torch.tensor(greedy)
    assert torch.equal(tokens[g], logits[g].argmax(-1))
    top10 = logits[~g].topk(10, -1).indices
    assert bool((top10 == tokens[~g].unsqueeze(1)).any(-1).all())
    assert len(set(tokens[~g].tolist())) > 10, "sampled rows must actually sample"


@pytest.mark.parametrize(
    "kw", [dict(top_k=4), dict(top_p=0.7), dict(min_p=0.15), dict(top_k=6, top_p=0.9, min_p=0.05, temperature=0.8)]
)
def test_draws_stay_in_the_allowed_set_and_follow_its_distribution(kw):
    torch.manual_seed(3)
    v = 12
    logits = torch.randn(1, v) * 1.5
    params = SamplingParams(**kw)
    n = 20_000
    ref = reference_process(logits, [make_row(params)])[0]
    allowed = torch.isfinite(ref)
    assert 1 < int(allowed.sum()) < v, "the case should mask some tokens and keep several"
    tokens = torch.tensor(Sampler(v)(logits.expand(n, v), [make_row(params)] * n).token_ids)
    assert bool(allowed[tokens].all())
    expected = torch.softmax(ref.double(), -1)[allowed] * n
    observed = torch.bincount(tokens, minlength=v)[allowed].double()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    dof = int(allowed.sum()) - 1
    assert chi2 < 25.0, f"chi-square {chi2:.1f} over {dof} degrees of freedom"  # p < 0.002 at dof <= 8


def seeded_run(device, target: SamplingParams, target_logits, position: int, batch: int, neighbour_seed: int):
    """Tokens drawn for `target` over the steps of `target_logits`, in a batch of `batch` rows at `position`, with
    random neighbours (greedy, unseeded, other seeds, penalties)."""
    rng = random.Random(neighbour_seed)
    torch.manual_seed(neighbour_seed)  # a different global RNG state for every run
    sampler = Sampler(V, device)
    target_row = make_row(target, [1, 2, 3], [], device=device)
    neighbours = [
        make_row(
            SamplingParams(temperature=rng.choice([0.0, 0.7, 1.3]), top_p=rng.choice([1.0, 0.8]),
                           seed=rng.choice([None, 7, rng.randrange(1000)]), frequency_penalty=rng.choice([0.0, 0.5])),
            [4, 5], [], device=device,
        )
        for _ in range(batch - 1)
    ]
    rows = neighbours[:position] + [target_row] + neighbours[position:]
    tokens = []
    for step_logits in target_logits:
        logits = torch.randn(batch, V, device=device) * 2
        logits[position] = step_logits.to(device)
        tok = sampler(logits, rows).token_ids
        tokens.append(tok[position])
        for r, t in zip(rows, tok):
            r.output_token_ids.append(t)
    return tokens


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])]
)
def test_seeded_rows_ignore_batch_neighbours_and_position(device):
    torch.manual_seed(4)
    steps = torch.randn(12, V) * 0.5  # flat-ish, so the draws are far from deterministic
    target = SamplingParams(temperature=1.3, top_p=0.95, seed=1234)
    alone = seeded_run(device, target, steps, position=0, batch=1, neighbour_seed=0)
    for position, batch, nseed in [(5, 8, 1), (0, 8, 2), (7, 8, 3), (2, 3, 4)]:
        assert seeded_run(device, target, steps, position, batch, nseed) == alone
    other = seeded_run(device, SamplingParams(temperature=1.3, top_p=0.95, seed=1235), steps, 0, 1, 0)
    assert other != alone, "different seeds must give different sequences"


def test_seeded_row_without_generator_is_an_error():
    row = SamplingRow(SamplingParams(seed=1), [], [], None, frozenset())
    with pytest.raises(ValueError, match="generator"):
        Sampler(V)(torch.randn(1, V), [row])


def test_nothing_left_to_sample_falls_back_to_raw_argmax():
    torch.manual_seed(5)
    logits = torch.randn(3, V)
    everything = frozenset(range(V))
    rows = [
        make_row(SamplingParams(min_tokens=4), stop_ids=everything),
        make_row(SamplingParams(temperature=0.0, min_tokens=4), stop_ids=everything),
        make_row(SamplingParams(top_k=1, min_tokens=4), output=[1, 2, 3, 4], stop_ids=everything),  # long enough
    ]
    logits[2, 7] = 50.0
    out = Sampler(V)(logits, rows)
    assert out.token_ids == [int(logits[0].argmax()), int(logits[1].argmax()), 7]
    nan_row = torch.full((1, V), float("nan"))
    nan_row[0, 9] = 1.0
    assert Sampler(V)(nan_row, [make_row(SamplingParams())]).token_ids == [9]
    # greedy rows with nothing to process take the no-copy path: the same answers
    assert Sampler(V)(nan_row, [make_row(SamplingParams(temperature=0.0))]).token_ids == [9]
    assert Sampler(V)(logits, [make_row(SamplingParams(temperature=0.0))] * 3).token_ids == logits.argmax(-1).tolist()


def check_logprobs(got, lp_row, tok: int, k: int) -> None:
    """got against log_softmax of the raw logits; rank counts tokens at least as likely (ties as in vLLM), and
    tied alternatives may come in any order, so top ids are checked by their logprobs."""
    assert got.token_id == tok
    assert got.logprob == lp_row[tok].item()
    assert got.rank == int((lp_row >= lp_row[tok]).sum())
    assert [v for _, v in got.top] == (lp_row.topk(k).values.tolist() if k else [])
    assert all(lp_row[i].item() == v for i, v in got.top)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_come_from_the_raw_logits(dtype):
    torch.manual_seed(6)
    logits = (torch.randn(5, V) * 2).to(dtype)  # bfloat16 has ties, which exercise the rank rule
    ks = [None, 0, 1, 5, 20]
    rows = [
        make_row(SamplingParams(logprobs=k, temperature=0.5, top_k=10, logit_bias={3: 30.0}, repetition_penalty=1.5),
                 [1, 2], [3, 4])
        for k in ks
    ]
    out = Sampler(V)(logits, rows)
    lp = torch.log_softmax(logits.float(), -1)
    assert out.logprobs[0] is None
    assert out.token_ids == [3] * 5  # the bias picks token 3; the logprob reported stays the model's
    for i, k in enumerate(ks[1:], start=1):
        check_logprobs(out.logprobs[i], lp[i], 3, k)
    assert max(lp[i].argsort(descending=True).tolist().index(3) for i in range(5)) > 0, "3 should not always lead"


def test_prompt_logprobs_match_a_direct_computation():
    torch.manual_seed(7)
    logits = torch.randn(9, V, dtype=torch.float16)
    nxt = torch.randint(V, (9,))
    got = prompt_logprobs(logits, nxt, k=3)
    lp = torch.log_softmax(logits.float(), -1)
    assert len(got) == 9
    for t, g in enumerate(got):
        check_logprobs(g, lp[t], int(nxt[t]), 3)
    assert [g.top for g in prompt_logprobs(logits, nxt, k=0)] == [[]] * 9


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="logits must be"):
        Sampler(V)(torch.randn(2, V), [make_row(SamplingParams())])
    with pytest.raises(ValueError, match="logits must be"):
        Sampler(V)(torch.randn(1, V + 1), [make_row(SamplingParams())])


BAD = [
    ("n", 0), ("n", 1.5), ("max_tokens", 0), ("min_tokens", -1), ("min_tokens", 17), ("temperature", -0.1),
    ("temperature", math.nan), ("temperature", math.inf), ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan),
    ("top_k", -2), ("top_k", 2.5), ("min_p", -0.01), ("min_p", 1.5), ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0), ("repetition_penalty", math.inf), ("presence_penalty", 2.5),
    ("presence_penalty", -2.01), ("frequency_penalty", 3.0), ("frequency_penalty", math.nan),
    ("logit_bias", {V: 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}), ("logit_bias", {5: 101.0}),
    ("logit_bias", {5: math.nan}), ("logit_bias", [1, 2]), ("seed", 2**64), ("seed", "abc"), ("stop", "x"),
    ("stop", [""]), ("stop_token_ids", [V]), ("stop_token_ids", [-1]), ("logprobs", 21), ("logprobs", -1),
    ("prompt_logprobs", 21), ("ignore_eos", 1), ("skip_special_tokens", None),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_validate_names_the_bad_field(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value}).validate(vocab_size=V, max_logprobs=20)


def test_validate_accepts_the_edges():
    SamplingParams(n=3, max_tokens=5, min_tokens=5, temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0,
                   repetition_penalty=0.01, presence_penalty=-2.0, frequency_penalty=2.0,
                   logit_bias={0: -100.0, V - 1: 100}, seed=-(2**63), stop=["\n"], stop_token_ids=[0, V - 1],
                   logprobs=20, prompt_logprobs=0).validate(vocab_size=V, max_logprobs=20)
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=0.5).greedy
