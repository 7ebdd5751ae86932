"""What the tables put to sleep, and how they change it in between: the weights as CUDA tensors (torch tensors in
our pools or a peer's, or views of core `Allocator` allocations) or as allocations of a simulated core Allocator.

Every subject can rewrite address ranges in place (each byte + 1, mod 256: every byte changes, so every chunk
touched changes), on the device for CUDA tensors, and checks after a wake that the weights hold the last writes.
"""

from __future__ import annotations

import bisect
import gc
import random
from collections.abc import Callable, Iterable
from typing import Any

from ..workload import (
    WEIGHTS_TAG,
    AllocatorWorkload,
    TensorSpec,
    TorchWorkload,
    VerificationError,
    pattern_bytes,
    round_up,
    sim_granularity,
)
from .common import Context

Span = tuple[int, int]  # (address, bytes)

_PLUS_ONE = bytes((i + 1) % 256 for i in range(256))


def choose_chunks(spans: list[Span], chunk: int, fraction: float, rng: random.Random) -> list[Span]:
    """`fraction` of the `chunk`-aligned address ranges that hold bytes of `spans` (at least one), at random: the
    chunks a rewrite of that fraction touches. Allocations start at multiples of the chunk size (the granularity
    is one), so these are the chunks the fingerprints cover."""
    ids = sorted({k for a, n in spans if n for k in range(a // chunk, (a + n - 1) // chunk + 1)})
    if not ids:
        return []
    picked = sorted(rng.sample(ids, max(1, round(len(ids) * fraction))))
    return [(k * chunk, chunk) for k in picked]


def overlaps(starts: list[int], spans: list[Span], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(index of span, start, end offset inside it) of every span of the sorted `spans` meeting [lo, hi)."""
    out = []
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(spans) and spans[i][0] < hi:
        a, n = spans[i]
        s, e = max(lo, a), min(hi, a + n)
        if s < e:
            out.append((i, s - a, e - a))
        i += 1
    return out


class TensorSubject:
    """The weights of a TorchWorkload (any pool: ours, a core allocation's view, a peer's)."""

    def __init__(self, wl: TorchWorkload, tag: str = WEIGHTS_TAG):
        import torch

        self.wl = wl
        self.tag = tag
        views = [(t.data_ptr(), t.reshape(-1).view(torch.uint8)) for s, t in zip(wl.specs, wl.tensors)
                 if s.tag == tag]
        views.sort(key=lambda x: x[0])
        self._spans = [(p, v.numel()) for p, v in views]
        self._views = [v for _, v in views]
        self._starts = [p for p, _ in views]

    def spans(self) -> list[Span]:
        return list(self._spans)

    def rewrite(self, ranges: list[Span]) -> None:
        """Add 1 to every byte of the weights inside `ranges`, with kernels on the current stream."""
        for lo, n in ranges:
            for i, s, e in overlaps(self._starts, self._spans, lo, lo + n):
                self._views[i][s:e].add_(1)

    def remember(self) -> None:
        """Take the checksums that `verify` compares with (after a rewrite)."""
        self.wl.checksum(self.tag)

    def verify(self) -> None:
        self.wl.verify(self.tag)


class _DeviceBytes:
    """`nbytes` of device memory at `ptr` under the CUDA array interface, for a zero-copy torch view."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 2}


class CoreTensors(TorchWorkload):
    """The workload as allocations of the core `Allocator.cuda()` (its `malloc`, under each spec's tag), seen by
    torch through zero-copy uint8 views so that fills, rewrites and checksums run on the GPU."""

    def __init__(self, core: Any, specs: list[TensorSpec], device: int, seed: int = 0):
        super().__init__(specs, device=device, seed=seed)
        self.core = core
        self.addresses: list[int] = []

    def allocate(self, cumem: Any = None, progress: Any = None) -> None:
        import torch

        try:
            for spec in self.specs:
                self.core.push_tag(spec.tag)
                try:
                    addr = self.core.malloc(spec.nbytes, self.device)
                finally:
                    self.core.pop_tag()
                self.addresses.append(addr)
                view = torch.as_tensor(_DeviceBytes(addr, spec.nbytes), device=torch.device("cuda", self.device))
                if view.data_ptr() != addr:
                    raise RuntimeError("torch copied a core allocation instead of viewing it")
                self.tensors.append(view)
        except Exception:
            self.release()
            raise
        self.ptrs = [t.data_ptr() for t in self.tensors]

    def release(self) -> None:
        super().release()
        for addr in self.addresses:
            self.core.free(addr)
        self.addresses = []


def sim_allocator(scale: int, sizes: Iterable[int], compress: bool = False) -> Any:
    """A simulated core Allocator with the granularity of `scale` and room for allocations of `sizes`. Without
    `compress` its driver offers no codec: the copy path's rows would otherwise measure the sim's host codec
    (zstd on this machine's cores), not the copies; the compress rows ask for it."""
    from .. import Allocator

    gran = sim_granularity(scale)
    return Allocator.simulated(capacity=sum(round_up(n, gran) for n in sizes) + 16 * gran, granularity=gran,
                               compress=compress)


def release_tensors(ctx: Context, wl: TorchWorkload) -> None:
    """Drop a torch workload and let torch hand its segments back (through my_free for ours)."""
    wl.release()
    gc.collect()
    ctx.torch.cuda.empty_cache()


class SimSubject:
    """The weights as allocations of a simulated core Allocator; the bytes each must hold are kept on the host."""

    def __init__(self, alloc: Any, specs: list[TensorSpec], seed: int = 0, tag: str = WEIGHTS_TAG):
        self.alloc = alloc
        self.tag = tag
        self.wl = AllocatorWorkload(alloc, specs, seed=seed)
        self._spans: list[Span] = []
        self._expected: list[bytearray] = []

    def allocate(self) -> None:
        self.wl.allocate()
        self.wl.fill()
        for i, (spec, addr) in enumerate(zip(self.wl.specs, self.wl.addresses)):
            if spec.tag == self.tag:
                self._spans.append((addr, spec.nbytes))
                self._expected.append(bytearray(pattern_bytes(self.wl.seed, i, spec.nbytes)))
        order = sorted(range(len(self._spans)), key=lambda i: self._spans[i][0])
        self._spans = [self._spans[i] for i in order]
        self._expected = [self._expected[i] for i in order]

    def spans(self) -> list[Span]:
        return list(self._spans)

    def rewrite(self, ranges: list[Span]) -> None:
        starts = [a for a, _ in self._spans]
        for lo, n in ranges:
            for i, s, e in overlaps(starts, self._spans, lo, lo + n):
                new = bytes(self._expected[i][s:e]).translate(_PLUS_ONE)
                self.alloc.write(self._spans[i][0] + s, new)
                self._expected[i][s:e] = new

    def remember(self) -> None:
        pass  # rewrite keeps the expected bytes up to date

    def overwrite(self, content: Callable[[int, int], bytes]) -> None:
        """Write `content(nbytes, i)` over the whole of the i-th allocation (address order), and expect it."""
        for i, (addr, n) in enumerate(self._spans):
            data = content(n, i)
            self.alloc.write(addr, data)
            self._expected[i] = bytearray(data)

    def verify(self) -> None:
        live = {a["address"] for a in self.alloc.allocations()}
        for (addr, n), want in zip(self._spans, self._expected):
            if addr not in live:
                raise VerificationError(f"allocation at {addr:#x} is no longer live")
            if self.alloc.read(addr, n) != want:
                raise VerificationError(f"contents differ after wake (allocation at {addr:#x}, {n} B)")

    def release(self) -> None:
        self.wl.free()
        self._spans, self._expected = [], []


def equal_specs(count: int, size: int, tag: str = WEIGHTS_TAG) -> list[TensorSpec]:
    """`count` bf16 tensors of `size` bytes each under `tag`."""
    return [TensorSpec(f"alloc{i}", (size // 2,), size, tag) for i in range(count)]
