"""Two ranks, one GPU each, talking over NCCL while their weights sleep.

What vLLM does with tensor parallelism: every rank keeps its weights in CuMemAllocator's "weights" pool and its
NCCL communicator (whose buffers NCCL allocates itself, outside our pool) stays alive across sleep/wake. Each rank
checks that collectives keep working while its weights are asleep, that the weights come back bit-identical at the
same addresses, and that a tensor in our pool takes part in an all_reduce after wake.

The ranks are child processes running this file with `--worker`, configured through the environment the way
torchrun does it. NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1): nothing
here needs it, and multicast objects are a different kind of memory from ours.

Skipped unless two CUDA GPUs, NCCL and the cumem_rs CUDA driver are available.
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
TIMEOUT_S = 180
MiB = 1 << 20
# The driver's free-memory figure may move by a little besides our own mappings.
FREE_SLACK = 16 * MiB


def _usable_gpus() -> int:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return 0
    import cumem_rs

    if not (cumem_rs.cuda_available() and torch.cuda.is_available() and dist.is_available()
            and dist.is_nccl_available()):
        return 0
    return torch.cuda.device_count()


def _active_primary_contexts() -> list[bool]:
    """For every visible GPU: is its primary context active in this process? Asked of the driver directly."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    count = ctypes.c_int()
    assert cuda.cuDeviceGetCount(ctypes.byref(count)) == 0
    active = []
    for ordinal in range(count.value):
        dev, flags, is_active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        assert cuda.cuDeviceGet(ctypes.byref(dev), ordinal) == 0
        assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(is_active)) == 0
        active.append(bool(is_active.value))
    return active


# ---------------------------------------------------------------------------------------------------------------
# One rank (runs in a child process).


def _worker() -> int:
    import torch
    import torch.distributed as dist

    from cumem_rs import CuMemAllocator

    for key, want in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        if os.environ.get(key) != want:
            raise RuntimeError(f"{key} must be {want} (multicast stays off), got {os.environ.get(key)!r}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    # device_id binds the communicator to this GPU and creates it now, before any of our pool memory exists.
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    expected = float(world * (world + 1) // 2)  # every rank contributes rank + 1

    cumem = CuMemAllocator.get_instance()
    core = cumem.native
    with cumem.use_memory_pool("weights"):
        weights = [torch.empty(64 * MiB + 7 + rank, dtype=torch.uint8, device=dev),
                   torch.empty((4096, 1024 + rank), dtype=torch.bfloat16, device=dev)]
    with cumem.use_memory_pool("kv_cache"):
        in_pool = torch.empty(2 * MiB, dtype=torch.float32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    for w in weights:
        # Random bits, not values: every pattern (NaNs included) must survive.
        w.reshape(-1).view(torch.uint8).random_(0, 256, generator=gen)
    refs = [w.reshape(-1).view(torch.uint8).cpu() for w in weights]
    ptrs = [t.data_ptr() for t in weights + [in_pool]]
    outside = torch.full((1 << 20,), float(rank + 1), dtype=torch.float32, device=dev)

    def record(t):
        p = t.data_ptr()
        hits = [a for a in core.allocations() if a["address"] <= p < a["address"] + a["size"]]
        return hits[0] if hits else None

    for t, tag in ((weights[0], "weights"), (weights[1], "weights"), (in_pool, "kv_cache")):
        r = record(t)
        assert r is not None and (r["tag"], r["device"]) == (tag, rank), f"not routed to our pool: {r}"
    assert record(outside) is None, "a tensor made outside the pool block is in our pool"

    dist.all_reduce(outside)
    torch.cuda.synchronize()
    assert bool((outside == expected).all()), "all_reduce before sleep"

    free0 = torch.cuda.mem_get_info(rank)[0]
    mapped0 = core.usage(rank)
    # Sleep pins host memory on worker threads that have no CUDA context: they must borrow this rank's, not
    # create one on GPU 0 (which would also cost GPU 0 memory that rank 0 is measuring).
    contexts = _active_primary_contexts()
    cumem.sleep(offload_tags="weights")
    torch.cuda.synchronize()
    assert _active_primary_contexts() == contexts, f"sleep created a CUDA context on another GPU: {contexts}"
    assert core.usage(rank) == 0, f"{core.usage(rank)} bytes still mapped after sleep"
    freed = torch.cuda.mem_get_info(rank)[0] - free0
    assert freed >= mapped0 - FREE_SLACK, f"sleep freed {freed} bytes of the GPU, {mapped0} were mapped"

    # The communicator and its buffers are NCCL's, not ours: collectives keep working while the weights sleep.
    outside.fill_(rank + 1)
    dist.all_reduce(outside)
    asleep_sum = torch.full((4096,), float(rank + 1), device=dev)
    dist.all_reduce(asleep_sum)
    torch.cuda.synchronize()
    assert bool((outside == expected).all()) and bool((asleep_sum == expected).all()), "all_reduce while asleep"

    contexts = _active_primary_contexts()
    cumem.wake_up()
    assert _active_primary_contexts() == contexts, f"wake created a CUDA context on another GPU: {contexts}"
    assert [t.data_ptr() for t in weights + [in_pool]] == ptrs, "data_ptr changed across sleep/wake"
    for i, (w, ref) in enumerate(zip(weights, refs)):
        assert torch.equal(w.reshape(-1).view(torch.uint8).cpu(), ref), f"weights[{i}] differ after wake"

    # A tensor in our pool (discarded by sleep, mapped again by wake) in a collective.
    in_pool.fill_(rank + 1)
    dist.all_reduce(in_pool)
    torch.cuda.synchronize()
    assert bool((in_pool == expected).all()), "all_reduce on a tensor in our pool after wake"

    dist.barrier()
    dist.destroy_process_group()
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    errors = core.errors()
    assert not errors, f"the allocator recorded errors: {errors}"
    del weights, in_pool, outside, asleep_sum
    gc.collect()
    torch.cuda.empty_cache()
    print(f"RESULT rank={rank} ok weights_bytes={nbytes} freed_by_sleep={freed} sum={expected:g}", flush=True)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# The test: start the ranks, wait for both.


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
               WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    return env


@pytest.mark.skipif(_usable_gpus() < WORLD, reason=f"needs {WORLD} CUDA GPUs with NCCL and the cumem_rs driver")
def test_nccl_ranks_keep_talking_while_weights_sleep(tmp_path):
    port = _free_port()
    logs = [tmp_path / f"rank{r}.log" for r in range(WORLD)]
    procs = []
    try:
        for r in range(WORLD):
            with open(logs[r], "w") as log:  # the child keeps its own descriptor
                procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"],
                                              env=_rank_env(r, port), cwd=ROOT, stdout=log,
                                              stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TIMEOUT_S
        # Poll both: a rank that fails leaves the other waiting in a collective, so stop it at once.
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    texts = [log.read_text() for log in logs]
    report = "\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{t[-4000:]}"
                       for r, (p, t) in enumerate(zip(procs, texts)))
    assert all(p.returncode == 0 for p in procs), f"a rank failed or timed out after {TIMEOUT_S} s:\n{report}"
    for r, t in enumerate(texts):
        assert f"RESULT rank={r} ok" in t, report


if __name__ == "__main__" and "--worker" in sys.argv[1:]:
    sys.exit(_worker())
