"""The Ray Serve application: `serve run deploy/ray/serve.yaml`, or `import_path: service.rayserve.app:build_app`.

Two deployments: `LlamascopeIngress` (the HTTP entry, light) and `LlamascopeReplica` (one engine each) behind the
chosen request router. Replicas, CPUs/GPUs per replica and autoscaling bounds are per-deployment settings of the
config file (Ray overrides the defaults below by deployment name); the engine flags and the router are the
application's `args`, validated here (a typo fails the deploy, not the first request).
"""

# No `from __future__ import annotations`: Ray reads the builder's annotation to validate `args` against it.
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from service.config import Settings
from service.rayserve.ingress import LlamascopeIngress
from service.rayserve.replica import LlamascopeReplica

ROUTERS = {
    "prefix_aware": "service.rayserve.router:PrefixAwareRouter",
    "round_robin": "service.rayserve.router:RoundRobinRouter",
}


class RayAppArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine_flags: dict = Field(default_factory=dict, description="server settings by name, as `python -m service` flags")
    router: Literal["prefix_aware", "round_robin"] = "prefix_aware"
    router_kwargs: dict = Field(default_factory=dict, description="PrefixAwareRouter.initialize_state's arguments")
    read_timeout_s: float = Field(600.0, gt=0, description="longest wait for a replica's first byte or next chunk")


def build_app(args: RayAppArgs) -> Application:
    if isinstance(args, dict):  # called directly rather than by `serve run`
        args = RayAppArgs.model_validate(args)
    settings = Settings(**args.engine_flags)  # the flags are checked before any replica starts
    replica = serve.deployment(
        LlamascopeReplica, name="LlamascopeReplica",
        # the engine queues and batches by itself: let it see up to a full batch plus a queue of the same size
        max_ongoing_requests=2 * settings.max_num_seqs,
        health_check_period_s=5, health_check_timeout_s=30, graceful_shutdown_timeout_s=settings.shutdown_grace_seconds,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[args.router],
                                                  request_router_kwargs=args.router_kwargs,
                                                  request_routing_stats_period_s=2),
    ).bind(args.engine_flags)
    ingress = serve.deployment(LlamascopeIngress, name="LlamascopeIngress", max_ongoing_requests=1024)
    return ingress.bind(replica, max_body_bytes=settings.max_body_bytes, read_timeout_s=args.read_timeout_s)
