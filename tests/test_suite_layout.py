"""The test suite's own layout (issue 59): no test module imports another test module or conftest.py, in an import
statement or in the code a test hands to a child process (what tests share lives in the package tests/helpers/); and
the longest files run first."""

import ast
import re
from pathlib import Path

from helpers.suite import HEAVY_FIRST

TESTS = Path(__file__).resolve().parent
# A module name that is a test module's or conftest's: `import test_x`, `from conftest import y`.
TEST_MODULE = re.compile(r"^(test_\w+|conftest)$")
# The same inside a string of Python code that a test runs in another process (`python -c "..."`).
IN_CODE = re.compile(r"\b(?:from|import)\s+(test_\w+|conftest)\b")


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level module name) of every import in the tree, at any depth (imports inside functions too)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def docstrings(tree: ast.AST) -> set[ast.AST]:
    """The docstring nodes of the module, its classes and its functions (prose, not code)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(first.value)
    return found


def imports_in_code_strings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every test module or conftest that a string of code (not a docstring) imports."""
    prose = docstrings(tree)
    return [
        (node.lineno, match)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node not in prose
        for match in IN_CODE.findall(node.value)
    ]


def test_no_test_module_imports_another_test_module_or_conftest():
    modules = sorted([*TESTS.glob("*.py"), *TESTS.glob("helpers/*.py")])
    assert len(modules) > 50 and TESTS / "helpers" / "__init__.py" in modules  # the walk sees the suite
    offending = []
    for path in modules:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        named = [(line, name) for line, name in imported_modules(tree) if TEST_MODULE.match(name)]
        named += imports_in_code_strings(tree)
        offending += [f"{path.relative_to(TESTS)}:{line} imports {name}" for line, name in named]
    assert not offending, "move what is shared into tests/helpers/:\n" + "\n".join(offending)


def test_the_check_sees_an_import_in_a_function_and_in_code_run_by_a_child_process():
    """The walk bites: an import of a test module inside a function body, or in a `python -c` string, is found."""
    template = 'def f():\n    from {0} import y\n\nCODE = "import sys; from {1} import z"\n'
    tree = ast.parse(template.format("test_x", "conftest"))  # formatted here, so this module's text holds neither
    assert [name for _, name in imported_modules(tree) if TEST_MODULE.match(name)] == ["test_x"]
    assert imports_in_code_strings(tree) == [(4, "conftest")]


def test_the_heavy_files_are_test_files_of_this_suite_named_once():
    """A file renamed or removed would silently drop out of HEAVY_FIRST (and run last again): every name is a test
    file here, once."""
    names = [path.name for path in TESTS.glob("test_*.py")]
    assert [name for name in HEAVY_FIRST if name not in names] == []
    assert len(set(HEAVY_FIRST)) == len(HEAVY_FIRST)


def test_the_collection_starts_with_the_heavy_files_in_their_order(request):
    """What xdist's `--dist loadfile` sees: the session's items, after conftest.py's hook, begin with HEAVY_FIRST's
    files (those collected in this run) in that order, each file's tests together."""
    files = list(dict.fromkeys(item.path.name for item in request.session.items))
    heavy = [name for name in HEAVY_FIRST if name in files]
    assert files[: len(heavy)] == heavy
