"""Where nvCOMP 6 is installed, for the CUDA codec that compresses backups on the GPU.

The `nvidia-libnvcomp-cu13` / `-cu12` wheels (extras `cumem_rs[nvcomp-cu13]` / `[nvcomp-cu12]`) are found on
`sys.path` without importing anything of theirs, and their library paths are handed to the native
module when `cumem_rs` is imported, before the CUDA driver loads. The native side picks the wheel whose CUDA major
fits the running driver, falls back to `libnvcomp.so.6` through the system loader, and `CUMEM_RS_NVCOMP_LIB`
(a path) overrides both. Where none loads, backups are stored uncompressed, as without the extra.
"""

from __future__ import annotations

import os
from typing import Any

from . import _env

# (CUDA major, prefix of the wheel's .dist-info directory), newest first.
WHEELS = ((13, "nvidia_libnvcomp_cu13-"), (12, "nvidia_libnvcomp_cu12-"))
# Where both wheels put the library, inside the `nvidia` namespace package.
LIBRARY = os.path.join("libnvcomp", "lib64", "libnvcomp.so.6")


def wheel_libraries() -> list[tuple[int, str]]:
    """(CUDA major, absolute path of libnvcomp.so.6) of every installed nvCOMP wheel whose library is there.

    Cheap enough for `import cumem_rs`: it looks in every entry of `sys.path` for `nvidia/libnvcomp/...` and the
    wheels' .dist-info beside it, importing nothing (importlib.metadata alone costs more than that). Not through
    the `nvidia` package: some of the nvidia wheels that torch installs make it a regular package (with an
    `__init__.py`), and then its other directories are not part of it."""
    import sys

    found = []
    seen = set()
    for entry in sys.path:
        site = os.path.abspath(entry or os.curdir)
        if site in seen:
            continue
        seen.add(site)
        lib = os.path.join(site, "nvidia", LIBRARY)
        if not os.path.isfile(lib):
            continue
        try:
            names = os.listdir(site)
        except OSError:
            continue
        for major, prefix in WHEELS:
            if any(n.startswith(prefix) and n.endswith(".dist-info") for n in names):
                found.append((major, lib))
    return found


def hand_over(native: Any) -> None:
    """Give the native module the installed wheels' paths. Never raises: nvCOMP is optional, and a broken
    metadata entry must not break `import cumem_rs`."""
    try:
        native.set_nvcomp_wheels(wheel_libraries())
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def status_lines() -> list[str]:
    """What `python -m cumem_rs info` says of compression: the active codec and where it comes from, or why none."""
    from . import _native

    active, text = _native.cuda_codec_status()
    lines = [f"codec: {'active: ' if active else 'none: '}{text}"]
    if active:
        from . import Allocator

        for d in range(Allocator.cuda().device_count()):
            ring = _native.cuda_codec_device_bytes(d)
            lines.append(f"  device {d}: staging ring {ring / (1 << 20):.0f} MiB" if ring else
                         f"  device {d}: no staging ring (not used yet, or its memory could not be had)")
    wheels = wheel_libraries()
    if _env.text(_env.NVCOMP_LIB):
        lines.append(f"  {_env.NVCOMP_LIB}={_env.text(_env.NVCOMP_LIB)}")
    for major, path in wheels:
        lines.append(f"  installed: nvidia-libnvcomp-cu{major} ({path})")
    if not wheels and not active:
        lines.append("  install cumem_rs[nvcomp-cu13] (or [nvcomp-cu12] for a CUDA 12 driver) to compress backups")
    return lines
