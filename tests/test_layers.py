"""The crate's layers, read off its source (tests/rust_imports.py: every `use` form, inline paths, crate-root
re-exports, unit-test modules read too): arrows go one way (bindings -> engine -> components -> driver -> base), no
module of a layer imports one of a layer above it, unit-test code included (held to the same rule, apart, so a test
helper cannot smuggle in an upward dependency), and there is no import cycle between modules (sibling files of one
module included). A module not placed in a layer below fails the test, so a new one gets a place. The checker's own
tests plant each import form in a small crate and see the violation reported."""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from rust_imports import Graph, Module, read_graph

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

needs_src = pytest.mark.skipif(not SRC.is_dir(), reason="needs the source tree (rust/src)")


def upward(edges: dict[Module, set[Module]], rank: dict[str, int]) -> list[tuple[str, str]]:
    return sorted(
        (".".join(m), ".".join(t)) for m, targets in edges.items() for t in targets if rank[t[0]] < rank[m[0]]
    )


def cycles(edges: dict[Module, set[Module]]) -> list[str]:
    # A module and its own children form one unit only through `mod` declarations; their imports between each
    # other are fine. Cycles are looked for between siblings and across the tree.
    def related(a: Module, b: Module) -> bool:
        return a[: len(b)] == b or b[: len(a)] == a

    graph = {m: {t for t in ts if not related(m, t)} for m, ts in edges.items()}
    state: dict[Module, int] = {}
    found: list[str] = []

    def visit(m: Module, stack: list[Module]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                found.append(" -> ".join(".".join(x) for x in stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


@pytest.fixture(scope="module")
def graph() -> Graph:
    return read_graph(SRC)


@needs_src
def test_every_top_level_module_has_a_layer():
    tops = {p.relative_to(SRC).parts[0].removesuffix(".rs") for p in SRC.iterdir() if p.suffix == ".rs" or p.is_dir()}
    assert tops - set(RANK) == set(), f"modules without a layer: {sorted(tops - set(RANK))}"


@needs_src
def test_no_module_imports_from_a_layer_above_it(graph):
    assert upward(graph.code, RANK) == [], "imports of a higher layer"


@needs_src
def test_unit_tests_import_no_layer_above_their_module_either(graph):
    assert upward(graph.tests, RANK) == [], "unit-test imports of a higher layer"


@needs_src
def test_no_import_cycles(graph):
    assert cycles(graph.code) == [], "import cycles"


@needs_src
def test_the_checker_sees_the_crates_imports(graph):
    assert ("backups",) in graph.code[("engine",)]
    assert ("driver",) in graph.code[("backups", "retain")]
    # Grouped, from the bindings: `use crate::{ffi, global, tags};` in preload.rs.
    assert {("ffi",), ("global",), ("tags",)} <= graph.code[("preload",)]
    # A crate-root re-export: python/results.rs imports Report and friends through `crate::`.
    assert ("engine",) in graph.code[("python", "results")]
    # Unit-test code is read (the sim driver's tests live in a file of their own).
    assert any(graph.tests.values())


# --- the checker against planted violations -------------------------------------------------------------------

PLANT_RANK = {"lib": 0, "engine": 1, "backups": 2, "driver": 3}


def plant(tmp_path: pathlib.Path, files: dict[str, str]) -> Graph:
    """A crate with lib.rs re-exporting engine::Report, modules engine, backups (with children) and driver, plus
    `files` (path -> source) on top."""
    base = {
        "lib.rs": "pub mod backups;\npub mod driver;\npub mod engine;\npub use engine::{Engine, Report};\n",
        "engine/mod.rs": "pub struct Engine;\npub struct Report;\npub fn run() {}\n",
        "driver/mod.rs": "pub trait Driver {}\n",
        "backups/mod.rs": "mod retain;\nmod tier;\nuse crate::driver::Driver;\n",
        "backups/retain.rs": "pub struct Retention;\n",
        "backups/tier.rs": "pub struct Tier;\n",
    }
    base.update(files)
    for rel, text in base.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return read_graph(tmp_path)


def test_a_clean_planted_crate_has_no_violation(tmp_path):
    g = plant(tmp_path, {})
    assert upward(g.code, PLANT_RANK) == [] and upward(g.tests, PLANT_RANK) == []
    assert ("driver",) in g.code[("backups",)]


@pytest.mark.parametrize(
    "source",
    [
        "use crate::engine::Engine;\n",
        "use crate::{engine::Engine};\n",
        "use crate::{driver::Driver, engine};\n",
        "use crate::{driver::{Driver}, engine::{self, Report}};\n",
        "use crate::Report;\n",  # through the crate root's re-export
        "use crate::{Engine as E};\n",
        "use crate::engine::*;\n",
        "pub(crate) use crate::engine::run;\n",
        "use\n    crate::{\n        engine::Engine,\n    };\n",
        "fn f() { crate::engine::run() }\n",  # an inline path, no `use`
        "#[cfg(test)]\nfn helper() {}\nuse crate::engine::Engine;\n",  # after a cfg(test) item that is no module
    ],
    ids=["plain", "grouped", "grouped-two", "nested-self", "root-reexport", "renamed", "glob", "pub-crate",
         "multiline", "inline-path", "after-cfg-test-fn"],
)
def test_each_import_form_of_a_higher_layer_is_reported(tmp_path, source):
    g = plant(tmp_path, {"backups/tier.rs": source})
    assert upward(g.code, PLANT_RANK) == [("backups.tier", "engine")], source


@pytest.mark.parametrize(
    "source",
    [
        "use super::super::engine::Engine;\n",
        "use super::{super::engine, retain};\n",
        "fn f() { super::super::engine::run() }\n",
    ],
    ids=["super-chain", "super-grouped", "super-inline"],
)
def test_relative_paths_up_the_tree_are_reported(tmp_path, source):
    g = plant(tmp_path, {"backups/tier.rs": source})
    assert upward(g.code, PLANT_RANK) == [("backups.tier", "engine")], source


def test_self_and_child_paths_resolve_to_the_child(tmp_path):
    g = plant(tmp_path, {"backups/mod.rs": "mod retain;\nmod tier;\nuse self::retain::Retention;\nuse tier::Tier;\n"})
    assert {("backups", "retain"), ("backups", "tier")} <= g.code[("backups",)]


def test_comments_and_strings_are_not_imports(tmp_path):
    source = (
        '// use crate::engine::Engine;\n/* crate::engine::run() */\n'
        'const URL: &str = "http://x/ crate::engine::run()";\nuse crate::driver::Driver;\n'
    )
    g = plant(tmp_path, {"backups/tier.rs": source})
    assert upward(g.code, PLANT_RANK) == [] and ("driver",) in g.code[("backups", "tier")]


def test_unit_test_modules_are_read_and_held_apart(tmp_path):
    inline = "pub struct Tier;\n#[cfg(test)]\nmod tests {\n    use super::*;\n    use crate::engine::Engine;\n}\n"
    g = plant(tmp_path, {"backups/tier.rs": inline})
    assert upward(g.code, PLANT_RANK) == []
    assert upward(g.tests, PLANT_RANK) == [("backups.tier", "engine")]


def test_a_test_module_in_a_file_of_its_own_is_test_code(tmp_path):
    g = plant(tmp_path, {
        "backups/tier.rs": "pub struct Tier;\n#[cfg(test)]\nmod tests;\n",
        "backups/tier/tests.rs": "use crate::engine::Engine;\n",
    })
    assert upward(g.code, PLANT_RANK) == []
    assert upward(g.tests, PLANT_RANK) == [("backups.tier.tests", "engine")]


def test_a_planted_cycle_between_siblings_is_found(tmp_path):
    g = plant(tmp_path, {
        "backups/retain.rs": "use super::tier::Tier;\n",
        "backups/tier.rs": "use super::retain::Retention;\n",
    })
    assert cycles(g.code) == ["backups.retain -> backups.tier -> backups.retain"]
