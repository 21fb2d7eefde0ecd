"""model/huge_pages.py: the weights and the KV pool moved onto 2 MB pages change no value, keep tied weights tied,
and serve the same tokens; the arena starts on a 2 MB boundary and is advised for huge pages where Linux allows; the
weights, written on 4 KB pages, are collapsed onto 2 MB ones while the model serves."""

from __future__ import annotations

import mmap
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.machine import rss_mb
from model import huge_pages
from model.engine import Engine, EngineConfig
from model.quantize import QuantEmbedding, quantize_model
from tiny import byte_tokenizer, greedy_tokens, tiny_model


def test_arena_is_zeroed_and_starts_on_a_huge_page():
    a = huge_pages.arena(3 << 20)
    assert a.shape == (3 << 20,) and a.dtype == torch.uint8 and not a.any()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert a.data_ptr() % huge_pages.PAGE == 0
    kv = huge_pages.empty((2, 3, 4), torch.bfloat16)
    assert kv.shape == (2, 3, 4) and kv.dtype == torch.bfloat16 and not kv.any()


def _tied(model) -> bool:
    """The head and the embedding table are one tensor (float) or one module (quantized: `QuantEmbedding`)."""
    emb = model.tok_embeddings
    if isinstance(emb, QuantEmbedding):
        return emb.table is model.output and emb.table.weight is model.output.weight
    return model.output.weight is emb.weight


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_placed_weights_serve_the_same_tokens(mode):
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8] * 4]
    model = quantize_model(tiny_model(seed=2), mode)
    want = greedy_tokens(model, prompts)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    tied = _tied(model)
    placed = huge_pages.place_weights(model, min_bytes=1024)
    assert placed > 0
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert _tied(model) == tied
    big = [t for t in after.values() if t.nbytes >= 1024]
    lo = min(t.data_ptr() for t in big)
    assert all(t.data_ptr() - lo < placed for t in big)  # one arena holds every placed tensor
    assert greedy_tokens(model, prompts) == want


def test_the_kv_pool_is_on_huge_pages_and_serves():
    model = tiny_model()
    engine = Engine(model, byte_tokenizer(), EngineConfig(num_blocks=32, block_size=4))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert engine.cache.k.data_ptr() % huge_pages.PAGE == 0
    assert not engine.cache.k.any() and not engine.cache.v.any()
    assert greedy_tokens(model, [[1, 2, 3]], n=4)


def test_weight_arena_carves_tensors_and_falls_back_past_its_capacity():
    arena = huge_pages.WeightArena(3 << 20)
    a = arena.empty((1000, 3), torch.float32)
    b = arena.empty((2 << 20,), torch.uint8)
    c = arena.empty((1 << 20,), torch.uint8)  # past the capacity: ordinary memory
    assert not a.any() and a.shape == (1000, 3) and b.data_ptr() % huge_pages.ALIGN == 0
    assert b.data_ptr() >= a.data_ptr() + a.nbytes and arena.used <= 3 << 20
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert huge_pages.on_huge_pages(a) and huge_pages.on_huge_pages(b) and not huge_pages.on_huge_pages(c)
    assert not huge_pages.on_huge_pages(torch.zeros(4))


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="Linux only")
def test_populate_makes_pages_resident_and_keeps_what_was_written():
    a = huge_pages.arena(64 << 20)
    a[5 << 20 : (5 << 20) + 3] = torch.tensor([7, 8, 9], dtype=torch.uint8)  # one page written before
    before = rss_mb()
    if not huge_pages.populate(a, threads=2):
        pytest.skip("the kernel refuses MADV_POPULATE_WRITE (before Linux 5.14)")
    assert rss_mb() - before >= 56  # MB: the other 62 (and a 2 MB page of slack)
    assert a[5 << 20 : (5 << 20) + 3].tolist() == [7, 8, 9] and int(a.sum()) == 24


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="Linux only")
def test_a_background_pool_is_usable_at_once_and_becomes_resident():
    before = rss_mb()
    kv = huge_pages.empty((64, 1 << 18), torch.float32, resident=False)  # 64 MB
    worker = huge_pages.populate_later([kv])
    kv[0, :4] = 1.0  # written while the worker may still be faulting pages in
    worker.join()
    assert kv[0, :4].tolist() == [1.0] * 4 and int(kv.count_nonzero()) == 4
    assert rss_mb() - before >= 56


# A process that ends while a background thread still faults a pool in: the thread is stopped at its next madvise
# call and joined before the interpreter finalizes (an atexit function registered before huge_pages is imported
# runs after huge_pages' own), and the process exits with its own status. A daemon thread left running then was
# halted wherever it next took the GIL, and a process ending beside a freshly built engine aborted now and then.
EXITS_DURING_POPULATE = """
import atexit, sys, time
seen = {}
atexit.register(lambda: print(seen["worker"].is_alive(), int(time.perf_counter() - seen["exit"] < 2)))
import torch
from model import huge_pages
kv = huge_pages.empty((1024, 1 << 18), torch.float32, resident=False)  # 1 GB, faulted in by the worker
seen["worker"] = huge_pages.populate_later([kv])
seen["exit"] = time.perf_counter()
sys.exit(3)
"""


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="Linux only")
def test_a_process_ending_while_its_pool_is_faulted_in_stops_the_worker_first():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", EXITS_DURING_POPULATE], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert (out.returncode, out.stdout.split(), out.stderr) == (3, ["False", "1"], "")


def test_the_engine_serves_while_its_pool_becomes_resident():
    from model.engine.sampling_params import SamplingParams

    model = tiny_model()
    engine = Engine(model, byte_tokenizer(), EngineConfig(num_blocks=8192, block_size=4))  # tiny model: 1 MB a step

    def tokens(i: int) -> list[int]:
        engine.add_request(str(i), [1, 2, 3], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        out: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                out += o.token_ids
        return out

    first = tokens(0)  # (the pool's pages may still be faulting in)
    engine.cache.wait_resident()
    assert not engine.cache.filling.is_alive()
    assert first == tokens(1) == greedy_tokens(model, [[1, 2, 3]], n=6)[0]


def _huge_kb_at(address: int) -> int:
    """AnonHugePages (kB) of the mapping holding `address` (/proc/self/smaps)."""
    inside, kb = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                kb = int(line.split()[1])
    return kb


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="Linux only")
def test_written_weights_are_collapsed_onto_huge_pages_unchanged():
    arena = huge_pages.WeightArena(16 << 20)
    w = arena.empty((6 << 20,), torch.uint8)  # 6 MB from the arena's start: three whole 2 MB pages
    w.copy_(torch.randint(0, 256, w.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    want = w.clone()
    assert _huge_kb_at(w.data_ptr()) == 0  # written on 4 KB pages (the arena is not advised while loading)
    outcome = huge_pages.collapse([w])
    if outcome != "collapsed":
        pytest.skip(f"the kernel refuses MADV_COLLAPSE (before Linux 6.1): {outcome!r}")
    assert _huge_kb_at(w.data_ptr()) >= 6 << 10  # kB
    assert torch.equal(w, want)
    assert _huge_kb_at(w.data_ptr()) < 16 << 10  # the arena's unwritten rest stays unmapped


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_placed_weights_serve_the_same_tokens_while_they_are_collapsed(mode):
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8] * 4]
    model = quantize_model(tiny_model(seed=3, dim=512, hidden_dim=2048), mode)  # 2.6-4.5 MB: whole 2 MB pages
    want = greedy_tokens(model, prompts)
    assert huge_pages.place_weights(model, min_bytes=1024) > 0
    tensors = [*model.parameters(), *model.buffers()]
    worker = huge_pages.collapse_later(tensors)
    during = greedy_tokens(model, prompts)  # (the pages may still be moving)
    worker.join()
    assert worker.outcome in (("collapsed", "advised") if hasattr(mmap, "MADV_HUGEPAGE") else ("",))
    assert during == greedy_tokens(model, prompts) == want
