"""Shared pieces of the GPU test modules that use the torch layer (imported by them, not a conftest, so the
autouse fixture applies to those modules only)."""

import gc

import pytest


def settle() -> None:
    """Finish queued work and let torch return every segment nobody uses (released pools included)."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def sleep_and_wake(cumem, layer: str) -> None:
    """One sleep (offloading "weights") and wake, through the torch layer or straight through the core."""
    if layer == "torch":
        cumem.sleep(offload_tags="weights")
        cumem.wake_up()
    else:
        cumem.native.sleep(["weights"])
        cumem.native.wake_up(None)


@pytest.fixture(scope="module")
def cumem():
    from cumem_rs import CuMemAllocator

    return CuMemAllocator.get_instance()


@pytest.fixture(autouse=True)
def _awake_between_tests(cumem):
    settle()
    yield
    cumem.wake_up()  # a failing test must not leave memory asleep for the next one
    settle()
