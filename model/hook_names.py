"""Hook names: the names people give a place in the network, mapped onto this project's (layer, site).

Dictionaries (sparse autoencoders, transcoders) name where they read and write in one of two vocabularies:

TransformerLens' hook points (`transformer_lens/components/transformer_block.py`, `abstract_attention.py`,
`mlps/gated_mlp.py`, `rms_norm.py`; what SAELens' `hook_name` holds):

    hook_embed, blocks.0.hook_resid_pre   the residual stream's start                      -> (0, embeddings)
    blocks.L.hook_resid_pre               block L's input = block L-1's output             -> (L-1, block_output)
    blocks.L.hook_attn_out                the attention sub-block's output                 -> (L, attention_output)
    blocks.L.hook_resid_mid               the stream between attention and MLP             -> (L, resid_mid)
    blocks.L.hook_mlp_in                  the MLP's input before ln2 (= resid_mid in TL)   -> (L, resid_mid)
    blocks.L.ln2.hook_normalized          x / rms(x) of resid_mid, WITHOUT the norm's gain -> (L, mlp_normalized)
    blocks.L.mlp.hook_post                act(gate) * up, w2's input, F wide               -> (L, mlp_hidden)
    blocks.L.hook_mlp_out                 the MLP sub-block's output                       -> (L, mlp_output)
    blocks.L.hook_resid_post              the block's output                               -> (L, block_output)
    blocks.L.attn.hook_z                  every head's output before wo, (H, E) flattened  -> (L, head_output)

TransformerLens' RMSNorm applies `hook_normalized` to x / rms(x) before multiplying by the gain (`rms_norm.py`), and
its LLaMA weights fold the gain into the next linear layer (`fold_layer_norm`), so `ln2.hook_normalized` is not the
gained tensor HF's `post_attention_layernorm` returns: the two are distinct sites here (mlp_normalized, mlp_input).

HF module paths (`modeling_llama.py`; EleutherAI sparsify names its folders after them relative to the base model,
`layers.6`, `layers.6.mlp`; Gemma Scope 2's configs write `model.layers.6.output`): a module's output, or with
`.input` its first input (what sparsify's transcoders read, `sparsify/trainer.py`'s forward hook):

    model.embed_tokens                         output -> (0, embeddings)
    model.layers.L                             input  -> resid_pre of L         output -> (L, block_output)
    model.layers.L.input_layernorm             input  -> resid_pre of L
    model.layers.L.self_attn                                                    output -> (L, attention_output)
    model.layers.L.self_attn.o_proj            input  -> (L, head_output)       output -> (L, attention_output)
    model.layers.L.post_attention_layernorm    input  -> (L, resid_mid)         output -> (L, mlp_input)
    model.layers.L.pre_feedforward_layernorm   (Gemma's name for the same norm: likewise)
    model.layers.L.mlp                         input  -> (L, mlp_input)         output -> (L, mlp_output)
    model.layers.L.mlp.down_proj               input  -> (L, mlp_hidden)        output -> (L, mlp_output)
    model.layers.L.post_feedforward_layernorm  (Gemma's sandwich norm)          output -> (L, mlp_output)

The sites of model/interventions.py that exist on every execution path (ENGINE_SITES: the block's D-wide SITES
and head_output), among them those between the two sub-blocks,

    resid_mid        h + attention_output: the stream between the attention and the MLP sub-blocks     D
    mlp_input        ffn_norm(resid_mid): the MLP's normed input, gain included (HF's mlp input)        D
    mlp_normalized   resid_mid / rms(resid_mid): the same without the gain (TL's ln2.hook_normalized)   D

and those named here for dictionaries that the network does not hand its context yet (NEW_SITES):

    embeddings       the residual stream's start, the embedding rows (times Granite's multiplier)     D
    mlp_hidden       silu(w1 x) * w3 x: the MLP's hidden activation, w2's input                          F

Every name here is for the pre-norm LLaMA layout; a post-norm model (OLMo-2) puts its norms after each sub-block,
where these norm names mean other tensors, and they are refused for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Sites of model/interventions.py a dictionary can read (head_output: all heads, flattened to H * E).
ENGINE_SITES = ("attention_output", "resid_mid", "mlp_normalized", "mlp_input", "mlp_output", "block_output",
                "head_output")
NEW_SITES = ("embeddings", "mlp_hidden")
DICTIONARY_SITES = ENGINE_SITES + NEW_SITES
NORM_SITES = ("resid_mid", "mlp_input", "mlp_normalized")  # named through a norm module or TL's ln2


@dataclass(frozen=True)
class Hook:
    """A place a dictionary reads or writes: block `layer`'s `site` (see the module docstring)."""

    layer: int
    site: str

    def __post_init__(self) -> None:
        if self.site not in DICTIONARY_SITES:
            raise ValueError(f"site: unknown {self.site!r}; choose from {list(DICTIONARY_SITES)}")
        if self.site == "embeddings" and self.layer != 0:  # the stream's start is before block 0 only
            raise ValueError(f"layer: the embeddings are at layer 0, not {self.layer}")

    def width(self, config) -> int:  # a ModelConfig -> the activation's last dimension there
        if self.site == "mlp_hidden":
            return config.hidden_dim
        if self.site == "head_output":
            return config.n_heads * config.head_dim
        return config.dim

    def width_name(self) -> str:
        return {"mlp_hidden": "hidden_dim", "head_output": "n_heads * head_dim"}.get(self.site, "dim")

    def transformer_lens_name(self) -> str:
        """The canonical TransformerLens name of this place (the one SAELens configs written here carry)."""
        if self.site == "embeddings":
            return "blocks.0.hook_resid_pre"
        if self.site not in _TL_SUFFIX:  # mlp_input: TransformerLens hooks the norm's output only without its gain
            raise ValueError(f"{self.site} has no TransformerLens name; its HF module is {self.hf_module()}")
        return f"blocks.{self.layer}." + _TL_SUFFIX[self.site]

    def hf_module(self) -> tuple[str, str]:
        """(HF module path, "input" | "output") whose forward hook sees this place in a LLaMA of transformers."""
        if self.site == "embeddings":
            return "model.embed_tokens", "output"
        if self.site == "mlp_normalized":
            raise ValueError("mlp_normalized (TransformerLens' ln2.hook_normalized, x / rms(x) without the gain) is "
                             "no HF module's input or output")
        path, io = _HF_OF_SITE[self.site]
        return f"model.layers.{self.layer}" + (f".{path}" if path else ""), io


_TL_SUFFIX = {
    "block_output": "hook_resid_post", "attention_output": "hook_attn_out", "mlp_output": "hook_mlp_out",
    "head_output": "attn.hook_z", "resid_mid": "hook_resid_mid", "mlp_normalized": "ln2.hook_normalized",
    "mlp_hidden": "mlp.hook_post",
}
_TL_SITES = {
    "hook_resid_post": "block_output", "hook_attn_out": "attention_output", "hook_mlp_out": "mlp_output",
    "attn.hook_z": "head_output", "hook_resid_mid": "resid_mid", "hook_mlp_in": "resid_mid",
    "ln2.hook_normalized": "mlp_normalized", "mlp.hook_post": "mlp_hidden",
}
_HF_OF_SITE = {  # site -> (module under model.layers.L, which side)
    "block_output": ("", "output"), "attention_output": ("self_attn.o_proj", "output"),
    "mlp_output": ("mlp", "output"), "head_output": ("self_attn.o_proj", "input"),
    "resid_mid": ("post_attention_layernorm", "input"), "mlp_input": ("mlp", "input"),
    "mlp_hidden": ("mlp.down_proj", "input"),
}
_HF_SITES = {  # module under layers.L -> {side: site}; "resid_pre" resolves to the block before
    "": {"input": "resid_pre", "output": "block_output"},
    "input_layernorm": {"input": "resid_pre"},
    "self_attn": {"output": "attention_output"},
    "self_attn.o_proj": {"input": "head_output", "output": "attention_output"},
    "post_attention_layernorm": {"input": "resid_mid", "output": "mlp_input"},
    "pre_feedforward_layernorm": {"input": "resid_mid", "output": "mlp_input"},
    "mlp": {"input": "mlp_input", "output": "mlp_output"},
    "mlp.down_proj": {"input": "mlp_hidden", "output": "mlp_output"},
    "post_feedforward_layernorm": {"output": "mlp_output"},
}
_TL_RE = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_RE = re.compile(r"(?:model\.)*layers\.(\d+)(?:\.(.+?))?")


def _resid_pre(layer: int) -> Hook:
    # block L's input is block L-1's output; block 0's is the embeddings
    return Hook(0, "embeddings") if layer == 0 else Hook(layer - 1, "block_output")


def parse_hook(name: str, side: str | None = None, config=None, where: str = "hook_name") -> Hook:
    """A TransformerLens hook name or an HF module path (optionally ending in `.input` / `.output`, or with `side`
    "input" / "output"; default the output) -> its Hook. With `config` (a ModelConfig) the layer is checked against
    the model and post-norm models refuse the norm sites. ValueError naming `where` for anything else."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{where}: {why}")

    if not isinstance(name, str) or not name:
        raise bad(f"{name!r} is not a hook name")
    hook = _parse(name, side, bad)
    if config is not None:
        if not 0 <= hook.layer < config.n_layers:
            raise bad(f"{name!r} is at layer {hook.layer}, out of range [0, {config.n_layers})")
        if hook.site in NORM_SITES and getattr(config, "norm_placement", "pre") != "pre":
            raise bad(f"{name!r} names a pre-norm place, and this model puts its norms after each sub-block")
    return hook


def _parse(name: str, side: str | None, bad) -> Hook:
    if name in ("hook_embed", "embed_tokens", "model.embed_tokens", "model.embed_tokens.output"):
        return Hook(0, "embeddings")
    if m := _TL_RE.fullmatch(name):
        layer, suffix = int(m.group(1)), m.group(2)
        if suffix == "hook_resid_pre":
            return _resid_pre(layer)
        if suffix in _TL_SITES:
            return Hook(layer, _TL_SITES[suffix])
        raise bad(f"unknown hook {name!r}: a dictionary reads blocks.L.{{{', '.join(['hook_resid_pre', *_TL_SITES])}}}"
                  " or hook_embed")
    stem = name
    for s in ("input", "output"):
        if name.endswith("." + s):
            if side not in (None, s):
                raise bad(f"{name!r} names the {s}, and the {side} was asked for")
            stem, side = name[: -len(s) - 1], s
    side = side or "output"
    if side not in ("input", "output"):
        raise bad(f"side must be 'input' or 'output', got {side!r}")
    if m := _HF_RE.fullmatch(stem):
        layer, module = int(m.group(1)), m.group(2) or ""
        sites = _HF_SITES.get(module)
        if sites is None:
            raise bad(f"unknown module {name!r}: a dictionary reads model.layers.L[.{{{', '.join(k for k in _HF_SITES if k)}}}]")
        if side not in sites:
            raise bad(f"the {side} of {stem!r} is not a place a dictionary reads here "
                      f"(it has: {', '.join(sites)})")
        site = sites[side]
        return _resid_pre(layer) if site == "resid_pre" else Hook(layer, site)
    raise bad(f"unknown hook {name!r}: give a TransformerLens name (blocks.L.hook_resid_post, ...) or an HF module "
              "path (model.layers.L, model.layers.L.mlp, ...)")
