#!/usr/bin/env bash
# One entry point for set-up and the project's jobs. Creates .venv on first use and installs what it needs.
#   scripts/dev.sh demo   - the main job: a model-shaped sleep/wake cycle (GPU if present, else simulated)
#   scripts/dev.sh test   - all tests: cargo test + pytest (simulated driver; CUDA too when a GPU is present)
#   scripts/dev.sh build  - (re)build the extension into .venv
#   scripts/dev.sh bench  - the sleep/wake benchmark at a small scale
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY="$VENV/bin/python"

setup() {
  if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
  fi
  if ! "$PY" -c "import torch, hypothesis, pytest, maturin, numpy, rich, mypy" >/dev/null 2>&1; then
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q torch numpy "hypothesis>=6.100" "pytest>=7" "maturin>=1.5,<2" "rich>=13" mypy
  fi
}

build() {
  setup
  VIRTUAL_ENV="$PWD/$VENV" PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/maturin" develop --release -q
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
    cargo test --no-default-features
    "$PY" -m pytest -q tests
    ;;
  *) echo "usage: scripts/dev.sh {demo|test|build|bench}" >&2; exit 2 ;;
esac
