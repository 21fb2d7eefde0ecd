"""The per-row feature protocol (model/features/protocol.py) as a new feature meets it: a feature registered in
model/features/registry.py is checked, admitted, keys its blocks, prepares a part for the steps its rows are in,
sends its per-token values with each token, and its part's `paths` choose the execution path. The feature here is
the test's own (it reads the existing `background` option, so no request field is added); what it records is each
sampled row's position, which the engine's own accounting gives independently."""

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
