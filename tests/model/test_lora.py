"""model/features/lora/adapters.py's PEFT reader: what it maps where (a fused projection's column ranges, the scaling), and the one-line
refusals of adapters it cannot serve exactly. The served numbers against PEFT itself: tests/service/test_lora_service.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model.features.lora import load_adapter, load_peft
from tiny import tiny_model

PREFIX = "base_model.model.model.layers"


def _write(folder, tensors: dict, **config) -> str:
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    return str(folder)


def _pair(layer: int, kind: str, module: str, r: int, fan_in: int, fan_out: int) -> dict:
    return {f"{PREFIX}.{layer}.{kind}.{module}.lora_A.weight": torch.randn(r, fan_in),
            f"{PREFIX}.{layer}.{kind}.{module}.lora_B.weight": torch.randn(fan_out, r)}


def test_targets_become_column_ranges_of_the_fused_projections(tmp_path):
    c = tiny_model().config
    H, K, E, D, F = c.n_heads, c.n_kv_heads, c.head_dim, c.dim, c.hidden_dim
    t = {**_pair(0, "self_attn", "k_proj", 4, D, K * E), **_pair(1, "mlp", "up_proj", 4, D, F),
         **_pair(1, "mlp", "down_proj", 2, F, D)}
    a = load_peft("x", _write(tmp_path / "a", t, use_rslora=True, alpha_pattern={"down_proj": 3}), c, 64)
    (k,) = a.parts[(0, "qkv")]
    assert (k.start, k.stop) == (H * E, (H + K) * E) and k.scale == 8 / math.sqrt(4)
    (up,) = a.parts[(1, "w13")]
    assert (up.start, up.stop) == (F, 2 * F)
    (down,) = a.parts[(1, "w2")]
    assert (down.start, down.stop) == (0, D) and down.scale == 3 / math.sqrt(2) and a.rank == 4


@pytest.mark.parametrize("tensors, config, message", [
    (lambda c: _pair(0, "self_attn", "q_proj", 4, c.dim, 7), {}, "needs A (r, 64) and B (64, r)"),
    (lambda c: _pair(0, "self_attn", "q_proj", 128, c.dim, c.dim), {}, "rank 128 exceeds --max-lora-rank 64"),
    (lambda c: _pair(9, "self_attn", "q_proj", 4, c.dim, c.dim), {}, "names block 9; the model has 2"),
    (lambda c: {"base_model.model.lm_head.lora_A.weight": torch.randn(4, c.dim)}, {}, "cannot adapt"),
    (lambda c: _pair(0, "self_attn", "q_proj", 4, c.dim, c.dim), {"use_dora": True}, "DoRA is not supported"),
    (lambda c: _pair(0, "self_attn", "q_proj", 4, c.dim, c.dim), {"bias": "all"}, "bias 'all' is not supported"),
    (lambda c: {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.randn(4, c.dim)}, {}, "without its pair"),
])
def test_adapters_it_cannot_serve_exactly_are_refused_by_name(tmp_path, tensors, config, message):
    c = tiny_model().config
    with pytest.raises(ValueError, match="LoRA adapter 'x'") as e:
        load_peft("x", _write(tmp_path / "a", tensors(c), **config), c, 64)
    assert message in str(e.value)


def test_a_folder_without_peft_files_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs adapter_config.json and adapter_model.safetensors"):
        load_peft("x", tmp_path, tiny_model().config, 64)


def test_a_gguf_that_is_not_a_lora_adapter_is_refused(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "model.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", torch.zeros(64, 64).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="is not a LoRA adapter GGUF"):
        load_adapter("x", str(path), tiny_model().config, 64)


# llama.cpp's own converter: `make install-test` puts it in the virtual environment (taken from llama-cpp-python's
# sdist, which vendors llama.cpp); LLAMA_CPP_DIR names another checkout (the folder holding convert_lora_to_gguf.py,
# conversion/ and gguf-py/).
CONVERTER = Path(os.environ.get("LLAMA_CPP_DIR", Path(sys.prefix) / "llama.cpp")) / "convert_lora_to_gguf.py"


@pytest.mark.skipif(not CONVERTER.is_file(), reason=f"no {CONVERTER}: `make install-test` fetches it, or set LLAMA_CPP_DIR")
def test_llama_cpps_converter_output_reads_as_its_peft_source(tmp_path):
    """A PEFT adapter of a random LLaMA converted by llama.cpp's convert_lora_to_gguf.py (f32): the GGUF reads back as
    exactly the PEFT folder's targets, scales and weights (lora_b's q/k rows un-permuted)."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaForCausalLM

    from hf_checkpoints import save_tiny_checkpoint
    from model.loaders.hf import read_hf_config
    from model.features.lora import load_gguf_lora

    base = save_tiny_checkpoint(tmp_path / "base")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(LlamaForCausalLM.from_pretrained(base), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False))
    model.save_pretrained(tmp_path / "adapter")
    subprocess.run([sys.executable, str(CONVERTER), "--base", str(base), "--outfile", str(tmp_path / "a.gguf"),
                    "--outtype", "f32", str(tmp_path / "adapter")], check=True, capture_output=True)
    config = read_hf_config(base)
    want, got = load_peft("p", tmp_path / "adapter", config, 64), load_gguf_lora("g", tmp_path / "a.gguf", config, 64)
    assert want.parts.keys() == got.parts.keys()
    for key in want.parts:
        for a, b in zip(want.parts[key], got.parts[key]):
            assert (a.start, a.stop, a.scale) == (b.start, b.stop, b.scale)
            assert torch.equal(a.A, b.A) and torch.equal(a.BT, b.BT)
