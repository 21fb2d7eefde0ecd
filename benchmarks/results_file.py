"""The results JSON of a long run, kept current: rewritten after every phase, so a failure part-way keeps every
figure measured before it, and a phase that raises is recorded while the run goes on (benchmarks/gpu.py)."""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import traceback
from pathlib import Path
from typing import Iterator

import torch


def free(device: torch.device) -> None:
    """Release what the last phase left: reference cycles first, then the CUDA allocator's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Results:
    """The run's JSON, rewritten after every phase, so a failure part-way keeps what was measured before it."""

    def __init__(self, path: Path, data: dict) -> None:
        self.path, self.data = path, data
        path.parent.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=float) + "\n")
        tmp.replace(self.path)  # atomic: a reader (or a crash) never sees half a file

    @contextlib.contextmanager
    def phase(self, r: dict, name: str, device: torch.device) -> Iterator[None]:
        """Run a phase; on an exception record it in r["errors"][name] and go on. Saves either way."""
        failed = False
        try:
            yield
        except Exception as e:  # out of memory, a kernel that does not build, ...: the other phases still run
            failed = True
            r.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:2000]
            print(f"[results] {name} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        finally:
            if failed:  # the traceback is gone now, and with it the failed frame's tensors
                free(device)
            self.save()


def errors(data: dict) -> list[str]:
    """Every phase that failed, run-wide and per model."""
    found = [f"{k}: {v}" for k, v in data.get("errors", {}).items()]
    for name, m in data["models"].items():
        found += [f"{name} / {k}: {v}" for k, v in m.get("errors", {}).items()]
    return found

