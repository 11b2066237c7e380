"""The routers' and the ingress's Prometheus metrics: routing decisions, index sizes, retries on another
replica; one registry per process (the ingress's /metrics serves it)."""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class RouterMetrics:
    """Routing decisions and index sizes of the routers in this process (the ingress's /metrics)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.decisions = Counter(
            "tachy:router_requests", "Requests routed, by decision.", ["model_name", "decision"], registry=self.registry
        )
        self.matched_blocks = Counter(
            "tachy:router_matched_blocks",
            "Prompt blocks the chosen replica held, summed over routed requests.",
            ["model_name"],
            registry=self.registry,
        )
        self.retries = Counter(
            "tachy:replica_retries",
            "Requests sent again to another replica because theirs died before the first token.",
            ["model_name"],
            registry=self.registry,
        )
        self.index_size = Gauge(
            "tachy:router_index_entries", "(replica, block) pairs in the router's index.", ["model_name"],
            registry=self.registry,
        )  # fmt: skip

        self.pending_prefill_blocks = Gauge(
            "tachy:router_pending_prefill_blocks",
            "Prompt blocks the routed requests still have to compute before their first tokens.",
            ["model_name"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


@functools.cache
def router_metrics() -> RouterMetrics:
    return RouterMetrics()
