"""nvCOMP for the codec's CUDA tests, on a machine with a GPU (used by `scripts/dev.sh test`).

    python scripts/nvcomp_extra.py install   # on a GPU machine: the nvCOMP wheel of torch's CUDA major
    python scripts/nvcomp_extra.py summary   # one line: whether the codec's CUDA tests ran here, or why not

`install` does nothing without a GPU (no `nvidia-smi` on PATH and `cumem_rs.cuda_available()` False): CPU-only
machines need no nvCOMP, and those tests skip there like every GPU test. With a GPU it installs the requirement
of the package's extra `nvcomp-cu<major>` (pyproject.toml), <major> being torch's CUDA major, unless a wheel of
that major is installed already. It never fails the run: when pip cannot install it (registry unreachable, no
such wheel) it warns, and the summary line says that the codec's CUDA tests were skipped and why.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
# Seconds pip waits on the network per try, and its retries: an unreachable registry costs well under a minute.
PIP = [sys.executable, "-m", "pip", "install", "-q", "--timeout", "15", "--retries", "1"]


def has_gpu() -> bool:
    """A GPU as the project sees one: the NVIDIA driver's tool on PATH, or cumem_rs finds a VMM-capable device."""
    if shutil.which("nvidia-smi"):
        return True
    try:
        import cumem_rs

        return cumem_rs.cuda_available()
    except Exception:  # noqa: BLE001 - no usable extension: no GPU that the tests could use either
        return False


def torch_cuda_major() -> Optional[int]:
    """The CUDA major torch was built for (None: a CPU-only torch, or no torch)."""
    try:
        import torch
    except ImportError:
        return None
    version = torch.version.cuda
    return int(version.split(".")[0]) if version else None


def extra_requirement(major: int, pyproject: str) -> Optional[str]:
    """The requirement of the extra `nvcomp-cu<major>` in the text of pyproject.toml (None: no such extra)."""
    m = re.search(rf'^nvcomp-cu{major}\s*=\s*\[\s*"([^"]+)"\s*\]', pyproject, re.M)
    return m[1] if m else None


def installed_majors() -> list[int]:
    """CUDA majors of the nvCOMP wheels installed where this Python finds them (as `import cumem_rs` does)."""
    try:
        from cumem_rs._nvcomp import wheel_libraries
    except Exception:  # noqa: BLE001 - no usable cumem_rs: count nothing as installed
        return []
    return [m for m, _ in wheel_libraries()]


def plan(gpu: bool, major: Optional[int], installed: Sequence[int], pyproject: str) -> tuple[Optional[str], str]:
    """(requirement to install or None, why not): what `install` does with these facts."""
    if not gpu:
        return None, "no GPU here: nothing to install"
    if major is None:
        return None, "torch here has no CUDA build: no nvCOMP wheel fits it"
    if major in installed:
        return None, f"nvidia-libnvcomp-cu{major} is installed"
    requirement = extra_requirement(major, pyproject)
    if requirement is None:
        return None, f"the package has no nvCOMP extra for torch's CUDA {major} (extras nvcomp-cu12, nvcomp-cu13)"
    return requirement, ""


def install(gpu: bool, major: Optional[int], installed: Sequence[int], pyproject: str,
            pip: Sequence[str] = PIP) -> bool:
    """Install what `plan` says, through `pip` (a command line the requirement is appended to). Returns whether an
    nvCOMP wheel for torch's CUDA major is there afterwards; warns on stderr, never raises, when it is not."""
    requirement, why = plan(gpu, major, installed, pyproject)
    if requirement is None:
        present = gpu and major is not None and major in installed
        if gpu and not present:
            print(f"warning: {why}; the codec's CUDA tests will skip", file=sys.stderr)
        return present
    try:
        ok = subprocess.run([*pip, requirement], timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"warning: pip could not be run ({e})", file=sys.stderr)
        ok = False
    if not ok:
        print(f"warning: could not install {requirement} (registry unreachable?); the codec's CUDA tests will skip",
              file=sys.stderr)
    return ok


def summary(gpu: bool) -> str:
    """One line on the codec's CUDA tests (tests/test_nvcomp_cuda.py, the compressed cases of the GPU suite)."""
    if not gpu:
        return "codec CUDA tests: skipped (no GPU here)"
    try:
        import cumem_rs
        from cumem_rs import _native

        cumem_rs.Allocator.cuda().mem_info(0)  # sets device 0 up, as the tests do
        active, text = _native.cuda_codec_status()
    except Exception as e:  # noqa: BLE001 - the line must say why, whatever went wrong
        return f"codec CUDA tests: SKIPPED ({type(e).__name__}: {e})"
    return f"codec CUDA tests: ran ({text})" if active else f"codec CUDA tests: SKIPPED (no codec: {text})"


def main(argv: Sequence[str]) -> int:
    if list(argv) == ["install"]:
        gpu = has_gpu()
        major, installed = (torch_cuda_major(), installed_majors()) if gpu else (None, [])
        install(gpu, major, installed, (ROOT / "pyproject.toml").read_text())
        return 0
    if list(argv) == ["summary"]:
        print(summary(has_gpu()))
        return 0
    print("usage: nvcomp_extra.py {install|summary}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
