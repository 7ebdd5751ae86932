"""Many sleep/wake cycles of a model-shaped pool through CuMemAllocator on a GPU, plus the two hazards of a real
server: sleeping while kernels are still queued, and exiting while memory is asleep.

Skipped unless torch sees a GPU and cumem_rs can load the CUDA driver. About 1.5 GiB of GPU memory; the file takes
well under a minute on an H200 (100 cycles of 1 GiB each way at tens of GB/s, plus checksums).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import cumem_rs  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and cumem_rs.cuda_available()),
    reason="needs a CUDA GPU visible to both torch and cumem_rs",
)

MiB = 1 << 20
CYCLES = 100
# ~1 GiB of "weights" in tensors of different sizes; the smallest is larger than SLACK, so the free-memory check
# below fails if any single tensor stayed mapped.
WEIGHT_MIB = [256, 192, 160, 128, 96, 80, 64, 48]
KV_MIB = 512
# Device memory the driver may take for itself during a sleep (stream and copy resources, page tables for the
# pinned host backup): small next to the pool, smaller than any one tensor.
SLACK = 32 * MiB
CHUNK = 1 << 24  # int32 elements per checksum step: bounds the int64 temporaries to 128 MiB each


from torch_support import _awake_between_tests, cumem, settle as _settle, sleep_and_wake  # noqa: E402,F401


def _free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _random_bytes(nbytes: int, gen: Any) -> Any:
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(generator=gen)


class Checksum:
    """Per-tensor (sum, position-weighted sum) of the int32 view, computed on the GPU in the default pool.

    Integer sums wrap deterministically and do not depend on the reduction order, so equal bytes give equal
    checksums bit for bit; the weights (fixed random int32 per position in a chunk, times the chunk number) make
    moved or swapped words change the result, not only changed ones."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.w = _random_bytes(CHUNK * 4, gen).view(torch.int32).to(torch.int64)

    def __call__(self, t: Any) -> Any:
        x = t.view(torch.int32)
        total = torch.zeros((), dtype=torch.int64, device="cuda")
        weighted = torch.zeros((), dtype=torch.int64, device="cuda")
        for k, start in enumerate(range(0, x.numel(), CHUNK)):
            c = x[start : start + CHUNK]
            total += c.sum(dtype=torch.int64)
            weighted += (c.to(torch.int64) * self.w[: c.numel()]).sum() * (k + 1)
        return torch.stack([total, weighted])


def _records(cumem) -> list[dict]:
    return cumem.native.allocations()


def _holder(cumem, t: Any) -> Any:
    p = t.data_ptr()
    return next((a for a in _records(cumem) if a["address"] <= p < a["address"] + a["size"]), None)


def test_hundred_cycles_keep_weights_and_release_the_pool(cumem):
    gen = torch.Generator(device="cuda").manual_seed(1234)
    with cumem.use_memory_pool("weights"):
        weights = [_random_bytes(m * MiB, gen) for m in WEIGHT_MIB]
    with cumem.use_memory_pool("kv_cache"):
        kv = torch.zeros(KV_MIB * MiB // 4, dtype=torch.int32, device="cuda")
    for t in weights + [kv]:
        assert _holder(cumem, t) is not None, "a tensor made in a pool is not in the core allocator"
    assert {_holder(cumem, t)["tag"] for t in weights} == {"weights"}
    assert _holder(cumem, kv)["tag"] == "kv_cache"

    ptrs = [t.data_ptr() for t in weights + [kv]]
    checksum = Checksum(seed=99)
    ref = torch.stack([checksum(t) for t in weights])
    ref_host = [t.cpu() for t in weights]  # full byte comparison on a few cycles
    weights_bytes = sum(WEIGHT_MIB) * MiB
    _settle()  # torch's own cache (checksum temporaries) must not differ between this reading and the last
    free_start = _free_bytes()
    host_after_first = None

    for i in range(CYCLES):
        free_awake = _free_bytes()
        # Every awake allocation is released by sleep (weights backed up, kv_cache and any other tag discarded).
        awake_bytes = sum(a["size"] for a in _records(cumem) if not a["asleep"])
        assert awake_bytes >= weights_bytes + KV_MIB * MiB

        report = cumem.sleep(offload_tags="weights")
        free_asleep = _free_bytes()
        backed_up = report["copied_bytes"] + report["skipped_bytes"]  # skipped: unchanged since the last wake
        assert backed_up >= weights_bytes, f"cycle {i}: not all weights were backed up"
        assert free_asleep - free_awake >= awake_bytes - SLACK, (
            f"cycle {i}: sleep gave back {(free_asleep - free_awake) / MiB:.0f} MiB of {awake_bytes / MiB:.0f} MiB"
        )
        assert all(a["asleep"] for a in _records(cumem)), f"cycle {i}: an allocation stayed awake"

        if i % 2:
            # vLLM's order: weights first, the KV cache once the weights are updated.
            cumem.wake_up(["weights"])
            assert _holder(cumem, kv)["asleep"], "wake_up(['weights']) woke the KV cache"
            cumem.wake_up(["kv_cache"])
        else:
            cumem.wake_up()
        assert [t.data_ptr() for t in weights + [kv]] == ptrs, f"cycle {i}: a tensor moved"
        assert not any(a["asleep"] for a in _records(cumem))

        now = torch.stack([checksum(t) for t in weights])
        bad = [k for k in range(len(weights)) if not torch.equal(now[k], ref[k])]
        assert not bad, f"cycle {i}: weights {bad} changed across sleep/wake"
        if i in (0, CYCLES // 2, CYCLES - 1):
            for k, (t, h) in enumerate(zip(weights, ref_host)):
                assert torch.equal(t.cpu(), h), f"cycle {i}: weights[{k}] bytes differ"
        # The KV cache was discarded: it must be usable memory again (contents are ours to write).
        kv.fill_(i)
        assert bool((kv == i).all()), f"cycle {i}: the woken KV cache does not hold what was written"

        if i == 1:
            host_after_first = cumem.native.host_bytes()
    # Steady state: no host memory or device memory creeps up over the cycles.
    assert cumem.native.host_bytes() <= host_after_first, "host backup memory grew across cycles"
    _settle()
    assert _free_bytes() >= free_start - SLACK, "device memory leaked across cycles"

    del weights, kv, now, ref, t  # `t` is the loop variable of the byte comparison: it still holds a tensor
    _settle()
    for p in ptrs:
        assert not any(a["address"] <= p < a["address"] + a["size"] for a in _records(cumem)), (
            "memory of dead pool tensors was not given back to the core allocator"
        )


@pytest.mark.parametrize("stream", ["current", "side"])
@pytest.mark.parametrize("layer", ["torch", "core"])
def test_sleep_behind_queued_matmuls_keeps_the_final_result(cumem, layer, stream):
    """Hundreds of ms of matmuls accumulate into a weights tensor; sleep is called with all of them still queued.
    The backup must be taken after the last one (the device is synchronized before copying), on whichever stream
    they run. Operands are small integers, so fp32 results are exact and equal a reference made in torch's own
    pool whatever kernel computes them."""
    n, steps = 4096, 200  # |result| <= steps * n < 2**24: exact in fp32 (and in TF32 inputs)
    gen = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randint(-1, 2, (n, n), device="cuda", generator=gen).float()
    b = torch.randint(-1, 2, (n, n), device="cuda", generator=gen).float()
    ref = torch.zeros(n, n, device="cuda")
    for _ in range(steps):
        ref.addmm_(a, b)
    with cumem.use_memory_pool("weights"):
        w = torch.zeros(n, n, device="cuda")
    ptr = w.data_ptr()
    torch.cuda.synchronize()

    s = torch.cuda.Stream() if stream == "side" else torch.cuda.current_stream()
    with torch.cuda.stream(s):
        for _ in range(steps):
            w.addmm_(a, b)  # ~2 ms each in fp32 on an H200
    assert not s.query(), "the matmuls finished before sleep was called: the test would prove nothing"
    sleep_and_wake(cumem, layer)
    torch.cuda.current_stream().wait_stream(s)
    assert w.data_ptr() == ptr
    assert torch.equal(w, ref), "the backup was taken before the queued matmuls finished"


# --- exiting with memory asleep --------------------------------------------------------------------------------------

_EXIT_PRELUDE = """
import torch
from cumem_rs import CuMemAllocator

alloc = CuMemAllocator.get_instance()
gen = torch.Generator(device="cuda").manual_seed(0)
with alloc.use_memory_pool("weights"):
    w = [torch.empty(n << 20, dtype=torch.uint8, device="cuda").random_(generator=gen) for n in (64, 32, 6)]
with alloc.use_memory_pool("kv_cache"):
    kv = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
with alloc.use_memory_pool():
    scratch = torch.ones(8 << 20, device="cuda")
# A reference cycle: these tensors die only in the collector run at interpreter shutdown.
cycle = {"tensors": [w[0][:100], kv[:100]]}
cycle["self"] = cycle
del cycle
"""

_EXIT_SCRIPTS = {
    # Everything asleep with host backups; the script just ends.
    "asleep": """
alloc.sleep(offload_tags=("weights", "kv_cache", "default"))
print("exiting", flush=True)
""",
    # sys.exit from inside a pool block while the rest is asleep: the block unwinds during SystemExit.
    "sys_exit_in_pool_block": """
import sys
alloc.sleep(offload_tags="weights")
with alloc.use_memory_pool("weights"):
    extra = torch.ones(4 << 20, device="cuda")  # made between sleep and wake: awake, usable
    assert bool((extra == 1).all())
    print("exiting", flush=True)
    sys.exit(0)
""",
    # Weights woken, KV cache still asleep (vLLM's state between the two wake calls).
    "partly_awake": """
alloc.sleep(offload_tags="weights")
alloc.wake_up(["weights"])
assert bool((w[1].sum() >= 0).item())
print("exiting", flush=True)
""",
}


@pytest.mark.parametrize("variant", sorted(_EXIT_SCRIPTS))
def test_process_with_asleep_memory_exits_cleanly(variant):
    script = textwrap.dedent(_EXIT_PRELUDE) + textwrap.dedent(_EXIT_SCRIPTS[variant])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    detail = f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, detail
    assert "exiting" in proc.stdout, detail
    for bad in ("Traceback", "terminate called", "pure virtual", "Segmentation fault", "Fatal Python error",
                "Exception ignored", "CUDA error"):
        assert bad not in proc.stderr, detail
