"""The engine of the embeddings server: it turns one parsed request into an answer, as text-embeddings-inference's
`Infer` and vLLM's serving classes do, apart from HTTP (serve/http.py) and the process (serve/process.py).

For a request to POST /v1/embeddings, in order: the plan (which encoder, layer and width: serve/catalog.py), the
ladder's rung for a request that leaves its layer open (serve/ladder.py), the texts' characters bounded before the
tokenizer sees them, the bound on waiting work (serve/admission.py, before tokenizing too: a refused request costs
no tokenizer time), one tokenizer call (on the event loop for a short request, on a thread of its own for a long one,
so that no request holds /health or the others' answers: serve/texts.py), the micro-batcher (serve/batching.py),
then the vectors cut to their width, made unit length, quantised and written with orjson (serve/protocol.py), and
the metrics and headers of every phase.

Vectors are the first `dimensions` numbers at `layer`, L2-normalised after slicing (as OpenAI's are), so they
equal `ElasticEncoder.encode(texts, layer=layer, dim=dimensions, normalize=True)`. `embedding_type` quantises
those unit vectors afterwards (sentence-transformers' quantize_embeddings): int8 / uint8 over the fixed range
[-1, 1] that every component of a unit vector lies in (so a vector's codes never depend on the other texts of
its batch), binary / ubinary as sign bits packed eight to a byte (ceil(dimensions / 8) numbers).

Every model the engine runs hands its calls to one model thread, so the calls of a ladder's rungs take the core in
turns, as the ladder's cost model adds them up. The engine's state is its own attributes: what is being tokenized
off the loop (`tokenizing`, `tokenizer_working`), the tokenizer's thread while the app runs, and each encoder's
batcher.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.serve.admission import Admission
from matryoshka2d.serve.backends import Backend, TorchBackend
from matryoshka2d.serve.catalog import ADAPTIVE, Catalog, Plan, ServedModel
from matryoshka2d.serve.config import ServerConfig
from matryoshka2d.serve.ladder import Ladder
from matryoshka2d.serve.metrics import ServerMetrics
from matryoshka2d.serve.model_thread import ModelThread
from matryoshka2d.serve.protocol import encode_rows, parse_body, reply_bytes
from matryoshka2d.serve.texts import OFF_LOOP_CHARS, tokenized, within_characters

# What waits for a model answer in `Engine.embed` (the batcher's future, and whether the model is busy, so that the
# request may wait): the answer, or a 499 when the client leaves first (serve/http.py).
UnlessGone = Callable[[asyncio.Future, bool], Awaitable]


@dataclass
class Models:
    """What a server runs: the model under `name`, and query encoders beside it, each a Backend (or an
    ElasticEncoder, run by torch); `query_layers`: a query encoder's own layer (0 for a static cell; default its
    last); `ladder`: the rungs of adaptive depth, or None. serve/loading.py makes one from a ServerConfig; a caller
    with models in memory (a test, a notebook) makes its own."""

    name: str
    main: Backend | ElasticEncoder
    queries: dict[str, Backend | ElasticEncoder] = field(default_factory=dict)
    query_layers: dict[str, int] = field(default_factory=dict)
    ladder: Ladder | None = None


class Engine:
    """One server's state and its answer to each request (see the module's docstring)."""

    def __init__(self, config: ServerConfig, models: Models):
        self.config = config
        self.admission = Admission(config.api_key, config.max_queued_texts, config.max_queue_ms)
        self.metrics = ServerMetrics()
        self.thread = ModelThread()  # every model's calls, in turns on one thread (serve/model_thread.py)
        self.ladder = models.ladder
        observe = self.ladder.observe if self.ladder is not None else None

        def served(name: str, model, layer: int | None = None) -> ServedModel:
            backend = TorchBackend(model, config.batch_size) if isinstance(model, ElasticEncoder) else model
            return ServedModel.of(name, backend, config, self.metrics, self.thread, observe, layer)

        self.main = served(models.name, models.main)
        self.queries = {
            name: served(name, model, models.query_layers.get(name)) for name, model in models.queries.items()
        }
        self.everyone = (self.main, *self.queries.values())
        self.by_name = {s.name: s for s in self.everyone}
        self.catalog = Catalog(self.main, self.queries, config, self.ladder)
        if self.ladder is not None:
            for rung in self.ladder.rungs:
                if rung.encoder not in self.by_name:
                    raise ValueError(f"adaptive depth: the rung {rung.name} names no model this server runs")
            self.ladder.backlog = self.backlog_ms
        self.tokenizing = 0  # texts being tokenized off the loop: admitted, not queued yet
        self.tokenizer_working = 0  # calls running on the tokenizer's thread (one may outlive a request the drain cut)
        self.tokenizer_thread: ThreadPoolExecutor | None = None  # while the app runs (start .. stop)
        self.metrics.queued_texts.set_function(lambda: self.waiting()[0])

    # -- the app's life --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """On the app's event loop, before its first request: the batchers and the tokenizer's thread."""
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="matryoshka2d-tokenizer")
        for served in self.everyone:
            served.batcher.start()
        self.admission.loop_lag.start(asyncio.get_running_loop())

    async def stop(self) -> None:
        """After the last request: a model call or a tokenizing still running is not waited for (`busy` says so)."""
        self.admission.loop_lag.stop()
        for served in self.everyone:
            await served.batcher.stop()
        self.thread.shutdown()
        if self.tokenizer_thread is not None:
            self.tokenizer_thread.shutdown(wait=False, cancel_futures=True)
            self.tokenizer_thread = None

    def busy(self) -> bool:
        """A thread of this engine is still working (a model call or a tokenizing outlived the drain)."""
        return self.tokenizer_working > 0 or any(s.batcher.in_call for s in self.everyone)

    def waiting(self) -> tuple[int, float]:
        """(texts waiting for the model, seconds the model needs for them and the calls it runs): the 429 bounds.
        Every encoder's calls take the one model thread in turns, so a request waits for all of them."""
        queued, seconds = self.tokenizing, self.tokenizing * self.main.batcher.ms_per_text / 1000
        for served in self.everyone:
            queued += served.batcher.queued_texts
            seconds += served.batcher.drain_seconds()
        return queued, seconds

    def backlog_ms(self) -> float:
        """The model's ms for what waits now, all encoders together: the ladder drains a backlog past its target."""
        return sum(s.batcher.queued_texts * s.batcher.model_ms_per_text for s in self.everyone)

    # -- the routes' answers -----------------------------------------------------------------------------------------
    def health(self) -> dict:
        return {"status": "ok", "model": self.main.name, "queued_requests": len(self.main.batcher.queue)}

    def prometheus(self) -> tuple[bytes, str]:
        if self.ladder is not None:
            self.metrics.ladder_state(self.ladder.describe())
        return self.metrics.render()

    async def embed(
        self, raw: bytes, arrived: float, unless_gone: UnlessGone, deadline_ms: float | None = None
    ) -> tuple[bytes, dict[str, str]]:
        """The answer to one POST /v1/embeddings body (`raw`, read at `arrived`, a perf_counter time): its JSON and
        its headers; an ApiError in OpenAI's shape for anything refused. `unless_gone(future, busy)` waits for the
        model's answer, or raises a 499 when the client leaves first (so its texts are skipped); `deadline_ms`: the
        client's own deadline, when it sent one (serve/admission.py)."""
        read = time.perf_counter()
        plan = self.catalog.plan(parse_body(raw))
        served, layer = self._rung(plan)
        texts, cut = within_characters(plan.texts, served.max_chars, served.backend.max_length, self.config.truncate)
        queued, seconds = self.waiting()  # before tokenizing: a refusal costs no tokenizer time
        own = served.batcher.own_call_seconds(len(texts), queued=seconds > 0)
        self.admission.admit(len(texts), queued, seconds, own, deadline_ms)
        parsed = time.perf_counter()
        encoded, used, truncated = await self._tokenized(served, texts, cut)
        tokenized_at = time.perf_counter()
        if self.ladder is not None and plan.layer is not ADAPTIVE:  # documents, named layers: off the ladder's budget
            self.ladder.fixed(time.monotonic(), self.ladder.costs.get(served.name), layer, len(texts), sum(used))
        timing: dict = {}
        busy = any(s.batcher.queued_texts or s.batcher.in_flight for s in self.everyone)  # this request may queue
        vectors, layer = await unless_gone(served.batcher.submit(texts, layer, encoded, timing), busy)
        handed = time.perf_counter()
        content = self._reply(plan, served, layer, vectors, sum(used), truncated)
        done = time.perf_counter()
        phases = {
            "http": 1000 * (read - arrived),
            "parse": 1000 * (parsed - read),
            "tokenize": 1000 * (tokenized_at - parsed),
            **timing,  # queue, handoff, model (serve/batching.py)
            "answer": 1000 * (done - handed),
        }
        self.metrics.phases(phases)
        if seconds > 0:  # it queued behind others: how its estimate held, for the next ones' admission
            self.admission.margin.observe(1000 * (seconds + own), 1000 * (done - parsed))
        headers = {
            "x-matryoshka2d-layer": str(layer),
            "x-matryoshka2d-encoder": served.header_name,
            # text-embeddings-inference's names where they mean the same (ms)
            "x-total-time": f"{1000 * (done - arrived):.3f}",
            "x-tokenization-time": f"{phases['tokenize']:.3f}",
            "x-queue-time": f"{timing.get('queue', 0.0):.3f}",
            "x-inference-time": f"{timing.get('model', 0.0):.3f}",
            "x-matryoshka2d-phases": ",".join(f"{k}={v:.3f}" for k, v in phases.items()),
        }
        return content, headers

    def _rung(self, plan: Plan) -> tuple[ServedModel, int | None]:
        """The encoder and layer that answer `plan`: its own, or, for a request that leaves its layer open, the
        ladder's rung (a request that names its layer is never moved)."""
        if self.ladder is None:
            return plan.served, plan.layer
        self.ladder.request()
        if plan.layer is not ADAPTIVE:
            return plan.served, plan.layer
        idle = not any(s.batcher.queued_texts or s.batcher.in_flight for s in self.everyone)
        rung = self.ladder.choose(time.monotonic(), len(plan.texts), idle)
        return self.by_name[rung.encoder], rung.layer

    async def _tokenized(self, served: ServedModel, texts: list[str], cut: set[int]) -> tuple[dict, list[int], int]:
        """serve/texts.tokenized on the event loop for a short request, else on the tokenizer's thread (with its own
        copy of the tokenizer), while the loop answers the others."""
        max_length, truncate = served.backend.max_length, self.config.truncate
        if sum(map(len, texts)) <= OFF_LOOP_CHARS:
            return tokenized(served.counter, texts, max_length, served.max_chars, truncate, cut)
        self.tokenizing += len(texts)
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.tokenizer_thread, self._tokenized_on_thread, served, texts, cut
            )
        finally:
            self.tokenizing -= len(texts)

    def _tokenized_on_thread(self, served: ServedModel, texts: list[str], cut: set[int]) -> tuple[dict, list[int], int]:
        self.tokenizer_working += 1
        try:
            max_length, truncate = served.backend.max_length, self.config.truncate
            return tokenized(served.thread_counter, texts, max_length, served.max_chars, truncate, cut)
        finally:
            self.tokenizer_working -= 1

    def _reply(
        self, plan: Plan, served: ServedModel, layer: int, vectors: np.ndarray, tokens: int, truncated: int
    ) -> bytes:
        """The answer's JSON, serialised here: a returned dict goes through FastAPI's jsonable_encoder, which visits
        every number of every vector in Python (most of a small cell's request time)."""
        data = encode_rows(vectors[:, : plan.dim], plan.encoding, plan.embedding_type)
        self.metrics.answered(served.name, layer, len(data), tokens)
        reply = {
            "object": "list",
            "data": data,
            "model": served.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "layer": layer,
            "dimensions": plan.dim,
            "embedding_type": plan.embedding_type,
            "truncated_inputs": truncated,
        }
        if plan.annotate:  # routed or adaptive: each item says what made it
            reply["encoder"] = served.name
            for item in data:
                item["layer"], item["encoder"] = layer, served.name
        return reply_bytes(reply)
