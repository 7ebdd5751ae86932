#!/usr/bin/env bash
# vLLM's own Python modules for tests/test_vllm_plugin.py, taken from the vLLM 0.33.0 release wheel into DEST:
# the sleep-mode backend registry, the allocator, the plugin loader, the platform layer and what they import (about
# 1 MiB), plus, for reading only, the sources of vLLM's config and worker that the plugin relies on. No compiled
# extension: vLLM's allocator module then imports on any machine, as in a vLLM build without CUDA, and nothing of
# vLLM goes into the Python environment (importing vLLM changes process-wide torch settings, so the tests import it
# only in child processes, with DEST on their PYTHONPATH).
#
#   scripts/vllm_files.sh [DEST [PYTHON_VERSION]]      DEST defaults to .vllm_src (ignored by git)
#
# These modules also import `regex` and `psutil`. With PYTHON_VERSION (e.g. 3.12) their wheels for that Python are
# unpacked into DEST/deps as well, for a machine that lacks them and has no network (the tests put DEST/deps after
# the installed packages, so an installed copy wins); without it, pip-install them.
# Needs network (or pip's cache) and pip; PYTHON selects the interpreter that runs pip (default python3).
set -euo pipefail
VLLM_VERSION=0.33.0
DEST=${1:-.vllm_src}
PYVER=${2:-}
PYTHON=${PYTHON:-python3}

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# Only its .py files are taken, so the wheel's own tags need not fit this machine (vLLM needs Python >= 3.11 and
# glibc 2.28).
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 "vllm==$VLLM_VERSION" -d "$TMP/vllm"
if [ -n "$PYVER" ]; then
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    regex psutil -d "$TMP/deps"
fi

"$PYTHON" - "$TMP" "$DEST" "$VLLM_VERSION" <<'PY'
import shutil
import sys
import zipfile
from pathlib import Path, PurePosixPath

tmp, dest, version = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
# Every .py directly in these packages.
PACKAGES = {"vllm/device_allocator", "vllm/logging_utils", "vllm/platforms", "vllm/utils", "vllm/ray"}
FILES = {
    "vllm/__init__.py", "vllm/_version.py", "vllm/version.py", "vllm/env_override.py", "vllm/envs.py",
    "vllm/logger.py", "vllm/plugins/__init__.py", "vllm/third_party/__init__.py", "vllm/third_party/pynvml.py",
    "vllm/v1/__init__.py", "vllm/v1/attention/__init__.py", "vllm/v1/attention/backends/__init__.py",
    "vllm/v1/attention/backends/registry.py",
    # Read by the tests, not imported (they need vLLM's full dependencies).
    "vllm/config/vllm.py", "vllm/v1/worker/worker_base.py", "vllm/v1/worker/gpu_worker.py",
}

def wanted(name: str) -> bool:
    path = PurePosixPath(name)
    return name.endswith(".py") and (name in FILES or str(path.parent) in PACKAGES)

if dest.exists():
    shutil.rmtree(dest)
dest.mkdir(parents=True)
(wheel,) = (tmp / "vllm").glob(f"vllm-{version}-*.whl")
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if wanted(n)]
    missing = FILES - set(names)
    if missing:
        sys.exit(f"vllm {version} wheel lacks {sorted(missing)}")
    z.extractall(dest, names)
for dep in sorted((tmp / "deps").glob("*.whl")):
    with zipfile.ZipFile(dep) as z:
        z.extractall(dest / "deps", [n for n in z.namelist() if ".dist-info/" not in n])
(dest / "VLLM_VERSION").write_text(version + "\n")
size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
print(f"vllm {version}: {len(names)} files, {size / 2**20:.1f} MiB in {dest}")
PY
