"""Compact JSON made in bounded pieces, so that a large response can be built as slices of an engine-thread job.

An inspection's response runs to tens of megabytes (attention maps, a feature grid over thousands of tokens). One
`json.dumps` call over it is one C call that holds the GIL from start to end (CPython's `c_make_encoder` runs the
whole encoding without returning to the interpreter loop), so wherever it runs, on the event loop or a worker thread,
the engine thread and the event loop stand still for all of it: every request in flight stalls for that long. Made
here instead as a generator of pieces, each one `json.dumps` call over at most `CHUNK` items of a list (each a
scalar or a short list of them) or `STRING_CHUNK` characters of a string, whose caller (service/microscope/probing.py
`ThenRespond`, the engine thread's job) takes as many as a time budget allows.

The bytes are those of `json.dumps(x, ensure_ascii=False, separators=(",", ":"), allow_nan=False)` where x holds
finite floats only; a non-finite float (a model that overflows) becomes null (`nan_to_none`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Generator, Iterator

CHUNK = 512  # list items per json.dumps call: each a scalar or a list of at most SMALL scalars
SMALL = 16  # a list or dict of at most this many scalars is one item
STRING_CHUNK = 1 << 16  # characters of a long string per json.dumps call (base64 maps run to megabytes)
_SCALARS = frozenset({str, int, float, bool, type(None)})


def drain(steps: Generator):
    """Run `steps` to its end at once; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def nan_to_none(x):
    """x with every non-finite float replaced by None (JSON null)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [nan_to_none(v) for v in x]
    return x


def _dumps(x) -> str:
    try:
        return json.dumps(x, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a non-finite float in this piece: null there
        return json.dumps(nan_to_none(x), ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _scalar(x) -> bool:
    t = type(x)
    return t in _SCALARS and (t is not str or len(x) <= STRING_CHUNK)


def _small(x) -> bool:
    """A scalar, or a list of at most SMALL scalars, or a dict of at most SMALL scalars and such lists: one item of
    a piece."""
    t = type(x)
    if t is list:
        return len(x) <= SMALL and all(_scalar(v) for v in x)
    if t is dict:
        return len(x) <= SMALL and all(_scalar(v) or (type(v) is list and len(v) <= SMALL and all(_scalar(w) for w in v))
                                       for v in x.values())
    return _scalar(x)


def pieces(x) -> Iterator[str]:
    """x's compact JSON as a sequence of strings whose concatenation is the whole."""
    if type(x) is dict:
        if _small(x):
            yield _dumps(x)
            return
        sep = "{"
        for k, v in x.items():
            yield sep + _dumps(k if type(k) is str else str(k)) + ":"
            yield from pieces(v)
            sep = ","
        yield "}" if sep == "," else "{}"
    elif type(x) in (list, tuple):
        sep = "["
        for i in range(0, len(x), CHUNK):
            chunk = list(x[i : i + CHUNK])
            if all(_small(v) for v in chunk):
                yield sep + _dumps(chunk)[1:-1]
                sep = ","
                continue
            for v in chunk:
                if _small(v):
                    yield sep + _dumps(v)
                else:
                    yield sep
                    yield from pieces(v)
                sep = ","
        yield "]" if sep == "," else "[]"
    elif type(x) is str and len(x) > STRING_CHUNK:
        # escaping is per character, so the slices' escapes are the whole's
        yield '"'
        for i in range(0, len(x), STRING_CHUNK):
            yield _dumps(x[i : i + STRING_CHUNK])[1:-1]
        yield '"'
    else:
        yield _dumps(x)


def dumps_with_size_steps(body: dict) -> Generator[None, None, bytes]:
    """Compact JSON of `body` with `usage.response_bytes` set to the length of the body that carries it, yielding
    between pieces. `body` must hold a `usage` dict; its other keys are encoded once, its `usage` last of all, when
    the length is known (its own digits count too)."""
    out: list[bytes] = [b"{"]
    at = -1  # where the usage value goes
    size = 2  # the braces
    for n, (k, v) in enumerate(body.items()):
        head = ("," if n else "") + _dumps(k) + ":"
        out.append(head.encode())
        size += len(out[-1])
        if k == "usage":
            at = len(out)
            out.append(b"")
            continue
        for p in pieces(v):
            out.append(p.encode())
            size += len(out[-1])
            yield
    usage = body["usage"]
    usage["response_bytes"] = 0
    for _ in range(3):  # the size's own digits change the size; two rounds settle it
        encoded = _dumps(usage).encode()
        total = size + len(encoded)
        if usage["response_bytes"] == total:
            break
        usage["response_bytes"] = total
    out[at] = encoded
    out.append(b"}")
    yield
    return b"".join(out)  # one copy of the whole
