"""The ladder of adaptive depth (deploy/ladder.py) on synthetic rungs: the linear program's mix, how requests are
dealt to it at a given arrival rate, what comes off the budget (fixed requests, the stack's time, a backlog), and
where the calibration texts come from. Nothing here is timed: costs are fixed lines and the clock is given."""

import itertools

import numpy as np
import pytest
from scipy.optimize import linprog

from matryoshka2d.deploy import ladder as ladder_module
from matryoshka2d.deploy.cost import QUERY_TEXTS
from matryoshka2d.deploy.depth import LayerCost
from matryoshka2d.deploy.ladder import Ladder, Rung, best_mix, calibration_texts, measure_qualities, upper_hull


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
    monkeypatch.setenv("MATRYOSHKA2D_SERVE_WORKER", "7 8000 1 4")  # worker 1 of 4 (deploy/workers.py)
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
