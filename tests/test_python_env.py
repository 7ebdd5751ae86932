"""The Python side reads its CUMEM_RS_* variables in one module (`cumem_rs._env`): no other module of the package
names one in an environment read, and `_env` parses a switch as the Rust side does (one parser for both)."""

from __future__ import annotations

import pathlib
import re

import pytest

from cumem_rs import _env

PACKAGE = pathlib.Path(_env.__file__).resolve().parent
#: An environment read that names one of our variables by its literal: os.environ.get("CUMEM_RS_..."),
#: os.environ["CUMEM_RS_..."], os.getenv("CUMEM_RS_..."), env_flag("CUMEM_RS_...", ...).
READ = re.compile(r"""(?:environ(?:\.get)?\s*[\[(]|getenv\s*\(|env_flag\s*\()\s*f?["']CUMEM_RS_""")


def test_no_module_but_env_reads_a_cumem_rs_variable_by_name():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_env.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if READ.search(line):
                offenders.append(f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert offenders == [], "read CUMEM_RS_* through cumem_rs._env"


def test_the_checker_sees_each_form_of_read():
    for line in ('os.environ.get("CUMEM_RS_X")', "os.environ['CUMEM_RS_X']", 'os.getenv("CUMEM_RS_X", "")',
                 '_native.env_flag("CUMEM_RS_X", True)'):
        assert READ.search(line), line
    assert not READ.search('"set CUMEM_RS_X=0 to turn it off"')


@pytest.mark.parametrize("raw, want", [("1", True), ("on", True), ("YES", True), (" true ", True), ("0", False),
                                       ("Off", False), ("no", False), ("", None)])
def test_a_choice_reads_every_spelling_of_a_switch(monkeypatch, raw, want):
    monkeypatch.setenv("CUMEM_RS_TEST_CHOICE", raw)
    assert _env.choice("CUMEM_RS_TEST_CHOICE", "1 or 0") is want
    if want is not None:
        # The Rust side's parser agrees: the same spelling gives the same switch.
        assert _env.flag("CUMEM_RS_TEST_CHOICE", not want) is want


def test_a_mistyped_choice_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("CUMEM_RS_TEST_CHOICE", "maybe")
    with pytest.raises(ValueError, match="CUMEM_RS_TEST_CHOICE='maybe': expected 1 or 0"):
        _env.choice("CUMEM_RS_TEST_CHOICE", "1 or 0")
    monkeypatch.delenv("CUMEM_RS_TEST_CHOICE")
    assert _env.choice("CUMEM_RS_TEST_CHOICE", "1 or 0") is None
