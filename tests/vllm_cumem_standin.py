"""pytest plugin for vLLM's own allocator tests run against cumem_rs (loaded with `-p vllm_cumem_standin` in the child
processes of tests/test_vllm_cumem.py; never by the suite itself).

vLLM's test files (`scripts/vllm_files.sh` fetches them by commit into DEST/vllm_tests) run unchanged, over vLLM
0.33's own modules (DEST, `CUMEM_TEST_VLLM_SRC`), with these stand-ins, each only where vLLM's own piece is missing:

* The allocator: vLLM's `get_mem_allocator_instance()` and `CuMemAllocator.get_instance()` answer cumem_rs's
  `CuMemAllocator`, routed by cumem_rs's vLLM plugin (`CUMEM_RS_VLLM=1`), as in a vLLM run with
  `--sleep-mode-backend cumem_rs`. Not a stand-in: the product's own path.
* `vllm.device_allocator.cumem.lib_name` (None without vLLM's compiled allocator): `cumem_rs.allocator.lib_name`,
  the library that exports the `my_malloc` / `my_free` the tests call through ctypes.
* vLLM's tests/utils.py (the tests import it relatively): `create_new_process_for_each_test` runs the test as it is
  (the runner already starts one process per test), `requires_fp8` skips.
* `vllm.LLM`, `SamplingParams`, `AsyncEngineArgs`, `AsyncLLMEngine` where vLLM's engine cannot be imported (vLLM's
  modules without its dependencies): placeholders that skip the test that uses them.
* The CUDA platform where vLLM's own (`vllm.platforms.cuda`) cannot load (no compiled kernels) and a GPU is there: a
  `Platform` with CUDA's enum and device type (the rest, e.g. `graph_pool_handle`, `mem_get_info`, is torch.cuda's
  through `Platform.__getattr__`).
* `vllm.config.VllmConfig` where vLLM's config package cannot be imported: a placeholder class
  (`vllm/compilation/cudagraph_pool.py` names it only in an annotation; the tests pass their own configs).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import pytest

VLLM_SRC = Path(os.environ["CUMEM_TEST_VLLM_SRC"])

#: vLLM modules a test imports in its body that vLLM's modules alone may not import (vLLM's config package needs its
#: full dependencies; the NCCL graph allocator zmq and urllib3): without them the test skips, saying which.
NEEDS = {
    "test_workspace_scratch_discarded_on_sleep": ("vllm.v1.worker.workspace",),
    "test_cudagraph_pool_sleep": (
        "vllm.distributed.device_communicators.pynccl_allocator",
        "vllm.compilation.cudagraph_pool",
    ),
}


def _import_error(name: str) -> str:
    """Why `name` does not import ("" when it does)."""
    try:
        importlib.import_module(name)
        return ""
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _importable(name: str) -> bool:
    return not _import_error(name)


def _utils_module(package: str) -> types.ModuleType:
    utils = types.ModuleType(f"{package}.utils", "Stand-in for vLLM's tests/utils.py (vllm_cumem_standin).")

    def create_new_process_for_each_test(method: object = None):
        return lambda test: test

    utils.create_new_process_for_each_test = create_new_process_for_each_test  # type: ignore[attr-defined]
    utils.requires_fp8 = pytest.mark.skip(reason="needs a vLLM engine and a model (not run against cumem_rs)")
    return utils


class _NeedsEngineMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith(("_", "pytest")):  # what collection looks up on module attributes (__test__, ...)
            raise AttributeError(name)
        pytest.skip(f"needs vLLM's engine ({cls.__name__}), which vLLM's modules without its dependencies lack")


def _needs_engine(name: str) -> type:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pytest.skip(f"needs vLLM's engine ({name}), which vLLM's modules without its dependencies lack")

    return _NeedsEngineMeta(name, (), {"__init__": __init__})


def _cuda_platform() -> None:
    import cumem_rs
    import vllm.platforms

    if not cumem_rs.cuda_available() or _importable("vllm.platforms.cuda"):
        return
    from vllm.platforms.interface import Platform, PlatformEnum

    class CudaWithoutKernels(Platform):
        _enum = PlatformEnum.CUDA
        device_name = device_type = "cuda"
        dispatch_key = "CUDA"

    vllm.platforms._current_platform = CudaWithoutKernels()


def pytest_configure(config: pytest.Config) -> None:
    sys.path.append(str(VLLM_SRC / "deps"))  # after the installed packages, which win
    os.environ["CUMEM_RS_VLLM"] = "1"
    # First: vllm.device_allocator (which the plugin's registry import brings in) binds the platform at import.
    _cuda_platform()
    import cumem_rs.vllm_plugin
    import vllm
    from cumem_rs.allocator import lib_name

    cumem_rs.vllm_plugin.register()
    import vllm.device_allocator.cumem as vllm_cumem

    if vllm_cumem.lib_name is None:
        vllm_cumem.lib_name = lib_name
    if not _importable("vllm.entrypoints.llm"):
        for name in ("LLM", "SamplingParams", "AsyncEngineArgs", "AsyncLLMEngine"):
            setattr(vllm, name, _needs_engine(name))
    try:
        from vllm.config import VllmConfig  # noqa: F401
    except ImportError:
        import vllm.config

        vllm.config.VllmConfig = type("VllmConfig", (), {"__doc__": "Stand-in (vllm_cumem_standin)."})
    for package in (VLLM_SRC / "vllm_tests").glob("*/__init__.py"):
        name = package.parent.name
        sys.modules[f"{name}.utils"] = _utils_module(name)


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        for module in NEEDS.get(getattr(item, "originalname", item.name), ()):
            error = _import_error(module)
            if error:
                item.add_marker(pytest.mark.skip(reason=f"needs {module}, which does not import here ({error})"))
                break
