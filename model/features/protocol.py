"""The per-row feature protocol: what the engine, the runner and the execution paths call, at fixed points, of
each feature a request can carry (model/features/registry.py lists them), and the views of a step they get.

A per-row feature is something a request carries beside its prompt and sampling that changes, reads or adds to
what its own rows compute, never its neighbours' (attention telemetry, hidden-state reads, interventions, ...). Its
folder owns every stage of it; the engine names none of them and calls, for each registered `Feature`:

    check(value)              the request's option against the engine the feature is bound to (InvalidOption
                              naming the request field); any thread, fixed configuration and its own
                              thread-safe caches only (`Engine.check`)
    admit(value, P, config)   its per-request state, made once against the prompt (P tokens) at admission;
                              start(state) its state for each choice (sequence) from it
    prefix_key(request)       its share of the root of the request's prefix-cache keys (K/V it changes is not the
                              base's), and block_key(state, start, end) its share of one block's key
    max_cached(state, seq)    the prompt positions the prefix cache may supply a sequence at (re)admission: a
                              feature that reads rows of the prompt has them computed, not served from the cache
    plain(value)              whether rows carrying it are still plain decoders (the engine's decode path:
                              nothing per row but tokens, positions and block tables); a class method, as is
                              block_key: they depend on the request alone
    accept(state, token)      a token appended to a choice advances its state (`start`'s): "stop" or "length"
                              when that ends the choice (its say in the end-of-sequence rule,
                              model/engine/end_of_sequence.py), else None
    drafts(state, seq, d)     the prefix of a choice's speculative drafts d its rows may verify (the kept ones
                              then come through `accept`); a class method, as is accept: they depend on the
                              choice alone
    prepare(step)             its part of one step (`Part`), or None when no row of the step carries it
    metrics()                 its counters, for the engine's stats
    graph_part(rows, device)  its share of the CUDA graphs (`GraphPart`), made once per engine, or None: its
                              parts then never set `graph`
    changed()                 called by the feature itself when its per-engine state changed between steps (an
                              adapter loaded): the engine's listeners follow it then (the featured graphs are
                              captured again), never in the middle of a step

and, for the `Part` a step carries, on the path the runner chose:

    paths                     the execution paths (`PATHS`) that can run a step carrying it: the runner picks the
                              first of its order that every part allows ("module", the reference, runs every
                              part: a part always lists it)
    module_hooks(model)       the module path: hooks installed for the step only
    adapt(l, site, x, y)      the module path (and a featured graph's captured forward), a projection's output at
                              the attention context's seam (model/attention.py, `adapt`): y, its rows changed
    attention_recorder(l)     what the decode-attention kernel records into at layer l (every path's kernel)
    after_attention(...)      the module path, once a layer's pools hold the step's K/V
    native_args()             the native step's keyword arguments (model/kernels/csrc/bindings.cpp, step_layers)
    graph                     whether a pure decode step carrying it replays the featured CUDA graphs: those
                              captured with every feature's `GraphPart`, which the step's parts are loaded into
    mask_logits(logits)       the step's sampled rows' logits (S, V), once the forward ran and before the sampler
                              reads them: -inf where it forbids a token of a row it owns (every path)
    reads()                   rows of the step it reads at a site (`SiteRead`): every path fills them through the
                              step's hidden-state reads table (model/edits.py, `StepEdits` read_rows / read_out),
                              so a part that reads allows every path; `take_reads(values)` hands them over
    collect(outputs)          its per-token results into each sequence's outputs, once the forward ran: the engine
                              sends the kept tokens' values with them, one delta a token

The features see a step through `StepView` (its rows, in order, and the rows it samples) and the engine through
`EngineView` (its configuration, the served model, a view of the requests it holds), so no feature imports the
engine (pyproject.toml's import-linter contract). A sequence
is the engine's object, read by features through the few attributes `SequenceView` names.

The shape follows two peers. vLLM keeps LoRA in its own package (vllm/lora/: the adapters, their layers and the
worker's manager, vllm/lora/worker_manager.py) and hands the runner one mixin
(vllm/v1/worker/lora_model_runner_mixin.py) through which it reaches them: `set_active_loras`, called at one point
of each step with the step's rows. nnsight keeps interventions apart from the model (nnsight/intervention/interleaver.py: the intervention
graph runs beside an unchanged model's forward through hooks at module boundaries). Here the hooks are the
attention context's seams (model/attention.py) and the fused native call's arguments, and the step's rows
choose which parts run.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator, Protocol

if TYPE_CHECKING:
    import torch
    from torch import Tensor

# The execution paths, in the runner's order of preference (model/engine/model_runner.py)
PATHS = ("cuda_graph", "native", "module")


class InvalidOption(ValueError):
    """A request option this engine cannot serve (`Feature.check`, `Engine.check`), naming the request field the
    API reports."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class SequenceView(Protocol):
    """What a feature reads of one of the engine's sequences (model/engine/request.py's `Sequence`)."""

    seq_id: int
    request: Any  # .options (the request's RequestOptions), .params, .state (per-request feature state)
    state: dict[str, Any]  # per-choice feature state, by feature name (`Feature.start`)
    output_token_ids: list[int]
    draft_token_ids: list[int]  # speculative drafts its rows verify this step
    num_computed_tokens: int
    num_evicted: int  # a kv_window's evicted tokens: cache position + num_evicted = token position past the sinks
    window: Any  # the request's kv_window, or None


@dataclass
class StepRow:
    """One scheduled sequence's rows of a step: packed rows start .. start + num_new - 1, computing its tokens
    num_computed .. num_computed + num_new - 1, attending over `context_len` cache positions in `block_ids`."""

    seq: SequenceView
    start: int
    num_new: int
    num_computed: int
    context_len: int
    block_ids: list[int]


@dataclass
class StepView:
    """One step as a feature prepares its part: its rows in order, the (sequence, logits row) pairs it samples (a
    sequence that caught up: its last row; a drafting one: 1 + drafts rows), the model, its device, and whether
    prefill rows attend over the pool row by row as decode rows do (`PagedKVCache.paged_prefill`)."""

    rows: list[StepRow]
    sample: list[tuple[SequenceView, int]]
    model: torch.nn.Module
    device: torch.device
    paged_prefill: bool = False


@dataclass
class SiteRead:
    """Rows a part reads: packed `rows` at block `layer`'s `site` (one of model/interventions.py's SITES), after
    any edit there. `start`: where they land in the step's read_out, set by the runner's table
    (model/edits.py, `EditTables.build`)."""

    layer: int
    site: str
    rows: list[int]
    start: int = -1


@dataclass(frozen=True)
class EngineView:
    """The engine's fixed configuration, as `Feature.check` reads it, and what a feature's per-engine state
    needs of the engine."""

    distributed: bool  # tensor parallelism: a step's rows run across processes
    max_model_len: int
    block_size: int
    # the served model (its dtype and device; under tensor parallelism rank 0's, which sends per-engine state to
    # the other ranks), for what a feature loads
    model: Any = None
    # the requests the engine holds now, running or waiting (each with .options): what a feature's state serves
    requests: Callable[[], Iterable[Any]] = tuple
    tokenizer: Any = None  # model/text/tokenizer.py's Tokenizer
    vocab_size: int = 0
    max_num_seqs: int = 1
    device: str = "cpu"  # the model's device type


class Part:
    """A feature's share of one step. The defaults do nothing, so a part overrides only the stages it takes."""

    paths: ClassVar[frozenset[str]] = frozenset(PATHS)
    graph: ClassVar[bool] = False  # replayed by the featured CUDA graphs (its feature's `GraphPart`)

    def module_hooks(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def adapt(self, layer: int, site: str, x: Tensor, y: Tensor) -> Tensor:
        """The module path: block `layer`'s projection at `site` ("qkv", "o", "w13", "w2"), its input x (1, N, in)
        and output y (1, N, out) -> y, its rows changed in place, or as it is."""
        return y

    def attention_recorder(self, layer: int) -> Any:
        """What `ops.decode_attention` records into at `layer` (model/kernels/attention_telemetry.py), or None."""
        return None

    def after_attention(self, layer: int, q: Tensor, k_pool: Tensor, v_pool: Tensor, window: int, scale: float) -> None:
        """The module path, after a layer's K/V are written: q (1, N, H, E) of the step."""

    def native_args(self) -> dict[str, Any]:
        return {}

    def mask_logits(self, logits: Tensor) -> Tensor:
        """logits (S, V): the step's sampled rows, in `StepView.sample` order -> the same, with -inf where it
        forbids a token (a copy where it changes any; the caller's raw logits stay raw)."""
        return logits

    def reads(self) -> list[SiteRead]:
        """The rows it reads in this step (none by default)."""
        return []

    def take_reads(self, values: list[Tensor]) -> None:
        """Once the forward ran, before `collect`: each of `reads()`'s rows, in order, as (len(rows), D) float32
        on the step's device."""

    def collect(self, outputs: dict[Any, dict[str, list]]) -> None:
        """Its per-token results: outputs[sequence][feature name] = one value per sampled row, in row order."""


class GraphPart(Part):
    """A feature's share of the CUDA graphs (`Feature.graph_part`, one per engine): static buffers, one slot a row,
    that the featured graphs are captured with and read when replayed; its `Part` stages are what the captured
    forward runs. Before each replay the step's parts are loaded into it."""

    def current(self) -> bool:
        """Whether what it holds is the feature's per-engine state now (graphs captured with it may replay)."""
        return True

    def use(self) -> bool:
        """Hold the feature's per-engine state now; True where that changed it (the graphs captured with it before
        are dropped)."""
        return False

    def active(self) -> bool:
        """Whether a step can carry it now (the featured graphs are worth capturing)."""
        return True

    def load(self, parts: StepParts | None) -> None:
        """The step's parts into its buffers; None: no row carries the feature (a capture's padding rows)."""


class Feature:
    """One per-row feature (a subclass per folder, listed in the registry), one instance per engine, bound to it:
    what it keeps per engine is its own. `name` is the `RequestOptions` field it reads, the key of its per-request
    state and of its per-token outputs."""

    name: ClassVar[str]
    # its arguments of the fused native call when no row of the step carries it (the binding's required ones)
    native_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, engine: EngineView) -> None:
        self.engine = engine
        self.listeners: list[Callable[[], None]] = []  # called by `changed` (`EngineFeatures.listen`)

    @classmethod
    def value(cls, options: Any) -> Any:
        return getattr(options, cls.name)

    @classmethod
    def plain(cls, value: Any) -> bool:
        """Whether rows carrying `value` still run as plain decoders (most features need the general step)."""
        return value is None

    @classmethod
    def block_key(cls, state: Any, start: int, end: int) -> bytes | None:
        """Its share of the prefix-cache key of the block of positions [start, end), from its per-request state:
        None where it changes nothing there (the block hashes as the base's)."""
        return None

    @classmethod
    def max_cached(cls, state: Any, seq: SequenceView) -> int | None:
        """The most leading tokens of `seq` the prefix cache may supply at (re)admission, from its per-request
        state: None where the feature needs none of them computed."""
        return None

    def check(self, value: Any) -> None:
        """InvalidOption naming the request field when this engine cannot serve `value` (never None here)."""

    def admit(self, value: Any, num_prompt_tokens: int, model_config: Any) -> Any:
        """Its per-request state (kept on the request under `name`), or None."""
        return None

    def start(self, state: Any) -> Any:
        """Its state for one choice, from its per-request state (kept on the sequence under `name`), or None."""
        return None

    @classmethod
    def accept(cls, state: Any, token: int) -> str | None:
        """`token` was appended to the choice whose state this is: "stop" or "length" where that ends the choice."""
        return None

    @classmethod
    def drafts(cls, state: Any, seq: SequenceView, drafts: list[int]) -> list[int]:
        """The prefix of `drafts` the choice's rows may verify (all of them: it constrains none)."""
        return drafts

    def prefix_key(self, request: Any) -> bytes | None:
        return None

    def prepare(self, step: StepView) -> Part | None:
        return None

    def metrics(self) -> dict[str, float]:
        return {}

    def graph_part(self, max_rows: int, device: torch.device) -> GraphPart | None:
        """Its share of the CUDA graphs over `max_rows` rows, or None where its parts never replay them."""
        return None

    def changed(self) -> None:
        """Its per-engine state changed, between steps: the engine's listeners follow it."""
        for listener in self.listeners:
            listener()


@dataclass
class StepParts:
    """The parts of one step's features, as the runner and the paths read them."""

    parts: list[Part] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.parts)

    @property
    def graph(self) -> bool:
        """Whether the step replays the featured CUDA graphs (a part whose feature has a `GraphPart`)."""
        return any(p.graph for p in self.parts)

    def adapt(self, layer: int, site: str, x: Tensor, y: Tensor) -> Tensor:
        for p in self.parts:
            y = p.adapt(layer, site, x, y)
        return y

    def allow(self, path: str) -> bool:
        """Whether every part can run on `path`."""
        return all(path in p.paths for p in self.parts)

    @property
    def recorder(self) -> Part | None:
        """The part whose attention the decode kernel records (one a step: the kernel takes one recorder)."""
        return next((p for p in self.parts if type(p).attention_recorder is not Part.attention_recorder), None)

    @contextlib.contextmanager
    def module_hooks(self, model: torch.nn.Module) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for p in self.parts:
                stack.enter_context(p.module_hooks(model))
            yield

    def native_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {}
        for p in self.parts:
            args.update(p.native_args())
        return args

    @property
    def masks(self) -> bool:
        """Whether a part masks the sampled rows' logits (then the sampler needs the logits, not only picks)."""
        return any(type(p).mask_logits is not Part.mask_logits for p in self.parts)

    def mask_logits(self, logits: Tensor) -> Tensor:
        for p in self.parts:
            logits = p.mask_logits(logits)
        return logits

    def reads(self) -> list[SiteRead]:
        """Every part's reads, in part order."""
        return [r for p in self.parts for r in p.reads()]

    def take_reads(self, read_out: Tensor) -> None:
        """Each part its reads' rows of the step's read_out (K, D), once the forward filled it."""
        for p in self.parts:
            reads = p.reads()
            if reads:
                p.take_reads([read_out[r.start : r.start + len(r.rows)] for r in reads])

    def collect(self) -> dict[Any, dict[str, list]]:
        out: dict[Any, dict[str, list]] = {}
        for p in self.parts:
            p.collect(out)
        return out
