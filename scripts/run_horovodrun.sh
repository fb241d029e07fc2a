#!/usr/bin/env bash
# flowpm-mtf under horovodrun (its MPI controller: HvdSimdMeshImpl needs MPI for its
# Cartesian communicator, so --mpi is always used).
#
#   NP=4 bash scripts/run_horovodrun.sh                          # simulate on this host
#   NP=16 HOSTS=node1:8,node2:8 bash scripts/run_horovodrun.sh --nc 1024
#   NP=2 COMMAND=fft-demo bash scripts/run_horovodrun.sh --nc 32
#
# Environment: NP (ranks, default 2), HOSTS (horovodrun -H list, default localhost:NP),
# VENV (default <repo>/.venv), COMMAND (simulate | fft-demo | bench), NC, GRID (PxQ),
# OUT (default out/horovodrun). Extra arguments go to the sub-command.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
VENV="${VENV:-$REPO/.venv}"
NP="${NP:-2}"
COMMAND="${COMMAND:-simulate}"
OUT="${OUT:-out/horovodrun}"
HOSTS="${HOSTS:-localhost:$NP}"

export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}" TF_FORCE_GPU_ALLOW_GROWTH=true
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
MPI_ARGS="--bind-to none"
[ "$(id -u)" -eq 0 ] && MPI_ARGS="$MPI_ARGS --allow-run-as-root"
[ "$HOSTS" = "localhost:$NP" ] && MPI_ARGS="$MPI_ARGS --oversubscribe"
HVDRUN=("$VENV/bin/horovodrun" --mpi -np "$NP" -H "$HOSTS" --mpi-args="$MPI_ARGS")

NC_ARGS=(); [ -n "${NC:-}" ] && NC_ARGS=(--nc "$NC")
GRID_ARGS=(); [ -n "${GRID:-}" ] && GRID_ARGS=(--grid "$GRID")
case "$COMMAND" in
  simulate|fft-demo)
    exec "${HVDRUN[@]}" "$VENV/bin/flowpm-mtf" "$COMMAND" "${NC_ARGS[@]}" "${GRID_ARGS[@]}" \
      --out "$OUT" "$@" ;;
  bench)
    if [ -z "${GRID:-}" ] || [ -z "${NC:-}" ]; then
      echo "COMMAND=bench needs NC and GRID" >&2; exit 2
    fi
    mkdir -p "$OUT"
    exec "${HVDRUN[@]}" "$VENV/bin/python" scripts/bench_compare.py --backend hvd --size "$NC" \
      --grid "$GRID" --record "$OUT/bench_hvd_${NC}_${GRID}.json" "$@" ;;
  *) echo "unknown COMMAND=$COMMAND (simulate, fft-demo or bench)" >&2; exit 2 ;;
esac
