"""Pinning ahead and the host RAM guard through CuMemAllocator on a real GPU: the end of a weights pool block
starts the background worker and the first sleep uses its arena; `pin_ahead = False` starts none; a host memory
limit lowered through CUMEM_RS_HOST_MEMORY_LIMIT (in a child process) makes the sleep refuse with
CumemOutOfMemoryError, every tensor still awake with its data. Needs a GPU; skipped otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")

import cumem_rs  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and cumem_rs.cuda_available()),
    reason="needs a CUDA GPU visible to both torch and cumem_rs",
)

from torch_support import _awake_between_tests, cumem, settle  # noqa: E402,F401

MiB = 1 << 20


def _wait_done(native) -> None:
    deadline = time.monotonic() + 60
    while native.pin_ahead_status()["running"]:
        assert time.monotonic() < deadline, "the background pinning worker did not finish"
        time.sleep(0.01)


def test_weights_pool_end_pins_ahead_and_the_first_sleep_uses_it(cumem):
    settle()
    native = cumem.native
    native.trim_host()
    assert cumem.pin_ahead, "on by default (unless CUMEM_RS_PIN_AHEAD=0)"
    errors = len(native.errors())
    # Raw backups: pinning ahead then sizes for the raw bytes (for a compressing tag it sizes for the stored
    # bytes the last compressed sleep's ratio predicts, which test_compression.py covers on the sim).
    cumem.set_tag_policy("weights", compress="off")
    try:
        with cumem.use_memory_pool(tag="weights"):
            w = torch.randint(0, 1 << 30, (64 * MiB // 4,), dtype=torch.int32, device="cuda")
        status = native.pin_ahead_status()
        assert status["nbytes"] >= 64 * MiB, status
        _wait_done(native)
        assert native.pin_ahead_status()["pinned"] == native.pin_ahead_status()["nbytes"]
        expected = w.cpu()
        cumem.sleep(offload_tags="weights")
        cumem.wake_up()
        assert torch.equal(w.cpu(), expected)
        assert native.errors()[errors:] == []
        del w
    finally:
        cumem.set_tag_policy("weights")
    settle()


def test_pin_ahead_off_starts_no_worker(cumem):
    settle()
    native = cumem.native
    native.trim_host()
    previous, cumem.pin_ahead = cumem.pin_ahead, False
    try:
        with cumem.use_memory_pool(tag="weights"):
            w = torch.ones(8 * MiB, dtype=torch.uint8, device="cuda")
        assert native.pin_ahead_status() == {"running": False, "pinned": 0, "nbytes": 0}
        assert native.host_bytes() == 0
    finally:
        cumem.pin_ahead = previous
    del w
    settle()


def test_host_memory_limit_from_the_environment_refuses_the_sleep():
    script = textwrap.dedent(
        """
        import torch
        from cumem_rs import CumemOutOfMemoryError
        from cumem_rs.allocator import CuMemAllocator

        c = CuMemAllocator.get_instance()
        with c.use_memory_pool(tag="weights"):
            w = torch.arange(16 << 20, dtype=torch.int32, device="cuda")  # 64 MiB
        expected = w.cpu()
        try:
            c.sleep(offload_tags="weights")
            print("SLEPT")
        except CumemOutOfMemoryError as e:
            print("REFUSED:", e)
        assert not any(a["asleep"] for a in c.native.allocations()), "an allocation went to sleep"
        assert torch.equal(w.cpu(), expected), "data changed"
        print("INTACT")
        """
    )
    env = dict(os.environ, CUMEM_RS_HOST_MEMORY_LIMIT="1M")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "REFUSED:" in out.stdout and "INTACT" in out.stdout, out.stdout + out.stderr
    refused = next(line for line in out.stdout.splitlines() if line.startswith("REFUSED:"))
    assert "bytes of host memory" in refused and "CUMEM_RS_HOST_MEMORY_LIMIT" in refused, refused
