#!/usr/bin/env bash
# A single-node Slurm (slurmctld + slurmd + munge) on this machine, to try and test the cluster path.
#   scripts/slurm_local.sh start    # installs slurm-wlm + munge with apt-get if missing, starts, waits until idle
#   scripts/slurm_local.sh status   # prints sinfo; exit 0 when the node answers
#   scripts/slurm_local.sh stop
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

install() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
  command -v apt-get >/dev/null || die "Slurm is not installed and apt-get is missing; install slurm-wlm and munge with your package manager"
  echo "installing slurm-wlm and munge with apt-get ..."
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >"$DIR/apt.log" 2>&1 \
    || { apt-get update -q >>"$DIR/apt.log" 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >>"$DIR/apt.log" 2>&1; } \
    || die "apt-get install slurm-wlm munge failed; see $DIR/apt.log"
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

start_munge() {
  if [ -S /run/munge/munge.socket.2 ] && munge -n </dev/null >/dev/null 2>&1; then return; fi
  [ -f /etc/munge/munge.key ] || { mkdir -p /etc/munge; dd if=/dev/urandom of=/etc/munge/munge.key bs=1k count=1 2>/dev/null; }
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  if id munge >/dev/null 2>&1; then
    chown munge:munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
    chmod 0400 /etc/munge/munge.key
    runuser -u munge -- munged
  else
    chmod 0400 /etc/munge/munge.key
    munged --force
  fi
  for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && return; sleep 0.1; done
  die "munged did not start; see /var/log/munge/munged.log"
}

start() {
  [ "$(id -u)" = 0 ] || die "scripts/slurm_local.sh start needs root (it installs packages and runs slurmctld/slurmd); run it with sudo"
  mkdir -p "$DIR/state" "$DIR/spool"
  install
  if ! running slurmctld || ! running slurmd; then
    port_taken "$CTLD_PORT" slurmctld && die "port $CTLD_PORT is taken by another program; set SLURM_LOCAL_CTLD_PORT to a free port"
    port_taken "$SLURMD_PORT" slurmd && die "port $SLURMD_PORT is taken by another program; set SLURM_LOCAL_SLURMD_PORT to a free port"
    write_conf
  fi
  [ -e /etc/slurm/slurm.conf ] || { mkdir -p /etc/slurm; ln -s "$CONF" /etc/slurm/slurm.conf; }
  start_munge
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

case "${1:-}" in
  start) start;;
  stop) stop;;
  status) status;;
  *) echo "usage: scripts/slurm_local.sh {start|stop|status}" >&2; exit 2;;
esac
