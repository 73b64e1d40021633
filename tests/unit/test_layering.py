"""Imports point down only (ARCHITECTURE.md): an AST walk over servelm/ (issue 11).

server -> engine -> {cache, workers -> model, sampling, constrained, lora, spec} -> distributed, with config,
errors, logging_utils and files as leaf modules everyone may use. Deferred imports inside functions count
too: a deferred upward import is still an upward dependency. The front end (server/) may use the
request-side types and validators of sampling/, constrained/ and parsers/, but never model/ or
cache/, which live in the engine process; it may use distributed/'s process helpers
(``die_with_parent`` for its template sandbox), the bottom layer, and disagg/'s request-side
transfer spec (``disagg/spec.py``; the transfer code itself runs in the engine process). The entry points (cli, launch_server, bench, ...) sit on
top and may import each other only without cycles, and nothing imports another unit's private
(underscore) names.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "servelm"

LEAF = {"config", "errors", "logging_utils", "files", "multimodal"}
"""``multimodal`` (the image seam, processors, the encoder cache) imports no other unit: the server,
the engine and the model all use it."""
PEERS = {"cache", "model", "sampling", "constrained", "lora", "spec", "parsers"}
ALLOWED: dict[str, set[str]] = {
    **{leaf: set(LEAF) for leaf in LEAF},
    "distributed": set(LEAF),
    **{peer: {"distributed", *LEAF} for peer in PEERS},
    "workers": {"model", "distributed", *LEAF},
    "disagg": {"cache", "model", "sampling", "distributed", *LEAF},
    "multimodal": set(LEAF),  # request images (media.py) and the seam types (inputs.py)
    "engine": {*PEERS - {"parsers"}, "workers", "disagg", "distributed", "multimodal", *LEAF},
    "server": {"engine", "sampling", "constrained", "parsers", "disagg", "distributed",
               "multimodal", *LEAF},
    "router": set(LEAF),  # talks to servers over HTTP only
}
ENTRY = {"__init__", "__main__", "cli", "cli_args", "cli_flags", "launch_server", "bench",
         "bench_common", "bench_serving"}
"""Top-level modules above the packages: they may import any package, and each other in a DAG."""


def unit_of(path: Path) -> str:
    """The top-level package or module a file belongs to (``engine``, ``cli``, ...)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(imported servelm module, imported names, line) for every import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "servelm":
            found.append((node.module, [alias.name for alias in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names
                      if alias.name.split(".")[0] == "servelm"]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"{path}:{node.lineno}: use absolute servelm imports")
    return found


def targets(module: str, names: list[str]) -> list[str]:
    """The units a ``from servelm[.x] import names`` statement reaches."""
    parts = module.split(".")
    if len(parts) > 1:
        return [parts[1]]
    return list(names)  # from servelm import cli, config


def edges() -> list[tuple[str, str, str, list[str], str]]:
    """(source unit, target unit, imported module, names, location) for every servelm import."""
    result = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = unit_of(path)
        for module, names, line in imports(path):
            for target in targets(module, names):
                if target != source:
                    result.append((source, target, module, names, f"{path.relative_to(PACKAGE.parent)}:{line}"))
    return result


def test_every_unit_is_placed() -> None:
    units = {unit_of(path) for path in PACKAGE.rglob("*.py")}
    unplaced = units - set(ALLOWED) - ENTRY - PEERS
    assert not unplaced, f"add these to the layering table: {sorted(unplaced)}"


def test_imports_point_down() -> None:
    upward = [f"{where}: {source} imports {module}" for source, target, module, _, where in edges()
              if source not in ENTRY and target not in ALLOWED.get(source, set())]
    assert not upward, "upward or sideways imports:\n" + "\n".join(upward)


def test_entry_points_form_no_cycle() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target, _, _, _ in edges():
        if source in ENTRY and target in ENTRY:
            graph[source].add(target)
    visiting: list[str] = []
    done: set[str] = set()

    def visit(unit: str) -> None:
        assert unit not in visiting, f"import cycle: {' -> '.join(visiting[visiting.index(unit):] + [unit])}"
        if unit in done:
            return
        visiting.append(unit)
        for target in sorted(graph[unit]):
            visit(target)
        visiting.pop()
        done.add(unit)

    for unit in sorted(graph):
        visit(unit)


def test_no_private_names_across_units() -> None:
    private = [f"{where}: {source} imports {name} from {module}"
               for source, _, module, names, where in edges()
               for name in names if name.startswith("_") and name != "__version__"]
    assert not private, "private helpers used across units:\n" + "\n".join(private)


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The walk itself works: a deferred upward import inside a function is found."""
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from servelm.engine.outputs import RequestOutput\n")
    assert imports(source) == [("servelm.engine.outputs", ["RequestOutput"], 2)]
    assert targets("servelm.engine.outputs", ["RequestOutput"]) == ["engine"]
    assert "engine" not in ALLOWED["sampling"]
