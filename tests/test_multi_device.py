"""Several devices in one process: allocations, per-device accounting, and sleep/wake covering every device at once.

The core tests run on a three-device simulated driver always, and on the CUDA driver when it has two or more GPUs.
The torch tests (CuMemAllocator pools on every GPU) need two or more GPUs visible to torch. Last, a smoke run of
`python -m cumem_rs bench-multi` on simulated devices.
"""

from __future__ import annotations

import functools
import gc
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

import cumem_rs
from cumem_rs import Allocator
from cumem_rs.workload import pattern_bytes, round_up

from conftest import allocator_for

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20

SIM_DEVICES = 3
SIM_GRANULARITY = 64 << 10
SIM_CAPACITY = 32 * MiB
# On a GPU the driver's free-memory figure may move by a little besides our own mappings (its own bookkeeping).
CUDA_FREE_SLACK = 16 * MiB


@functools.lru_cache(maxsize=None)
def _cuda_core_devices() -> int:
    if not cumem_rs.cuda_available():
        return 0
    return Allocator.cuda().device_count()


@functools.lru_cache(maxsize=None)
def _torch_gpus() -> int:
    if not cumem_rs.cuda_available():
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


MULTI_BACKENDS = [
    pytest.param("sim", id="sim"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
        _cuda_core_devices() < 2, reason="needs two or more CUDA devices")),
]


@pytest.fixture(params=MULTI_BACKENDS)
def multi(request) -> Iterator[Allocator]:
    """Three simulated devices, or the process-wide CUDA allocator (conftest checks it gets back all it gave)."""
    if request.param == "sim":
        a = Allocator.simulated(devices=SIM_DEVICES, capacity=SIM_CAPACITY, granularity=SIM_GRANULARITY)
        try:
            yield a
        finally:
            a.close()
    else:
        with allocator_for("cuda") as a:
            yield a


def _unit(a: Allocator) -> int:
    """Base allocation size: a few sim granules; 32 MiB on a GPU so freed memory shows well above the slack."""
    return 3 * a.granularity(0) if a.backend == "sim" else 32 * MiB


def _free(a: Allocator, d: int) -> int:
    return a.mem_info(d)[0]


def _check_free_rose(a: Allocator, d: int, before: int, released: int) -> None:
    """The device's free physical memory rose by what was released there (exactly on the sim)."""
    got = _free(a, d) - before
    if a.backend == "sim":
        assert got == released, f"device {d}: free rose by {got}, {released} released"
    else:
        assert got >= released - CUDA_FREE_SLACK, f"device {d}: free rose by {got}, {released} released"


class _Layout:
    """Per device: one "weights" and one "kv_cache" allocation, sizes and contents different on every device."""

    def __init__(self, a: Allocator):
        self.a = a
        self.devices = list(range(a.device_count()))
        unit = _unit(a)
        self.addr: dict[tuple[int, str], int] = {}
        self.size: dict[tuple[int, str], int] = {}
        for d in self.devices:
            for i, tag in enumerate(("weights", "kv_cache")):
                # Odd sizes: the tail granule is partly used; different per device and tag (bounded, for 8 GPUs).
                size = (2 + d % 3 + i) * unit + 4097 * (d + 1)
                a.push_tag(tag)
                try:
                    self.addr[d, tag] = a.malloc(size, device=d)
                finally:
                    a.pop_tag()
                self.size[d, tag] = size

    def data(self, d: int, tag: str) -> bytes:
        return pattern_bytes(100 + d, 0 if tag == "weights" else 1, self.size[d, tag])

    def fill(self) -> None:
        for (d, tag), addr in self.addr.items():
            self.a.write(addr, self.data(d, tag))

    def intact(self, d: int, tag: str) -> bool:
        return self.a.read(self.addr[d, tag], self.size[d, tag]) == self.data(d, tag)

    def mapped(self, d: int, *tags: str) -> int:
        g = self.a.granularity(d)
        return sum(round_up(self.size[d, t], g) for t in tags)

    def records(self) -> dict[int, dict]:
        mine = set(self.addr.values())
        return {r["address"]: r for r in self.a.allocations() if r["address"] in mine}


# --- core allocator -------------------------------------------------------------------------------------------------


def test_allocations_land_on_their_device(multi):
    base = [multi.usage(d) for d in range(multi.device_count())]
    lay = _Layout(multi)
    recs = lay.records()
    for (d, tag), addr in lay.addr.items():
        r = recs[addr]
        assert (r["device"], r["tag"], r["requested"]) == (d, tag, lay.size[d, tag])
        assert r["size"] == round_up(lay.size[d, tag], multi.granularity(d))
    for d in lay.devices:
        assert multi.usage(d) - base[d] == lay.mapped(d, "weights", "kv_cache")
    assert len(set(lay.addr.values())) == len(lay.addr)
    spans = sorted((addr, addr + recs[addr]["size"]) for addr in lay.addr.values())
    assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:])), "ranges of different devices overlap"


def test_usage_per_device_is_what_was_allocated_there(multi):
    n = multi.device_count()
    base = [multi.usage(d) for d in range(n)]
    base_all = multi.usage()
    unit = _unit(multi)
    mine: dict[int, list[int]] = {d: [] for d in range(n)}
    # Device d gets d + 1 allocations, so a count or size mixed up between devices shows.
    for d in range(n):
        for k in range(d + 1):
            mine[d].append(multi.malloc(unit * (k + 1) + 1, device=d))
    want = {d: sum(round_up(unit * (k + 1) + 1, multi.granularity(d)) for k in range(d + 1)) for d in range(n)}
    recs = {r["address"]: r for r in multi.allocations()}
    for d in range(n):
        assert multi.usage(d) - base[d] == want[d]
        assert sum(recs[x]["size"] for x in mine[d]) == want[d]
        assert all(recs[x]["device"] == d for x in mine[d])
    assert multi.usage() - base_all == sum(want.values())

    # Freeing one device's allocations changes that device's figure only.
    for x in mine[1]:
        multi.free(x)
    assert multi.usage(1) == base[1]
    for d in (0, 2) if n > 2 else (0,):
        assert multi.usage(d) - base[d] == want[d]
    if multi.backend == "sim":
        for d in range(n):
            assert _free(multi, d) == multi.mem_info(d)[1] - multi.usage(d)


def test_sleep_offloads_every_device_and_wake_restores_each(multi):
    lay = _Layout(multi)
    lay.fill()
    addrs = dict(lay.addr)
    before = {d: (_free(multi, d), multi.usage(d)) for d in lay.devices}

    report = multi.sleep("weights")
    assert report["copied_bytes"] + report["skipped_bytes"] == sum(lay.mapped(d, "weights") for d in lay.devices)
    for d in lay.devices:
        assert multi.usage(d) == 0, f"device {d} still has memory mapped after sleep"
        # Everything mapped there was released: ours and whatever else the process-wide allocator held awake.
        _check_free_rose(multi, d, before[d][0], before[d][1])
    recs = lay.records()
    for (d, tag), addr in lay.addr.items():
        assert recs[addr]["asleep"]
        assert recs[addr]["backed_up"] == (tag == "weights")

    multi.wake_up()
    recs = lay.records()
    assert set(recs) == set(addrs.values()), "addresses changed across sleep/wake"
    for d in lay.devices:
        assert multi.usage(d) >= lay.mapped(d, "weights", "kv_cache")
        assert lay.intact(d, "weights"), f"device {d}: weights differ after wake"
        assert all(not recs[lay.addr[d, t]]["asleep"] for t in ("weights", "kv_cache"))
        if multi.backend == "sim":
            # Discarded memory comes back poisoned, never silently with the old (or another device's) bytes.
            assert not lay.intact(d, "kv_cache")
            assert multi.usage(d) == before[d][1]
            assert _free(multi, d) == before[d][0]


def test_selective_wake_per_tag_across_devices(multi):
    lay = _Layout(multi)
    lay.fill()
    # A third tag on the last device: discarded by sleep and not asked for by the selective wakes.
    last = lay.devices[-1]
    multi.push_tag("scratch")
    try:
        scratch = multi.malloc(_unit(multi), device=last)
    finally:
        multi.pop_tag()
    multi.sleep(["weights", "kv_cache"])
    asleep_free = {d: _free(multi, d) for d in lay.devices}

    multi.wake_up("kv_cache")
    recs = lay.records()
    for d in lay.devices:
        assert not recs[lay.addr[d, "kv_cache"]]["asleep"]
        assert recs[lay.addr[d, "weights"]]["asleep"]
        assert multi.usage(d) == lay.mapped(d, "kv_cache"), f"device {d}: wrong bytes mapped after waking kv_cache"
        assert lay.intact(d, "kv_cache"), f"device {d}: kv_cache differs after wake"
        if multi.backend == "sim":
            assert asleep_free[d] - _free(multi, d) == lay.mapped(d, "kv_cache")
    assert {r["address"]: r for r in multi.allocations()}[scratch]["asleep"], "the core woke a tag not asked for"

    multi.wake_up(["weights"])
    for d in lay.devices:
        assert multi.usage(d) == lay.mapped(d, "weights", "kv_cache")
        assert lay.intact(d, "weights") and lay.intact(d, "kv_cache")
    multi.wake_up()
    assert multi.usage(last) == lay.mapped(last, "weights", "kv_cache") + round_up(_unit(multi),
                                                                                 multi.granularity(last))


@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_freeing_asleep_allocations_on_several_devices(multi):
    # On CUDA the process-wide allocator may hold allocations of earlier tests (a torch pool's cached segment):
    # asleep after the sleep below, back after the wake.
    base = {d: multi.usage(d) for d in range(multi.device_count())}
    lay = _Layout(multi)
    lay.fill()
    multi.sleep("weights")
    host = multi.host_bytes()
    assert host >= sum(lay.mapped(d, "weights") for d in lay.devices)
    for d in lay.devices:
        multi.free(lay.addr[d, "weights"])
    left = lay.records()
    assert set(left) == {lay.addr[d, "kv_cache"] for d in lay.devices}
    multi.wake_up()
    for d in lay.devices:
        assert multi.usage(d) == base[d] + lay.mapped(d, "kv_cache")
    with pytest.raises(ValueError):
        multi.malloc(4096, device=multi.device_count())


# --- torch: CuMemAllocator pools on every GPU ----------------------------------------------------------------------

needs_torch_gpus = pytest.mark.skipif(_torch_gpus() < 2, reason="needs two or more CUDA GPUs visible to torch")


@pytest.fixture
def cumem():
    import torch

    from cumem_rs import CuMemAllocator

    c = CuMemAllocator.get_instance()
    _settle(torch)
    yield c
    c.wake_up()  # whatever a failing test left asleep
    _settle(torch)


def _settle(torch) -> None:
    gc.collect()
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)
    torch.cuda.empty_cache()


def _record_of(records: list[dict], t) -> dict:
    p = t.data_ptr()
    hits = [r for r in records if r["address"] <= p < r["address"] + r["size"]]
    assert hits, "the tensor is not in a cumem_rs allocation (the pool did not route it)"
    return hits[0]


def _torch_layout(torch, cumem, devices):
    """Per device: two "weights" tensors of random bits and one "kv_cache" tensor, all different per device.
    Returns (tensors {(d, tag): [t]}, cpu copies of the weights {d: [t]}, new core records)."""
    core = cumem.native
    before = {r["address"] for r in core.allocations()}
    usage0 = {d: core.usage(d) for d in devices}
    tensors: dict = {}
    for d in devices:
        # use_mem_pool routes the allocations of the device that is current when the block is entered.
        with torch.cuda.device(d):
            with cumem.use_memory_pool("weights"):
                tensors[d, "weights"] = [torch.empty(24 * MiB + 5 * d + 3, dtype=torch.uint8, device=f"cuda:{d}"),
                                         torch.empty((d + 1) * MiB, dtype=torch.uint8, device=f"cuda:{d}")]
            with cumem.use_memory_pool("kv_cache"):
                tensors[d, "kv_cache"] = [torch.empty(32 * MiB, dtype=torch.uint8, device=f"cuda:{d}")]
        gen = torch.Generator(device=f"cuda:{d}").manual_seed(1000 + d)
        for t in tensors[d, "weights"]:
            t.random_(0, 256, generator=gen)
        tensors[d, "kv_cache"][0].fill_(d + 1)
    refs = {d: [t.cpu() for t in tensors[d, "weights"]] for d in devices}
    new = [r for r in core.allocations() if r["address"] not in before]
    for d in devices:
        assert core.usage(d) - usage0[d] == sum(r["size"] for r in new if r["device"] == d)
    for (d, tag), ts in tensors.items():
        for t in ts:
            assert t.device.index == d
            r = _record_of(new, t)
            assert (r["device"], r["tag"]) == (d, tag)
    assert not torch.equal(refs[0][0][:MiB], refs[1][0][:MiB]), "the devices should hold different data"
    return tensors, refs, new


def _weights_intact(torch, tensors, refs, d) -> bool:
    return all(torch.equal(t.cpu(), ref) for t, ref in zip(tensors[d, "weights"], refs[d]))


@needs_torch_gpus
def test_torch_pools_sleep_and_wake_on_every_gpu(cumem):
    import torch

    devices = list(range(torch.cuda.device_count()))
    core = cumem.native
    tensors, refs, new = _torch_layout(torch, cumem, devices)
    ptrs = {k: [t.data_ptr() for t in ts] for k, ts in tensors.items()}
    ours = {d: sum(r["size"] for r in new if r["device"] == d) for d in devices}
    _settle(torch)
    free_before = {d: torch.cuda.mem_get_info(d)[0] for d in devices}

    cumem.sleep(offload_tags="weights")
    _settle(torch)
    for d in devices:
        assert core.usage(d) == 0, f"cuda:{d} still has cumem_rs memory mapped after sleep"
        freed = torch.cuda.mem_get_info(d)[0] - free_before[d]
        assert freed >= ours[d] - CUDA_FREE_SLACK, f"cuda:{d}: {freed} bytes freed, {ours[d]} were ours"

    cumem.wake_up()
    for d in devices:
        assert core.usage(d) >= ours[d]
        assert _weights_intact(torch, tensors, refs, d), f"cuda:{d}: weights differ after wake"
        assert torch.cuda.mem_get_info(d)[0] <= free_before[d] + CUDA_FREE_SLACK
    assert {k: [t.data_ptr() for t in ts] for k, ts in tensors.items()} == ptrs
    # The woken memory computes on its own device.
    for d in devices:
        kv = tensors[d, "kv_cache"][0]
        kv.fill_(7 * (d + 1))
        assert int(kv.sum(dtype=torch.int64)) == 7 * (d + 1) * kv.numel()


@needs_torch_gpus
def test_torch_selective_wake_per_tag_across_gpus(cumem):
    import torch

    devices = list(range(torch.cuda.device_count()))
    core = cumem.native
    tensors, refs, new = _torch_layout(torch, cumem, devices)
    kv_ref = {d: tensors[d, "kv_cache"][0].cpu() for d in devices}

    def asleep_by(tag: str, d: int) -> list[bool]:
        recs = {r["address"]: r for r in core.allocations()}
        return [recs[r["address"]]["asleep"] for r in new if r["tag"] == tag and r["device"] == d]

    cumem.sleep(offload_tags=("weights", "kv_cache"))
    cumem.wake_up(tags=["kv_cache"])
    for d in devices:
        assert asleep_by("weights", d) and all(asleep_by("weights", d)), f"cuda:{d}: weights woke too early"
        assert not any(asleep_by("kv_cache", d)), f"cuda:{d}: kv_cache did not wake"
        assert torch.equal(tensors[d, "kv_cache"][0].cpu(), kv_ref[d]), f"cuda:{d}: kv_cache differs after wake"
    cumem.wake_up(tags=["weights"])
    for d in devices:
        assert not any(asleep_by("weights", d))
        assert _weights_intact(torch, tensors, refs, d), f"cuda:{d}: weights differ after wake"


# --- the multi-device benchmark, smoke run -------------------------------------------------------------------------


def test_bench_multi_cli_on_simulated_devices(tmp_path):
    out = tmp_path / "multi.json"
    p = subprocess.run([sys.executable, "-m", "cumem_rs", "bench-multi", "--backend", "sim", "--scale", "512",
                        "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "cumem_rs multi-device sleep/wake benchmark (sim, 2 devices" in p.stdout
    assert "measurement" in p.stdout and "ratio of / note" in p.stdout
    import json

    m = json.loads(out.read_text())["metrics"]
    assert m["devices"] == 2 and m["errors"] == []
    assert m["sleep_gbps"] > 0 and m["wake_gbps"] > 0 and m["copy_limit_gbps"] > 0
    # Each device got back at least its weights' bytes from the one sleep call.
    assert len(m["freed_by_sleep_bytes"]) == 2
    assert all(f >= m["weights_bytes_per_device"] for f in m["freed_by_sleep_bytes"])
