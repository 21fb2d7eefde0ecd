"""Dictionary files refused as a server must refuse them, each with a DictionaryError naming the field: a path outside
the allowed directories (a symlink leading out included), a bound on memory, a dictionary that does not fit the model
(width, layer, unknown hook), malformed or foreign files; and the dictionary shipped for the default model loads,
fits it and encodes sparsely. The encoders' math against SAELens' and sparsify's own: tests/model/test_sae_reference.py
(slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model.config import KNOWN_SHAPES, ModelConfig
from model.features.sae import DictionaryError, load_dictionary, top_features
from model.hook_names import Hook

CFG = ModelConfig(vocab_size=10, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=96)
SHIPPED = Path(__file__).resolve().parents[2] / "model/features/sae/shipped"


def write_saelens(folder: Path, d_in: int = 64, d_sae: int = 32, hook_name: str = "blocks.1.hook_resid_post",
                  architecture: str = "topk", **fields) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    save_file({"W_enc": torch.randn(d_in, d_sae, generator=g), "b_enc": torch.zeros(d_sae),
               "W_dec": torch.randn(d_sae, d_in, generator=g), "b_dec": torch.zeros(d_in)},
              folder / "sae_weights.safetensors")
    cfg = {"architecture": architecture, "d_in": d_in, "d_sae": d_sae, "k": 4, "dtype": "float32",
           "apply_b_dec_to_input": True, "normalize_activations": "none",
           "metadata": {"hook_name": hook_name, "sae_lens_version": "6.54.12"}, **fields}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return folder


def refused(field: str, fragment: str, path, **kw) -> DictionaryError:
    with pytest.raises(DictionaryError, match=fragment) as e:
        load_dictionary(path, **kw)
    assert e.value.field == field and str(e.value).startswith(field + ": ")
    return e.value


def test_a_dictionary_loads_from_an_allowed_directory(tmp_path):
    d = load_dictionary(write_saelens(tmp_path / "ok"), allowed=[tmp_path], config=CFG)
    assert (d.hook_in, d.activation, d.k, d.d_sae) == (Hook(1, "block_output"), "topk", 4, 32)
    f = d.encode(torch.randn(5, 64))
    assert ((f != 0).sum(-1) <= 4).all()
    values, ids = top_features(f, 3)
    assert torch.equal(f.gather(-1, ids), values) and (values[:, :-1] >= values[:, 1:]).all()


def test_paths_outside_the_allowed_directories_are_refused(tmp_path):
    inside, outside = tmp_path / "allowed", tmp_path / "elsewhere"
    inside.mkdir()
    write_saelens(outside / "sae")
    refused("path", "not under an allowed directory", outside / "sae", allowed=[inside])
    refused("path", "not under an allowed directory", inside / ".." / "elsewhere" / "sae", allowed=[inside])
    (inside / "link").symlink_to(outside / "sae")  # a folder inside that is a link out
    refused("path", "not under an allowed directory", inside / "link", allowed=[inside])
    folder = inside / "sae"  # a real folder inside whose weights file links out
    folder.mkdir()
    (folder / "cfg.json").write_text((outside / "sae" / "cfg.json").read_text())
    (folder / "sae_weights.safetensors").symlink_to(outside / "sae" / "sae_weights.safetensors")
    refused("path", "not under an allowed directory", folder, allowed=[inside])
    refused("path", "loading dictionaries from disk is off", outside / "sae", allowed=[])
    refused("path", "does not exist", inside / "nothing", allowed=[inside])


def test_the_memory_bound_is_checked_before_loading(tmp_path):
    folder = write_saelens(tmp_path / "sae", d_sae=64)
    need = (64 * 64 * 2 + 64 + 64) * 4
    assert load_dictionary(folder, max_bytes=need).nbytes == need
    refused("max_bytes", f"needs {need} bytes as float32, over the bound of {need - 1}", folder, max_bytes=need - 1)
    assert load_dictionary(folder, max_bytes=need // 2, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_a_dictionary_that_does_not_fit_the_model_is_refused(tmp_path):
    refused("d_in", r"48 does not match block_output of layer 1: 64 wide \(dim\)",
            write_saelens(tmp_path / "width", d_in=48), config=CFG)
    refused("hook_name", r"layer 5 is out of range \[0, 3\)",
            write_saelens(tmp_path / "layer", hook_name="blocks.5.hook_resid_post"), config=CFG)
    refused("hook_name", "unknown hook", write_saelens(tmp_path / "hook", hook_name="blocks.1.hook_q"))
    refused("d_in", r"64 does not match mlp_hidden of layer 0: 96 wide \(hidden_dim\)",
            write_saelens(tmp_path / "hidden", hook_name="blocks.0.mlp.hook_post"), config=CFG)
    transcoder = write_saelens(tmp_path / "tc", architecture="transcoder", apply_b_dec_to_input=False,
                               metadata={"hook_name": "blocks.0.ln2.hook_normalized",
                                         "hook_name_out": "blocks.0.mlp.hook_post", "sae_lens_version": "6.54.12"})
    refused("d_out", "64 does not match mlp_hidden", transcoder, config=CFG)
    no_out = write_saelens(tmp_path / "tc2", architecture="transcoder", apply_b_dec_to_input=False)
    refused("hook_name_out", "names no output hook", no_out)


def test_malformed_and_foreign_files_are_refused(tmp_path):
    refused("architecture", "'matching_pursuit' is not served", write_saelens(tmp_path / "a", architecture="matching_pursuit"))
    refused("k", "out of range", write_saelens(tmp_path / "k", k=0))
    refused("threshold", "missing from sae_weights.safetensors", write_saelens(tmp_path / "j", architecture="jumprelu"))
    wrong = write_saelens(tmp_path / "d")
    (wrong / "cfg.json").write_text((wrong / "cfg.json").read_text().replace('"d_sae": 32', '"d_sae": 99'))
    refused("d_sae", "cfg.json says 99", wrong)
    bad_json = write_saelens(tmp_path / "json")
    (bad_json / "cfg.json").write_text("{not json")
    refused("cfg.json", "not readable JSON", bad_json)
    truncated = write_saelens(tmp_path / "trunc")
    (truncated / "sae_weights.safetensors").write_bytes((truncated / "sae_weights.safetensors").read_bytes()[:300])
    refused("sae_weights.safetensors", "not a readable safetensors file", truncated)
    (tmp_path / "empty").mkdir()
    refused("path", "holds no dictionary of a known format", tmp_path / "empty")
    sparsify_run = tmp_path / "run"
    for name in ("layers.0", "layers.1"):
        (sparsify_run / name).mkdir(parents=True)
        (sparsify_run / name / "cfg.json").write_text("{}")
    refused("path", "layers.0, layers.1: name one", sparsify_run)


def test_the_shipped_dictionary_fits_the_default_model():
    folders = [p for p in SHIPPED.iterdir() if (p / "cfg.json").exists()]
    assert folders, "no dictionary shipped"
    config = KNOWN_SHAPES["smollm2-135m"]
    for folder in folders:
        d = load_dictionary(folder, config=config)
        assert d.activation == "topk" and d.hook_in.site == "block_output" and d.d_in == config.dim
        run = json.loads((folder / "training.json").read_text())
        assert (d.hook_in.layer, d.d_sae, d.k) == (run["layer"], run["d_sae"], run["k"])
        x = torch.randn(16, config.dim) * run["scale"] ** -1 * config.dim ** 0.5  # the training data's mean norm
        f = d.encode(x)
        assert ((f != 0).sum(-1) <= d.k).all()


def test_the_store_serves_by_name_within_its_bound_and_its_directories(tmp_path):
    from model.features.sae.store import DictionaryStore, StoreLimits

    one = write_saelens(tmp_path / "allowed" / "one")  # 64 x 32 float32, twice, and the biases: 16,768 bytes
    store = DictionaryStore(StoreLimits(allowed=(str(tmp_path / "allowed"),), max_bytes=20_000), CFG)
    d = store.load("one", one)
    assert store.get("one") is d and store.names() == ["one"] and store.nbytes == d.nbytes
    # the store's default int8 encoder, made at load, counts against the bound: 32 x 64 int8 and a float16 scale a
    # block of 32
    assert d.encoder == "int8" and d.nbytes == 16_768 + 32 * 64 + 32 * 2 * 2
    for name, path, field, fragment in (("one", one, "name", "already loaded"),
                                        ("a/b", one, "name", "is not a name"),
                                        ("two", write_saelens(tmp_path / "allowed" / "two"), "max_bytes", "over the bound"),
                                        ("out", write_saelens(tmp_path / "outside"), "path", "not under an allowed")):
        with pytest.raises(DictionaryError, match=fragment) as e:
            store.load(name, path)
        assert e.value.field == field
    assert store.names() == ["one"]
    with pytest.raises(DictionaryError, match="no dictionary named 'two'"):
        store.get("two")
    store.unload("one")
    assert store.names() == [] and d.encode(torch.randn(2, 64)).shape == (2, 32)  # a holder keeps its own
    trusted = DictionaryStore(StoreLimits(), CFG)  # start-time dictionaries: no allowed directory needed
    assert trusted.load("x", tmp_path / "outside", trusted=True).d_sae == 32
    with pytest.raises(DictionaryError, match="loading dictionaries from disk is off"):
        trusted.load("y", tmp_path / "outside")
