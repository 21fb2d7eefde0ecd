"""Loading in bounded memory, on models large enough to show it: a Q4_0 GGUF and a bfloat16 safetensors checkpoint
whose float32 copies would take 4-6x their served weights load with a peak of the served weights plus a fixed
margin (each in a fresh process, its peak resident memory read from the kernel); a checkpoint too large for the
memory available is refused before a weight is read, with the figure it needs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from benchmarks.shapes import write_random
from hf_checkpoints import save_tiny_llama, tiny_llama_config
from tiny import byte_tokenizer
from model.loaders import CheckpointError, default_model_path, load_model

ROOT = Path(__file__).resolve().parents[2]
# Transients beside the served weights: the GGUF reader's parse of the metadata (~160 MB for the default model's
# vocabulary, in gguf-py), one matrix's conversion, the huge-page copy of the largest tensor, the tokenizer.
MARGIN = 400 << 20
# (n_layers, dim, heads, kv heads, ffn, tied, rope theta): 342M parameters, 1.4 GB in float32
SHAPE = (16, 1024, 16, 4, 4096, False, 1e4)

PROBE = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    from model.loaders import load_model
    def status(key):
        return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS: the peak from here on
    before = status("VmRSS:")
    path, how = Path(sys.argv[1]), sys.argv[2]
    # the server's own entry point, as `serve` calls it
    lm = load_model(path, quantization="auto") if how == "gguf" else load_model(path, torch.bfloat16, quantization="int4")
    lm.model.collapsing.join()  # the weights' move onto 2 MB pages, in the background after loading: within the bound too
    print(json.dumps({"before": before, "peak": status("VmHWM:"), "weights": lm.weight_bytes,
                      "float32": 4 * lm.model.config.num_parameters()}))
""")


def _probe(path: Path, how: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(path), how], capture_output=True, text=True, cwd=ROOT,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_q4_0_gguf_loads_within_its_served_weights_plus_a_margin(tmp_path):
    path = tmp_path / "random-q4_0.gguf"
    write_random(path, SHAPE, default_model_path(), "Q4_0")
    r = _probe(path, "gguf")
    grew = r["peak"] - r["before"]
    print(f"\npeak growth {grew / 2**20:.0f} MiB for {r['weights'] / 2**20:.0f} MiB of served weights "
          f"(float32 would be {r['float32'] / 2**20:.0f} MiB)")
    assert r["float32"] > r["weights"] + 2 * MARGIN  # the model is large enough for a float copy to show
    assert grew <= r["weights"] + MARGIN


@pytest.mark.slow
def test_bfloat16_safetensors_quantized_on_load_within_its_served_weights_plus_a_margin(tmp_path):
    from safetensors.torch import save_file

    cfg = tiny_llama_config(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
                            num_key_value_heads=4, vocab_size=49152, tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "torch_dtype": "bfloat16"}))
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": (49152, 1024), "lm_head.weight": (49152, 1024), "model.norm.weight": (1024,)}
    for i in range(4):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": (1024,), p + "post_attention_layernorm.weight": (1024,),
                        p + "self_attn.q_proj.weight": (1024, 1024), p + "self_attn.k_proj.weight": (256, 1024),
                        p + "self_attn.v_proj.weight": (256, 1024), p + "self_attn.o_proj.weight": (1024, 1024),
                        p + "mlp.gate_proj.weight": (4096, 1024), p + "mlp.up_proj.weight": (4096, 1024),
                        p + "mlp.down_proj.weight": (1024, 4096)})
    save_file({n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in tensors.items()},
              str(tmp_path / "model.safetensors"))
    byte_tokenizer()._tk.save(str(tmp_path / "tokenizer.json"))
    r = _probe(tmp_path, "hf")
    grew = r["peak"] - r["before"]
    print(f"\npeak growth {grew / 2**20:.0f} MiB for {r['weights'] / 2**20:.0f} MiB of served weights "
          f"(float32 would be {r['float32'] / 2**20:.0f} MiB)")
    assert r["float32"] > r["weights"] + MARGIN
    assert grew <= r["weights"] + MARGIN


def test_a_checkpoint_too_large_is_refused_before_loading(tmp_path, monkeypatch):
    from model.loaders import memory

    gguf = default_model_path()
    monkeypatch.setattr(memory, "available_bytes", lambda: 50 << 20)  # a machine with 50 MiB to spare
    with pytest.raises(CheckpointError, match=r"needs 1\.\d GiB \(weights 0\.\d GiB \+ KV pool 1\.0 GiB\) but 0\.0 GiB is available"):
        load_model(gguf, quantization="auto", reserve_bytes=1 << 30)
    save_tiny_llama(tmp_path / "hf")
    with pytest.raises(CheckpointError, match=r"hf: hf needs 1\.0 GiB \(weights 0\.0 GiB \+ KV pool 1\.0 GiB\)"):
        load_model(tmp_path / "hf", reserve_bytes=1 << 30)  # (an HF directory: from its files' headers)
