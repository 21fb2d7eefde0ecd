"""model/hook_names.py: TransformerLens names and HF module paths onto (layer, site). The table below is written
from the two libraries' definitions; the HF modules each Hook names hold what our own network computes at that site
(a tiny random LLaMA saved by transformers, loaded here); TransformerLens' own hooks are checked against the same
map in tests/model/test_sae_reference.py (slow)."""

from __future__ import annotations

import pytest
import torch

from hf_checkpoints import save_tiny_llama
from model.attention import CausalAttention
from model.config import ModelConfig
from model.hook_names import DICTIONARY_SITES, ENGINE_SITES, NEW_SITES, Hook, parse_hook
from model.interventions import HEAD_SITES, SITES
from model.loaders.hf import load_hf

NAMES = {
    "hook_embed": Hook(0, "embeddings"),
    "blocks.0.hook_resid_pre": Hook(0, "embeddings"),
    "blocks.5.hook_resid_pre": Hook(4, "block_output"),
    "blocks.5.hook_resid_mid": Hook(5, "resid_mid"),
    "blocks.5.hook_mlp_in": Hook(5, "resid_mid"),
    "blocks.5.hook_resid_post": Hook(5, "block_output"),
    "blocks.5.hook_attn_out": Hook(5, "attention_output"),
    "blocks.5.hook_mlp_out": Hook(5, "mlp_output"),
    "blocks.5.attn.hook_z": Hook(5, "head_output"),
    "blocks.5.ln2.hook_normalized": Hook(5, "mlp_normalized"),
    "blocks.5.mlp.hook_post": Hook(5, "mlp_hidden"),
    "model.embed_tokens": Hook(0, "embeddings"),
    "model.layers.5": Hook(5, "block_output"),
    "model.layers.5.output": Hook(5, "block_output"),
    "model.layers.5.input": Hook(4, "block_output"),
    "model.layers.0.input": Hook(0, "embeddings"),
    "layers.5": Hook(5, "block_output"),  # sparsify's folder names, relative to the base model
    "layers.5.mlp": Hook(5, "mlp_output"),
    "layers.5.mlp.input": Hook(5, "mlp_input"),
    "model.layers.5.input_layernorm.input": Hook(4, "block_output"),
    "model.layers.5.self_attn": Hook(5, "attention_output"),
    "model.layers.5.self_attn.o_proj": Hook(5, "attention_output"),
    "model.layers.5.self_attn.o_proj.input": Hook(5, "head_output"),
    "model.layers.5.post_attention_layernorm.input": Hook(5, "resid_mid"),
    "model.layers.5.post_attention_layernorm": Hook(5, "mlp_input"),
    "model.layers.5.pre_feedforward_layernorm.output": Hook(5, "mlp_input"),  # Gemma Scope 2's name
    "model.layers.5.post_feedforward_layernorm.output": Hook(5, "mlp_output"),
    "model.layers.5.mlp.down_proj.input": Hook(5, "mlp_hidden"),
    "model.layers.5.mlp.down_proj": Hook(5, "mlp_output"),
}


@pytest.mark.parametrize("name", list(NAMES))
def test_names_map_onto_layer_and_site(name):
    assert parse_hook(name) == NAMES[name]


def test_every_site_names_itself_back():
    for site in DICTIONARY_SITES:
        hook = Hook(0 if site == "embeddings" else 3, site)
        if site != "mlp_normalized":  # no HF module holds it (x / rms(x) without the gain)
            path, side = hook.hf_module()
            assert parse_hook(path, side=side) == hook
        if site != "mlp_input":  # TransformerLens hooks the norm's output only without its gain
            assert parse_hook(hook.transformer_lens_name()) == hook


def test_a_hook_is_a_site_of_a_layer():
    with pytest.raises(ValueError, match="site: unknown"):
        Hook(1, "head_q")
    with pytest.raises(ValueError, match="layer 0"):
        Hook(2, "embeddings")


def test_the_sites_engine_and_new():
    assert set(ENGINE_SITES) <= set(SITES + HEAD_SITES)
    assert not set(NEW_SITES) & set(SITES + HEAD_SITES)
    cfg = ModelConfig(vocab_size=10, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=96, head_dim=24)
    widths = {s: Hook(0, s).width(cfg) for s in DICTIONARY_SITES}
    assert widths == {**{s: 64 for s in DICTIONARY_SITES}, "mlp_hidden": 96, "head_output": 4 * 24}


@pytest.mark.parametrize("name, side, fragment", [
    ("blocks.2.ln1.hook_normalized", None, "unknown hook"),
    ("blocks.2.hook_q", None, "unknown hook"),
    ("model.layers.2.input_layernorm", None, "is not a place"),
    ("model.layers.2.self_attn.input", None, "is not a place"),
    ("model.layers.2.mlp.gate_proj", None, "unknown module"),
    ("model.layers.2.mlp.input", "output", "the input"),
    ("transformer.h.2", None, "unknown hook"),
    ("", None, "not a hook name"),
])
def test_names_that_are_no_site_are_refused(name, side, fragment):
    with pytest.raises(ValueError, match=fragment) as e:
        parse_hook(name, side=side, where="sae.hook_name")
    assert str(e.value).startswith("sae.hook_name: ")


def test_the_model_bounds_the_layer_and_post_norm_refuses_norm_sites():
    cfg = ModelConfig(vocab_size=10, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=96)
    assert parse_hook("blocks.3.hook_resid_post", config=cfg) == Hook(3, "block_output")
    with pytest.raises(ValueError, match=r"layer 4, out of range \[0, 4\)"):
        parse_hook("blocks.4.hook_resid_post", config=cfg)
    with pytest.raises(ValueError, match=r"layer 4, out of range"):
        parse_hook("blocks.5.hook_resid_pre", config=cfg)
    post = cfg.replace(norm_placement="post")
    assert parse_hook("blocks.1.hook_mlp_out", config=post) == Hook(1, "mlp_output")
    with pytest.raises(ValueError, match="pre-norm"):
        parse_hook("blocks.1.ln2.hook_normalized", config=post)


class Recorder(CausalAttention):
    """Our network's sites as each block hands them to its context."""

    def __init__(self):
        super().__init__(None)
        self.values: dict[tuple[int, str], torch.Tensor] = {}

    def edit(self, layer, site, x):
        self.values[(layer, site)] = x.detach().reshape(x.shape[1], -1).clone()  # head sites: (T, H * E)
        return x


def test_hf_modules_hold_what_our_network_computes_there(tmp_path):
    """For each site a dictionary reads, the HF module's input or output that Hook.hf_module names equals our own
    forward's value there: the engine's sites as its blocks hand them over, the new ones from their definitions
    (resid_mid = the block's input + attention_output; mlp_input = ffn_norm(resid_mid); mlp_normalized =
    resid_mid / rms; mlp_hidden = silu(w1 x) * w3 x)."""
    hf = save_tiny_llama(tmp_path, num_hidden_layers=3)
    ours = load_hf(tmp_path)
    tokens = torch.tensor([[5, 17, 99, 3, 42, 8, 61, 23]])
    rec = Recorder()
    with torch.no_grad():
        h, cos, sin = ours.embed(tokens, torch.arange(8)[None])
        ref = {(0, "embeddings"): h[0].clone()}
        for i, blk in enumerate(ours.layers):
            x_in = h
            h = blk(h, cos, sin, rec)
            mid = x_in + rec.values[(i, "attention_output")].view_as(x_in)
            normed = blk.ffn_norm(mid)
            w13 = blk.feed_forward.w13(normed)
            F = w13.shape[-1] // 2
            ref.update({(i, "resid_mid"): mid[0], (i, "mlp_input"): normed[0],
                        (i, "mlp_normalized"): (mid * torch.rsqrt(mid.pow(2).mean(-1, keepdim=True) + 1e-5))[0],
                        (i, "mlp_hidden"): (torch.nn.functional.silu(w13[..., :F]) * w13[..., F:])[0]})
    ref.update({k: v for k, v in rec.values.items() if k[1] in ENGINE_SITES})
    for (layer, site), want in ref.items():
        hook = Hook(layer, site)
        if site == "mlp_normalized":
            path, side = f"model.layers.{layer}.post_attention_layernorm", "input"
        else:
            path, side = hook.hf_module()
        seen = {}

        def grab(module, args, output, side=side):  # returns None: the forward goes on unchanged
            seen["x"] = args[0] if side == "input" else (output[0] if isinstance(output, tuple) else output)

        handle = hf.get_submodule(path).register_forward_hook(grab)
        try:
            with torch.no_grad():
                hf(tokens)
        finally:
            handle.remove()
        got = seen["x"].reshape(tokens.shape[1], -1)
        if site == "mlp_normalized":
            got = got * torch.rsqrt(got.pow(2).mean(-1, keepdim=True) + hf.config.rms_norm_eps)
        assert torch.allclose(got, want, atol=1e-4 * want.abs().max().item()), (layer, site)
