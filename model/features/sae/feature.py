"""A dictionary's features streamed with every token, as a per-row feature (model/features/protocol.py): the
request's `features` option (options.py) names a dictionary, and each step encodes the rows it asked for at the
dictionary's `hook_in` site.

Where the numbers come from: each asking row's activation at the site (after any intervention there) is read
through the step's hidden-state reads table (model/edits.py, `StepEdits`), which the module path, the fused native
step and the CUDA graphs all fill (`SiteRead`); once the forward ran, the rows of each dictionary are encoded
together, one (rows, D_in) @ W_enc matmul a dictionary a step (`Dictionary.encode`, its products in one order
whatever the rows: `Served`), and each row keeps its top_k
(id, activation) largest first (`top_features`), the activations of the ids it names, and where asked the norm of
the reconstruction error |x - decode(encode(x))| (Marks et al. 2024's "error term").

A generated token carries the row that produced it (its logprobs' row); rows of the prompt before the last, which
produce no token, are kept per sequence and go out with its next token (`TokenFeatures.prompt`). Such prompt rows
are computed, never served from the prefix cache (`max_cached`, as hidden-state reads of the prompt do,
model/engine/request.py), and read once even when a preemption recomputes them. Reading changes no K/V: no
prefix-cache key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from model.features.protocol import Feature, InvalidOption, Part, SequenceView, SiteRead, StepView
from model.features.sae.dictionary import Dictionary, top_features
from model.features.sae.options import FeatureReadOptions
from model.kernels import native, ops
from model.quantize.layers import Int8Linear


@dataclass
class FeatureActivations:
    """One row's features: position p's forward at the dictionary's hook_in."""

    position: int
    ids: list[int]  # the top_k feature ids, largest activation first
    values: list[float]  # their activations (zeros past the active ones)
    id_values: list[float]  # the activations of the request's `ids`, in its order
    error_norm: float | None = None  # |x - decode(encode(x))| where the request asked


@dataclass
class TokenFeatures:
    """One generated token's value: the row that produced it (None where the positions leave it out), and the
    prompt rows read since the sequence's last token, in position order."""

    own: FeatureActivations | None
    prompt: list[FeatureActivations] = field(default_factory=list)


@dataclass
class FeatureReadState:
    """Per request: its options (the dictionary object itself), and per sequence the prompt rows read so far and
    those not sent yet."""

    options: FeatureReadOptions
    num_prompt_tokens: int
    read_upto: dict[int, int] = field(default_factory=dict)  # seq_id -> prompt rows below this are read
    pending: dict[int, list[FeatureActivations]] = field(default_factory=dict)  # seq_id -> read, not sent


@dataclass
class _Row:
    seq: SequenceView
    state: FeatureReadState
    position: int
    packed_row: int
    sampled: bool


class Served:
    """A dictionary as one engine encodes it: on the step's device, its encoder (and, once asked for an error norm,
    its decoder) transposed to (out, in), multiplied by a kernel with one reduction order per output whatever the
    number of rows, which makes a row's features the same batched as alone.

    `encoder` "float32": `ops.linear` (model/kernels/csrc/float_linear.cpp), equal to `Dictionary.encode` within
    float32 rounding. "int8": W_enc rounded to int8 in blocks of 32 inputs with a float16 scale each (GGUF's Q8_0,
    `Int8Linear`), the activations rounded likewise, exact integer block sums (the model's own int8 layers'
    kernel): a quarter of the bytes each step reads (a 16k-feature encoder of a 576-wide site is 38 MB in float32,
    more than a third of the int4 default model), at an error docs/inspection.md ("The encoder's precision")
    reports against the float32 encode. Only where the native CPU kernels run (elsewhere the encoder stays float32) and the site's
    width is whole blocks of 32."""

    def __init__(self, d: Dictionary, device: torch.device) -> None:
        self.source = d  # the request's object (held: no other dictionary can take its id while this lives)
        self.d = d if d.W_enc.device == device else Dictionary(
            **{k: getattr(d, k) for k in d.__dataclass_fields__}).to(device=device)
        native_int8 = d.encoder == "int8" and device.type == "cpu" and native() is not None
        self.q_enc: Int8Linear | None = d.int8_encoder() if native_int8 else None
        self.w_enc = self.d.W_enc.T.contiguous() if self.q_enc is None else None  # (F, D_in)
        self._w_dec: Tensor | None = None

    @property
    def precision(self) -> str:
        return "int8" if self.q_enc is not None else "float32"

    @property
    def w_dec(self) -> Tensor:  # (D_out, F)
        if self._w_dec is None:
            self._w_dec = self.d.W_dec.T.contiguous()
        return self._w_dec

    def encode_top(self, x: Tensor, k: int, dense: bool) -> tuple[Tensor | None, Tensor, Tensor]:
        """x (R, D_in) -> (f (R, F) where `dense` or the activation needs it, else None; each row's k largest
        activations (R, k) and their ids (R, k), largest first). Where the activation keeps the order of the
        pre-activations (relu; a TopK's own selection, which holds its k largest) the k largest pre-activations,
        relu'd, are `top_features` of f without forming it (R x F floats written, then searched again)."""
        d = self.d
        pre = self._pre(x)  # (R, F)
        if not dense and (d.activation == "relu" or (d.activation == "topk" and k <= d.k)):
            values, ids = pre.topk(min(k, pre.shape[-1]), dim=-1, sorted=True)  # (R, k) x 2
            return None, values.relu_(), ids
        f = d._activate(pre)
        return (f, *top_features(f, k))

    def _pre(self, x: Tensor) -> Tensor:  # (R, D_in) -> the encoder's pre-activations (R, F)
        d = self.d
        x, _ = d._normalize(x.to(d.dtype))
        if d.apply_b_dec_to_input:
            x = x - d.b_dec
        pre = ops.linear(x, self.w_enc) if self.q_enc is None else self.q_enc(x.float()).to(d.dtype)
        return pre.add_(d.b_enc)

    def error_norm(self, x: Tensor, f: Tensor) -> Tensor:
        """|x - decode(f)| (R,) for an autoencoder: `Dictionary.decode` with its matmul in one order."""
        d = self.d
        x = x.to(d.dtype)
        out = ops.linear(f, self.w_dec) + d.b_dec  # (R, D)
        if d.normalize_activations != "none":
            _, (scale, shift) = d._normalize(x)
            out = out * scale + shift
        return (x - out).float().norm(dim=-1)


class StepFeatures(Part):
    """One step's encodes: the asking rows grouped by dictionary, one SiteRead each; every path serves it."""

    def __init__(self, groups: list[tuple[Served, list[_Row]]],
                 sampled: list[tuple[SequenceView, int, int]]) -> None:
        self.groups = groups
        # (sequence, its first sampled row's position, its sampled rows) of the asking sequences, in step order
        self.sampled = sampled
        self._reads = [SiteRead(s.d.hook_in.layer, s.d.hook_in.site, [r.packed_row for r in rows])
                       for s, rows in groups]
        self._own: dict[tuple[int, int], FeatureActivations] = {}  # (id(seq), position) -> a sampled row's

    def reads(self) -> list[SiteRead]:
        return self._reads

    @torch.no_grad()
    def take_reads(self, values: list[Tensor]) -> None:
        for (served, rows), x in zip(self.groups, values):  # x (R, D_in) float32
            k = max(r.state.options.top_k for r in rows)
            ask = sorted({i for r in rows for i in r.state.options.ids})
            want_err = any(r.state.options.error_norm for r in rows)
            f, top_v, top_i = served.encode_top(x, k, dense=bool(ask) or want_err)  # (R, F) or None, (R, k) x 2
            err = served.error_norm(x, f).tolist() if want_err else None
            col = {i: j for j, i in enumerate(ask)}
            picked = f[:, ask].float().cpu().tolist() if ask else [[] for _ in rows]  # (R, n_ids)
            top_v, top_i = top_v.float().cpu().tolist(), top_i.cpu().tolist()
            for j, r in enumerate(rows):
                o = r.state.options
                a = FeatureActivations(r.position, top_i[j][: o.top_k], top_v[j][: o.top_k],
                                       [picked[j][col[i]] for i in o.ids],
                                       err[j] if o.error_norm else None)
                if r.sampled:
                    self._own[(id(r.seq), r.position)] = a
                else:
                    r.state.pending.setdefault(r.seq.seq_id, []).append(a)

    def collect(self, outputs: dict) -> None:
        """Each asking sequence's TokenFeatures per sampled row, in row order, under "features"."""
        for seq, first, n in self.sampled:
            state: FeatureReadState = seq.request.state[SAEFeatures.name]
            values = [TokenFeatures(self._own.get((id(seq), first + i))) for i in range(n)]
            values[0].prompt = state.pending.pop(seq.seq_id, [])
            outputs.setdefault(seq, {})[SAEFeatures.name] = values


KEEP_STEPS = 256  # steps a served dictionary's copies outlive their last use


class SAEFeatures(Feature):
    name = "features"

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._served: dict[int, tuple[Served, int]] = {}  # id(dictionary) -> it as served here, its last use
        self._step = 0
        self.rows_encoded = 0

    def check(self, value: FeatureReadOptions) -> None:
        if self.engine.distributed:
            raise InvalidOption("features", "features are not read under tensor parallelism")
        value.validate()

    def admit(self, value: FeatureReadOptions, num_prompt_tokens: int, model_config: Any) -> FeatureReadState:
        return FeatureReadState(value, num_prompt_tokens)

    @classmethod
    def max_cached(cls, state: FeatureReadState, seq: SequenceView) -> int | None:
        return state.options.first_prompt_position(state.num_prompt_tokens, state.read_upto.get(seq.seq_id, 0))

    def prepare(self, step: StepView) -> StepFeatures | None:
        self._step += 1
        if self._served:
            for key in [k for k, (_, last) in self._served.items() if self._step - last > KEEP_STEPS]:
                del self._served[key]
        counts: dict[int, int] = {}
        for seq, _ in step.sample:
            counts[id(seq)] = counts.get(id(seq), 0) + 1
        groups: dict[int, tuple[Served, list[_Row]]] = {}
        sampled: list[tuple[SequenceView, int, int]] = []
        for sl in step.rows:
            seq = sl.seq
            state: FeatureReadState | None = seq.request.state.get(self.name)
            if state is None:
                continue
            o, P = state.options, state.num_prompt_tokens
            n_sampled = counts.get(id(seq), 0)
            first_sampled = sl.num_computed + sl.num_new - n_sampled
            upto = state.read_upto.get(seq.seq_id, 0)
            rows = []
            for i in range(sl.num_new):
                p = sl.num_computed + i
                is_sampled = p >= first_sampled
                # a row that samples no token is read once, and only below P - 1 (P - 1 produces the first token)
                if (is_sampled or (upto <= p < P - 1)) and o.wants(p, P):
                    rows.append(_Row(seq, state, p, sl.start + i, is_sampled))
            state.read_upto[seq.seq_id] = max(upto, min(sl.num_computed + sl.num_new, P - 1))
            if rows:
                served = self._on_device(o.dictionary, step.device)
                groups.setdefault(id(served), (served, []))[1].extend(rows)
            if n_sampled:
                sampled.append((seq, first_sampled, n_sampled))
        if not groups and not sampled:
            return None
        part = StepFeatures(list(groups.values()), sampled)
        self.rows_encoded += sum(len(rows) for _, rows in groups.values())
        return part

    def _on_device(self, d: Dictionary, device: torch.device) -> Served:
        """The dictionary as this engine serves it, made once and kept while requests use it: one no step has used
        for `KEEP_STEPS` steps is dropped (an unloaded dictionary's memory goes once its last request is done)."""
        held = self._served.get(id(d))
        served = held[0] if held is not None and held[0].source is d else Served(d, device)
        self._served[id(d)] = (served, self._step)
        return served

    def metrics(self) -> dict[str, float]:
        return {"rows_encoded": float(self.rows_encoded)} if self.rows_encoded else {}
