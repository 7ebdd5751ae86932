#!/usr/bin/env bash
# vLLM's own Python modules for tests/test_vllm_plugin.py and tests/test_vllm_cumem.py, taken from the vLLM 0.33.0
# release wheel into DEST: the sleep-mode backend registry, the allocator, the plugin loader, the platform layer, the
# CUDA-graph pool routing and NCCL graph allocator (vllm/compilation/cudagraph_pool.py and what it imports) and what
# they import (about 1 MiB), plus, for reading only, the sources of vLLM's config and worker that the plugin relies
# on. No compiled extension: vLLM's allocator module then imports on any machine, as in a vLLM build without CUDA,
# and nothing of vLLM goes into the Python environment (importing vLLM changes process-wide torch settings, so the
# tests import it only in child processes, with DEST on their PYTHONPATH). Packages whose __init__ pulls in vLLM's
# whole runtime (vllm.distributed, vllm.config) are taken without it: they import as namespace packages.
#
# Also vLLM's allocator tests, by commit, into DEST/vllm_tests (each under a package of its own, so that their
# relative imports of vLLM's tests/utils.py resolve to the stand-in tests/test_vllm_cumem.py provides):
#   3eec60f9dbac42c63338028b32ff268e716a7624  tests/basic_correctness/test_cumem.py
#   016993098b69fb9ce8ff941ef60aa2e9baeb11b6  tests/basic_correctness/memory/cumem/test_cumem.py
# from raw.githubusercontent.com, or, with VLLM_GIT set, from that git directory of vllm-project/vllm (e.g. a bare
# clone holding both commits: git --git-dir "$VLLM_GIT" show COMMIT:PATH). Where neither answers, the copy an earlier
# run left in DEST/vllm_tests (same commit) is kept; without one, a warning, and those tests skip saying why.
#
#   scripts/vllm_files.sh [DEST [PYTHON_VERSION]]      DEST defaults to .vllm_src (ignored by git)
#
# These modules also import `regex` and `psutil` (and the NCCL graph allocator `zmq` and `urllib3`). With
# PYTHON_VERSION (e.g. 3.12) their wheels for that Python are unpacked into DEST/deps as well, for a machine that
# lacks them and has no network (the tests put DEST/deps after the installed packages, so an installed copy wins);
# without it, pip-install them (pyzmq for zmq).
# Needs network (or pip's cache) and pip; PYTHON selects the interpreter that runs pip (default python3).
set -euo pipefail
VLLM_VERSION=0.33.0
DEST=${1:-.vllm_src}
PYVER=${2:-}
PYTHON=${PYTHON:-python3}

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# DEST is made anew below; vLLM's test files fetched by an earlier run are kept aside in case they cannot be
# fetched now.
if [ -d "$DEST/vllm_tests" ]; then
  cp -r "$DEST/vllm_tests" "$TMP/vllm_tests_before"
fi

# Only its .py files are taken, so the wheel's own tags need not fit this machine (vLLM needs Python >= 3.11 and
# glibc 2.28).
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 "vllm==$VLLM_VERSION" -d "$TMP/vllm"
if [ -n "$PYVER" ]; then
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    regex psutil pyzmq urllib3 -d "$TMP/deps"
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
    # CUDA-graph pool routing (test_cudagraph_pool_sleep of vLLM's newer test_cumem.py) and what it imports.
    "vllm/compilation/__init__.py", "vllm/compilation/cudagraph_pool.py", "vllm/distributed/utils.py",
    "vllm/distributed/device_communicators/pynccl.py", "vllm/distributed/device_communicators/pynccl_allocator.py",
    "vllm/distributed/device_communicators/pynccl_wrapper.py",
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

"$PYTHON" - "$DEST" "$TMP/vllm_tests_before" <<'PY'
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

dest, before = Path(sys.argv[1]) / "vllm_tests", Path(sys.argv[2])
TESTS = {  # package name: (commit, path in vllm-project/vllm)
    "vllm_tests_3eec60f9": ("3eec60f9dbac42c63338028b32ff268e716a7624", "tests/basic_correctness/test_cumem.py"),
    "vllm_tests_016993098": (
        "016993098b69fb9ce8ff941ef60aa2e9baeb11b6", "tests/basic_correctness/memory/cumem/test_cumem.py"
    ),
}


def fetch(commit: str, path: str) -> bytes:
    git = os.environ.get("VLLM_GIT")
    if git:
        return subprocess.run(["git", "--git-dir", git, "show", f"{commit}:{path}"], check=True,
                              capture_output=True).stdout
    url = f"https://raw.githubusercontent.com/vllm-project/vllm/{commit}/{path}"
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read()


for package, (commit, path) in TESTS.items():
    try:
        text = fetch(commit, path)
    except Exception as e:
        earlier = before / package
        stamp = earlier.joinpath(*Path(path).parts[1:]).parent / "COMMIT"
        if stamp.is_file() and stamp.read_text().strip() == commit:
            shutil.copytree(earlier, dest / package)
            print(f"vllm {commit[:9]}: {path} could not be fetched ({e}); kept the copy fetched before")
        else:
            print(f"warning: could not fetch vLLM's {path} at {commit[:9]} ({e}); its tests will skip",
                  file=sys.stderr)
        continue
    # tests/X/.../test_cumem.py -> PACKAGE/X/.../test_cumem.py, an __init__.py in each directory.
    target = dest.joinpath(package, *Path(path).parts[1:])
    target.parent.mkdir(parents=True, exist_ok=True)
    for d in [target.parent, *target.parent.parents]:
        if d == dest:
            break
        (d / "__init__.py").touch()
    target.write_bytes(text)
    (target.parent / "COMMIT").write_text(commit + "\n")
    print(f"vllm {commit[:9]}: {path} ({len(text)} bytes) in {target}")
PY
