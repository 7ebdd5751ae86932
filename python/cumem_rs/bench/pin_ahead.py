"""The first sleep with host memory pinned ahead in the background (`CuMemAllocator.pin_ahead`): when the weights
pool closes, a worker pins the arena the first sleep will copy into. Rows, each a fresh workload with no host
memory cached before it: the first sleep with pinning ahead off (today's cold sleep), at once after the weights
pool closed, and 2 s after it, against the pinned-copy limit; then a bf16 matmul loop running while the worker
pins the weights' bytes, against the same loop alone. GPU only (the torch layer needs CUDA).
"""

from __future__ import annotations

import time

from ..workload import KV_TAG, WEIGHTS_TAG, TorchWorkload, reference_workload, total_bytes
from . import config
from .common import Context, fmt_seconds, say, timed
from .limits import limit
from .subjects import release_tensors

SECTION = "pinning ahead: the first sleep"

#: (row key, label, pin ahead, seconds between the weights pool closing and the sleep, target note)
CASES = (
    ("first_sleep_no_pin_ahead", "first sleep, pin ahead off (cold)", False, 0.0, ""),
    ("first_sleep_pin_ahead_0s", "first sleep at once after the weights pool closed", True, 0.0,
     " (target: not slower than cold)"),
    ("first_sleep_pin_ahead_2s", "first sleep 2 s after the weights pool closed", True, 2.0, " (target >= 0.9)"),
)


def run(ctx: Context) -> None:
    res = ctx.res
    res.section(SECTION)
    if not ctx.gpu:
        for _, label, *_ in CASES:
            res.skipped(label, "no GPU")
        res.skipped("matmul loop while pinning ahead", "no GPU")
        return
    from .. import Allocator
    from ..allocator import CuMemAllocator

    specs = reference_workload(ctx.scale, ctx.args.kv_gib)
    wbytes, kvbytes = total_bytes(specs, WEIGHTS_TAG), total_bytes(specs, KV_TAG)
    _, d2h = limit(ctx, wbytes)
    ctx.check_fits(wbytes + kvbytes)
    sync = ctx.sync
    cumem = CuMemAllocator.get_instance()
    core = Allocator.cuda()
    core.set_retain_backups(False)
    ctx.res.configure(config.short(core))
    previous = cumem.pin_ahead
    try:
        for key, label, on, delay, note in CASES:
            core.trim_host()  # nothing cached: the first sleep starts from no pinned memory
            cumem.pin_ahead = on
            wl = TorchWorkload(specs, device=ctx.device)
            try:
                wl.allocate(cumem)  # the weights pool closes inside, starting the worker when on
                closed = time.perf_counter()
                wl.fill(WEIGHTS_TAG)
                wl.checksum(WEIGHTS_TAG)
                sync()
                time.sleep(max(0.0, delay - (time.perf_counter() - closed)))
                status = core.pin_ahead_status()
                _, ts = timed(lambda: cumem.sleep(offload_tags=WEIGHTS_TAG), sync)
                cumem.wake_up()
                wl.verify(WEIGHTS_TAG)
                say(f"{label}: {fmt_seconds(ts)} (worker had pinned {status['pinned']} of {status['nbytes']} bytes)")
                res.bandwidth(key, label, wbytes, ts, d2h, "device->host copy" + note)
            finally:
                release_tensors(ctx, wl)
        _matmul_rows(ctx, core, wbytes)
    finally:
        cumem.pin_ahead = previous
        core.trim_host()
    ctx.add_errors(core.errors())


def _matmul_rows(ctx: Context, core, nbytes: int) -> None:
    """A bf16 matmul loop alone, then the same loop while a worker pins `nbytes` of host memory."""
    torch = ctx.torch
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=ctx.device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=ctx.device)

    def loop(n: int) -> None:
        for _ in range(n):
            torch.matmul(a, b)

    loop(5)
    _, t1 = timed(lambda: loop(20), ctx.sync)
    n = max(20, int(20 * 1.0 / max(t1, 1e-6)))  # about one second alone
    _, alone = timed(lambda: loop(n), ctx.sync)
    core.trim_host()
    core.reserve_host(nbytes, background=True)
    _, busy = timed(lambda: loop(n), ctx.sync)
    status = core.pin_ahead_status()
    core.trim_host()
    ctx.res.latency("matmul_while_pinning", "matmul loop while pinning ahead (time, against alone)", busy, alone,
                    f"the same loop alone (target <= 1.05; worker pinned {status['pinned']} of {nbytes} bytes "
                    "meanwhile)")
