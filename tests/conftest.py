"""Shared fixtures: the `backend` parameter (sim always, cuda with a GPU) and fresh allocators per test.

The simulated allocator is created per test and closed afterwards. The CUDA allocator is process-wide (it is the
one behind `my_malloc`/`my_free`), so it is never closed: a test gets it as it is and must give back exactly what
it took, which the teardown here enforces.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import pytest
from hypothesis import HealthCheck, settings

import cumem_rs
from cumem_rs import Allocator

KiB = 1 << 10
MiB = 1 << 20

# Small granularity keeps simulated mmaps and copies cheap; two devices exercise per-device accounting.
SIM_DEVICES = 2
SIM_CAPACITY = 64 * MiB
SIM_GRANULARITY = 64 * KiB

# "ci" is the default; a GPU run can pick fewer examples with CUMEM_HYPOTHESIS_PROFILE=gpu.
settings.register_profile("ci", max_examples=200, deadline=None)
settings.register_profile("gpu", max_examples=100, deadline=None)
settings.register_profile("quick", max_examples=20, deadline=None)
settings.load_profile(os.environ.get("CUMEM_HYPOTHESIS_PROFILE", "ci"))

# Stateful tests build a fresh allocator per example, which hypothesis' fixture health check dislikes, and
# some examples are legitimately slow (copies of whole allocations).
STATEFUL_SETTINGS = settings(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)

HAS_CUDA = cumem_rs.cuda_available()

BACKENDS = [
    pytest.param("sim", id="sim"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (cuda_available() is False)"),
    ),
]


def new_sim() -> Allocator:
    return Allocator.simulated(devices=SIM_DEVICES, capacity=SIM_CAPACITY, granularity=SIM_GRANULARITY)


def _unwind_tags(a: Allocator) -> None:
    """Pop whatever a test left on this thread's tag stack (pop_tag raises once the stack is empty)."""
    for _ in range(10_000):
        try:
            a.pop_tag()
        except (cumem_rs.CumemError, ValueError, IndexError):
            return
    raise AssertionError("tag stack does not empty")


@contextlib.contextmanager
def allocator_for(backend: str) -> Iterator[Allocator]:
    """A clean allocator for one test (or one hypothesis example) and the matching teardown.

    sim: a new allocator, closed afterwards. cuda: the process-wide allocator; afterwards every allocation the
    test made is freed and the usage must be back at its starting value (nothing leaked, nothing freed twice).
    """
    if backend == "sim":
        a = new_sim()
        try:
            yield a
        finally:
            a.close()
        return
    if backend != "cuda":
        raise ValueError(f"unknown backend {backend!r}")
    a = Allocator.cuda()
    before = {r["address"] for r in a.allocations()}
    usage_before = a.usage()
    try:
        yield a
    finally:
        _unwind_tags(a)
        for r in a.allocations():
            if r["address"] not in before:
                a.free(r["address"])
        assert a.usage() == usage_before, "the test leaked (or over-freed) CUDA memory"


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def alloc(backend: str) -> Iterator[Allocator]:
    with allocator_for(backend) as a:
        yield a


@pytest.fixture(autouse=True)
def _process_wide_host_setting_restored() -> Iterator[None]:
    """The CUDA allocator is one per process: a test that changes its host-memory setting (torch_memory_saver's
    `retain_cpu_backup` is `set_keep_host_memory`, False by default there) must not change the next test's."""
    if not HAS_CUDA:
        yield
        return
    a = Allocator.cuda()
    keep = a.keep_host_memory()
    yield
    a.set_keep_host_memory(keep)


@pytest.fixture
def raw_backups(monkeypatch) -> None:
    """Allocators made in the test back up raw (CUMEM_RS_COMPRESS=0: no codec), for tests that count the raw
    path's copies, pinned cells or host bytes. Request it before the allocator (`usefixtures`)."""
    monkeypatch.setenv("CUMEM_RS_COMPRESS", "0")


@pytest.fixture
def codec_on(monkeypatch) -> None:
    """The opposite of `raw_backups`: allocators made in the test compress where the driver has a codec, whatever
    CUMEM_RS_COMPRESS says (a GPU suite run with compression off must not switch the sim's codec off under the
    tests about it)."""
    monkeypatch.delenv("CUMEM_RS_COMPRESS", raising=False)


@pytest.fixture
def sim() -> Iterator[Allocator]:
    with allocator_for("sim") as a:
        yield a


# --- helpers over driver_counts() (simulated driver only) -------------------------------------------------------


def live_counts(a: Allocator) -> dict:
    """What the simulated driver still holds: ranges, handles, mapped bytes, host registrations/allocations."""
    c = a.driver_counts()
    return {k: c[k] for k in ("ranges", "handles", "mapped_bytes", "host_registered", "host_allocated")}


def call_counts(a: Allocator) -> dict[str, int]:
    """How often each driver operation (FAULT_OPS names) was called so far."""
    return dict(a.driver_counts()["calls"])


def fd_target(fd: str) -> str:
    """Where this process's open file descriptor `fd` points ("" once it closed)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def spill_files(a: Allocator, directory) -> tuple[int, int]:
    """(count, disk bytes of allocated blocks) of this process's open spill files in `directory`, once `a`'s
    reclaim of the files closed and holes given back so far has settled."""
    a.settle_spill_files()
    count = total = 0
    for fd in os.listdir("/proc/self/fd"):
        if fd_target(fd).startswith(str(directory) + "/"):
            try:
                total += os.stat(f"/proc/self/fd/{fd}").st_blocks * 512
            except OSError:
                continue
            count += 1
    return count, total
