"""Swap: two processes on one GPU, A sleeps while B wakes (the reference weights each, 15 GiB at scale 1), as
aggregate raw bytes per second against a bidirectional pinned copy measured in the same run (device->host and
host->device at once, on two streams, the same bytes each way).

Each process (`swap_child.py`) holds its weights (bf16-like, `normal_() * 0.02`) in its own core allocator,
retained backups off. Per setting (`compress="off"`, then `"auto"` where a codec is active; `--cycles` cycles,
medians): A's sleep and B's wake one after the other, then both at once: the parent tells both to start at the
same CLOCK_MONOTONIC instant (system-wide on Linux; `time.perf_counter` is not comparable across processes) and
each reports its own start and end, so the aggregate is over the union of the two intervals. Targets at scale 1:
>= 0.95x of the bidirectional limit uncompressed, >= 1.3x compressed. B's weights are verified after every wake,
A's after the wake that resets it. On the simulated device the processes use simulated drivers with the host
codec and the limit is two host memcpys at once, on two threads.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from ..workload import WEIGHTS_TAG, VerificationError, reference_workload, total_bytes
from .common import Context, fmt_bytes, fmt_seconds, say

SECTION = "swap: two processes on one GPU, A sleeps while B wakes"
MODES = ("off", "auto")
#: How far ahead of now both processes are told to start (enough for both to read the command).
START_AHEAD_S = 0.05
#: Seconds a process may take to answer one command (a setup at scale 1 imports torch and fills 15 GiB).
ANSWER_S = 600

# python/ (the directory holding the cumem_rs package), for the children's PYTHONPATH.
_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ChildFailed(RuntimeError):
    pass


class _Child:
    """One `swap_child` process, driven by JSON lines."""

    def __init__(self, role: str) -> None:
        self.role = role
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_PARENT, env.get("PYTHONPATH", "")) if p)
        self._err = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen([sys.executable, "-m", "cumem_rs.bench.swap_child"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)

    def send(self, **msg: Any) -> None:
        assert self.p.stdin is not None
        try:
            self.p.stdin.write(json.dumps(msg) + "\n")
            self.p.stdin.flush()
        except OSError as e:
            raise ChildFailed(f"process {self.role}: {e}; {self._tail()}") from None

    def recv(self) -> dict:
        assert self.p.stdout is not None
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(self.p.stdout.readline()), daemon=True)  # type: ignore
        reader.start()
        reader.join(ANSWER_S)
        if not got or not got[0]:
            raise ChildFailed(f"process {self.role} {'exited' if got else 'did not answer'}; {self._tail()}")
        msg = json.loads(got[0])
        if "error" in msg:
            if msg["error"].startswith("VerificationError"):  # wrong data fails the run, as in every table
                raise VerificationError(f"swap process {self.role}: {msg['error']}")
            raise ChildFailed(f"process {self.role}: {msg['error']}")
        return msg

    def _tail(self) -> str:
        self._err.seek(0)
        lines = self._err.read().strip().splitlines()
        return lines[-1] if lines else f"exit code {self.p.poll()}"

    def close(self) -> None:
        try:
            self.send(cmd="quit")
            self.p.wait(timeout=60)
        except (ChildFailed, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait()
        finally:
            for f in (self.p.stdin, self.p.stdout, self._err):
                if f is not None:
                    f.close()


def _both(children: list[_Child], **msg: Any) -> list[dict]:
    """Send `msg` to every child first, then collect the answers (they work at the same time)."""
    for c in children:
        c.send(**msg)
    return [c.recv() for c in children]


# ---------------------------------------------------------------------------------------------------------------
# The limit: both directions at once.


def bidirectional_copy_gpu(torch: Any, device: int, nbytes: int, reps: int = 3) -> dict[str, float]:
    """Seconds (median of `reps` after a warm-up) of a pinned host->device copy_ alone, a device->pinned host
    copy_ alone, and both at once on two streams, each of `nbytes`."""
    h_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    h_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    d_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    up, down = torch.cuda.Stream(device=device), torch.cuda.Stream(device=device)

    def once(h2d: bool, d2h: bool) -> float:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        if h2d:
            with torch.cuda.stream(up):
                d_dst.copy_(h_src, non_blocking=True)
        if d2h:
            with torch.cuda.stream(down):
                h_dst.copy_(d_src, non_blocking=True)
        up.synchronize()
        down.synchronize()
        return time.perf_counter() - t0

    out = {}
    for key, h2d, d2h in (("h2d", True, False), ("d2h", False, True), ("both", True, True)):
        once(h2d, d2h)
        out[key] = statistics.median(once(h2d, d2h) for _ in range(reps))
    del h_src, h_dst, d_src, d_dst
    torch.cuda.empty_cache()
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # the pinned pages go back now, before the processes pin theirs
    return out


def bidirectional_copy_sim(nbytes: int, reps: int = 3) -> dict[str, float]:
    """The simulated device's copies are host memcpys: one each way alone, then two at once on two threads
    (ctypes calls release the GIL)."""
    import ctypes

    bufs = [bytearray(os.urandom(min(nbytes, 1 << 16))) * (nbytes // (1 << 16) + 1) for _ in range(4)]
    ptrs = [(ctypes.c_char * len(b)).from_buffer(b) for b in bufs]
    pairs = ((ptrs[1], ptrs[0]), (ptrs[3], ptrs[2]))

    def once(which: tuple[int, ...]) -> float:
        start = threading.Barrier(len(which) + 1)

        def copy(i: int) -> None:
            start.wait()
            ctypes.memmove(pairs[i][0], pairs[i][1], nbytes)

        threads = [threading.Thread(target=copy, args=(i,)) for i in which]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    out = {}
    for key, which in (("h2d", (0,)), ("d2h", (1,)), ("both", (0, 1))):
        once(which)
        out[key] = statistics.median(once(which) for _ in range(reps))
    del ptrs, pairs
    return out


# ---------------------------------------------------------------------------------------------------------------
# The table.


def run(ctx: Context) -> None:
    res = ctx.res
    res.section(SECTION)
    specs = reference_workload(ctx.scale, kv_gib=0)
    wbytes = total_bytes(specs, WEIGHTS_TAG)
    if ctx.gpu:
        ctx.check_fits(2 * wbytes, "the swap table's bidirectional copy")
        say(f"measuring a bidirectional pinned copy over {fmt_bytes(wbytes)} each way")
        t = bidirectional_copy_gpu(ctx.torch, ctx.device, wbytes)
        what = "torch copy_"
    else:
        t = bidirectional_copy_sim(wbytes)
        what = "host memcpy (sim)"
    res.bandwidth("swap_copy_h2d", f"{what} pinned host -> device alone", wbytes, t["h2d"], None)
    res.bandwidth("swap_copy_d2h", f"{what} device -> pinned host alone", wbytes, t["d2h"], None)
    limit = res.bandwidth("swap_copy_both", f"{what} both at once, two streams (the limit)", 2 * wbytes, t["both"],
                          None)
    children: list[_Child] = []
    try:
        children = [_Child("A"), _Child("B")]
        setup = dict(cmd="setup", backend=ctx.backend, scale=ctx.scale, device=ctx.device)
        for i, c in enumerate(children):
            c.send(role=c.role, seed=i, **setup)
        infos = [c.recv() for c in children]
        say(f"swap: two processes ready, codec: {infos[0]['codec_text']}")
        for mode in MODES:
            if mode != "off" and not all(i["codec"] for i in infos):
                res.skipped(f"swap, compress={mode!r}", f"no codec ({infos[0]['codec_text']})")
                continue
            _mode_rows(ctx, children, mode, wbytes, limit)
    except ChildFailed as e:
        res.skipped("swap", str(e)[:300])
    finally:
        for c in children:
            c.close()


def _mode_rows(ctx: Context, children: list[_Child], mode: str, wbytes: int, limit: float) -> None:
    res = ctx.res
    a, b = children
    answers = _both(children, cmd="mode", compress=mode)
    res.configure(answers[0].get("config", ""))
    recs = []
    for _ in range(max(1, ctx.cycles)):
        # One after the other: each starts as soon as it reads the command.
        a.send(cmd="go", at=0)
        sa = a.recv()
        b.send(cmd="go", at=0)
        sb = b.recv()
        _both(children, cmd="reset")
        ta, tb = _both(children, cmd="go", at=time.monotonic() + START_AHEAD_S)
        _both(children, cmd="reset")
        recs.append(dict(a_alone_s=sa["t1"] - sa["t0"], b_alone_s=sb["t1"] - sb["t0"],
                         a_s=ta["t1"] - ta["t0"], b_s=tb["t1"] - tb["t0"],
                         union_s=max(ta["t1"], tb["t1"]) - min(ta["t0"], tb["t0"]),
                         skew_s=abs(ta["t0"] - tb["t0"]), a_held=ta["held"]))
    med = {f: statistics.median(r[f] for r in recs) for f in recs[0]}
    n = len(recs)
    key = f"swap_{mode}"
    label = f"compress={mode!r}"
    target = {"off": ">= 0.95x", "auto": ">= 1.3x"}.get(mode, "")
    t = f" (target {target})" if ctx.gpu and target else ""
    res.bandwidth(f"{key}_one_after_other", f"A sleeps, then B wakes, {label} (median of {n})", 2 * wbytes,
                  med["a_alone_s"] + med["b_alone_s"], limit,
                  f"bidirectional copy; A {fmt_seconds(med['a_alone_s'])}, B {fmt_seconds(med['b_alone_s'])}")
    res.bandwidth(f"{key}_at_once", f"A sleeps while B wakes, {label} (median of {n})", 2 * wbytes,
                  med["union_s"], limit, f"bidirectional copy{t}; A {fmt_seconds(med['a_s'])}, B "
                  f"{fmt_seconds(med['b_s'])}, starts {fmt_seconds(med['skew_s'])} apart")
    held = int(med["a_held"])
    res.value(f"{key}_host_bytes", f"    host memory A holds asleep, {label}", held,
              f"{held / wbytes:.3f}x of the raw {fmt_bytes(wbytes)}")
    res.metrics[f"{key}_cycles"] = recs
