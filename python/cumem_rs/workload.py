"""The reference workload of every demo and benchmark figure, as data, and its materialisation.

Llama-3-8B in bf16 (291 weight tensors, about 15.0 GiB) under the tag "weights", plus one KV-cache tensor (48 GiB
at full scale) under "kv_cache". `scale` divides every tensor's element count (by dividing its first dimension,
never below one row), so a scaled workload keeps all 291 tensors and their proportions: a sleep still walks 291
allocations, only smaller ones.

Two materialisations share the specs:
- `AllocatorWorkload`: raw allocations of a core `Allocator` (simulated, or CUDA through host copies), filled with
  deterministic pseudo-random bytes and verified byte for byte.
- `TorchWorkload`: CUDA tensors created inside `CuMemAllocator.use_memory_pool(tag)`, filled on the GPU and
  verified with per-2-MiB-row checksums computed on the GPU (no second copy of 15 GiB needed).
"""

from __future__ import annotations

import argparse

import random
from dataclasses import dataclass
from typing import Any, Optional

GiB = 1 << 30
MiB = 1 << 20

WEIGHTS_TAG = "weights"
KV_TAG = "kv_cache"
BF16_BYTES = 2

# Llama-3-8B (config.json of meta-llama/Meta-Llama-3-8B).
HIDDEN = 4096
INTERMEDIATE = 14336
VOCAB = 128256
LAYERS = 32
HEADS = 32
KV_HEADS = 8
HEAD_DIM = 128
DEFAULT_KV_GIB = 48.0


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    nbytes: int
    tag: str


def _scaled(shape: tuple[int, ...], scale: int) -> tuple[int, ...]:
    # Dividing the first dimension keeps rows whole (a row is what a real kernel indexes) and at least one row.
    return (max(1, shape[0] // scale),) + shape[1:]


def _nbytes(shape: tuple[int, ...]) -> int:
    n = BF16_BYTES
    for d in shape:
        n *= d
    return n


def llama3_8b_weights(scale: int = 1) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, nbytes) of the 291 bf16 weight tensors, each divided by `scale`."""
    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale}")
    q_out = HEADS * HEAD_DIM
    kv_out = KV_HEADS * HEAD_DIM
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (HIDDEN,)),
            (f"{p}.self_attn.q_proj.weight", (q_out, HIDDEN)),
            (f"{p}.self_attn.k_proj.weight", (kv_out, HIDDEN)),
            (f"{p}.self_attn.v_proj.weight", (kv_out, HIDDEN)),
            (f"{p}.self_attn.o_proj.weight", (HIDDEN, q_out)),
            (f"{p}.post_attention_layernorm.weight", (HIDDEN,)),
            (f"{p}.mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{p}.mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (f"{p}.mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
        ]
    shapes += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    out = []
    for name, shape in shapes:
        s = _scaled(shape, scale)
        out.append((name, s, _nbytes(s)))
    return out


def kv_cache_spec(scale: int = 1, kv_gib: float = DEFAULT_KV_GIB) -> tuple[str, tuple[int, ...], int]:
    """(name, shape, nbytes) of the single bf16 KV-cache tensor: `kv_gib` GiB divided by `scale`."""
    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale}")
    elems = max(1, int(kv_gib * GiB) // BF16_BYTES // scale)
    return ("kv_cache", (elems,), elems * BF16_BYTES)


def reference_workload(scale: int = 1, kv_gib: float = DEFAULT_KV_GIB) -> list[TensorSpec]:
    """The weights (tag "weights") followed by the KV cache (tag "kv_cache"); kv_gib=0 leaves the KV cache out."""
    specs = [TensorSpec(n, s, b, WEIGHTS_TAG) for n, s, b in llama3_8b_weights(scale)]
    if kv_gib > 0:
        n, s, b = kv_cache_spec(scale, kv_gib)
        specs.append(TensorSpec(n, s, b, KV_TAG))
    return specs


def total_bytes(specs: list[TensorSpec], tag: Optional[str] = None) -> int:
    return sum(s.nbytes for s in specs if tag is None or s.tag == tag)


def round_up(n: int, granularity: int) -> int:
    return -(-n // granularity) * granularity


def sim_granularity(scale: int) -> int:
    """Granularity of the simulated device for a scaled workload: 2 MiB / scale (a power of two, >= 4 KiB), so the
    rounding overhead keeps the proportion it has on a GPU instead of dominating a small workload."""
    g = max(4096, (2 * MiB) // scale)
    return 1 << (g.bit_length() - 1)


class VerificationError(RuntimeError):
    """Data or addresses changed across a sleep/wake cycle."""


# ---------------------------------------------------------------------------------------------------------------
# Raw allocations of a core Allocator.

# Not a divisor of any page size or granularity: tiling it shifts the pattern from page to page, so a page mapped
# at the wrong offset, or two swapped pages, cannot read back equal.
_PATTERN_BYTES = 64 * 1024 + 13


def pattern_bytes(seed: int, index: int, nbytes: int) -> bytes:
    """Deterministic pseudo-random content of tensor `index`, regenerated for verification instead of kept."""
    pattern = random.Random(seed * 1_000_003 + index).randbytes(min(nbytes, _PATTERN_BYTES))
    reps, rest = divmod(nbytes, len(pattern)) if pattern else (0, 0)
    return pattern * reps + pattern[:rest]


class AllocatorWorkload:
    """The workload as raw allocations of a core `Allocator`, each allocated under its spec's tag."""

    def __init__(self, alloc: Any, specs: list[TensorSpec], seed: int = 0):
        self.alloc = alloc
        self.specs = specs
        self.seed = seed
        self.addresses: list[int] = []

    def allocate(self) -> None:
        for spec in self.specs:
            self.alloc.push_tag(spec.tag)
            try:
                self.addresses.append(self.alloc.malloc(spec.nbytes))
            finally:
                self.alloc.pop_tag()

    def fill(self, tag: Optional[str] = None) -> int:
        """Write every tensor (of `tag`, or all); returns bytes written."""
        written = 0
        for i, (spec, addr) in enumerate(zip(self.specs, self.addresses)):
            if tag is None or spec.tag == tag:
                self.alloc.write(addr, pattern_bytes(self.seed, i, spec.nbytes))
                written += spec.nbytes
        return written

    def verify(self, tag: str = WEIGHTS_TAG, addresses: Optional[list[int]] = None) -> int:
        """Raise VerificationError unless every tensor of `tag` reads back bit-identical (and, given `addresses`,
        sits at the same address). Returns bytes verified."""
        if addresses is not None and addresses != self.addresses:
            raise VerificationError("allocation addresses changed across sleep/wake")
        live = {a["address"] for a in self.alloc.allocations()}
        checked = 0
        for i, (spec, addr) in enumerate(zip(self.specs, self.addresses)):
            if spec.tag != tag:
                continue
            if addr not in live:
                raise VerificationError(f"{spec.name}: allocation at {addr:#x} is no longer live")
            if self.alloc.read(addr, spec.nbytes) != pattern_bytes(self.seed, i, spec.nbytes):
                raise VerificationError(f"{spec.name}: contents differ after wake (at {addr:#x}, {spec.nbytes} B)")
            checked += spec.nbytes
        return checked

    def free(self) -> None:
        for addr in self.addresses:
            self.alloc.free(addr)
        self.addresses = []


# ---------------------------------------------------------------------------------------------------------------
# CUDA tensors through CuMemAllocator.

# Checksum granularity: one int64 sum per 2 MiB (the GPU's VMM granularity), so a page restored at the wrong place
# changes the row sums even though it would keep a whole-tensor sum.
_ROW_WORDS = (2 * MiB) // 8


def fingerprint(t: Any) -> Any:
    """Per-2-MiB-row int64 sums of a contiguous tensor's bytes (plus its tail), computed where the tensor lives.
    Integer sums wrap identically in any order, so equal bytes always give equal fingerprints."""
    import torch

    u8 = t.detach().reshape(-1).view(torch.uint8)
    n8 = u8.numel() - u8.numel() % 8
    words = u8[:n8].view(torch.int64)
    rows = words.numel() // _ROW_WORDS
    parts = []
    if rows:
        parts.append(words[: rows * _ROW_WORDS].view(rows, _ROW_WORDS).sum(dim=1))
    parts.append(words[rows * _ROW_WORDS :].sum().reshape(1))
    parts.append(u8[n8:].to(torch.int64).sum().reshape(1))
    return torch.cat(parts)


class TorchWorkload:
    """The workload as bf16 CUDA tensors allocated inside `use_memory_pool(tag)` of a CuMemAllocator."""

    def __init__(self, specs: list[TensorSpec], device: Any = "cuda", seed: int = 0):
        self.specs = specs
        self.device = device
        self.seed = seed
        self.tensors: list[Any] = []
        self.ptrs: list[int] = []
        self._fingerprints: list[Any] = []

    def allocate(self, cumem: Any, progress: Any = None) -> None:
        """One `use_memory_pool(tag)` block per run of same-tag specs, as a model loader does: torch then packs
        small tensors into shared segments instead of giving each its own."""
        import itertools

        import torch

        for tag, group in itertools.groupby(self.specs, key=lambda s: s.tag):
            with cumem.use_memory_pool(tag=tag):
                for spec in group:
                    self.tensors.append(torch.empty(spec.shape, dtype=torch.bfloat16, device=self.device))
                    if progress is not None:
                        progress()
        self.ptrs = [t.data_ptr() for t in self.tensors]

    def fill(self, tag: str = WEIGHTS_TAG) -> int:
        """Random bits (not random bf16 values: every bit pattern, NaNs included, must survive the round trip)."""
        import torch

        gen = torch.Generator(device=torch.device(self.device))  # an int index means that CUDA device
        gen.manual_seed(self.seed)
        written = 0
        for spec, t in zip(self.specs, self.tensors):
            if spec.tag == tag:
                t.reshape(-1).view(torch.uint8).random_(0, 256, generator=gen)
                written += spec.nbytes
        return written

    def checksum(self, tag: str = WEIGHTS_TAG) -> None:
        self._fingerprints = [fingerprint(t) for spec, t in zip(self.specs, self.tensors) if spec.tag == tag]

    def verify(self, tag: str = WEIGHTS_TAG) -> int:
        """Raise VerificationError unless data_ptrs are unchanged and every tensor of `tag` matches its checksum."""
        import torch

        if [t.data_ptr() for t in self.tensors] != self.ptrs:
            raise VerificationError("tensor data_ptr() changed across sleep/wake")
        checked = 0
        mine = [(spec, t) for spec, t in zip(self.specs, self.tensors) if spec.tag == tag]
        for (spec, t), want in zip(mine, self._fingerprints):
            if not torch.equal(fingerprint(t), want):
                raise VerificationError(f"{spec.name}: contents differ after wake ({spec.nbytes} B)")
            checked += spec.nbytes
        return checked

    def release(self) -> None:
        self.tensors = []
        self._fingerprints = []


def add_workload_arguments(
    p: "argparse.ArgumentParser",
    *,
    sim_scale: int,
    kv_gib: float,
    cycles: Optional[int],
    cycles_help: str,
    target: str = "the GPU",
    kv_help: str = "KV cache size in GiB before scaling",
) -> None:
    """The flags every command over the reference workload shares (demo, bench, bench-multi)."""
    p.add_argument("--backend", choices=["auto", "sim", "cuda"], default="auto",
                   help=f"cuda: {target} through CuMemAllocator; sim: the simulated device; auto: cuda when a GPU "
                        "and CUDA torch are present (default)")
    p.add_argument("--scale", type=int, default=None,
                   help=f"divide every tensor of the workload by N (default 1 on cuda, {sim_scale} on sim)")
    p.add_argument("--kv-gib", type=float, default=kv_gib, help=f"{kv_help} (default {kv_gib:g}; 0 = none)")
    # cycles=None: the caller's help says what each use defaults to.
    p.add_argument("--cycles", type=int, default=cycles,
                   help=cycles_help if cycles is None else f"{cycles_help} (default {cycles})")

