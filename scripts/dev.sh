#!/usr/bin/env bash
# One entry point for set-up and the project's jobs. Creates .venv on first use and installs what it needs.
#   scripts/dev.sh demo   - the main job: a model-shaped sleep/wake cycle (GPU if present, else simulated)
#   scripts/dev.sh test   - all tests: cargo test + pytest (simulated driver; CUDA too when a GPU is present), then
#                           the release wheel tested as installed (test-installed, simulated device)
#   scripts/dev.sh build  - (re)build the extension into .venv
#   scripts/dev.sh bench  - the sleep/wake benchmark at a small scale
#   scripts/dev.sh wheel  - the release abi3 wheel (manylinux2014) and the sdist into target/wheels/
#   scripts/dev.sh test-installed [WHEEL] [PYTEST_ARGS...]
#                         - a wheel installed into a fresh venv, run from outside the source tree: info, demo and
#                           the test suite (the GPU's too when one is present); needs no cargo, no network
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY="$VENV/bin/python"

setup() {
  if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
  fi
  if ! "$PY" -c "import torch, hypothesis, pytest, maturin, numpy, rich, mypy, matplotlib" >/dev/null 2>&1; then
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q torch numpy "hypothesis>=6.100" "pytest>=7" "maturin>=1.5,<2" "rich>=13" mypy matplotlib
  fi
}

# vLLM 0.33.0's own modules for tests/test_vllm_plugin.py, fetched once into .vllm_src (outside the venv: see
# scripts/vllm_files.sh), and the two modules they import. Never fatal: without them those tests skip, saying why.
vllm_files() {
  if [ ! -f .vllm_src/VLLM_VERSION ]; then
    PYTHON="$PY" scripts/vllm_files.sh .vllm_src ||
      echo "warning: could not fetch vLLM's modules; tests/test_vllm_plugin.py will skip" >&2
  fi
  if ! "$PY" -c "import regex, psutil" >/dev/null 2>&1; then
    "$PY" -m pip install -q regex psutil ||
      echo "warning: could not install regex and psutil; tests/test_vllm_plugin.py will skip" >&2
  fi
}

build() {
  setup
  VIRTUAL_ENV="$PWD/$VENV" PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/maturin" develop --release -q
}

# --- the wheel, and the wheel tested as installed -----------------------------------------------------------------
WHEEL_DIR=target/wheels
# glibc 2.17: the lowest manylinux tag the zig linker builds for; torch's own wheels need glibc 2.28.
WHEEL_COMPAT=manylinux2014
# README.md and docs/layout.md promise this tag or a lower one; check_wheel_tag fails on anything newer.
WHEEL_MAX_GLIBC_MINOR=28

wheel() {
  setup
  if ! "$PY" -c "import ziglang, auditwheel" >/dev/null 2>&1; then
    "$PY" -m pip install -q ziglang auditwheel
  fi
  rm -f "$WHEEL_DIR"/cumem_rs-*.whl "$WHEEL_DIR"/cumem_rs-*.tar.gz
  PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/maturin" build --release --zig --compatibility "$WHEEL_COMPAT" \
    -o "$WHEEL_DIR" -q
  "$VENV/bin/maturin" sdist -o "$WHEEL_DIR"
  check_wheel_tag "$(ls "$WHEEL_DIR"/cumem_rs-*.whl)"
  ls -1 "$WHEEL_DIR"/cumem_rs-*
}

# The wheel's own tags are abi3 and manylinux_2_<=28, and auditwheel finds no symbol needing a newer glibc.
check_wheel_tag() {
  local shown
  shown=$("$VENV/bin/auditwheel" show "$1")
  "$PY" - "$1" "$WHEEL_MAX_GLIBC_MINOR" "$shown" <<'EOF'
import os, re, sys
whl, max_minor, shown = sys.argv[1], int(sys.argv[2]), sys.argv[3]
_, _, _, abi, plats = os.path.basename(whl)[: -len(".whl")].split("-")
legacy = {"manylinux1": 5, "manylinux2010": 12, "manylinux2014": 17}
claimed = []
for p in plats.split("."):
    m = re.fullmatch(r"manylinux_2_(\d+)_\w+", p) or re.fullmatch(r"(manylinux\d+)_\w+", p)
    if not m:
        sys.exit(f"wheel tag {p!r} is not a manylinux tag: {whl}")
    claimed.append(legacy[m[1]] if m[1] in legacy else int(m[1]))
needed = re.search(r'consistent with the following platform tag:\s*"manylinux_2_(\d+)_', shown)
if abi != "abi3":
    sys.exit(f"wheel ABI tag is {abi!r}, not abi3: {whl}")
if max(claimed) > max_minor:
    sys.exit(f"wheel claims glibc 2.{max(claimed)}, newer than the promised manylinux_2_{max_minor}: {whl}")
if not needed or int(needed[1]) > min(claimed):
    sys.exit(f"auditwheel: the wheel needs more than its tag says:\n{shown}")
print(f"wheel tag ok: {abi}-{plats} (auditwheel: symbols need glibc 2.{needed[1]})")
EOF
}

# Install the wheel into a fresh venv and run it from a temp dir, so nothing resolves to the source tree. The venv
# borrows torch, pytest, hypothesis and numpy from $BASE_PYTHON's site-packages through a .pth of plain paths
# (no second torch install): plain path lines do not process the .pth files inside those dirs, so an editable
# cumem_rs there stays invisible, and the venv's own site-packages comes first on sys.path anyway.
test_installed() {
  local whl="" base="${BASE_PYTHON:-}"
  if [[ "${1:-}" == *.whl ]]; then whl=$1; shift; fi
  [ -n "$whl" ] || whl=$(ls "$WHEEL_DIR"/cumem_rs-*.whl 2>/dev/null | head -n 1) || true
  [ -f "$whl" ] || { echo "no wheel ${whl:-in $WHEEL_DIR} (run scripts/dev.sh wheel)" >&2; return 1; }
  [ -n "$base" ] || { [ -x "$PY" ] && base="$PY"; } || base=python3
  whl=$(cd "$(dirname "$whl")" && pwd)/$(basename "$whl")
  INSTALL_TMP=$(mktemp -d)
  trap 'rm -rf "$INSTALL_TMP"' EXIT
  local tmp="$INSTALL_TMP"
  cp -r tests benches "$tmp"/
  "$base" -m venv --without-pip "$tmp/venv"
  local vpy="$tmp/venv/bin/python"
  "$base" -m pip --python "$vpy" install -q --no-deps --no-index "$whl"
  "$base" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
    > "$("$vpy" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_borrowed_site_packages.pth"
  (
    cd "$tmp" && unset PYTHONPATH
    "$vpy" -c 'import sys, cumem_rs
assert cumem_rs.__file__.startswith(sys.prefix + "/"), f"cumem_rs imported from {cumem_rs.__file__}, not the venv"
print(f"installed cumem_rs {cumem_rs.__version__} at {cumem_rs.__file__}")'
    "$vpy" -m cumem_rs info
    "$tmp/venv/bin/cumem-rs" --help >/dev/null
    "$vpy" -m cumem_rs demo
    # test_stubs type-checks the source tree; the stub and py.typed are checked as shipped in test_packaging.
    "$vpy" -m pytest -q -p no:cacheprovider tests --ignore=tests/test_stubs.py "$@"
  )
}

case "${1:-}" in
  build) build ;;
  demo) build; "$PY" -m cumem_rs demo ;;
  bench) build; shift; "$PY" -m cumem_rs bench "$@" ;;
  test)
    build
    # The embedded PTX must be what its CUDA C source compiles to (NVRTC 12.0: PTX ISA 8.0, no GPU needed).
    "$PY" scripts/gen_ptx.py --find >/dev/null 2>&1 || "$PY" -m pip install -q "nvidia-cuda-nvrtc-cu12==12.0.*"
    "$PY" scripts/gen_ptx.py --check
    vllm_files
    # On a GPU machine: the nvCOMP wheel of torch's CUDA major, for the codec's CUDA tests (warns, never fails).
    "$PY" scripts/nvcomp_extra.py install
    cargo test --no-default-features
    rc=0
    "$PY" -m pytest -q tests || rc=$?
    "$PY" scripts/nvcomp_extra.py summary  # whether the codec's CUDA tests ran, or why they skipped
    [ "$rc" -eq 0 ] || exit "$rc"
    # The release wheel, installed, on the simulated device (GPU hidden: the GPU suite ran in-tree above).
    wheel
    CUDA_VISIBLE_DEVICES= CUMEM_HYPOTHESIS_PROFILE=quick test_installed
    ;;
  wheel) wheel ;;
  test-installed) shift; test_installed "$@" ;;
  *) echo "usage: scripts/dev.sh {demo|test|build|bench|wheel|test-installed}" >&2; exit 2 ;;
esac
