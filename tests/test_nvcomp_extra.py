"""scripts/nvcomp_extra.py, which `scripts/dev.sh test` runs: on a GPU machine it installs the nvCOMP wheel of
torch's CUDA major (the package's extra), never on a CPU-only one, and never fails the run when pip cannot; its
summary line says whether the codec's CUDA tests ran, or why not. Skipped outside the source tree."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "nvcomp_extra.py"

pytestmark = pytest.mark.skipif(not SCRIPT.is_file(), reason="not run from the source tree")


@pytest.fixture(scope="module")
def extra():
    spec = importlib.util.spec_from_file_location("nvcomp_extra", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pyproject() -> str:
    return (ROOT / "pyproject.toml").read_text()


# A stand-in for pip: records the requirement it was given in a file, exits with the given status.
def _fake_pip(tmp_path, status: int) -> tuple[list[str], Path]:
    log = tmp_path / "pip-args"
    code = f"import sys; open({str(log)!r}, 'w').write(sys.argv[-1]); sys.exit({status})"
    return [sys.executable, "-c", code], log


@pytest.mark.parametrize("major", [12, 13])
def test_the_requirement_is_the_extra_of_torchs_cuda_major(extra, pyproject, major):
    assert extra.extra_requirement(major, pyproject) == f"nvidia-libnvcomp-cu{major}>=6,<7"
    assert extra.plan(True, major, [], pyproject) == (f"nvidia-libnvcomp-cu{major}>=6,<7", "")


def test_nothing_is_installed_without_a_gpu_or_when_it_is_there(extra, pyproject):
    assert extra.plan(False, 12, [], pyproject)[0] is None
    assert extra.plan(True, 13, [13], pyproject)[0] is None
    assert extra.plan(True, 12, [13], pyproject)[0] == "nvidia-libnvcomp-cu12>=6,<7", "the wrong major is not it"
    requirement, why = extra.plan(True, None, [], pyproject)
    assert requirement is None and "no CUDA build" in why
    requirement, why = extra.plan(True, 11, [], pyproject)
    assert requirement is None and "no nvCOMP extra" in why


def test_install_runs_pip_with_the_requirement(extra, pyproject, tmp_path):
    pip, log = _fake_pip(tmp_path, 0)
    assert extra.install(True, 12, [], pyproject, pip=pip)
    assert log.read_text() == "nvidia-libnvcomp-cu12>=6,<7"


def test_a_failed_install_warns_and_never_fails(extra, pyproject, tmp_path, capsys):
    pip, log = _fake_pip(tmp_path, 1)  # what pip does when the registry cannot be reached
    assert extra.install(True, 13, [], pyproject, pip=pip) is False
    assert log.read_text() == "nvidia-libnvcomp-cu13>=6,<7"
    err = capsys.readouterr().err
    assert "could not install nvidia-libnvcomp-cu13" in err and "will skip" in err
    assert extra.install(True, 13, [], pyproject, pip=["/nonexistent/pip"]) is False  # pip not even there


def test_a_cpu_only_machine_runs_no_pip_and_says_nothing(extra, pyproject, tmp_path, capsys):
    pip, log = _fake_pip(tmp_path, 0)
    assert extra.install(False, 12, [], pyproject, pip=pip) is False
    assert not log.exists() and capsys.readouterr().err == ""
    assert extra.summary(False) == "codec CUDA tests: skipped (no GPU here)"


def test_main_without_a_known_command_is_a_usage_error(extra, capsys):
    assert extra.main(["frobnicate"]) == 2
    assert "usage" in capsys.readouterr().err
