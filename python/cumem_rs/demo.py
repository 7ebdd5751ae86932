"""`python -m cumem_rs demo`: the product's story in about twenty lines.

The reference workload (workload.py: Llama-3-8B shapes in bf16 under "weights", a KV cache under "kv_cache") with
weights filled like trained ones (`normal_() * 0.02`, which compresses as real weights do; random bits would not),
put to sleep and woken `--cycles` times:

  cycle 1           cold: the first sleep and wake of the process;
  cycles 2..N-1     steady, weights unchanged since the wake (retained backups: nothing is copied again);
  cycle N (N >= 3)  steady, after the last layers were rewritten (a partial weight sync: only their chunks are
                    copied).

Each sleep offloads the weights and discards the KV cache; every wake is checked bit-identical at the same
addresses. On a GPU each step prints its wall time and its ratio to the link, a torch `copy_` of the same bytes
between pinned host memory and the device measured in the same run, with the pinned host memory held; a summary
sets sleep, wake and host memory against the link and against the raw bytes. On the simulated device times are
those of a host emulation and mean nothing, so the demo prints what it checked instead (bytes copied and
restored, addresses, checksums) and no rate.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from . import _env
from .bench.common import fmt_bytes, fmt_seconds, timed
from .workload import (
    KV_TAG,
    LAYERS,
    WEIGHTS_TAG,
    TensorSpec,
    TorchWorkload,
    VerificationError,
    reference_workload,
    round_up,
    sim_granularity,
    total_bytes,
)

DEFAULT_SIM_SCALE = 256
DEFAULT_CYCLES = 3
#: Layers rewritten before the last sleep (a weight sync of the top layers): 4 of 32, about 11% of the bytes.
REWRITE_LAYERS = 4
#: Seconds between a sleep and its wake on the GPU, as work would run between them (a wake right after a large
#: release waits on the driver's own teardown).
PAUSE_S = 1.0
#: GPU memory left aside beside the workload (the codec's staging ring, the fingerprint buffer, torch's own).
GPU_MARGIN = 2 << 30
#: Longest wait for pinning ahead before the first sleep (it takes about 1 s for 15 GiB on a GPU host).
PIN_AHEAD_WAIT_S = 30.0


# ---------------------------------------------------------------------------------------------------------------
# What the cycles do, on either device.


def rewritten_layers(specs: list[TensorSpec]) -> list[int]:
    """Indices of the weight tensors of the last REWRITE_LAYERS layers."""
    first = LAYERS - REWRITE_LAYERS
    names = tuple(f"model.layers.{i}." for i in range(first, LAYERS))
    return [i for i, s in enumerate(specs) if s.tag == WEIGHTS_TAG and s.name.startswith(names)]


def cycle_kind(c: int, cycles: int) -> str:
    """"cold", "unchanged" or "rewritten" (see the module's docstring)."""
    if c == 1:
        return "cold"
    return "rewritten" if c == cycles and cycles >= 3 else "unchanged"


@dataclass
class Step:
    cycle: int
    kind: str
    call: str  # "sleep" or "wake"
    seconds: float
    copied: int
    host: int
    checked: str = ""  # what the step verified


@dataclass
class Story:
    """The rows printed as the cycles run, and the summary drawn from them."""

    wbytes: int
    link: Optional[tuple[float, float]]  # (host->device, device->host) GB/s; None on the simulated device
    steps: list[Step] = field(default_factory=list)

    def ratio(self, step: Step) -> float:
        """The link's time for the raw weight bytes over this step's: above 1 is past the link."""
        assert self.link is not None
        gbps = self.link[1] if step.call == "sleep" else self.link[0]
        return self.wbytes / gbps / 1e9 / step.seconds if step.seconds > 0 else float("inf")

    def label(self, step: Step, rewrite_bytes: int) -> str:
        what = {"cold": "cold", "unchanged": "weights unchanged",
                "rewritten": f"{REWRITE_LAYERS} layers rewritten ({rewrite_bytes / self.wbytes:.0%})"}[step.kind]
        return f"cycle {step.cycle} {step.call}: {what}"

    def add(self, step: Step, rewrite_bytes: int) -> None:
        self.steps.append(step)
        name = self.label(step, rewrite_bytes)
        if self.link is not None:
            print(f"  {name:<40} {fmt_seconds(step.seconds):>10}  {self.ratio(step):5.2f}x  "
                  f"{fmt_bytes(step.copied):>10}  {fmt_bytes(step.host):>10}", flush=True)
        else:
            print(f"  {name:<40} {step.checked:<44} {fmt_bytes(step.host):>10}", flush=True)

    def of(self, call: str, kind: Optional[str] = None) -> list[Step]:
        return [s for s in self.steps if s.call == call and (kind is None or s.kind == kind)]

    def host_asleep(self) -> int:
        """Pinned host memory held while asleep, at the last sleep (steady when there were several)."""
        return self.of("sleep")[-1].host


def header_lines(where: str, specs: list[TensorSpec], scale: int, content: str) -> list[str]:
    wbytes, kvbytes = total_bytes(specs, WEIGHTS_TAG), total_bytes(specs, KV_TAG)
    n = sum(1 for s in specs if s.tag == WEIGHTS_TAG)
    at = "" if scale == 1 else f" at 1/{scale} scale"
    kv = f"; a {fmt_bytes(kvbytes)} KV cache under \"kv_cache\", discarded at each sleep" if kvbytes else ""
    return [f"cumem_rs demo on {where}: Llama-3-8B shapes in bf16{at}",
            f"  {n} weight tensors, {fmt_bytes(wbytes)} under \"weights\", {content}{kv}"]


def nvcomp_extra() -> str:
    """The extra that installs nvCOMP for this torch's CUDA major (cu12 also serves a CUDA 13 driver)."""
    try:
        import torch

        major = int((torch.version.cuda or "12").split(".")[0])
    except (ImportError, ValueError):
        major = 12
    return f"cumem_rs[nvcomp-cu{13 if major >= 13 else 12}]"


# ---------------------------------------------------------------------------------------------------------------
# The simulated device: the core Allocator over a host emulation.


def bf16_weight_bytes(nbytes: int, seed: int) -> tuple[bytes, str]:
    """`nbytes` like trained bf16 weights (normal_() * 0.02, generated by torch on the CPU), and what they are.
    Without torch: random bytes, which do not compress (the demo says so)."""
    try:
        import torch
    except ImportError:
        return random.Random(seed).randbytes(nbytes), "random bytes: torch is not installed"
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((nbytes + 1) // 2, generator=gen).mul_(0.02).to(torch.bfloat16)
    return ctypes.string_at(x.data_ptr(), nbytes), "filled like trained weights: normal_()*0.02"


class SimWeights:
    """The workload as allocations of a simulated `Allocator`; the checksum of every weight tensor is kept to
    compare what each wake restored."""

    def __init__(self, specs: list[TensorSpec], scale: int, seed: int):
        from . import Allocator

        gran = sim_granularity(scale)
        self.specs = specs
        self.seed = seed
        self.alloc = Allocator.simulated(capacity=sum(round_up(s.nbytes, gran) for s in specs) + 16 * gran,
                                         granularity=gran)
        self.addresses: list[int] = []
        self.sums: dict[int, bytes] = {}
        self.content = ""

    def allocate(self) -> None:
        for spec in self.specs:
            self.alloc.push_tag(spec.tag)
            try:
                self.addresses.append(self.alloc.malloc(spec.nbytes))
            finally:
                self.alloc.pop_tag()

    def fill(self, indices: list[int], seed: int) -> int:
        written = 0
        for i in indices:
            data, self.content = bf16_weight_bytes(self.specs[i].nbytes, seed * 1_000_003 + i)
            self.alloc.write(self.addresses[i], data)
            self.sums[i] = hashlib.blake2b(data, digest_size=16).digest()
            written += len(data)
        return written

    def verify(self) -> str:
        """Raise VerificationError unless every allocation is live at its address and every weight tensor reads
        back with its checksum; returns what was checked."""
        live = {a["address"]: a for a in self.alloc.allocations()}
        moved = [s.name for s, a in zip(self.specs, self.addresses) if a not in live or live[a]["asleep"]]
        if moved or len(live) != len(self.addresses):
            raise VerificationError(f"allocations not awake at their addresses after wake: {moved[:3]}")
        for i, want in self.sums.items():
            got = hashlib.blake2b(self.alloc.read(self.addresses[i], self.specs[i].nbytes), digest_size=16).digest()
            if got != want:
                raise VerificationError(f"{self.specs[i].name}: contents differ after wake")
        return f"{len(self.sums)} checksums equal, {len(self.addresses)} addresses same"

    def close(self) -> list:
        errors = self.alloc.errors()
        for a in self.addresses:
            self.alloc.free(a)
        self.alloc.close()
        return errors


def demo_sim(args: argparse.Namespace) -> int:
    scale = args.scale or DEFAULT_SIM_SCALE
    specs = reference_workload(scale, args.kv_gib)
    weights = [i for i, s in enumerate(specs) if s.tag == WEIGHTS_TAG]
    wbytes = total_bytes(specs, WEIGHTS_TAG)
    sim = SimWeights(specs, scale, args.seed)
    try:
        sim.allocate()
        sim.fill(weights, args.seed)
        print("\n".join(header_lines("the simulated device (no GPU used)", specs, scale, sim.content)))
        print("  times on the simulated device are those of a host emulation and say nothing about GPU speed: none "
              "are shown; each step shows what it checked")
        codec = sim.alloc.stats()["codec"]
        print(f"codec: {codec}: backups compressed (on a GPU: nvCOMP)" if codec else "codec: none: backups raw")
        rewrite = rewritten_layers(specs)
        rewrite_bytes = sum(specs[i].nbytes for i in rewrite)
        story = Story(wbytes, None)
        print(f"  {'step':<40} {'checked':<44} {'host held':>10}")
        for c in range(1, args.cycles + 1):
            kind = cycle_kind(c, args.cycles)
            if kind == "rewritten":
                sim.fill(rewrite, args.seed + c)
            mapped = sim.alloc.usage()
            report = sim.alloc.sleep(WEIGHTS_TAG)
            left = sim.alloc.usage()
            if left:
                raise VerificationError(f"{left} bytes still mapped after sleep")
            story.add(Step(c, kind, "sleep", 0.0, report["copied_bytes"], sim.alloc.host_bytes(),
                           f"{fmt_bytes(report['copied_bytes'])} copied, {fmt_bytes(mapped)} -> 0 B mapped"),
                      rewrite_bytes)
            report = sim.alloc.wake_up()
            story.add(Step(c, kind, "wake", 0.0, report["copied_bytes"], sim.alloc.host_bytes(), sim.verify()),
                      rewrite_bytes)
        print(f"every wake verified bit-identical: {len(weights)} weight tensors' checksums and all "
              f"{len(specs)} addresses unchanged; each sleep left 0 B mapped (the KV cache discarded)")
        _sim_summary(story, rewrite_bytes)
    finally:
        errors = sim.close()
    return _finish(errors, args.cycles)


def _sim_summary(story: Story, rewrite_bytes: int) -> None:
    sleeps = story.of("sleep")
    parts = [f"{fmt_bytes(sleeps[0].copied)} copied cold (all the weights, as mapped)"]
    if story.of("sleep", "unchanged"):
        parts.append(f"{fmt_bytes(story.of('sleep', 'unchanged')[-1].copied)} with the weights unchanged")
    if story.of("sleep", "rewritten"):
        parts.append(f"{fmt_bytes(story.of('sleep', 'rewritten')[-1].copied)} after "
                     f"{fmt_bytes(rewrite_bytes)} were rewritten")
    n = len(story.of("wake"))
    host = story.host_asleep()
    print("summary (simulated device: what was checked, not how fast):")
    print(f"  sleep: {', '.join(parts)}")
    print(f"  wake:  {'the wake' if n == 1 else f'each of the {n} wakes'} restored all {fmt_bytes(story.wbytes)} of "
          f"weights bit-identical at the same addresses")
    print(f"  host:  {fmt_bytes(host)} held while asleep, {host / story.wbytes:.2f}x of the raw bytes")


# ---------------------------------------------------------------------------------------------------------------
# The GPU: torch tensors in CuMemAllocator's pools.


def fill_bf16(torch: Any, tensors: list, seed: int) -> int:
    """normal_() * 0.02 in place, generated on the tensors' device; returns bytes written."""
    n = 0
    for i, t in enumerate(tensors):
        gen = torch.Generator(device=t.device).manual_seed(seed * 1_000_003 + i)
        t.normal_(generator=gen).mul_(0.02)
        n += t.numel() * t.element_size()
    return n


def choose_scale(torch: Any, device: int, scale: Optional[int], kv_gib: float) -> tuple[int, Optional[str]]:
    """The scale to run at: `scale` when given (an error when it does not fit), else 1 or, on a GPU too small for
    the reference workload, the first power of two that fits. Returns (scale, why not 1) or raises SystemExit."""
    free, _ = torch.cuda.mem_get_info(device)
    for s in ([scale] if scale else [1 << k for k in range(11)]):
        need = total_bytes(reference_workload(s, kv_gib)) + GPU_MARGIN
        if need <= free:
            return s, (None if s == 1 or scale else f"the reference workload needs more than the "
                                                    f"{fmt_bytes(free)} free on this GPU")
    raise SystemExit(f"error: the workload needs {fmt_bytes(need)} of GPU memory, {fmt_bytes(free)} is free; use "
                     f"--scale or --kv-gib")


def demo_cuda(args: argparse.Namespace) -> int:
    import torch

    from . import _native
    from .allocator import CuMemAllocator
    from .bench.limits import copy_limit

    device = torch.cuda.current_device()
    scale, why = choose_scale(torch, device, args.scale, args.kv_gib)
    specs = reference_workload(scale, args.kv_gib)
    wbytes = total_bytes(specs, WEIGHTS_TAG)
    name = torch.cuda.get_device_name(device)
    print("\n".join(header_lines(name, specs, scale, "filled like trained weights: normal_()*0.02")))
    if why:
        print(f"  scaled down: {why}")
    sync = torch.cuda.synchronize

    # The link first, while the GPU memory it needs is free: a device buffer and pinned host memory of the same size.
    dev_buf = torch.empty(wbytes, dtype=torch.uint8, device=device)
    h2d, d2h = copy_limit(torch, dev_buf, wbytes)
    del dev_buf
    torch.cuda.empty_cache()

    cumem = CuMemAllocator.get_instance()
    core = cumem.native
    wl = TorchWorkload(specs, device=device, seed=args.seed)
    wl.allocate(cumem)  # the end of the weights' pool block starts pinning their host backup ahead
    weights = [t for s, t in zip(specs, wl.tensors) if s.tag == WEIGHTS_TAG]
    fill_bf16(torch, weights, args.seed)
    wl.checksum(WEIGHTS_TAG)
    sync()
    if cumem.codec:
        print(f"codec: {cumem.codec}: backups compressed on the GPU")
    else:
        why_raw = (f"{_env.COMPRESS}={_env.text(_env.COMPRESS)}" if not _env.flag(_env.COMPRESS, True)
                   else _native.cuda_codec_status()[1])
        print(f"codec: none ({why_raw}): backups raw; `pip install {nvcomp_extra()}` adds nvCOMP")
    print(f"the link: torch copy_ of the same {fmt_bytes(wbytes)}, pinned host <-> GPU: {h2d:.1f} GB/s to the "
          f"GPU, {d2h:.1f} GB/s back ({fmt_seconds(wbytes / h2d / 1e9)} / {fmt_seconds(wbytes / d2h / 1e9)})")
    pinned = _wait_pin_ahead(core)
    print(f"  x link: the link's time over ours for the raw bytes (above 1.00x: past the link); each wake "
          f"{PAUSE_S:g} s after its sleep; host held: pinned host memory after the step"
          + (f"; {fmt_bytes(pinned)} pinned ahead before the first sleep" if pinned else ""))
    print(f"  {'step':<40} {'time':>10}  {'x link':>6}  {'copied':>10}  {'host held':>10}")

    rewrite = rewritten_layers(specs)
    rewrite_bytes = sum(specs[i].nbytes for i in rewrite)
    story = Story(wbytes, (h2d, d2h))
    freed = []
    for c in range(1, args.cycles + 1):
        kind = cycle_kind(c, args.cycles)
        if kind == "rewritten":
            fill_bf16(torch, [wl.tensors[i] for i in rewrite], args.seed + c)
            wl.checksum(WEIGHTS_TAG)
            sync()
        free_before = torch.cuda.mem_get_info(device)[0]
        report, t = timed(lambda: cumem.sleep(offload_tags=WEIGHTS_TAG), sync)
        left = core.usage(device)
        if left:
            raise VerificationError(f"{left} bytes still mapped after sleep")
        freed.append(torch.cuda.mem_get_info(device)[0] - free_before)
        story.add(Step(c, kind, "sleep", t, report["copied_bytes"], core.host_bytes()), rewrite_bytes)
        time.sleep(PAUSE_S)
        report, t = timed(cumem.wake_up, sync)
        wl.verify(WEIGHTS_TAG)
        story.add(Step(c, kind, "wake", t, report["copied_bytes"], core.host_bytes()), rewrite_bytes)
    print(f"every wake verified bit-identical: per-2-MiB checksums of all {len(weights)} weight tensors, every "
          f"data_ptr unchanged; each sleep freed {fmt_bytes(min(freed))} of GPU memory or more")
    _gpu_summary(story, rewrite_bytes)
    errors = core.errors()
    wl.release()
    return _finish(errors, args.cycles)


def _wait_pin_ahead(core: Any) -> int:
    """Wait (bounded) for the background pinning the weights' pool started, as a model load would leave it time
    to; returns the bytes pinned."""
    deadline = time.monotonic() + PIN_AHEAD_WAIT_S
    while core.pin_ahead_status()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(core.pin_ahead_status()["pinned"])


def _gpu_summary(story: Story, rewrite_bytes: int) -> None:
    cold = story.of("sleep", "cold")[0]
    parts = [f"{story.ratio(cold):.2f}x the link cold"]
    unchanged = story.of("sleep", "unchanged")
    if unchanged:
        r = statistics.median(story.ratio(s) for s in unchanged)
        parts.append(f"{r:.2f}x with the weights unchanged ({1 / r:.2f}x of the copy's time)")
    rewritten = story.of("sleep", "rewritten")
    if rewritten:
        parts.append(f"{story.ratio(rewritten[0]):.2f}x after {rewrite_bytes / story.wbytes:.0%} were rewritten")
    wakes = story.of("wake")
    steady = wakes[1:] or wakes
    wake = f"{statistics.median(story.ratio(s) for s in steady):.2f}x the link" + (
        f" steady (median of {len(steady)}), {story.ratio(wakes[0]):.2f}x cold" if len(wakes) > 1 else " cold")
    host = story.host_asleep()
    print(f"summary against the link (torch copy_ of the same {fmt_bytes(story.wbytes)}) and the raw bytes:")
    print(f"  sleep: {'; '.join(parts)}")
    print(f"  wake:  {wake}")
    print(f"  host:  {fmt_bytes(host)} held while asleep, {host / story.wbytes:.2f}x of the raw bytes (the pinned "
          f"copy holds 1.00x)")


# ---------------------------------------------------------------------------------------------------------------


def _finish(errors: list, cycles: int) -> int:
    if errors:
        print(f"allocator recorded errors: {errors}", file=sys.stderr)
        return 1
    print(f"OK: {cycles} sleep/wake cycle(s), every wake bit-identical at unchanged addresses")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .workload import DEFAULT_KV_GIB, add_workload_arguments

    add_workload_arguments(p, sim_scale=DEFAULT_SIM_SCALE, kv_gib=DEFAULT_KV_GIB, cycles=DEFAULT_CYCLES,
                           cycles_help="sleep/wake cycles: the first cold, the last (of 3 or more) after the top "
                                       f"{REWRITE_LAYERS} layers were rewritten, the others with the weights unchanged")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights' content")


def run(args: argparse.Namespace) -> int:
    from .bench import resolve_backend

    if args.scale is not None and args.scale < 1:
        raise SystemExit("error: --scale must be >= 1")
    if args.cycles < 1:
        raise SystemExit("error: --cycles must be >= 1")
    if args.kv_gib < 0:
        raise SystemExit("error: --kv-gib must be >= 0")
    backend = resolve_backend(args.backend)
    try:
        return demo_cuda(args) if backend == "cuda" else demo_sim(args)
    except VerificationError as e:
        print(f"error: verification failed: {e}", file=sys.stderr)
        return 1
