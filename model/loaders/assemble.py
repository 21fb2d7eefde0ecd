"""Assemble a `Transformer` from named tensors: shape checks against the config, dtype/device cast, no double copy.

Loaders translate their file's names to ours (LLaMA names, docs/development.md rule 4) and hand tensors over one at
a time; the model is built on the meta device and its parameters are the handed-over tensors themselves.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from model.config import ModelConfig
from model.loaders.errors import CheckpointError
from model.loaders.progress import LoadProgress
from model.loaders.shard import WeightShard
from model.quantize import GROUP_SIZE, Int4Linear, Int8Linear, Quantization, QuantLinear, quantize_model
from model.loaders.families import OPTIONAL_NAMES, Family
from model.transformer import FUSED_BIAS_PARTS, FUSED_PARTS, Transformer

_LAYER_SHAPES = {
    "attention_norm.weight": lambda c: (c.dim,),
    "attention.wq.weight": lambda c: (c.n_heads * c.head_dim, c.dim),
    "attention.wk.weight": lambda c: (c.n_kv_heads * c.head_dim, c.dim),
    "attention.wv.weight": lambda c: (c.n_kv_heads * c.head_dim, c.dim),
    "attention.wo.weight": lambda c: (c.dim, c.n_heads * c.head_dim),
    "ffn_norm.weight": lambda c: (c.dim,),
    "feed_forward.w1.weight": lambda c: (c.hidden_dim, c.dim),
    "feed_forward.w3.weight": lambda c: (c.hidden_dim, c.dim),
    "feed_forward.w2.weight": lambda c: (c.dim, c.hidden_dim),
}


def _optional_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The family switches' own tensors (model/loaders/families.py OPTIONAL_NAMES) this config has."""
    H, K, E = c.n_heads, c.n_kv_heads, c.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if c.qkv_bias:
        shapes.update({"attention.bq": (H * E,), "attention.bk": (K * E,), "attention.bv": (K * E,)})
    if c.qk_norm != "none":
        q, k = (E, E) if c.qk_norm == "head" else (H * E, K * E)
        shapes.update({"attention.q_norm.weight": (q,), "attention.k_norm.weight": (k,)})
    return shapes


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> shape, in `Transformer.state_dict()` naming (fused modules as their parts). `output.weight`
    only when untied."""
    shapes = {"tok_embeddings.weight": (config.vocab_size, config.dim)}
    optional = _optional_shapes(config)
    for i in range(config.n_layers):
        for name, shape in _LAYER_SHAPES.items():
            shapes[f"layers.{i}.{name}"] = shape(config)
        for name, shape in optional.items():
            shapes[f"layers.{i}.{name}"] = shape
    shapes["norm.weight"] = (config.dim,)
    if not config.tie_embeddings:
        shapes["output.weight"] = (config.vocab_size, config.dim)
    return shapes


# Each block tensor's name, ours (Meta's llama names) / transformers' LlamaForCausalLM / GGUF's (ggml's docs/gguf.md
# "LLaMA"; GGUF adds ".weight" itself): the one table both loaders' name maps are built from.
LAYER_NAMES: list[tuple[str, str, str]] = [
    ("attention_norm.weight", "input_layernorm.weight", "attn_norm"),
    ("attention.wq.weight", "self_attn.q_proj.weight", "attn_q"),
    ("attention.wk.weight", "self_attn.k_proj.weight", "attn_k"),
    ("attention.wv.weight", "self_attn.v_proj.weight", "attn_v"),
    ("attention.wo.weight", "self_attn.o_proj.weight", "attn_output"),
    ("ffn_norm.weight", "post_attention_layernorm.weight", "ffn_norm"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight", "ffn_gate"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight", "ffn_up"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight", "ffn_down"),
]


def layer_names(family: Family) -> list[tuple[str, str, str]]:
    """`LAYER_NAMES` with `family`'s own names (model/loaders/families.py) and the optional tensors: ours, HF, GGUF."""
    table = {ours: (hf, gguf + ".weight") for ours, hf, gguf in LAYER_NAMES}
    table.update({ours: (hf, gguf) for ours, hf, gguf in OPTIONAL_NAMES})
    for ours in family.hf_names.keys() | family.gguf_names.keys():
        hf, gguf = table.get(ours, (None, None))
        table[ours] = (family.hf_names.get(ours, hf), family.gguf_names.get(ours, gguf))
    if "feed_forward.w13.weight" in family.gguf_names:  # (its ffn_up is the fused gate/up: no part of that name)
        table["feed_forward.w3.weight"] = (table["feed_forward.w3.weight"][0], None)
    return [(ours, hf, gguf) for ours, (hf, gguf) in table.items()]


def fused_parts(name: str) -> list[str] | None:
    """Our fused parameter name ("layers.0.attention.wqkv.weight") -> its parts' names, in order; None otherwise."""
    prefix, _, rest = name.partition(".")[2].partition(".")
    parts = FUSED_PARTS.get(rest.removesuffix(".weight")) if name.startswith("layers.") and rest.endswith(".weight") else None
    return None if parts is None else [f"layers.{prefix}.{p}.weight" for p in parts]


class NameMap:
    """A file format's tensor names -> ours: whole names for the top-level tensors, plus `layer_re` (groups: layer
    index, per-layer suffix) with a suffix table for the blocks. Unknown names map to None."""

    def __init__(self, top: dict[str, str], layer_re: str, layer: dict[str, str]) -> None:
        self.top, self.layer_re, self.layer = top, re.compile(layer_re), layer

    def __call__(self, name: str) -> str | None:
        if name in self.top:
            return self.top[name]
        m = self.layer_re.fullmatch(name)
        if m and m.group(2) in self.layer:
            return f"layers.{m.group(1)}.{self.layer[m.group(2)]}"
        return None


def quantized_kind(mode: str, name: str, rows: int, cols: int) -> str | None:
    """The format a float matrix, our parameter `name` (rows, cols), is quantized into under `mode`: the mode for a
    block's projection, int8 for the head and the embedding table (`quantize_model`); None: it stays in float (a
    norm, a matrix whose input is not whole blocks of 32, or no quantization). Int4 needs whole groups of 16 rows."""
    if mode == "none" or cols % GROUP_SIZE or not name.endswith(".weight"):
        return None
    if name in ("output.weight", "tok_embeddings.weight"):
        return "int8"
    if not name.startswith("layers.") or "_norm" in name:
        return None
    return "int4" if mode == "int4" and rows % 16 == 0 else "int8"


def module_of(name: str, tied: bool) -> str:
    """Our parameter name -> the module that serves it quantized (`quantize_model`'s `prequantized` keys): a block's
    projection ("layers.0.attention.wq"), the head ("output"; with tied embeddings the table is the head) or the
    embedding table ("tok_embeddings")."""
    if name == "tok_embeddings.weight":
        return "output" if tied else "tok_embeddings"
    return name.removesuffix(".weight")


class ModelAssembler:
    def __init__(self, config: ModelConfig, path: str, dtype: torch.dtype, device: torch.device | str, desc: str,
                 plan: WeightShard | None = None, quantization: Quantization = "none") -> None:
        """`plan`: a tensor-parallel rank's shard; tensors are then handed over already sliced, in its shapes.
        `quantization` "int8" / "int4": every matrix is quantized as it is handed over (`add`) or handed over
        quantized (`add_layer`), so no float copy of the model ever exists; `finish` installs them."""
        self.plan = plan
        config = plan.local_config if plan is not None else config
        self.config, self.path, self.dtype, self.device = config, path, dtype, torch.device(device)
        self.quantization = quantization
        self.expected = expected_shapes(config)
        self.tensors: dict[str, Tensor] = {}
        self.layers: dict[str, QuantLinear] = {}  # quantized modules by `module_of` name
        self.progress = LoadProgress(len(self.expected), desc)

    def check(self, name: str, shape: tuple[int, ...], source_name: str, source_file: str | None = None) -> tuple[int, ...]:
        """The shape our parameter `name` must have; a CheckpointError naming the file and tensor otherwise."""
        file = source_file or self.path
        want = self.expected.get(name)
        parts = fused_parts(name)
        if want is None and parts is not None and all(p in self.expected for p in parts):
            want = (sum(self.expected[p][0] for p in parts), *self.expected[parts[0]][1:])  # a fused matrix (Phi-3)
        if want is None:
            raise CheckpointError(f"unexpected tensor (maps to {name!r}, which this config does not have)", path=file, tensor=source_name)
        if tuple(shape) != want:
            raise CheckpointError(f"expected shape {list(want)}, found {list(shape)}", path=file, tensor=source_name)
        return want

    def add(self, name: str, tensor: Tensor, source_name: str, source_file: str | None = None) -> None:
        """Take `tensor` for our parameter `name`, read from tensor `source_name` of `source_file` (a shard). A
        fused matrix (Phi-3's qkv_proj, gate_up_proj) is taken as its parts, each a view of its rows."""
        self.check(name, tuple(tensor.shape), source_name, source_file)
        parts = fused_parts(name)
        if parts is not None and name not in self.expected:
            for part, piece in zip(parts, tensor.split([self.expected[p][0] for p in parts])):
                self.add(part, piece, source_name, source_file)
            return
        kind = quantized_kind(self.quantization, name, *tensor.shape) if tensor.dim() == 2 else None
        if kind is not None:
            cls = Int4Linear if kind == "int4" else Int8Linear
            self.add_layer(name, cls.from_float(tensor), source_name, source_file)
            return
        self.tensors[name] = tensor.to(device=self.device, dtype=self.dtype)
        self.progress.advance(source_name, self.tensors[name].nbytes)

    def add_layer(self, name: str, layer: QuantLinear, source_name: str, source_file: str | None = None,
                  rows: int | None = None) -> None:
        """Take an already quantized matrix for our parameter `name` (a file's own blocks, or one just rounded);
        `rows`: its rows, where the layer holds padding rows beyond them (an embedding table)."""
        shape = (rows or layer.out_features, layer.in_features)
        self.check(name, shape, source_name, source_file)
        self.layers[module_of(name, self.config.tie_embeddings)] = layer
        parts = fused_parts(name) if name not in self.expected else None
        for part in parts or [name]:  # a fused matrix quantized whole: its parts are placeholders (`stack_fused`)
            self.tensors[part] = torch.empty(*self.expected.get(part, shape), device="meta", dtype=self.dtype)
        self.progress.advance(source_name, layer.decode_bytes)

    def finish(self, rope_freq_factors: Tensor | None = None) -> Transformer:
        missing = [n for n in self.expected if n not in self.tensors]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"missing tensors (our names): {', '.join(missing[:5])}{more}", path=self.path)
        with torch.device("meta"):
            model = Transformer(self.config)
        model.load_state_dict(stack_fused(self.tensors, self.config.n_layers), strict=False, assign=True)
        self.tensors.clear()
        model.tie_weights()
        model.rope.reset(self.device, rope_freq_factors)
        if self.quantization != "none":
            quantize_model(model, self.quantization, self.layers)
        self.progress.close()
        if self.plan is not None:
            model.tp_plan = self.plan  # the whole model's config and this rank's slices (model/parallel/plan.py)
        return model.eval().requires_grad_(False)


def split_fused(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """The inverse of `stack_fused`: a state dict with each fused weight split back into its parts' names (views)."""
    rows = {name: shape(config)[0] for name, shape in _LAYER_SHAPES.items()}
    rows.update({name: shape[0] for name, shape in _optional_shapes(config).items()})
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        prefix, _, suffix = name.partition(".")[2].partition(".")  # "layers.0.attention.wqkv.weight": "0", ...
        if name.startswith("layers.") and suffix in FUSED_BIAS_PARTS:
            for part, piece in zip(FUSED_BIAS_PARTS[suffix], t.split([rows[p] for p in FUSED_BIAS_PARTS[suffix]])):
                out[f"layers.{prefix}.{part}"] = piece
            continue
        parts = FUSED_PARTS.get(suffix.removesuffix(".weight")) if name.startswith("layers.") else None
        if parts is None:
            out[name] = t
            continue
        for part, piece in zip(parts, t.split([rows[f"{p}.weight"] for p in parts])):
            out[f"layers.{prefix}.{part}.weight"] = piece
    return out


def stack_fused(tensors: dict[str, Tensor], n_layers: int) -> dict[str, Tensor]:
    """Our part names (wq, wk, wv; w1, w3) -> the fused modules' weights (`transformer.FUSED_PARTS`), parts stacked
    along the output dim in order; the parts are released as they are stacked. Other names pass through."""
    out = dict(tensors)
    for i in range(n_layers):
        for fused, parts in FUSED_PARTS.items():
            names = [f"layers.{i}.{p}.weight" for p in parts]
            out[f"layers.{i}.{fused}.weight"] = _cat_rows([out.pop(n) for n in names])
        for fused, parts in FUSED_BIAS_PARTS.items():  # Qwen2's q/k/v biases, where the model has them
            names = [f"layers.{i}.{p}" for p in parts]
            if names[0] in out:
                out[f"layers.{i}.{fused}"] = _cat_rows([out.pop(n) for n in names])
    return out


def _cat_rows(parts: list[Tensor]) -> Tensor:
    """torch.cat along dim 0; placeholders on the meta device (the layers converted as read hold the values) become
    one new placeholder, since a first meta-device torch.cat imports a large part of PyTorch (seconds of a start-up)."""
    if all(p.is_meta for p in parts):
        return torch.empty(sum(p.shape[0] for p in parts), *parts[0].shape[1:], device="meta", dtype=parts[0].dtype)
    return torch.cat(parts)
