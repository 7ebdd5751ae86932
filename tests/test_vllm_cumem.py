"""vLLM's own allocator tests, run unchanged against cumem_rs's `CuMemAllocator`.

Two versions of vLLM's test_cumem.py, fetched by commit by `scripts/vllm_files.sh` into DEST/vllm_tests (DEST is
`.vllm_src` or CUMEM_TEST_VLLM_SRC, as for tests/test_vllm_plugin.py): tests/basic_correctness/test_cumem.py of
3eec60f9 and tests/basic_correctness/memory/cumem/test_cumem.py of 016993098. Each of their tests runs in a child
pytest of its own, over vLLM 0.33's modules, with the stand-ins of `vllm_cumem_standin` (vLLM's allocator calls
routed to cumem_rs by its vLLM plugin). The tables below say, for every test of each file, whether it runs here and,
if not, why; `test_tables_cover_every_test_of_the_file` holds them to the file's real list (no GPU needed). The tests
themselves need a GPU and skip without one, or without vLLM's files.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

import cumem_rs

ROOT = Path(__file__).resolve().parent.parent
VLLM_SRC = Path(os.environ.get("CUMEM_TEST_VLLM_SRC") or ROOT / ".vllm_src")
HAS_GPU = cumem_rs.cuda_available()

ENGINE = "needs vLLM's engine (vllm.LLM) and a Hugging Face model"
POISON = (
    "monkeypatches vLLM's own C extension (cumem.create_and_map, cumem.libcudart) to poison woken memory; cumem_rs "
    "never calls them (its counterpart is the tag policy wake_fill='zero')"
)


class VllmTests(NamedTuple):
    package: str
    path: str  # inside the package
    commit: str
    run: tuple[str, ...]  # expected to pass on a GPU
    left_out: dict[str, str]  # test id -> why it is not run

    @property
    def file(self) -> Path:
        return VLLM_SRC / "vllm_tests" / self.package / self.path


OLD = VllmTests(
    "vllm_tests_3eec60f9",
    "basic_correctness/test_cumem.py",
    "3eec60f9dbac42c63338028b32ff268e716a7624",
    run=("test_python_error", "test_basic_cumem", "test_cumem_with_cudagraph"),
    left_out={
        "test_end_to_end[hmellor/tiny-random-LlamaForCausalLM]": ENGINE,
        "test_end_to_end[facebook/opt-125m]": ENGINE,
        "test_deep_sleep": ENGINE,
        "test_deep_sleep_async": ENGINE,
        "test_deep_sleep_fp8_kvcache": ENGINE,
    },
)

NEW = VllmTests(
    "vllm_tests_016993098",
    "basic_correctness/memory/cumem/test_cumem.py",
    "016993098b69fb9ce8ff941ef60aa2e9baeb11b6",
    run=(
        "test_python_error",
        "test_allocation_after_driver_error",
        "test_basic_cumem",
        "test_discard_tags",
        "test_selective_wake_restores_internal_tags[workspace]",
        "test_selective_wake_restores_internal_tags[default]",
        # Skips (saying so) where vllm.v1.worker.workspace cannot be imported: it needs vLLM's config package.
        "test_workspace_scratch_discarded_on_sleep",
        "test_reentered_tag[x-freed]",
        "test_reentered_tag[x-alive]",
        "test_runtime_state_survives_sleep[sleep-1]",
        "test_runtime_state_survives_sleep[sleep-2]",
        "test_cumem_with_cudagraph",
        "test_cudagraph_pool_sleep[sleep-1]",
        "test_cudagraph_pool_sleep[sleep-2]",
    ),
    left_out={
        "test_release_kv_cache_memory_preserves_generation[kv-only]": ENGINE,
        "test_release_kv_cache_memory_preserves_generation[sleep-1]": ENGINE,
        "test_release_kv_cache_memory_preserves_generation[sleep-2]": ENGINE,
        "test_sleep_with_only_weights_asleep[1-1]": ENGINE,
        "test_sleep_with_only_weights_asleep[1-2]": ENGINE,
        "test_sleep_with_only_weights_asleep[2-1]": ENGINE,
        "test_sleep_with_only_weights_asleep[2-2]": ENGINE,
        "test_level2_discards_ordinary_tensor_with_weights_tag": POISON,
    },
)

#: Tests that skip, saying why, where vLLM's modules they import cannot be imported (`vllm_cumem_standin.NEEDS`);
#: any other skip of a test in a `run` table is a failure.
MAY_SKIP = ("test_workspace_scratch_discarded_on_sleep", "test_cudagraph_pool_sleep")


def _missing(tests: VllmTests) -> str:
    if sys.version_info < (3, 11):
        return "vLLM 0.33.0 needs Python >= 3.11"
    if not (VLLM_SRC / "VLLM_VERSION").is_file():
        return f"vLLM's modules are not in {VLLM_SRC} (scripts/dev.sh test fetches them: scripts/vllm_files.sh)"
    if not tests.file.is_file():
        return f"vLLM's {tests.path} of {tests.commit[:9]} is not in {tests.file.parent} (scripts/vllm_files.sh)"
    return ""


def _pytest(tests: VllmTests, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """A child pytest over `tests`'s file with the stand-ins, outside this checkout's pytest configuration."""
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\n")
    env = dict(os.environ, CUMEM_TEST_VLLM_SRC=str(VLLM_SRC))
    env.pop("CUMEM_RS_VLLM", None)
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(VLLM_SRC), here, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pytest", "-p", "vllm_cumem_standin", "-p", "no:cacheprovider", "-c", str(ini),
           "--rootdir", str(VLLM_SRC / "vllm_tests"), *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def _params(tests: VllmTests) -> list:
    marks = [pytest.mark.skipif(bool(_missing(tests)), reason=_missing(tests) or "-")]
    return [pytest.param(tests, id=tests.commit[:9], marks=marks)]


@pytest.mark.parametrize("tests", _params(OLD) + _params(NEW))
def test_tables_cover_every_test_of_the_file(tests: VllmTests, tmp_path: Path) -> None:
    """The file imports through the stand-ins (no GPU needed), and each of its tests is in exactly one table."""
    r = _pytest(tests, ["--collect-only", "-q", str(tests.file)], tmp_path)
    assert r.returncode == 0, f"collection failed ({r.returncode}):\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"
    collected = sorted(line.split("::", 1)[1] for line in r.stdout.splitlines() if "::" in line)
    assert collected == sorted([*tests.run, *tests.left_out]), r.stdout
    assert not set(tests.run) & set(tests.left_out)


def _run_params() -> list:
    params = []
    for tests in (OLD, NEW):
        missing = _missing(tests) or ("" if HAS_GPU else "no CUDA device (cuda_available() is False)")
        marks = [pytest.mark.skipif(bool(missing), reason=missing or "-")]
        params += [pytest.param(tests, test, id=f"{tests.commit[:9]}-{test}", marks=marks) for test in tests.run]
    return params


@pytest.mark.parametrize("tests,test", _run_params())
def test_vllm_test_passes(tests: VllmTests, test: str, tmp_path: Path) -> None:
    r = _pytest(tests, ["-q", "-rs", f"{tests.file}::{test}"], tmp_path)
    out = f"{r.stdout[-8000:]}\n{r.stderr[-4000:]}"
    if r.returncode == 0 and " skipped" in r.stdout and " passed" not in r.stdout and test.startswith(MAY_SKIP):
        pytest.skip(next((line for line in r.stdout.splitlines() if line.startswith("SKIPPED")), out))
    assert r.returncode == 0 and "1 passed" in r.stdout, f"vLLM's {test} did not pass ({r.returncode}):\n{out}"
