"""`--model Qwen/Qwen2.5-0.5B-Instruct`: a Hugging Face Hub id, found in the local HF cache or downloaded into it.

The cache is huggingface_hub's layout (huggingface_hub/constants.py, file_download.py): `$HF_HUB_CACHE`, else
`$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`; a repository is
`models--{org}--{name}/`, its `refs/main` names the commit, and `snapshots/{commit}/` holds the files. Reading the
cache needs nothing but the file system; downloading needs `huggingface_hub` (an optional dependency, imported only
then) and the network, and is not tried under `HF_HUB_OFFLINE=1`. `org/name/file.gguf` names one GGUF file of a
repository.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from model.loaders.errors import CheckpointError

_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:/(?P<file>[^/]+\.gguf))?$")
# What serving a repository reads: config, weights, tokenizer, chat template (never its other checkpoints' formats)
_SERVED_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
_TRUE = {"1", "on", "true", "yes"}


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def repo_cache_dir(repo: str) -> Path:
    return hub_cache_dir() / ("models--" + repo.replace("/", "--"))


def resolve_checkpoint(model: str | Path) -> Path:
    """A local path stays as it is (an existing path always wins over a Hub id); a Hub id becomes its cached
    snapshot (folder or GGUF file), downloaded first when it is not cached. CheckpointError, in one line, when it is
    neither cached nor downloadable."""
    local = Path(model).expanduser()
    match = _HUB_ID.match(str(model))
    if local.exists() or match is None or str(model).startswith((".", "/", "~")):
        return local
    repo, filename = match["repo"], match["file"]
    cached = _cached(repo, filename)
    if cached is not None:
        return cached
    return _download(str(model), repo, filename)


def checkpoint_name(path: Path) -> str:
    """The name a checkpoint is served under: `org/name` for a cached Hub snapshot folder, else the folder's name or
    the GGUF file's stem."""
    if path.is_dir() and path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/", 1)
    return path.name.removesuffix(".gguf")


def _snapshot(repo_dir: Path) -> Path | None:
    """The snapshot `refs/main` names, else the newest one (a cache filled with an explicit revision)."""
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        snap = repo_dir / "snapshots" / ref.read_text(encoding="utf-8").strip()
        return snap if snap.is_dir() else None
    snaps = [p for p in (repo_dir / "snapshots").glob("*") if p.is_dir()] if (repo_dir / "snapshots").is_dir() else []
    return max(snaps, key=lambda p: p.stat().st_mtime) if snaps else None


def _complete(snap: Path) -> bool:
    """A snapshot a load can use: config, tokenizer and every weight shard (a cache a config-only download filled
    holds config.json alone)."""
    if not (snap / "config.json").is_file() or not (snap / "tokenizer.json").is_file():
        return False
    index = snap / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        return bool(shards) and all((snap / s).is_file() for s in shards)
    return any(snap.glob("*.safetensors"))


def _cached(repo: str, filename: str | None) -> Path | None:
    snap = _snapshot(repo_cache_dir(repo))
    if snap is None:
        return None
    if filename is not None:
        return snap / filename if (snap / filename).is_file() else None
    return snap if _complete(snap) else None


def _download(model: str, repo: str, filename: str | None) -> Path:
    where = f"{model}: no such file or directory, and as a Hugging Face Hub id not in the cache ({repo_cache_dir(repo)})"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE:
        raise CheckpointError(f"{where} and HF_HUB_OFFLINE is set: download it where the network allows "
                              f"(`huggingface-cli download {repo}`) or give a local path")
    try:
        import huggingface_hub
    except ImportError:
        raise CheckpointError(f"{where}, and downloading it needs huggingface_hub: `pip install huggingface_hub` "
                              "(or give a local path)") from None
    try:
        if filename is not None:
            return Path(huggingface_hub.hf_hub_download(repo, filename, cache_dir=hub_cache_dir()))
        return Path(huggingface_hub.snapshot_download(repo, allow_patterns=_SERVED_FILES, cache_dir=hub_cache_dir()))
    except Exception as e:  # offline, unknown or gated repository: the library's own words, first line
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{where} and the download failed: {reason}") from None
