#!/usr/bin/env python3
"""Compile the CUDA C kernels in rust/kernels/ to the PTX that the crate embeds, with NVRTC from the
`nvidia-cuda-nvrtc-cu12==12.0.*` wheel (PTX ISA 8.0: it loads on every driver from CUDA 12.0 on; a newer NVRTC
would emit an ISA that older drivers refuse). No GPU and no CUDA toolkit are needed.

    python scripts/gen_ptx.py           # regenerate rust/kernels/*.ptx
    python scripts/gen_ptx.py --check   # fail if the committed PTX differs from what the source compiles to
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "rust" / "kernels"
# Oldest architecture whose PTX the driver JIT-compiles for every GPU with the VMM API we support (Volta on).
ARCH = "compute_70"
NVRTC_VERSION = (12, 0)


def find_nvrtc() -> str:
    candidates = []
    for entry in sys.path:
        candidates += glob.glob(os.path.join(entry, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.12"))
    if not candidates:
        sys.exit("libnvrtc.so.12 not found: pip install 'nvidia-cuda-nvrtc-cu12==12.0.*'")
    return candidates[0]


def check(nvrtc: ctypes.CDLL, r: int, what: str) -> None:
    if r != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit(f"{what} failed: {nvrtc.nvrtcGetErrorString(r).decode()}")


def compile_ptx(nvrtc: ctypes.CDLL, source: Path) -> str:
    prog = ctypes.c_void_p()
    check(
        nvrtc,
        nvrtc.nvrtcCreateProgram(
            ctypes.byref(prog), source.read_bytes(), source.name.encode(), 0, None, None
        ),
        "nvrtcCreateProgram",
    )
    opts = [f"--gpu-architecture={ARCH}".encode(), b"--std=c++14"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    r = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    log_size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size))
    log = ctypes.create_string_buffer(log_size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if r != 0:
        sys.exit(f"compiling {source.name} failed:\n{log.value.decode()}")
    size = ctypes.c_size_t()
    check(nvrtc, nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
    buf = ctypes.create_string_buffer(size.value)
    check(nvrtc, nvrtc.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.value.decode()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed PTX instead of writing it")
    ap.add_argument("--find", action="store_true", help="print the NVRTC library used and exit")
    args = ap.parse_args()
    if args.find:
        print(find_nvrtc())
        return 0
    nvrtc = ctypes.CDLL(find_nvrtc())
    major, minor = ctypes.c_int(), ctypes.c_int()
    check(nvrtc, nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    if (major.value, minor.value) != NVRTC_VERSION:
        sys.exit(f"NVRTC {major.value}.{minor.value} found; {NVRTC_VERSION[0]}.{NVRTC_VERSION[1]} is required")
    stale = []
    for source in sorted(KERNELS.glob("*.cu")):
        ptx = compile_ptx(nvrtc, source)
        target = source.with_suffix(".ptx")
        if args.check:
            if not target.exists() or target.read_text() != ptx:
                stale.append(target.name)
        else:
            target.write_text(ptx)
            print(f"wrote {target.relative_to(ROOT)} ({len(ptx)} bytes)")
    if stale:
        print(f"stale PTX (run scripts/gen_ptx.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    if args.check:
        print("PTX up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
