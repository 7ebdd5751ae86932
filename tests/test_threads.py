"""Many threads against one allocator while another thread puts it to sleep and wakes it.

Every engine call releases the GIL, so the threads really run inside the engine at the same time. The semantics
checked here (one engine mutex makes every call atomic):

- malloc/free/read/write called while a sleep or wake runs wait until it has finished: each call happens either
  wholly before or wholly after it (never half in the sleep's report, half outside);
- an allocation made between a sleep and its wake is awake; the wake leaves it alone;
- freeing an asleep allocation works (its range and backup go away);
- data written to an allocation survives every sleep/wake that happened after the write if all those sleeps
  offloaded its tag; otherwise it is either untouched (no sleep came in between) or lost (poison on the sim);
- tag stacks are per thread: another thread's push_tag never changes this thread's tag.

Ordering evidence without locks around the calls: the sleeper thread keeps counters that it updates only
outside the engine (`started` before calling sleep, `finished` after it returned, `woken` after the wake
returned). A sleep numbered > `finished` read before a call may have happened after it; one numbered > `started`
read after a call returned cannot have happened before it. A pause gate stops the workers between operations
now and then, so that the whole state (allocations(), usage(), driver counts) can be compared with what the
workers own.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import pytest

from cumem_rs import Allocator, CumemError
from conftest import BACKENDS, HAS_CUDA, allocator_for, live_counts

MiB = 1 << 20
POISON = b"\xa5"  # what the simulated driver fills fresh physical memory with
PAYLOAD = 16  # bytes written right after malloc (and on rewrites), at a random offset
TAGS = ("thr-w", "thr-kv", "thr-x", "default")
WORKERS = 8
MAX_LIVE = 8  # per worker
JOIN_TIMEOUT = 120.0  # far above the expected run time: only a deadlock reaches it

# Total operations (engine calls) of all workers, and allocation sizes, per backend.
OPS = {"sim": 100_000, "cuda": 20_000}


class RangeSet:
    """Address ranges the workers hold. A range is removed *before* its free is called, so a malloc returning
    memory that overlaps a range still here got memory that was never freed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: dict[int, int] = {}

    def add(self, start: int, size: int) -> None:
        end = start + size
        with self._lock:
            i = bisect.bisect_left(self._starts, start)
            if i > 0:
                prev = self._starts[i - 1]
                assert self._ends[prev] <= start, f"malloc gave [{start:#x}, {end:#x}) overlapping a live range"
            if i < len(self._starts):
                assert end <= self._starts[i], f"malloc gave [{start:#x}, {end:#x}) overlapping a live range"
            self._starts.insert(i, start)
            self._ends[start] = end

    def remove(self, start: int) -> None:
        with self._lock:
            del self._ends[start]
            self._starts.remove(start)


class Gate:
    """Lets the sleeper stop all workers between two operations (no engine call of theirs in flight)."""

    def __init__(self, workers: int) -> None:
        self._cond = threading.Condition()
        self._pausing = False
        self._parked = 0
        self._running = workers

    def checkpoint(self) -> None:
        if not self._pausing:  # unlocked read: a stale False only delays parking to the next checkpoint
            return
        with self._cond:
            self._parked += 1
            self._cond.notify_all()
            while self._pausing:
                self._cond.wait()
            self._parked -= 1

    def leave(self) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify_all()

    @property
    def running(self) -> int:
        return self._running

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        deadline = time.monotonic() + JOIN_TIMEOUT
        with self._cond:
            self._pausing = True
            while self._parked < self._running:
                assert time.monotonic() < deadline, "workers did not reach a checkpoint: a call hangs"
                self._cond.wait(timeout=1.0)
        try:
            yield
        finally:
            with self._cond:
                self._pausing = False
                self._cond.notify_all()


@dataclass(eq=False)
class Rec:
    """One allocation a worker owns, with the evidence about when it was made and written."""

    addr: int
    size: int
    requested: int
    device: int
    tag: str
    fin_before_malloc: int  # sleeps finished before malloc was called: those happened before it
    started_after_malloc: int  # sleeps started when malloc had returned: later ones happened after it
    off: int = 0
    payload: Optional[bytes] = None  # None: content unknown (the write met an asleep allocation, or data lost)
    fin_before_write: int = 0


class Run:
    """State shared by the workers and the sleeper of one test run."""

    def __init__(self, a: Allocator, backend: str, foreign: dict[int, dict], seed: int) -> None:
        self.a = a
        self.backend = backend
        self.foreign = foreign  # cuda: allocations that existed before the test (never touched by workers)
        self.foreign_tags = frozenset(r["tag"] for r in foreign.values())
        self.seed = seed
        self.ranges = RangeSet()
        self.gate = Gate(WORKERS)
        self.owned: list[dict[int, Rec]] = [{} for _ in range(WORKERS)]
        self.errors: list[BaseException] = []
        self.ops = [0] * WORKERS
        # Sleeper counters and the offload set of sleep number k (1-based) at log[k - 1].
        self.log: list[frozenset[str]] = []
        self.started = 0
        self.finished = 0
        self.woken = 0
        self.sleeps_checked_quietly = 0
        self.asleep_seen_by_workers = 0
        self.asleep_frees = 0
        self.lost_seen = 0
        self.preserved_seen = 0
        if backend == "sim":
            self.gran = [a.granularity(d) for d in range(a.device_count())]
            self.devices = a.device_count()
        else:
            self.gran = [a.granularity(0)]
            self.devices = 1  # torch and the lead's runs use device 0; more devices add nothing here

    def size_for(self, rng: random.Random) -> int:
        g = self.gran[0]
        if self.backend == "cuda":
            return rng.randint(2 * PAYLOAD, g)  # one granule (2 MiB on an H200)
        return rng.randint(2 * PAYLOAD, 3 * g)

    def rounded(self, size: int, device: int) -> int:
        g = self.gran[device]
        return -(-size // g) * g


# --- workers ---------------------------------------------------------------------------------------------------------


def _is_asleep_error(e: BaseException) -> bool:
    return isinstance(e, CumemError) and "asleep" in str(e)


class Worker:
    def __init__(self, run: Run, wid: int, n_ops: int) -> None:
        self.run = run
        self.a = run.a
        self.wid = wid
        self.n_ops = n_ops
        self.rng = random.Random(run.seed * 1000 + wid)
        self.own = run.owned[wid]

    def __call__(self) -> None:
        run = self.run
        try:
            while run.ops[self.wid] < self.n_ops:
                run.gate.checkpoint()
                r = self.rng.random()
                if not self.own or (r < 0.35 and len(self.own) < MAX_LIVE):
                    self.malloc()
                elif r < 0.55 or len(self.own) >= MAX_LIVE and r < 0.6:
                    self.free(self.rng.choice(list(self.own.values())))
                elif r < 0.85:
                    self.check(self.rng.choice(list(self.own.values())))
                else:
                    self.tags()
        except BaseException as e:  # reported by the main thread
            run.errors.append(e)
        finally:
            try:
                for rec in list(self.own.values()):
                    run.gate.checkpoint()
                    self.free(rec)
            except BaseException as e:
                run.errors.append(e)
            run.gate.leave()

    def _count(self, n: int = 1) -> None:
        self.run.ops[self.wid] += n

    def malloc(self) -> None:
        run, a = self.run, self.a
        tag = self.rng.choice(TAGS)
        device = self.rng.randrange(run.devices)
        requested = run.size_for(self.rng)
        pushed = tag != "default" or self.rng.random() < 0.5  # "default" both explicitly and by an empty stack
        if pushed:
            a.push_tag(tag)
            assert a.current_tag() == tag, "another thread changed this thread's tag"
            self._count(2)
        fin0 = run.finished
        try:
            addr = a.malloc(requested, device)
        finally:
            if pushed:
                assert a.pop_tag() == tag
                self._count()
        self._count()
        started1 = run.started
        rec = Rec(addr, run.rounded(requested, device), requested, device, tag, fin0, started1)
        run.ranges.add(addr, rec.size)
        self.own[addr] = rec
        self.write(rec, just_allocated=True)

    def write(self, rec: Rec, just_allocated: bool = False) -> None:
        run = self.run
        rec.off = self.rng.randrange(0, rec.requested - PAYLOAD + 1)
        payload = self.rng.randbytes(PAYLOAD)
        rec.fin_before_write = run.finished
        woken0 = run.woken
        self._count()
        try:
            self.a.write(rec.addr + rec.off, payload)
        except CumemError as e:
            assert _is_asleep_error(e), f"write failed: {e}"
            # Asleep: some sleep came before this write and its wake did not finish before the write started;
            # right after malloc that sleep must also have come after the malloc (made between sleep and wake
            # means awake).
            bound = rec.fin_before_malloc if just_allocated else woken0
            assert run.started > bound, (
                "write found the allocation asleep, but no sleep can have happened since "
                + ("its malloc" if just_allocated else "the last completed wake")
            )
            rec.payload = None
            run.asleep_seen_by_workers += 1
            return
        rec.payload = payload

    def check(self, rec: Rec) -> None:
        run = self.run
        if rec.payload is None:
            self.write(rec)
            return
        woken0 = run.woken
        self._count()
        try:
            data = self.a.read(rec.addr + rec.off, PAYLOAD)
        except CumemError as e:
            assert _is_asleep_error(e), f"read failed: {e}"
            assert run.started > woken0, "read found the allocation asleep after every sleep was woken"
            run.asleep_seen_by_workers += 1
            if self.rng.random() < 0.5:
                run.asleep_frees += 1  # most likely still asleep: exercises free of asleep allocations
                self.free(rec)
            return
        started1 = run.started
        between = run.log[rec.fin_before_write : started1]
        if all(rec.tag in tags for tags in between):
            assert data == rec.payload, (
                f"{rec.tag} data changed across {len(between)} sleeps that all offloaded it"
            )
            run.preserved_seen += bool(between)
        elif data != rec.payload:
            if run.backend == "sim":
                assert data == POISON * PAYLOAD, "data neither kept nor poisoned after a discarding sleep"
            run.lost_seen += 1
            self.write(rec)

    def free(self, rec: Rec) -> None:
        del self.own[rec.addr]
        self.run.ranges.remove(rec.addr)
        self._count()
        self.a.free(rec.addr)  # awake or asleep, it must succeed

    def tags(self) -> None:
        a = self.a
        outer = a.current_tag()
        assert outer == "default", f"tag stack not empty between operations: {outer!r}"
        t1, t2 = self.rng.sample(TAGS[:3], 2)
        a.push_tag(t1)
        assert a.current_tag() == t1
        a.push_tag(t2)
        assert a.current_tag() == t2
        assert a.pop_tag() == t2
        assert a.current_tag() == t1
        assert a.pop_tag() == t1
        assert a.current_tag() == "default"
        self._count(9)


# --- the sleeper and the global checks ------------------------------------------------------------------------------


def check_consistency(run: Run, asleep_phase: Optional[int]) -> None:
    """With every worker parked: the allocator's view equals what the workers own.

    `asleep_phase`: k when sleep k has finished and its wake has not started, else None (all awake)."""
    a = run.a
    snap = a.allocations()
    ours = {r["address"]: r for r in snap if r["address"] not in run.foreign}
    owned = {addr: rec for own in run.owned for addr, rec in own.items()}
    assert ours.keys() == owned.keys(), "allocator and workers disagree on the live allocations"
    for addr, rec in owned.items():
        r = ours[addr]
        assert (r["size"], r["requested"], r["device"], r["tag"]) == (rec.size, rec.requested, rec.device, rec.tag)
        if asleep_phase is None:
            assert not r["asleep"], "an allocation is asleep after its wake"
            continue
        k = asleep_phase
        if rec.fin_before_malloc >= k:
            assert not r["asleep"], "made after sleep finished, yet asleep before the wake"
        if rec.started_after_malloc < k:
            assert r["asleep"], "made before the sleep started, yet awake after it"
            assert r["backed_up"] == (rec.tag in run.log[k - 1]), "backup does not follow the offload tags"
    spans = sorted((r["address"], r["address"] + r["size"]) for r in snap)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, "two live allocations overlap"
    awake = sum(r["size"] for r in snap if not r["asleep"])
    assert a.usage() == awake, "usage() is not the sum of the awake allocations"
    if run.backend == "sim":
        c = a.driver_counts()
        # Allocations share reservations, and neighbours woken together share a handle (wake groups).
        assert (c["ranges"] > 0) == bool(snap)
        assert c["handles"] <= sum(not r["asleep"] for r in snap)
        assert c["mapped_bytes"] == awake + a.stats()["unreturned_bytes"]


def sleeper(run: Run, done: threading.Event) -> None:
    a = run.a
    rng = random.Random(run.seed)
    k = 0
    try:
        while not done.is_set():
            k += 1
            tags = frozenset(t for t in TAGS if rng.random() < 0.5) | run.foreign_tags
            quiet = k % 25 == 0
            with run.gate.paused() if quiet else contextlib.nullcontext():
                before = a.allocations() if quiet else []
                run.log.append(tags)
                run.started += 1
                report = a.sleep(sorted(tags))
                run.finished += 1
                if quiet:
                    # Nobody else ran: the report must account for exactly the awake allocations.
                    awake = [r for r in before if not r["asleep"]]
                    copied = sum(r["size"] for r in awake if r["tag"] in tags)
                    assert report["allocations"] == len(awake)
                    assert report["copied_bytes"] + report["skipped_bytes"] == copied  # skipped: unchanged retained chunks
                    assert report["discarded_bytes"] == sum(r["size"] for r in awake) - copied
                    check_consistency(run, k)
                    run.sleeps_checked_quietly += 1
            time.sleep(rng.uniform(0, 0.002))
            if k % 10 == 3:
                with run.gate.paused():
                    check_consistency(run, k)
            a.wake_up()
            run.woken += 1
            if k % 10 == 7:
                with run.gate.paused():
                    check_consistency(run, None)
            time.sleep(rng.uniform(0, 0.002))
    except BaseException as e:
        run.errors.append(e)


@pytest.mark.parametrize("backend", BACKENDS)
def test_threads_against_sleep_wake(backend: str) -> None:
    with allocator_for(backend) as a:
        foreign = {r["address"]: r for r in a.allocations()}
        if any(r["asleep"] for r in foreign.values()):
            pytest.skip("the process-wide CUDA allocator holds asleep allocations of another test")
        usage0 = a.usage()
        stats0 = a.stats()
        errors0 = len(a.errors())
        run = Run(a, backend, foreign, seed=int.from_bytes(os.urandom(4), "little"))
        per_worker = OPS[backend] // WORKERS
        workers = [threading.Thread(target=Worker(run, i, per_worker), name=f"worker-{i}") for i in range(WORKERS)]
        done = threading.Event()
        sl = threading.Thread(target=sleeper, args=(run, done), name="sleeper")
        t0 = time.monotonic()
        for t in workers:
            t.start()
        sl.start()
        for t in workers:
            t.join(timeout=max(1.0, JOIN_TIMEOUT - (time.monotonic() - t0)))
        done.set()
        sl.join(timeout=max(1.0, JOIN_TIMEOUT - (time.monotonic() - t0)))
        hung = [t.name for t in workers + [sl] if t.is_alive()]
        assert not hung, f"deadlock: {hung} still running after {JOIN_TIMEOUT} s (seed {run.seed})"
        if run.errors:
            raise AssertionError(f"a thread failed (seed {run.seed})") from run.errors[0]

        # Whatever the sleeper's last step was, wake everything; then nothing of ours is left.
        a.wake_up()
        check_consistency(run, None)
        assert sum(run.ops) >= OPS[backend] - WORKERS, "the workers did not run their operations"
        assert run.started >= 5, "the sleeper hardly ran: no real overlap with the workers"
        assert run.sleeps_checked_quietly >= 1 or run.started < 25
        assert {r["address"] for r in a.allocations()} == set(foreign), "allocations were left behind"
        assert a.usage() == usage0
        stats = a.stats()
        assert stats["mallocs"] - stats0["mallocs"] == stats["frees"] - stats0["frees"], "every malloc freed once"
        assert a.errors()[errors0:] == [], "calls recorded errors"
        if backend == "sim":
            a.close()
            assert all(v == 0 for v in live_counts(a).values()), live_counts(a)


# --- deterministic orderings ----------------------------------------------------------------------------------------


def test_malloc_and_free_racing_a_sleep_are_atomic() -> None:
    """A malloc and a free of an asleep-to-be allocation issued while a long sleep copies: each lands wholly
    before or wholly after the sleep, as its report and the final states show."""
    G = 2 * MiB
    a = Allocator.simulated(devices=1, capacity=1 << 30, granularity=G)
    try:
        a.push_tag("w")
        big = [a.malloc(32 * MiB) for _ in range(6)]  # ~190 MiB to copy: the sleep takes a while
        a.pop_tag()
        pattern = {addr: os.urandom(64) for addr in big}
        for addr, data in pattern.items():
            a.write(addr, data)
        rng = random.Random(1)
        outcomes = set()
        for _ in range(12):
            a.push_tag("x")
            victim = a.malloc(3 * G)  # discarded by the sleep if it is still there: 3 granules tell it apart
            a.pop_tag()
            report: dict = {}
            go = threading.Barrier(2)

            def do_sleep() -> None:
                go.wait()
                report.update(a.sleep(["w"]))

            t = threading.Thread(target=do_sleep)
            t.start()
            go.wait()
            time.sleep(rng.uniform(0, 0.02))
            a.push_tag("w")
            new = a.malloc(G)
            a.pop_tag()
            a.free(victim)
            t.join(timeout=60)
            assert not t.is_alive()

            state = {r["address"]: r for r in a.allocations()}
            new_asleep = state[new]["asleep"]
            victim_in_sleep = report["discarded_bytes"] == 3 * G
            assert victim not in state
            assert report["discarded_bytes"] in (0, 3 * G)
            assert report["allocations"] == len(big) + new_asleep + victim_in_sleep
            assert report["copied_bytes"] + report["skipped_bytes"] == len(big) * 32 * MiB + new_asleep * G
            assert state[new]["backed_up"] == new_asleep
            # malloc came first, so the sleep saw the new allocation; the free came after the malloc, so if the
            # new allocation was left out (malloc after the sleep) the victim's free was after it too.
            if not new_asleep:
                assert victim_in_sleep, "free finished before a sleep that had not seen the earlier malloc"
            outcomes.add((new_asleep, victim_in_sleep))

            a.wake_up()
            for addr, data in pattern.items():
                assert a.read(addr, 64) == data
            a.free(new)
        assert a.usage() == len(big) * 32 * MiB
    finally:
        a.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_allocation_between_sleep_and_wake_is_awake(backend: str) -> None:
    with allocator_for(backend) as a:
        if any(r["asleep"] for r in a.allocations()):
            pytest.skip("the process-wide CUDA allocator holds asleep allocations of another test")
        foreign_tags = sorted({r["tag"] for r in a.allocations()})
        a.push_tag("thr-w")
        old = a.malloc(a.granularity(0))
        a.pop_tag()
        a.write(old, b"old-data")
        a.sleep(["thr-w", *foreign_tags])

        made: dict = {}

        def other() -> None:
            a.push_tag("thr-w")
            made["addr"] = addr = a.malloc(100)
            a.pop_tag()
            a.write(addr, b"made-while-asleep")
            made["read"] = a.read(addr, 17)

        t = threading.Thread(target=other)
        t.start()
        t.join(timeout=60)
        assert not t.is_alive()
        new = made["addr"]
        assert made["read"] == b"made-while-asleep"
        state = {r["address"]: r for r in a.allocations()}
        assert state[old]["asleep"] and not state[new]["asleep"]

        asleep = sum(r["asleep"] for r in state.values())
        report = a.wake_up()
        assert report["allocations"] == asleep, "the wake counted an allocation that was awake"
        state = {r["address"]: r for r in a.allocations()}
        assert not state[new]["asleep"] and not state[old]["asleep"]
        assert a.read(new, 17) == b"made-while-asleep", "the wake touched an allocation that was awake"
        assert a.read(old, 8) == b"old-data"
        # The next sleep treats it like any other awake allocation of its tag.
        a.sleep(["thr-w", *foreign_tags])
        assert {r["address"]: r for r in a.allocations()}[new]["backed_up"]
        a.wake_up()
        assert a.read(new, 17) == b"made-while-asleep"
        a.free(new)
        a.free(old)


def test_frees_of_asleep_allocations_racing_a_wake() -> None:
    """Threads free asleep allocations while another wakes: each free lands before the wake (the allocation is
    never woken) or after it (it is woken, then freed); nothing leaks, nothing is released twice."""
    a = Allocator.simulated(devices=2, capacity=256 * MiB, granularity=64 << 10)
    try:
        addrs = []
        for i in range(400):
            a.push_tag("w" if i % 2 else "kv")
            addrs.append(a.malloc((i % 5 + 1) * 40_000, i % 2))
            a.pop_tag()
        keep = set(addrs[::7])
        for addr in keep:
            a.write(addr, addr.to_bytes(8, "little"))
        a.sleep(["w", "kv"])
        to_free = [x for x in addrs if x not in keep]
        chunks = [to_free[i::6] for i in range(6)]
        errors: list[BaseException] = []

        def freer(chunk: list[int]) -> None:
            try:
                for addr in chunk:
                    a.free(addr)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=freer, args=(c,)) for c in chunks]
        threads.append(threading.Thread(target=a.wake_up))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors[0]
        state = a.allocations()
        assert {r["address"] for r in state} == keep
        assert not any(r["asleep"] for r in state)
        for addr in keep:
            assert a.read(addr, 8) == addr.to_bytes(8, "little")
        assert a.usage() == sum(r["size"] for r in state)
        assert a.errors() == []
        for addr in keep:
            a.free(addr)
        a.close()
        assert all(v == 0 for v in live_counts(a).values()), live_counts(a)
    finally:
        a.close()


# --- torch: my_malloc / my_free from a torch thread while another sleeps and wakes ---------------------------------

_TORCH_THREAD_SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time
    import torch
    from cumem_rs import CuMemAllocator

    alloc = CuMemAllocator.get_instance()
    native = alloc.native
    errors_before = len(native.errors())
    MiB = 1 << 20
    stop = threading.Event()
    failures = []
    counts = {"blocks": 0, "tensors": 0}

    def allocate():
        # Allocation only, never a kernel: a kernel on memory that another thread just put to sleep would
        # fault. torch calls my_malloc (new segment) and, when a block's pool is dropped, my_free, possibly on
        # asleep allocations.
        try:
            kept = []
            i = 0
            while not stop.is_set() and i < 3000:
                tag = ("weights", "kv_cache", "default")[i % 3]
                with alloc.use_memory_pool(tag):
                    for j in range(4):
                        kept.append(torch.empty((1 + (i + j) % 7) * MiB, dtype=torch.uint8, device="cuda"))
                        counts["tensors"] += 1
                    del kept[:-8]
                counts["blocks"] += 1
                i += 1
            kept.clear()
        except BaseException as e:
            failures.append(repr(e))

    t = threading.Thread(target=allocate, daemon=True)
    t.start()
    cycles = 0
    deadline = time.monotonic() + 60
    while t.is_alive() and time.monotonic() < deadline:
        alloc.sleep(offload_tags=("weights",))
        alloc.wake_up()
        cycles += 1
    stop.set()
    t.join(timeout=60)
    if t.is_alive():
        print(f"DEADLOCK after {cycles} cycles, {counts}", flush=True)
        os._exit(3)
    alloc.wake_up()
    alloc.release_pools()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    import cumem_rs._native as n
    print("cycles", cycles, "blocks", counts["blocks"], "tensors", counts["tensors"], flush=True)
    print("failures", failures, flush=True)
    print("errors", native.errors()[errors_before:], n.ffi_errors(), flush=True)
    print("asleep", sum(a["asleep"] for a in native.allocations()), flush=True)
    """
)


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(not (HAS_CUDA and _torch_cuda()), reason="needs a CUDA GPU visible to torch and cumem_rs")
def test_torch_thread_allocates_while_main_thread_sleeps_and_wakes() -> None:
    """my_malloc/my_free never need the GIL: a torch thread allocating in our pools (torch may hold the GIL in
    there) and the main thread sleeping and waking (the engine waits for the allocation, the allocation for the
    engine) must both finish. Run in a child process so that a deadlock or an abort fails this test only."""
    proc = subprocess.run(
        [sys.executable, "-c", _TORCH_THREAD_SCRIPT], capture_output=True, text=True, timeout=240
    )
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr}"
    lines = {line.split(" ", 1)[0]: line for line in out.splitlines()}
    cycles, blocks = int(lines["cycles"].split()[1]), int(lines["cycles"].split()[3])
    assert cycles >= 1 and blocks >= 1, out
    assert lines["failures"] == "failures []", out
    assert lines["errors"] == "errors [] []", out
    assert lines["asleep"] == "asleep 0", out
    assert "Traceback" not in proc.stderr, proc.stderr
