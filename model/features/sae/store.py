"""`DictionaryStore`: the dictionaries one engine serves, by name: the ones named at start (`--sae NAME=PATH`) and
those loaded and unloaded at run time (`POST /v1/saes`, `DELETE /v1/saes/{name}`), with their memory bounded as a
whole.

A name stays bound to one dictionary object while a request uses it: unloading drops the store's reference, and a
request admitted before keeps its own (a Dictionary is never changed after load), so an unload never changes what
a running request reads or steers by. Loads read files outside the lock (they can take seconds); the bound and
the name are checked again under it before the dictionary is added, so two loads racing for the last bytes or for
one name cannot both succeed.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass

import torch

from model.features.sae.dictionary import ENCODERS, Dictionary, DictionaryError
from model.features.sae.load import load_dictionary

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a path segment of /v1/saes/{name}


@dataclass(frozen=True)
class StoreLimits:
    """What a server lets its dictionaries take: the directories run-time loads may read (empty: run-time loading
    off; dictionaries named at start are read wherever the operator put them), and their bytes together; and the
    precision their per-token reads encode in unless a load names one (`Dictionary.encoder`)."""

    allowed: tuple[str, ...] = ()
    max_bytes: int = 1 << 30
    dtype: torch.dtype = torch.float32
    encoder: str = "int8"


class DictionaryStore:
    def __init__(self, limits: StoreLimits, model_config) -> None:
        self.limits = limits
        self.config = model_config
        self._lock = threading.Lock()
        self._dicts: dict[str, Dictionary] = {}

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._dicts)

    def get(self, name: str) -> Dictionary:
        """The dictionary named `name`; DictionaryError("sae") naming the loaded ones when there is none."""
        with self._lock:
            d = self._dicts.get(name)
            if d is None:
                have = ", ".join(sorted(self._dicts)) or "none is loaded"
                raise DictionaryError("sae", f"no dictionary named {name!r} ({have})")
            return d

    def items(self) -> list[tuple[str, Dictionary]]:
        with self._lock:
            return sorted(self._dicts.items())

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(d.nbytes for d in self._dicts.values())

    def load(self, name: str, path: str | os.PathLike, *, trusted: bool = False, encoder: str | None = None,
             **options) -> Dictionary:
        """Read the dictionary at `path` and serve it as `name`. `trusted`: a path the operator gave at start (no
        allowed-directory check); a client's path must lie under `limits.allowed`. `encoder`: its per-token reads'
        precision (default `limits.encoder`). `options`: load_dictionary's (format, hook_name, hook_name_out,
        norm_scaling_factor). DictionaryError naming the field on refusal, with nothing loaded."""
        if not NAME.fullmatch(name):
            raise DictionaryError("name", f"{name!r} is not a name: letters, digits, '.', '_', '-', at most 64")
        encoder = encoder or self.limits.encoder
        if encoder not in ENCODERS:
            raise DictionaryError("encoder", f"{encoder!r} is not served; choose from {list(ENCODERS)}")
        with self._lock:
            if name in self._dicts:
                raise DictionaryError("name", f"{name!r} is already loaded (DELETE /v1/saes/{name} first)")
            left = self.limits.max_bytes - sum(d.nbytes for d in self._dicts.values())
        allowed = None if trusted else list(self.limits.allowed)
        d = load_dictionary(path, allowed=allowed, max_bytes=left, config=self.config, dtype=self.limits.dtype,
                            **options)
        d.encoder = encoder
        if encoder == "int8":
            d.int8_encoder()  # rounded here, on the loading thread, not by the first request's step
        with self._lock:
            if name in self._dicts:
                raise DictionaryError("name", f"{name!r} is already loaded (DELETE /v1/saes/{name} first)")
            used = sum(x.nbytes for x in self._dicts.values())
            if used + d.nbytes > self.limits.max_bytes:
                raise DictionaryError("path", f"{d.nbytes} bytes would exceed the dictionaries' bound of "
                                              f"{self.limits.max_bytes} bytes ({used} in use)")
            self._dicts[name] = d
        return d

    def unload(self, name: str) -> None:
        with self._lock:
            if self._dicts.pop(name, None) is None:
                raise DictionaryError("sae", f"no dictionary named {name!r}")
