"""The benchmarks' structure: their imports run one way (no circle among benchmarks/, imports inside functions
counted), and no benchmark holds an absolute path of a machine (a path is given by a user, taken relative to the
checkout, from tempfile or from the environment)."""

import ast
import graphlib
import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# An absolute path under a folder that belongs to one machine's set-up, not to the checkout: a name of the root
# folder right after a slash that no name, dot or tilde precedes (so `../shared/data` and `runs/tmp` do not count).
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:work|root|home|opt|tmp|data|mnt|srv|scratch|var|Users|usr/local)(?=/|\b)")


def import_graph(folder: Path) -> dict[str, set[str]]:
    """Each module of `folder` (its *.py, by stem) with the modules of `folder` it imports, anywhere in the file
    (a function's own imports included)."""
    modules = {path.stem: path for path in sorted(folder.glob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
        graph[name] = (imported & modules.keys()) - {name}
    return graph


def import_circle(folder: Path) -> list[str] | None:
    """One circle of imports among the modules of `folder` (its modules in order, the first repeated at the end), or
    None when their imports run one way."""
    try:
        graphlib.TopologicalSorter(import_graph(folder)).prepare()
    except graphlib.CycleError as error:
        return list(error.args[1])
    return None


def machine_paths(folder: Path) -> list[str]:
    """'FILE:LINE: path' for each absolute machine path in the string literals of `folder`'s *.py files (docstrings
    and f-strings included) and in its *.sh files (the #! line aside)."""
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for match in MACHINE_PATH.finditer(node.value):
                    line = node.lineno + node.value[: match.start()].count("\n")
                    found.append(f"{path.name}:{line}: {match.group()}")
    for path in sorted(folder.glob("*.sh")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not (number == 1 and line.startswith("#!")):
                found += [f"{path.name}:{number}: {match.group()}" for match in MACHINE_PATH.finditer(line)]
    return found


def test_the_benchmarks_import_one_way():
    graph = import_graph(BENCHMARKS)
    assert graph["serve_capacity"] >= {"serving_harness", "serve_peers"}  # the graph sees the imports it checks
    assert import_circle(BENCHMARKS) is None, f"an import circle among benchmarks/: {import_circle(BENCHMARKS)}"


def test_an_import_circle_through_a_function_is_found(tmp_path):
    (tmp_path / "harness.py").write_text("def start():\n    from peers import Peer\n    return Peer()\n")
    (tmp_path / "peers.py").write_text("import harness\n\n\nclass Peer:\n    pass\n")
    (tmp_path / "report.py").write_text("import harness\nimport numpy\n")

    assert import_graph(tmp_path) == {"harness": {"peers"}, "peers": {"harness"}, "report": {"harness"}}
    assert import_circle(tmp_path) in (["harness", "peers", "harness"], ["peers", "harness", "peers"])


def test_no_benchmark_holds_a_machine_path():
    assert machine_paths(BENCHMARKS) == []


@pytest.mark.parametrize(
    "source, found",
    [
        ('LOGS = "/tmp/serve-overload"\n', ["bench.py:1: /tmp"]),
        ('"""Run it as\n\n    /work/venvs/peer/bin/python bench.py\n"""\n', ["bench.py:3: /work"]),
        ('venv = f"/home/{user}/venv"\n', ["bench.py:1: /home"]),
        ('data = "../shared/data/nli"\nruns = "runs/tmp"\nproc = f"/proc/{pid}/status"\n', []),
        ('import tempfile\nfolder = tempfile.gettempdir() + "/m2d"\n', []),
    ],
)
def test_a_machine_path_is_found_where_it_is(tmp_path, source, found):
    (tmp_path / "bench.py").write_text(source)

    assert machine_paths(tmp_path) == found


def test_a_machine_path_in_a_shell_script_is_found(tmp_path):
    (tmp_path / "recipe.sh").write_text("#!/usr/bin/env bash\nOUT=${OUT:-runs/recipe}\nDATA=/data/shared\n")

    assert machine_paths(tmp_path) == ["recipe.sh:3: /data"]
