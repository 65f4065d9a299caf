"""What the embeddings server did, in Prometheus' text format (`GET /metrics`), through prometheus-client.

One registry per app (two servers in one process, as in the tests, never share counters). Every part of the
server counts what it decided: the guards each answer (requests by route and status, so 401 / 413 / 429 / 503 are
visible), the batcher what it ran (queue depth in texts, batch sizes, model time per layer), the endpoint what it
answered (tokens, texts per layer and per encoder, each request's time by phase) and the ladder of adaptive depth
its rungs' quality, cost and share (serve/ladder.py).
Names follow Prometheus' conventions (base units, `_total` counters) and text-embeddings-inference's where they
mean the same (`te_` there, `matryoshka2d_` here).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# The routes a request is counted under; any other path (a 404) is one label, so a scan cannot grow the series.
ROUTES = ("/v1/embeddings", "/v1/models", "/v1/models/{name}", "/health", "/metrics")
LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PHASE_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def route_of(path: str) -> str:
    if path in ROUTES:
        return path
    return "/v1/models/{name}" if path.startswith("/v1/models/") else "other"


class ServerMetrics:
    """The server's counters, gauges and histograms, in a registry of their own."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self._children: dict = {}
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
        self.phase_seconds = Histogram(
            "matryoshka2d_phase_duration_seconds",
            "Time of one embeddings request by phase: http (from the first byte the app saw to its body read), parse "
            "(validate and route), tokenize, queue (waiting for its model call), handoff (to the model thread and "
            "back), model (the call itself, shared by the texts of its batch), answer (encode the reply)",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        rung = ["encoder", "layer"]
        self.rung_quality = Gauge(
            "matryoshka2d_rung_quality",
            "Adaptive depth: each rung's quality against the full depth (mean cosine on the calibration texts)",
            rung,
            registry=r,
        )
        self.rung_share = Gauge(
            "matryoshka2d_rung_share", "Adaptive depth: the share of open requests the present mix gives each rung",
            rung, registry=r,
        )  # fmt: skip
        self.rung_ms = Gauge(
            "matryoshka2d_rung_ms_per_text", "Adaptive depth: each rung's model time per text, now", rung, registry=r
        )
        self.arrival_rate = Gauge(
            "matryoshka2d_open_arrivals_per_second", "Adaptive depth: texts of open requests per second", registry=r
        )
        self.stack_ms = Gauge(
            "matryoshka2d_stack_ms_per_request",
            "CPU time of the server's own work per request (all but the model calls), as the ladder measures it",
            registry=r,
        )

    # Every request touches several series: each labelled child is looked up once and kept (prometheus-client's
    # `labels()` validates and hashes its arguments on every call, a tenth of a small request's own time).
    def _child(self, metric, *labels):
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request(self, path: str, status: int, seconds: float) -> None:
        route = route_of(path)
        self._child(self.requests, route, str(status)).inc()
        self._child(self.request_seconds, route).observe(seconds)

    def model_call(self, encoder: str, layer: int, texts: int, seconds: float) -> None:
        self._child(self.batch_texts, encoder).observe(texts)
        self._child(self.model_seconds, encoder, str(layer)).observe(seconds)

    def answered(self, encoder: str, layer: int, texts: int, tokens: int) -> None:
        self._child(self.embeddings, encoder, str(layer)).inc(texts)
        self._child(self.tokens, encoder).inc(tokens)

    def phases(self, ms: dict[str, float]) -> None:
        for phase, value in ms.items():
            self._child(self.phase_seconds, phase).observe(value / 1000)

    def ladder_state(self, described: dict) -> None:
        """The ladder's rungs and load (serve/ladder.Ladder.describe), set when /metrics is read."""
        for rung in described["rungs"]:
            labels = (rung["encoder"], str(rung["layer"]))
            self.rung_quality.labels(*labels).set(rung["quality"])
            self.rung_share.labels(*labels).set(rung["share"])
            self.rung_ms.labels(*labels).set(rung["ms_per_text"])
        self.arrival_rate.set(described["arrival_rate_per_s"])
        self.stack_ms.set(described["stack_ms_per_request"])

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
