"""The weights of the RL-loop table and what a training step does to them: filled like trained bf16 weights
(`normal_() * 0.02`, which the codec shrinks to about 2/3), a fraction of their chunks rewritten with fresh values
of the same distribution (so the codec's ratio stays what it is on real weights, cycle after cycle), and checked
after every wake against the last writes.

`GpuRlWeights`: the weights tensors of a `TorchWorkload` in CuMemAllocator's pools; fills, rewrites and checksums
(per-2-MiB-row sums, `workload.fingerprint`) run on the device. `SimRlWeights`: allocations of a simulated core
Allocator, the expected bytes kept on the host and compared byte for byte.
"""

from __future__ import annotations

import random
from typing import Any

from ..workload import KV_TAG, WEIGHTS_TAG, TensorSpec, TorchWorkload, VerificationError
from .compress_data import fill_tensors, sim_bytes
from .subjects import Span, overlaps, choose_chunks

#: The spread of trained bf16 weights (what `normal_() * STD` gives compresses as real checkpoints do).
STD = 0.02


def chunks_to_rewrite(spans: list[Span], chunk: int, fraction: float, rng: random.Random) -> list[Span]:
    """`fraction` of the `chunk`-aligned chunks of `spans`, chosen at random over all of them (so over every
    tensor), neighbouring chunks merged into one range (fewer kernels; the bytes are the same)."""
    merged: list[Span] = []
    for lo, n in choose_chunks(spans, chunk, fraction, rng):
        if merged and merged[-1][0] + merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((lo, n))
    return merged


class GpuRlWeights:
    """The weights tensors of `wl` (allocated by the caller) as bf16 on their device."""

    def __init__(self, torch: Any, wl: TorchWorkload, chunk: int, seed: int = 0, tag: str = WEIGHTS_TAG):
        self.torch = torch
        self.wl = wl
        self.tag = tag
        self.chunk = chunk
        self.seed = seed
        self._calls = 0
        mine = sorted(((t.data_ptr(), t.reshape(-1).view(torch.bfloat16)) for s, t in zip(wl.specs, wl.tensors)
                       if s.tag == tag), key=lambda x: x[0])
        self._spans = [(p, v.numel() * 2) for p, v in mine]
        self._starts = [p for p, _ in self._spans]
        self._views = [v for _, v in mine]

    def spans(self) -> list[Span]:
        return list(self._spans)

    def fill(self) -> None:
        fill_tensors(self.torch, self._views, "bf16", self.seed)
        self.wl.checksum(self.tag)

    def rewrite(self, fraction: float, rng: random.Random) -> int:
        """Fresh `normal_() * STD` values over `fraction` of the chunks; returns the bytes written. Takes the
        checksums `verify` compares with."""
        self._calls += 1
        gen = self.torch.Generator(device=self._views[0].device).manual_seed(self.seed * 7919 + self._calls)
        written = 0
        for lo, n in chunks_to_rewrite(self._spans, self.chunk, fraction, rng):
            for i, s, e in overlaps(self._starts, self._spans, lo, lo + n):
                # Chunk bounds and bf16 tensors are both even addresses: s and e are whole elements.
                self._views[i][s // 2:e // 2].normal_(generator=gen).mul_(STD)
                written += e - s
        self.wl.checksum(self.tag)
        return written

    def verify(self) -> None:
        self.wl.verify(self.tag)


class SimRlWeights:
    """The workload's specs as allocations of a simulated core Allocator (weights and KV cache under their tags);
    the weights hold bf16-like bytes."""

    def __init__(self, alloc: Any, specs: list[TensorSpec], chunk: int, seed: int = 0):
        self.alloc = alloc
        self.specs = specs
        self.chunk = chunk
        self.seed = seed
        self.addresses: list[int] = []
        self._spans: list[Span] = []
        self._expected: list[bytearray] = []
        self._calls = 0

    def allocate(self) -> None:
        for spec in self.specs:
            self.alloc.push_tag(spec.tag)
            try:
                addr = self.alloc.malloc(spec.nbytes)
            finally:
                self.alloc.pop_tag()
            self.addresses.append(addr)
            if spec.tag == WEIGHTS_TAG:
                self._spans.append((addr, spec.nbytes))
                self._expected.append(bytearray(spec.nbytes))
        order = sorted(range(len(self._spans)), key=lambda i: self._spans[i][0])
        self._spans = [self._spans[i] for i in order]
        self._expected = [self._expected[i] for i in order]

    def kv_addresses(self) -> list[int]:
        return [a for s, a in zip(self.specs, self.addresses) if s.tag == KV_TAG]

    def spans(self) -> list[Span]:
        return list(self._spans)

    def fill(self) -> None:
        for i, (addr, n) in enumerate(self._spans):
            data = sim_bytes("bf16", n, self.seed * 1_000_003 + i)
            self.alloc.write(addr, data)
            self._expected[i][:] = data

    def rewrite(self, fraction: float, rng: random.Random) -> int:
        self._calls += 1
        starts = [a for a, _ in self._spans]
        written = 0
        for k, (lo, n) in enumerate(chunks_to_rewrite(self._spans, self.chunk, fraction, rng)):
            for i, s, e in overlaps(starts, self._spans, lo, lo + n):
                data = sim_bytes("bf16", e - s, (self.seed * 7919 + self._calls) * 1_000_003 + k)
                self.alloc.write(self._spans[i][0] + s, data)
                self._expected[i][s:e] = data
                written += e - s
        return written

    def verify(self) -> None:
        live = {a["address"] for a in self.alloc.allocations()}
        for (addr, n), want in zip(self._spans, self._expected):
            if addr not in live:
                raise VerificationError(f"allocation at {addr:#x} is no longer live")
            if self.alloc.read(addr, n) != want:
                raise VerificationError(f"contents differ after wake (allocation at {addr:#x}, {n} B)")

    def free(self) -> None:
        for addr in self.addresses:
            self.alloc.free(addr)
        self.addresses, self._spans, self._expected = [], [], []
