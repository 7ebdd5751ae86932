"""torch_memory_saver, the peer, on the same workload in a child process (its default hook mode needs LD_PRELOAD,
and it must not share the process with our pools). The child runs before any other table allocates, so that it
has the GPU to itself; its numbers become rows at the end of the run, as ratios of this run's copy limit.

Rows: pause (cold first, steady) and resume with `retain_cpu_backup` off (its default); the same three pauses as
the retained-backup table (weights unchanged since resume, 1% of the chunks rewritten in place, all rewritten)
with `retain_cpu_backup` off and on (on keeps its pinned host buffer across resume; every pause still copies
every byte); pause/resume of the KV cache alone; host RSS growth after resume.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from ..workload import KV_TAG, WEIGHTS_TAG, TorchWorkload, reference_workload, total_bytes
from .common import Context, say, timed
from .limits import limit
from .malloc import raw_kv_baseline
from .retained import GPU_CHUNK, KINDS, add_rows, rewrite_cycles
from .subjects import TensorSubject

# python/ (the directory holding the cumem_rs package), for the child's PYTHONPATH.
_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(ctx: Context) -> None:
    """Run the child now (nothing of ours is allocated yet); its rows come in `finish`."""
    m = ctx.res.metrics
    if not ctx.gpu:
        m["tms_skipped"] = "no GPU"
        return
    if importlib.util.find_spec("torch_memory_saver") is None:
        m["tms_skipped"] = "not installed"
        return
    last_err = ""
    for mode in ("preload", "torch"):
        env = dict(os.environ)
        if mode == "preload":
            try:
                # Its preload hook mode intercepts cudaMalloc through LD_PRELOAD, which only a new process gets.
                import torch_memory_saver as tms_pkg

                with tms_pkg.configure_subprocess():
                    env = dict(os.environ)
            except Exception as e:
                last_err = f"configure_subprocess: {e}"
                continue
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PKG_PARENT, env.get("PYTHONPATH", "")) if p)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "tms.json")
            cmd = [sys.executable, "-m", "cumem_rs.bench", "--tms-child", mode, "--scale", str(ctx.scale),
                   "--kv-gib", str(ctx.args.kv_gib), "--cycles", str(ctx.cycles), "--json", out]
            say(f"torch_memory_saver ({mode} hook mode) in a child process")
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            if p.returncode == 0 and os.path.exists(out):
                with open(out) as f:
                    child = json.load(f)
                child["hook_mode"] = mode
                m["tms"] = child
                return
            tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or [f"exit code {p.returncode}"]
            last_err = f"{mode} mode: {tail[0]}"
    m["tms_skipped"] = last_err[:200]


def finish(ctx: Context) -> None:
    """Rows of the child's numbers, as ratios of this run's copy limit (and raw driver calls for the KV rows)."""
    res, m = ctx.res, ctx.res.metrics
    tms = m.get("tms")
    tag = f"tms {tms.get('version', '?')}" if tms else "torch_memory_saver"
    w = m["weights_bytes"]
    h2d, d2h = limit(ctx, w) if tms else (0.0, 0.0)
    res.section(f"{tag}: the same workload in a child process, ratios of this run's limits")
    if not tms:
        res.skipped("torch_memory_saver", m.get("tms_skipped", "not run"))
        return
    res.bandwidth("tms_sleep_cold", f"{tag}: pause, cold first (cpu backup weights)", w, tms["sleep_all_s"][0],
                  d2h, "device->host copy")
    if len(tms["sleep_all_s"]) > 1:
        res.bandwidth("tms_sleep", f"{tag}: pause, steady (median)", w, statistics.median(tms["sleep_all_s"][1:]),
                      d2h, "device->host copy")
        res.bandwidth("tms_wake", f"{tag}: resume, steady (median)", w, statistics.median(tms["wake_all_s"][1:]),
                      h2d, "host->device copy")
    kv = m["kv_bytes"]
    raw = raw_kv_baseline(ctx, kv) if kv and "discard_kv_s" in tms else None
    if "discard_kv_s" in tms:
        res.latency("tms_discard_kv", f"{tag}: pause kv_cache only", tms["discard_kv_s"], raw[1] if raw else None,
                    "raw cuMemUnmap+cuMemRelease", nbytes=kv)
    if "wake_kv_s" in tms:
        res.latency("tms_wake_kv", f"{tag}: resume kv_cache only", tms["wake_kv_s"], raw[0] if raw else None,
                    "raw cuMemCreate+cuMemMap+cuMemSetAccess", nbytes=kv)
    res.value("tms_rss_after_wake", f"{tag}: host RSS growth after resume", tms["rss_growth_after_wake"],
              "RSS delta (not an exact count)")
    for state in ("off", "on"):
        recs = tms.get(f"retain_{state}")
        if recs:
            add_rows(ctx, f"tms_retain_{state}", f"{tag}, retain_cpu_backup {state}", recs, w, h2d, d2h, False,
                     verbs=("pause", "resume"))
        elif state == "on":
            res.skipped(f"{tag}, retain_cpu_backup on", tms.get("retain_error", "not run"))


# ---------------------------------------------------------------------------------------------------------------
# The child.


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _TmsPools:
    """torch_memory_saver regions in the place of use_memory_pool. Weights get a cpu backup, the kv cache none:
    what our sleep(offload_tags="weights") does."""

    def __init__(self, tms: Any):
        self.tms = tms

    def use_memory_pool(self, tag: str) -> Any:
        return self.tms.region(tag=tag, enable_cpu_backup=tag == WEIGHTS_TAG)


def _set_retain(tms: Any, on: bool, out: dict) -> bool:
    """Set `retain_cpu_backup`; False (and the reason in `out`) when this version has no such setting."""
    try:
        tms.retain_cpu_backup = on
        out[f"retain_{'on' if on else 'off'}_readback"] = bool(tms.retain_cpu_backup)
        return True
    except Exception as e:
        out["retain_error"] = f"retain_cpu_backup: {type(e).__name__}: {e}"[:200]
        return False


def tms_child(args: argparse.Namespace) -> dict:
    """Runs in the child: the reference workload through torch_memory_saver, same cycles and verification."""
    import torch
    import torch_memory_saver as tms_pkg

    tms = tms_pkg.torch_memory_saver
    if args.tms_child == "torch":
        tms.hook_mode = "torch"
    specs = reference_workload(args.scale, args.kv_gib)
    sync = torch.cuda.synchronize
    wl = TorchWorkload(specs)
    wl.allocate(_TmsPools(tms))
    wl.fill(WEIGHTS_TAG)
    wl.checksum(WEIGHTS_TAG)
    sync()
    out: dict[str, Any] = {}
    has_knob = _set_retain(tms, False, out)
    rss0 = _rss_bytes()
    sleeps, wakes = [], []
    for _ in range(args.cycles + 1):
        _, ts = timed(tms.pause, sync)
        _, tw = timed(tms.resume, sync)
        wl.verify(WEIGHTS_TAG)
        sleeps.append(ts)
        wakes.append(tw)
    out.update(sleep_all_s=sleeps, wake_all_s=wakes, rss_growth_after_wake=_rss_bytes() - rss0)

    # Retention off: the steady cycles above are the "unchanged" pauses; each rewritten kind once (without its
    # buffer kept, every pause allocates and pins the whole backup again: seconds each).
    subject = TensorSubject(wl)
    once = min(args.cycles, 1)
    off = rewrite_cycles(subject, tms.pause, tms.resume, {"one_percent": once, "all": once}, GPU_CHUNK, sync)
    off["unchanged"] = [dict(sleep_s=s, wake_s=w, report=None) for s, w in zip(sleeps[1:], wakes[1:])]
    out["retain_off"] = off
    if has_knob and _set_retain(tms, True, out):
        # Warm-up: the first pause with retention allocates the host buffer that later pauses reuse.
        timed(tms.pause, sync)
        timed(tms.resume, sync)
        wl.verify(WEIGHTS_TAG)
        out["retain_on"] = rewrite_cycles(subject, tms.pause, tms.resume, {k: args.cycles for k, _ in KINDS},
                                          GPU_CHUNK, sync)
    if total_bytes(specs, KV_TAG):
        _, out["discard_kv_s"] = timed(lambda: tms.pause(KV_TAG), sync)
        _, out["wake_kv_s"] = timed(lambda: tms.resume(KV_TAG), sync)
    try:
        from importlib.metadata import version

        out["version"] = version("torch_memory_saver")
    except Exception:
        pass
    return out
