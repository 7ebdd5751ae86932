"""torch_memory_saver 0.0.10 against cumem_rs.memory_saver on one torch_memory_saver-style script, in one run.

    python benches/bench_memory_saver.py [--scale N] [--kv-gib G] [--cycles N] [--impl ...] [--json PATH]

The script is the same for every implementation, only the `torch_memory_saver` object differs: the reference
workload (Llama-3-8B-shaped bf16 weights, 15.0 GiB, plus a 48 GiB KV cache) allocated inside
`region("weights", enable_cpu_backup=True)` and `region("kv_cache")`, then one cold and --cycles steady rounds
of `pause()` + `resume()` (every tag), the weights verified after every resume, then `pause("kv_cache")` +
`resume("kv_cache")` alone (for cumem_rs also with the KV cache's wake_fill="zero": the cost of zeroing).
Each implementation runs in its own child process (torch_memory_saver's default hook mode needs LD_PRELOAD, and
two allocators must not share a process); each child first measures the physical limit, a pinned-host `copy_` of
the weights' size each way, so every ratio is against a limit of the same run.

Implementations: "cumem" (cumem_rs.memory_saver: its steady pauses skip the weights' chunks unchanged since the
resume, thanks to retained backups), "cumem-noretain" (the same with retained backups off, CUMEM_RS_RETAIN_BACKUPS=0:
every pause copies every byte), "tms" (torch_memory_saver with its defaults) and "tms-retain" (torch_memory_saver
with retain_cpu_backup=True); the torch_memory_saver ones are skipped when it is not installed.
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
from typing import Any, Optional

from cumem_rs.bench.common import fmt_bytes, fmt_seconds, print_table, say, timed
from cumem_rs.bench.limits import copy_limit
from cumem_rs.bench.peer_tms import _rss_bytes, _TmsPools, tms_child_env
from cumem_rs.workload import KV_TAG, WEIGHTS_TAG, TorchWorkload, reference_workload, total_bytes

IMPLS = ("cumem", "cumem-noretain", "tms", "tms-retain")


def _saver(impl: str, hook_mode: str) -> tuple[Any, str]:
    """The torch_memory_saver object of `impl`, set up as that implementation is meant to be used, and its version."""
    from importlib.metadata import version

    if impl.startswith("cumem"):
        import cumem_rs
        from cumem_rs.memory_saver import torch_memory_saver

        off = " (retained backups off)" if impl == "cumem-noretain" else ""
        return torch_memory_saver, f"cumem_rs {cumem_rs.__version__}{off}"
    import torch_memory_saver as pkg

    saver = pkg.torch_memory_saver
    if hook_mode == "torch":
        saver.hook_mode = "torch"
    if impl == "tms-retain":
        saver.retain_cpu_backup = True
    return saver, f"torch_memory_saver {version('torch_memory_saver')} ({hook_mode} hook mode)"


def child(impl: str, hook_mode: str, scale: int, kv_gib: float, cycles: int) -> dict:
    """The script, in this process, with `impl`'s saver: every figure in seconds and bytes."""
    import torch

    sync = torch.cuda.synchronize
    specs = reference_workload(scale, kv_gib)
    wbytes = total_bytes(specs, WEIGHTS_TAG)
    # The limit first, on plain torch memory that is given back before the workload exists.
    dev = torch.empty(wbytes, dtype=torch.uint8, device="cuda")
    h2d, d2h = copy_limit(torch, dev, wbytes)
    del dev
    torch.cuda.empty_cache()

    saver, label = _saver(impl, hook_mode)
    wl = TorchWorkload(specs)
    wl.allocate(_TmsPools(saver))  # region("weights", enable_cpu_backup=True), region("kv_cache")
    wl.fill(WEIGHTS_TAG)
    wl.checksum(WEIGHTS_TAG)
    sync()
    rss0 = _rss_bytes()
    pauses, resumes = [], []
    for _ in range(cycles + 1):
        _, tp = timed(saver.pause, sync)
        _, tr = timed(saver.resume, sync)
        wl.verify(WEIGHTS_TAG)
        pauses.append(tp)
        resumes.append(tr)
    out: dict[str, Any] = dict(
        impl=impl, label=label, weights_bytes=wbytes, kv_bytes=total_bytes(specs, KV_TAG),
        copy_h2d_gbps=h2d, copy_d2h_gbps=d2h, pause_all_s=pauses, resume_all_s=resumes,
        rss_growth_after_resume=_rss_bytes() - rss0,
    )
    if out["kv_bytes"]:
        _, out["pause_kv_s"] = timed(lambda: saver.pause(KV_TAG), sync)
        _, out["resume_kv_s"] = timed(lambda: saver.resume(KV_TAG), sync)
        if impl == "cumem":
            # The cost of a zero wake fill: the same resume with the KV cache's policy asking for zeros.
            from cumem_rs import CuMemAllocator

            CuMemAllocator.get_instance().set_tag_policy(KV_TAG, backup=False, wake_fill="zero")
            saver.pause(KV_TAG)
            _, out["resume_kv_zero_s"] = timed(lambda: saver.resume(KV_TAG), sync)
    return out


def run_child(impl: str, args: argparse.Namespace) -> tuple[Optional[dict], str]:
    """Run `impl` in a child process; (its numbers, "") or (None, why not)."""
    modes = ["cumem"] if impl.startswith("cumem") else ["preload", "torch"]
    why = ""
    for mode in modes:
        try:
            env = tms_child_env(mode)
        except Exception as e:
            why = f"configure_subprocess: {e}"
            continue
        if impl == "cumem-noretain":
            env["CUMEM_RS_RETAIN_BACKUPS"] = "0"  # every pause copies every byte, as torch_memory_saver's do
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "out.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--hook-mode", mode,
                   "--scale", str(args.scale), "--kv-gib", str(args.kv_gib), "--cycles", str(args.cycles),
                   "--json", path]
            say(f"{impl} ({mode}) in a child process")
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            if p.returncode == 0 and os.path.exists(path):
                with open(path) as f:
                    return json.load(f), ""
            tail = (p.stderr or p.stdout).strip().splitlines()[-3:] or [f"exit code {p.returncode}"]
            why = f"{mode}: {' | '.join(tail)}"
            say(f"{impl} ({mode}) failed: {why}")
    return None, why


def report(results: dict[str, dict], skipped: dict[str, str]) -> list[list[str]]:
    """Table rows: per implementation and step, time, GB/s of the weights, ratio to the pinned copy of the same
    child, and the time relative to cumem_rs's."""
    rows: list[list[str]] = []

    def step(name: str, r: dict, seconds: float, limit: Optional[float], ours: Optional[float]) -> None:
        gbps = r["weights_bytes"] / seconds / 1e9 if seconds > 0 else float("inf")
        rows.append([
            r["label"], name, fmt_seconds(seconds), f"{gbps:.1f}",
            f"{gbps / limit:.2f}x" if limit else "", f"{seconds / ours:.2f}x" if ours else "",
        ])

    ours = results.get("cumem")
    med = statistics.median
    for r in results.values():
        p, q = r["pause_all_s"], r["resume_all_s"]
        d2h, h2d = r["copy_d2h_gbps"], r["copy_h2d_gbps"]
        rows.append([r["label"], "pinned copy_ limit (this process)", "", f"{d2h:.1f} / {h2d:.1f}", "1.00x",
                     "d2h / h2d GB/s"])
        step("pause, cold first", r, p[0], d2h, ours["pause_all_s"][0] if ours else None)
        if len(p) > 1:
            step(f"pause, steady (median of {len(p) - 1})", r, med(p[1:]), d2h,
                 med(ours["pause_all_s"][1:]) if ours else None)
            step(f"resume, steady (median of {len(q) - 1})", r, med(q[1:]), h2d,
                 med(ours["resume_all_s"][1:]) if ours else None)
        for key, name in (("pause_kv_s", "pause kv_cache alone"), ("resume_kv_s", "resume kv_cache alone")):
            if key in r:
                rel = ours.get(key) if ours else None
                rows.append([r["label"], f"{name} ({fmt_bytes(r['kv_bytes'])})", fmt_seconds(r[key]), "", "",
                             f"{r[key] / rel:.2f}x" if rel else ""])
        if "resume_kv_zero_s" in r:
            rows.append([r["label"], "resume kv_cache alone, wake_fill=zero", fmt_seconds(r["resume_kv_zero_s"]), "",
                         "", f"{r['resume_kv_zero_s'] / r['resume_kv_s']:.2f}x of without (target <= 1.10x)"])
        rows.append([r["label"], "host RSS growth after resume", fmt_bytes(r["rss_growth_after_resume"]), "", "", ""])
    for impl, why in skipped.items():
        rows.append([impl, "skipped", "", "", "", why[:120]])
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=int, default=1, help="divide every tensor of the workload by N (default 1)")
    p.add_argument("--kv-gib", type=float, default=48.0, help="KV cache size in GiB before scaling (default 48)")
    p.add_argument("--cycles", type=int, default=3, help="steady pause/resume rounds after the cold one (default 3)")
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS), help="implementations to run")
    p.add_argument("--json", metavar="PATH", help="also write every number to PATH as JSON")
    p.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--hook-mode", default="preload", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.scale < 1 or args.cycles < 0:
        raise SystemExit("error: --scale must be >= 1 and --cycles >= 0")
    if args.child:
        out = child(args.child, args.hook_mode, args.scale, args.kv_gib, args.cycles)
        with open(args.json, "w") as f:
            json.dump(out, f)
        return 0

    import cumem_rs

    if not cumem_rs.cuda_available():
        print("error: this benchmark needs a CUDA GPU (cumem_rs found none)", file=sys.stderr)
        return 2
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for impl in args.impl:
        if impl.startswith("tms") and importlib.util.find_spec("torch_memory_saver") is None:
            skipped[impl] = "torch_memory_saver is not installed"
            continue
        r, why = run_child(impl, args)
        if r is None:
            skipped[impl] = why
        else:
            results[impl] = r
    columns = ["implementation", "step", "time", "GB/s (weights)", "vs pinned copy", "time vs cumem_rs"]
    first = next(iter(results.values()), None)
    sizes = f"{fmt_bytes(first['weights_bytes'])} weights + {fmt_bytes(first['kv_bytes'])} KV" if first else ""
    print_table(f"torch_memory_saver-style pause/resume, {sizes}, scale 1/{args.scale}", columns,
                report(results, skipped))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "skipped": skipped}, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if results.get("cumem") or "cumem" not in args.impl else 1


if __name__ == "__main__":
    sys.exit(main())
