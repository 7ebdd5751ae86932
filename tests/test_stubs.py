"""The type stubs tell the truth: `_native.pyi` matches the compiled module, and the package type-checks.

`mypy.stubtest` imports `cumem_rs._native` and compares every name, signature, default and class property with the
stub, so a Rust-side signature change that the stub misses fails here rather than in a user's type checker.
Both run in a subprocess with a private cache directory (mypy writes one; it must not land in the checkout or
race another run's cache).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "cumem_rs"
# Entries for what stubtest cannot judge, one regex a line, each with a comment why (none are needed today).
ALLOWLIST = Path(__file__).resolve().parent / "stubtest_allowlist.txt"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed")


def _run(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, MYPY_CACHE_DIR=str(cache))
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def test_stub_matches_native_module(tmp_path: Path) -> None:
    args = ["mypy.stubtest", "cumem_rs._native"]
    if ALLOWLIST.exists():
        args += ["--allowlist", str(ALLOWLIST)]
    r = _run(args, tmp_path / "cache")
    assert r.returncode == 0, f"stubtest found mismatches:\n{r.stdout}\n{r.stderr}"


def test_package_type_checks(tmp_path: Path) -> None:
    # torch ships its own types; anything without types (rich, numpy extras) is not ours to check.
    r = _run(["mypy", str(PACKAGE), "--ignore-missing-imports"], tmp_path / "cache")
    assert r.returncode == 0, f"mypy found type errors:\n{r.stdout}\n{r.stderr}"
