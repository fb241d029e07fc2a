# shellcheck shell=bash
# Shell side of the scripts' shared library (flowpm_bench/launch.py is the Python side;
# keep mpirun_options and flowpm_bench.launch.mpirun_command in step). Sourced by
# scripts/run_*.sh; defines functions only.

# stack_name: the software stack chosen by FLOWPM_MTF_STACK (tf2.21, the default, or
# tf2.12, the previous one; docs/setup.md); exit 2 on another value.
stack_name() {
  case "${FLOWPM_MTF_STACK:-tf2.21}" in
    tf2.21|tf2.12) echo "${FLOWPM_MTF_STACK:-tf2.21}" ;;
    *) echo "FLOWPM_MTF_STACK must be tf2.21 or tf2.12, got '${FLOWPM_MTF_STACK}'" >&2; return 2 ;;
  esac
}

# stack_venv REPO: the stack's default virtualenv (VENV, when set, wins in the callers):
# REPO/.venv for tf2.21, REPO/.venv-tf2.12 for tf2.12, so both can live in one checkout.
stack_venv() {
  local stack
  stack="$(stack_name)" || return 2
  if [ "$stack" = tf2.21 ]; then echo "$1/.venv"; else echo "$1/.venv-$stack"; fi
}

# stack_requirements REPO: the stack's pinned requirements file.
stack_requirements() {
  local stack
  stack="$(stack_name)" || return 2
  if [ "$stack" = tf2.21 ]; then echo "$1/requirements.txt"; else echo "$1/requirements-$stack.txt"; fi
}

# mpirun_options [local|hosts]: the mpirun options of every launch, one per line:
# --bind-to none (Open MPI's default binds each rank to one core when there are at most
# 2 ranks: a 1-rank job would get one core), --allow-run-as-root as root, and
# --oversubscribe on this host alone ("local", the default; not with a host list).
# With a host list ("hosts"), TCP keepalive on mpirun's links to its remote daemons
# (idle 20 s, then 4 probes 5 s apart; Open MPI's default is 300 s + 9 x 20 s): mpirun
# notices a cut-off node on an idle link within ~40 s. (The ranks end within
# FLOWPM_MTF_PEER_TIMEOUT by themselves; mpirun, once it has an unacknowledged order for
# the lost daemon, waits for TCP's retransmission limit: docs/clusters.md.)
#   mapfile -t MPI_OPTS < <(mpirun_options)
mpirun_options() {
  printf '%s\n' --bind-to none
  if [ "$(id -u)" -eq 0 ]; then printf '%s\n' --allow-run-as-root; fi
  if [ "${1:-local}" = local ]; then
    printf '%s\n' --oversubscribe
  else
    printf '%s\n' --mca oob_tcp_keepalive_time 20 --mca oob_tcp_keepalive_intvl 5 \
      --mca oob_tcp_keepalive_probes 4
  fi
}

# exec_subcommand VENV COMMAND OUT LAUNCHER... -- ARGS...: replace the shell by COMMAND
# (simulate | fft-demo | lensing | reconstruct | imaging: flowpm-mtf; bench: one scripts/bench_compare.py record) under
# LAUNCHER (an mpirun or horovodrun command line), with --nc "$NC" and --grid "$GRID"
# when set and ARGS at the end. Exit 2 on an unknown COMMAND or bench without NC/GRID.
exec_subcommand() {
  local venv="$1" command="$2" out="$3"
  shift 3
  local launcher=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do launcher+=("$1"); shift; done
  if [ $# -gt 0 ]; then shift; fi
  local nc_args=() grid_args=()
  if [ -n "${NC:-}" ]; then nc_args=(--nc "$NC"); fi
  if [ -n "${GRID:-}" ]; then grid_args=(--grid "$GRID"); fi
  case "$command" in
    simulate|fft-demo|lensing|reconstruct|imaging)
      exec "${launcher[@]}" "$venv/bin/flowpm-mtf" "$command" "${nc_args[@]}" "${grid_args[@]}" \
        --out "$out" "$@" ;;
    bench)
      if [ -z "${GRID:-}" ] || [ -z "${NC:-}" ]; then
        echo "COMMAND=bench needs NC and GRID" >&2; exit 2
      fi
      mkdir -p "$out"
      exec "${launcher[@]}" "$venv/bin/python" scripts/bench_compare.py --backend hvd --size "$NC" \
        --grid "$GRID" --record "$out/bench_hvd_${NC}_${GRID}.json" "$@" ;;
    *) echo "unknown COMMAND=$command (simulate, fft-demo, lensing, reconstruct, imaging or bench)" >&2; exit 2 ;;
  esac
}
