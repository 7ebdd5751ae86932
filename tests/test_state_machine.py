"""The allocator against a model: one hypothesis RuleBasedStateMachine, run on every backend.

The model keeps, per allocation, what the allocator must agree with (address, sizes, device, tag, asleep,
backed up) and which bytes we know (written by us and not since discarded), plus the tag policies. Rules drive
alloc / free / write / read / tag switches / sleep / wake / discard / pause / resume / policy changes; invariants
after every step compare the allocator's own view (`allocations()`, `usage()`, `status()`, and on the simulated
driver `driver_counts()`) with the model.

`test_faults.py` subclasses `AllocatorMachine` to add fault injection; the `_faulted` hook below is where a
failing call is handed to it (here, every unexpected error fails the test).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import cumem_rs
from conftest import BACKENDS, STATEFUL_SETTINGS, allocator_for, live_counts

TAGS = ["weights", "kv_cache", "default", "other"]
tag_sets = st.lists(st.sampled_from(TAGS), unique=True, max_size=len(TAGS))
DEFAULT_POLICY = {"backup": None, "wake_fill": "undefined"}


@dataclass(eq=False)  # identity: records hold numpy arrays
class Rec:
    """Model of one live allocation."""

    address: int
    size: int  # rounded to the granularity: what is mapped while awake
    requested: int
    device: int
    tag: str
    asleep: bool = False
    backed_up: bool = False
    # Content we can vouch for: data[i] is meaningful where known[i].
    data: np.ndarray = field(default=None)  # type: ignore[assignment]
    known: np.ndarray = field(default=None)  # type: ignore[assignment]
    foreign: bool = False  # cuda only: existed before the test; never freed by us, content unknown
    retained: bool = False  # awake with the backup its wake restored from still bound to it
    dirty: bool = False  # written since that wake (a retained backup must copy at least those chunks again)
    packed: bool = False  # its last backup was made compressed (its tag's policy compressed then)
    surely_packed: bool = False  # ... and no codec can have stored it raw (see CompressingMachine._released)

    def __post_init__(self) -> None:
        if self.data is None:
            self.data = np.zeros(self.requested, dtype=np.uint8)
            self.known = np.zeros(self.requested, dtype=bool)

    def forget(self) -> None:
        self.known[:] = False


FAULTED = object()  # returned by _call when a failure was accepted by the `_faulted` hook


class AllocatorMachine(RuleBasedStateMachine):
    backend = "sim"
    #: Sleep reports must skip every unchanged retained chunk (fault injection may turn fingerprints off).
    exact_skips = True

    def __init__(self) -> None:
        super().__init__()
        self._cm = allocator_for(self.backend)
        self.a = self._cm.__enter__()
        self.sim = self.a.backend == "sim"
        self.ndev = self.a.device_count() if self.sim else 1
        self.gran = [self.a.granularity(d) for d in range(self.ndev)]
        self.capacity = [self.a.mem_info(d)[1] for d in range(self.ndev)]
        self.model: dict[int, Rec] = {}
        # Addresses the sleep or pause under way must back up (for `_faulted`: what a failed one may leave).
        self.backing: set[int] = set()
        self.tag_stack: list[str] = []
        # Several fingerprint chunks per allocation, so that writes to part of one skip the rest.
        self.a.set_fingerprint_chunk(self.gran[0] // 4)
        # On the process-wide CUDA allocator other code may own allocations: they take part in sleep/wake like
        # ours (so the model must know them) but are never freed here.
        for r in self.a.allocations():
            rec = self._rec_from_row(r)
            rec.foreign = True
            self.model[rec.address] = rec
        # Policies of the tags we use and of the foreign allocations' tags, as found (the CUDA allocator is
        # process-wide: those of our tags are restored at teardown).
        tags = set(TAGS) | {r.tag for r in self.model.values()}
        self.policies: dict[str, dict] = {t: self.a.tag_policy(t) for t in tags}
        self.found_policies = {t: self.policies[t] for t in TAGS}
        self.found_group_bytes = self.a.wake_group_bytes

    # --- plumbing ---------------------------------------------------------------------------------------------

    @staticmethod
    def _rec_from_row(r: dict) -> Rec:
        return Rec(
            address=r["address"],
            size=r["size"],
            requested=r["requested"],
            device=r["device"],
            tag=r["tag"],
            asleep=r["asleep"],
            backed_up=r["backed_up"],
        )

    def _call(self, what: str, fn: Callable, *args, **kw):
        """Run one allocator call; a CumemError goes to `_faulted`, which may accept it (returns FAULTED)."""
        try:
            return fn(*args, **kw)
        except cumem_rs.CumemError as e:
            if self._faulted(what, e):
                return FAULTED
            raise

    def _faulted(self, what: str, err: Exception) -> bool:
        """Without fault injection every failure is a bug."""
        return False

    def _current_tag(self) -> str:
        return self.tag_stack[-1] if self.tag_stack else "default"

    def _model_usage(self, device: int) -> int:
        return sum(r.size for r in self.model.values() if r.device == device and not r.asleep)

    def _ours(self, awake: Optional[bool] = None) -> list[Rec]:
        return [
            r
            for _, r in sorted(self.model.items())
            if not r.foreign and (awake is None or r.asleep != awake)
        ]

    def _read_all(self, rec: Rec):
        """The whole allocation as a uint8 array, or None when an injected fault made the read fail."""
        got = self._call("read", self.a.read, rec.address, rec.requested)
        return None if got is FAULTED else np.frombuffer(got, dtype=np.uint8)

    def _verify_known(self, rec: Rec) -> None:
        """Read the whole allocation and compare every byte the model knows."""
        got = self._read_all(rec)
        if got is None:
            return  # the model still knows the bytes; a later read or the teardown checks them
        bad = np.flatnonzero(rec.known & (got != rec.data))
        assert bad.size == 0, (
            f"allocation {rec.address:#x} ({rec.tag}): {bad.size} known bytes differ, first at offset "
            f"{bad[0]}: got {got[bad[0]]:#x}, expected {rec.data[bad[0]]:#x}"
        )

    def _pick(self, data, recs: list[Rec]) -> Rec:
        return data.draw(st.sampled_from(recs), label="allocation")

    # --- rules ------------------------------------------------------------------------------------------------

    @rule(data=st.data())
    def alloc(self, data):
        device = data.draw(st.integers(0, self.ndev - 1), label="device")
        g = self.gran[device]
        size = data.draw(st.integers(1, 4 * g), label="size")
        rounded = -(-size // g) * g
        # The simulated device has a hard capacity, so whether this fits is known exactly.
        expect_oom = self.sim and rounded > self.capacity[device] - self._model_usage(device)
        try:
            addr = self._call("malloc", self.a.malloc, size, device)
        except cumem_rs.CumemOutOfMemoryError as e:
            assert expect_oom, f"unexpected OOM for {size} bytes on device {device}: {e}"
            return
        if addr is FAULTED:
            return
        assert not expect_oom, f"malloc of {rounded} bytes succeeded beyond the capacity of device {device}"
        assert addr not in self.model, f"malloc returned the live address {addr:#x} again"
        # torch's caching allocator relies on CUDA's 256-byte alignment (reservations are far more aligned).
        assert addr % 256 == 0, f"address {addr:#x} is not 256-byte aligned"
        self.model[addr] = Rec(addr, rounded, size, device, self._current_tag())

    @precondition(lambda self: self._ours())
    @rule(data=st.data())
    def free(self, data):
        rec = self._pick(data, self._ours())
        if self._call("free", self.a.free, rec.address) is FAULTED:
            return
        del self.model[rec.address]

    @precondition(lambda self: self._ours(awake=True))
    @rule(data=st.data())
    def write(self, data):
        rec = self._pick(data, self._ours(awake=True))
        payload = data.draw(st.binary(min_size=1, max_size=min(512, rec.requested)), label="bytes")
        off = data.draw(st.integers(0, rec.requested - len(payload)), label="offset")
        if self._call("write", self.a.write, rec.address + off, payload) is FAULTED:
            rec.known[off : off + len(payload)] = False  # a failed write may have copied part or all of it
            return
        rec.data[off : off + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        rec.known[off : off + len(payload)] = True
        rec.dirty = True

    @precondition(lambda self: self._ours(awake=True))
    @rule(data=st.data(), value=st.integers(0, 255))
    def write_last_byte(self, data, value):
        """The last byte of an allocation (its last fingerprint chunk, often a short one)."""
        rec = self._pick(data, self._ours(awake=True))
        off = rec.requested - 1
        if self._call("write", self.a.write, rec.address + off, bytes([value])) is FAULTED:
            rec.known[off] = False
            return
        rec.data[off], rec.known[off], rec.dirty = value, True, True

    @precondition(lambda self: self._ours(awake=True))
    @rule(data=st.data())
    def rewrite_same(self, data):
        """Write back what is already there: a change-free write must never make a sleep lose data."""
        rec = self._pick(data, self._ours(awake=True))
        off = data.draw(st.integers(0, rec.requested - 1), label="offset")
        n = data.draw(st.integers(1, min(256, rec.requested - off)), label="length")
        got = self._call("read", self.a.read, rec.address + off, n)
        if got is FAULTED:
            return
        if self._call("write", self.a.write, rec.address + off, got) is FAULTED:
            rec.known[off : off + n] = False
            return
        rec.dirty = True

    @precondition(lambda self: len(self._ours(awake=True)) >= 2)
    @rule(data=st.data())
    def copy_between(self, data):
        """Copy bytes from one allocation into another (as a weight sync would), same offsets."""
        src, dst = data.draw(st.permutations(self._ours(awake=True)), label="pair")[:2]
        n = data.draw(st.integers(1, min(src.requested, dst.requested, 4096)), label="length")
        got = self._call("read", self.a.read, src.address, n)
        if got is FAULTED:
            return
        if self._call("write", self.a.write, dst.address, got) is FAULTED:
            dst.known[:n] = False
            return
        dst.data[:n] = np.frombuffer(got, dtype=np.uint8)
        dst.known[:n] = src.known[:n]
        dst.dirty = True

    @precondition(lambda self: self._ours(awake=True))
    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def fill(self, data, seed):
        """Write the whole allocation, so that sleep/wake checks cover every byte, not just a few."""
        rec = self._pick(data, self._ours(awake=True))
        payload = np.random.default_rng(seed).integers(0, 256, rec.requested, dtype=np.uint8)
        if self._call("write", self.a.write, rec.address, payload.tobytes()) is FAULTED:
            rec.forget()  # a failed write may have copied part or all of it
            return
        rec.data[:] = payload
        rec.known[:] = True
        rec.dirty = True

    @precondition(lambda self: self._ours(awake=True))
    @rule(data=st.data())
    def read(self, data):
        rec = self._pick(data, self._ours(awake=True))
        off = data.draw(st.integers(0, rec.requested - 1), label="offset")
        n = data.draw(st.integers(1, rec.requested - off), label="length")
        got = self._call("read", self.a.read, rec.address + off, n)
        if got is FAULTED:
            return
        assert isinstance(got, bytes) and len(got) == n
        got_arr = np.frombuffer(got, dtype=np.uint8)
        known = rec.known[off : off + n]
        assert np.array_equal(got_arr[known], rec.data[off : off + n][known]), (
            f"read of {n} bytes at {rec.address:#x}+{off} does not match what was written"
        )

    @rule(tag=st.sampled_from(TAGS))
    def push_tag(self, tag):
        self.a.push_tag(tag)
        self.tag_stack.append(tag)

    @precondition(lambda self: self.tag_stack)
    @rule()
    def pop_tag(self):
        assert self.a.pop_tag() == self.tag_stack.pop()

    def _backs_up(self, tag: str, call: str) -> bool:
        """Whether a release by `call` ("pause", or "sleep" without tags) backs `tag` up, per its policy."""
        backup = self.policies.get(tag, DEFAULT_POLICY)["backup"]
        if backup is not None:
            return backup
        return call == "pause" or tag == "default"

    def _released(self, report, awake: list[Rec], backed: list[Rec]) -> None:
        """Check a sleep/pause report against the model and take over its effect."""
        dropped = [r for r in awake if r not in backed]
        # Backed up = copied now + skipped as unchanged; only retained backups may skip anything.
        assert report["copied_bytes"] + report["skipped_bytes"] == sum(r.size for r in backed), report
        assert report["skipped_bytes"] <= sum(r.size for r in backed if r.retained), report
        if self.exact_skips:
            clean = sum(r.size for r in backed if r.retained and not r.dirty and self._keeps_retained(r))
            assert report["skipped_bytes"] >= clean, f"unchanged retained backups were copied again: {report}"
        assert report["discarded_bytes"] == sum(r.size for r in dropped), report
        assert report["allocations"] == len(awake), report
        for r in backed:
            r.asleep, r.backed_up = True, True
        for r in dropped:
            r.asleep, r.backed_up = True, False
            r.forget()
        for r in awake:
            r.retained = r.dirty = False

    def _keeps_retained(self, r: Rec) -> bool:
        """Whether a sleep uses `r`'s retained backup (skipping its unchanged chunks)."""
        return True

    @rule(offload=st.one_of(st.none(), st.sampled_from(TAGS), tag_sets))
    def sleep(self, offload):
        # None: call without the argument (each tag per its policy, "default" without one); a str is one tag; a
        # list is a set of tags.
        awake = [r for r in self.model.values() if not r.asleep]
        if offload is None:
            backed = [r for r in awake if self._backs_up(r.tag, "sleep")]
        else:
            tags = {offload} if isinstance(offload, str) else set(offload)
            backed = [r for r in awake if r.tag in tags]
        self.backing = {r.address for r in backed}
        if offload is None:
            report = self._call("sleep", self.a.sleep)
        else:
            report = self._call("sleep", self.a.sleep, offload)
        if report is FAULTED:
            return
        self._released(report, awake, backed)

    @rule(tags=st.one_of(st.none(), st.sampled_from(TAGS), tag_sets))
    def pause(self, tags):
        want = None if tags is None else {tags} if isinstance(tags, str) else set(tags)
        awake = [r for r in self.model.values() if not r.asleep and (want is None or r.tag in want)]
        backed = [r for r in awake if self._backs_up(r.tag, "pause")]
        self.backing = {r.address for r in backed}
        report = self._call("pause", self.a.pause, tags)
        if report is FAULTED:
            return
        self._released(report, awake, backed)

    @rule(tag=st.sampled_from(TAGS), backup=st.sampled_from([None, True, False]),
          wake_fill=st.sampled_from(["undefined", "zero"]))
    def set_policy(self, tag, backup, wake_fill):
        self.a.set_tag_policy(tag, backup, wake_fill)
        self.policies[tag] = {"backup": backup, "wake_fill": wake_fill}

    @rule(units=st.sampled_from([0, 1, 2, 4, 16]))
    def set_wake_group_bytes(self, units):
        # Later wakes group neighbours differently (0: no groups); contents and accounting must not care.
        self.a.set_wake_group_bytes(units * self.gran[0])

    @rule(tags=st.one_of(st.none(), st.sampled_from(TAGS), tag_sets))
    def wake_up(self, tags):
        self._wake("wake_up", self.a.wake_up, tags)

    @rule(tags=st.one_of(st.none(), st.sampled_from(TAGS), tag_sets))
    def resume(self, tags):
        self._wake("resume", self.a.resume, tags)

    def _wake(self, what: str, fn: Callable, tags) -> None:
        """wake_up and resume: the same all-or-nothing wake of exactly `tags` (None: all)."""
        want = None if tags is None else {tags} if isinstance(tags, str) else set(tags)
        woken = [r for r in self.model.values() if r.asleep and (want is None or r.tag in want)]
        need = [sum(r.size for r in woken if r.device == d) for d in range(self.ndev)]
        expect_oom = self.sim and any(
            need[d] > self.capacity[d] - self._model_usage(d) for d in range(self.ndev)
        )
        try:
            report = self._call(what, fn, tags)
        except cumem_rs.CumemOutOfMemoryError as e:
            assert expect_oom, f"unexpected OOM at {what}: {e}"
            return  # transactional: the model (all still asleep, backups kept) stays right
        if report is FAULTED:
            return
        assert not expect_oom, f"{what} mapped more than the device capacity"
        restored = [r for r in woken if r.backed_up]
        zeroed = [
            r for r in woken if not r.backed_up and self.policies.get(r.tag, DEFAULT_POLICY)["wake_fill"] == "zero"
        ]
        assert report["allocations"] == len(woken), report
        assert report["copied_bytes"] == sum(r.size for r in restored), report
        assert report["discarded_bytes"] == sum(r.size for r in woken if not r.backed_up), report
        assert report["zeroed_bytes"] == sum(r.size for r in zeroed), report
        retaining = self.a.retains_backups()
        for r in woken:
            r.retained, r.dirty = retaining and r.backed_up, False
            r.asleep, r.backed_up = False, False
        for r in zeroed:
            r.data[:] = 0  # promised on every backend: known from now on, like written bytes
            r.known[:] = True
        for r in woken:
            if r in restored or r in zeroed:
                self._verify_known(r)
            elif self.sim and not r.foreign:
                # The simulator promises poison for discarded memory, never silent zeros.
                got = self._read_all(r)
                assert got is None or got.any(), f"discarded {r.address:#x} came back all zero"

    @rule(tags=st.one_of(st.sampled_from(TAGS), tag_sets))
    def discard(self, tags):
        want = {tags} if isinstance(tags, str) else set(tags)
        hit = [r for r in self.model.values() if not r.asleep and r.tag in want]
        if self._call("discard", self.a.discard, tags) is FAULTED:
            return
        for r in hit:
            r.asleep, r.backed_up, r.retained = True, False, False
            r.forget()

    # --- invariants -------------------------------------------------------------------------------------------

    @invariant()
    def registry_matches_model(self):
        rows = {r["address"]: r for r in self.a.allocations()}
        assert set(rows) == set(self.model), (
            f"allocations() has {sorted(set(rows) - set(self.model))} extra, "
            f"{sorted(set(self.model) - set(rows))} missing"
        )
        for addr, rec in self.model.items():
            r = rows[addr]
            assert (r["size"], r["requested"], r["device"], r["tag"], r["asleep"]) == (
                rec.size,
                rec.requested,
                rec.device,
                rec.tag,
                rec.asleep,
            ), f"allocation {addr:#x}: allocator says {r}, model says {rec}"
            if rec.asleep:
                assert r["backed_up"] == rec.backed_up, f"allocation {addr:#x}: backed_up {r}"

    @invariant()
    def no_overlap(self):
        spans = sorted((r["address"], r["size"]) for r in self.a.allocations())
        for (a0, s0), (a1, _) in zip(spans, spans[1:]):
            assert a0 + s0 <= a1, f"allocations overlap: [{a0:#x}, +{s0:#x}) and {a1:#x}"

    @invariant()
    def usage_matches_model(self):
        total = 0
        for d in range(self.ndev):
            want = self._model_usage(d)
            total += want
            assert self.a.usage(d) == want, f"usage({d}) = {self.a.usage(d)}, model says {want}"
        if self.sim:
            assert self.a.usage() == total
            mapped = live_counts(self.a)["mapped_bytes"]
            unreturned = self.a.stats()["unreturned_bytes"]
            assert mapped == total + unreturned, f"driver maps {mapped} bytes, registry says {total} + {unreturned}"
        s = self.a.stats()
        if total == 0:
            assert s["unreturned_bytes"] == 0, "a wake group outlived its last awake member"
        assert s["unreturned_bytes"] == 0 or s["wake_groups"] > 0, s

    @invariant()
    def status_matches_model(self):
        status = self.a.status()
        tags = status["tags"]
        assert status["is_sleeping"] == any(r.asleep for r in self.model.values()), status
        for tag in {r.tag for r in self.model.values()} | set(TAGS):
            recs = [r for r in self.model.values() if r.tag == tag]
            if not recs and tag not in tags:
                assert self.policies[tag] == DEFAULT_POLICY, f"policy of {tag!r} missing from status()"
                continue
            t = dict(tags[tag])
            # Retained backups of awake allocations count as backup bytes held; the model knows them exactly on
            # the simulated device without fault injection (not for other code's allocations on CUDA).
            retained = t.pop("retained_bytes")
            t["backup_bytes"] -= retained
            if self.sim and self.exact_skips:
                assert retained == sum(r.size for r in recs if r.retained), f"retained bytes of {tag!r}: {retained}"
            mapped = sum(r.size for r in recs if not r.asleep)
            asleep = sum(r.size for r in recs if r.asleep)
            want = {
                "allocations": len(recs),
                "mapped_bytes": mapped,
                "asleep_bytes": asleep,
                "backup_bytes": sum(r.size for r in recs if r.asleep and r.backed_up),
                "state": "awake" if not asleep else "asleep" if not mapped else "mixed",
                **self.policies.get(tag, DEFAULT_POLICY),
            }
            assert t == want, f"status of {tag!r}: allocator says {t}, model says {want}"

    @invariant()
    def retained_backups_match_model(self):
        if not self.exact_skips:
            return
        want = [r for r in self._ours() if r.retained]
        s = self.a.stats()
        if self.sim:
            assert s["retained_allocations"] == len(want), f"{s['retained_allocations']} retained, model {len(want)}"

    @invariant()
    def tag_matches_model(self):
        assert self.a.current_tag() == self._current_tag()

    # --- teardown ---------------------------------------------------------------------------------------------

    def teardown(self):
        try:
            while self.tag_stack:
                assert self.a.pop_tag() == self.tag_stack.pop()
            self._teardown_checks()
        finally:
            try:
                if not self.a.closed:
                    self.a.set_fingerprint_chunk(2 << 20)
                    self.a.set_wake_group_bytes(self.found_group_bytes)
                    for tag, p in self.found_policies.items():
                        self.a.set_tag_policy(tag, p["backup"], p["wake_fill"])
            finally:
                self._cm.__exit__(None, None, None)

    def _teardown_checks(self):
        # Wake everything (also other code's allocations on CUDA, leaving them as we found them) and check that
        # what was offloaded came back.
        if any(r.asleep for r in self.model.values()):
            self.a.wake_up(None)
            for rec in self.model.values():
                if rec.asleep and rec.backed_up:
                    self._verify_known(rec)
                rec.asleep = False
        for rec in self._ours():
            self.a.free(rec.address)
            del self.model[rec.address]
        if not self.sim:
            return
        assert self.a.allocations() == []
        assert self.a.usage() == 0
        c = live_counts(self.a)
        assert (c["ranges"], c["handles"], c["mapped_bytes"]) == (0, 0, 0), f"leak after freeing all: {c}"
        self.a.trim_host()
        c = live_counts(self.a)
        assert (c["host_registered"], c["host_allocated"]) == (0, 0), f"host memory held after trim_host: {c}"
        assert self.a.host_bytes() == 0


def machine_for(backend: str, base: type = AllocatorMachine) -> type:
    """The machine class bound to one backend (hypothesis builds the machine with no arguments)."""
    return type(f"{base.__name__}_{backend}", (base,), {"backend": backend})


@pytest.mark.parametrize("backend", BACKENDS)
def test_allocator_state_machine(backend):
    run_state_machine_as_test(machine_for(backend), settings=STATEFUL_SETTINGS)


# --- compression ---------------------------------------------------------------------------------------------------
# The simulated driver compresses backed-up tags by default ("auto"), so the machine above runs with compression
# on. The variants below switch each tag's mode between steps (raw and compressed backups mixed in one sleep,
# retained compressed backups across mode changes), and keep the raw path covered with every tag "off".

COMPRESS_MODES = ["auto", "off", "bits16", "bits8", "bytes"]


class CompressingMachine(AllocatorMachine):
    @rule(tag=st.sampled_from(TAGS), mode=st.sampled_from(COMPRESS_MODES))
    def set_compress(self, tag, mode):
        p = {k: v for k, v in self.policies.get(tag, DEFAULT_POLICY).items() if k != "compress"}
        self.a.set_tag_policy(tag, p["backup"], p["wake_fill"], compress=mode)
        if mode != "auto":
            p["compress"] = mode
        self.policies[tag] = p

    @precondition(lambda self: self._ours())
    @rule(mode=st.sampled_from(COMPRESS_MODES))
    def sleep_all_in_mode(self, mode):
        """Every tag switched to `mode`, everything woken, every tag there is offloaded: a sleep whose backups
        are all of one mode, fresh where the mode changed from or to "off" (a retained backup of the other kind
        is not reused), so that each mode's backups are asleep often enough for the byte counts to tell."""
        for tag in TAGS:
            self.set_compress(tag, mode)
        if any(r.asleep for r in self.model.values()):
            self.wake_up(None)
        self.sleep(sorted({r.tag for r in self.model.values()}))

    def _compressing(self, tag: str) -> bool:
        return self.policies.get(tag, DEFAULT_POLICY).get("compress", "auto") != "off"

    def _keeps_retained(self, r: Rec) -> bool:
        # A retained compressed backup of a tag that no longer compresses is dropped: the sleep copies it raw.
        return not r.packed or self._compressing(r.tag)

    def _released(self, report, awake, backed) -> None:
        fresh = {id(r): not r.retained for r in backed}  # before the base clears `retained`
        super()._released(report, awake, backed)
        for r in backed:
            r.packed = self._compressing(r.tag)
            # A fresh backup (no retained one reused, which may be raw) of a tag that compresses, whose last quarter
            # or more is never written (poison, or zeros after a zero-filled wake): its chunks there always shrink,
            # so it is never stored all raw nor skipped as incompressible later.
            r.surely_packed = r.packed and fresh[id(r)] and (r.size - r.requested) * 4 >= r.size

    @invariant()
    def compressed_bytes_add_up(self):
        """The host tier's bytes against the model: every backup asleep is there at its size; the compressed ones
        at most those of tags that compressed at their sleep (an "off" tag's data stored compressed fails), at
        least those that surely shrank (a codec that silently stores everything raw fails)."""
        s = self.a.stats()
        backed = [r for r in self.model.values() if r.asleep and r.backed_up]
        assert s["host_tier_bytes"] == sum(r.size for r in backed), s
        packed = sum(r.size for r in backed if r.packed)
        surely = sum(r.size for r in backed if r.surely_packed)
        assert surely <= s["compressed_raw_bytes"] <= packed, (
            f"compressed backups of {s['compressed_raw_bytes']} raw bytes; the model says {surely} to {packed}"
        )
        assert s["compressed_bytes"] <= s["host_tier_stored_bytes"], s
        # Raw host backups take their raw size.
        raw_stored = s["host_tier_stored_bytes"] - s["compressed_bytes"]
        assert raw_stored == s["host_tier_bytes"] - s["compressed_raw_bytes"], s


class RawMachine(AllocatorMachine):
    """Every tag with compress="off": the raw backups' path, as on a GPU without nvCOMP."""

    def __init__(self) -> None:
        super().__init__()
        for tag in TAGS:
            self._set(tag, None, "undefined")

    def _set(self, tag, backup, wake_fill):
        self.a.set_tag_policy(tag, backup, wake_fill, compress="off")
        self.policies[tag] = {"backup": backup, "wake_fill": wake_fill, "compress": "off"}

    @rule(tag=st.sampled_from(TAGS), backup=st.sampled_from([None, True, False]),
          wake_fill=st.sampled_from(["undefined", "zero"]))
    def set_policy(self, tag, backup, wake_fill):
        self._set(tag, backup, wake_fill)

    @invariant()
    def nothing_is_compressed(self):
        assert self.a.stats()["compressed_bytes"] == 0


@pytest.mark.parametrize("base", [CompressingMachine, RawMachine], ids=["compress-modes", "raw"])
def test_allocator_state_machine_compression(base):
    run_state_machine_as_test(machine_for("sim", base), settings=STATEFUL_SETTINGS)
