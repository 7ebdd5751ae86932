"""What a machine without a GPU (CI) must get: clear errors instead of crashes, and a loadable allocator library.

The first tests assert the no-GPU behaviour and skip where a GPU is present. The C-symbol tests run everywhere:
torch loads `my_malloc`/`my_free` from the extension's shared library, so they must be exported and must never
abort the process, whatever they are given.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import textwrap

import pytest

import cumem_rs
from cumem_rs import Allocator, CumemError, _native

HAS_CUDA = cumem_rs.cuda_available()
no_gpu_only = pytest.mark.skipif(HAS_CUDA, reason="asserts the behaviour without a GPU; this machine has one")


@no_gpu_only
def test_cuda_available_is_false() -> None:
    assert cumem_rs.cuda_available() is False


@no_gpu_only
def test_core_cuda_allocator_raises() -> None:
    with pytest.raises(CumemError):
        Allocator.cuda()


@no_gpu_only
def test_cumem_allocator_get_instance_names_missing_gpu() -> None:
    pytest.importorskip("torch")
    from cumem_rs import CuMemAllocator

    with pytest.raises(CumemError) as info:
        CuMemAllocator.get_instance()
    message = str(info.value)
    assert "GPU" in message and ("CUDA" in message or "driver" in message), message
    # A failed construction must not leave a half-made singleton behind.
    assert CuMemAllocator.instance is None
    assert isinstance(info.value, RuntimeError)


def _nm_defined_symbols(path: str) -> set[str]:
    out = subprocess.run(
        ["nm", "-D", "--defined-only", path], check=True, capture_output=True, text=True
    ).stdout
    # Lines look like "0000000000012340 T my_malloc"; the name is the last field.
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


@pytest.mark.parametrize("name", ["my_malloc", "my_free"])
def test_c_symbols_are_exported(name: str) -> None:
    path = _native.__file__
    if shutil.which("nm"):
        symbols = _nm_defined_symbols(path)
        assert name in symbols, f"{name} is not a defined dynamic symbol of {path}"
    lib = ctypes.CDLL(path)
    assert getattr(lib, name) is not None  # raises AttributeError when the symbol cannot be resolved


# Runs in a fresh interpreter so that an abort (panic across the C boundary, failed assertion) shows up as a
# non-zero exit code instead of killing pytest. torch's CUDAPluggableAllocator calls exactly these signatures:
#   void* my_malloc(ssize_t size, int device, cudaStream_t stream)
#   void  my_free(void* ptr, ssize_t size, int device, cudaStream_t stream)
_FFI_SCRIPT = textwrap.dedent(
    """
    import ctypes, sys
    import cumem_rs
    from cumem_rs import _native

    lib = ctypes.CDLL(_native.__file__)
    lib.my_malloc.restype = ctypes.c_void_p
    lib.my_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.my_free.restype = None
    lib.my_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]

    bogus = 0x7F0000001000  # page-aligned, never handed out by my_malloc
    if cumem_rs.cuda_available():
        core = cumem_rs.Allocator.cuda()
        errors_before = len(core.errors())
        usage_before = core.usage()
        lib.my_free(bogus, 4096, 0, None)
        assert len(core.errors()) > errors_before, "my_free of a bogus pointer recorded no error"
        # A real round trip through the C entry points.
        ptr = lib.my_malloc(1 << 20, 0, None)
        assert ptr, "my_malloc failed on a GPU machine"
        assert core.usage() > usage_before
        lib.my_free(ptr, 1 << 20, 0, None)
        assert core.usage() == usage_before
    else:
        # No engine exists to record into: failures go to the module-level list.
        errors_before = len(_native.ffi_errors())
        ptr = lib.my_malloc(1 << 20, 0, None)
        assert ptr is None, "my_malloc must return NULL without a GPU, got %#x" % ptr
        lib.my_free(bogus, 4096, 0, None)
        errors = _native.ffi_errors()[errors_before:]
        assert any(e.startswith("my_free(") for e in errors), errors
        # Still alive and still consistent after the failed calls.
        assert cumem_rs.cuda_available() is False
    print("ffi-ok")
    """
)


def test_ffi_entry_points_never_abort() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _FFI_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "ffi-ok" in proc.stdout


# A panic inside an entry point must be caught there: unwinding into torch's C++ would abort the process.
_PANIC_SCRIPT = textwrap.dedent(
    """
    import ctypes, os
    import cumem_rs
    from cumem_rs import _native

    lib = ctypes.CDLL(_native.__file__)
    lib.my_free.restype = None
    lib.my_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    recorded = cumem_rs.Allocator.cuda().errors if cumem_rs.cuda_available() else _native.ffi_errors
    before = len(recorded())
    _native._panic_in_next_ffi_call(True)
    lib.my_free(0x7F0000001000, 4096, 0, None)
    errors = recorded()[before:]
    assert len(errors) == 1 and "panic" in errors[0], errors
    # The recorded text carries the panic's own message, not a placeholder.
    assert "test hook" in errors[0], errors
    print("panic-caught")
    """
)


def test_panic_inside_ffi_is_caught_and_recorded() -> None:
    if not hasattr(_native, "_panic_in_next_ffi_call"):
        pytest.skip("this build has no panic test hook")
    proc = subprocess.run(
        [sys.executable, "-c", _PANIC_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "panic-caught" in proc.stdout
