"""LoRA adapters served beside their base model, per row (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
Language Models"): a targeted projection's output gets scale * B (A x) for the rows of a request that named the
adapter, and nothing for every other row of the step.

An adapter is read from PEFT's format (`adapter_config.json` + `adapter_model.safetensors`, as `save_pretrained`
writes them: peft/tuners/lora/layer.py's `Linear.forward`, `result + lora_B(lora_A(x)) * scaling`, with scaling
lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA, Kalajdzievski 2023), or from llama.cpp's LoRA GGUF
(`convert_lora_to_gguf.py`: `<tensor>.lora_a` (r, in) and `.lora_b` (out, r) beside each adapted base tensor's name,
`adapter.lora.alpha`, scaling alpha / r as `llama-adapter.cpp` applies it, and lora_b's q/k rows permuted as the
base's are for architectures llama.cpp ropes interleaved). Its targets are the HF names of the
LLaMA block's projections; here q, k and v are one fused projection (and gate and up another,
model/transformer.py's FUSED_PARTS), so each target becomes a column range of the fused output.

The low-rank products go through `ops.linear` (x A^T) and `ops.lora_expand` (t B^T, by fused multiply-adds over the
rank in order), whose reduction orders do not depend on the number of rows: a row's output under its adapter is the
same floats whichever rows share its step (docs/development.md rule 8), and the native fused step
(csrc/step_layers.cpp) computes the same floats in its block loop.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from model.config import ModelConfig
from model.kernels import ops

# HF module name -> (site in model/transformer.py, which part of the site's fused output); None: the whole output
TARGETS: dict[str, tuple[str, str | None]] = {
    "q_proj": ("qkv", "q"), "k_proj": ("qkv", "k"), "v_proj": ("qkv", "v"), "qkv_proj": ("qkv", None),
    "o_proj": ("o", None),
    "gate_proj": ("w13", "gate"), "up_proj": ("w13", "up"), "gate_up_proj": ("w13", None),
    "down_proj": ("w2", None),
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAPart:
    """One target: columns [start, stop) of its site's output get scale * B (A x)."""

    start: int
    stop: int
    A: Tensor  # (r, in)
    BT: Tensor  # B transposed, (r, stop - start): the expanding product's layout (csrc/lora.cpp)
    scale: float
    # A holds this tensor-parallel rank's input columns only (a row-parallel site: model/parallel/plan.py), so x A^T
    # is a partial sum, all-reduced over the ranks before B
    partial: bool = False


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest of its targets' ranks
    serial: int = 0  # which load it is (`LoRA.add`, feature.py): the root of its requests' prefix-cache keys
    # (layer, site) -> its targets there
    parts: dict[tuple[int, str], list[LoRAPart]] = field(default_factory=dict)

    def to(self, dtype: torch.dtype, device: torch.device) -> "LoRAAdapter":
        for parts in self.parts.values():
            for p in parts:
                p.A, p.BT = p.A.to(device, dtype).contiguous(), p.BT.to(device, dtype).contiguous()
        return self

    def apply(self, layer: int, site: str, x: Tensor, y: Tensor) -> Tensor:
        """x (..., in), y (..., out): a projection's input and output, every row under this adapter (`LoRARows.apply`,
        y in place and returned): what a probe's context does for the one sequence it runs."""
        rows = torch.arange(x.numel() // x.shape[-1], device=x.device)
        return LoRARows([(self, rows)]).apply(layer, site, x, y)


def target(config: ModelConfig, module: str) -> tuple[str, int, int, int]:
    """An HF module name (`TARGETS`) -> its site, the columns [start, stop) it adds to in the site's fused output, and
    its input width."""
    site, part = TARGETS[module]
    H, K, E, D, F = config.n_heads, config.n_kv_heads, config.head_dim, config.dim, config.hidden_dim
    spans = {
        ("qkv", "q"): (0, H * E, D), ("qkv", "k"): (H * E, (H + K) * E, D), ("qkv", "v"): ((H + K) * E, (H + 2 * K) * E, D),
        ("qkv", None): (0, (H + 2 * K) * E, D), ("o", None): (0, D, H * E),
        ("w13", "gate"): (0, F, D), ("w13", "up"): (F, 2 * F, D), ("w13", None): (0, 2 * F, D), ("w2", None): (0, D, F),
    }
    return (site, *spans[(site, part)])


def hf_module(layer: int, module: str) -> str:
    """Block `layer`'s module `module` as transformers names it (`model.layers.0.self_attn.q_proj`)."""
    kind = "mlp" if TARGETS[module][0] in ("w13", "w2") else "self_attn"
    return f"model.layers.{layer}.{kind}.{module}"


def _alpha(cfg: dict, module: str) -> float:
    """lora_alpha, or alpha_pattern's entry for this module (PEFT matches a pattern key against the name's end)."""
    for key, alpha in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?{key}$", module):
            return float(alpha)
    return float(cfg.get("lora_alpha", 8))


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """A PEFT adapter folder, or llama.cpp's LoRA GGUF (a `.gguf` file), for a model of `config`."""
    if str(path).endswith(".gguf"):
        return load_gguf_lora(name, path, config, max_rank)
    return load_peft(name, path, config, max_rank)


def _assemble(name: str, source: str | Path, pairs: dict[tuple[int, str], dict[str, Tensor]],
              alpha_of: Callable[[int, str], float | None], rs: bool, config: ModelConfig,
              max_rank: int) -> LoRAAdapter:
    """(block, HF module) -> {"A": (r, in), "B": (out, r)} read from a file -> the adapter (each pair whole)."""
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: {source} holds no LoRA weights")
    adapter = LoRAAdapter(name, str(source), 0)
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: block {layer} {module} has lora_{''.join(ab)} without its pair")
        _add_part(adapter, layer, module, ab["A"].float(), ab["B"].float(), alpha_of(layer, module), rs, config,
                  max_rank)
    return adapter


def _add_part(adapter: LoRAAdapter, layer: int, module: str, A: Tensor, B: Tensor, alpha: float | None,
              rs: bool, config: ModelConfig, max_rank: int) -> None:
    """One target (HF module name) of block `layer`: checked against the model and added. alpha None: scale 1."""
    name = adapter.name
    site, start, stop, fan_in = target(config, module)
    r = A.shape[0]
    if A.shape != (r, fan_in) or B.shape != (stop - start, r):
        raise ValueError(f"LoRA adapter {name!r}: block {layer} {module} has A {tuple(A.shape)}, B "
                         f"{tuple(B.shape)}; this model needs A (r, {fan_in}) and B ({stop - start}, r)")
    if r > max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {r} exceeds --max-lora-rank {max_rank}")
    scale = 1.0 if alpha is None else alpha / math.sqrt(r) if rs else alpha / r
    for other in adapter.parts.get((layer, site), []):  # (qkv_proj beside q_proj, say): added in one pass
        if start < other.stop and other.start < stop:
            raise ValueError(f"LoRA adapter {name!r}: block {layer} {module} overlaps another of its targets")
    adapter.parts.setdefault((layer, site), []).append(LoRAPart(start, stop, A, B.t().contiguous(), scale))
    adapter.rank = max(adapter.rank, r)


# llama.cpp's GGUF names of the adapted tensors (conversion's tensor map) -> the HF module names above
GGUF_TARGETS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_qkv": "qkv_proj",
                "attn_output": "o_proj", "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_GGUF_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


def load_gguf_lora(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """llama.cpp's LoRA GGUF for a model of `config` -> its parts (float32, on the CPU); ValueError naming the file
    and what is wrong."""
    from model.loaders.gguf_file import dequantized, family_of, open_gguf, unpermute_qk

    try:
        reader = open_gguf(path)
    except Exception as e:  # noqa: BLE001 - not a GGUF at all: the one-line reason
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a readable GGUF file ({e})") from None
    meta = reader.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a LoRA adapter GGUF (general.type "
                         f"{meta.get('general.type')!r}, adapter.type {meta.get('adapter.type')!r})")
    family = family_of(reader)
    fused_up = "feed_forward.w13.weight" in family.gguf_names  # (Phi-3: its ffn_up is gate and up together)
    alpha = float(meta.get("adapter.lora.alpha") or 0.0)
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    for t in reader.tensors:
        m = _GGUF_KEY.match(t.name)
        if m is None or m.group(2) not in GGUF_TARGETS:
            raise ValueError(f"LoRA adapter {name!r}: tensor {t.name!r} targets a tensor this server cannot adapt "
                             f"(adaptable: {', '.join(GGUF_TARGETS)} of each block)")
        layer, module = int(m.group(1)), GGUF_TARGETS[m.group(2)]
        if fused_up and module == "up_proj":
            module = "gate_up_proj"
        if layer >= config.n_layers:
            raise ValueError(f"LoRA adapter {name!r}: {t.name!r} names block {layer}; the model has {config.n_layers}")
        w = dequantized(t, str(path))  # lora_a (r, in), lora_b (out, r)
        if m.group(3) == "b" and family.permuted_qk and module in ("q_proj", "k_proj"):
            w = unpermute_qk(w, config.n_heads if module == "q_proj" else config.n_kv_heads)
        pairs.setdefault((layer, module), {})[m.group(3).upper()] = torch.from_numpy(w.copy())
    # llama-adapter.cpp: scale = alpha / rank, or 1 without an alpha
    return _assemble(name, path, pairs, lambda layer, module: alpha or None, False, config, max_rank)


def load_peft(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """A PEFT LoRA adapter folder for a model of `config` -> its parts (float32, on the CPU). ValueError, naming the
    folder and what is wrong, for anything this cannot serve exactly."""
    from safetensors.torch import load_file

    folder = Path(path)
    cfg_path, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {folder} needs adapter_config.json and adapter_model.safetensors "
                         "(PEFT's save_pretrained)")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r}; only LORA is served")
    refusals = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights", "modules_to_save": "modules_to_save",
                "layers_pattern": "layers_pattern", "use_qalora": "QALoRA"}
    for key, what in refusals.items():
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias {cfg['bias']!r} is not supported (only 'none')")
    tensors = load_file(str(weights))
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} targets a module this server cannot adapt "
                             f"(adaptable: {', '.join(TARGETS)} of each block)")
        layer = int(m.group(1))
        if layer >= config.n_layers:
            raise ValueError(f"LoRA adapter {name!r}: {key!r} names block {layer}; the model has {config.n_layers}")
        pairs.setdefault((layer, m.group(2)), {})[m.group(3)] = t

    return _assemble(name, folder, pairs, lambda layer, module: _alpha(cfg, hf_module(layer, module)),
                     bool(cfg.get("use_rslora")), config, max_rank)


SITES = ("qkv", "o", "w13", "w2")  # the native step's site numbers (csrc/ops.h's LoRAPart)


@dataclass
class LoRARows:
    """A step's rows under adapters: for each adapter with rows in the step, the packed rows (n,) it owns."""

    groups: list[tuple[LoRAAdapter, Tensor]]
    host_rows: list[list[int]] = field(default_factory=list)  # the same rows on the host, where the caller has them

    def rows_on_host(self, g: int) -> list[int]:
        """Group g's rows as a host list: the caller's, else read back from the device."""
        return self.host_rows[g] if self.host_rows else self.groups[g][1].tolist()

    def native_args(self, n_layers: int) -> tuple[list[Tensor], list[list[tuple]]]:
        """The same targets as step_layers takes them: each group's rows, and per block its targets (group, site,
        start, stop, scale, A, B)."""
        per_layer: list[list[tuple]] = [[] for _ in range(n_layers)]
        for g, (adapter, _) in enumerate(self.groups):
            for (layer, site), parts in adapter.parts.items():
                per_layer[layer] += [(g, SITES.index(site), p.start, p.stop, p.scale, p.A, p.BT) for p in parts]
        return [rows for _, rows in self.groups], per_layer

    def apply(self, layer: int, site: str, x: Tensor, y: Tensor) -> Tensor:
        """x (B, T, in), y (B, T, out): a projection's input and output; each adapter's rows of y get its deltas
        (in place, y returned)."""
        xf, yf = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for adapter, rows in self.groups:
            parts = adapter.parts.get((layer, site))
            if not parts:
                continue
            xs = xf.index_select(0, rows)  # (n, in)
            for p in parts:
                t = ops.linear(xs, p.A)  # (n, r)
                if p.partial:
                    dist.all_reduce(t)  # every rank the same (n, r), then the same delta on the all-reduced output
                delta = ops.lora_expand(t, p.BT).to(yf.dtype) * p.scale  # (n, stop - start)
                yf[rows, p.start : p.stop] += delta
        return y
