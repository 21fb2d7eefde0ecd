"""The router's /metrics: every loaded model's own exposition with a `model` label added to each sample, a family's
samples from all models together under its one HELP and TYPE (the text format wants a family's lines contiguous:
prometheus.io/docs/instrumenting/exposition_formats), then the router's counters of loads, unloads and restarts
and a gauge of each model's state. A dashboard written for one server sums or splits by `model`."""

from __future__ import annotations

import asyncio
import re

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

STATES = ("unloaded", "loading", "loaded", "failed")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "llamascope_router_"
        self.counters = {
            "loads": Counter(p + "model_loads", "model processes started (loads and restarts)", ["model"], registry=r),
            "unloads": Counter(p + "model_unloads", "models unloaded (requested or evicted)", ["model"], registry=r),
            "restarts": Counter(p + "model_restarts", "loaded models whose process exited on its own and was started "
                                "again", ["model"], registry=r),
        }
        self.state = Gauge(p + "model_state", "1 for the state each model is in", ["model", "state"], registry=r)
        self.in_flight = Gauge(p + "model_requests_in_flight", "requests routed to a model and not yet answered",
                               ["model"], registry=r)

    def count(self, what: str, model: str) -> None:
        self.counters[what].labels(model).inc()

    def set_states(self, children) -> None:
        for c in children:
            for s in STATES:
                self.state.labels(c.name, s).set(1 if c.status == s else 0)
            self.in_flight.labels(c.name).set(c.in_flight)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def relabel(text: str, model: str, families: dict[str, list[str]], headers: dict[str, list[str]]) -> None:
    """Add one exposition's lines to `families` (name -> sample lines, each with `model="..."` first among its labels)
    and `headers` (name -> its HELP and TYPE lines, from the first exposition that has them)."""
    label = f'model="{_escape(model)}"'
    current = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                current = parts[2]
                families.setdefault(current, [])
                if len(headers.setdefault(current, [])) < 2 and line not in headers[current]:
                    headers[current].append(line)
            continue
        m = _SAMPLE.match(line)
        if m is None or current is None:
            continue
        name, labels, rest = m.groups()
        inner = labels[1:-1] if labels else ""
        families[current].append(f"{name}{{{label}{',' + inner if inner else ''}}}{rest}")


async def aggregate(client: httpx.AsyncClient, children, headers: dict[str, str], own: RouterMetrics) -> bytes:
    """The exposition the front serves: the loaded children's, relabelled, then its own."""
    loaded = [c for c in children if c.status == "loaded"]

    async def scrape(c):
        try:
            r = await client.get(c.url + "/metrics", headers=headers, timeout=5)
            return c.name, r.text if r.status_code == 200 else ""
        except httpx.HTTPError:  # it died between the check and the scrape: its samples are missing this time
            return c.name, ""

    families: dict[str, list[str]] = {}
    helps: dict[str, list[str]] = {}
    for name, text in await asyncio.gather(*(scrape(c) for c in loaded)):
        relabel(text, name, families, helps)
    lines = []
    for fam, samples in families.items():
        lines += helps.get(fam, []) + samples
    own.set_states(children)
    return ("\n".join(lines) + "\n").encode() + generate_latest(own.registry) if lines else generate_latest(own.registry)
