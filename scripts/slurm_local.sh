#!/usr/bin/env bash
# A single-node Slurm (slurmctld + slurmd + munge) on this machine, to try and test the cluster path.
#   scripts/slurm_local.sh start    # installs slurm-wlm + munge with apt-get if missing, starts, waits until idle
#   scripts/slurm_local.sh status   # prints sinfo; exit 0 when the node answers
#   scripts/slurm_local.sh stop     # stops both clusters (the one below too) and munged if start started it
# A multi-node cluster beside it: N compute nodes node1..nodeN, each in its own network + UTS namespace (own
# hostname, own address 10.77.0.(10+K) on a private bridge otbr0 with the host at 10.77.0.1 and no route anywhere
# else, its own hosts file bind-mounted over /etc/hosts inside the node) with its own slurmd; slurmctld on the host;
# ports 6827/6828; files in $SLURM_LOCAL_NODES_DIR (default /tmp/outlier_titan-slurm-nodes). Clients use
# `export SLURM_CONF=$SLURM_LOCAL_NODES_DIR/slurm.conf`. Node sizes: nproc --all / N CPUs each.
#   scripts/slurm_local.sh start --nodes 2
#   scripts/slurm_local.sh status --nodes 2
#   scripts/slurm_local.sh crash K / revive K   # kill -9 every process of node K / start its slurmd again
# Needs root. Everything lives in $SLURM_LOCAL_DIR (default /tmp/outlier_titan-slurm): slurm.conf, state, logs.
# The clients find the cluster through /etc/slurm/slurm.conf (linked to ours when absent) or
# `export SLURM_CONF=$SLURM_LOCAL_DIR/slurm.conf`. Starting twice is harmless.
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/outlier_titan-slurm}
CONF=$DIR/slurm.conf
CTLD_PORT=${SLURM_LOCAL_CTLD_PORT:-6817}
SLURMD_PORT=${SLURM_LOCAL_SLURMD_PORT:-6818}
NODE=$(hostname -s)
export SLURM_CONF=$CONF

die() { echo "error: $*" >&2; exit 2; }

running() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

port_taken() { # port owned by a process other than our own daemon
  local port=$1 daemon=$2
  running "$daemon" && return 1
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null
}

install() { # slurm-wlm and munge when missing; the apt-get log goes to folder $1 (created)
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
  command -v apt-get >/dev/null || die "Slurm is not installed and apt-get is missing; install slurm-wlm and munge with your package manager"
  local log=$1/apt.log
  mkdir -p "$1" || die "cannot create $1; set SLURM_LOCAL_DIR / SLURM_LOCAL_NODES_DIR to a writable folder"
  echo "installing slurm-wlm and munge with apt-get ..."
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >"$log" 2>&1 \
    || { apt-get update -q >>"$log" 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >>"$log" 2>&1; } \
    || die "apt-get install slurm-wlm munge failed; see $log"
}

write_conf() {
  local cpus mem
  cpus=$(nproc --all)  # the machine's CPUs: plain nproc honours OMP_NUM_THREADS (1 makes a node that runs nothing)
  mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
  cat >"$CONF" <<EOF
# Written by scripts/slurm_local.sh: one node ($cpus CPUs, $mem MiB), one partition, no accounting daemon.
ClusterName=outlier_titan_local
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again cred_expire + 1 s after the requeue (Slurm's default: 120 s).
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
SchedulerType=sched/backfill
# Schedule every second (not the default minute) so a requeued job restarts quickly.
SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=100000
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Keep finished jobs visible to scontrol show job for 10 minutes.
MinJobAge=600
KillWait=30
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

start_munge() { # munged unless one answers; the folder $1 notes a munged it started, for stop
  local started=0
  if [ -S /run/munge/munge.socket.2 ] && munge -n </dev/null >/dev/null 2>&1; then return; fi
  [ -f /etc/munge/munge.key ] || { mkdir -p /etc/munge; dd if=/dev/urandom of=/etc/munge/munge.key bs=1k count=1 2>/dev/null; }
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  started=1
  if id munge >/dev/null 2>&1; then
    chown munge:munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
    chmod 0400 /etc/munge/munge.key
    runuser -u munge -- munged
  else
    chmod 0400 /etc/munge/munge.key
    munged --force
  fi
  for _ in $(seq 50); do
    if munge -n </dev/null >/dev/null 2>&1; then
      [ -s /run/munge/munged.pid ] && [ "$started" = 1 ] && cp /run/munge/munged.pid "$1/munged.pid"
      return
    fi
    sleep 0.1
  done
  die "munged did not start; see /var/log/munge/munged.log"
}

stop_munge() { # the munged that starting the clusters of $DIR / $NDIR started (another cluster's stays)
  local mark pid
  for mark in "$DIR/munged.pid" "$NDIR/munged.pid"; do
    [ -s "$mark" ] || continue
    pid=$(cat "$mark")
    if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = munged ]; then
      kill "$pid"
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$mark"
  done
}

start() {
  [ "$(id -u)" = 0 ] || die "scripts/slurm_local.sh start needs root (it installs packages and runs slurmctld/slurmd); run it with sudo"
  mkdir -p "$DIR/state" "$DIR/spool"
  install "$DIR"
  if ! running slurmctld || ! running slurmd; then
    port_taken "$CTLD_PORT" slurmctld && die "port $CTLD_PORT is taken by another program; set SLURM_LOCAL_CTLD_PORT to a free port"
    port_taken "$SLURMD_PORT" slurmd && die "port $SLURMD_PORT is taken by another program; set SLURM_LOCAL_SLURMD_PORT to a free port"
    write_conf
  fi
  [ -e /etc/slurm/slurm.conf ] || { mkdir -p /etc/slurm; ln -s "$CONF" /etc/slurm/slurm.conf; }
  start_munge "$DIR"
  running slurmctld || slurmctld -f "$CONF" || die "slurmctld did not start; see $DIR/slurmctld.log"
  running slurmd || slurmd -f "$CONF" || die "slurmd did not start; see $DIR/slurmd.log"
  for _ in $(seq 300); do
    state=$(sinfo -h -n "$NODE" -o %t 2>/dev/null || true)
    case "$state" in
      idle*|mix*|alloc*) echo "local Slurm up: node $NODE $state (SLURM_CONF=$CONF)"; return;;
      down*|drain*) scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true;;
    esac
    sleep 0.2
  done
  die "the local Slurm node did not become idle in 60 s; see $DIR/slurmctld.log and $DIR/slurmd.log"
}

stop() {
  local d pid
  for d in slurmd slurmctld; do
    if running "$d"; then
      pid=$(cat "$DIR/$d.pid")
      kill "$pid"
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
  done
  [ "$(readlink /etc/slurm/slurm.conf 2>/dev/null)" = "$CONF" ] && rm -f /etc/slurm/slurm.conf
  echo "local Slurm stopped"
}

status() {
  running slurmctld && running slurmd || { echo "local Slurm is not running (scripts/slurm_local.sh start)"; return 1; }
  sinfo
}

# ---------------------------------------------------------------- the multi-node cluster (--nodes N, N > 1)
NDIR=${SLURM_LOCAL_NODES_DIR:-/tmp/outlier_titan-slurm-nodes}
NCONF=$NDIR/slurm.conf
NCTLD_PORT=${SLURM_LOCAL_NODES_CTLD_PORT:-6827}
NSLURMD_PORT=${SLURM_LOCAL_NODES_SLURMD_PORT:-6828}
# Names and addresses of the node network: another prefix and subnet (with other ports) make a second,
# independent cluster beside it (the tests start one from fresh folders that way).
NET=${SLURM_LOCAL_NODES_PREFIX:-ot}
SUBNET=${SLURM_LOCAL_NODES_SUBNET:-10.77.0}
BRIDGE=${NET}br0

running_n() { [ -f "$NDIR/$1.pid" ] && kill -0 "$(cat "$NDIR/$1.pid")" 2>/dev/null; }

write_nodes_conf() {
  local n=$1 cpus=$2 mem=$3 k
  {
    echo "# Written by scripts/slurm_local.sh start --nodes $n: $n nodes in network namespaces, $cpus CPUs each."
    echo "ClusterName=outlier_titan_nodes"
    echo "SlurmctldHost=$NODE($SUBNET.1)"
    echo "SlurmctldPort=$NCTLD_PORT"
    echo "SlurmdPort=$NSLURMD_PORT"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    echo "AuthInfo=cred_expire=10"
    echo "StateSaveLocation=$NDIR/state"
    echo "SlurmdSpoolDir=$NDIR/spool/%n"
    echo "SlurmctldPidFile=$NDIR/slurmctld.pid"
    echo "SlurmdPidFile=$NDIR/slurmd-%n.pid"
    echo "SlurmctldLogFile=$NDIR/slurmctld.log"
    echo "SlurmdLogFile=$NDIR/slurmd-%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "ReturnToService=2"
    echo "SlurmdTimeout=30"
    echo "MpiDefault=none"
    echo "SchedulerType=sched/backfill"
    echo "SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=100000"
    echo "AccountingStorageType=accounting_storage/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "JobCompType=jobcomp/none"
    echo "MinJobAge=600"
    echo "KillWait=30"
    for k in $(seq "$n"); do
      echo "NodeName=node$k NodeAddr=$SUBNET.$((10 + k)) CPUs=$cpus RealMemory=$mem State=UNKNOWN"
    done
    echo "PartitionName=nodes Nodes=node[1-$n] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
  } >"$NCONF"
}

start_nodes() {
  local n=$1 k ns cpus mem tool states
  [ "$(id -u)" = 0 ] || die "scripts/slurm_local.sh start --nodes $n needs root (namespaces, a bridge, slurmd); run it with sudo"
  for tool in ip unshare nsenter; do
    command -v "$tool" >/dev/null || die "start --nodes needs '$tool' (iproute2 / util-linux); install it"
  done
  mkdir -p "$NDIR/state" "$NDIR/spool" || die "cannot create $NDIR; set SLURM_LOCAL_NODES_DIR to a writable folder"
  install "$NDIR"
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge 2>/dev/null \
      || die "cannot create the bridge $BRIDGE (network namespaces and bridges are not permitted here?)"
    ip addr add $SUBNET.1/24 dev "$BRIDGE"
    ip link set "$BRIDGE" up
  fi
  { echo "127.0.0.1 localhost"; echo "$SUBNET.1 $NODE"
    for k in $(seq "$n"); do echo "$SUBNET.$((10 + k)) node$k"; done; } >"$NDIR/hosts"
  for k in $(seq "$n"); do
    ns=${NET}node$k
    ip netns list | grep -qw "$ns" && continue
    ip netns add "$ns" 2>/dev/null || die "cannot create the network namespace $ns (not permitted here?)"
    ip link add "${NET}v$k" type veth peer name eth0 netns "$ns"
    ip link set "${NET}v$k" master "$BRIDGE" up
    ip -n "$ns" addr add "$SUBNET.$((10 + k))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
  cpus=$(( $(nproc --all) / n )); [ "$cpus" -ge 1 ] || cpus=1
  mem=$(awk -v n="$n" '/MemTotal/ {print int($2 / 1024 * 0.9 / n)}' /proc/meminfo)
  if ! running_n slurmctld; then  # the conf is written only while slurmctld is down
    port_taken "$NCTLD_PORT" none && die "port $NCTLD_PORT is taken; set SLURM_LOCAL_NODES_CTLD_PORT to a free port"
    write_nodes_conf "$n" "$cpus" "$mem"
  fi
  start_munge "$NDIR"
  running_n slurmctld || SLURM_CONF=$NCONF slurmctld -f "$NCONF" || die "slurmctld did not start; see $NDIR/slurmctld.log"
  for k in $(seq "$n"); do
    [ -n "$(ip netns pids "${NET}node$k" 2>/dev/null)" ] || start_slurmd "$k"
  done
  for _ in $(seq 300); do
    states=$(SLURM_CONF=$NCONF sinfo -h -N -o %t 2>/dev/null | sort -u | tr '\n' ' ')
    [ "$states" = "idle " ] && { echo "local Slurm up: nodes node1..node$n idle (SLURM_CONF=$NCONF)"; return; }
    sleep 0.2
  done
  die "the $n local Slurm nodes did not become idle in 60 s; see $NDIR/slurmctld.log and $NDIR/slurmd-node*.log"
}

stop_nodes() {
  local ns pid
  for ns in $(ip netns list 2>/dev/null | awk -v p="^${NET}node[0-9]+$" '$1 ~ p {print $1}'); do
    for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
  if running_n slurmctld; then
    pid=$(cat "$NDIR/slurmctld.pid")
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  ip link del "$BRIDGE" 2>/dev/null || true
}

start_slurmd() { # node K's slurmd, inside its namespaces (the hostname picks its NodeName)
  mkdir -p "$NDIR/spool/node$1"
  # Debian's default line first, as on a real Debian node: `127.0.1.1 nodeK` makes the node's own name resolve to
  # loopback, which the rendezvous and gloo must not be fooled by
  { echo "127.0.1.1 node$1"; cat "$NDIR/hosts"; } >"$NDIR/hosts.node$1"
  SLURM_CONF=$NCONF unshare --mount --uts -- sh -c "mount --bind $NDIR/hosts.node$1 /etc/hosts && hostname node$1 && exec nsenter --net=/run/netns/${NET}node$1 slurmd -f $NCONF" \
    || die "slurmd of node$1 did not start; see $NDIR/slurmd-node$1.log"
}

crash_node() { # kills every process of node K (its slurmd, job steps, ranks) at once, as a node failure would
  ip netns list | grep -qw "${NET}node$1" || die "no node$1 (scripts/slurm_local.sh start --nodes N)"
  local pid
  for pid in $(ip netns pids "${NET}node$1"); do kill -9 "$pid" 2>/dev/null || true; done
  for _ in $(seq 100); do [ -z "$(ip netns pids "${NET}node$1")" ] && { echo "node$1 crashed"; return; }; sleep 0.1; done
  die "processes of node$1 survived kill -9"
}

revive_node() { # starts node K's slurmd again once its namespace is empty
  ip netns list | grep -qw "${NET}node$1" || die "no node$1 (scripts/slurm_local.sh start --nodes N)"
  [ -z "$(ip netns pids "${NET}node$1")" ] || die "node$1 still has processes; crash it first"
  start_slurmd "$1"
  echo "node$1 revived"
}

status_nodes() {
  running_n slurmctld || { echo "the local multi-node Slurm is not running (scripts/slurm_local.sh start --nodes N)"; return 1; }
  SLURM_CONF=$NCONF sinfo -N
}

nodes=1
cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  crash|revive) [[ "${1:-}" =~ ^[1-9][0-9]*$ ]] || die "usage: scripts/slurm_local.sh $cmd K (a node number)"
    if [ "$cmd" = crash ]; then crash_node "$1"; else revive_node "$1"; fi; exit 0;;
esac
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) { [ $# -ge 2 ] && [[ "$2" =~ ^[1-9][0-9]*$ ]]; } || die "--nodes needs a positive number"; nodes=$2; shift 2;;
    *) die "unknown option $1 (usage: scripts/slurm_local.sh {start|stop|status} [--nodes N])";;
  esac
done
case "$cmd" in
  start) if [ "$nodes" = 1 ]; then start; else start_nodes "$nodes"; fi;;
  stop) stop_nodes; stop; stop_munge;;
  status) if [ "$nodes" = 1 ]; then status; else status_nodes; fi;;
  *) echo "usage: scripts/slurm_local.sh {start|stop|status} [--nodes N] | {crash|revive} K" >&2; exit 2;;
esac
