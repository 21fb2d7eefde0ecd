"""Loading progress: a tqdm bar on a terminal, periodic log lines otherwise (a 7B GGUF takes a while)."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("llamascope.load")


class LoadProgress:
    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.done, self.bytes = total, desc, 0, 0
        self.start = time.perf_counter()
        self._next_log = 0.0
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="tensor", leave=False)

    def advance(self, name: str, nbytes: int) -> None:
        self.done += 1
        self.bytes += nbytes
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(name, refresh=False)
        elif self.done >= self._next_log * self.total or self.done == self.total:
            log.info("%s: %d/%d tensors, %.0f MB, %.1fs", self.desc, self.done, self.total, self.bytes / 1e6, self.elapsed)
            self._next_log += 0.25

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        log.info("%s: loaded %d tensors (%.0f MB) in %.1fs", self.desc, self.done, self.bytes / 1e6, self.elapsed)
