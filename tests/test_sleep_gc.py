"""What `CuMemAllocator.sleep` collects first (`sleep_gc`): tensors that died in a reference cycle made since the
last full collection are freed, not copied, in the default "young" mode and in "full"; "off" copies them.

Needs a GPU (the torch layer); skipped otherwise, except the argument check which needs no device.
"""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")

import cumem_rs  # noqa: E402
from cumem_rs import allocator as allocator_mod  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and cumem_rs.cuda_available()),
    reason="needs a CUDA GPU visible to both torch and cumem_rs",
)

from torch_support import _awake_between_tests, cumem, settle  # noqa: E402,F401

MiB = 1 << 20


class _Cycle:
    """Holds a tensor and itself: only the cycle collector can free it."""

    def __init__(self, t) -> None:
        self.t = t
        self.me = self


def _dead_cycle(cumem, nbytes: int) -> None:
    with cumem.use_memory_pool(tag="weights"):
        _Cycle(torch.ones(nbytes, dtype=torch.uint8, device="cuda"))


@pytest.mark.parametrize("mode, freed", [("young", True), ("full", True), ("off", False)])
def test_dead_cycles_are_freed_not_copied(cumem, mode, freed):
    settle()
    with cumem.use_memory_pool(tag="weights"):
        live = torch.ones(64 * MiB, dtype=torch.uint8, device="cuda")
    live_bytes = sum(a["size"] for a in cumem.native.allocations() if a["tag"] == "weights" and not a["asleep"])
    gc.disable()  # the test decides when a collection runs
    try:
        _dead_cycle(cumem, 96 * MiB)
        previous, cumem.sleep_gc = cumem.sleep_gc, mode
        try:
            report = cumem.sleep(offload_tags="weights")
        finally:
            cumem.sleep_gc = previous
    finally:
        gc.enable()
    backed_up = report["copied_bytes"] + report["skipped_bytes"]
    if freed:
        assert backed_up == live_bytes, f"{mode}: the dead tensor's segment was copied ({backed_up} bytes)"
    else:
        assert backed_up >= live_bytes + 96 * MiB, f"off: expected the dead segment copied too ({backed_up})"
    cumem.wake_up()
    assert bool((live == 1).all())
    del live


def test_sleep_gc_refuses_unknown_modes(cumem):
    with pytest.raises(ValueError, match="sleep_gc must be one of"):
        cumem.sleep_gc = "sometimes"
    assert cumem.sleep_gc in allocator_mod.SLEEP_GC_MODES
