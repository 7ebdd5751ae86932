"""What pip installs agrees with itself: one version everywhere, the torch bound the code enforces, typing files.

These run against whichever cumem_rs is imported: the editable build in the source tree, or the release wheel
installed into a fresh venv (`scripts/dev.sh test-installed`), where the source-tree test skips.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import cumem_rs
from cumem_rs import allocator

ROOT = Path(__file__).resolve().parents[1]


def _requirement(name: str) -> str:
    reqs = importlib.metadata.requires("cumem_rs") or []
    found = [r for r in reqs if re.match(rf"{name}\b", r) and "extra ==" not in r]
    assert len(found) == 1, f"expected one unconditional {name} requirement, got {reqs}"
    return found[0]


def test_version_of_extension_matches_installed_metadata():
    # __version__ comes from the compiled extension (Cargo.toml at build time), the metadata from the wheel or the
    # editable install: a stale extension next to fresh metadata (or the reverse) shows up here.
    assert cumem_rs.__version__ == importlib.metadata.version("cumem_rs")
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", cumem_rs.__version__), cumem_rs.__version__


@pytest.mark.skipif(not (ROOT / "Cargo.toml").exists(), reason="not run from the source tree")
def test_cargo_toml_is_the_one_version_source():
    cargo = (ROOT / "Cargo.toml").read_text()
    package = cargo.split("[package]", 1)[1].split("\n[", 1)[0]
    m = re.search(r'^version\s*=\s*"([^"]+)"', package, re.M)
    assert m, "Cargo.toml [package] has no version"
    assert cumem_rs.__version__ == m[1]
    project = (ROOT / "pyproject.toml").read_text().split("[project]", 1)[1].split("\n[", 1)[0]
    assert not re.search(r"^version\s*=", project, re.M), "pyproject.toml must take the version from Cargo.toml"
    assert re.search(r'^dynamic\s*=\s*\[[^\]]*"version"', project, re.M)


def test_torch_requirement_matches_the_runtime_check():
    # CuMemAllocator refuses torch older than _MIN_TORCH; pip must refuse the same versions up front.
    req = _requirement("torch")
    m = re.fullmatch(r"torch\s*>=\s*(\d+)\.(\d+)", req.replace(" ", ""))
    assert m, f"torch requirement is {req!r}, expected a plain lower bound"
    assert (int(m[1]), int(m[2])) == allocator._MIN_TORCH


def test_metadata_a_user_reads():
    meta = importlib.metadata.metadata("cumem_rs")
    assert meta["Summary"] and "PyTorch" in meta["Summary"]
    assert meta["Requires-Python"] == ">=3.10"
    assert meta["Description-Content-Type"].startswith("text/markdown")
    readme = meta["Description"] or meta.get_payload() or ""
    assert readme.startswith("# cumem_rs") and "\n## Install\n" in readme, "the README is not the long description"
    classifiers = set(meta.get_all("Classifier") or [])
    assert {f"Programming Language :: Python :: 3.{minor}" for minor in range(10, 14)} <= classifiers
    assert "Operating System :: POSIX :: Linux" in classifiers


def test_typing_files_ship_next_to_the_package():
    package = Path(cumem_rs.__file__).parent
    assert (package / "py.typed").is_file()
    assert (package / "_native.pyi").is_file()
    assert Path(cumem_rs._native.__file__).parent == package


def test_installed_requirements_are_satisfied():
    # The venv of `scripts/dev.sh test-installed` borrows its torch; what it borrows must be what pip would accept.
    from packaging.requirements import Requirement

    for req in map(Requirement, importlib.metadata.requires("cumem_rs") or []):
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        have = importlib.metadata.version(req.name)
        assert req.specifier.contains(have, prereleases=True), f"{req.name} {have} does not satisfy {req}"
