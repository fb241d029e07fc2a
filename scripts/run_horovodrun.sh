#!/usr/bin/env bash
# flowpm-mtf under horovodrun (its MPI controller: HvdSimdMeshImpl needs MPI for its
# Cartesian communicator, so --mpi is always used).
#
#   NP=4 bash scripts/run_horovodrun.sh                          # simulate on this host
#   NP=16 HOSTS=node1:8,node2:8 bash scripts/run_horovodrun.sh --nc 1024
#   NP=2 COMMAND=fft-demo bash scripts/run_horovodrun.sh --nc 32
#
# Environment: NP (ranks, default 2), HOSTS (horovodrun -H list, default localhost:NP),
# VENV (default: the FLOWPM_MTF_STACK venv, <repo>/.venv), COMMAND (simulate | fft-demo | lensing | reconstruct | imaging | bench), NC, GRID (PxQ),
# OUT (default out/horovodrun). Extra arguments go to the sub-command.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
# shellcheck disable=SC1091  # functions only: mpirun_options, exec_subcommand
source scripts/launch_lib.sh
VENV="${VENV:-$(stack_venv "$REPO")}"  # FLOWPM_MTF_STACK's venv (docs/setup.md)
NP="${NP:-2}"
COMMAND="${COMMAND:-simulate}"
OUT="${OUT:-out/horovodrun}"
HOSTS="${HOSTS:-localhost:$NP}"

export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}" TF_FORCE_GPU_ALLOW_GROWTH=true
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
where=hosts; [ "$HOSTS" = "localhost:$NP" ] && where=local
mapfile -t MPI_OPTS < <(mpirun_options "$where")
MPI_ARGS="${MPI_OPTS[*]}"
HVDRUN=("$VENV/bin/horovodrun" --mpi -np "$NP" -H "$HOSTS" --mpi-args="$MPI_ARGS")

exec_subcommand "$VENV" "$COMMAND" "$OUT" "${HVDRUN[@]}" -- "$@"
