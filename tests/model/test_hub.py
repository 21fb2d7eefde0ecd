"""`--model org/name`: a Hugging Face Hub id found in a cache the test builds in huggingface_hub's layout
(`models--org--name/refs/main`, `snapshots/<commit>/` links into `blobs/`), never the network; a download stood in
for by a function that fills the cache as huggingface_hub does; offline and uncached, one line naming the id and the
cache path."""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import pytest
import torch

from gguf_writer import write_tiny_gguf
from hf_checkpoints import save_tiny_checkpoint
from model.generate import main as generate_main
from model.loaders.checkpoint import load_model
from model.loaders.errors import CheckpointError
from model.loaders.hub import checkpoint_name, hub_cache_dir, resolve_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    for var in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    return home


def cache_repo(files: Path, repo: str, ref: bool = True) -> Path:
    """`files` into the HF cache as huggingface_hub lays a download out: content-addressed blobs, a snapshot folder
    of relative links to them, refs/main naming the commit. Returns the snapshot folder."""
    root = hub_cache_dir() / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for f in sorted(p for p in files.iterdir() if p.is_file()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, root / "blobs" / digest)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    if ref:
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text(COMMIT)
    return snap


@pytest.fixture
def tiny_dir(tmp_path):
    return save_tiny_checkpoint(tmp_path / "tiny")


def test_a_cached_hub_id_loads_its_snapshot(hf_home, tiny_dir):
    snap = cache_repo(tiny_dir, "org/tiny-llama")
    loaded = load_model("org/tiny-llama")
    assert loaded.path == snap and loaded.name == "org/tiny-llama"  # served under the id, not the commit
    direct = load_model(tiny_dir)
    ids = torch.tensor([[1, 2, 3, 200]])
    assert torch.equal(loaded.model(ids), direct.model(ids))
    assert loaded.tokenizer.encode("héllo") == direct.tokenizer.encode("héllo")


def test_a_cache_without_refs_and_a_gguf_in_a_repository(hf_home, tiny_dir, tmp_path):
    from hf_checkpoints import save_tiny_llama

    cache_repo(tiny_dir, "org/no-ref", ref=False)  # filled with an explicit revision: its one snapshot
    assert resolve_checkpoint("org/no-ref") == hub_cache_dir() / "models--org--no-ref" / "snapshots" / COMMIT
    files = tmp_path / "gguf"
    files.mkdir()
    write_tiny_gguf(files / "tiny-F32.gguf", save_tiny_llama(tmp_path / "hf", vocab_size=258))
    snap = cache_repo(files, "org/tiny-GGUF")
    assert resolve_checkpoint("org/tiny-GGUF/tiny-F32.gguf") == snap / "tiny-F32.gguf"
    assert checkpoint_name(snap / "tiny-F32.gguf") == "tiny-F32"


def test_a_local_path_wins_over_a_hub_id(hf_home, tiny_dir, tmp_path, monkeypatch):
    cache_repo(tiny_dir, "org/tiny-llama")
    (tmp_path / "org").mkdir()
    shutil.copytree(tiny_dir, tmp_path / "org" / "tiny-llama")
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint("org/tiny-llama") == Path("org/tiny-llama")
    assert resolve_checkpoint("./missing/dir") == Path("missing/dir")  # a path, not an id: the loader says so


def test_offline_and_uncached_is_one_line(hf_home, tiny_dir, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = hub_cache_dir() / "models--Qwen--Qwen2.5-0.5B-Instruct"
    with pytest.raises(CheckpointError) as e:
        load_model("Qwen/Qwen2.5-0.5B-Instruct")
    msg = str(e.value)
    assert "\n" not in msg and "Qwen/Qwen2.5-0.5B-Instruct" in msg and str(cache) in msg and "HF_HUB_OFFLINE" in msg
    # a snapshot a config-only download left (no weights, no tokenizer) is not a checkpoint either
    partial = tiny_dir.parent / "partial"
    partial.mkdir()
    shutil.copyfile(tiny_dir / "config.json", partial / "config.json")
    cache_repo(partial, "org/partial")
    with pytest.raises(CheckpointError, match="org/partial: no such file or directory, and as a Hugging Face Hub id"):
        load_model("org/partial")
    # the CLI prints that one line and exits 2
    assert generate_main(["hi", "--model", "Qwen/Qwen2.5-0.5B-Instruct"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: {msg}"


def test_the_download_path(hf_home, tiny_dir, monkeypatch):
    """Not cached and online: huggingface_hub's snapshot_download fills the cache (here a stand-in that does what
    it does, without the network); its failure, or no huggingface_hub at all, is one line."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    asked = []

    def snapshot_download(repo_id, allow_patterns, cache_dir):
        asked.append((repo_id, tuple(allow_patterns), Path(cache_dir)))
        return str(cache_repo(tiny_dir, repo_id))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    loaded = load_model("org/downloaded")
    assert loaded.name == "org/downloaded" and asked[0][0] == "org/downloaded" and asked[0][2] == hub_cache_dir()
    assert "*.safetensors" in asked[0][1] and "*.json" in asked[0][1]

    def unreachable(*a, **kw):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection.")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(CheckpointError) as e:
        load_model("org/elsewhere")
    assert "\n" not in str(e.value) and str(e.value).endswith("the download failed: We couldn't connect to "
                                                              "'https://huggingface.co' to load the files.")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed: the base install needs it not
    with pytest.raises(CheckpointError, match=r"org/elsewhere: .*needs huggingface_hub: `pip install huggingface_hub`"):
        load_model("org/elsewhere")


def test_the_server_serves_a_hub_id_under_its_name(hf_home, tiny_dir, monkeypatch):
    from service.config import Settings
    from service.common.state import ServerState

    cache_repo(tiny_dir, "org/tiny-llama")
    state = ServerState(Settings(model="org/tiny-llama", kv_cache_bytes=4 << 20))
    state.start()
    try:
        assert state.load_error is None and state.model_name == "org/tiny-llama"
    finally:
        state.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    state = ServerState(Settings(model="org/not-cached", kv_cache_bytes=4 << 20))
    state.start()  # /health says 503 with this reason, and the log has it once
    assert state.engine is None and "\n" not in state.load_error and "org/not-cached" in state.load_error
    assert str(hub_cache_dir() / "models--org--not-cached") in state.load_error
