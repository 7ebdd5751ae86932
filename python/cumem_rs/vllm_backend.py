"""The `cumem_rs` sleep-mode backend of vLLM. vLLM's backend registry imports this module only when the backend is
selected (`--sleep-mode-backend cumem_rs`); `cumem_rs.vllm_plugin` registers it and routes the allocator."""

from __future__ import annotations

from typing import Any, Optional

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

from ._native import CumemValueError, cuda_available
from .vllm_plugin import check_vllm_allocator_unused

#: Offloaded to host at every level, as vLLM's own backend does: "runtime" holds state built once at start-up (KV
#: cache set-up, LoRA adapters), "cudagraph" the memory of graphs captured through `cudagraph_pool()`.
KEPT_TAGS = ("runtime", "cudagraph")


def offload_tags(level: int) -> tuple[str, ...]:
    """The tags `suspend(level)` backs up; every other allocation is released without a copy."""
    if isinstance(level, bool) or level not in (1, 2):
        raise CumemValueError(f"sleep level must be 1 (weights to host) or 2 (weights discarded), got {level!r}")
    return (("weights",) if level == 1 else ()) + KEPT_TAGS


class CumemRsBackend(SleepModeBackend):
    """Memory-only suspension with cumem_rs: physical GPU memory is released and mapped again at the same virtual
    addresses, so pointers, CUDA graphs, compiled kernels and NCCL communicators all stay valid.

    * `suspend(1)`: weights, runtime state and graph memory are copied to pinned host memory; KV cache, workspace
      and everything else are released without a copy. `suspend(2)`: the same but the weights are discarded too
      (vLLM reloads or receives them). All of the pool's GPU memory is released at either level.
    * `resume(tags)`: `None` restores everything; otherwise `tags` picks among the deferrable "weights" and
      "kv_cache", and every other tag wakes anyway. All or nothing: a failed resume keeps the backups.
    * `discard(tags)`: release the awake allocations of `tags` without a copy.
    * `state()`: "SUSPENDED" while any allocation is asleep, "RUNNING" once all are awake.
    """

    def _allocator(self) -> Any:
        from .allocator import CuMemAllocator

        return CuMemAllocator.get_instance()

    def _settle(self, allocator: Any) -> None:
        asleep = any(a["asleep"] for a in allocator.native.allocations())
        self._state = "SUSPENDED" if asleep else "RUNNING"

    def suspend(self, level: int = 1) -> None:
        tags = offload_tags(level)
        check_vllm_allocator_unused()
        allocator = self._allocator()
        try:
            allocator.sleep(offload_tags=tags)
        finally:
            self._settle(allocator)

    def resume(self, tags: Optional[list[str]] = None) -> None:
        allocator = self._allocator()
        self._state = "RESUMING"
        try:
            allocator.wake_up(tags)
        finally:
            self._settle(allocator)

    def discard(self, tags: tuple[str, ...]) -> None:
        allocator = self._allocator()
        try:
            allocator.discard(tags)
        finally:
            self._settle(allocator)

    @classmethod
    def is_supported(cls) -> bool:
        return cuda_available()

    @classmethod
    def preserves_communicators(cls) -> bool:
        # NCCL's buffers are allocated outside the pool and never touched.
        return True

    @classmethod
    def preserves_compiled_artifacts(cls) -> bool:
        # The process and its CUDA context live on; only pool memory is released.
        return True

    @classmethod
    def preserves_graphs_with_communicators(cls) -> bool:
        # Communicators are kept and graph memory is either outside the pool or restored at the same addresses.
        return True

    @classmethod
    def supports_durable_storage(cls) -> bool:
        return False


__all__ = ["KEPT_TAGS", "CumemRsBackend", "offload_tags"]
