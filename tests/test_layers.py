"""The crate's layers, read off its `use` lines: arrows go one way (bindings -> engine -> components -> driver ->
base), no module of a layer imports one of a layer above it, and there is no import cycle between modules (sibling
files of one module included). A module not placed in a layer below fails the test, so a new one gets a place."""

from __future__ import annotations

import itertools
import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).resolve().parent.parent / "rust" / "src"

# Top-level modules by layer, highest first.
LAYERS = [
    ("bindings", {"python", "ffi", "preload", "global", "lib"}),
    ("engine", {"engine"}),
    ("components", {"backups", "registry", "tags", "address_space", "transfer", "host"}),
    ("driver", {"driver"}),
    ("base", {"env", "error", "error_log", "fingerprint", "host_guard", "logbuf", "timing"}),
]
RANK = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}

pytestmark = pytest.mark.skipif(not SRC.is_dir(), reason="needs the source tree (rust/src)")


def _module(path: pathlib.Path) -> tuple[str, ...]:
    parts = path.relative_to(SRC).with_suffix("").parts
    return parts[:-1] if parts[-1] == "mod" else parts


def _code(path: pathlib.Path) -> str:
    """The file without comments and without its unit tests."""
    text = path.read_text().split("#[cfg(test)]")[0]
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def _imports() -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    modules = {_module(p): p for p in SRC.rglob("*.rs")}
    edges: dict[tuple[str, ...], set[tuple[str, ...]]] = {m: set() for m in modules}
    for m, path in modules.items():
        code = _code(path)
        for hit in re.finditer(r"\bcrate::((?:[a-z_]+::)*[a-z_]+)", code):
            target = tuple(hit[1].split("::"))
            while target and target not in modules:
                target = target[:-1]
            if target and target != m:
                edges[m].add(target)
        parent = m[:-1]
        for hit in re.finditer(r"\bsuper::([a-z_]+)", code):
            target = parent + (hit[1],)
            if target in modules and target != m:
                edges[m].add(target)
    return edges


def test_every_top_level_module_has_a_layer():
    tops = {p.relative_to(SRC).parts[0].removesuffix(".rs") for p in SRC.iterdir() if p.suffix == ".rs" or p.is_dir()}
    assert tops - set(RANK) == set(), f"modules without a layer: {sorted(tops - set(RANK))}"


def test_no_module_imports_from_a_layer_above_it():
    upward = [
        (".".join(m), ".".join(t))
        for m, targets in _imports().items()
        for t in targets
        if RANK[t[0]] < RANK[m[0]]
    ]
    assert upward == [], f"imports of a higher layer: {upward}"


def test_no_import_cycles():
    edges = _imports()
    # A module and its own children form one unit only through `mod` declarations; their imports between each
    # other are fine. Cycles are looked for between siblings and across the tree.
    def related(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
        return a[: len(b)] == b or b[: len(a)] == a

    graph = {m: {t for t in ts if not related(m, t)} for m, ts in edges.items()}
    state: dict[tuple[str, ...], int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                cycles.append(" -> ".join(".".join(x) for x in stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == [], f"import cycles: {cycles}"


def test_the_checker_sees_imports():
    edges = _imports()
    assert ("backups",) in edges[("engine",)]
    assert ("driver",) in edges[("backups", "retain")]
    assert not any(itertools.chain.from_iterable(
        (t[0] == "engine" for t in ts) for m, ts in edges.items() if m[0] == "backups"
    ))
