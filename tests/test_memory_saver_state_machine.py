"""A hypothesis state machine for `cumem_rs.memory_saver` (torch_memory_saver's API) against a model.

Rules: allocate in a region of a tag with no backup, CPU backup or disk backup; write; pause and resume a tag
(or every tag, or one never used); turn `retain_cpu_backup` on and off; `get_cpu_backup` as a copy and as a
zero-copy view; write through a view; drop views; free. The model keeps each allocation's bytes, whether it is paused, and the
content of its backup while one exists (paused, or retained after a resume with retain_cpu_backup); the
allocator's `keep_host_memory` and a pending "off" (False takes effect at the next resume, as there).

Invariants after every step: the awake bytes, the paused flags, `retain_cpu_backup`, every zero-copy view (it
shows the backup while the backup stays where the view is, and the bytes as they were once it moved or went),
and on the simulated device the disk backup files (one per allocation with a backup in a file), the retained
count and the host memory given back when nothing is kept.

On the simulated device the saver runs over `SimulatedPools` (hook_mode "torch": the only one without a GPU;
preload mode routes cudaMalloc of torch's allocator, which the simulated device has not got). With a GPU the same
machine runs with torch tensors in hook_mode "torch" over the process-wide allocator (preload mode needs a process
started inside `configure_subprocess()`, see test_memory_saver_cuda.py). Tags never contain "[" (the saver's
own names for a second backup setting of a tag use it).
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

import pytest

torch = pytest.importorskip("torch")

from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cumem_rs import Allocator, CumemError  # noqa: E402
from cumem_rs._sim_pools import SimulatedPools  # noqa: E402
from cumem_rs.memory_saver import TorchMemorySaver  # noqa: E402
from conftest import BACKENDS, STATEFUL_SETTINGS  # noqa: E402

MiB = 1 << 20
GRAN = 64 << 10
TAGS = ["w", "kv", "g"]
BACKUPS = ["none", "cpu", "cpu", "disk"]  # CPU backup twice as often: the views and retained backups need it
# Small and uneven sizes: a part of a granule, more than one granule with a tail, an exact granule.
SIZES = [4096, 100_000, 3 * GRAN + 17, GRAN]
MAX_ALLOCS = 8

_example = itertools.count()


def _random_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _bytes_of(t: "torch.Tensor") -> bytes:
    """The bytes of CPU tensor `t`, read where they lie."""
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


class SimMemory:
    """Allocations of a saver over a simulated device: `Allocator.malloc` inside a region, by address."""

    def __init__(self) -> None:
        self.sim = Allocator.simulated(devices=1, capacity=64 * MiB, granularity=GRAN)
        self.saver = TorchMemorySaver(_backend=SimulatedPools(self.sim))
        self.native = self.sim
        self.prefix = ""

    def alloc(self, n: int) -> int:
        return self.sim.malloc(n)

    def address(self, h: int) -> int:
        return h

    def write(self, h: int, offset: int, data: bytes) -> None:
        self.sim.write(h + offset, data)

    def read(self, h: int, n: int) -> bytes:
        return self.sim.read(h, n)

    def backup(self, h: int, n: int, zero_copy: bool) -> Optional["torch.Tensor"]:
        # A paused allocation here is an address, not a CUDA tensor: the body of get_cpu_backup below its checks.
        return self.saver._cpu_backup(h, n, torch.uint8, (n,), zero_copy)

    def free(self, h: int) -> None:
        self.sim.free(h)

    def close(self) -> None:
        self.sim.close()


class CudaMemory:
    """Torch tensors made in regions of a saver in hook_mode "torch" over the process-wide allocator. Each example
    uses tags of its own (the allocator and torch's pools outlive the example)."""

    def __init__(self) -> None:
        from cumem_rs.allocator import CuMemAllocator

        self.saver = TorchMemorySaver()
        self.saver.hook_mode = "torch"
        self.native = CuMemAllocator.get_instance().native
        # Process-wide settings the example changes (set-up sets keep_host_memory, the machine a spill directory).
        self.keep_before = self.native.keep_host_memory()
        self.spill_before = self.native.spill_dir
        self.prefix = f"sm{os.getpid()}_{next(_example)}_"

    def alloc(self, n: int) -> "torch.Tensor":
        return torch.empty(n, dtype=torch.uint8, device="cuda")

    def address(self, h: "torch.Tensor") -> int:
        return h.data_ptr()

    def write(self, h: "torch.Tensor", offset: int, data: bytes) -> None:
        h[offset : offset + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        torch.cuda.synchronize()

    def read(self, h: "torch.Tensor", n: int) -> bytes:
        return h.cpu().numpy().tobytes()

    def backup(self, h: "torch.Tensor", n: int, zero_copy: bool) -> Optional["torch.Tensor"]:
        return self.saver.get_cpu_backup(h, zero_copy=zero_copy)

    def free(self, h: "torch.Tensor") -> None:
        pass  # the model drops its reference: torch's pool keeps the block

    def close(self) -> None:
        self.saver.resume()
        self.native.set_keep_host_memory(self.keep_before)
        self.native.set_spill_dir(self.spill_before)


@dataclass
class Mem:
    """The model of one allocation."""

    handle: Any
    tag: str
    backup: str  # "none", "cpu" or "disk"
    size: int
    data: Optional[bytearray]  # what the memory holds while awake; None: undefined (resumed without backup)
    paused: bool = False
    saved: Optional[bytes] = None  # the content of its backup while one exists (paused, or retained)


@dataclass
class View:
    """A zero-copy view of an allocation's backup and the bytes it must show."""

    tensor: "torch.Tensor"
    mem: Mem
    expected: bytes
    live: bool = True  # the backup is still where the view is


def machine_for(backend: str) -> type:
    class MemorySaverMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.m = SimMemory() if backend == "sim" else CudaMemory()
            self.saver = self.m.saver
            self.disk_dir = tempfile.mkdtemp(prefix="cumem-rs-tms-")
            self.saver.set_disk_backup_dir(self.disk_dir)  # named files, one per paused disk-backed allocation
            self.mems: list[Mem] = []
            self.views: list[View] = []
            self.keep = False  # the allocator's keep_host_memory (torch_memory_saver's default at set-up)
            self.release_pending = False  # retain_cpu_backup = False while kept: applied by the next resume
            self.used_tags: set[str] = set()

        def tag(self, name: str) -> str:
            return self.m.prefix + name

        # -- rules ------------------------------------------------------------------------------------------------

        @initialize(on=st.booleans(), first=st.lists(st.tuples(st.sampled_from(TAGS), st.sampled_from(BACKUPS),
                                                               st.sampled_from(SIZES)), min_size=2, max_size=4))
        def start(self, on, first):
            """A few allocations to begin with, and half the runs retaining from the start (retained backups and
            views of them are rare otherwise: rules are drawn among those a run enables)."""
            if on:
                self.retain_cpu_backup(True)
            for i, (tag, backup, size) in enumerate(first):
                self.alloc(tag, backup, size, i)

        @precondition(lambda self: len(self.mems) < MAX_ALLOCS)
        @rule(tag=st.sampled_from(TAGS), backup=st.sampled_from(BACKUPS), size=st.sampled_from(SIZES),
              seed=st.integers(0, 2**16))
        def alloc(self, tag, backup, size, seed):
            with self.saver.region(self.tag(tag), enable_cpu_backup=backup == "cpu",
                                   enable_disk_backup=backup == "disk"):
                h = self.m.alloc(size)
            data = _random_bytes(size, seed)
            self.m.write(h, 0, data)
            self.mems.append(Mem(h, tag, backup, size, bytearray(data)))
            self.used_tags.add(tag)

        @precondition(lambda self: any(not x.paused for x in self.mems))
        @rule(pick=st.integers(0, 1000), at=st.integers(0, 1000), seed=st.integers(0, 2**16))
        def write(self, pick, at, seed):
            awake = [x for x in self.mems if not x.paused]
            x = awake[pick % len(awake)]
            if x.data is None:  # undefined bytes: write it whole, so the model knows them again
                offset, n = 0, x.size
                x.data = bytearray(x.size)
            else:
                offset = at * x.size // 1001
                n = min(x.size - offset, 1 + seed % 5000)
            data = _random_bytes(n, seed)
            self.m.write(x.handle, offset, data)
            x.data[offset : offset + n] = data

        @rule(tag=st.one_of(st.none(), st.sampled_from(TAGS + ["unused"])))
        def pause(self, tag):
            self.saver.pause(None if tag is None else self.tag(tag))
            for x in self.mems:
                if (tag is None or x.tag == tag) and not x.paused:
                    x.paused = True
                    x.saved = None if x.backup == "none" else bytes(x.data)
                    if x.backup == "none":
                        x.data = None

        @rule(tag=st.one_of(st.none(), st.sampled_from(TAGS + ["unused"])))
        def resume(self, tag):
            self.saver.resume(None if tag is None else self.tag(tag))
            acts = tag is not None or bool(self.used_tags)  # resume() of no tag at all is no call
            if acts and self.release_pending:
                self.keep, self.release_pending = False, False
                for x in self.mems:
                    if not x.paused:
                        x.saved = None  # retained backups go with the kept host memory
            for x in self.mems:
                if (tag is None or x.tag == tag) and x.paused:
                    x.paused = False
                    if x.backup != "none":
                        x.data = bytearray(x.saved)
                    if not self.keep:
                        x.saved = None

        @rule(on=st.sampled_from([True, True, False]))  # on more often: retained backups live across resumes
        def retain_cpu_backup(self, on):
            self.saver.retain_cpu_backup = on
            if on:
                self.keep, self.release_pending = True, False
            elif self.keep:
                self.release_pending = True

        @precondition(lambda self: self.mems)
        @rule(pick=st.integers(0, 1000), zero_copy=st.booleans())
        def get_cpu_backup(self, pick, zero_copy):
            x = self.mems[pick % len(self.mems)]
            if x.paused and x.backup == "none":
                with pytest.raises(CumemError, match="without CPU backup"):
                    self.m.backup(x.handle, x.size, zero_copy)
                return
            got = self.m.backup(x.handle, x.size, zero_copy)
            # Awake: the retained backup if it is in host memory (a file one is not read while awake, as there).
            want = x.saved if x.paused or x.backup == "cpu" else None
            if want is None:
                assert got is None, (x.tag, x.backup, x.paused)
                return
            assert got is not None and got.dtype == torch.uint8 and tuple(got.shape) == (x.size,)
            assert _bytes_of(got) == want, (x.tag, x.backup, x.paused, zero_copy)
            where = self.m.native.view_backup(self.m.address(x.handle), x.size, False)
            if zero_copy and x.backup == "cpu":
                assert where is not None and got.data_ptr() == where.address, "a view is the backup itself"
                self.views.append(View(got, x, want))
            elif where is not None:
                assert got.data_ptr() != where.address, "a copy is not the backup"

        @precondition(lambda self: any(x.backup == "cpu" and x.saved is not None for x in self.mems))
        @rule(pick=st.integers(0, 1000), awake=st.booleans(), write=st.booleans(), seed=st.integers(0, 2**16))
        def view_a_host_backup(self, pick, awake, write, seed):
            """get_cpu_backup(zero_copy=True) of an allocation with a backup in host memory (paused, or retained:
            those first when `awake`, the rarer case), and maybe a write through that view at once."""
            held = [x for x in self.mems if x.backup == "cpu" and x.saved is not None]
            retained = [x for x in held if not x.paused]
            held = retained if awake and retained else held
            self.get_cpu_backup(self.mems.index(held[pick % len(held)]), True)
            if write:
                self._write_through(self.views[-1], seed % 1001, seed)

        @precondition(lambda self: any(v.live for v in self.views))
        @rule(pick=st.integers(0, 1000), at=st.integers(0, 1000), seed=st.integers(0, 2**16))
        def write_through_view(self, pick, at, seed):
            """A view is writable: what it writes is what the next resume restores (paused), and the next pause
            copies that allocation whole (a retained backup written behind the fingerprints' back)."""
            live = [v for v in self.views if v.live]
            self._write_through(live[pick % len(live)], at, seed)

        def _write_through(self, v: View, at: int, seed: int) -> None:
            x = v.mem
            offset = at * x.size // 1001
            data = _random_bytes(min(x.size - offset, 1 + seed % 300), seed)
            v.tensor[offset : offset + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            saved = bytearray(x.saved)
            saved[offset : offset + len(data)] = data
            x.saved = bytes(saved)
            v.expected = x.saved

        @precondition(lambda self: self.views)
        @rule(pick=st.integers(0, 1000))
        def drop_view(self, pick):
            del self.views[pick % len(self.views)]
            gc.collect()

        @precondition(lambda self: len(self.mems) >= 3)  # keep a few: backups need an allocation to live on
        @rule(pick=st.integers(0, 1000))
        def free(self, pick):
            x = self.mems.pop(pick % len(self.mems))
            self.m.free(x.handle)

        # -- invariants -------------------------------------------------------------------------------------------

        @invariant()
        def awake_bytes_match(self):
            for x in self.mems:
                if not x.paused and x.data is not None:
                    assert self.m.read(x.handle, x.size) == bytes(x.data), (x.tag, x.backup)

        @invariant()
        def paused_flags_match(self):
            rows = self.m.native.allocations()
            for x in self.mems:
                p = self.m.address(x.handle)
                (row,) = [r for r in rows if r["address"] <= p < r["address"] + r["size"]]
                assert row["asleep"] == x.paused, (x.tag, x.backup, row)

        @invariant()
        def retain_setting_matches(self):
            assert self.saver.retain_cpu_backup == (self.keep and not self.release_pending)
            assert self.m.native.keep_host_memory() == self.keep

        @invariant()
        def views_show_the_backup_or_the_bytes_as_they_were(self):
            for v in self.views:
                if v.live:
                    where = None
                    if v.mem in self.mems and v.mem.saved is not None:
                        where = self.m.native.view_backup(self.m.address(v.mem.handle), v.mem.size, False)
                    if where is not None and where.address == v.tensor.data_ptr():
                        v.expected = v.mem.saved  # still the backup itself: updated in place by a pause
                    else:
                        v.live = False  # moved or released: it keeps what it showed last
                assert _bytes_of(v.tensor) == v.expected, (v.mem.tag, v.live)

        @invariant()
        def disk_files_are_those_of_disk_backups(self):
            if backend != "sim":
                return  # on a GPU torch's pools may hold several tensors per allocation, and blocks of freed ones
            with_file = sum(1 for x in self.mems if x.backup == "disk" and x.saved is not None)
            assert len(os.listdir(self.disk_dir)) == with_file

        @invariant()
        def retained_and_host_memory_match(self):
            if backend != "sim":
                return  # the process-wide allocator holds other tests' memory too
            retained = sum(1 for x in self.mems if not x.paused and x.saved is not None)
            assert self.m.native.stats()["retained_allocations"] == retained
            if not self.keep and not any(x.saved is not None and x.backup == "cpu" for x in self.mems):
                assert self.m.native.host_bytes() == 0, "host memory nobody keeps goes back to the OS"

        def teardown(self):
            try:
                self.views.clear()
                self.mems.clear()
                gc.collect()
                self.m.close()
            finally:
                shutil.rmtree(self.disk_dir, ignore_errors=True)

    return MemorySaverMachine


@pytest.fixture(autouse=True)
def _no_tms_env(monkeypatch):
    for name in [k for k in os.environ if k.startswith("TMS_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_saver_against_its_model(backend):
    run_state_machine_as_test(machine_for(backend), settings=STATEFUL_SETTINGS)


@pytest.mark.parametrize("backup", ["cpu", "disk"])
def test_retain_turned_off_and_on_while_paused_still_retains_at_resume(backup, tmp_path):
    """Found by the machine above: retain_cpu_backup = False, applied by a resume of another tag while "w" was
    paused (set_keep_host_memory(False)), dropped the fingerprints of w's backup with the retained backups, so that
    after retain_cpu_backup = True again w's resume kept no backup (get_cpu_backup then said None, and a disk
    backup's file was removed). Its next pause copies it whole, into the same bytes."""
    sim = Allocator.simulated(devices=1, capacity=64 * MiB, granularity=GRAN)
    try:
        saver = TorchMemorySaver(_backend=SimulatedPools(sim))
        saver.set_disk_backup_dir(str(tmp_path))
        data = bytearray(_random_bytes(100_000, 1))
        with saver.region("w", enable_cpu_backup=backup == "cpu", enable_disk_backup=backup == "disk"):
            p = sim.malloc(len(data))
        sim.write(p, bytes(data))
        saver.retain_cpu_backup = True
        saver.pause("w")
        saver.retain_cpu_backup = False
        saver.resume("kv")  # applies the False: the allocator keeps nothing from here on
        assert sim.keep_host_memory() is False
        saver.retain_cpu_backup = True
        saver.resume("w")
        assert sim.read(p, len(data)) == data
        assert sim.stats()["retained_allocations"] == 1, "the resume with retain_cpu_backup kept the backup"
        assert len(os.listdir(tmp_path)) == (backup == "disk")
        kept = saver._cpu_backup(p, len(data), torch.uint8, (len(data),), False)
        assert (kept is None) if backup == "disk" else _bytes_of(kept) == data
        sim.write(p + 7, b"\x01\x02")
        data[7:9] = b"\x01\x02"
        saver.pause("w")
        assert sim.read_backup(p, len(data)) == data
        saver.resume("w")
        assert sim.read(p, len(data)) == data
    finally:
        sim.close()
