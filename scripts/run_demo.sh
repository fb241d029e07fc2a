#!/usr/bin/env bash
# The main job: set-up (idempotent), then the demo on NP ranks (default 2).
#   bash scripts/run_demo.sh                    # defaults
#   NP=4 bash scripts/run_demo.sh --nc 128      # extra arguments go to the sub-command
#   FLOWPM_MTF_STACK=tf2.12 bash scripts/run_demo.sh   # on the previous stack, TensorFlow 2.12
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
bash scripts/setup_env.sh
# shellcheck disable=SC1091  # functions only: mpirun_options, stack_venv
source scripts/launch_lib.sh
VENV="${VENV:-$(stack_venv "$REPO")}"  # FLOWPM_MTF_STACK's venv (docs/setup.md)
NP="${NP:-2}"
mapfile -t MPI_OPTS < <(mpirun_options local)
MPIRUN=(mpirun "${MPI_OPTS[@]}")
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
exec "${MPIRUN[@]}" -np "$NP" "$VENV/bin/flowpm-mtf" "${FLOWPM_MTF_COMMAND:-simulate}" --out "${OUT:-out/sim}" "$@"
