"""The weights the compress rows sleep, on either backend, and the data they are filled with.

`GpuWeights` are views of core `Allocator.cuda()` allocations (fills and checksums are torch kernels on the GPU);
`SimWeights` are allocations of a simulated core Allocator (the expected bytes are kept on the host). Both fill
with a named kind of data: "bf16" (like trained weights: `normal_() * 0.02`, which compresses to about 2/3) or
"random" (uniformly random bytes, as `torch.randint(0, 256)` gives: incompressible, stored raw by the codec).
"""

from __future__ import annotations

import os
from typing import Any

from ..workload import WEIGHTS_TAG, TensorSpec
from .subjects import CoreTensors, SimSubject, TensorSubject

KINDS = ("bf16", "random")


def fill_tensors(torch: Any, tensors: list, kind: str, seed: int = 0) -> None:
    """Fill CUDA tensors (any dtype, contiguous) with `kind` of data, generated on their device."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    for i, t in enumerate(tensors):
        gen = torch.Generator(device=t.device).manual_seed(seed * 1_000_003 + i)
        raw = t.reshape(-1).view(torch.uint8)
        if kind == "bf16":
            raw.view(torch.bfloat16).normal_(generator=gen).mul_(0.02)
        else:
            raw.random_(0, 256, generator=gen)


def sim_bytes(kind: str, nbytes: int, seed: int) -> bytes:
    """`nbytes` of `kind` of data on the host. bf16 needs torch (CPU): without it the bytes are random, which the
    sim's codec stores raw (the rows still run)."""
    if kind == "bf16":
        try:
            import torch
        except ImportError:
            return os.urandom(nbytes)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn((nbytes + 1) // 2, generator=gen).mul_(0.02).to(torch.bfloat16)
        return x.view(torch.uint8)[:nbytes].numpy().tobytes()
    if kind == "random":
        return os.urandom(nbytes)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


class GpuWeights:
    """The allocations of `specs` under their tags in the core CUDA allocator, as torch views."""

    def __init__(self, ctx: Any, core: Any, specs: list[TensorSpec], seed: int = 0,
                 views: CoreTensors | None = None):
        self.torch = ctx.torch
        self.seed = seed
        self.views = views or CoreTensors(core, specs, ctx.device)
        self._own = views is None
        self.subject: Any = TensorSubject(self.views) if views is not None else None

    def allocate(self) -> None:
        self.views.allocate()
        self.subject = TensorSubject(self.views)

    def fill(self, kind: str) -> None:
        fill_tensors(self.torch, self.weights(), kind, self.seed)
        self.subject.remember()

    def weights(self) -> list:
        return [t for s, t in zip(self.views.specs, self.views.tensors) if s.tag == WEIGHTS_TAG]

    def verify(self) -> None:
        self.subject.verify()

    def release(self) -> None:
        if self._own:  # views handed in belong to the caller
            self.views.release()


class SimWeights:
    """The allocations of `specs` in a simulated core Allocator."""

    def __init__(self, alloc: Any, specs: list[TensorSpec], seed: int = 0):
        self.seed = seed
        self.subject = SimSubject(alloc, specs, seed=seed)

    def allocate(self) -> None:
        self.subject.allocate()

    def fill(self, kind: str) -> None:
        self.subject.overwrite(lambda n, i: sim_bytes(kind, n, self.seed * 1_000_003 + i))

    def verify(self) -> None:
        self.subject.verify()

    def release(self) -> None:
        self.subject.release()
