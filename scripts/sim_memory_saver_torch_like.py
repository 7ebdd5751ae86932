"""The memory saver state machine on the simulated device the way a GPU run drives it, for hunting faults without
a GPU (tests/test_memory_saver_state_machine.py's [sim] case calls `Allocator.malloc` per tensor and frees at once).

Here, as torch's caching allocator does in hook_mode "torch" on a GPU:

* every tensor made in a region is a 2 MiB segment of its own (a fresh pool per region block; granularity 2 MiB),
  the tensor at its start;
* a dead tensor's segment stays allocated (cached in its dropped pool) until a tag whose dropped pools hold an
  unused segment is entered again, which frees every unused segment of every dropped pool (`empty_cache`);
* one allocator serves every example (the CUDA one is process-wide), and an example ends as CudaMemory.close does
  (resume every tag, keep_host_memory and the spill directory restored, the allocator left open).

An extra invariant fails on any entry in the allocator's error log: a driver error the engine absorbed (a copy or
fingerprint of unmapped memory is refused by the simulated driver, where CUDA would fault).

Run:  PYTHONPATH=python python scripts/sim_memory_saver_torch_like.py [examples]   (about 0.4 s per example)
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import test_memory_saver_state_machine as sm  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, run_state_machine_as_test  # noqa: E402

from cumem_rs import Allocator  # noqa: E402
from cumem_rs._sim_pools import SimulatedPools  # noqa: E402
from cumem_rs.memory_saver import TorchMemorySaver  # noqa: E402

SEGMENT = 2 << 20
SIM = Allocator.simulated(devices=1, capacity=1 << 30, granularity=SEGMENT)
DEAD: set[int] = set()  # segments whose tensor died, still allocated
SEGMENTS: dict[int, str] = {}  # segment -> allocator tag
BY_TAG: dict[str, list[int]] = {}
_examples = itertools.count()


class Tensor:
    """A tensor at the start of its segment; its death leaves the segment cached."""

    def __init__(self, addr: int, n: int) -> None:
        self.addr, self.n = addr, n

    def __del__(self) -> None:
        DEAD.add(self.addr)


def empty_cache() -> None:
    for a in sorted(DEAD):
        SIM.free(a)
        BY_TAG[SEGMENTS.pop(a)].remove(a)
    DEAD.clear()


class TorchLikePools(SimulatedPools):
    def use_memory_pool(self, tag=None):
        if any(a in DEAD for a in BY_TAG.get(tag, ())):  # _pools.EnteredPools.enter_again
            empty_cache()
        return super().use_memory_pool(tag)


class TorchLikeMemory:
    def __init__(self) -> None:
        self.saver = TorchMemorySaver(_backend=TorchLikePools(SIM))
        self.native = SIM
        self.prefix = f"ex{next(_examples)}_"
        self.keep_before = SIM.keep_host_memory()
        self.spill_before = SIM.spill_dir

    def alloc(self, n: int) -> Tensor:
        a = SIM.malloc(SEGMENT)
        SEGMENTS[a] = tag = SIM.current_tag()
        BY_TAG.setdefault(tag, []).append(a)
        return Tensor(a, n)

    def address(self, h: Tensor) -> int:
        return h.addr

    def write(self, h: Tensor, offset: int, data: bytes) -> None:
        SIM.write(h.addr + offset, data)

    def read(self, h: Tensor, n: int) -> bytes:
        return SIM.read(h.addr, n)

    def backup(self, h: Tensor, n: int, zero_copy: bool):
        return self.saver._cpu_backup(h.addr, n, torch.uint8, (n,), zero_copy)

    def free(self, h: Tensor) -> None:
        pass  # the model drops its reference: the segment stays cached

    def close(self) -> None:
        self.saver.resume()
        SIM.set_keep_host_memory(self.keep_before)
        SIM.set_spill_dir(self.spill_before)


def machine() -> type:
    # The GPU variant of the machine: its invariants that only hold per fresh allocator are skipped.
    base = sm.machine_for("cuda")

    class TorchLikeMachine(base):
        def __init__(self) -> None:
            RuleBasedStateMachine.__init__(self)
            self.m = TorchLikeMemory()
            self.saver = self.m.saver
            self.disk_dir = tempfile.mkdtemp(prefix="cumem-rs-tms-")
            self.saver.set_disk_backup_dir(self.disk_dir)
            self.mems, self.views = [], []
            self.keep, self.release_pending = False, False
            self.used_tags = set()

        @invariant()
        def no_absorbed_driver_errors(self):
            errors = SIM.errors()
            assert not errors, errors

    return TorchLikeMachine


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    run_state_machine_as_test(machine(), settings=settings(sm.STATEFUL_SETTINGS, max_examples=n, deadline=None))
    print(f"passed {n} examples; {len(SIM.allocations())} allocations left (dead segments of earlier examples)")
