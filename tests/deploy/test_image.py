"""The CPU image, started and used as a user would (`make image-test`, which CI runs after `make image`): the
container passes its own HEALTHCHECK, then over HTTP on a loopback-published port: a chat answer, a streamed
completion, /inspect, the viewer page and /metrics; it runs as the non-root user, on the native kernels compiled
while the image was built; SIGTERM with streams in flight lets them finish and the container exits 0 within the
grace period; a model mounted at /models is served; a model that cannot load ends the container with exit 1 and
the reason.

Marked `image` and collected only with `--image TAG` (tests/conftest.py): `make test` runs none of them."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.tiny_checkpoint import write_tiny_checkpoint
from container import Container, engine, sse_chunks, stream
from live_server import free_port

pytestmark = pytest.mark.image

ROOT = Path(__file__).resolve().parents[2]
SUMMER = "Summer is warm. Winter is cold.\n"
GRACE = 30.0  # the image's default --shutdown-grace-seconds
KV = str(256 << 20)  # the KV pool each test container allocates (the default, 1 GiB, is resident seconds after the start)


@pytest.fixture(scope="module")
def image(pytestconfig) -> str:
    return pytestconfig.getoption("--image")


@pytest.fixture(scope="module")
def served(image):
    """The image as shipped (default model, default settings), its port 8000 published on loopback."""
    port = free_port()
    c = Container(image, f"llamascope-test-{os.getpid()}",
                  ["-p", f"127.0.0.1:{port}:8000", "-e", f"LLAMASCOPE_KV_CACHE_BYTES={KV}"])
    try:
        c.healthy_after = c.wait_healthy(timeout=300)
        c.url = f"http://127.0.0.1:{port}"
        yield c
    finally:
        c.remove()


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_the_healthcheck_passes(served):
    print(f"healthy {served.healthy_after:.1f} s after start")
    assert served.health() == "healthy"
    r = httpx.get(served.url + "/health", timeout=10)
    assert r.status_code == 200, r.text


def test_it_runs_as_the_non_root_user(served):
    assert served.inspect()["Config"]["User"] == "10001"
    status = served.exec("cat", "/proc/1/status")  # the server is PID 1
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert uids == ["10001"] * 4, uids  # real, effective, saved, filesystem
    assert "python" in served.exec("cat", "/proc/1/cmdline")


def test_chat(served):
    body = {"messages": [{"role": "user", "content": "What is the capital of Japan?"}],
            "max_tokens": 24, "temperature": 0}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    [choice] = body["choices"]
    # every token of the default model's answer leads clearly at each precision (tests/test_docs.py's ANSWER)
    assert choice["message"]["role"] == "assistant" and "Tokyo" in choice["message"]["content"], body
    assert choice["finish_reason"] in ("length", "stop") and 0 < body["usage"]["completion_tokens"] <= 24, body


def test_streamed_completion(served):
    events, started = [], threading.Event()
    stream(served.url, {"prompt": "The capital of France is", "max_tokens": 12, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}, events, started)
    chunks, reasons = sse_chunks(events)
    text = [ch["text"] for c in chunks for ch in c["choices"]]
    assert reasons == ["length"] and len([t for t in text if t]) >= 2, text  # token by token, not one lump
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_inspect(served):
    """The default model's massive activation (Sun et al.): token 0, dimension 507, from block 11 on."""
    r = httpx.post(served.url + "/inspect", json={"prompt": SUMMER, "include": ["massive", "attention"], "mode": "none"},
                   timeout=120)
    assert r.status_code == 200, r.text
    s = r.json()["summary"]
    assert (s["first_massive_layer"], s["massive_dims"]) == (11, [507]), s
    assert s["massive_tokens"] == [{"index": 0, "text": "Summer"}]


def test_viewer_page(served):
    page = httpx.get(served.url + "/inspect/ui", timeout=10)
    assert page.status_code == 200 and "<canvas" in page.text
    script = httpx.get(served.url + "/inspect/ui/inspect.js", timeout=10)
    assert script.status_code == 200 and "halfToFloat" in script.text


def test_metrics(served):
    before = metrics(served.url)
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "One, two,", "max_tokens": 5, "ignore_eos": True},
                   timeout=120)
    assert r.status_code == 200, r.text
    after = metrics(served.url)
    ok = ("llamascope_requests_total", (("endpoint", "completions"), ("status", "200")))
    assert after[ok] - before.get(ok, 0) == 1
    generated = ("llamascope_generation_tokens_total", ())
    assert after[generated] - before[generated] == 5


def test_the_native_kernels_built_in_the_image_are_in_use(served, image):
    """The model-load log names the kernel build it loaded: the one compiled into /opt/llamascope/kernels while the
    image was built (the image has no compiler, so nothing could have been built at start)."""
    log = served.logs()
    assert "native CPU kernels: loaded /opt/llamascope/kernels/llamascope_kernels_avx2_" in log, log[-3000:]
    assert "CPU kernels: native (avx2" in log and "building it" not in log, log[-3000:]
    assert served.exec("sh", "-c", "command -v g++ c++ gcc cc || echo none").strip() == "none"
    size = int(engine("image", "inspect", "--format", "{{.Size}}", image).stdout)
    print(f"{image}: {size / 1e6:.0f} MB")
    assert size < 2_000_000_000  # torch's CPU build is most of it


def _kernels_on(served, cpu: set[str]) -> tuple[str, list[str]]:
    """In the image, on a CPU of these flags: (what the kernels' load said and their status, the loaded build's
    recorded flags)."""
    code = ("import json, logging, pathlib, sys; logging.basicConfig(level=logging.WARNING, stream=sys.stdout); "
            f"from model import kernels as k; k.cpu_flags = lambda: set({sorted(cpu)!r}); m = k.native(); print(k.status()); "
            "print(json.dumps(json.loads((pathlib.Path(m.__file__).parent / 'build.json').read_text())['flags']))")
    out = served.exec("python", "-c", code).strip()
    return out, json.loads(out.splitlines()[-1])


def test_on_a_cpu_without_its_own_build_the_image_loads_its_portable_one(served):
    """Beside the build for the CPU it was built on, the image carries one for any CPU with AVX2 and, built on a CPU
    with more, one for AVX-VNNI and one for AVX-512 VNNI (`python -m model.kernels --portable`). A CPU whose flags
    match no build cannot compile its own there (no compiler) and loads the richest build it can run."""
    from model import kernels

    base = {"avx2", "fma", "f16c"}
    # AVX512-VNNI and -VL without -BW, as no real CPU has: the AVX2 build
    out, flags = _kernels_on(served, base | {"avx512_vnni", "avx512vl"})
    assert "a build for a CPU with fewer of them" in out and "native (avx2)" in out, out
    assert flags == kernels.compile_flags(True, [])
    # a Zen 4 (AVX-512 VNNI, no AVX-VNNI or AMX): the AVX-512 build, its own where the image's machine is one too;
    # the AVX2 one where that machine had no AVX-512 VNNI to check it on
    avx512 = kernels.PORTABLE[2]
    out, flags = _kernels_on(served, base | {"avx512_vnni", "avx512vl", "avx512bw"})
    built_here = kernels._features(avx512) <= kernels.cpu_flags()
    assert flags == kernels.compile_flags(True, avx512 if built_here else []), out
    assert ("native (avx2, vnni, zmm)" if built_here else "native (avx2)") in out, out
    # an Alder Lake (AVX-VNNI, no AVX-512): the AVX-VNNI build where the image's machine has AVX-VNNI
    avx_vnni = kernels.PORTABLE[1]
    out, flags = _kernels_on(served, base | {"avx_vnni"})
    built_here = kernels._features(avx_vnni) <= kernels.cpu_flags()
    assert flags == kernels.compile_flags(True, avx_vnni if built_here else []), out
    assert ("native (avx2, vnni)" if built_here else "native (avx2)") in out, out


def test_sigterm_lets_streams_in_flight_finish_and_exits_0(served):
    """Last in this file: it ends the shared container."""
    body = {"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    runs = []
    for _ in range(2):
        events, started = [], threading.Event()
        t = threading.Thread(target=stream, args=(served.url, body, events, started))
        t.start()
        runs.append((t, events, started))
    for _, _, started in runs:
        assert started.wait(60)
    t0 = time.monotonic()
    served.signal("TERM")
    rc = served.wait_exit(GRACE + 15)
    took = time.monotonic() - t0
    for t, _, _ in runs:
        t.join(30)
    log = served.logs()
    assert rc == 0, log[-3000:]
    assert took < GRACE, took
    for _, events, _ in runs:
        chunks, reasons = sse_chunks(events)
        assert reasons == ["length"] and not [c for c in chunks if "error" in c], chunks[-2:]
        assert chunks[-1]["usage"]["completion_tokens"] == 16
    assert "shutting down: refusing new requests" in log and "Traceback" not in log, log[-3000:]
    print(f"exit 0 {took:.1f} s after SIGTERM, 2 streams of 16 tokens finished")


def test_a_model_mounted_at_models_is_served(image, tmp_path):
    model = write_tiny_checkpoint(tmp_path / "models" / "tiny-llama", seed=3)
    for p in (tmp_path, tmp_path / "models", model, *model.iterdir()):  # readable by the image's user (uid 10001)
        p.chmod(0o755 if p.is_dir() else 0o644)
    port = free_port()
    with Container(image, f"llamascope-test-models-{os.getpid()}",
                   ["-p", f"127.0.0.1:{port}:8000", "-v", f"{tmp_path / 'models'}:/models:ro",
                    "-e", "LLAMASCOPE_MODEL=/models/tiny-llama", "-e", "LLAMASCOPE_KV_CACHE_BYTES=16777216"]) as c:
        c.wait_healthy(timeout=300)
        url = f"http://127.0.0.1:{port}"
        assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]] == ["tiny-llama"]
        r = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        digest = hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()
        assert c.exec("sha256sum", "/models/tiny-llama/model.safetensors").split()[0] == digest


def test_a_model_that_cannot_load_ends_the_container_with_the_reason(image):
    """A broken model is a failure the server cannot recover from: the container exits 1 at once, its last log line
    the reason, instead of running unhealthy (docs/development.md rule 9)."""
    r = engine("run", "--rm", "-e", "LLAMASCOPE_MODEL=/models/missing.gguf", "-e", f"LLAMASCOPE_KV_CACHE_BYTES={KV}",
               image, timeout=300, check=False)
    last = (r.stdout + r.stderr).strip().splitlines()[-1]
    assert r.returncode == 1, (r.returncode, (r.stdout + r.stderr)[-3000:])
    assert last.startswith("python -m service: error: model failed to load: ") and "missing.gguf" in last, last


CUDA_STANDIN = "llamascope:cuda-standin"
LAUNCHER_CHECK = r'''
import pathlib, subprocess, sys, sysconfig
# A Python extension module built as Triton builds its launcher (triton/runtime/build.py: cc -shared -fPIC with
# Python's headers), then imported
src = pathlib.Path("/tmp/launcher.c")
src.write_text("""#include <Python.h>
static PyObject *ok(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"ok", ok, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "launcher", NULL, -1, methods};
PyMODINIT_FUNC PyInit_launcher(void) { return PyModule_Create(&mod); }
""")
include = sysconfig.get_paths()["include"]
so = "/tmp/launcher" + sysconfig.get_config_var("EXT_SUFFIX")
subprocess.run(["gcc", str(src), "-O3", "-shared", "-fPIC", "-Wno-psabi", "-o", so, "-I" + include], check=True)
sys.path.insert(0, "/tmp")
import launcher
print("launcher", launcher.ok())
'''


def test_the_cuda_variant_on_a_stand_in_base():
    """The CUDA image without a GPU or PyTorch's CUDA base: `make image-cuda-standin` builds DEVICE=cuda up to the
    final stage on a stand-in base (CUDA_BASE_IMAGE: the CPU image's runtime stage: Debian's python and the
    CPU torch). Its final stage has what Triton needs at the first kernel launch (a C compiler and libc's headers
    that build and link a Python extension module), compiles no CPU kernels, carries the repo's Triton launch check,
    and its entrypoint serves (here on CPU, on PyTorch ops: the CUDA image brings no CPU kernels)."""
    assert engine("image", "exists", CUDA_STANDIN, check=False).returncode == 0, \
        f"no {CUDA_STANDIN}: build it with `make image-cuda-standin`"
    port = free_port()
    with Container(CUDA_STANDIN, f"llamascope-test-cuda-{os.getpid()}",
                   ["-p", f"127.0.0.1:{port}:8000", "-e", f"LLAMASCOPE_KV_CACHE_BYTES={KV}"]) as c:
        assert c.exec("ls", "-A", "/opt/llamascope/kernels").strip() == ""
        assert c.exec("python", "-c", LAUNCHER_CHECK).strip() == "launcher 42"
        probe = c.exec("python", "-c", "import model.kernels.triton_attention as t; print(t.__file__)").strip()
        shipped = c.exec("sha256sum", probe).split()[0]
        assert shipped == hashlib.sha256((ROOT / "model/kernels/triton_attention.py").read_bytes()).hexdigest()
        c.wait_healthy(timeout=300)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        log = c.logs()
        assert "CPU kernels: unavailable" in log and "Traceback" not in log, log[-3000:]
