#!/usr/bin/env bash
# A simulated cluster on this machine, for multi-node tests and for trying a launch by hand.
#
# Node i ("node1".."nodeN") is a network namespace and a UTS namespace of its own: its own
# hostname, loopback, and one address (198.18.0.i, the RFC 2544 test range, which exists only
# inside the cluster) on a veth link to a bridge in a switch namespace. The host's own network
# is not touched. Every process launched on a node (by this script's ssh stand-in, as Open MPI
# or horovodrun launch a remote daemon) runs in that node's namespaces with a per-node TMPDIR,
# so Open MPI's session directories and shared-memory segments are per node, and ranks on
# different nodes talk over TCP on the veth links. The run directory lives on the shared file
# system, as on a real cluster.
#
#   bash scripts/sim_cluster.sh up 2            # make node1, node2; prints the hostfile's path
#   bash scripts/sim_cluster.sh mpirun -np 4 .venv/bin/flowpm-mtf simulate --out /work/x
#   bash scripts/sim_cluster.sh run CMD...      # CMD on node1 with the ssh stand-in on PATH
#                                               # (horovodrun -H node1:2,node2:2, run_mpirun.sh)
#   bash scripts/sim_cluster.sh exec node2 CMD...   # CMD on one node (the caller's environment)
#   bash scripts/sim_cluster.sh status          # the nodes, their addresses and byte counters
#   bash scripts/sim_cluster.sh link node2 down # take node2's link down (and up again)
#   bash scripts/sim_cluster.sh down            # remove every namespace, mount, file and process
#
# Needs root and iproute2, util-linux (unshare, nsenter, mount). Environment:
#   FLOWPM_SIM_CLUSTER      name of the cluster, prefix of its namespaces (default fpmc; the
#                           tests use their own, so they never touch a cluster made by hand)
#   FLOWPM_SIM_CLUSTER_DIR  its state directory (default /tmp/flowpm-sim-cluster-NAME)
#   SLOTS                   slots per node in the hostfile (default 2)
# Errors print one line "sim_cluster: error: ..." and exit 2 (usage) or 1 (a failed step,
# after which nothing of the cluster is left).
set -Eeuo pipefail

SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
NAME="${FLOWPM_SIM_CLUSTER:-fpmc}"
MAX_NODES=16
SUBNET=198.18.0

die() { echo "sim_cluster: error: $*" >&2; exit "${EXIT:-2}"; }

[[ "$NAME" =~ ^[a-z][a-z0-9]{0,7}$ ]] ||
  die "FLOWPM_SIM_CLUSTER must be 1-8 lower-case letters or digits starting with a letter, got '$NAME'"
DIR="${FLOWPM_SIM_CLUSTER_DIR:-/tmp/flowpm-sim-cluster-$NAME}"
SWITCH="$NAME-switch"

netns_of() { echo "$NAME-$1"; }

# in_range VALUE LO HI: VALUE is a whole number from LO to HI
in_range() { [[ "$1" =~ ^[0-9]{1,6}$ ]] && [ "$1" -ge "$2" ] && [ "$1" -le "$3" ]; }

# up_failed RC COMMAND: the ERR trap of 'up': remove what was made, one line, exit 1
up_failed() {
  trap - ERR
  cmd_down
  EXIT=1 die "up failed (exit $1) at: $2"
}

# node_count: the number of nodes of the cluster that is up (0 when none)
node_count() {
  if [ -f "$DIR/nodes" ]; then cat "$DIR/nodes"; else echo 0; fi
}

# check_node NODE: one line and exit 2 unless NODE is a node of the cluster that is up
check_node() {
  local n
  n="$(node_count)"
  [ "$n" -gt 0 ] || die "no simulated cluster '$NAME' is up: run 'bash scripts/sim_cluster.sh up N' first"
  if ! { [[ "$1" =~ ^node([0-9]+)$ ]] && in_range "${BASH_REMATCH[1]}" 1 "$n"; }; then
    die "no node '$1' in the simulated cluster '$NAME' (it has node1..node$n)"
  fi
  ip netns list | grep -qw "^$(netns_of "$1")" ||
    die "node '$1' of the simulated cluster '$NAME' has no namespace (half removed?): run down, then up"
}

need_root() {
  [ "$(id -u)" -eq 0 ] || die "the simulated cluster needs root (network and UTS namespaces)"
  local p
  for p in ip unshare nsenter mount umount; do
    command -v "$p" >/dev/null || die "'$p' is not installed (iproute2, util-linux)"
  done
}

cmd_down() {
  need_root
  local ns pid mnt
  # every namespace of this cluster, also one that a crashed 'up' left without state
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$NAME-(node[0-9]+|switch)$" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do kill -KILL "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  if [ -d "$DIR/uts" ]; then
    for mnt in "$DIR"/uts/*; do
      [ -e "$mnt" ] || continue
      umount -l "$mnt" 2>/dev/null || true
    done
  fi
  rm -rf "$DIR"
  # /etc/netns only if this script made it and nothing else is in it
  if [ -f /etc/netns/.flowpm-sim-cluster ] && [ "$(ls -A /etc/netns)" = ".flowpm-sim-cluster" ]; then
    rm -f /etc/netns/.flowpm-sim-cluster; rmdir /etc/netns 2>/dev/null || true
  fi
}

cmd_up() {
  [ $# -eq 1 ] || die "usage: sim_cluster.sh up N (N nodes, 1..$MAX_NODES)"
  in_range "$1" 1 "$MAX_NODES" ||
    die "the number of nodes must be a whole number from 1 to $MAX_NODES, got '$1'"
  local n="$1" slots="${SLOTS:-2}" i ns
  in_range "$slots" 1 1024 || die "SLOTS must be a whole number from 1 to 1024, got '$slots'"
  need_root
  cmd_down  # 'up' after a crash (or twice) starts from nothing
  # from here on a failed step removes everything again, then exits 1 with one line
  trap 'up_failed $? "$BASH_COMMAND"' ERR
  mkdir -p "$DIR/uts" "$DIR/tmp" "$DIR/bin"
  if [ ! -d /etc/netns ]; then mkdir -p /etc/netns; touch /etc/netns/.flowpm-sim-cluster; fi
  ip netns add "$SWITCH"
  ip -n "$SWITCH" link add br0 type bridge
  ip -n "$SWITCH" link set br0 up
  : > "$DIR/hostfile"
  printf '127.0.0.1 localhost\n' > "$DIR/hosts"
  for i in $(seq 1 "$n"); do printf '%s.%d node%d\n' "$SUBNET" "$i" "$i" >> "$DIR/hosts"; done
  for i in $(seq 1 "$n"); do
    ns="$(netns_of "node$i")"
    ip netns add "$ns"
    ip link add eth0 netns "$ns" type veth peer name "p$i" netns "$SWITCH"
    ip -n "$SWITCH" link set "p$i" master br0
    ip -n "$SWITCH" link set "p$i" up
    ip -n "$ns" addr add "$SUBNET.$i/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    # the node's hostname: a UTS namespace kept alive by a bind mount of its nsfs file
    touch "$DIR/uts/node$i"
    unshare --uts="$DIR/uts/node$i" hostname "node$i"
    # names resolve inside the node: ip netns exec binds /etc/netns/NS/hosts over /etc/hosts
    if [ ! -d /etc/netns ]; then mkdir -p /etc/netns; touch /etc/netns/.flowpm-sim-cluster; fi
    mkdir -p "/etc/netns/$ns"
    cp "$DIR/hosts" "/etc/netns/$ns/hosts"
    mkdir -p "$DIR/tmp/node$i"
    printf 'node%d slots=%d\n' "$i" "$slots" >> "$DIR/hostfile"
  done
  # the ssh stand-in: what Open MPI and horovodrun call to start a process on another node
  cat > "$DIR/bin/ssh" <<EOF
#!/usr/bin/env bash
# ssh stand-in of the simulated cluster '$NAME' (written by $SELF)
exec env FLOWPM_SIM_CLUSTER='$NAME' FLOWPM_SIM_CLUSTER_DIR='$DIR' bash '$SELF' ssh "\$@"
EOF
  chmod +x "$DIR/bin/ssh"
  echo "$n" > "$DIR/nodes"
  trap - ERR
  echo "$DIR/hostfile"
}

# run CMD on NODE: in its network and UTS namespaces, with its TMPDIR
enter() {
  local node="$1"; shift
  exec ip netns exec "$(netns_of "$node")" nsenter --uts="$DIR/uts/$node" -- "$@"
}

cmd_exec() {
  [ $# -ge 2 ] || die "usage: sim_cluster.sh exec NODE COMMAND [ARGS...]"
  need_root
  check_node "$1"
  local node="$1"; shift
  export TMPDIR="$DIR/tmp/$node" PATH="$DIR/bin:$PATH"
  enter "$node" "$@"
}

# ssh [OPTIONS] HOST [OPTIONS] COMMAND...: like OpenSSH (which reads options after the
# host too, as horovodrun writes them), a fresh login environment on HOST running COMMAND
# through the shell (Open MPI passes its orted command line as words to join)
cmd_ssh() {
  local host="" words=()
  while [ $# -gt 0 ]; do
    case "$1" in
      -[BbcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;
      -*) shift ;;
      *) if [ -z "$host" ]; then host="$1"; shift; else words=("$@"); break; fi ;;
    esac
  done
  [ -n "$host" ] || die "ssh stand-in: no host given"
  set -- "${words[@]}"
  check_node "$host"
  local cmd="$*"
  [ -n "$cmd" ] || die "ssh stand-in: no command for $host (no interactive logins)"
  enter "$host" env -i HOME="${HOME:-/root}" USER="$(id -un)" LOGNAME="$(id -un)" \
    PATH="$DIR/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    TMPDIR="$DIR/tmp/$host" LANG=C.UTF-8 /bin/sh -c "$cmd"
}

cmd_mpirun() {
  need_root
  check_node node1
  local opts=(--hostfile "$DIR/hostfile" --mca plm_rsh_agent "$DIR/bin/ssh" --bind-to none)
  [ "$(id -u)" -ne 0 ] || opts+=(--allow-run-as-root)
  cmd_exec node1 mpirun "${opts[@]}" "$@"
}

cmd_status() {
  need_root
  local n i ns
  n="$(node_count)"
  [ "$n" -gt 0 ] || die "no simulated cluster '$NAME' is up"
  echo "cluster $NAME: $n node(s), hostfile $DIR/hostfile"
  for i in $(seq 1 "$n"); do
    ns="$(netns_of "node$i")"
    printf 'node%d %s.%d link=%s tx_bytes=%s rx_bytes=%s processes=%s\n' "$i" "$SUBNET" "$i" \
      "$(ip -n "$SWITCH" -o link show "p$i" | grep -q 'state UP' && echo up || echo down)" \
      "$(ip netns exec "$ns" cat /sys/class/net/eth0/statistics/tx_bytes)" \
      "$(ip netns exec "$ns" cat /sys/class/net/eth0/statistics/rx_bytes)" \
      "$(ip netns pids "$ns" | wc -l)"
  done
}

cmd_link() {
  if [ $# -ne 2 ] || { [ "$2" != up ] && [ "$2" != down ]; }; then
    die "usage: sim_cluster.sh link NODE up|down"
  fi
  need_root
  check_node "$1"
  # the switch's port: like a cable pulled at the switch (the node keeps its address)
  ip -n "$SWITCH" link set "p${1#node}" "$2"
}

case "${1:-}" in
  up) shift; cmd_up "$@" ;;
  down) shift; [ $# -eq 0 ] || die "usage: sim_cluster.sh down"; cmd_down ;;
  exec) shift; cmd_exec "$@" ;;
  ssh) shift; cmd_ssh "$@" ;;
  mpirun) shift; cmd_mpirun "$@" ;;
  run) shift; [ $# -ge 1 ] || die "usage: sim_cluster.sh run COMMAND [ARGS...]"; cmd_exec node1 "$@" ;;
  status) shift; cmd_status ;;
  link) shift; cmd_link "$@" ;;
  ""|-h|--help|help) sed -n '2,/^set -euo/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//' ;;
  *) die "unknown command '$1' (up, down, mpirun, run, exec, status, link)" ;;
esac
