"""Structured outputs in the engine (tiny random model, byte vocabulary): a random model's samples still match their
grammar; constrained rows give alone what they give in a mixed batch, free rows are bit-identical with or without
constrained neighbours; preemption, n > 1, seeds, logprobs of the masked distribution; compile errors and cache."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch

from model.engine import PLAIN, Engine, EngineConfig, RequestOptions, SamplingParams
from model.engine.sampler import Sampler, SamplingRow
from model.features.structured import AllowedTokens, StructuredOutputSpec, StructuredOutputs
from model.features.structured.masks import _apply_allowed
from test_engine import assert_pool_clean, run

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["id"], "additionalProperties": False},
    },
    "required": ["name", "age", "score", "kind", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,4}-[0-9]{3}"
CHOICES = ["yes", "no", "perhaps not"]


def constrained(spec: StructuredOutputSpec, **kw) -> tuple[SamplingParams, RequestOptions]:
    return SamplingParams(**{"max_tokens": 250, "temperature": 1.0, **kw}), RequestOptions(structured=spec)


def check(spec: StructuredOutputSpec, text: str) -> None:
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(spec.value))
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif spec.kind == "regex":
        assert re.fullmatch(spec.value, text), text
    elif spec.kind == "choice":
        assert text in json.loads(spec.value)


SPECS = [StructuredOutputSpec.json_schema(SCHEMA), StructuredOutputSpec("regex", REGEX),
         StructuredOutputSpec.choice(CHOICES)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_random_model_samples_match_the_grammar(model, tok, spec):
    """A random model at temperature 1 has no idea of JSON: every valid output is the mask's doing."""
    engine = Engine(model, tok, EngineConfig(num_blocks=512, block_size=4))
    reqs = {str(i): ([65 + i, 32, 66], *constrained(spec, seed=i)) for i in range(8)}
    res = run(engine, reqs)
    for i in range(8):
        out = res[str(i)][0]
        assert out["finish_reason"] == "stop", out
        check(spec, out["text"])
    assert len({res[str(i)][0]["text"] for i in range(8)}) > 1  # sampled, not forced to one answer
    assert_pool_clean(engine)


def test_constrained_alone_equals_in_a_mixed_batch_and_free_rows_are_untouched(model, tok):
    """Greedy: each constrained request gives in a batch of 24 mixed requests exactly its tokens alone; each free
    request gives the tokens (and the logprobs, to the bit) it gives in a batch of free requests only."""
    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + i % 5)] for i in range(24)]
    specs = {i: SPECS[i % 3] for i in range(0, 24, 2)}  # even rows constrained, odd rows free

    def params(i):
        if i in specs:
            return SamplingParams(max_tokens=250, temperature=0.0, logprobs=2), RequestOptions(structured=specs[i])
        return SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2), PLAIN

    cfg = EngineConfig(num_blocks=1024, block_size=4)
    mixed = run(Engine(model, tok, cfg), {str(i): (p, *params(i)) for i, p in enumerate(prompts)})
    for i in specs:
        alone = run(Engine(model, tok, cfg), {"a": (prompts[i], *params(i))})["a"][0]
        assert mixed[str(i)][0]["tokens"] == alone["tokens"]
        check(specs[i], mixed[str(i)][0]["text"])
    free = run(Engine(model, tok, cfg), {str(i): (p, *params(i)) for i, p in enumerate(prompts) if i not in specs})
    for i in range(1, 24, 2):
        got, ref = mixed[str(i)][0], free[str(i)][0]
        assert got["tokens"] == ref["tokens"]
        assert [(lp.logprob, lp.top) for lp in got["logprobs"]] == [(lp.logprob, lp.top) for lp in ref["logprobs"]]


def test_preemption_keeps_the_grammar_state(model, tok):
    """A pool too small for every sequence: preempted sequences recompute their kept tokens, and their grammar
    state (kept with them) still matches; outputs equal a run with room for all."""
    prompts = [[(11 * i + j) % 250 + 1 for j in range(6)] for i in range(6)]
    spec = StructuredOutputSpec.json_schema({"type": "array", "minItems": 8, "maxItems": 8,
                                             "items": {"type": "integer", "minimum": 0, "maximum": 999}})
    reqs = {str(i): (p, *constrained(spec, temperature=0.0, max_tokens=100)) for i, p in enumerate(prompts)}
    roomy = run(Engine(model, tok, EngineConfig(num_blocks=512, block_size=4)), reqs)
    tight = Engine(model, tok, EngineConfig(num_blocks=40, block_size=4, max_num_batched_tokens=32))
    res = run(tight, reqs)
    assert tight.scheduler.num_preemptions > 0
    for i in range(6):
        assert res[str(i)][0]["tokens"] == roomy[str(i)][0]["tokens"]
        assert res[str(i)][0]["finish_reason"] == "stop"
        check(spec, res[str(i)][0]["text"])
    assert_pool_clean(tight)


def test_n_choices_and_seeds_are_independent_of_neighbours(model, tok):
    cfg = EngineConfig(num_blocks=512, block_size=4)
    p = constrained(SPECS[1], n=3, seed=123)
    alone = run(Engine(model, tok, cfg), {"s": ([70, 71], *p)})["s"]
    crowd = {"s": ([70, 71], *p)} | {str(i): ([i + 1, 2], *constrained(SPECS[i % 3], seed=i)) for i in range(6)}
    crowded = run(Engine(model, tok, cfg), crowd)["s"]
    assert [alone[c]["tokens"] for c in range(3)] == [crowded[c]["tokens"] for c in range(3)]
    for c in range(3):
        check(SPECS[1], alone[c]["text"])


def test_logprobs_are_of_the_masked_distribution(model, tok):
    """Each reported logprob is the model's log-probability renormalised over the tokens the grammar allowed."""
    engine = Engine(model, tok, EngineConfig(num_blocks=256, block_size=4))
    res = run(engine, {"c": ([65, 66], *constrained(StructuredOutputSpec.choice(CHOICES), logprobs=3))})["c"][0]
    assert res["text"] in CHOICES
    first = res["logprobs"][0]
    allowed_first = {ord(c[0]) for c in CHOICES}  # the byte vocabulary: token id = byte value for ASCII
    assert {t for t, _ in first.top} <= allowed_first
    assert math.isclose(sum(math.exp(v) for _, v in first.top), 1.0, rel_tol=1e-5)  # 2 allowed: all mass there


def test_sampler_mask_touches_only_its_rows():
    V = 70
    sampler = Sampler(V)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 1] = 1 << 3 | 1 << 5  # tokens 35 and 37
    bitmask[0, 2] = 1 << 1  # token 65
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=1), [1], []) for _ in range(3)]
    out = sampler(_apply_allowed(logits, AllowedTokens(bitmask, [1]), torch.arange(32, dtype=torch.int32)), rows)
    free = sampler(logits, rows)
    assert out.token_ids[0] == free.token_ids[0] and out.token_ids[2] == free.token_ids[2]
    assert out.logprobs[0].logprob == free.logprobs[0].logprob  # bit-identical
    sub = logits[1, [35, 37, 65]]
    assert out.token_ids[1] == [35, 37, 65][int(sub.argmax())]
    assert math.isclose(out.logprobs[1].logprob, float(torch.log_softmax(sub, 0).max()), rel_tol=1e-6)


def test_compile_errors_name_the_field_and_the_cache_is_keyed_by_spec(tok):
    so = StructuredOutputs(tok, 258, max_num_seqs=4)
    bad = [
        (StructuredOutputSpec.json_schema({"type": "foo"}, source="response_format.json_schema.schema"), "Invalid type"),
        (StructuredOutputSpec.json_schema({"type": "array", "uniqueItems": True}, source="guided_json"), "uniqueItems"),
        (StructuredOutputSpec("regex", "a{2,", source="structured_outputs.regex"), "regex"),
        (StructuredOutputSpec.choice([], source="guided_choice"), "choices"),
        (StructuredOutputSpec("json_schema", "[1]", source="x.schema"), "must be an object"),
    ]
    for spec, words in bad:
        with pytest.raises(ValueError, match=re.escape(spec.source) + ".*" + words):
            so.compile(spec)
    a = so.compile(StructuredOutputSpec.json_schema(SCHEMA, source="a"))
    b = so.compile(StructuredOutputSpec.json_schema(json.dumps(SCHEMA), source="b"))  # same spec, other field
    assert a is b and so.compiler.num_compiled == 1
    with pytest.raises(ValueError, match="structured"):
        RequestOptions(structured="not a spec").validate(2)


def test_grammar_state_rebuilds_from_the_output(tok):
    so = StructuredOutputs(tok, 258, max_num_seqs=4)
    g = so.compile(StructuredOutputSpec("regex", "ab+c"))
    s = g.new_state()
    out = tok.encode("abb", add_bos=False)
    s.sync(out)  # diverged (nothing consumed yet): replayed
    assert s.num_tokens == 3 and not s.is_error
    assert s.accept(tok.encode("c", add_bos=False)[0])  # complete: only EOS may follow


@pytest.mark.slow
def test_default_model_mixed_batch_of_32(default_model):
    """The issue's acceptance on the default model: 16 constrained and 16 free greedy requests in one batch of 32;
    each constrained one gives exactly its tokens alone, each free one the tokens and logprobs (to the bit) of a
    batch of the 16 free ones only."""
    model, tok = default_model.model, default_model.tokenizer
    topics = ["Paris", "the sea", "a cat", "rain", "music", "Mars", "bread", "winter"]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Tell me about {topics[i % 8]} "
                                                    f"({i})."}]), add_bos=False) for i in range(32)]
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    kinds = [StructuredOutputSpec.json_schema(person), StructuredOutputSpec("regex", r"[A-Z][a-z]{2,8} [0-9]{1,3}"),
             StructuredOutputSpec.choice(["yes", "no", "maybe"]), StructuredOutputSpec("json_object")]
    specs = {i: kinds[(i // 2) % 4] for i in range(0, 32, 2)}

    def params(i):
        if i in specs:
            return SamplingParams(max_tokens=32, temperature=0.0, logprobs=1), RequestOptions(structured=specs[i])
        return SamplingParams(max_tokens=16, temperature=0.0, logprobs=1), PLAIN

    cfg = EngineConfig(num_blocks=1024, block_size=16, max_num_seqs=32, max_num_batched_tokens=2048)
    mixed = run(Engine(model, tok, cfg), {str(i): (p, *params(i)) for i, p in enumerate(prompts)})
    free = run(Engine(model, tok, cfg), {str(i): (p, *params(i)) for i, p in enumerate(prompts) if i not in specs})
    for i in range(32):
        got = mixed[str(i)][0]
        if i in specs:
            alone = run(Engine(model, tok, cfg), {"a": (prompts[i], *params(i))})["a"][0]
            assert got["tokens"] == alone["tokens"], i
            if got["finish_reason"] == "stop":
                check(specs[i], got["text"])
        else:
            ref = free[str(i)][0]
            assert got["tokens"] == ref["tokens"], i
            assert [lp.logprob for lp in got["logprobs"]] == [lp.logprob for lp in ref["logprobs"]], i


def test_stop_strings_still_end_a_constrained_choice(model, tok):
    engine = Engine(model, tok, EngineConfig(num_blocks=256, block_size=4))
    res = run(engine, {str(i): ([66 + i, 67], *constrained(SPECS[1], seed=i, stop=["-"])) for i in range(4)})
    for i in range(4):
        out = res[str(i)][0]
        assert out["finish_reason"] == "stop" and out["stop_reason"] == "-"
        assert re.fullmatch(r"[a-z]{2,4}", out["text"]), out["text"]  # the regex's head, cut at the stop string


@pytest.mark.parametrize("max_tokens", [12, 23, 40])
def test_json_object_near_max_tokens_is_closed_in_time(model, tok, max_tokens):
    """JSON mode bounds no string: a random model at temperature 1 opens strings, arrays and objects and closes none
    of its own. Every reply still parses within max_tokens: its last tokens close what is open (closing.py), and it
    says "length" (the model did not end it); a reply the grammar completed on its own says "stop"."""
    engine = Engine(model, tok, EngineConfig(num_blocks=512, block_size=4))
    spec = StructuredOutputSpec("json_object")
    reqs = {str(i): ([65 + i, 32, 66], *constrained(spec, seed=i, max_tokens=max_tokens, logprobs=0))
            for i in range(16)}
    res = run(engine, reqs)
    reasons = set()
    for i in range(16):
        out = res[str(i)][0]
        assert len(out["tokens"]) <= max_tokens
        check(spec, out["text"])
        reasons.add(out["finish_reason"])
        if out["finish_reason"] == "length":  # the closing tokens were the only ones allowed: logprob 0
            assert out["logprobs"][-1].logprob == 0.0
    assert "length" in reasons  # the random model needed closing: the test exercised it
    assert_pool_clean(engine)


def test_closing_plans_close_what_is_open(tok):
    """The plan from a cut JSON prefix, through the grammar: the prefix plus the plan parses."""
    from model.features.structured.closing import JsonCloser

    compiled = StructuredOutputs(tok, 258, 4).compile(StructuredOutputSpec("json_object"))  # the tiny model's vocab
    closer = JsonCloser(tok)
    for prefix in ['{"name": "Al', '{"a": [1, 2, {"b": "x', '{"a": [1, 2, {', '{"a": tr', '{"a": 1.', '{"k',
                   '{"a": "x", ', '{"a": [{"b": [']:
        state = compiled.new_state()
        state.matcher.consume_tokens(tok.encode(prefix, add_bos=False))
        plan = closer.plan(state.matcher)
        assert plan is not None, prefix
        assert isinstance(json.loads(prefix + tok.decode(plan)), dict), prefix + tok.decode(plan)
    state = compiled.new_state()
    state.matcher.consume_tokens(tok.encode('{"a": 1}', add_bos=False))
    assert closer.plan(state.matcher) == []  # complete already
