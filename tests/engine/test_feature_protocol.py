"""The per-row feature protocol (model/features/protocol.py) as a new feature meets it: a feature registered in
model/features/registry.py is checked, admitted, keys its blocks, prepares a part for the steps its rows are in,
sends its per-token values with each token, and its part's `paths` choose the execution path; a feature's state of
each choice is advanced by each appended token and may end the choice, and its part masks its rows' logits. The
features here are the test's own (they read the existing `background` option, so no request field is added); what
the first records is each sampled row's position, which the engine's own accounting gives independently."""

from __future__ import annotations

import contextlib

import pytest

from model.engine import Engine, EngineConfig, InvalidOption, RequestOptions, SamplingParams
from model.features import registry
from model.features.protocol import Feature, Part, StepView
from test_engine import assert_pool_clean
from tiny import byte_tokenizer, tiny_model


class _RowPositions(Part):
    """Each sampled row's position, per sequence; runs on the module path only (as a part the native step cannot
    serve would)."""

    paths = frozenset({"module"})

    def __init__(self, rows: list[tuple[object, int]], log: list[str]) -> None:
        self.rows, self.log = rows, log

    def module_hooks(self, model):
        self.log.append("hooks")
        return contextlib.nullcontext()

    def collect(self, outputs: dict) -> None:
        for seq, position in self.rows:
            outputs.setdefault(seq, {}).setdefault("positions", []).append(position)


class _Positions(Feature):
    name = "positions"

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.log: list[str] = []

    @classmethod
    def value(cls, options):
        return True if options.background else None

    def check(self, value) -> None:
        if self.engine.max_model_len < 64:
            raise InvalidOption("background", "positions: the context is too short")

    def admit(self, value, num_prompt_tokens, model_config):
        return num_prompt_tokens

    @classmethod
    def block_key(cls, state, start, end):
        return b"positions"

    def prepare(self, step: StepView):
        rows = []
        for r in step.rows:
            n_sampled = sum(1 for seq, _ in step.sample if seq is r.seq)
            if n_sampled and r.seq.request.options.background:
                rows += [(r.seq, r.num_computed + r.num_new - n_sampled + i) for i in range(n_sampled)]
        return _RowPositions(rows, self.log) if rows else None

    def metrics(self):
        return {"steps": float(self.log.count("hooks"))}


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(registry, "FEATURES", registry.FEATURES + (_Positions,))


def _engine(**kw) -> Engine:
    return Engine(tiny_model(seed=2), byte_tokenizer(), EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4,
                                                                     max_num_batched_tokens=64, **kw))


def test_a_registered_feature_runs_at_each_point(registered):
    engine = _engine()
    prompt = list(range(10, 19))
    engine.add_request("f", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                       RequestOptions(background=True))
    engine.add_request("p", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    req = engine.requests["f"]
    assert req.state["positions"] == len(prompt) and not req.plain_decode  # admitted; not a plain decoder
    assert engine.requests["p"].state == {} and engine.requests["p"].plain_decode
    # its block key: the two requests' first blocks hash apart, the plain one's as without features
    for r in ("f", "p"):
        engine.kv._extend_hashes(engine.requests[r].seqs[0], len(prompt))
    f_hash, p_hash = engine.requests["f"].seqs[0].block_hashes[0], engine.requests["p"].seqs[0].block_hashes[0]
    assert f_hash != p_hash
    outs: dict[str, list] = {"f": [], "p": []}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += [(t, o.features.get("positions")) for t in o.token_ids]
    assert_pool_clean(engine)
    # one delta a token with its value: the position of the row that sampled it
    assert [v for _, v in outs["f"]] == list(range(len(prompt) - 1, len(prompt) + 5))
    assert all(v is None for _, v in outs["p"])
    assert [t for t, _ in outs["f"]] == [t for t, _ in outs["p"]]  # the feature changes no token
    # every step carrying its part ran on the module path, the only one it allows
    steps = engine.features.metrics()["positions"]["steps"]
    assert steps == 6 and engine.runner.path_counts["module"] >= steps


def test_a_registered_feature_checks_the_request(registered):
    engine = _engine(max_model_len=32)
    with pytest.raises(InvalidOption, match="positions: the context is too short") as e:
        engine.check(RequestOptions(background=True))
    assert e.value.param == "background"
    engine.check(RequestOptions())  # not carried: not asked


class _EvenRows(Part):
    """Masks every odd token id in the sampled rows it owns (rows: indices into `StepView.sample`)."""

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows

    def mask_logits(self, logits):
        x = logits.clone()
        x[self.rows, 1::2] = float("-inf")
        return x


class _EvenTokens(Feature):
    """A choice's own state (`start`: a count of its tokens), advanced by every appended token (`accept`), which
    ends the choice after 4; its sampled rows may take even token ids only (`Part.mask_logits`)."""

    name = "even"

    @classmethod
    def value(cls, options):
        return True if options.background else None

    def admit(self, value, num_prompt_tokens, model_config):
        return 4

    def start(self, state):
        return {"left": state, "seen": []}

    @classmethod
    def accept(cls, state, token):
        state["seen"].append(token)
        state["left"] -= 1
        return "stop" if state["left"] == 0 else None

    def prepare(self, step: StepView):
        rows = [i for i, (seq, _) in enumerate(step.sample) if self.name in seq.state]
        return _EvenRows(rows) if rows else None


def test_a_feature_masks_its_rows_logits_and_ends_its_choices(monkeypatch):
    """start / accept / mask_logits: each choice of the feature's request (n = 2) keeps its own state, sees each of
    its tokens once, takes even ids only, and ends with "stop" after 4 tokens; the free request beside it gives its
    tokens alone, and samples odd ids there (the mask is the feature's doing)."""
    monkeypatch.setattr(registry, "FEATURES", registry.FEATURES + (_EvenTokens,))
    prompt = list(range(20, 29))
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = _engine()
    alone.add_request("p", prompt, free)
    ref = [t for o in _drain(alone) for t in o.token_ids]
    engine = _engine()
    engine.add_request("e", prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=2, ignore_eos=True),
                       RequestOptions(background=True))
    engine.add_request("p", prompt, free)
    seqs = engine.requests["e"].seqs
    outs = _drain(engine)
    assert [t for o in outs if o.request_id == "p" for t in o.token_ids] == ref and any(t % 2 for t in ref)
    for c, seq in enumerate(seqs):
        tokens = [t for o in outs if o.request_id == "e" and o.index == c for t in o.token_ids]
        assert len(tokens) == 4 and all(t % 2 == 0 for t in tokens) and seq.state["even"]["seen"] == tokens
        assert seq.finish_reason.value == "stop"
    assert seqs[0].state["even"] is not seqs[1].state["even"]
    assert_pool_clean(engine)


def _drain(engine: Engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs
