"""A matmul loop on another tag while the weights pause and resume compressed (issue 23: the compression kernels
share the GPU with whatever still serves; target >= 0.9x of the loop's rate alone).

The loop multiplies two 8192 x 8192 bf16 matrices held in core allocations of tag "serving", which stays awake.
It runs once alone, then again while a thread pauses and resumes the weights uncompressed (the reference: what
the VMM calls and the copies cost the loop), then compressed (retained backups off, so every pause compresses every
byte), each without a break; the thread starts its first pause before the loop starts
and stops after the loop ends, so the whole loop shares the GPU with the codec. Both loops are timed on the
loop's own stream. The weights are verified after the last resume. On the simulated device a host hash loop stands
in for the matmul (there is no GPU to share): the row checks the path runs.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any, Callable

from ..workload import WEIGHTS_TAG, TensorSpec
from . import config
from .common import Context, fmt_bytes, say
from .compress_rows import accept
from .subjects import CoreTensors

SERVE_TAG = "serving"
N = 8192
#: Seconds the loop runs alone; longer than one pause plus resume of the reference weights at full scale.
LOOP_S = 2.0
SIM_LOOP_S = 0.2


#: Steps queued between two waits on the loop's stream: a short queue, so that a launch never blocks on a full
#: one while holding the GIL (the pausing thread needs it between its calls); the wait itself releases it.
BATCH = 32


def _timed_loop(step: Callable[[], None], k: int, sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    for i in range(k):
        step()
        if i % BATCH == BATCH - 1:
            sync()
    sync()
    return time.perf_counter() - t0


def _pausing(core: Any, stop: threading.Event, started: threading.Event, cycles: list, errors: list) -> None:
    """Pause and resume the weights until `stop`; each cycle's seconds go to `cycles`, a failure to `errors`."""
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            started.set()
            core.pause(WEIGHTS_TAG)
            core.resume(WEIGHTS_TAG)
            cycles.append(time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - re-raised on the main thread
        errors.append(e)
    finally:
        started.set()


def matmul_rows(ctx: Context, core: Any, w: Any, wbytes: int) -> None:
    res = ctx.res
    label = "matmul loop on another tag while the weights pause and resume compressed"
    if not accept(core, "auto"):
        res.skipped(label, "the allocator has no compress= policy")
        return
    core.set_retain_backups(False)
    w.fill("bf16")
    serving = None
    if ctx.gpu:
        torch = ctx.torch
        serving = CoreTensors(core, [TensorSpec(f"serving{i}", (N, N), N * N * 2, SERVE_TAG) for i in range(3)],
                              ctx.device)
        serving.allocate()
        a, b, c = (t.view(torch.bfloat16).view(N, N) for t in serving.tensors)
        a.normal_()
        b.normal_()
        stream = torch.cuda.current_stream(ctx.device)

        def step() -> None:
            torch.matmul(a, b, out=c)

        sync, loop_s, what = stream.synchronize, LOOP_S, f"{N}x{N} bf16 matmuls"
    else:
        buf = bytes(4 << 20)

        def step() -> None:
            hashlib.sha256(buf).digest()  # releases the GIL, as a kernel launch would not hold the device

        sync, loop_s, what = (lambda: None), SIM_LOOP_S, "host hashes of 4 MiB (sim: no GPU to share)"
    try:
        _timed_loop(step, 5, sync)  # warm-up
        probe = _timed_loop(step, 20, sync)
        n = max(20, int(20 * loop_s / max(probe, 1e-6)))
        alone = _timed_loop(step, n, sync)
        # The raw path first: the same loop while the weights pause and resume uncompressed says what the VMM
        # calls and the copies cost the loop, so that the compressed row's loss beyond it is the codec's.
        runs, labels = {}, {}
        for mode in ("off", "auto"):
            runs[mode] = _loop_while_pausing(core, step, n, sync, mode)
            labels[mode] = config.short(core)  # the policy the run had, read back
        w.verify()
    finally:
        if serving is not None:
            serving.release()
    for mode, key, what_pause in (("off", "compress_matmul_during_raw_pause", "uncompressed"),
                                  ("auto", "compress_matmul_during_pause", "compressed")):
        busy, cycles = runs[mode]
        res.configure(labels[mode])
        row_label = f"matmul loop on another tag while the weights pause and resume {what_pause}"
        say(f"{row_label}: {n} {what} in {busy:.3f} s, alone {alone:.3f} s; {len(cycles)} pause/resume cycles")
        target = " (target >= 0.9x)" if ctx.gpu and mode == "auto" else ""
        res.rate(key, row_label, n, busy, n / alone,
                 f"the same loop alone ({n / alone:.1f}/s){target}; {n} {what}, {len(cycles)} pause/resume cycles "
                 f"of {fmt_bytes(wbytes)} meanwhile")
        res.metrics[f"{key}_cycles_s"] = cycles
    res.metrics["compress_matmul_pause_cycles_s"] = runs["auto"][1]


def _loop_while_pausing(core: Any, step: Callable[[], None], n: int, sync: Callable[[], None],
                        mode: str) -> tuple[float, list[float]]:
    """The loop of `n` steps while a thread pauses and resumes the weights with compress=`mode`: its seconds and
    the pause/resume cycles' seconds."""
    core.set_tag_policy(WEIGHTS_TAG, compress=mode)
    stop, started = threading.Event(), threading.Event()
    cycles: list[float] = []
    errors: list[Exception] = []
    worker = threading.Thread(target=_pausing, args=(core, stop, started, cycles, errors), daemon=True)
    worker.start()
    started.wait()
    try:
        busy = _timed_loop(step, n, sync)
    finally:
        stop.set()
        worker.join()
    if errors:
        raise errors[0]
    return busy, cycles
