"""Dictionaries against their own libraries: for every architecture, a random dictionary saved by SAELens itself (and
by EleutherAI sparsify, and files laid out as SAELens' Llama Scope and Gemma Scope converters read them), loaded
here and run on HF transformers' activations of a tiny random LLaMA at the place its hook names, gives the features
(and reconstructions, transcoder outputs) the library's own encode gives on the same activations, within 1e-4 of
the largest. And TransformerLens' hooks on the same weights hold what model/hook_names.py says each name is.

Slow: importing SAELens (TransformerLens, wandb, datasets) is seconds of CPU on its own."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hf_checkpoints import tiny_llama_config
from model.features.sae import Dictionary, load_dictionary
from model.hook_names import parse_hook

os.environ.setdefault("SPARSIFY_DISABLE_TRITON", "1")  # its Triton decoder is for CUDA tensors
pytestmark = pytest.mark.slow
sae_lens = pytest.importorskip("sae_lens")

TOKENS = torch.tensor([[5, 17, 99, 3, 42, 8, 61, 23, 77, 14, 90, 2, 33, 50]])


@pytest.fixture(scope="module")
def hf():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.ndim > 1 else 1.0)
    return model


def hf_activation(hf, name: str) -> torch.Tensor:
    """The activation at hook `name` (a TransformerLens name or HF module path) on TOKENS: (T, width), read by a
    forward hook on the HF module model/hook_names.py names for it."""
    hook = parse_hook(name, config=None)
    if hook.site == "mlp_normalized":  # TL's ln2.hook_normalized: resid_mid / rms, without the norm's gain
        x = hf_activation(hf, f"model.layers.{hook.layer}.post_attention_layernorm.input")
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf.config.rms_norm_eps)
    path, side = hook.hf_module()
    seen = {}

    def grab(module, args, output):
        x = args[0] if side == "input" else (output[0] if isinstance(output, tuple) else output)
        seen["x"] = x.detach()

    handle = hf.get_submodule(path).register_forward_hook(grab)
    try:
        with torch.no_grad():
            hf(TOKENS)
    finally:
        handle.remove()
    return seen["x"].reshape(TOKENS.shape[1], -1).float()


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    ours, ref = ours.detach().float(), ref.detach().float()
    assert ours.shape == ref.shape
    assert ref.abs().max() > 0
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), f"max error {err} vs largest {ref.abs().max().item()}"


def sparse_enough(f: torch.Tensor) -> None:
    """The activation bites: some features are active and most are not (a wrong threshold or k shows)."""
    active = (f != 0).float().mean().item()
    assert 0.0 < active < 0.9, active


def randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim > 1 else 0.5))


def set_thresholds(sae, x: torch.Tensor) -> None:
    """JumpReLU thresholds that keep some positive pre-activations and drop others."""
    with torch.no_grad():
        pre = x.to(sae.W_enc.dtype) @ sae.W_enc + sae.b_enc
        g = torch.Generator().manual_seed(1)
        sae.threshold.copy_(torch.rand(sae.threshold.shape, generator=g) * pre.relu().quantile(0.9).item())


def metadata(hook_name: str, hook_name_out: str | None = None):
    from sae_lens.saes.sae import SAEMetadata

    return SAEMetadata(hook_name=hook_name, **({"hook_name_out": hook_name_out} if hook_name_out else {}))


# (architecture, config fields, hook_name, hook_name_out): every inference architecture SAELens registers that is
# served here, at sites across the block
SAES = {
    "standard": ("StandardSAE", {}, "blocks.1.hook_resid_post", None),
    "standard-constant_norm_rescale": ("StandardSAE", {"normalize_activations": "constant_norm_rescale"},
                                       "blocks.2.hook_mlp_out", None),
    "standard-layer_norm": ("StandardSAE", {"normalize_activations": "layer_norm"}, "blocks.0.hook_attn_out", None),
    "jumprelu": ("JumpReLUSAE", {"apply_b_dec_to_input": False}, "blocks.2.hook_resid_pre", None),
    "topk": ("TopKSAE", {"k": 5}, "blocks.1.hook_resid_mid", None),
    "topk-rescaled": ("TopKSAE", {"k": 7, "rescale_acts_by_decoder_norm": True}, "blocks.0.hook_resid_pre", None),
    "gated": ("GatedSAE", {"reshape_activations": "hook_z"}, "blocks.1.attn.hook_z", None),
    "transcoder": ("Transcoder", {"apply_b_dec_to_input": False}, "blocks.1.ln2.hook_normalized",
                   "blocks.1.hook_mlp_out"),
    "skip_transcoder": ("SkipTranscoder", {"apply_b_dec_to_input": False}, "blocks.2.hook_resid_mid",
                        "blocks.2.hook_resid_post"),
    "jumprelu_transcoder": ("JumpReLUTranscoder", {"apply_b_dec_to_input": False}, "blocks.0.mlp.hook_post",
                            "blocks.0.hook_mlp_out"),
    "jumprelu_skip_transcoder": ("JumpReLUSkipTranscoder", {"apply_b_dec_to_input": False},
                                 "blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out"),
}


@pytest.mark.parametrize("case", list(SAES))
def test_saelens_saved_dictionaries_encode_as_saelens(case, hf, tmp_path):
    import sae_lens.saes as saes

    cls_name, fields, hook_name, hook_name_out = SAES[case]
    cls = getattr(saes, cls_name)
    x = hf_activation(hf, hook_name)
    d_in, d_sae = x.shape[-1], 96
    kw = dict(d_in=d_in, d_sae=d_sae, metadata=metadata(hook_name, hook_name_out), **fields)
    if hook_name_out:
        kw["d_out"] = hf_activation(hf, hook_name_out).shape[-1]
    sae = cls(getattr(saes, cls_name + "Config")(**kw))
    randomize(sae, seed=len(case))
    if hasattr(sae, "threshold"):
        set_thresholds(sae, x)
    sae.save_model(tmp_path)
    ref = sae_lens.SAE.load_from_disk(tmp_path)  # SAELens' own reading of its own file

    ours = load_dictionary(tmp_path)
    assert isinstance(ours, Dictionary) and ours.hook_in == parse_hook(hook_name)
    x_in = x.view(x.shape[0], 4, -1) if fields.get("reshape_activations") == "hook_z" else x  # hook_z: (T, H, E)
    f_ref = ref.encode(x_in)
    close(ours.encode(x), f_ref)
    sparse_enough(f_ref)
    out_ref = ref.forward(x_in) if hook_name_out else ref.decode(f_ref)
    close(ours.forward(x)[0], out_ref.reshape(x.shape[0], -1))


def test_batchtopk_is_served_as_saelens_saves_it_for_inference(hf, tmp_path):
    """A BatchTopK training checkpoint (its scalar topk_threshold, decoder norms not folded) and the JumpReLU SAELens
    saves for inference both encode as that JumpReLU does."""
    from sae_lens.saes import BatchTopKTrainingSAE, BatchTopKTrainingSAEConfig

    hook_name = "blocks.1.hook_resid_post"
    x = hf_activation(hf, hook_name)
    sae = BatchTopKTrainingSAE(BatchTopKTrainingSAEConfig(d_in=x.shape[-1], d_sae=96, k=6.0,
                                                          metadata=metadata(hook_name)))
    randomize(sae, seed=3)
    sae.topk_threshold = torch.tensor(0.7 * sae.encode(x).max().item() / 3, dtype=torch.double)
    sae.save_model(tmp_path / "training")
    sae.save_inference_model(tmp_path / "inference")
    assert json.loads((tmp_path / "inference" / "cfg.json").read_text())["architecture"] == "jumprelu"
    ref = sae_lens.SAE.load_from_disk(tmp_path / "inference")
    f_ref = ref.encode(x)
    sparse_enough(f_ref)
    for folder in ("training", "inference"):
        ours = load_dictionary(tmp_path / folder)
        assert ours.activation == "jumprelu"
        close(ours.encode(x), f_ref)
        close(ours.forward(x)[0], ref.decode(f_ref))


def test_pre_6_layout_reads_as_saelens_reads_it(hf, tmp_path):
    """The older cfg.json (top-level hook_point, activation_fn_str "topk" with its k, a boolean
    normalize_activations, no version) of a TopK SAE: as SAELens' own pre-6.0 handling reads it."""
    from sae_lens.saes import TopKSAE, TopKSAEConfig

    x = hf_activation(hf, "blocks.2.hook_resid_post")
    sae = TopKSAE(TopKSAEConfig(d_in=x.shape[-1], d_sae=80, k=4, metadata=metadata("blocks.2.hook_resid_post")))
    randomize(sae, seed=4)
    sae.save_model(tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps({
        "d_in": x.shape[-1], "d_sae": 80, "dtype": "float32", "device": "cpu", "hook_point": "blocks.2.hook_resid_post",
        "hook_point_layer": 2, "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 4},
        "apply_b_dec_to_input": True, "normalize_activations": False, "model_name": "tiny"}))
    ref = sae_lens.SAE.load_from_disk(tmp_path)
    assert ref.cfg.architecture() == "topk"
    ours = load_dictionary(tmp_path)
    assert (ours.activation, ours.k, ours.hook_in) == ("topk", 4, parse_hook("blocks.2.hook_resid_post"))
    close(ours.encode(x), ref.encode(x))


SPARSIFY = {  # folder (the HF module), config
    "layers.1": dict(k=6, num_latents=96),
    "layers.2": dict(k=8, num_latents=128, activation="groupmax"),
    "layers.0.mlp": dict(k=5, num_latents=96, transcode=True, skip_connection=True),
}


@pytest.mark.parametrize("module", list(SPARSIFY))
def test_sparsify_saved_coders_encode_as_sparsify(module, hf, tmp_path):
    from sparsify import SparseCoder, SparseCoderConfig

    cfg = SparseCoderConfig(**SPARSIFY[module])
    # an autoencoder reads the module's output; a transcoder its input, predicting its output
    x = hf_activation(hf, module + (".input" if cfg.transcode else ""))
    coder = SparseCoder(x.shape[-1], cfg)
    randomize(coder, seed=7)
    coder.save_to_disk(tmp_path / module)
    ref = SparseCoder.load_from_disk(tmp_path / module)
    top_acts, top_ids, _ = ref.encode(x)
    f_ref = torch.zeros(x.shape[0], ref.num_latents).scatter_(-1, top_ids, top_acts)

    ours = load_dictionary(tmp_path / module)
    assert ours.hook_in == parse_hook(module + (".input" if cfg.transcode else ""))
    close(ours.encode(x), f_ref)
    sparse_enough(f_ref)
    y = hf_activation(hf, module) if cfg.transcode else None
    close(ours.forward(x)[0], ref.forward(x, y).sae_out)


def fake_hub(monkeypatch, root: Path):
    """SAELens' converters fetch from the Hub; here they read `root`/repo_id/... (their own parsing is the test)."""
    from huggingface_hub.utils import EntryNotFoundError

    import sae_lens.loading.pretrained_sae_loaders as loaders

    def download(repo_id, filename=None, subfolder=None, **_):
        p = root / repo_id / (subfolder or "") / filename
        if not p.exists():
            raise EntryNotFoundError(str(p))
        return str(p)

    def shapes(repo_id, filename):
        from safetensors import safe_open

        with safe_open(str(root / repo_id / filename), "pt") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118

    monkeypatch.setattr(loaders, "hf_hub_download", download)
    monkeypatch.setattr(loaders, "get_safetensors_tensor_shapes", shapes)
    return loaders


def saelens_from(cfg_dict: dict, state_dict: dict):
    """What `SAE.from_pretrained` builds from a converter's output."""
    from sae_lens.loading.pretrained_sae_loaders import handle_config_defaulting

    cfg_dict = handle_config_defaulting(cfg_dict)
    arch = cfg_dict["architecture"]
    sae = sae_lens.SAE.get_sae_class_for_architecture(arch)(
        sae_lens.SAE.get_sae_config_class_for_architecture(arch).from_dict(cfg_dict))
    sae.process_state_dict_for_loading(state_dict)
    sae.load_state_dict(state_dict)
    return sae


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) * (0.3 if len(s) > 1 else 0.5) for k, s in shapes.items()}


def test_llama_scope_files_read_as_saelens_converts_them(hf, monkeypatch, tmp_path):
    """hyperparams.json + checkpoints/final.safetensors, with the dataset-norm rescaling SAELens applies: its
    converter's output, folded by the release's norm_scaling_factor (sqrt(D) / the dataset's input norm)."""
    x = hf_activation(hf, "blocks.1.hook_resid_post")
    D, F, norm_in = x.shape[-1], 128, 3.0 * x.norm(dim=-1).mean().item()
    folder = tmp_path / "fnlp" / "Llama3_1-8B-Base-LXR-8x" / "Llama3_1-8B-Base-L1R-8x"
    (folder / "checkpoints").mkdir(parents=True)
    hp = {"d_model": D, "d_sae": F, "hook_point_in": "blocks.1.hook_resid_post",
          "hook_point_out": "blocks.1.hook_resid_post", "act_fn": "jumprelu", "jump_relu_threshold": 0.2,
          "norm_activation": "dataset-wise", "dataset_average_activation_norm": {"in": norm_in, "out": norm_in},
          "apply_decoder_bias_to_pre_encoder": False, "top_k": 50}
    (folder / "hyperparams.json").write_text(json.dumps(hp))
    save_file(random_tensors({"encoder.weight": (F, D), "encoder.bias": (F,), "decoder.weight": (D, F),
                              "decoder.bias": (D,)}, seed=11), folder / "checkpoints" / "final.safetensors")

    loaders = fake_hub(monkeypatch, tmp_path)
    cfg_dict, state_dict, _ = loaders.llama_scope_sae_huggingface_loader(
        "fnlp/Llama3_1-8B-Base-LXR-8x", "Llama3_1-8B-Base-L1R-8x", cfg_overrides={"dtype": "float32"})
    ref = saelens_from(cfg_dict, state_dict)
    ref.fold_activation_norm_scaling_factor(D ** 0.5 / norm_in)
    ours = load_dictionary(folder)
    assert ours.hook_in == parse_hook("blocks.1.hook_resid_post") and not ours.transcoder
    f_ref = ref.encode(x)
    sparse_enough(f_ref)
    close(ours.encode(x), f_ref)
    close(ours.forward(x)[0], ref.decode(f_ref))


def test_gemma_scope_1_params_npz_reads_as_saelens_converts_it(hf, monkeypatch, tmp_path):
    x = hf_activation(hf, "blocks.2.hook_resid_post")
    D, F = x.shape[-1], 128
    repo, folder = "google/gemma-scope-2b-pt-res", "layer_2/width_16k/average_l0_71"
    (tmp_path / repo / folder).mkdir(parents=True)
    t = random_tensors({"W_enc": (D, F), "W_dec": (F, D), "b_enc": (F,), "b_dec": (D,)}, seed=12)
    t["threshold"] = torch.rand(F, generator=torch.Generator().manual_seed(2)) * 2.0
    np.savez(tmp_path / repo / folder / "params.npz", **{k: v.numpy() for k, v in t.items()})

    loaders = fake_hub(monkeypatch, tmp_path)
    cfg_dict, state_dict, _ = loaders.gemma_2_sae_huggingface_loader(repo, folder, cfg_overrides={"d_in": D,
                                                                                                  "d_sae": F})
    ref = saelens_from(cfg_dict, state_dict)
    ours = load_dictionary(tmp_path / repo / folder)
    assert ours.hook_in == parse_hook(cfg_dict["hook_name"])
    f_ref = ref.encode(x)
    sparse_enough(f_ref)
    close(ours.encode(x), f_ref)
    close(ours.forward(x)[0], ref.decode(f_ref))


@pytest.mark.parametrize("kind", ["resid_post", "transcoder"])
def test_gemma_scope_2_params_safetensors_read_as_saelens_converts_them(kind, hf, monkeypatch, tmp_path):
    """A residual SAE with its config.json (HF module names), and an affine skip transcoder named by its folders
    alone (SAELens infers the MLP's normed input and output)."""
    repo = "google/gemma-scope-2-270m-pt"
    if kind == "resid_post":
        folder, name_in, name_out = "resid_post/layer_1_width_16k_l0_small", "model.layers.1.output", None
    else:
        folder, name_in, name_out = ("transcoder/layer_0_width_16k_l0_small_affine", "model.layers.0.mlp.input",
                                     "model.layers.0.mlp")
    x = hf_activation(hf, name_in)
    D, F = x.shape[-1], 128
    (tmp_path / repo / folder).mkdir(parents=True)
    t = random_tensors({"w_enc": (D, F), "w_dec": (F, D), "b_enc": (F,), "b_dec": (D,)}, seed=13)
    t["threshold"] = torch.rand(F, generator=torch.Generator().manual_seed(3)) * 2.0
    if name_out:
        t["affine_skip_connection"] = torch.randn(D, D, generator=torch.Generator().manual_seed(4)) * 0.1
    save_file(t, tmp_path / repo / folder / "params.safetensors")
    if kind == "resid_post":
        (tmp_path / repo / folder / "config.json").write_text(json.dumps({
            "architecture": "jump_relu", "model_name": "gemma-v3-270m-pt", "hf_hook_point_in": name_in}))

    loaders = fake_hub(monkeypatch, tmp_path)
    cfg_dict, state_dict, _ = loaders.gemma_3_sae_huggingface_loader(repo, folder)
    ref = saelens_from(cfg_dict, state_dict)
    ours = load_dictionary(tmp_path / repo / folder)
    assert ours.hook_in == parse_hook(name_in)
    f_ref = ref.encode(x)
    sparse_enough(f_ref)
    close(ours.encode(x), f_ref)
    if name_out:
        assert ours.transcoder and ours.hook_out == parse_hook(name_out)
        close(ours.forward(x)[0], ref.forward(x))
    else:
        close(ours.forward(x)[0], ref.decode(f_ref))


TL_NAMES = ["hook_embed", "blocks.0.hook_resid_pre", "blocks.2.hook_resid_pre", "blocks.1.hook_resid_mid",
            "blocks.1.hook_mlp_in", "blocks.1.ln2.hook_normalized", "blocks.1.mlp.hook_post", "blocks.0.hook_attn_out",
            "blocks.2.hook_mlp_out", "blocks.1.hook_resid_post", "blocks.2.attn.hook_z"]


def test_transformer_lens_hooks_hold_what_the_names_map_to(hf):
    """TransformerLens' own model on the same weights (its LLaMA conversion, no folding): each hook's cache equals
    the HF module input or output model/hook_names.py maps the name to."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights

    c = hf.config
    cfg = HookedTransformerConfig(
        d_model=c.hidden_size, d_head=c.hidden_size // c.num_attention_heads, n_heads=c.num_attention_heads,
        d_mlp=c.intermediate_size, n_layers=c.num_hidden_layers, n_ctx=64, eps=c.rms_norm_eps, d_vocab=c.vocab_size,
        act_fn="silu", n_key_value_heads=c.num_key_value_heads, normalization_type="RMS",
        positional_embedding_type="rotary", rotary_adjacent_pairs=False, rotary_dim=c.hidden_size // c.num_attention_heads,
        rotary_base=10000.0, final_rms=True, gated_mlp=True, original_architecture="LlamaForCausalLM")
    tl = HookedTransformer(cfg)
    tl.load_and_process_state_dict(convert_llama_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                   center_unembed=False, fold_value_biases=False)
    tl.set_use_hook_mlp_in(True)  # hook_mlp_in exists only when asked for
    with torch.no_grad():
        logits, cache = tl.run_with_cache(TOKENS)
        close(logits[0], hf(TOKENS).logits[0])  # the same network
    for name in TL_NAMES:
        close(hf_activation(hf, name), cache[name][0].reshape(TOKENS.shape[1], -1))


def test_saelens_reads_the_shipped_dictionary_as_we_do():
    """The SAE shipped for the default model is a SAELens file: SAELens' own load of it encodes and decodes as ours
    (on activations of the training data's scale)."""
    shipped = Path(__file__).resolve().parents[2] / "model/features/sae/shipped"
    folders = [p for p in shipped.iterdir() if (p / "cfg.json").exists()]
    assert folders
    for folder in folders:
        ref = sae_lens.SAE.load_from_disk(folder)
        ours = load_dictionary(folder)
        run = json.loads((folder / "training.json").read_text())
        x = torch.randn(32, ours.d_in, generator=torch.Generator().manual_seed(5)) * ours.d_in ** 0.5 / run["scale"]
        x = x / ours.d_in ** 0.5  # a mean norm of about sqrt(D) / scale, the activations' own
        f_ref = ref.encode(x)
        close(ours.encode(x), f_ref)
        close(ours.forward(x)[0], ref.decode(f_ref))
