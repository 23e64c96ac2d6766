"""`GET /metrics`: the server's Prometheus metrics (prometheus-client), one registry per server."""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]
disable_created_metrics()  # the *_created series only double what a scrape needs

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/rerank", "/v1/models", "/health", "/metrics", "/openapi.json")
# Decode steps on a CPU take milliseconds to a second; first tokens wait for a prefill and a queue.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.requests = Counter("hardy_http_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.prompt_tokens = Counter("hardy_prompt_tokens", "prompt tokens prefilled", registry=self.registry)
        self.generated_tokens = Counter("hardy_generation_tokens", "tokens generated", registry=self.registry)
        self.time_to_first_token = Histogram("hardy_time_to_first_token_seconds",
                                             "from a request's arrival to its first generated token",
                                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram("hardy_inter_token_latency_seconds",
                                             "between consecutive tokens of one request",
                                             buckets=LATENCY_BUCKETS, registry=self.registry)
        Gauge("hardy_queue_depth", "requests waiting for a slot",
              registry=self.registry).set_function(lambda: engine.waiting.qsize())
        Gauge("hardy_running_batch", "requests holding a slot (decoded together)",
              registry=self.registry).set_function(lambda: sum(s is not None for s in engine.slots))

        if engine.speculator is not None:
            self.registry.register(_Speculation(engine.speculator))

    def count_response(self, path: str, status: int) -> None:
        self.requests.labels(path if path in ROUTES else "other", str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Speculation:
    """The speculator's running totals (`--speculate`), read at each scrape."""

    def __init__(self, speculator):
        self.speculator = speculator

    def collect(self):
        yield CounterMetricFamily("hardy_speculation_drafted_tokens", "guessed tokens checked by the model",
                                  value=self.speculator.drafted)
        yield CounterMetricFamily("hardy_speculation_accepted_tokens", "guessed tokens the model agreed with",
                                  value=self.speculator.accepted)
