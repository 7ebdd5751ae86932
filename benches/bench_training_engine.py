"""A training engine paused and resumed through torch_memory_saver's preload hook mode: cumem_rs against
torch_memory_saver 0.0.10, in one run.

    python benches/bench_training_engine.py [--params N] [--cycles N] [--impl ...] [--json PATH]

What torch_memory_saver's RL users (slime, SGLang) pause between rollouts: a training engine's memory, made by
torch's own caching allocator on every thread, with no region around the training code. Every implementation runs
the same script in a child process of its own, started with its preload hook library in `LD_PRELOAD`
(`configure_subprocess()`) and `TMS_INIT_ENABLE=1`, `TMS_INIT_ENABLE_CPU_BACKUP=0`:

* the model: `--params` parameters (default 1e9) as residual `nn.Linear` layers (width 4096 when it fits), in the
  usual mixed-precision layout: bf16 params and bf16 grads (autograd's backward thread makes them), fp32 master
  params, fp32 grads made from the bf16 ones for each step and freed after it, and `torch.optim.AdamW(fused=True)`
  over the master params (fp32 exp_avg and exp_avg_sq, made by its first step);
* the bf16 params are made inside `region("params", enable_cpu_backup=True)`, the master params and every
  optimizer step inside `region("optimizer", enable_cpu_backup=True)`; everything else (grads, activations, the
  step's fp32 grads, torch's cached blocks) is routed by `TMS_INIT_ENABLE` under the default tag without backup:
  torch_memory_saver's users rebuild grads, so a pause releases them without copying them;
* set-up (a one-layer warm-up step, so that kernel code and cuBLAS's workspace exist before the initial GPU level
  is read, then the model and one training step), then `--cycles` rounds of: checksum of params, master params and
  AdamW's states; `pause()`; `resume()`; the same checksum, which must be equal; one more training step (so every
  pause backs up state that changed since the last resume, as in training).

Each child first measures its limit, a pinned-host `copy_` each way of the bytes a pause backs up (on plain
runtime memory, inside `disable()`), so every ratio is against a limit of the same process. Implementations:
"cumem" (cumem_rs.memory_saver), "tms" (torch_memory_saver's own preload library), and both with
`retain_cpu_backup=True` ("cumem-retain", "tms-retain"); the torch_memory_saver ones are skipped, saying why, when
its wheel is not installed. Without a GPU the script says so and exits 0.

A file of its own rather than a mode of bench_memory_saver.py: that one measures an inference shape through regions
(weights and a KV cache, no TMS_INIT_ENABLE); this one has its own process set-up, workload and table.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable, Optional

from cumem_rs.bench.common import fmt_bytes, fmt_seconds, print_table, say, timed

IMPLS = ("cumem", "tms", "cumem-retain", "tms-retain")
#: The cumem_rs implementation each one is compared with (same retain_cpu_backup setting).
OURS = {"cumem": "cumem", "tms": "cumem", "cumem-retain": "cumem-retain", "tms-retain": "cumem-retain"}

MiB = 1 << 20
PARAMS_TAG = "params"
OPTIM_TAG = "optimizer"
MAX_WIDTH = 4096  # a 1B-class model's hidden size
BATCH = 1024  # rows of each step's input
MIN_PARAMS = 10_000
LAYOUT = "bf16 params + grads, fp32 master params + AdamW exp_avg/exp_avg_sq"
#: Bytes per parameter that a pause backs up: bf16 params, fp32 master params, fp32 exp_avg and exp_avg_sq.
BACKED_UP_PER_PARAM = 2 + 4 + 4 + 4
#: Bytes per parameter at the peak of a step: the above, bf16 grads and the step's fp32 grads.
PEAK_PER_PARAM = BACKED_UP_PER_PARAM + 2 + 4
#: GPU memory beyond PEAK_PER_PARAM: activations (BATCH rows per layer), the checksum's scratch, the context.
HEADROOM = 3 << 30
#: torch_memory_saver's own training_engine test: at pause, GPU memory within the initial level + 200 MiB.
PAUSED_ABOVE_INITIAL_TARGET = 200 * MiB
#: Elements per checksum chunk: bounds the checksum's GPU scratch (three int64 vectors of this length).
CHECK_CHUNK = 1 << 24


class VerificationError(RuntimeError):
    """Params or optimizer states changed across a pause/resume cycle."""


# ---------------------------------------------------------------------------------------------------------------
# The model: shapes and the training engine.


def plan(params: int) -> tuple[int, int]:
    """(width, layers) of the stack of width x width `nn.Linear` layers (with biases) nearest to `params`
    parameters: width 4096 where one layer fits, else the largest multiple of 64 whose square does."""
    width = max(64, min(MAX_WIDTH, math.isqrt(params) // 64 * 64))
    layers = max(1, round(params / layer_params(width)))
    return width, layers


def layer_params(width: int) -> int:
    return width * width + width


class TrainingEngine:
    """Residual ReLU `nn.Linear` layers in bf16, trained by fused AdamW over fp32 master copies of their params.
    `region(tag)` is where the engine's state is made (params under PARAMS_TAG, master params and AdamW's states
    under OPTIM_TAG); everything else is made wherever the process routes it."""

    def __init__(self, torch: Any, width: int, layers: int, region: Callable[[str], Any], device: str = "cuda",
                 batch: int = BATCH):
        nn = torch.nn
        self.torch = torch
        self.width = width
        self.batch = batch
        self.device = torch.device(device)
        self.region = region
        with region(PARAMS_TAG):
            self.layers = nn.ModuleList(
                nn.Linear(width, width, device=device, dtype=torch.bfloat16) for _ in range(layers)
            )
        self.params = list(self.layers.parameters())
        # The threads that make the grads (on a GPU autograd's device thread, not the caller's): a region around
        # the training code would not route their allocations, which is why this shape needs the preload hook.
        self.grad_threads: set[int] = set()
        self.params[0].register_hook(lambda grad: self.grad_threads.add(threading.get_ident()))
        with region(OPTIM_TAG):
            self.master = [p.detach().float() for p in self.params]
            self.opt = torch.optim.AdamW(self.master, lr=1e-3, weight_decay=0.01, fused=True)

    def step(self) -> float:
        """One forward + backward + AdamW step; the loss."""
        torch = self.torch
        self.layers.zero_grad(set_to_none=False)  # grads are rebuilt: after a resume their contents are undefined
        x = torch.randn(self.batch, self.width, device=self.device, dtype=torch.bfloat16)
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        loss = x.float().square().mean()
        loss.backward()  # on autograd's device thread, which makes the bf16 grads
        for m, p in zip(self.master, self.params):
            m.grad = p.grad.float()
        with self.region(OPTIM_TAG):  # AdamW makes its states in its first step
            self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.master, self.params):
                p.copy_(m)
                m.grad = None
        return float(loss.detach())

    def state(self) -> list:
        """What a pause must back up and a resume restore: params, master params and AdamW's states."""
        states = [
            t for st in self.opt.state.values() for t in st.values()
            if self.torch.is_tensor(t) and t.device == self.device
        ]
        return [*self.params, *self.master, *states]

    def grads(self) -> list:
        return [p.grad for p in self.params if p.grad is not None]


#: The integer type of each element size, whose words a checksum adds.
_WORDS = {1: lambda t: t.int8, 2: lambda t: t.int16, 4: lambda t: t.int32, 8: lambda t: t.int64}


def checksum(torch: Any, tensors: list, chunk_words: int = CHECK_CHUNK) -> Any:
    """A CPU int64 tensor: per chunk of `chunk_words` words of each tensor (all on one device), the sum of its words
    and the sum of its words weighted by their position, computed where the tensors are (bounded scratch, never a
    copy of the whole state). Returned on the host, because GPU memory without a backup (where the scratch lives)
    is undefined after a resume."""
    sums = []
    weights = torch.arange(1, chunk_words + 1, device=tensors[0].device, dtype=torch.int64)
    for t in tensors:
        flat = t.detach().reshape(-1)
        words = flat.view(_WORDS[flat.element_size()](torch))
        for chunk in words.split(chunk_words):
            wide = chunk.to(torch.int64)
            sums.append(wide.sum())
            sums.append((wide * weights[: wide.numel()]).sum())
    out = torch.stack(sums).cpu()
    del weights
    return out


# ---------------------------------------------------------------------------------------------------------------
# The child: one implementation, in a process of its own.


def _saver(impl: str) -> tuple[Any, str]:
    """The torch_memory_saver object of `impl` in preload hook mode, and its label. Imported before torch touches
    the GPU: cumem_rs routes allocations from the import of its memory_saver on."""
    from importlib.metadata import version

    if impl.startswith("cumem"):
        import cumem_rs
        from cumem_rs.memory_saver import torch_memory_saver as saver

        label = f"cumem_rs {cumem_rs.__version__}"
    else:
        from torch_memory_saver import torch_memory_saver as saver

        label = f"torch_memory_saver {version('torch_memory_saver')}"
    saver.hook_mode = "preload"
    return saver, label + (", retain_cpu_backup" if impl.endswith("-retain") else "")


def _used(torch: Any) -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _allocator_report(impl: str) -> Optional[dict]:
    """cumem_rs's own report of the last pause (bytes copied, unchanged since the resume, released without backup);
    None for torch_memory_saver, which reports nothing."""
    if not impl.startswith("cumem"):
        return None
    from cumem_rs import CuMemAllocator

    r = CuMemAllocator.get_instance().stats()["last_sleep"]
    if r is None:
        return None
    keys = ("copied_bytes", "skipped_bytes", "discarded_bytes", "allocations", "seconds")
    return {k: r[k] for k in keys}


def _check_fits(torch: Any, count: int) -> None:
    free, _ = torch.cuda.mem_get_info()
    need = PEAK_PER_PARAM * count + HEADROOM
    if need > free:
        raise SystemExit(
            f"error: --params {count} needs about {fmt_bytes(need)} of GPU memory at its peak, {fmt_bytes(free)} is "
            "free: use a smaller --params"
        )


def child(impl: str, params: int, cycles: int) -> dict:
    """The script, in this process, with `impl`'s saver: every figure in seconds and bytes."""
    saver, label = _saver(impl)
    import torch

    from cumem_rs.bench.limits import copy_limit

    sync = torch.cuda.synchronize
    width, layers = plan(params)
    count = layers * layer_params(width)
    _check_fits(torch, count)
    # The limit, on plain runtime memory that is given back before the engine exists.
    limit_bytes = BACKED_UP_PER_PARAM * count
    with saver.disable():
        dev = torch.empty(limit_bytes, dtype=torch.uint8, device="cuda")
        h2d, d2h = copy_limit(torch, dev, limit_bytes)
        del dev
        torch.cuda.empty_cache()
    if impl.endswith("-retain"):
        saver.retain_cpu_backup = True

    def region(tag: str) -> Any:
        return saver.region(tag, enable_cpu_backup=True)

    # Kernel code and cuBLAS's workspace are loaded or made by the first step and stay: a warm-up step of one layer
    # (its memory routed under the default tag, then freed) makes them part of the initial level.
    torch.manual_seed(0)
    warm = TrainingEngine(torch, width, 1, lambda tag: contextlib.nullcontext())
    warm.step()
    del warm
    gc.collect()
    torch.cuda.empty_cache()
    initial = _used(torch)

    engine = TrainingEngine(torch, width, layers, region)
    losses = [engine.step()]
    state = engine.state()
    out: dict[str, Any] = dict(
        impl=impl, label=label, params=count, width=width, layers=layers, layout=LAYOUT,
        state_bytes=sum(t.numel() * t.element_size() for t in state),
        grad_bytes=sum(t.numel() * t.element_size() for t in engine.grads()),
        limit_bytes=limit_bytes, copy_h2d_gbps=h2d, copy_d2h_gbps=d2h, gpu_used_initial=initial,
        pause_s=[], resume_s=[], gpu_used_before_pause=[], gpu_used_at_pause=[], gpu_used_after_resume=[],
        rss_growth_at_pause=[], allocator_pause=[], losses=losses,
        grads_off_caller_thread=bool(engine.grad_threads) and threading.get_ident() not in engine.grad_threads,
    )
    for cycle in range(cycles):
        before = checksum(torch, state)
        out["gpu_used_before_pause"].append(_used(torch))
        rss = _rss_bytes()
        _, tp = timed(saver.pause, sync)
        out["gpu_used_at_pause"].append(_used(torch))
        out["rss_growth_at_pause"].append(_rss_bytes() - rss)
        out["allocator_pause"].append(_allocator_report(impl))
        _, tr = timed(saver.resume, sync)
        out["gpu_used_after_resume"].append(_used(torch))
        if not torch.equal(checksum(torch, state), before):
            raise VerificationError(
                f"cycle {cycle + 1}: params or optimizer states differ after resume from before the pause"
            )
        out["pause_s"].append(tp)
        out["resume_s"].append(tr)
        losses.append(engine.step())
    return out


def child_env(impl: str) -> dict[str, str]:
    """The environment of `impl`'s child: its preload library first in LD_PRELOAD (its `configure_subprocess()`),
    every allocation routed from the start, without backup outside regions."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_")}
    env.update(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="0")
    if impl.startswith("cumem"):
        from cumem_rs.memory_saver import configure_subprocess
    else:
        from torch_memory_saver import configure_subprocess
    with configure_subprocess():
        env["LD_PRELOAD"] = os.environ["LD_PRELOAD"]
    return env


def run_child(impl: str, args: argparse.Namespace) -> tuple[Optional[dict], str]:
    """Run `impl` in a child process; (its numbers, "") or (None, why not)."""
    try:
        env = child_env(impl)
    except Exception as e:
        return None, f"configure_subprocess: {type(e).__name__}: {e}"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--params", str(args.params),
               "--cycles", str(args.cycles), "--json", path]
        say(f"{impl} in a child process (LD_PRELOAD={env['LD_PRELOAD']})")
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        tail = " | ".join((p.stderr or p.stdout).strip().splitlines()[-3:]) or f"exit code {p.returncode}"
        if not os.path.exists(path):
            return None, tail
        # The file is written (whole, renamed into place) only after every cycle verified; an error at the
        # child's exit (CUDA teardown with a preload library) is reported beside its numbers.
        with open(path) as f:
            out = json.load(f)
        if p.returncode != 0:
            out["exit_error"] = f"exit code {p.returncode} after the run: {tail}"
        return out, ""


# ---------------------------------------------------------------------------------------------------------------
# The report.


def tms_missing() -> Optional[str]:
    """Why torch_memory_saver cannot be the peer here (None: it can)."""
    from importlib.metadata import PackageNotFoundError, version

    if importlib.util.find_spec("torch_memory_saver") is None:
        return "torch_memory_saver is not installed (pip install torch_memory_saver==0.0.10)"
    try:
        version("torch_memory_saver")
    except PackageNotFoundError:
        return "the importable torch_memory_saver is no installed distribution (a stand-in?), so not the peer"
    return None


def gpu_missing() -> Optional[str]:
    """Why this machine cannot run the benchmark (None: it can)."""
    import cumem_rs

    if not cumem_rs.cuda_available():
        return "no CUDA GPU here (cumem_rs cannot use the CUDA driver): this benchmark needs one"
    import torch

    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU: this benchmark needs one"
    return None


def _median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def ratios(results: dict[str, dict]) -> dict[str, dict[str, Optional[float]]]:
    """Per implementation: pause and resume (first cycle, median of the others) as GB/s of the state bytes over the
    pinned copy limit of its own process, and as time over cumem_rs's with the same retain setting."""
    out: dict[str, dict[str, Optional[float]]] = {}
    for impl, r in results.items():
        ours = results.get(OURS.get(impl, "cumem"))
        row: dict[str, Optional[float]] = {}
        for verb, limit in (("pause", r["copy_d2h_gbps"]), ("resume", r["copy_h2d_gbps"])):
            times = r[f"{verb}_s"]
            ref = ours[f"{verb}_s"] if ours else []
            for when, t, o in (("first", times[0] if times else None, ref[0] if ref else None),
                               ("steady", _median(times[1:]), _median(ref[1:]))):
                row[f"{verb}_{when}_vs_copy"] = r["state_bytes"] / t / 1e9 / limit if t and limit else None
                row[f"{verb}_{when}_vs_cumem"] = t / o if t and o else None
        out[impl] = row
    return out


def report(results: dict[str, dict], skipped: dict[str, str], failed: dict[str, str]) -> list[list[str]]:
    """Table rows: per implementation, its limit, pause and resume (first, steady), GPU memory at pause against
    the initial level, the bytes backed up; then the implementations that did not run, and why."""
    rows: list[list[str]] = []
    rel = ratios(results)

    def x(v: Optional[float]) -> str:
        return f"{v:.2f}x" if v is not None else ""

    for impl in [i for i in IMPLS if i in results]:
        r, q = results[impl], rel[impl]
        n = len(r["pause_s"])
        lab = r["label"]
        rows.append([lab, "pinned copy_ limit, d2h / h2d GB/s", "", f"{r['copy_d2h_gbps']:.1f} / "
                     f"{r['copy_h2d_gbps']:.1f}", "1.00x", "", f"over {fmt_bytes(r['limit_bytes'])}"])
        for verb in ("pause", "resume"):
            times = r[f"{verb}_s"]
            for when, name, t in (("first", f"{verb}, cycle 1", times[0] if times else None),
                                  ("steady", f"{verb}, steady (median of {n - 1})", _median(times[1:]))):
                if t is None:
                    continue
                rows.append([lab, name, fmt_seconds(t), f"{r['state_bytes'] / t / 1e9:.1f}",
                             x(q[f"{verb}_{when}_vs_copy"]), x(q[f"{verb}_{when}_vs_cumem"]) if impl != OURS[impl]
                             else "", ""])
        per = ", ".join(f"{p * 1e3:.1f}/{s * 1e3:.1f}" for p, s in zip(r["pause_s"], r["resume_s"]))
        rows.append([lab, "pause/resume per cycle", "", "", "", "", f"{per} ms"])
        above = max(r["gpu_used_at_pause"], default=r["gpu_used_initial"]) - r["gpu_used_initial"]
        held = max(r["gpu_used_before_pause"], default=r["gpu_used_initial"]) - r["gpu_used_initial"]
        verdict = "ok" if above < PAUSED_ABOVE_INITIAL_TARGET else "over"
        rows.append([lab, "GPU memory at pause, above initial", fmt_bytes(above), "", "", "",
                     f"{verdict} (target < {fmt_bytes(PAUSED_ABOVE_INITIAL_TARGET)}); before pause "
                     f"+{fmt_bytes(held)}"])
        off = {True: "made on autograd's thread", False: "made on the caller's thread"}.get(
            r.get("grads_off_caller_thread"), "")
        note = f"params, master, AdamW states; grads {fmt_bytes(r['grad_bytes'])}: no backup, {off}"
        rows.append([lab, "state backed up (tensors)", fmt_bytes(r["state_bytes"]), "", "", "", note])
        alloc = next((a for a in r.get("allocator_pause", []) if a), None)
        if alloc:
            rows.append([lab, "backed up, cycle 1 (allocator)", fmt_bytes(alloc["copied_bytes"] +
                         alloc["skipped_bytes"]), "", "", "", f"{fmt_bytes(alloc['skipped_bytes'])} unchanged; "
                         f"{fmt_bytes(alloc['discarded_bytes'])} no backup; {alloc['allocations']} allocations"])
        if r["rss_growth_at_pause"]:
            rows.append([lab, "host RSS growth at pause, cycle 1", fmt_bytes(r["rss_growth_at_pause"][0]),
                         "", "", "", f"last cycle: {fmt_bytes(r['rss_growth_at_pause'][-1])}"])
        if r.get("exit_error"):
            rows.append([lab, "child process exit", "", "", "", "", r["exit_error"][:200]])
    for impl, why in skipped.items():
        rows.append([impl, "skipped", "", "", "", "", why[:160]])
    for impl, why in failed.items():
        rows.append([impl, "FAILED", "", "", "", "", why[:240]])
    return rows


COLUMNS = ["implementation", "measurement", "value", "GB/s (state)", "vs pinned copy", "time vs cumem_rs", "note"]


def title(results: dict[str, dict], args: argparse.Namespace) -> str:
    first = next(iter(results.values()), None)
    width, layers = (first["width"], first["layers"]) if first else plan(args.params)
    count = layers * layer_params(width)
    return (f"training engine, {fmt_count(count)} params ({layers} x Linear({width}, {width})), {LAYOUT}; "
            f"preload hook mode, TMS_INIT_ENABLE=1, {args.cycles} cycles")


def fmt_count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def exit_code(failed: dict[str, str]) -> int:
    """1 when an implementation of cumem_rs that was asked for failed (a peer's failure is only reported)."""
    return 1 if any(impl.startswith("cumem") for impl in failed) else 0


# ---------------------------------------------------------------------------------------------------------------
# Entry point.


def parse_params(text: str) -> int:
    """--params: a parameter count such as 1e9, 250000000 or 1_000_000, at least MIN_PARAMS."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a parameter count such as 1e9, got {text!r}") from None
    if not math.isfinite(value) or value < MIN_PARAMS or value > 1e13:
        raise argparse.ArgumentTypeError(f"must be between {MIN_PARAMS} and 1e13, got {text!r}")
    return int(value)


def parse_cycles(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=parse_params, default=10**9,
                   help="parameters of the model (default 1e9); a smaller count makes a quick run")
    p.add_argument("--cycles", type=parse_cycles, default=3, help="pause/resume cycles (default 3)")
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS), help="implementations to run")
    p.add_argument("--json", metavar="PATH", help="also write every number to PATH as JSON")
    p.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child and not args.json:
        p.error("--child needs --json")
    return args


def _write_json(path: Optional[str], doc: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {path}")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.child:
        out = child(args.child, args.params, args.cycles)
        tmp = f"{args.json}.part"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, args.json)
        return 0
    why = gpu_missing()
    if why:
        print(f"skipped: {why}")
        _write_json(args.json, {"skipped": {"all": why}})
        return 0
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    missing = tms_missing()
    for impl in args.impl:
        if impl.startswith("tms") and missing:
            say(f"{impl} skipped: {missing}")
            skipped[impl] = missing
            continue
        r, why = run_child(impl, args)
        if r is None:
            say(f"{impl} failed: {why}")
            failed[impl] = why
        else:
            results[impl] = r
    print_table(title(results, args), COLUMNS, report(results, skipped, failed))
    _write_json(args.json, {"args": {"params": args.params, "cycles": args.cycles}, "results": results,
                            "ratios": ratios(results), "skipped": skipped, "failed": failed})
    return exit_code(failed)


if __name__ == "__main__":
    sys.exit(main())
