"""cumem_rs: put PyTorch GPU memory to sleep and wake it up at the same virtual addresses.

`Allocator` is the core (Rust) allocator over a driver: `Allocator.cuda()` for the GPU, `Allocator.simulated()`
for the host-emulated device. `CuMemAllocator` is the vLLM-compatible torch layer; it is imported lazily so that
`import cumem_rs` works without torch.

Errors: everything raised is a `CumemError` (a `RuntimeError`); a bad argument is a `CumemValueError` or
`CumemTypeError`, which are also a `ValueError` / `TypeError`. The dicts the allocator returns are typed in
`cumem_rs.results`.
"""

from ._native import (
    FAULT_ERRORS,
    FAULT_OPS,
    Allocator,
    ClosedError,
    CumemError,
    CumemOutOfMemoryError,
    CumemTypeError,
    CumemValueError,
    DriverError,
    __version__,
    cuda_available,
)
from .logs import forward_native_logs
from . import _native as _native_module
from ._nvcomp import hand_over as _hand_over_nvcomp

# Before anything can load the CUDA driver (which opens nvCOMP once): where the nvCOMP wheels are.
_hand_over_nvcomp(_native_module)

__all__ = [
    "Allocator",
    "ClosedError",
    "CuMemAllocator",
    "CumemError",
    "CumemOutOfMemoryError",
    "CumemTypeError",
    "CumemValueError",
    "DriverError",
    "FAULT_ERRORS",
    "FAULT_OPS",
    "__version__",
    "cuda_available",
    "forward_native_logs",
]


def __getattr__(name: str):
    if name == "CuMemAllocator":
        from .allocator import CuMemAllocator

        return CuMemAllocator
    raise AttributeError(f"module 'cumem_rs' has no attribute {name!r}")
