"""vLLM plugin: cumem_rs as vLLM's sleep-mode backend, with no change to vLLM.

    pip install cumem_rs
    vllm serve MODEL --enable-sleep-mode --sleep-mode-backend cumem_rs

vLLM >= 0.33 (which has the sleep-mode backend registry of RFC #34303) calls `register()` in each of its processes
through the `vllm.general_plugins` entry point. It registers the backend `cumem_rs` (`cumem_rs.vllm_backend`, loaded
by vLLM only when selected) and routes vLLM's sleep-mode allocator to cumem_rs's `CuMemAllocator` where that backend
is selected: every caller of vLLM's allocator (`get_mem_allocator_instance()`, the worker, LoRA, graph capture) ends
in `vllm.device_allocator.cumem.CuMemAllocator.get_instance()`, which answers ours when `selected()` and vLLM's own
otherwise. A run that does not select the backend keeps exactly vLLM's behaviour.

Where the selection is read (`selected()`, first answer wins):

1. `CUMEM_RS_VLLM`: `1` routes to cumem_rs, `0` never does, unset leaves it to the config. The fallback for a
   process that uses vLLM's allocator without building a vLLM worker (and a way to switch the routing off).
2. vLLM's current config (`get_current_vllm_config_or_none()`): `model_config.sleep_mode_backend == "cumem_rs"`.
3. The config of the vLLM worker built in this process. vLLM's worker picks the allocator of the weights before it
   makes its config current (`Worker.load_model` enters the "weights" pool, then `set_current_vllm_config`), so
   that choice cannot rely on (2). The worker's constructor (`WorkerBase.__init__`) runs earlier, in every worker
   process, and is the first point where the selection is known there: it is noted then.

`register()` imports no vLLM module beyond the backend registry and its package (`vllm.device_allocator`, which
vLLM's own backend needs too) and never initializes CUDA: the two wraps (of `CuMemAllocator.get_instance` and
`WorkerBase.__init__`) are applied when vLLM itself imports those modules.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, Optional

from . import _env

logger = logging.getLogger("cumem_rs")

BACKEND_NAME = "cumem_rs"
ENV_VAR = _env.VLLM

_REGISTRY_MODULE = "vllm.device_allocator.sleep_mode_backend"
_CUMEM_MODULE = "vllm.device_allocator.cumem"
_WORKER_MODULE = "vllm.v1.worker.worker_base"
_CONFIG_MODULE = "vllm.config.vllm"
# Set on the functions this module installs, so that a second install sees its own work.
_MARK = "_cumem_rs_wrapped"

_lock = threading.Lock()
_registered = False
_routing_logged = False
# Selection of the config of the last vLLM worker built in this process (source 3); None: no worker built.
_worker_choice: Optional[bool] = None


# --- selection ------------------------------------------------------------------------------------------------------


def _env_choice() -> Optional[bool]:
    return _env.choice(ENV_VAR, "1 (route vLLM's sleep-mode allocator to cumem_rs) or 0 (never route it)")


def config_choice(vllm_config: Any) -> Optional[bool]:
    """Whether a vLLM config (anything with `model_config.sleep_mode_backend`) selects cumem_rs; None without one."""
    model_config = getattr(vllm_config, "model_config", None)
    backend = getattr(model_config, "sleep_mode_backend", None)
    return None if backend is None else backend == BACKEND_NAME


def _current_vllm_config() -> Any:
    # Nothing can be current before vLLM has imported its config module, so it is never imported here.
    module = sys.modules.get(_CONFIG_MODULE)
    getter = getattr(module, "get_current_vllm_config_or_none", None)
    return getter() if getter is not None else None


def _choice() -> tuple[bool, str]:
    forced = _env_choice()
    if forced is not None:
        return forced, f"{ENV_VAR}={_env.text(ENV_VAR)}"
    current = config_choice(_current_vllm_config())
    if current is not None:
        return current, "vLLM's current config"
    if _worker_choice is not None:
        return _worker_choice, "the config of this process's vLLM worker"
    return False, "no selection"


def selected() -> bool:
    """Whether vLLM's sleep-mode allocator is cumem_rs's `CuMemAllocator` in this process, now (see module doc)."""
    return _choice()[0]


def note_worker_config(vllm_config: Any) -> None:
    """Remember the selection of the vLLM worker being built in this process (source 3 of `selected()`)."""
    global _worker_choice
    choice = config_choice(vllm_config)
    if choice is not None:
        _worker_choice = choice


def check_vllm_allocator_unused() -> None:
    """Raise RuntimeError when vLLM's own CuMemAllocator holds memory in this process: once cumem_rs serves vLLM,
    that memory would be out of reach of sleep and wake (the selection reached the process too late)."""
    module = sys.modules.get(_CUMEM_MODULE)
    instance = getattr(getattr(module, "CuMemAllocator", None), "instance", None)
    used = instance.get_current_usage() if instance is not None else 0
    if used:
        raise RuntimeError(
            f"vLLM's own CuMemAllocator already holds {used} bytes in this process, but cumem_rs now serves vLLM's "
            f"sleep-mode allocations: that memory would never sleep. The selection of the sleep-mode backend "
            f"{BACKEND_NAME!r} came after vLLM's first allocation; set {ENV_VAR}=1 for this process."
        )


# --- wraps, applied when vLLM imports the wrapped modules -----------------------------------------------------------


def route_allocator(cumem_module: ModuleType) -> None:
    """Make vLLM's `CuMemAllocator.get_instance()` answer cumem_rs's allocator while `selected()`. Idempotent."""
    vllm_class = cumem_module.CuMemAllocator
    vllm_get_instance = vllm_class.get_instance
    if getattr(vllm_get_instance, _MARK, False):
        return

    @functools.wraps(vllm_get_instance)
    def get_instance() -> Any:
        chosen, source = _choice()
        if not chosen:
            return vllm_get_instance()
        check_vllm_allocator_unused()
        from .allocator import CuMemAllocator

        allocator = CuMemAllocator.get_instance()
        _log_routing(source)
        return allocator

    setattr(get_instance, _MARK, True)
    vllm_class.get_instance = staticmethod(get_instance)


def _log_routing(source: str) -> None:
    global _routing_logged
    if not _routing_logged:
        _routing_logged = True
        logger.info("cumem_rs: vLLM's sleep-mode allocations are served by cumem_rs (selected by %s)", source)


def record_worker_selection(worker_class: Any) -> None:
    """Make each construction of `worker_class` (vLLM's `WorkerBase`) note its `vllm_config`. Idempotent."""
    init = worker_class.__init__
    if getattr(init, _MARK, False):
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        note_worker_config(getattr(self, "vllm_config", None))

    setattr(__init__, _MARK, True)
    setattr(worker_class, "__init__", __init__)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `callback(module)` right after `name` is first imported, by whoever imports it (vLLM uses the same
    technique in `vllm/env_override.py`). Stays in `sys.meta_path` until the import succeeds."""

    _cumem_rs_wrapped = True  # _MARK: found again by a later register()

    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback
        self._searching = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name or self._searching:
            return None
        self._searching = True  # find_spec below walks sys.meta_path again
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching = False
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return None
        exec_module = loader.exec_module

        def exec_then_call(module: ModuleType) -> None:
            exec_module(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _call_safely(self.callback, module)

        loader.exec_module = exec_then_call
        return spec


def _call_safely(callback: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        callback(module)
    except Exception:  # a failed wrap must not break vLLM: it only costs the cumem_rs routing
        logger.warning("cumem_rs: could not hook into %s; cumem_rs will not serve vLLM", module.__name__, exc_info=True)


def _after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    module = sys.modules.get(name)
    if module is not None:
        _call_safely(callback, module)
    elif not any(getattr(f, _MARK, False) and getattr(f, "name", None) == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))


# --- entry point ----------------------------------------------------------------------------------------------------


def _has_backend_registry() -> bool:
    try:
        return importlib.util.find_spec(_REGISTRY_MODULE) is not None
    except ImportError:  # no vllm.device_allocator at all
        return False


def _vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:
        return getattr(sys.modules.get("vllm"), "__version__", "unknown")


def register() -> None:
    """Entry point of the `vllm.general_plugins` group, run by vLLM in each of its processes.

    Registers the sleep-mode backend `cumem_rs` and installs the allocator routing. Idempotent (vLLM may load its
    plugins several times), cheap, never initializes CUDA and never raises: with a vLLM older than the backend
    registry it logs one line and does nothing.
    """
    global _registered
    with _lock:
        if _registered:
            return
        try:
            if not _has_backend_registry():
                _registered = True
                logger.info(
                    "cumem_rs: vLLM %s has no sleep-mode backend registry (vLLM >= 0.33 has it); "
                    "the cumem_rs plugin does nothing",
                    _vllm_version(),
                )
                return
            from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

            try:
                SleepModeBackendFactory.register_backend(BACKEND_NAME, "cumem_rs.vllm_backend", "CumemRsBackend")
            except ValueError:  # the name is taken already: by this plugin, loaded again after a module reload
                logger.debug("cumem_rs: sleep-mode backend %r was registered already", BACKEND_NAME)
            _after_import(_CUMEM_MODULE, route_allocator)
            _after_import(_WORKER_MODULE, lambda module: record_worker_selection(module.WorkerBase))
            _registered = True
        except Exception:  # never break vLLM's start-up, least of all for a run that does not select cumem_rs
            logger.warning("cumem_rs: registering the vLLM plugin failed; backend %r is unavailable", BACKEND_NAME,
                           exc_info=True)


__all__ = [
    "BACKEND_NAME",
    "ENV_VAR",
    "check_vllm_allocator_unused",
    "config_choice",
    "note_worker_config",
    "record_worker_selection",
    "register",
    "route_allocator",
    "selected",
]
