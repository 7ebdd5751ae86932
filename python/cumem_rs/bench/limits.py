"""The physical limit every sleep/wake ratio is taken against, measured in the same run.

GPU: torch `copy_` between a pinned host tensor and device memory, each way, over the same bytes as the measured
sleep or wake. Simulated device: a host memcpy over those bytes (its copies are memcpys).
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from typing import Any

from .common import Context, fmt_bytes, say

SECTION = "the limit: pinned copies"


def memcpy_gbps(nbytes: int, reps: int = 3) -> float:
    """Host memcpy bandwidth over `nbytes`, the physical limit of the simulated device's copies."""
    src = bytearray(os.urandom(min(nbytes, 1 << 16))) * (nbytes // (1 << 16) + 1)
    dst = bytearray(len(src))
    cs = (ctypes.c_char * len(src)).from_buffer(src)
    cd = (ctypes.c_char * len(dst)).from_buffer(dst)
    ctypes.memmove(cd, cs, nbytes)  # first touch of dst
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ctypes.memmove(cd, cs, nbytes)
        times.append(time.perf_counter() - t0)
    del cs, cd
    return nbytes / statistics.median(times) / 1e9


def copy_limit(torch: Any, dev_buf: Any, nbytes: int, reps: int = 3) -> tuple[float, float]:
    """(host->device, device->host) GB/s of one `copy_` between a pinned host tensor and `dev_buf`, median of
    `reps` after a warm-up, timed with CUDA events."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = dev_buf[:nbytes]
    out = []
    for dst, src in ((dev, host), (host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out.append(nbytes / statistics.median(times) / 1e9)
    del host, dev
    # Give the pinned pages back now, so that they count neither against our host arena nor as held host RAM.
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
    return out[0], out[1]


def limit(ctx: Context, nbytes: int, key: str = "") -> tuple[float, float]:
    """(host->device, device->host) GB/s over `nbytes`, measured once per run and size; the first measurement adds
    its rows (keys copy_h2d/copy_d2h on the GPU, copy_limit on the sim, each with `key` appended). On the GPU call
    it while the bytes still fit beside what the calling table holds: the device buffer is a plain torch tensor,
    released right after."""
    return ctx.cached(("limit", nbytes), lambda: _measure(ctx, nbytes, key))


def _measure(ctx: Context, nbytes: int, key: str) -> tuple[float, float]:
    res = ctx.res
    before, before_config = res.current_section, res.current_config
    res.section(SECTION)  # a plain copy: no allocator configuration
    try:
        if not ctx.gpu:
            gbps = memcpy_gbps(nbytes)
            res.bandwidth(f"copy_limit{key}", "host memcpy (the limit on the simulated device)", nbytes,
                          nbytes / gbps / 1e9, None, "")
            return gbps, gbps
        torch = ctx.torch
        say(f"measuring pinned copy bandwidth over {fmt_bytes(nbytes)}")
        dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
        try:
            h2d, d2h = copy_limit(torch, dev_buf, nbytes)
        finally:
            del dev_buf
            torch.cuda.empty_cache()
        res.bandwidth(f"copy_h2d{key}", "torch copy_ pinned host -> device (the limit)", nbytes,
                      nbytes / h2d / 1e9, None)
        res.bandwidth(f"copy_d2h{key}", "torch copy_ device -> pinned host (the limit)", nbytes,
                      nbytes / d2h / 1e9, None)
        return h2d, d2h
    finally:
        res.section(before)
        res.configure(before_config)
