"""Load harness: drive a live llamascope server on loopback with a bounded, seeded mix of requests, then check that
it kept its promises: nothing lost (every request answered, none hung, no 5xx), nothing leaked (KV blocks, running
and waiting sequences back to 0, RSS growth reported), and its own counters in `/metrics` agreeing with ours.

The mix: completions and chat, streamed and not, prompts from 1 token to near the context limit, `n` > 1, some
prompt lists, clients that disconnect mid-stream, clients that give up on a non-streamed request, and bursts fired
all at once above the queue limit (429s are expected there, and count as answers).

    python -m benchmarks.load --tiny                                  # serves a tiny random model itself
    python -m benchmarks.load --serve "--model path/to/model.gguf"    # serves a checkpoint itself
    python -m benchmarks.load --url http://127.0.0.1:8000             # a server already running
    ... --requests 3000 --concurrency 64 --json report.json

Served by the harness, the server is stopped with SIGTERM at the end and must exit 0 (graceful shutdown).

TTFT is request start to the first chunk carrying text, inter-token latency the gap between successive chunks
carrying text of one choice (streamed requests; a chunk is usually one token), as a client sees them.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

GEN = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
WORDS = "the a of light harbour keeper storm ship night lamp stone pier winter west spray rhythm town hour".split()


@dataclass
class LoadConfig:
    num_requests: int = 300
    concurrency: int = 32
    max_tokens: int = 16  # each request asks for 1..max_tokens
    max_prompt_len: int | None = None  # prompt tokens at most (default: the context less max_tokens)
    max_n: int = 3
    chat_share: float = 0.35
    stream_share: float = 0.5
    multi_prompt_share: float = 0.1  # completions with two prompts in one request
    disconnect_share: float = 0.08  # streams the client leaves after a few events
    abort_share: float = 0.08  # non-streamed requests the client gives up on after a random wait
    burst_every: int = 100  # every so many requests, a burst fired at once, outside the concurrency limit
    burst_size: int = 96
    retry_after_cap: float = 1.0  # after a 429, a client slot waits Retry-After, at most this long (bursts never wait)
    timeout: float = 300.0  # a request unanswered this long counts as hung
    seed: int = 0


@dataclass
class Outcome:
    endpoint: str
    kind: str  # "done" (answered in full), "disconnected" (we left mid-stream), "aborted" (we gave up, no answer)
    status: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_bound: int = 0  # the most prompt tokens the request can carry (for those we left before the usage)
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    retry_after: float | None = None


@dataclass
class LoadReport:
    config: dict
    seconds: float
    requests: int
    requests_per_s: float
    output_tokens: int
    output_tokens_per_s: float
    ttft_ms: dict
    itl_ms: dict
    status_counts: dict  # "200", "429", ..., "disconnected", "aborted"
    server_5xx: int
    hung: int
    kv_blocks_in_use: float  # llamascope_kv_cache_blocks_in_use after the run: must be 0
    running: float
    waiting: float
    rss_before_mb: float | None
    rss_after_mb: float | None
    rss_growth_mb: float | None
    inconsistencies: list[str]
    exit_code: int | None = None  # the server's, when the harness served it (SIGTERM at the end)

    @property
    def ok(self) -> bool:
        return (self.server_5xx == 0 and self.hung == 0 and self.kv_blocks_in_use == 0 and self.running == 0
                and self.waiting == 0 and not self.inconsistencies and self.exit_code in (None, 0))

    def summary(self) -> str:
        def pct(d):
            return " / ".join(f"{d[k]:.1f}" if d.get(k) is not None else "-" for k in ("p50", "p95", "p99"))

        lines = [
            f"{self.requests} requests in {self.seconds:.1f} s: {self.requests_per_s:.2f} req/s, "
            f"{self.output_tokens} output tokens, {self.output_tokens_per_s:.1f} tok/s",
            f"TTFT p50/p95/p99 ms: {pct(self.ttft_ms)}   inter-token p50/p95/p99 ms: {pct(self.itl_ms)}",
            "outcomes: " + ", ".join(f"{k}: {v}" for k, v in sorted(self.status_counts.items())),
            f"5xx: {self.server_5xx}, hung: {self.hung}, after the run: KV blocks in use {self.kv_blocks_in_use:.0f}, "
            f"running {self.running:.0f}, waiting {self.waiting:.0f}",
            "RSS: " + (f"{self.rss_before_mb:.0f} MB -> {self.rss_after_mb:.0f} MB ({self.rss_growth_mb:+.1f} MB)"
                       if self.rss_growth_mb is not None else "not exported"),
            "metrics vs client: " + ("consistent" if not self.inconsistencies else "; ".join(self.inconsistencies)),
        ]
        if self.exit_code is not None:
            lines.append(f"server exit code after SIGTERM: {self.exit_code}")
        lines.append("OK" if self.ok else "FAILED")
        return "\n".join(lines)


# ---- the requests ---------------------------------------------------------------------------------------------


class Workload:
    def __init__(self, cfg: LoadConfig, vocab: int, context: int) -> None:
        self.cfg, self.vocab, self.context = cfg, vocab, context
        self.rng = random.Random(cfg.seed)
        self.max_prompt = min(cfg.max_prompt_len or context, context - cfg.max_tokens)
        if self.max_prompt < 1:
            raise ValueError(f"max_tokens {cfg.max_tokens} leaves no room for a prompt in a context of {context}")

    def prompt_len(self) -> int:
        r = self.rng.random()
        if r < 0.1:  # the edges: one token, and right at the limit
            return 1
        if r < 0.2:
            return self.max_prompt
        return int(round(self.max_prompt ** self.rng.random()))  # log-uniform in between: mostly short, some long

    def request(self, burst: bool = False) -> tuple[str, dict, str]:
        """-> (path, body, behaviour): behaviour is "stream", "stream-leave", "plain" or "plain-abort"."""
        cfg, rng = self.cfg, self.rng
        body = {"max_tokens": rng.randint(1, cfg.max_tokens), "temperature": rng.choice([0.0, 0.7, 1.0]),
                "seed": rng.randrange(1 << 30), "n": rng.randint(1, cfg.max_n) if rng.random() < 0.3 else 1}
        if rng.random() < 0.5:
            body["ignore_eos"] = True
        if rng.random() < cfg.chat_share:
            path = "/v1/chat/completions"
            # ASCII words: at most one token per character in any tokenizer; the template's own tokens get 64
            budget = max(1, min(self.max_prompt, 4096) - 64)
            text, target = "", rng.randint(1, budget)
            while len(text) < target:
                text += rng.choice(WORDS) + " "
            body["messages"] = [{"role": "user", "content": text[:target].strip() or "hi"}]
        else:
            path = "/v1/completions"
            if rng.random() < cfg.multi_prompt_share:
                body["prompt"] = [self.ids(self.prompt_len()), self.ids(self.prompt_len())]
            else:
                body["prompt"] = self.ids(self.prompt_len())
        if burst:
            return path, body, "plain"
        if rng.random() < cfg.stream_share:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            return path, body, "stream-leave" if rng.random() < cfg.disconnect_share / cfg.stream_share else "stream"
        return path, body, "plain-abort" if rng.random() < cfg.abort_share / (1 - cfg.stream_share) else "plain"

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]


async def send(client: httpx.AsyncClient, path: str, body: dict, behaviour: str, rng: random.Random,
               timeout: float) -> Outcome:
    out = Outcome(GEN[path], "done", prompt_bound=prompt_bound(body))
    start = time.perf_counter()
    try:
        if behaviour.startswith("stream"):
            leave_after = rng.randint(1, 4) if behaviour == "stream-leave" else None
            await asyncio.wait_for(_stream(client, path, body, out, start, leave_after), timeout)
        else:
            give_up = rng.uniform(0.02, 1.0) if behaviour == "plain-abort" else timeout
            try:
                r = await asyncio.wait_for(client.post(path, json=body), give_up)
            except asyncio.TimeoutError:
                if behaviour != "plain-abort":
                    raise
                out.kind = "aborted"
                return out
            out.status = r.status_code
            if r.status_code == 429:
                out.retry_after = float(r.headers.get("retry-after", 0))
            if r.status_code == 200:
                usage = r.json()["usage"]
                out.prompt_tokens, out.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
            else:
                out.error = r.text[:300]
    except asyncio.TimeoutError:
        out.kind, out.error = "hung", f"no answer in {timeout} s"
    except httpx.HTTPError as e:
        out.kind, out.error = "transport", f"{type(e).__name__}: {e}"
    return out


def prompt_bound(body: dict) -> int:
    if "messages" in body:  # ASCII words, so at most a token per character, plus the chat template's own tokens
        return sum(len(m["content"]) for m in body["messages"]) + 64
    p = body["prompt"]
    return sum(len(x) for x in p) if p and isinstance(p[0], list) else len(p)


async def _stream(client, path, body, out: Outcome, start: float, leave_after: int | None) -> None:
    async with client.stream("POST", path, json=body) as r:
        out.status = r.status_code
        if r.status_code == 429:
            out.retry_after = float(r.headers.get("retry-after", 0))
        if r.status_code != 200:
            out.error = (await r.aread()).decode()[:300]
            return
        last: dict[int, float] = {}
        events = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events += 1
            if line == "data: [DONE]":
                return
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.error = chunk["error"]["message"]
                continue
            now = time.perf_counter()
            for c in chunk.get("choices", []):
                if c.get("text") or (c.get("delta") or {}).get("content"):
                    if out.ttft is None:
                        out.ttft = now - start
                    if c["index"] in last:
                        out.itl.append(now - last[c["index"]])
                    last[c["index"]] = now
            if chunk.get("usage"):
                out.prompt_tokens = chunk["usage"]["prompt_tokens"]
                out.completion_tokens = chunk["usage"]["completion_tokens"]
            if leave_after is not None and events >= leave_after:
                out.kind = "disconnected"  # leaving the block closes the connection mid-stream
                return
        out.error = out.error or "the stream ended without [DONE]"


# ---- the server's view ----------------------------------------------------------------------------------------


def scrape(url: str, headers: dict) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    return {s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else ""): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def wait_idle(url: str, headers: dict, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url, headers)
        idle = (m["llamascope_kv_cache_blocks_in_use"], m["llamascope_num_requests_running"],
                m["llamascope_num_requests_waiting"]) == (0, 0, 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def _requests_total(m: dict[str, float], endpoint: str) -> Counter:
    prefix = "llamascope_requests_total"
    out = Counter()
    for k, v in m.items():
        if k.startswith(prefix + "{"):
            labels = json.loads(k[len(prefix):])
            if labels["endpoint"] == endpoint:
                out[labels["status"]] += v
    return out


def reconcile(before: dict, after: dict, outcomes: list[Outcome]) -> list[str]:
    """The server's counters against the client's own counts. Exact where the client saw the answer; a request the
    client gave up on (no status seen) is counted by the server once, or not at all if it left before the request
    reached the app."""
    problems = []
    for endpoint in GEN.values():
        server = _requests_total(after, endpoint) - _requests_total(before, endpoint)
        mine = [o for o in outcomes if o.endpoint == endpoint]
        seen = Counter(str(o.status) for o in mine if o.status is not None)
        unseen = sum(1 for o in mine if o.status is None)
        for status in seen:
            if server[status] < seen[status]:
                problems.append(f"{endpoint} {status}: server counted {server[status]:.0f}, client saw {seen[status]}")
        surplus = sum(server.values()) - sum(seen.values())
        if not 0 <= surplus <= unseen:
            problems.append(f"{endpoint}: server counted {sum(server.values()):.0f} requests, client sent {len(mine)}")
    done = [o for o in outcomes if o.kind == "done" and o.status == 200]
    gen = after["llamascope_generation_tokens_total"] - before["llamascope_generation_tokens_total"]
    if gen < sum(o.completion_tokens for o in done):
        problems.append(f"generation tokens: server {gen:.0f} < client {sum(o.completion_tokens for o in done)}")
    # The server counts a request's prompt tokens when it answered it in full; a request we left may or may not have
    # been finished by then, so it may add up to its own prompt size.
    prompt = after["llamascope_prompt_tokens_total"] - before["llamascope_prompt_tokens_total"]
    mine_prompt = sum(o.prompt_tokens for o in done)
    slack = sum(o.prompt_bound for o in outcomes if o.kind in ("disconnected", "aborted"))
    if not mine_prompt <= prompt <= mine_prompt + slack:
        problems.append(f"prompt tokens: server {prompt:.0f}, client {mine_prompt} (+ up to {slack} left early)")
    errors = after.get('llamascope_request_finish_total{"finish_reason": "error"}', 0) - \
        before.get('llamascope_request_finish_total{"finish_reason": "error"}', 0)
    if errors:
        problems.append(f"{errors:.0f} choices finished with an error")
    return problems


def _percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p95": None, "p99": None, "n": 0}
    xs = sorted(xs)

    def p(q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3

    return {"p50": p(0.5), "p95": p(0.95), "p99": p(0.99), "n": len(xs)}


# ---- the run --------------------------------------------------------------------------------------------------


def run_load(url: str, cfg: LoadConfig, api_key: str | None = None,
             before_burst: Callable[[], Awaitable[None]] | None = None) -> LoadReport:
    """`before_burst`: awaited in the client's loop just before each burst is fired (a test holds the server's engine
    busy there, so that the burst meets a full queue however fast the model is)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    context = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["max_model_len"]
    vocab = _vocab_size(url, headers)
    work = Workload(cfg, vocab, context)
    rng = random.Random(cfg.seed + 1)
    plan: list = []  # single requests, and bursts (lists of requests)
    planned, next_burst = 0, cfg.burst_every
    while planned < cfg.num_requests:
        if cfg.burst_every and planned >= next_burst and planned + cfg.burst_size <= cfg.num_requests:
            plan.append([work.request(burst=True) for _ in range(cfg.burst_size)])
            planned += cfg.burst_size
            next_burst = planned + cfg.burst_every
            continue
        plan.append(work.request())
        planned += 1

    async def main() -> tuple[list[Outcome], float]:
        limits = httpx.Limits(max_connections=cfg.concurrency + cfg.burst_size, max_keepalive_connections=cfg.concurrency)
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=cfg.timeout, limits=limits) as client:
            sem = asyncio.Semaphore(cfg.concurrency)
            loop_start = time.perf_counter()

            async def one(path, body, behaviour):
                async with sem:
                    out = await send(client, path, body, behaviour, random.Random(rng.random()), cfg.timeout)
                    if out.status == 429:  # a polite client waits as told before its next request
                        await asyncio.sleep(min(cfg.retry_after_cap, out.retry_after or 0.0))
                    return out

            tasks = []
            for item in plan:
                if isinstance(item, list):  # a burst: all at once, past the concurrency limit
                    if before_burst is not None:
                        await before_burst()
                    tasks += [asyncio.create_task(send(client, p, b, bh, random.Random(rng.random()), cfg.timeout))
                              for p, b, bh in item]
                else:
                    tasks.append(asyncio.create_task(one(*item)))
                await asyncio.sleep(0)
            outcomes = await asyncio.gather(*tasks)
            return list(outcomes), time.perf_counter() - loop_start

    for _ in range(3):  # warm-up, so RSS growth is the run's, not the first requests' buffers
        httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 2}, headers=headers, timeout=cfg.timeout)
    before = wait_idle(url, headers)
    rss_before = before.get("llamascope_process_resident_memory_bytes")
    outcomes, seconds = asyncio.run(main())
    after = wait_idle(url, headers)
    rss_after = after.get("llamascope_process_resident_memory_bytes")
    statuses = Counter(o.kind if o.kind != "done" else str(o.status) for o in outcomes)
    tokens = sum(o.completion_tokens for o in outcomes if o.kind == "done" and o.status == 200)
    report = LoadReport(
        config=asdict(cfg), seconds=seconds, requests=len(outcomes), requests_per_s=len(outcomes) / seconds,
        output_tokens=tokens, output_tokens_per_s=tokens / seconds,
        ttft_ms=_percentiles([o.ttft for o in outcomes if o.ttft is not None]),
        itl_ms=_percentiles([x for o in outcomes for x in o.itl]),
        status_counts=dict(statuses), server_5xx=sum(1 for o in outcomes if o.status and o.status >= 500),
        hung=sum(1 for o in outcomes if o.kind == "hung"),
        kv_blocks_in_use=after["llamascope_kv_cache_blocks_in_use"],
        running=after["llamascope_num_requests_running"], waiting=after["llamascope_num_requests_waiting"],
        rss_before_mb=rss_before / 1e6 if rss_before else None, rss_after_mb=rss_after / 1e6 if rss_after else None,
        rss_growth_mb=(rss_after - rss_before) / 1e6 if rss_before and rss_after else None,
        inconsistencies=reconcile(before, after, outcomes),
    )
    report.inconsistencies += [f"{o.endpoint}: {o.kind}: {o.error}" for o in outcomes if o.kind in ("transport",)]
    return report


def _vocab_size(url: str, headers: dict) -> int:
    """From the OpenAPI document, where token ids are bounded by the served vocabulary (service/common/openapi.py)."""
    try:
        doc = httpx.get(url + "/openapi.json", headers=headers, timeout=30).json()
        detok = doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]
        return int(detok["maximum"]) + 1
    except (KeyError, ValueError, httpx.HTTPError):
        return 256


# ---- serving it ourselves -------------------------------------------------------------------------------------


class ServedProcess:
    """`python -m service ARGS` on a free loopback port; stopped with SIGTERM, its exit code kept."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = self.free_port()
        self.start([sys.executable, "-m", "service", "--port", str(self.port), *args], log_path, env)

    @staticmethod
    def free_port() -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def start(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None, timeout: float = 600) -> None:
        """Run `cmd` (serving on self.port) and wait until its /health answers 200, asked every 50 ms over a plain
        `http.client` connection (the shapes benchmark times this wait as the load time of both servers, and
        llama-server loads a 1B file in 1-2 s: an httpx client made per ask cost ~20 ms of CPU each, on 2 cores
        beside the starting server)."""
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = cmd
        self.log = open(log_path, "w")
        self.log_path = log_path
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1],
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{Path(cmd[0]).name} exited with {self.proc.returncode}; see {log_path}")
            if self.healthy():
                return
            time.sleep(0.05)
        self.proc.kill()
        raise RuntimeError(f"{Path(cmd[0]).name} did not become ready in {timeout:.0f} s; see {log_path}")

    def healthy(self) -> bool:
        """/health answers 200 (False for any other status, a refused connection or a timeout)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def stop(self, grace: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(grace + 30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()


def main(argv: list[str] | None = None) -> int:
    d = LoadConfig()
    p = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server")
    where.add_argument("--serve", metavar="ARGS", help="serve `python -m service ARGS` for the run (\"\": the default model)")
    where.add_argument("--tiny", action="store_true", help="serve a tiny random model (benchmarks/tiny_checkpoint.py)")
    p.add_argument("--api-key", default=os.environ.get("LLAMASCOPE_API_KEY"))
    p.add_argument("--requests", type=int, default=d.num_requests)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--max-prompt-len", type=int, default=None)
    p.add_argument("--max-n", type=int, default=d.max_n)
    p.add_argument("--burst-every", type=int, default=d.burst_every)
    p.add_argument("--burst-size", type=int, default=d.burst_size)
    p.add_argument("--timeout", type=float, default=d.timeout)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--server-args", default="--max-waiting 64 --max-num-seqs 16 --threads 1",
                   help="extra `python -m service` flags with --tiny / --serve (a small queue, so bursts meet 429)")
    p.add_argument("--json", type=Path, help="write the report here")
    a = p.parse_args(argv)
    cfg = LoadConfig(num_requests=a.requests, concurrency=a.concurrency, max_tokens=a.max_tokens,
                     max_prompt_len=a.max_prompt_len, max_n=a.max_n, burst_every=a.burst_every,
                     burst_size=a.burst_size, timeout=a.timeout, seed=a.seed)
    served = None
    with tempfile.TemporaryDirectory() as tmp:
        if a.tiny or a.serve is not None:
            if a.tiny:
                from benchmarks.tiny_checkpoint import write_tiny_checkpoint

                args = ["--model", str(write_tiny_checkpoint(Path(tmp) / "tiny-llama", max_seq_len=512))]
            else:
                args = shlex.split(a.serve)
            served = ServedProcess(args + shlex.split(a.server_args), Path(tmp) / "server.log")
            print(f"serving on {served.url}: python -m service {' '.join(args + shlex.split(a.server_args))}",
                  file=sys.stderr)
        url = served.url if served else a.url.rstrip("/")
        try:
            report = run_load(url, cfg, a.api_key)
        finally:
            if served:
                code = served.stop()
        if served:
            report.exit_code = code
            if code != 0:
                print((Path(tmp) / "server.log").read_text()[-3000:], file=sys.stderr)
    print(report.summary())
    if a.json:
        a.json.write_text(json.dumps({**asdict(report), "ok": report.ok}, indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
