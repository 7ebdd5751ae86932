"""`get_cpu_backup`'s tensors: a view of a raw host backup where it lies (zero copy), or a copy of it.

A zero-copy tensor's storage is the backup's own host memory (`Allocator.view_backup` hands out a `HostBytes`
for it); the tensor keeps that object alive, and it keeps the bytes mapped, so the tensor never dangles: once the
backup is released (a resume that does not retain it, a free, the allocator closed) or moved, the tensor shows
the bytes as they were then, and its memory goes back to the OS with the last tensor over it.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from ._native import HostBytes


def tensor_over(view: HostBytes, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor of `dtype` and `shape` whose storage is the first `nbytes` bytes of `view`."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = (ctypes.c_uint8 * nbytes).from_address(view.address)
    # torch.frombuffer keeps `raw` alive for the tensor's storage; `raw` keeps the view, the view the bytes.
    raw._cumem_view = view  # type: ignore[attr-defined]
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)


def tensor_of_bytes(data: bytes, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor of `dtype` and `shape` holding a copy of the first `nbytes` bytes of `data`."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data[:nbytes]), dtype=torch.uint8).view(dtype).view(shape)


def copy_of(
    view: Optional[HostBytes], nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> Optional[torch.Tensor]:
    """A copy of the bytes of `view` (None: None), as a tensor that owns its memory."""
    if view is None:
        return None
    return tensor_over(view, nbytes, dtype, shape).clone()
