#!/usr/bin/env bash
# flowpm-mtf under plain mpirun (Open MPI), one rank per GPU (or per core share on CPUs).
#
#   NP=8 bash scripts/run_mpirun.sh                        # simulate, 8 ranks, this host
#   NP=16 HOSTFILE=hosts.txt GPUS_PER_NODE=8 bash scripts/run_mpirun.sh --nc 1024
#   NP=4 COMMAND=bench GRID=2x2 NC=128 bash scripts/run_mpirun.sh   # one benchmark record
#
# Environment: NP (ranks, default 2), HOSTFILE (Open MPI hostfile; default: this host),
# GPUS_PER_NODE (ranks per node with a hostfile), VENV (default: the FLOWPM_MTF_STACK venv, <repo>/.venv), COMMAND
# (simulate | fft-demo | lensing | reconstruct | imaging | bench), NC, GRID (PxQ), OUT (default out/mpirun). Extra
# arguments go to the sub-command.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
# shellcheck disable=SC1091  # functions only: mpirun_options, exec_subcommand
source scripts/launch_lib.sh
VENV="${VENV:-$(stack_venv "$REPO")}"  # FLOWPM_MTF_STACK's venv (docs/setup.md)
NP="${NP:-2}"
COMMAND="${COMMAND:-simulate}"
OUT="${OUT:-out/mpirun}"

if [ -n "${HOSTFILE:-}" ]; then
  mapfile -t MPI_OPTS < <(mpirun_options hosts)
  MPI_OPTS+=(--hostfile "$HOSTFILE" --map-by "ppr:${GPUS_PER_NODE:-1}:node")
else
  mapfile -t MPI_OPTS < <(mpirun_options local)
fi
MPIRUN=(mpirun -np "$NP" "${MPI_OPTS[@]}")
# Forward the variables that matter to every rank (-x): thread counts, TF/NCCL/Horovod,
# and ours (on other hosts a rank would otherwise run another allocator or op path).
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}" TF_FORCE_GPU_ALLOW_GROWTH=true
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
for v in TF_CPP_MIN_LOG_LEVEL TF_FORCE_GPU_ALLOW_GROWTH OMP_NUM_THREADS PATH LD_LIBRARY_PATH \
         FLOWPM_MTF_INTRA_THREADS FLOWPM_MTF_INTER_THREADS NCCL_DEBUG NCCL_SOCKET_IFNAME \
         NCCL_IB_HCA HOROVOD_FUSION_THRESHOLD HOROVOD_CYCLE_TIME FLOWPM_MTF_ALLOCATOR \
         FLOWPM_MTF_NATIVE FLOWPM_MTF_MAX_FULL_ELEMENTS FLOWPM_MTF_EXIT_TIMEOUT \
         FLOWPM_MTF_PEER_TIMEOUT; do
  [ -n "${!v:-}" ] && MPIRUN+=(-x "$v")
done

exec_subcommand "$VENV" "$COMMAND" "$OUT" "${MPIRUN[@]}" -- "$@"
