"""docs/layout.md names every module of the crate (rust/src) and of the package (python/cumem_rs), and every path it
names exists: the map holds. An entry is a path, `dir/{a,b}.rs` for several files, or a directory entry ending in
`/` for a subpackage whose modules the entry describes as a whole (only those listed in WHOLE_DIRS)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYOUT = ROOT / "docs" / "layout.md"
# Subpackages named as a whole: the benchmark (one module per table, listed by `python -m cumem_rs bench --help`).
WHOLE_DIRS = {"python/cumem_rs/bench/"}

pytestmark = pytest.mark.skipif(not (ROOT / "rust" / "src").is_dir() or not LAYOUT.is_file(),
                                reason="needs the source tree")


def named_paths() -> set[str]:
    block = LAYOUT.read_text().split("## Source layout", 1)[1].split("```")[1]
    names: set[str] = set()
    for line in block.splitlines():
        for token in re.findall(r"(?:rust|python|tests|benches|scripts)/(?:[^\s;,{}]|\{[^}]*\})*", line):
            m = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", token)
            if m:
                names.update(f"{m[1]}{part}{m[3]}" for part in m[2].split(","))
            else:
                names.add(token)
    return names


def modules() -> set[str]:
    rust = {p.relative_to(ROOT).as_posix() for p in (ROOT / "rust" / "src").rglob("*.rs")}
    py = {p.relative_to(ROOT).as_posix() for p in (ROOT / "python" / "cumem_rs").rglob("*.py")}
    return rust | py


def covered(path: str, names: set[str]) -> bool:
    return path in names or any(d in names and path.startswith(d) for d in WHOLE_DIRS)


def test_every_module_is_named():
    names = named_paths()
    missing = sorted(p for p in modules() if not covered(p, names))
    assert missing == [], f"modules docs/layout.md does not name: {missing}"


def test_every_named_path_exists():
    gone = sorted(n for n in named_paths() if "*" not in n and not (ROOT / n).exists())
    assert gone == [], f"docs/layout.md names paths that do not exist: {gone}"


def test_the_parser_reads_groups_and_files():
    names = named_paths()
    assert {"rust/src/driver/mod.rs", "rust/src/driver/cuda.rs", "rust/src/driver/sim.rs"} <= names
    assert "python/cumem_rs/memory_saver.py" in names
