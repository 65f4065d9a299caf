"""What the embeddings server did, in Prometheus' text format (`GET /metrics`), through prometheus-client.

One registry per app (two servers in one process, as in the tests, never share counters). Every part of the
server counts what it decided: the guards each answer (requests by route and status, so 401 / 413 / 429 / 503 are
visible), the batcher what it ran (queue depth in texts, batch sizes, model time per layer), the endpoint what it
answered (tokens, texts per layer and per encoder) and the depth controller the layer it chose per batch.
Names follow Prometheus' conventions (base units, `_total` counters) and text-embeddings-inference's where they
mean the same (`te_` there, `matryoshka2d_` here).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# The routes a request is counted under; any other path (a 404) is one label, so a scan cannot grow the series.
ROUTES = ("/v1/embeddings", "/v1/models", "/v1/models/{name}", "/health", "/metrics")
LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def route_of(path: str) -> str:
    if path in ROUTES:
        return path
    return "/v1/models/{name}" if path.startswith("/v1/models/") else "other"


class ServerMetrics:
    """The server's counters, gauges and histograms, in a registry of their own."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "matryoshka2d_requests", "HTTP requests answered, by route and status", ["route", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "matryoshka2d_request_duration_seconds",
            "Time from the request's arrival to its answer, by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queued_texts = Gauge("matryoshka2d_queue_texts", "Texts waiting for the model, all encoders", registry=r)
        self.batch_texts = Histogram(
            "matryoshka2d_batch_texts",
            "Texts per model call, by encoder",
            ["encoder"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.model_seconds = Histogram(
            "matryoshka2d_model_duration_seconds",
            "Time of one model call, by encoder and layer",
            ["encoder", "layer"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "matryoshka2d_tokens", "Tokens of the texts answered, by encoder", ["encoder"], registry=r
        )
        self.embeddings = Counter(
            "matryoshka2d_embeddings",
            "Texts answered, by encoder and the layer that answered",
            ["encoder", "layer"],
            registry=r,
        )
        self.demand = Gauge(
            "matryoshka2d_full_depth_demand",
            "Share of the model's time the last second's arrivals would take at full depth, by encoder (adaptive "
            "depth holds its target strictly from 1 on)",
            ["encoder"],
            registry=r,
        )
        self.depth_choices = Counter(
            "matryoshka2d_adaptive_batches",
            "Batches of adaptive requests, by the layer the depth controller chose",
            ["layer"],
            registry=r,
        )

    def request(self, path: str, status: int, seconds: float) -> None:
        route = route_of(path)
        self.requests.labels(route, str(status)).inc()
        self.request_seconds.labels(route).observe(seconds)

    def model_call(self, encoder: str, layer: int, texts: int, seconds: float) -> None:
        self.batch_texts.labels(encoder).observe(texts)
        self.model_seconds.labels(encoder, str(layer)).observe(seconds)

    def answered(self, encoder: str, layer: int, texts: int, tokens: int) -> None:
        self.embeddings.labels(encoder, str(layer)).inc(texts)
        self.tokens.labels(encoder).inc(tokens)

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
