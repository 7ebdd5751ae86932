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
  the failures an armed fault explains and checks what each left behind. Arming is biased toward the calls the
  model says a sleep or a wake will make, and a tally of the faults fired per operation is printed per run.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule, run_state_machine_as_test

import cumem_rs
from cumem_rs import Allocator, CumemError, CumemOutOfMemoryError, DriverError
from conftest import SIM_GRANULARITY, STATEFUL_SETTINGS, call_counts, live_counts, new_sim
from test_state_machine import DEFAULT_POLICY, FAULTED, TAGS, AllocatorMachine, Rec, machine_for, tag_sets

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


# Driver operations each machine action reaches, and how often (measured on the sim). Per allocation it touches:
# a sleep's unmap and release, a raw backup's copy and pinned cell, a compressed one's blob, a wake's create, map,
# set access and restoring copy or zero fill; per device: synchronize, wait, fingerprint, compress, decompress.
# Faults are armed mostly at one of these calls, right before the action runs (`FaultyMachine._reached_ops`).
PER_ALLOCATION = {"unmap", "release", "copy_d2h", "copy_h2d", "record_marker", "host_register", "compress_blob",
                  "create", "map", "set_access", "memset_zero"}
ACTION_OPS = {
    "alloc": ["reserve", "create", "map", "set_access"],
    "free": ["synchronize", "unmap", "release", "free_range"],
    "write": ["synchronize", "copy_h2d", "wait"],
    "read": ["synchronize", "copy_d2h", "wait"],
    "discard": ["synchronize", "unmap", "release"],
}
# How often `faulty_step` picks each action: sleeps and wakes (the transactional paths) far more than the rest.
ACTION_WEIGHTS = {"sleep": 4, "pause": 3, "wake_up": 4, "resume": 3, "discard": 1, "alloc": 1, "free": 1,
                  "write": 1, "read": 1}
ACTIONS = [a for a, w in sorted(ACTION_WEIGHTS.items()) for _ in range(w)]
# The allocator calls whose faults are the point of the biasing: a run must fire some (`run_faulty`).
SLEEP_WAKE_CALLS = {"sleep", "pause", "wake_up", "resume"}


class FaultTally:
    """Faults armed and fired over one test's run (every example), per operation and per allocator call they
    fired in, raised or absorbed: what the run really exercised, printed at its end and checked for reach."""

    def __init__(self) -> None:
        self.armed: Counter[str] = Counter()
        self.fired: Counter[tuple[str, str, str]] = Counter()  # (op, call, "raised" | "absorbed")

    def fired_in(self, calls: set[str]) -> int:
        return sum(n for (_, call, _), n in self.fired.items() if call in calls)

    def table(self, title: str) -> str:
        ops = sorted(set(self.armed) | {op for op, _, _ in self.fired})
        lines = [f"{title}: {sum(self.armed.values())} faults armed, {sum(self.fired.values())} fired",
                 f"  {'op':16} {'armed':>6} {'raised':>6} {'absorbed':>8}  fired in"]
        for op in ops:
            raised = sum(n for (o, _, how), n in self.fired.items() if o == op and how == "raised")
            absorbed = sum(n for (o, _, how), n in self.fired.items() if o == op and how == "absorbed")
            where = Counter()
            for (o, call, _), n in self.fired.items():
                if o == op:
                    where[call] += n
            calls = ", ".join(f"{c} {n}" for c, n in sorted(where.items()))
            lines.append(f"  {op:16} {self.armed[op]:6} {raised:6} {absorbed:8}  {calls}")
        return "\n".join(lines)


class FaultyMachine(AllocatorMachine):
    """AllocatorMachine (sim) plus armed faults; a failing call reconciles the model with the allocator."""

    backend = "sim"
    # A failed fingerprint counts its chunks as changed: fewer skips, never wrong data.
    exact_skips = False
    #: The run's tally (a fresh one per test: see `run_faulty`).
    tally = FaultTally()

    def __init__(self) -> None:
        super().__init__()
        self.armed: Optional[tuple[str, int]] = None  # (op, call count at which it fires)
        self.errors_seen = 0
        self.last_call = ""  # the allocator call made last (where a fault that fired did)

    def _call(self, what: str, fn, *args, **kw):
        self.last_call = what
        return super()._call(what, fn, *args, **kw)

    def _fired(self) -> bool:
        return self.armed is not None and call_counts(self.a)[self.armed[0]] >= self.armed[1]

    def _arm(self, op: str, nth: int, error: str) -> None:
        self.armed = (op, call_counts(self.a)[op] + nth)
        self.a.inject_fault(op, nth, error)
        self.tally.armed[op] += 1

    @precondition(lambda self: self.armed is None)
    @rule(op=st.sampled_from(cumem_rs.FAULT_OPS), nth=st.integers(1, 4), error=st.sampled_from(cumem_rs.FAULT_ERRORS))
    def inject(self, op, nth, error):
        """Arm a fault that fires whenever the allocator gets there (maybe never)."""
        self._arm(op, nth, error)

    def _reached_ops(self, action: str, tags) -> list[tuple[str, int]]:
        """The operations `action` of `tags` will reach now, each with how many calls of it to expect, from the
        model: a sleep of nothing awake or a wake of nothing asleep reaches none, a sleep without backups no print
        or copy, one of raw backups no codec op, one of compressed backups no copy."""
        if action in ACTION_OPS:
            return [(op, 1) for op in ACTION_OPS[action]]  # one allocation, one call each
        want = None if tags is None else {tags} if isinstance(tags, str) else set(tags)
        ops: list[tuple[str, list[Rec]]] = []
        raw: list[Rec] = []
        if action in ("sleep", "pause"):
            awake = [r for r in self.model.values() if not r.asleep and (action == "sleep" or want is None
                                                                          or r.tag in want)]
            if action == "pause" or want is None:
                backed = [r for r in awake if self._backs_up(r.tag, action)]
            else:
                backed = [r for r in awake if r.tag in want]
            packed = [r for r in backed if self._compresses(r.tag)]
            raw = [r for r in backed if not self._compresses(r.tag)]
            ops = [("synchronize", awake), ("unmap", awake), ("release", awake), ("fingerprint", backed),
                   ("wait", backed), ("compress", packed), ("compress_blob", packed), ("copy_d2h", raw),
                   ("record_marker", raw), ("host_register", raw), ("thread_spawn", raw)]
        else:
            asleep = [r for r in self.model.values() if r.asleep and (want is None or r.tag in want)]
            backed = [r for r in asleep if r.backed_up]
            zeroed = [r for r in asleep if not r.backed_up
                      and self.policies.get(r.tag, DEFAULT_POLICY)["wake_fill"] == "zero"]
            ops = [("create", asleep), ("map", asleep), ("set_access", asleep), ("wait", asleep),
                   ("decompress", backed), ("copy_h2d", backed), ("fingerprint", backed), ("memset_zero", zeroed)]

        def calls(op: str, recs: list[Rec]) -> int:
            devices = len({r.device for r in recs})
            if op == "wait":  # the prints' wait per device, then the copies' (a raw sleep: one per cell)
                return 2 * devices + (len(raw) if action in ("sleep", "pause") else 0)
            return len(recs) if op in PER_ALLOCATION else devices

        return [(op, calls(op, recs)) for op, recs in ops if recs]

    def _compresses(self, tag: str) -> bool:
        return self.policies.get(tag, DEFAULT_POLICY).get("compress", "auto") != "off"

    def _arm_for(self, action: str, data, tags=None) -> None:
        """Arm a fault, mostly (7 in 8) at one of the calls `action` (of `tags`) will make, else anywhere."""
        reached = self._reached_ops(action, tags)
        if reached and data.draw(st.integers(0, 7), label="any op") > 0:
            op, calls = data.draw(st.sampled_from(reached), label="op")
            nth = data.draw(st.integers(1, min(calls, 6)), label="nth")
        else:
            op = data.draw(st.sampled_from(cumem_rs.FAULT_OPS), label="op")
            nth = data.draw(st.integers(1, 3), label="nth")
        self._arm(op, nth, data.draw(st.sampled_from(cumem_rs.FAULT_ERRORS), label="error"))

    def _settle(self) -> None:
        """After an action: a fault it fired was raised (and taken over) or absorbed visibly; one it did not reach
        is cleared, so that the next is armed alone."""
        self.fired_faults_surface()
        if self.armed is not None:
            self.a.clear_faults()
            self.armed = None

    @rule(action=st.sampled_from(ACTIONS), data=st.data())
    def faulty_step(self, action, data):
        """Arm a fault, mostly in an operation that `action` uses, and run that action at once: without this,
        most armed faults would be cleared before any call reaches them. A fault `inject` armed and no call has
        reached yet is cleared first (one at a time), so that it does not hold these steps off."""
        self._settle()
        if action in ("sleep", "wake_up", "discard", "pause", "resume"):
            tags = data.draw(st.one_of(st.none(), st.sampled_from(TAGS), tag_sets), label="tags")
            if action == "discard" and tags is None:
                tags = []
            self._arm_for(action, data, tags)
            getattr(self, action)(tags)
            return
        self._arm_for(action, data)
        if action == "alloc" or (action == "free" and self._ours()) or self._ours(awake=True):
            getattr(self, action)(data)

    @precondition(lambda self: self._ours())
    @rule(data=st.data(), rounds=st.integers(1, 3), raw=st.sampled_from([None, True, False]),
          retain=st.sampled_from([None, True, False]))
    def faulty_cycle(self, data, rounds, raw, retain):
        """Rounds of: everything woken (no fault), a byte of each allocation written (so that retained backups
        have a changed chunk to copy), a sleep or pause with a fault armed in it, a wake or resume of everything
        with another. The transactional paths with real work to do (most of the machine's other steps find
        little awake), where a lost backup or a half-done wake would show. `raw`: first every tag backs up raw
        (True) or compressed (False), or as it was (None); `retain`: wakes retain backups (True: sleeps copy only
        changed chunks), not (False: every sleep backs up afresh), or as before (None)."""
        self._settle()
        if raw is not None:
            for tag in TAGS:
                self.set_raw(tag, raw)
        if retain is not None:
            self.a.set_retain_backups(retain)
        for _ in range(rounds):
            self._wake_and_touch(data)
            pause = data.draw(st.booleans(), label="pause")
            offload = self._draw_offload(data)
            self._arm_for("pause" if pause else "sleep", data, offload)
            (self.pause if pause else self.sleep)(offload)
            self._settle()
            if any(r.asleep for r in self.model.values()):
                self._arm_for("resume" if pause else "wake_up", data)
                (self.resume if pause else self.wake_up)(None)
                self._settle()

    def _wake_and_touch(self, data) -> None:
        """Wake everything (no fault armed), then write a byte of each allocation: the next sleep has work to do,
        retained backups included (a changed chunk to copy)."""
        if any(r.asleep for r in self.model.values()):
            self.wake_up(None)
        value = data.draw(st.integers(0, 255), label="byte")
        for rec in self._ours(awake=True):
            off = (value * 4099) % rec.requested
            if self._call("write", self.a.write, rec.address + off, bytes([value])) is not FAULTED:
                rec.data[off], rec.known[off], rec.dirty = value, True, True

    def _draw_offload(self, data):
        """Tags to offload: mostly (2 in 3) every tag there is, so that a sleep has backups to make, else the
        policies' (None) or any."""
        if data.draw(st.integers(0, 2), label="offload all") > 0:
            return sorted({r.tag for r in self._ours()})
        return data.draw(st.one_of(st.none(), st.sampled_from(TAGS), tag_sets), label="offload")

    @rule(tag=st.sampled_from(TAGS), raw=st.booleans())
    def set_raw(self, tag, raw):
        """Switch a tag between compressed ("auto") and raw ("off") host backups, so that faults reach the codec's
        ops and the raw path's copies, pinning and markers alike."""
        p = {k: v for k, v in self.policies.get(tag, DEFAULT_POLICY).items() if k != "compress"}
        self.a.set_tag_policy(tag, p["backup"], p["wake_fill"], compress="off" if raw else "auto")
        if raw:
            p["compress"] = "off"
        self.policies[tag] = p

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
        self.tally.fired[(self.armed[0], what, "raised")] += 1
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
                # What a failed sleep or pause released has exactly the backup the call owed it: one owed and
                # missing is data lost, one not owed a backup its policy does not give.
                owed = what != "discard" and addr in self.backing
                assert r["backed_up"] == owed, (
                    f"failed {what} put {addr:#x} ({rec.tag}) to sleep "
                    + ("without its backup: its data is lost" if owed else "with a backup it was not owed")
                )
                rec.asleep, rec.backed_up, rec.retained = True, owed, False
                if not owed:
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
            self.tally.fired[(op, self.last_call, "absorbed")] += 1
            self.armed = None
        self.errors_seen = errors

    def _teardown_checks(self):
        self.a.clear_faults()
        self.armed = None
        # Releases that failed were queued and are retried by the next call; a no-op discard is such a call
        # (without it the last queued release would show up as a leak).
        self.a.discard([])
        super()._teardown_checks()


def run_faulty(machine: type, title: str, settings=STATEFUL_SETTINGS) -> FaultTally:
    """Run a FaultyMachine class with a fresh tally; print the tally (pytest -s shows it), check that the run
    fired faults in sleeps, pauses, wakes and resumes (one per four examples at least), and return it."""
    machine.tally = FaultTally()
    run_state_machine_as_test(machine, settings=settings)
    print("\n" + machine.tally.table(title))
    fired = machine.tally.fired_in(SLEEP_WAKE_CALLS)
    print(f"{title}: {fired} faults fired in sleeps and wakes")
    # Measured: 20-150 per 20 examples, 300-800 per 200; before the biasing, 10-20 per 200.
    assert fired >= settings.max_examples // 4, (
        f"{title}: only {fired} faults fired in sleeps and wakes over {settings.max_examples} examples"
    )
    return machine.tally


def test_faulty_state_machine():
    run_faulty(machine_for("sim", FaultyMachine), "FaultyMachine")
