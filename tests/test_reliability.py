"""What an adversarial review found, from Python, each with the test that would have caught it.

- worker threads the OS refuses (every place that starts one) and panics: no PanicException, no copy still
  queued when host memory goes back, and a clear CumemError from an allocator a panic left unusable;
- a raw stream handle given to `malloc` (CUDA crashed in `free`): refused;
- rounds of sleep and partial wake multiplied the host memory held: a state machine checks the bound after
  every step;
- size setters and fault arguments that wrapped around.

rust/tests/reliability.rs covers the same at the engine, plus frees that fail half way and tag stacks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import cumem_rs
from cumem_rs import Allocator, CumemError
from conftest import HAS_CUDA, STATEFUL_SETTINGS, call_counts, live_counts, new_sim

MiB = 1 << 20
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (cuda_available() is False)")


# --- worker threads and panics ----------------------------------------------------------------------------


def every_spawn_site(a: Allocator) -> None:
    """A cold sleep of an allocation big enough to be touched by several threads (on a machine with several
    cores), wake, then `reserve_host`, which pins a buffer whole: every place that starts a worker thread."""
    big = 80 * MiB  # touching goes parallel from 64 MiB
    a.push_tag("weights")
    try:
        addr = a.malloc(big)
    finally:
        a.pop_tag()
    head, tail = os.urandom(4096), os.urandom(4096)
    a.write(addr, head)
    a.write(addr + big - 4096, tail)
    before = call_counts(a)["host_register"]
    a.sleep("weights")
    assert call_counts(a)["host_register"] > before, "the sleep was cold"
    a.wake_up()
    assert a.read(addr, 4096) == head and a.read(addr + big - 4096, 4096) == tail
    a.trim_host()
    a.reserve_host(big)
    a.free(addr)


def big_sim() -> Allocator:
    return Allocator.simulated(capacity=256 * MiB, granularity=2 * MiB)


def test_a_refused_thread_at_every_spawn_site_leaves_the_work_to_the_calling_thread():
    a = big_sim()
    every_spawn_site(a)
    sites = call_counts(a)["thread_spawn"]
    a.close()
    assert sites >= 1, "the scenario starts no worker thread"
    for nth in range(1, sites + 1):
        a = big_sim()
        try:
            a.inject_fault("thread_spawn", nth)
            every_spawn_site(a)  # neither raises nor panics
            assert any("thread_spawn" in e for e in a.errors()), f"spawn #{nth} refused silently: {a.errors()}"
            a.trim_host()
            assert live_counts(a) == dict.fromkeys(live_counts(a), 0), f"spawn #{nth}: leak {live_counts(a)}"
        finally:
            a.close()


# Run in a child process: the second sleep must pin on a worker thread while the process limit leaves no room
# for one more thread (root is not bound by that limit, so the child drops to an unprivileged user first). Raw
# backups: a compressed backup goes into blob arenas and pins no arena on a worker. The child first checks that
# the OS now refuses a plain thread, so that a machine that cannot apply the limit says so instead of passing.
OS_REFUSES_A_THREAD = """
import os, resource, threading
import cumem_rs

a = cumem_rs.Allocator.simulated(capacity=64 << 20, granularity=2 << 20)
a.set_retain_backups(False)  # the second sleep copies into the cached arena, pinning it first
a.set_tag_policy("w", compress="off")
a.push_tag("w")
p = a.malloc(8 << 20)
a.pop_tag()
a.write(p, b"x" * (8 << 20))
a.inject_fault("host_register", 1)  # the first sleep's arena stays pageable, so the second sleep pins it
a.sleep("w")
a.wake_up()
if os.getuid() == 0:
    os.setuid(65534)
resource.setrlimit(resource.RLIMIT_NPROC, (1, resource.getrlimit(resource.RLIMIT_NPROC)[1]))
try:
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    print("the OS started a thread past RLIMIT_NPROC=1")
except RuntimeError:
    print("limit applies")
spawns = a.driver_counts()["calls"]["thread_spawn"]
try:
    a.sleep("w")
    outcome = "ok"
except BaseException as e:  # PyO3's PanicException is a BaseException
    outcome = f"{type(e).__name__}: {e}"
print(outcome)
print(a.driver_counts()["calls"]["thread_spawn"] > spawns)
print([e for e in a.errors() if "thread_spawn" in e])
a.wake_up()
assert a.read(p, 4) == b"xxxx"
a.close()
"""


def test_the_os_refusing_a_thread_is_not_a_panic():
    r = subprocess.run([sys.executable, "-c", OS_REFUSES_A_THREAD], capture_output=True, text=True, timeout=120)
    lines = r.stdout.split("\n")
    assert r.returncode == 0, f"the child failed:\n{r.stdout}{r.stderr}"
    if lines[0] != "limit applies":
        pytest.skip(f"{lines[0]} (this machine cannot make the OS refuse a thread)")
    assert lines[1] == "ok", f"sleep failed when no thread could start:\n{r.stdout}{r.stderr}"
    assert lines[2] == "True", f"the sleep started no worker thread:\n{r.stdout}"
    assert "the OS refused a new thread" in lines[3], f"the refused thread was not recorded:\n{r.stdout}"


@pytest.mark.parametrize("op", ["reserve", "map", "copy_d2h", "host_register", "unmap", "thread_spawn"])
@pytest.mark.usefixtures("raw_backups")  # the raw path: counts its copies or host bytes
def test_a_panic_surfaces_as_cumem_error_and_leaves_the_allocator_refusing_calls(op):
    a = new_sim()
    a.set_pin_chunk(64 * 1024)  # several cells: copies are queued before the later cells are pinned
    a.set_retain_backups(False)  # every sleep copies into an arena (none skips through a retained backup)
    a.push_tag("weights")
    addrs = [a.malloc(3 * 64 * 1024, device=d % 2) for d in range(4)]
    a.pop_tag()
    if op == "host_register":
        # The panicking registration comes after copies of ready cells were queued (the review's case): a first
        # sleep leaves cell 3 unpinned in the cached arena, the second pins it after copying the others.
        a.inject_fault("host_register", 3)
        a.sleep("weights")
        a.wake_up()
    a.inject_panic(op)
    # pytest.raises(CumemError) lets anything else through: a PanicException (a BaseException) fails the test.
    with pytest.raises(CumemError, match="panic"):
        if op == "reserve":
            a.malloc(3 << 30)  # more than the shared reservations' free space: a new reservation is made
        elif op == "map":
            a.malloc(4096)
        elif op == "unmap":
            a.free(addrs[0])
        else:
            a.sleep("weights")
    assert a.driver_counts()["markers"] == 0, "a copy marker was never waited for"
    for call in (lambda: a.malloc(4096), lambda: a.sleep("weights"), a.wake_up, a.close):
        with pytest.raises(CumemError, match="unusable"):
            call()
    assert any("panicked" in e for e in a.errors())
    assert a.stats()["live_allocations"] == 4


# --- stream handles -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [0xDEADBEEF, 1, -1, 2**64])
def test_malloc_refuses_raw_stream_handles(sim, stream):
    with pytest.raises(ValueError, match="stream"):
        sim.malloc(4096, 0, stream)
    assert sim.allocations() == [] and live_counts(sim)["ranges"] == 0


@pytest.mark.parametrize("stream", ["0", 1.5, True, object()])
def test_malloc_stream_of_another_type_is_a_type_error(sim, stream):
    with pytest.raises(TypeError, match="stream"):
        sim.malloc(4096, 0, stream)
    assert sim.allocations() == []


@pytest.mark.parametrize("stream", [0, None])
def test_malloc_without_a_stream(sim, stream):
    """0 and None both mean the default stream: the allocation is made on the device asked for, usable, and freed
    whole."""
    for device, p in ((0, sim.malloc(4096, 0, stream)), (1, sim.malloc(4096, 1, stream=stream))):
        (row,) = [r for r in sim.allocations() if r["address"] == p]
        assert (row["device"], row["requested"], row["asleep"]) == (device, 4096, False), row
        sim.write(p, b"s" * 4096)
        assert sim.read(p, 4096) == b"s" * 4096
        sim.free(p)
    assert sim.allocations() == [] and live_counts(sim)["handles"] == 0


@needs_cuda
def test_cuda_malloc_with_a_made_up_stream_handle_raises_instead_of_crashing():
    a = Allocator.cuda()
    usage = a.usage()
    with pytest.raises(ValueError, match="stream"):
        p = a.malloc(1 << 21, 0, 0xDEADBEEF)
        a.free(p)  # what crashed the process before: cuStreamIsCapturing on the made-up handle
    assert a.usage() == usage


@needs_cuda
def test_cuda_malloc_takes_a_torch_stream_and_refuses_an_external_one():
    torch = pytest.importorskip("torch")
    a = Allocator.cuda()
    usage = a.usage()
    s = torch.cuda.Stream()
    p = a.malloc(1 << 21, 0, s)
    a.free(p)
    p = a.malloc(1 << 21, 0, torch.cuda.current_stream())
    a.free(p)
    with pytest.raises(TypeError, match="stream"):
        a.malloc(1 << 21, 0, torch.cuda.ExternalStream(s.cuda_stream))
    assert a.usage() == usage


# --- host memory over partial wakes ------------------------------------------------------------------------


TAGS = ["a", "b", "c", "d"]
subsets = st.lists(st.sampled_from(TAGS), unique=True, min_size=0, max_size=len(TAGS))


@dataclass
class Alloc:
    tag: str
    data: bytes
    asleep: bool = False
    backed_up: bool = False
    retained: bool = False  # awake with the backup its wake restored from still bound to it


class HostBoundMachine(RuleBasedStateMachine):
    """Allocations under four tags; sleeps of random tag sets, wakes of random subsets, frees, retained backups
    switched on and off, all in any order. After every step: host memory held <= the backups still referenced
    (allocations asleep with a backup, plus retained backups of awake ones) + the largest backup one sleep made,
    and every woken backup is intact (backups may have been moved between arenas to keep the bound)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = new_sim()
        self.gran = self.a.granularity()
        self.model: dict[int, Alloc] = {}
        self.largest = 0

    @rule(tag=st.sampled_from(TAGS), granules=st.integers(1, 3), device=st.integers(0, 1))
    def alloc(self, tag, granules, device):
        if len(self.model) >= 8:
            return  # enough to make holes; far from the simulated capacity
        self.a.push_tag(tag)
        try:
            addr = self.a.malloc(granules * self.gran, device)
        finally:
            self.a.pop_tag()
        data = os.urandom(granules * self.gran)
        self.a.write(addr, data)
        self.model[addr] = Alloc(tag, data)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        addr = data.draw(st.sampled_from(sorted(self.model)))
        self.a.free(addr)
        del self.model[addr]

    @rule(on=st.booleans())
    def retain(self, on):
        self.a.set_retain_backups(on)
        if not on:
            for rec in self.model.values():
                rec.retained = False  # switching retention off drops every retained backup

    @rule(offload=subsets)
    def sleep(self, offload):
        report = self.a.sleep(offload)
        self.largest = max(self.largest, report["copied_bytes"])
        for rec in self.model.values():
            if not rec.asleep:
                # A retained backup becomes the allocation's backup, or is dropped when not offloaded.
                rec.asleep, rec.backed_up, rec.retained = True, rec.tag in offload, False

    @rule(tags=st.none() | subsets)
    def wake(self, tags):
        self.a.wake_up(tags)
        retaining = self.a.retains_backups()
        for addr, rec in self.model.items():
            if rec.asleep and (tags is None or rec.tag in tags):
                if rec.backed_up:
                    assert self.a.read(addr, len(rec.data)) == rec.data, f"backup of {addr:#x} changed"
                else:
                    rec.data = self.a.read(addr, len(rec.data))  # undefined contents: take what is there
                rec.retained = retaining and rec.backed_up
                rec.asleep = rec.backed_up = False

    @invariant()
    def host_memory_is_bounded(self):
        """Host memory held <= what the model says backups still reference (asleep with a backup, or awake with
        a retained one, at their raw size) + the largest sleep's copy; the allocator's own count of retained
        bytes is checked against the model, never used for the bound."""
        held = self.a.host_bytes()
        asleep = sum(len(r.data) for r in self.model.values() if r.asleep and r.backed_up)
        retained = sum(len(r.data) for r in self.model.values() if r.retained)
        assert held <= asleep + retained + self.largest, (
            f"{held} bytes of host memory held for {asleep} asleep and {retained} retained in backups (model), "
            f"largest sleep {self.largest}"
        )
        reported = self.a.stats()["host_retained_bytes"]
        assert reported <= retained, f"the allocator reports {reported} retained bytes, the model {retained}"

    def teardown(self):
        self.a.close()


def test_host_memory_stays_bounded_over_random_partial_wakes():
    run_state_machine_as_test(HostBoundMachine, settings=STATEFUL_SETTINGS)


@pytest.mark.parametrize("retain", [False, True], ids=["copy", "retain"])
def test_the_reviews_four_rounds_of_partial_wake(retain):
    a = new_sim()
    a.set_retain_backups(retain)
    g = a.granularity()
    addrs = {}
    for t in TAGS:
        a.push_tag(t)
        addrs[t] = a.malloc(g)
        a.pop_tag()
        a.write(addrs[t], t.encode() * g)
    largest = 0
    for k in (3, 2, 1, 0):
        largest = max(largest, a.sleep(TAGS)["copied_bytes"])
        a.wake_up(TAGS[:k])
        asleep = sum(r["size"] for r in a.allocations() if r["asleep"] and r["backed_up"])
        needed = asleep + a.stats()["host_retained_bytes"]
        assert a.host_bytes() <= needed + largest, (k, a.host_bytes(), needed, largest)
    a.wake_up()
    for t, addr in addrs.items():
        assert a.read(addr, g) == t.encode() * g
    a.close()


# --- sizes and fault arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [0, -1, 2**63, 2**64 - 11, 2**80])
def test_set_pin_chunk_refuses_sizes_it_cannot_use(sim, nbytes):
    with pytest.raises(ValueError, match="pin chunk|nbytes"):
        sim.set_pin_chunk(nbytes)
    # The chunk in force is unchanged: a cold sleep still ends.
    addr = sim.malloc(4096)
    sim.sleep()
    sim.wake_up()
    sim.free(addr)


@pytest.mark.parametrize("nth", [2**64 - 1, 2**64, -1, 0])
def test_inject_fault_too_far_ahead_is_refused(sim, nth):
    sim.free(sim.malloc(4096))  # the call counters are past 0
    with pytest.raises(ValueError, match="nth"):
        sim.inject_fault("create", nth)
    with pytest.raises(ValueError, match="nth"):
        sim.inject_panic("create", nth)
    sim.free(sim.malloc(4096))  # nothing armed


def test_thread_spawn_is_a_fault_op():
    assert "thread_spawn" in cumem_rs.FAULT_OPS
