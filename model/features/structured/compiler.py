"""Spec -> grammar (llguidance), compiled once per distinct spec, and the per-sequence matcher state built from it.

Why llguidance (benchmarks/bench_grammar_engines.py; the figures: docs/performance.md#structured-outputs): it
compiles a schema lazily where xgrammar precomputes most masks at compile time, and a new tool or schema is compiled
on a request's path to its first token; it has no dependency (xgrammar imports transformers at import time and pulls
triton), and it reads the `tokenizers` JSON of any vocabulary the loaders build (BPE, SentencePiece, GGUF) itself.
xgrammar's masks are cheaper per row, but on CPU either is a small share of a decode step (bench_structured.py
measures the whole server).

Grammar text per kind follows vLLM's llguidance backend (`vllm/v1/structured_output/backend_guidance.py`): JSON
schemas through `grammar_from_json_schema`, choices as a Lark alternation, GBNF converted to Lark. JSON is written
compactly, with json.dumps' separators (", " and ": ") and no other whitespace: vLLM's `disable_any_whitespace`
made the default, since free whitespace lets a sampled row wander in blank space until max_tokens.

A grammar ends at EOS: the vocabulary's stop ids (`Tokenizer.stop_ids`) are the EOS set the masks allow once the
grammar is satisfied.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

from model.features.structured.closing import MARGIN, PLAN_LIMIT, RETRY_AFTER, JsonCloser
from model.features.structured.spec import StructuredOutputSpec
from model.text.tokenizer import Tokenizer

log = logging.getLogger("llamascope.engine")

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def import_llguidance():
    try:
        import llguidance
    except ImportError as e:  # a runtime dependency (pyproject.toml); missing only in a broken install
        raise RuntimeError("structured outputs need the `llguidance` package: pip install llguidance") from e
    return llguidance


def grammar_text(spec: StructuredOutputSpec) -> str:
    """The llguidance grammar (its JSON form) for a validated spec. ValueError naming spec.source when the text
    cannot even be parsed (the matcher reports everything else)."""
    ll = import_llguidance()
    try:
        if spec.kind == "json_schema":
            return ll.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
        if spec.kind == "json_object":
            return ll.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return ll.LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            return ll.grammar_from("choice", spec.value)
        if spec.kind == "grammar":
            return ll.grammar_from("grammar", spec.value)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ValueError(f"{spec.source}: {e}") from None
    raise ValueError(f"{spec.source}: unknown kind {spec.kind!r}")


class CompiledGrammar:
    """One compiled spec: a matcher at the start state that is never advanced, copied for each sequence."""

    def __init__(self, spec: StructuredOutputSpec, matcher, closer: JsonCloser | None = None) -> None:
        self.spec = spec
        self._start = matcher
        self.closer = closer  # JSON kinds: closes a reply max_tokens would cut (closing.py)

    def new_state(self) -> SequenceGrammar:
        return SequenceGrammar(self)

    def fresh_matcher(self):
        return self._start.deep_copy()  # shares the compiled grammar, copies only the parser state


class SequenceGrammar:
    """One sequence's position in its grammar: advanced by every token appended to its output.

    Preemption keeps a sequence's generated tokens (they are recomputed into the cache, not regenerated), so the
    state stays valid across it; `sync` rebuilds it by replaying the output should the two ever disagree (a
    runner that trims outputs, say)."""

    __slots__ = ("closing", "compiled", "matcher", "num_tokens", "retry_at")

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self.matcher = compiled.fresh_matcher()
        self.num_tokens = 0  # output tokens consumed
        self.closing = False  # following a closing plan because max_tokens is near (closing.py)
        self.retry_at = 0  # no closing plan is looked for before this many output tokens

    def forced_token(self, remaining: int) -> int | None:
        """The only token this row may take now, or None (sample from the grammar's mask). remaining: tokens left
        to max_tokens, this one included."""
        closer = self.compiled.closer
        if closer is None or self.matcher.is_error() or self.num_tokens < self.retry_at:
            return None
        token = closer.forced_token(self.matcher, remaining, self.closing)
        if token is False:  # no closing found from here: look again a few tokens on (every token near the end)
            self.retry_at = self.num_tokens + (RETRY_AFTER if remaining > 2 * MARGIN else 1)
            return None
        self.closing = self.closing or token is not None
        return token

    def accept(self, token: int) -> bool:
        """Advance by the sampled token. True when the grammar is complete: nothing but EOS may follow, so the
        sequence ends here (finish_reason "stop"; "length" when `closing`), or a closing plan has closed it."""
        if not self.matcher.consume_token(token):
            # Only a token the mask forbade can fail: the sampler's no-choice fallback or a bug. The matcher stays
            # in its error state, whose mask allows only EOS, so the sequence ends at its next token.
            log.warning("structured output: token %d rejected by the grammar (%s)", token, self.matcher.get_error())
        self.num_tokens += 1
        return self.matcher.is_stopped() or (self.closing and self.matcher.is_accepting())

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Make the state match the output exactly (a no-op unless they diverged)."""
        if self.num_tokens == len(output_token_ids):
            return
        self.matcher = self.compiled.fresh_matcher()
        self.matcher.consume_tokens(list(output_token_ids))
        self.num_tokens = len(output_token_ids)

    @property
    def is_error(self) -> bool:
        return self.matcher.is_error()

    def valid_drafts(self, drafts: list[int], remaining: int) -> list[int]:
        """[speculative decoding] The drafts this grammar accepts from its state, up to the first it rejects;
        none while a closing plan may force tokens (within reach of max_tokens: `remaining` tokens left)."""
        if self.closing or self.matcher.is_error() or (
                self.compiled.closer is not None and remaining - len(drafts) <= PLAN_LIMIT + MARGIN):
            return []
        return drafts[: self.matcher.validate_tokens(drafts)]


class GrammarCompiler:
    """Compiles specs against one vocabulary, with an LRU cache keyed by the spec (kind + text). Thread-safe: the
    service compiles on a worker thread before submitting (so errors reach the client as a 400 naming the field and
    the engine thread never waits on a compile); the engine's own call is then a cache hit."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256) -> None:
        self.tokenizer, self.vocab_size, self.cache_size = tokenizer, vocab_size, cache_size
        self._ll_tokenizer = None  # built on first use (a walk of the vocabulary): servers that never constrain skip it
        self._cache: OrderedDict[StructuredOutputSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and the benchmark
        self._closer: JsonCloser | None = None

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                ll = import_llguidance()
                # The checkpoint's `tokenizers` backend, serialized: llguidance reads every model type it can hold.
                backend = self.tokenizer._tk  # noqa: SLF001 - model/text/tokenizer.py exposes no public handle yet
                eos = sorted(self.tokenizer.stop_ids)
                self._ll_tokenizer = ll.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=eos or None)
            return self._ll_tokenizer

    def _json_closer(self) -> JsonCloser:
        with self._lock:
            if self._closer is None:
                self._closer = JsonCloser(self.tokenizer)
            return self._closer

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """ValueError naming spec.source for anything the grammar engine refuses (an invalid schema, an unsupported
        keyword, a regex or grammar that does not compile)."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        spec.validate()
        text = grammar_text(spec)
        matcher = import_llguidance().LLMatcher(self.ll_tokenizer, text, log_level=0)  # drops the GIL while it compiles
        if matcher.is_error():
            raise ValueError(f"{spec.source}: {_first_line(matcher.get_error())}")
        closer = self._json_closer() if spec.kind in ("json_object", "json_schema") else None
        compiled = CompiledGrammar(spec, matcher, closer)
        with self._lock:
            self.num_compiled += 1
            self._cache[spec] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled


def _first_line(message: str) -> str:
    """llguidance's regex errors come with a caret diagram over several lines; a client's message keeps the gist."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    head = lines[0] if lines else message
    detail = next((ln for ln in lines[1:] if ln.startswith("error:")), "")
    return f"{head} ({detail})" if detail and detail not in head else head
