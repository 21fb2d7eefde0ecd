"""Every broken checkpoint is one CheckpointError naming the file, the tensor, and expected vs found."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from hf_checkpoints import save_tiny_llama
from gguf_writer import write_tiny_gguf
from model.generate import main as generate_main
from model.loaders.checkpoint import load_model
from model.loaders.errors import CheckpointError
from model.loaders.gguf_file import load_gguf
from model.loaders.hf import load_hf


@pytest.fixture
def hf_dir(tmp_path):
    save_tiny_llama(tmp_path)
    return tmp_path


def _edit_weights(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_hf_missing_tensor(hf_dir):
    _edit_weights(hf_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors.*layers\.1\.feed_forward\.w3\.weight") as e:
        load_hf(hf_dir)
    assert str(hf_dir) in str(e.value)


def test_hf_mismatched_shape(hf_dir):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]

    _edit_weights(hf_dir, shrink)
    with pytest.raises(CheckpointError) as e:
        load_hf(hf_dir)
    msg = str(e.value)
    assert "model.safetensors" in msg and "'model.layers.0.self_attn.k_proj.weight'" in msg
    assert "expected shape [32, 64], found [16, 64]" in msg


def test_hf_config_disagrees_with_weights(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    # tensors are read in name order, so down_proj (64 x F) is the first to disagree
    with pytest.raises(CheckpointError, match=r"mlp\.down_proj\.weight'.*expected shape \[64, 128\], found \[64, 96\]"):
        load_hf(hf_dir)


def test_hf_truncated_file(hf_dir):
    path = hf_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read safetensors data \(truncated"):
        load_hf(hf_dir)


def test_hf_missing_shard(tmp_path):
    save_tiny_llama(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name}: shard listed in model.safetensors.index.json is missing"):
        load_hf(tmp_path)


def test_hf_unsupported_architecture(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: unsupported architecture \(model_type='gpt2'"):
        load_hf(hf_dir)


def test_hf_unsupported_rope_type(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"unsupported rope scaling type 'yarn'"):
        load_hf(hf_dir)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="config.json: missing required key 'num_attention_heads'"):
        load_hf(tmp_path)
    with pytest.raises(CheckpointError, match="no such file or directory"):
        load_model(tmp_path / "nope.gguf")


@pytest.fixture
def gguf_path(tmp_path):
    hf = save_tiny_llama(tmp_path / "hf")
    write_tiny_gguf(tmp_path / "m.gguf", hf)
    return tmp_path / "m.gguf", hf


def test_gguf_truncated(gguf_path):
    path, _ = gguf_path
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(CheckpointError) as e:
        load_gguf(path)
    msg = str(e.value)
    assert str(path) in msg and "file is truncated" in msg and "tensor 'output.weight'" in msg  # the last one written
    assert f"the file has {len(data) - 5000} bytes" in msg


def test_gguf_truncated_in_header(gguf_path):
    path, _ = gguf_path
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(CheckpointError, match=r"cannot read GGUF \(truncated or not a GGUF file\?\)"):
        load_gguf(path)


def test_gguf_unsupported_architecture(tmp_path):
    hf = save_tiny_llama(tmp_path / "hf")
    write_tiny_gguf(tmp_path / "m.gguf", hf, architecture="gpt2")
    with pytest.raises(CheckpointError, match=r"unsupported architecture 'gpt2'"):
        load_gguf(tmp_path / "m.gguf")


def test_gguf_unsupported_quantization(tmp_path):
    hf = save_tiny_llama(tmp_path / "hf")
    w = hf.model.layers[0].mlp.up_proj.weight.detach().numpy()
    write_tiny_gguf(tmp_path / "m.gguf", hf, raw_tensors={"blk.0.ffn_up.weight": (np.zeros(w.shape, np.int8), Q.I8)})
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.ffn_up\.weight': unsupported GGUF tensor type I8"):
        load_gguf(tmp_path / "m.gguf")


def test_gguf_shape_mismatch_and_unknown_tensor(tmp_path):
    hf = save_tiny_llama(tmp_path / "hf")
    bad = np.zeros((96, 32), np.float32)
    write_tiny_gguf(tmp_path / "a.gguf", hf, raw_tensors={"blk.1.ffn_gate.weight": (bad, Q.F32)})
    with pytest.raises(CheckpointError, match=r"'blk\.1\.ffn_gate\.weight': expected shape \[96, 64\], found \[96, 32\]"):
        load_gguf(tmp_path / "a.gguf")
    write_tiny_gguf(tmp_path / "b.gguf", hf, extra_tensors={"blk.0.attn_sinks.weight": (np.zeros(64, np.float32), Q.F32)})
    with pytest.raises(CheckpointError, match=r"'blk\.0\.attn_sinks\.weight': unknown tensor name"):
        load_gguf(tmp_path / "b.gguf")
    # a tensor another family has (Qwen2's q bias) in a llama file: known, and refused as not this config's
    write_tiny_gguf(tmp_path / "c.gguf", hf, extra_tensors={"blk.0.attn_q.bias": (np.zeros(64, np.float32), Q.F32)})
    with pytest.raises(CheckpointError, match=r"'blk\.0\.attn_q\.bias': unexpected tensor .*does not have"):
        load_gguf(tmp_path / "c.gguf")


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    assert generate_main(["hi", "--model", str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "x.gguf" in err and "Traceback" not in err
