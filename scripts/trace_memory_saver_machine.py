"""Trace the memory saver state machine on a GPU, to find the step that makes an illegal memory access.

tests/test_memory_saver_state_machine.py::test_memory_saver_against_its_model[cuda] failed on an H200 with
"CUDA error: an illegal memory access was encountered", reported by a later torch call (the error is
asynchronous and sticky, and hypothesis' replay then failed at its first allocation). This runs the same machine
with every device-touching operation traced:

* each operation (allocation in a region, write, read, get_cpu_backup, pause, resume, retain_cpu_backup, garbage
  collection, empty_cache) is printed before it runs, then the device is synchronized and the native log
  forwarded, so the first operation after which the synchronize fails is the one that faulted (or queued the
  faulting work);
* before the machine touches a tensor (write, read) the allocation holding it is looked up: touching memory the
  allocator has asleep is reported as such (the model or the saver is wrong, not the driver) instead of being done;
* a tensor handed out inside a region is checked to lie in an awake allocation (torch handing out a cached block
  of a paused segment would be the saver's hazard).

Run with a GPU (under a minute):  CUDA_LAUNCH_BLOCKING=1 python scripts/trace_memory_saver_machine.py [examples]
Exit status 0: no fault in that many examples; 3: a fault (the trace says after which operation); 4: a hazard
found before any fault (asleep memory about to be touched or handed out). A second part checks, in child
processes, the routes where torch itself may hand out a cached block of a paused allocation (preload mode's
region pool, a graph pool token shared across captures): `--probes` runs only those.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

os.environ.setdefault("CUDA_LAUNCH_BLOCKING", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import torch  # noqa: E402

STEPS: list[str] = []
BUDGET_S = 45.0


def say(msg: str) -> None:
    STEPS.append(msg)
    print(msg, flush=True)


def fault(msg: str, code: int) -> None:
    print(f"\n=== {msg}", flush=True)
    try:
        from cumem_rs.allocator import CuMemAllocator

        print("allocator errors:", CuMemAllocator.get_instance().native.errors(), flush=True)
    except Exception as e:  # the context is poisoned: anything may fail now
        print("allocator errors unavailable:", e, flush=True)
    os._exit(code)


def forward_logs() -> None:
    from cumem_rs.logs import forward_native_logs
    import logging

    logging.basicConfig(level=logging.DEBUG, format="    native: %(message)s", stream=sys.stdout)
    forward_native_logs()


def synced(name: str) -> None:
    """Synchronize the device after `name`; a failure here means `name` faulted (or queued what did)."""
    try:
        torch.cuda.synchronize()
    except Exception as e:
        forward_logs()
        fault(f"FAULT surfaced by the synchronize after: {name}\n{e}", 3)
    forward_logs()


def row_of(native, ptr: int):
    rows = [r for r in native.allocations() if r["address"] <= ptr < r["address"] + r["size"]]
    return rows[0] if rows else None


def run_machine(examples: int) -> None:
    import gc

    import test_memory_saver_state_machine as sm
    from hypothesis import Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    start = time.monotonic()
    Cuda = sm.CudaMemory

    class TracedCudaMemory(Cuda):
        def __init__(self) -> None:
            super().__init__()
            say(f"-- example {self.prefix}")
            if time.monotonic() - start > BUDGET_S:
                print(f"time budget reached; no fault in {len(STEPS)} traced steps", flush=True)
                os._exit(0)
            saver = self.saver
            for meth in ("pause", "resume", "get_cpu_backup"):
                orig = getattr(saver, meth)

                def wrap(*a, _orig=orig, _meth=meth, **k):
                    shown = [f"{x.data_ptr():#x}" if isinstance(x, torch.Tensor) else repr(x) for x in a]
                    say(f"{_meth}({', '.join(shown)}{', ' if k else ''}{k or ''})")
                    try:
                        return _orig(*a, **k)
                    finally:
                        synced(_meth)

                setattr(saver, meth, wrap)
            cls = type(saver)
            if not hasattr(cls, "_traced_retain"):
                prop = cls.retain_cpu_backup

                def set_retain(obj, value, _prop=prop):
                    say(f"retain_cpu_backup = {value}")
                    _prop.fset(obj, value)
                    synced("retain_cpu_backup")

                cls.retain_cpu_backup = property(prop.fget, set_retain)
                cls._traced_retain = True

        def alloc(self, n: int):
            say(f"alloc({n}) in tag {self.native.current_tag()!r}")
            t = super().alloc(n)
            synced("alloc")
            row = row_of(self.native, t.data_ptr())
            say(f"  -> {t.data_ptr():#x} in {row and (hex(row['address']), row['size'], row['tag'], row['asleep'])}")
            if row is None or row["asleep"]:
                fault(f"HAZARD: the tensor handed out at {t.data_ptr():#x} lies in {row} (not awake memory of ours)", 4)
            return t

        def _check_awake(self, h, what: str) -> None:
            row = row_of(self.native, h.data_ptr())
            if row is None or row["asleep"]:
                fault(f"HAZARD: the machine is about to {what} {h.data_ptr():#x}, which lies in {row}", 4)

        def write(self, h, offset: int, data: bytes) -> None:
            self._check_awake(h, "write")
            say(f"write {h.data_ptr():#x}+{offset} ({len(data)} bytes)")
            super().write(h, offset, data)
            synced("write")

        def read(self, h, n: int) -> bytes:
            self._check_awake(h, "read")
            got = super().read(h, n)
            synced(f"read {h.data_ptr():#x}")
            return got

        def close(self) -> None:
            say("close (resume every tag, settings restored)")
            super().close()
            synced("close")

    sm.CudaMemory = TracedCudaMemory
    orig_collect = gc.collect

    def collect(*a):
        say("gc.collect")
        n = orig_collect(*a)
        synced("gc.collect")
        return n

    sm.gc.collect = collect  # the module's own reference (drop_view, teardown)
    orig_empty = torch.cuda.empty_cache

    def empty_cache():
        say("torch.cuda.empty_cache (re-entered tag: dead segments freed through my_free)")
        orig_empty()
        synced("empty_cache")

    torch.cuda.empty_cache = empty_cache
    # No shrinking and no replay: the first fault poisons the context, everything after it only repeats it.
    run_state_machine_as_test(
        sm.machine_for("cuda"),
        settings=settings(sm.STATEFUL_SETTINGS, max_examples=examples, phases=[Phase.generate], database=None),
    )
    print(f"no fault in {examples} examples ({len(STEPS)} traced steps)", flush=True)


# --- probes: can torch hand out a cached block of a paused allocation? (each in a child: a fault is sticky) ---

PROBE_PRELOAD = r"""
import torch
from cumem_rs.memory_saver import TorchMemorySaver
s = TorchMemorySaver(); s.hook_mode = "preload"
with s.region("p", enable_cpu_backup=True):
    a = torch.empty(4096, dtype=torch.uint8, device="cuda")  # a 2 MiB segment of the region's own pool
a.fill_(1); torch.cuda.synchronize()
s.pause("p")
with s.region("p", enable_cpu_backup=True):
    b = torch.empty(4096, dtype=torch.uint8, device="cuda")  # from the pool's cached rest of that segment?
native = s._allocator().native
row = [r for r in native.allocations() if r["address"] <= b.data_ptr() < r["address"] + r["size"]]
print("preload: new tensor at", hex(b.data_ptr()), "lies in", row, flush=True)
print("HAZARD" if row and row[0]["asleep"] else "safe", flush=True)
s.resume("p")
"""

PROBE_GRAPH_TOKEN = r"""
import torch
from cumem_rs.memory_saver import TorchMemorySaver
s = TorchMemorySaver(); s.hook_mode = "torch"
token = torch.cuda.graph_pool_handle()
x = torch.zeros(1024, device="cuda")
g1 = torch.cuda.CUDAGraph()
side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(2): y = x + 1  # warm-up
torch.cuda.current_stream().wait_stream(side)
with s.cuda_graph(g1, pool=token, tag="g"):
    y = x + 1
torch.cuda.synchronize()
del y  # its block goes back to the shared pool, inside the graph's segment
s.pause("g")
g2 = torch.cuda.CUDAGraph()
with s.cuda_graph(g2, pool=token, tag="g"):
    z = x * 2  # served from the shared pool's cached blocks?
native = s._allocator().native
row = [r for r in native.allocations() if r["address"] <= z.data_ptr() < r["address"] + r["size"]]
print("graph token: captured output at", hex(z.data_ptr()), "lies in", row, flush=True)
print("HAZARD" if row and row[0]["asleep"] else "safe", flush=True)
s.resume("g")
"""


def run_probes() -> int:
    from cumem_rs.memory_saver import configure_subprocess

    env = dict(os.environ, PYTHONPATH=os.path.join(HERE, "..", "python"))
    found = 0
    for name, code in (("preload region pool", PROBE_PRELOAD), ("graph pool token", PROBE_GRAPH_TOKEN)):
        print(f"\n--- probe: {name}", flush=True)
        if name.startswith("preload"):
            with configure_subprocess():
                out = subprocess.run([sys.executable, "-c", code], env={**env, "LD_PRELOAD": os.environ["LD_PRELOAD"]},
                                     capture_output=True, text=True, timeout=60)
        else:
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        print(out.stdout[-3000:], out.stderr[-3000:], f"(exit {out.returncode})", flush=True)
        found += "HAZARD" in out.stdout
    return found


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--probes" in args:
        sys.exit(5 if run_probes() else 0)
    run_machine(int(args[0]) if args else 200)
