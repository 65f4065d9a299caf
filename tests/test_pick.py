"""The cell picker: Pareto frontier, budget choices that are always on it, cached timings, table and PNG."""

import json

import pytest

from helpers.data import result_file
from matryoshka2d.cli import main
from matryoshka2d.pick.picker import Point, mark_frontier, recommend


def points():
    # layer -> ms: 1 -> 1, 2 -> 2, 4 -> 4; score rises with layer and dim
    ms = {1: 1.0, 2: 2.0, 4: 4.0}
    score = {(1, 8): 50, (1, 32): 60, (2, 8): 55, (2, 32): 70, (4, 8): 54, (4, 32): 71}
    out = [Point(n, d, s, ms[n], 4 * d) for (n, d), s in score.items()]
    mark_frontier(out)
    return out


def test_frontier_drops_dominated_cells():
    front = {p.cell for p in points() if p.frontier}
    # (4,8) loses to (2,8): lower score, more time, same bytes; (2,8) stays (fewer bytes than (1,32))
    assert front == {"(1,8)", "(1,32)", "(2,8)", "(2,32)", "(4,32)"}


@pytest.mark.parametrize(
    ("budget", "cell"),
    [
        ({"max_latency_ms": 2.5}, "(2,32)"),
        ({"max_latency_ms": 1.0}, "(1,32)"),
        ({"max_bytes": 32}, "(2,8)"),
        ({"min_score": 65}, "(2,32)"),
        ({}, "(2,32)"),  # no budget: cheapest within 1 point of the best (71) -> 70
    ],
)
def test_recommendation_fits_the_budget(budget, cell):
    pts = points()
    chosen, reason = recommend(pts, **budget)
    assert chosen.cell == cell and reason.startswith(cell)
    if "max_bytes" not in budget:
        assert chosen.frontier


def test_max_bytes_choice_is_on_the_frontier_of_what_fits():
    chosen, reason = recommend(points(), max_bytes=32)
    assert "highest score among the 3 options with <= 32 bytes/vector" in reason
    assert chosen.cell != "(1,8)"


def test_impossible_budgets_say_what_the_cheapest_needs():
    with pytest.raises(
        ValueError, match=r"no cell fits the budget encode time <= 0.5 ms/query: the cheapest needs 1.00"
    ):
        recommend(points(), max_latency_ms=0.5)
    with pytest.raises(ValueError, match="no cell reaches the score 99: the best is 71.00"):
        recommend(points(), min_score=99)


def test_pick_command_measures_once_then_uses_the_cache(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MATRYOSHKA2D_CACHE", str(tmp_path / "cache"))
    results = result_file(tmp_path / "sts", tiny_dir)
    assert main(["pick", "--results", str(results), "--max-bytes", "64"]) == 0
    out = capsys.readouterr()
    assert "measuring encode time per query per layer" in out.err
    chosen = json.loads((results / "pick.json").read_text())["recommended"]
    assert (chosen["layer"], chosen["dim"]) == (4, 8)  # 8 dims x 4 bytes fits; 32 x 4 does not
    assert f"**({chosen['layer']},{chosen['dim']})**" in out.out  # the recommended cell is in the frontier table
    assert (results / "pick.png").stat().st_size > 10_000
    assert (
        main(["pick", "--results", str(results / "results.json"), "--min-score", "50", "--output", str(tmp_path / "o")])
        == 0
    )
    assert "cached" in capsys.readouterr().err
    assert (tmp_path / "cache" / "layer_latency.json").is_file()


def test_pick_errors(tmp_path, capsys):
    assert main(["pick", "--results", str(tmp_path / "nothing")]) == 2
    assert "no results.json" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"task": "sts"}')
    assert main(["pick", "--results", str(bad)]) == 2
    assert "not a matryoshka2d result (missing metric" in capsys.readouterr().err
