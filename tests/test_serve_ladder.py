"""Adaptive depth (serve/ladder.py, serve/depth.py) on synthetic rungs: the cost model's lines, the linear
program's mix, how requests are dealt to it at a given arrival rate, what comes off the budget (fixed requests, the
stack's time, a backlog), where the calibration texts come from, and a server with a ladder (its answers, its
metrics, its refusal on a model without aligned exits). Nothing here is timed: costs are fixed lines and the clock
is given."""

import itertools
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import linprog

from helpers.data import WORDS
from helpers.models import tiny_transformer
from helpers.server import InProcess, app_of
from matryoshka2d.cli import main
from matryoshka2d.models.encoder import ElasticEncoder
from matryoshka2d.models.heads_fit import fit_heads
from matryoshka2d.serve import ladder as ladder_module
from matryoshka2d.serve.depth import LayerCost, aligned_layers, along_depth
from matryoshka2d.serve.ladder import Ladder, Rung, best_mix, calibration_texts, measure_qualities, upper_hull
from matryoshka2d.serve.timing import QUERY_TEXTS


class FixedCost(LayerCost):
    """A cost model that what the server observes does not move."""

    def observe(self, layer, tokens, ms):
        pass


def fixed(ms_per_layer: dict[int, float]) -> FixedCost:
    """ms a text at each layer, whatever its tokens."""
    return FixedCost({n: [(0.0, ms), (100.0, ms)] for n, ms in ms_per_layer.items()})


def ladder_of(rungs: list[tuple[str, int, float, float]], target_ms=50.0, cores=1.0) -> Ladder:
    """A ladder of (encoder, layer, quality, ms a text) rungs, one cost model per encoder."""
    by_encoder: dict[str, dict[int, float]] = {}
    for encoder, layer, _, ms in rungs:
        by_encoder.setdefault(encoder, {})[layer] = ms
    costs = {encoder: fixed(layers) for encoder, layers in by_encoder.items()}
    out = Ladder([Rung(e, n, q, cost=costs[e]) for e, n, q, _ in rungs], target_ms, cores=cores)
    out._read_stack = lambda now: None  # the stack's time is set by the tests that need it, not read from the process
    return out


# The ladder, in ms a text: the full depth, query encoders of 3 and 2 layers, a static cell.
RUNGS = [("m", 6, 1.00, 2.5), ("q3", 3, 0.955, 1.3), ("q2", 2, 0.924, 0.9), ("static", 0, 0.896, 0.07)]


def test_the_upper_hull_drops_what_a_mix_of_two_others_beats():
    costs = [c for *_, c in RUNGS]
    qualities = [q for _, _, q, _ in RUNGS]
    # q2 lies below the chord from the static cell to q3: at its cost, 0.9 ms, the chord gives 0.896 + 0.059 x
    # (0.83 / 1.23) = 0.936 > 0.924, so a mix of the static cell and q3 beats it at its own cost
    assert upper_hull(costs, qualities) == [3, 1, 0]
    assert upper_hull([1.0, 2.0, 3.0], [0.5, 0.5, 0.9]) == [0, 2]  # no better than a cheaper rung: dropped
    assert upper_hull([1.0, 1.0], [0.7, 0.9]) == [1]  # the same cost: the better one


@pytest.mark.parametrize("seed", range(20))
def test_the_mix_is_the_linear_programs_optimum(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 7))
    costs, qualities = rng.uniform(0.05, 5.0, n), rng.uniform(0.5, 1.0, n)
    for budget in (*rng.uniform(costs.min(), costs.max(), 5), costs.min() / 2, costs.max() * 2):
        shares = best_mix(costs, qualities, budget)
        assert sum(shares) == pytest.approx(1.0) and min(shares) >= 0
        assert sum(s > 0 for s in shares) <= 2  # at most two rungs, neighbours on the hull
        if budget < costs.min():
            assert shares[int(np.argmin(costs))] == 1.0  # nothing fits: the cheapest
            continue
        solved = linprog(-qualities, A_ub=[costs], b_ub=[budget], A_eq=[np.ones(n)], b_eq=[1.0], bounds=[(0, 1)] * n)
        assert np.dot(shares, qualities) == pytest.approx(-solved.fun, abs=1e-9)
        assert np.dot(shares, costs) <= budget + 1e-9


def deal(ladder: Ladder, rate: float, seconds: float, start: float = 100.0) -> dict[str, int]:
    """Requests of one text at a steady `rate` for `seconds`: how many each rung answered."""
    counts: dict[str, int] = {}
    for i in range(int(rate * seconds)):
        rung = ladder.choose(start + i / rate)
        counts[rung.name] = counts.get(rung.name, 0) + 1
    return counts


def test_below_the_full_depths_capacity_every_request_is_answered_at_full_depth():
    ladder = ladder_of(RUNGS)
    # 0.9 x 1000 ms / 2.5 ms = 360 a second fit at full depth
    assert deal(ladder, 300, 3) == {"m@6": 900}


def test_past_it_the_requests_are_dealt_in_the_linear_programs_proportions():
    ladder = ladder_of(RUNGS)
    rate = 2 * 1000 / 2.5  # twice the full depth's capacity: 1.125 ms a text of room at a utilisation of 0.9
    counts = deal(ladder, rate, 3)
    budget = 1000 * ladder_module.UTILISATION / rate
    expected = best_mix([c for *_, c in RUNGS], [q for _, _, q, _ in RUNGS], budget)
    assert expected[2] == 0 and expected[0] == 0  # the static cell and q3 (q2 is off the hull)
    steady = deal(ladder, rate, 2, start=103.0)  # then on: the first arrivals measured their rate from fewer
    total = sum(steady.values())
    for (encoder, layer, *_), share in zip(RUNGS, expected, strict=True):
        assert steady.get(f"{encoder}@{layer}", 0) / total == pytest.approx(share, abs=0.01)
    assert sum(counts.values()) == int(rate * 3)


def test_the_deal_is_by_credit_not_by_chance():
    ladder = ladder_of([("m", 6, 1.0, 2.0), ("s", 0, 0.9, 0.0)])
    rate = 1000 * ladder_module.UTILISATION  # 1 ms of room a text, the full depth 2: half of them at full depth
    names = [ladder.choose(10 + i / rate).name for i in range(2000)][-20:]  # at the steady rate
    assert names.count("m@6") in (9, 10, 11)  # half of 20, dealt evenly, never a run of luck
    assert max(len(list(g)) for k, g in itertools.groupby(names) if k == "s@0") <= 2


def test_fixed_requests_the_stack_and_a_backlog_come_off_the_budget():
    ladder = ladder_of(RUNGS)
    now = 50.0
    for i in range(100):
        ladder.choose(now + i / 100)
    now += 1.0
    rate = ladder.rate(now)
    free = ladder.budget(now, rate)
    assert free == pytest.approx(900 / rate, rel=0.02)
    ladder.fixed(now - 0.5, ladder.costs["m"], 6, texts=40, tokens=400)  # 40 documents at full depth: 100 ms
    assert ladder.budget(now, rate) == pytest.approx((900 - 100) / rate, rel=0.02)
    ladder.stack_ms = 0.5  # the event loop's own time per open request, on the model's core
    assert ladder.budget(now, rate) == pytest.approx((900 - 100 - 0.5 * rate) / rate, rel=0.02)
    two = ladder_of(RUNGS, cores=2.0)  # the loop has a core of its own: its time is not the model's
    two.stack_ms = 0.5
    for i in range(100):
        two.choose(50 + i / 100)
    assert two.budget(now, two.rate(now)) == pytest.approx(900 / two.rate(now), rel=0.02)
    ladder.backlog = lambda: 12.5 + 10.0  # 10 ms past a quarter of the target: drained within half a second
    assert ladder.budget(now, rate) == pytest.approx((900 - 100 - 0.5 * rate - 20) / rate, rel=0.02)
    ladder.backlog = lambda: 50.0  # the whole target waits: the cheapest rung, whatever the mix
    assert {ladder.choose(now + i / 1000).name for i in range(10)} == {"static@0"}


def test_the_rungs_cost_follows_the_calls_they_run_in():
    line = FixedCost({6: [(10.0, 2.0), (320.0, 33.0)]})  # 2 ms a call of 10 tokens, 33 ms for 32 texts of 10
    ladder = Ladder([Rung("m", 6, 1.0, cost=line)], 50.0, cores=1.0)
    ladder.tokens_per_text = 10.0
    assert ladder.rung_ms(ladder.rungs[0]) == pytest.approx(2.0)
    for _ in range(400):  # under load its calls hold 32 texts: a text costs what it costs in such a call
        ladder.observe("m", 6, texts=32, tokens=320, cpu_seconds=0.03, ms=33.0)
    assert ladder.rung_ms(ladder.rungs[0]) == pytest.approx(33.0 / 32, rel=0.02)


def test_a_ladder_needs_a_target_and_a_rung():
    with pytest.raises(ValueError, match="--target-ms must be positive"):
        Ladder([Rung("m", 6, 1.0)], 0.0)
    with pytest.raises(ValueError, match="at least one rung"):
        Ladder([], 50.0)


class Constant:
    """A backend whose vectors at each layer are fixed rows."""

    def __init__(self, rows: dict[int, np.ndarray]):
        self.rows = rows

    def pooled(self, texts, layer, encoded=None):
        return np.tile(self.rows[layer], (len(texts), 1))


def test_a_rungs_quality_is_its_mean_cosine_to_the_full_depth_and_another_width_is_refused():
    full = Constant({6: np.array([1.0, 0.0, 0.0, 0.0]), 3: np.array([1.0, 1.0, 0.0, 0.0])})
    rung = Rung("m", 3, 0.0)
    measure_qualities([(rung, full)], full, 6, ["a", "b"])
    assert rung.quality == pytest.approx(1 / np.sqrt(2))
    narrow = Constant({0: np.array([1.0, 0.0])})
    with pytest.raises(ValueError, match="rung q@0 gives vectors of 2 numbers, the full depth 4"):
        measure_qualities([(Rung("q", 0, 0.0), narrow)], full, 6, ["a"])


def test_calibration_texts_are_the_operators_else_the_records_sentence_files_else_picks_queries(tmp_path):
    sentences = tmp_path / "s.txt"
    sentences.write_text("".join(f"sentence number {i}\n" for i in range(3000)))
    corpus = tmp_path / "beir"
    corpus.mkdir()
    (corpus / "corpus.jsonl").write_text('{"_id": "d1", "title": "", "text": "a document about cells"}\n')
    given, source = calibration_texts([str(sentences)], [], None)
    assert source == "--calibration-texts" and len(given) == ladder_module.CALIBRATION_TEXTS
    assert given[0] == "sentence number 0" and given[1] == "sentence number 8"  # spread over the first 2,048
    records = [{"data": [str(corpus), str(sentences), str(tmp_path / "gone.txt")]}]
    from_records, source = calibration_texts(None, records, None)
    assert from_records == given and "sentence files" in source  # the corpus is not query-like: left out
    fallback, source = calibration_texts(None, [{"data": [str(tmp_path / "gone.txt")]}], None)
    assert fallback == QUERY_TEXTS
    assert "--calibration-texts" in source
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="--calibration-texts: .*empty.txt: no sentences"):
        calibration_texts([str(empty)], [], None)


def test_the_cores_are_the_affinitys_shared_among_the_workers(monkeypatch):
    monkeypatch.setattr(ladder_module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("MATRYOSHKA2D_SERVE_WORKER", raising=False)
    assert ladder_module.process_cores() == 4.0
    monkeypatch.setenv("MATRYOSHKA2D_SERVE_WORKER", "7 8000 1 4")  # worker 1 of 4 (serve/workers.py)
    assert ladder_module.process_cores() == 1.0


def test_the_correction_fills_the_core_the_costs_leave_idle_and_backs_off_a_full_one():
    ladder = ladder_of(RUNGS)
    for i in range(800):  # twice the full depth's capacity: the mix sheds
        ladder.choose(100 + i / 800)
    assert ladder.shares[0] < 1
    before = ladder.budget(101.0, ladder.rate(101.0))
    ladder.correct(0.6)  # the mix was meant to fill 90% of the core and used 60%: the costs were too high
    assert ladder.correction == pytest.approx(np.exp(2.0 * 0.3))
    assert ladder.budget(101.0, ladder.rate(101.0)) == pytest.approx(before * ladder.correction)
    for _ in range(20):
        ladder.correct(1.0)  # a full core: back down, never below half
    assert ladder.correction == 0.5
    ladder.shares = [1.0, 0.0, 0.0, 0.0]  # at rest every request gets the full depth: the correction returns to 1
    for _ in range(30):
        ladder.correct(0.3)
    assert ladder.correction == pytest.approx(1.0, abs=0.01)


def test_a_request_that_finds_the_model_idle_gets_the_full_depth_whatever_the_rate():
    ladder = ladder_of(RUNGS)
    # clients sending their next query as soon as they have an answer: 800 a second, each alone in the server
    assert {ladder.choose(100 + i / 800, idle=True).name for i in range(1600)} == {"m@6"}
    # the same rate with work waiting: the mix (the static cell and q3, twice the full depth's capacity) sheds
    assert {ladder.choose(102 + i / 800).name for i in range(10)} <= {"static@0", "q3@3"}


# -- the cost model, on synthetic lines -----------------------------------------------------------------------------
SYNTHETIC = {1: (1.0, 0.02), 2: (1.0, 0.04), 3: (1.0, 0.06), 4: (1.0, 0.08)}  # ms = 1 + 0.02 x layer x tokens


def line(per_layer_ms: dict[int, tuple[float, float]], kind=LayerCost) -> LayerCost:
    """A cost model whose line per layer is exactly (fixed ms, ms per token)."""
    return kind({n: [(0.0, a), (100.0, a + 100 * b)] for n, (a, b) in per_layer_ms.items()})


def test_the_cost_line_is_the_measured_points_and_follows_what_the_server_observes():
    cost = line(SYNTHETIC)
    assert cost.predict(3, 100) == pytest.approx(7.0) and cost.predict(1, 0) == pytest.approx(1.0)
    for _ in range(200):  # the machine got twice as slow (calls at layer 3 say so): every layer follows
        cost.observe(3, 50, 2 * (1 + 0.06 * 50))
        cost.observe(3, 200, 2 * (1 + 0.06 * 200))
    assert cost.predict(3, 100) == pytest.approx(14.0, rel=0.01)
    assert cost.predict(2, 100) == pytest.approx(10.0, rel=0.01)  # a layer not chosen since is not left stale
    assert cost.describe()["speed_against_the_start"] == pytest.approx(0.5, rel=0.01)


def test_a_layer_timed_off_the_line_of_the_others_is_put_back_on_it_and_the_static_cell_keeps_its_time():
    measured = {0: 0.3, 1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0, 5: 7.0, 6: 7.0}  # layer 5 timed during a burst of load
    fitted = along_depth(measured)
    assert fitted[0] == 0.3
    assert [round(fitted[n], 6) for n in range(1, 7)] == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert along_depth({3: 4.0, 6: 9.0}) == {3: 4.0, 6: 9.0}  # two exits: nothing to fit a line through
    assert along_depth({1: 5.0, 2: 4.0, 3: 3.0}) == {1: 5.0, 2: 4.0, 3: 3.0}  # falling with depth: kept as measured


# -- a server with a ladder ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def aligned(tokenizer):
    """A tiny 4-layer model with closed-form exit heads: exits aligned to its last layer."""
    encoder = ElasticEncoder.from_modules(tiny_transformer("bert", tokenizer.vocab_size), tokenizer, name="aligned")
    sentences = [" ".join(np.random.default_rng(i).choice(WORDS, 6)) for i in range(80)]
    heads, _ = fit_heads(encoder, [sentences])
    encoder.set_exit_heads(heads)
    return encoder


def layer_ladder(encoder: str, layers: list[int], cost: LayerCost) -> Ladder:
    """A ladder of `encoder`'s layers, the deepest of quality 1 and each shallower one a tenth less a layer."""
    deepest = max(layers)
    return Ladder([Rung(encoder, n, 1 - 0.1 * (deepest - n), cost=cost) for n in layers], 50.0, cores=1.0)


def embed(client, **body):
    return client.post("/v1/embeddings", json={"model": "tiny", "input": ["red cat sleeps", "blue dog"], **body})


def test_metrics_parse_as_prometheus_text_and_count_what_happened(aligned):
    from prometheus_client.parser import text_string_to_metric_families

    ladder = layer_ladder("tiny", [1, 2, 3, 4], line(SYNTHETIC, FixedCost))
    with InProcess(app_of(aligned, ladder=ladder)) as server:
        client = server.http
        client.post("/v1/embeddings", json={"model": "tiny", "input": ["red cat", "blue dog"]})
        client.post("/v1/embeddings", json={"model": "tiny", "input": "red cat", "layer": 2})
        client.post("/v1/embeddings", json={"model": "nope", "input": "red cat"})
        text = client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("matryoshka2d_requests_total", (("route", "/v1/embeddings"), ("status", "200")))] == 2
    assert samples[("matryoshka2d_requests_total", (("route", "/v1/embeddings"), ("status", "404")))] == 1
    assert samples[("matryoshka2d_embeddings_total", (("encoder", "tiny"), ("layer", "4")))] == 2
    assert samples[("matryoshka2d_embeddings_total", (("encoder", "tiny"), ("layer", "2")))] == 1
    assert samples[("matryoshka2d_rung_quality", (("encoder", "tiny"), ("layer", "3")))] == pytest.approx(0.9)
    assert samples[("matryoshka2d_rung_share", (("encoder", "tiny"), ("layer", "4")))] == 1.0  # nothing waits
    for phase in ("http", "parse", "tokenize", "queue", "handoff", "model", "answer"):
        assert samples[("matryoshka2d_phase_duration_seconds_count", (("phase", phase),))] == 2
    assert samples[("matryoshka2d_tokens_total", (("encoder", "tiny"),))] > 0
    assert samples[("matryoshka2d_queue_texts", ())] == 0
    for name in (
        "matryoshka2d_request_duration_seconds",
        "matryoshka2d_batch_texts",
        "matryoshka2d_model_duration_seconds",
        "matryoshka2d_phase_duration_seconds",
    ):
        assert families[name].type == "histogram"


def test_adaptive_answers_say_their_layer_and_a_named_layer_is_kept(aligned):
    ladder = layer_ladder("tiny", aligned_layers(aligned), line(SYNTHETIC, FixedCost))
    with InProcess(app_of(aligned, ladder=ladder)) as server:
        client = server.http
        adaptive = embed(client)
        assert adaptive.headers["x-matryoshka2d-layer"] == "4"  # nothing waits: the full depth
        assert [(d["layer"], d["encoder"]) for d in adaptive.json()["data"]] == [(4, "tiny"), (4, "tiny")]
        timing = dict(part.split("=") for part in adaptive.headers["x-matryoshka2d-phases"].split(","))
        assert set(timing) == {"http", "parse", "tokenize", "queue", "handoff", "model", "answer"}
        assert float(adaptive.headers["x-total-time"]) >= float(adaptive.headers["x-inference-time"]) > 0
        assert embed(client, layer="auto").json()["layer"] == 4
        named = embed(client, layer=2).json()
        assert named["layer"] == 2 and named["data"][0]["layer"] == 2
        np.testing.assert_allclose(
            named["data"][0]["embedding"], aligned.encode("red cat sleeps", layer=2, normalize=True), atol=1e-5
        )
    with InProcess(app_of(aligned)) as server:
        refused = embed(server.http, layer="auto")
        assert refused.status_code == 400 and "--adaptive-depth" in refused.json()["error"]["message"]
    with pytest.raises(ValueError, match="the rung other@2 names no model this server runs"):
        app_of(aligned, ladder=Ladder([Rung("other", 2, 1.0)], 50.0, cores=1.0))


def test_adaptive_depth_is_refused_on_a_model_without_aligned_exits(tiny_dir, capsys):
    serve = ["serve", "--model", str(tiny_dir), "--pooling", "mean", "--port", "0", "--adaptive-depth"]
    assert main(serve) == 2
    err = capsys.readouterr().err
    assert "not aligned to its last layer" in err and "distill --mode shared" in err and "--query-model" in err
    assert main(["serve", "--model", str(tiny_dir), "--pooling", "mean", "--port", "0", "--min-layer", "2"]) == 2
    assert "add --adaptive-depth" in capsys.readouterr().err  # --target-ms is the server's own objective now


def test_the_overload_benchmark_bounds_what_any_choice_of_layers_keeps_at_a_load(monkeypatch):
    """benchmarks/serve_overload.py prints, beside adaptive depth's nDCG share, the most any mix of layers could keep
    at that load: at a load between two layers' capacities it mixes those two, using all of the core."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from serve_overload import depth_bound

    depth = [
        {"layer": 1, "of_full": 4.0, "ndcg_share_of_flat": 80.0},
        {"layer": 2, "of_full": 2.0, "ndcg_share_of_flat": 90.0},
        {"layer": 3, "of_full": 1.0, "ndcg_share_of_flat": 100.0},
    ]
    assert depth_bound(depth, 0.5) == pytest.approx(100.0)  # room for every request at full depth
    # at 1.5x: f at layer 3 and 1 - f at layer 2 fill the core: f / 1 + (1 - f) / 2 = 1 / 1.5, f = 1/3
    assert depth_bound(depth, 1.5) == pytest.approx(100 / 3 + 90 * 2 / 3)
    # at 3x: 1/3 at layer 2 and 2/3 at layer 1 (a mix of layers 3 and 1 fits only 1/9 at layer 3: 82.2)
    assert depth_bound(depth, 3.0) == pytest.approx(90 / 3 + 80 * 2 / 3)
    assert depth_bound(depth, 5.0) is None  # not even layer 1 keeps up
