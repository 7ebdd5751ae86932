"""Driver failures at every point of a sleep/wake cycle: each must surface, and leave a consistent allocator.

Two parts:

- `test_every_fault_position`: a reference scenario is run once cleanly to count how many calls of each driver
  operation it makes; then, for every operation and every call position n of it, the scenario runs again on a
  fresh simulated allocator whose n-th call of that operation fails. Afterwards the registry must agree with the
  driver, offloaded data must be intact (awake) or still backed up (asleep), and once the fault is cleared the
  same allocator must wake, hold the right data and free everything without leaking.
- `FaultyMachine`: the model-based state machine of test_state_machine.py plus rules that arm faults at random
  points. It is a separate class rather than an optional rule of the main machine, so that the main machine
  keeps its strict rule "every failure is a bug" (no fault can excuse one there), while this one accepts exactly
  the failures an armed fault explains and checks what each left behind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule, run_state_machine_as_test

import cumem_rs
from cumem_rs import Allocator, CumemError, CumemOutOfMemoryError, DriverError
from conftest import SIM_GRANULARITY, STATEFUL_SETTINGS, call_counts, live_counts, new_sim
from test_state_machine import TAGS, AllocatorMachine, machine_for, tag_sets

G = SIM_GRANULARITY

# (tag, requested size, device): two tags, both devices, sizes on and off the granularity.
SCENARIO_ALLOCS = [
    ("weights", G + G // 2, 0),
    ("weights", 2 * G, 1),
    ("weights", 100, 0),
    ("kv_cache", 3 * G, 0),
    ("kv_cache", G - 1, 1),
]

OFFLOADED = "weights"  # the tag the scenario's sleep backs up

# The CUDA result code each FAULT_ERRORS kind stands for (cudaError_enum / CUresult).
CUDA_CODES = {"oom": 2, "invalid": 1, "unknown": 999, "not_permitted": 800}


@dataclass
class Run:
    """What one scenario run did: the allocations it made and the data they must hold."""

    a: Allocator
    addrs: dict[int, str] = field(default_factory=dict)  # address -> tag
    data: dict[int, bytes] = field(default_factory=dict)  # address -> bytes written (weights only after sleep)
    step: str = ""
    freeing: Optional[int] = None  # the address whose free was attempted last
    error: Optional[Exception] = None
    groups_seen: int = 0  # wake groups alive after the first wake


def scenario(run: Run) -> None:
    """malloc under two tags, write, sleep offloading "weights", wake all, read, discard, wake, free all, trim.

    Stops at the first CumemError (kept in run.error, with the step in run.step)."""
    a = run.a
    try:
        run.step = "malloc"
        for tag, size, device in SCENARIO_ALLOCS:
            a.push_tag(tag)
            try:
                addr = a.malloc(size, device)
            finally:
                a.pop_tag()
            run.addrs[addr] = tag
        run.step = "write"
        for addr, tag in run.addrs.items():
            size = next(r["requested"] for r in a.allocations() if r["address"] == addr)
            payload = os.urandom(size)
            a.write(addr, payload)
            run.data[addr] = payload
        run.step = "sleep"
        a.sleep(OFFLOADED)
        # Only offloaded data is promised back.
        run.data = {addr: d for addr, d in run.data.items() if run.addrs[addr] == OFFLOADED}
        run.step = "wake_up"
        a.wake_up()
        run.groups_seen = a.stats()["wake_groups"]
        run.step = "read"
        for addr, d in run.data.items():
            assert a.read(addr, len(d)) == d, f"offloaded data of {addr:#x} changed across sleep/wake"
        run.step = "discard"
        a.discard("kv_cache")
        run.step = "wake_up again"
        a.wake_up()
        run.step = "free"
        for addr in list(run.addrs):
            run.freeing = addr
            a.free(addr)
            del run.addrs[addr]
            run.data.pop(addr, None)
        # Beyond the minimal cycle: returning the cached host memory covers the host unpinning path too.
        run.step = "trim_host"
        a.trim_host()
        run.step = "done"
    except CumemError as e:
        run.error = e


def check_consistent(run: Run) -> None:
    """After a (possibly failed) run: registry == driver; data we wrote is intact where awake; offloaded
    allocations that are asleep still have their backup."""
    a = run.a
    # Freed members of a wake group stay mapped until the group goes (unreturned_bytes).
    mapped = a.usage() + a.stats()["unreturned_bytes"]
    assert mapped == live_counts(a)["mapped_bytes"], "registry and driver disagree on mapped bytes"
    rows = {r["address"]: r for r in a.allocations()}
    assert set(rows) <= set(run.addrs), "an allocation appeared that the scenario did not make"
    gone = set(run.addrs) - set(rows)
    # Only the allocation whose free failed may be gone (a free that fails late may still have dropped it).
    assert gone <= {run.freeing}, f"allocations {gone} vanished after failing at {run.step}"
    for addr in gone:
        del run.addrs[addr]
        run.data.pop(addr, None)
    for addr, d in list(run.data.items()):
        r = rows[addr]
        if r["asleep"] and run.addrs[addr] != OFFLOADED:
            del run.data[addr]  # not offloaded: released without backup, contents undefined from now on
        elif r["asleep"]:
            assert r["backed_up"], f"offloaded {addr:#x} is asleep without its backup after failing at {run.step}"
        else:
            assert a.read(addr, len(d)) == d, f"offloaded {addr:#x} lost its data after failing at {run.step}"


def recover_and_finish(run: Run) -> None:
    """Clear faults; the same allocator must wake everything, keep offloaded data, free all and leak nothing."""
    a = run.a
    a.clear_faults()
    a.wake_up()
    for addr, d in run.data.items():
        assert a.read(addr, len(d)) == d, f"{addr:#x} lost its data after recovery"
    for addr in list(run.addrs):
        a.free(addr)
    assert a.allocations() == [] and a.usage() == 0
    c = live_counts(a)
    assert (c["ranges"], c["handles"], c["mapped_bytes"]) == (0, 0, 0), f"leak after recovery: {c}"
    a.trim_host()
    c = live_counts(a)
    assert (c["host_registered"], c["host_allocated"]) == (0, 0), f"host memory leak after recovery: {c}"
    assert a.host_bytes() == 0


def reference_counts() -> dict[str, int]:
    """Per-op call counts of one clean scenario run (which also proves the scenario itself passes)."""
    a = new_sim()
    try:
        start = call_counts(a)
        run = Run(a)
        scenario(run)
        assert run.error is None and run.step == "done", run.error
        # The two neighbouring "weights" allocations on device 0 wake as one group, so every fault position of
        # the group's create, map, set access, unmap and release is covered too.
        assert run.groups_seen == 1, run.groups_seen
        end = call_counts(a)
        return {op: end[op] - start.get(op, 0) for op in cumem_rs.FAULT_OPS}
    finally:
        a.close()


def run_with_fault(op: str, n: int, error: str) -> str:
    """The scenario with the n-th call of `op` failing with `error`; returns how the failure surfaced."""
    a = new_sim()
    where = f"{op}#{n} ({error})"
    try:
        before = call_counts(a)
        a.inject_fault(op, n, error)
        run = Run(a)
        scenario(run)
        assert call_counts(a)[op] - before[op] >= n, f"{where}: the scenario made fewer calls of {op} this time"
        if run.error is not None:
            want = CumemOutOfMemoryError if error == "oom" else DriverError
            assert isinstance(run.error, want), f"{where}: {type(run.error).__name__}: {run.error}"
            assert op in str(run.error), f"{where}: the message does not name the operation: {run.error}"
            if isinstance(run.error, DriverError):
                # The failed call and its CUDA code, as attributes (not only in the message).
                assert (run.error.op, run.error.code) == (op, CUDA_CODES[error]), f"{where}: {vars(run.error)}"
            outcome = f"raised at {run.step}"
        else:
            # Paths that cannot raise (a release after the point of no return, a pinning failure that pageable
            # copies absorb) must leave a record that names the operation.
            assert any(op in e for e in a.errors()), f"{where}: the failure vanished: no exception, {a.errors()}"
            outcome = "recorded in errors()"
        check_consistent(run)
        recover_and_finish(run)
        return outcome
    finally:
        a.close()


def test_every_fault_position():
    ref = reference_counts()
    assert set(ref) == set(cumem_rs.FAULT_OPS)
    covered = {op: 0 for op in cumem_rs.FAULT_OPS}
    outcomes: dict[str, int] = {}
    for op in cumem_rs.FAULT_OPS:
        for n in range(1, ref[op] + 1):
            # Every error kind: "oom" takes other paths (CumemOutOfMemoryError) than the generic driver errors.
            for error in cumem_rs.FAULT_ERRORS:
                outcome = run_with_fault(op, n, error)
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
            covered[op] += 1
    print(f"\nfault positions covered: {sum(covered.values())} (op, n) pairs x {len(cumem_rs.FAULT_ERRORS)} errors")
    for op in cumem_rs.FAULT_OPS:
        print(f"  {op:16} {covered[op]:3} of {ref[op]} calls")
    for outcome, count in sorted(outcomes.items()):
        print(f"  {count:4} {outcome}")
    used = [op for op, calls in ref.items() if calls]
    assert len(used) >= 10, f"the scenario exercises too few driver operations: {used}"
    for op in used:
        assert covered[op] == ref[op] > 0


def test_malloc_create_oom_is_out_of_memory_error():
    """A driver out-of-memory at create surfaces as CumemOutOfMemoryError and malloc leaves nothing behind."""
    a = new_sim()
    try:
        a.inject_fault("create", 1, "oom")
        with pytest.raises(CumemOutOfMemoryError, match="create"):
            a.malloc(100)
        c = live_counts(a)
        assert (c["ranges"], c["handles"], c["mapped_bytes"]) == (0, 0, 0), c
        addr = a.malloc(100)  # the fault fired once; the next call works
        a.free(addr)
    finally:
        a.close()


def test_driver_error_carries_op_and_code():
    """DriverError.op is the failed driver call and .code its CUDA result code, matching the message."""
    a = new_sim()
    try:
        assert set(CUDA_CODES) == set(cumem_rs.FAULT_ERRORS)
        for op, error in (("create", "unknown"), ("map", "invalid"), ("reserve", "not_permitted")):
            a.inject_fault(op, 1, error)
            with pytest.raises(DriverError) as e:
                a.malloc(100)
            assert e.value.op == op and e.value.code == CUDA_CODES[error], vars(e.value)
            assert f"driver call {op} failed" in str(e.value) and f"code {e.value.code}" in str(e.value)
        assert a.allocations() == []
    finally:
        a.close()


# --- the state machine with faults ----------------------------------------------------------------------------


# Driver operations each machine action is expected to reach; only a bias for where faults are armed (any
# operation may be drawn too).
ACTION_OPS = {
    "alloc": ["reserve", "create", "map", "set_access"],
    "free": ["synchronize", "unmap", "release", "free_range"],
    "write": ["synchronize", "copy_h2d", "wait"],
    "read": ["synchronize", "copy_d2h", "wait"],
    "sleep": ["synchronize", "host_register", "copy_d2h", "wait", "unmap", "release"],
    "wake_up": ["create", "map", "set_access", "copy_h2d", "memset_zero", "wait"],
    "discard": ["synchronize", "unmap", "release"],
    "pause": ["synchronize", "host_register", "copy_d2h", "wait", "unmap", "release"],
    "resume": ["create", "map", "set_access", "copy_h2d", "memset_zero", "wait"],
}


class FaultyMachine(AllocatorMachine):
    """AllocatorMachine (sim) plus armed faults; a failing call reconciles the model with the allocator."""

    backend = "sim"
    # A failed fingerprint counts its chunks as changed: fewer skips, never wrong data.
    exact_skips = False

    def __init__(self) -> None:
        super().__init__()
        self.armed: Optional[tuple[str, int]] = None  # (op, call count at which it fires)
        self.errors_seen = 0

    def _fired(self) -> bool:
        return self.armed is not None and call_counts(self.a)[self.armed[0]] >= self.armed[1]

    def _arm(self, op: str, nth: int, error: str) -> None:
        self.armed = (op, call_counts(self.a)[op] + nth)
        self.a.inject_fault(op, nth, error)

    @precondition(lambda self: self.armed is None)
    @rule(op=st.sampled_from(cumem_rs.FAULT_OPS), nth=st.integers(1, 4), error=st.sampled_from(cumem_rs.FAULT_ERRORS))
    def inject(self, op, nth, error):
        """Arm a fault that fires whenever the allocator gets there (maybe never)."""
        self._arm(op, nth, error)

    @precondition(lambda self: self.armed is None)
    @rule(action=st.sampled_from(sorted(ACTION_OPS)), data=st.data())
    def faulty_step(self, action, data):
        """Arm a fault, mostly in an operation that `action` uses, and run that action at once: without this,
        most armed faults would be cleared before any call reaches them."""
        ops = ACTION_OPS[action]
        op = data.draw(st.sampled_from(ops) | st.sampled_from(cumem_rs.FAULT_OPS), label="op")
        nth = data.draw(st.integers(1, 3), label="nth")
        self._arm(op, nth, data.draw(st.sampled_from(cumem_rs.FAULT_ERRORS), label="error"))
        if action in ("sleep", "wake_up", "discard", "pause", "resume"):
            tags = data.draw(st.one_of(st.none(), st.sampled_from(TAGS), tag_sets), label="tags")
            if action == "discard" and tags is None:
                tags = []
            getattr(self, action)(tags)
        elif action == "alloc" or (action == "free" and self._ours()) or self._ours(awake=True):
            getattr(self, action)(data)

    @precondition(lambda self: self.armed is not None)
    @rule()
    def clear(self):
        self.a.clear_faults()
        self.armed = None

    def _faulted(self, what: str, err: Exception) -> bool:
        if not self._fired():
            return False  # a failure that no fault explains is a bug
        assert self.armed is not None
        assert self.armed[0] in str(err) or isinstance(err, CumemOutOfMemoryError), err
        self.armed = None
        self._reconcile(what)
        return True

    def _reconcile(self, what: str) -> None:
        """Take over what a failed call changed, checking that it changed only what it may."""
        rows = {r["address"]: r for r in self.a.allocations()}
        assert set(rows) <= set(self.model), f"failed {what} left an allocation the model does not know"
        gone = set(self.model) - set(rows)
        assert what == "free" or not gone, f"failed {what} removed allocations {gone}"
        assert len(gone) <= 1
        for addr in gone:
            del self.model[addr]
        for addr, rec in self.model.items():
            r = rows[addr]
            if rec.asleep:
                assert r["asleep"], f"failed {what} woke {addr:#x} (wake must be transactional)"
                assert r["backed_up"] == rec.backed_up, f"failed {what} changed the backup of {addr:#x}"
            elif r["asleep"]:
                assert what in ("sleep", "pause", "discard"), f"failed {what} put {addr:#x} to sleep"
                rec.asleep, rec.backed_up = True, r["backed_up"]
                assert what != "discard" or not rec.backed_up
                if not rec.backed_up:
                    rec.forget()

    @invariant()
    def fired_faults_surface(self):
        """A fault that fired inside a call that then succeeded must have been absorbed visibly."""
        errors = len(self.a.errors())
        if self._fired():
            op = self.armed[0]  # type: ignore[index]
            # Visible means recorded in errors(), or (when it hit the retry of a queued release, which is not
            # recorded twice) that release still queued.
            assert errors > self.errors_seen or self.a.stats()["pending_releases"] > 0, (
                f"fault in {op} fired and vanished (not raised, not recorded, nothing queued)"
            )
            self.armed = None
        self.errors_seen = errors

    def _teardown_checks(self):
        self.a.clear_faults()
        self.armed = None
        # Releases that failed were queued and are retried by the next call; a no-op discard is such a call
        # (without it the last queued release would show up as a leak).
        self.a.discard([])
        super()._teardown_checks()


def test_faulty_state_machine():
    run_state_machine_as_test(machine_for("sim", FaultyMachine), settings=STATEFUL_SETTINGS)
