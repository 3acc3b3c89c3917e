#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine (Debian's slurm-wlm and munge, on localhost), for
# running the sbatch scripts of run_scripts/ in tests (`make test-slurm`). Needs root.
#
#   tools/slurm_local_cluster.sh install   # apt-get install slurm-wlm munge (if missing)
#   tools/slurm_local_cluster.sh start     # munge key, munged, slurm.conf, slurmctld, slurmd;
#                                          # waits until `sinfo` shows the node idle
#   tools/slurm_local_cluster.sh status    # which daemons run, and sinfo
#   tools/slurm_local_cluster.sh stop      # stop the daemons `start` started (by pid file)
#
# `start` is safe to run twice: running daemons are left alone. It writes /etc/slurm/slurm.conf
# (one node, <hostname -s> with <nproc> CPUs, partition "debug") and refuses to replace a slurm.conf
# it did not write. A requeued job may start again 11 s after the requeue (AuthInfo=cred_expire=10;
# Slurm's default: 121 s), and starts within 2 s of that (sched_interval=2; default: 60 s). No
# cgroup.conf: proctrack/linuxproc and task/none need none (and with CgroupPlugin=disabled slurmd
# refuses to start). Logs: /var/log/slurm/slurm{ctld,d}.log.
# SLURM_START_TIMEOUT: seconds to wait for the node to become idle (default 60).
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARKER="# Written by tools/slurm_local_cluster.sh"
RUN_DIR=/run/slurm-local                      # pid files of the daemons this script starts
STATE_DIR=/var/lib/slurm-local                # slurmctld state and slurmd spool
LOG_DIR=/var/log/slurm
MUNGE_KEY=/etc/munge/munge.key
MUNGE_PID=/run/munge/munged.pid               # munged's default pid file
MUNGE_STARTED="$RUN_DIR/munged.started"       # present when this script started munged
START_TIMEOUT="${SLURM_START_TIMEOUT:-60}"

slurm_version() { dpkg-query -W -f='slurm-wlm ${Version}' slurm-wlm 2>/dev/null || echo "slurm-wlm"; }
say() { echo "slurm_local_cluster: $*"; }
die() { echo "error: slurm_local_cluster: $*" >&2; exit 2; }
need_root() { [ "$(id -u)" -eq 0 ] || die "'$1' needs root (it installs packages / starts system daemons)"; }

alive() {  # alive PIDFILE NAME: the pid file names a running process called NAME
  local pid
  [ -f "$1" ] && pid=$(cat "$1" 2>/dev/null) && [ -n "$pid" ] || return 1
  [ "$(ps -o comm= -p "$pid" 2>/dev/null)" = "$2" ]
}

stop_pidfile() {  # stop_pidfile PIDFILE NAME: TERM, then KILL after 15 s; remove the pid file
  if alive "$1" "$2"; then
    local pid i; pid=$(cat "$1")
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then say "$2 ($pid) ignored SIGTERM: SIGKILL"; kill -KILL "$pid" || true; fi
    say "stopped $2 ($pid)"
  else
    say "$2 not running (from $1)"
  fi
  rm -f "$1"
}

munge_works() { command -v munge >/dev/null && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

cmd_install() {
  need_root install
  if command -v sbatch >/dev/null && command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
     && command -v munged >/dev/null; then
    say "slurm-wlm and munge already installed ($(slurm_version))"
    return
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurm-wlm munge
  say "installed $(slurm_version)"
}

write_conf() {
  local host cpus new
  host=$(hostname -s); cpus=$(nproc)
  new=$(cat <<EOF
$MARKER: a one-node cluster on localhost.
ClusterName=local
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=sched_interval=2
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation=$STATE_DIR/slurmctld
SlurmdSpoolDir=$STATE_DIR/slurmd
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
)
  if [ -f "$CONF" ] && ! grep -qF "$MARKER" "$CONF"; then
    die "$CONF exists and was not written by this script: not replacing it"
  fi
  if [ -f "$CONF" ] && [ "$(cat "$CONF")" = "$new" ]; then
    say "$CONF up to date ($host, $cpus CPUs)"
  else
    mkdir -p "$(dirname "$CONF")"
    printf '%s\n' "$new" > "$CONF"
    say "wrote $CONF ($host, $cpus CPUs)"
  fi
}

start_munge() {
  if munge_works; then say "munge works already"; return; fi
  if [ ! -s "$MUNGE_KEY" ]; then
    mkdir -p "$(dirname "$MUNGE_KEY")"
    dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
    say "made $MUNGE_KEY"
  fi
  chown munge:munge "$MUNGE_KEY" "$(dirname "$MUNGE_KEY")"
  chmod 400 "$MUNGE_KEY"
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- munged
  touch "$MUNGE_STARTED"
  local i
  for i in $(seq 50); do munge_works && break; sleep 0.1; done
  munge_works || die "munged started but munge -n | unmunge fails: see /var/log/munge/munged.log"
  say "started munged ($(cat "$MUNGE_PID"))"
}

node_state() { sinfo -h -N -o '%t' 2>/dev/null | head -n 1; }

cmd_start() {
  need_root start
  command -v slurmctld >/dev/null || die "Slurm is not installed: run '$0 install' first"
  mkdir -p "$RUN_DIR" "$STATE_DIR/slurmctld" "$STATE_DIR/slurmd" "$LOG_DIR"
  start_munge
  write_conf
  if alive "$RUN_DIR/slurmctld.pid" slurmctld; then say "slurmctld running already ($(cat "$RUN_DIR/slurmctld.pid"))"
  else slurmctld; say "started slurmctld"; fi
  if alive "$RUN_DIR/slurmd.pid" slurmd; then say "slurmd running already ($(cat "$RUN_DIR/slurmd.pid"))"
  else slurmd; say "started slurmd"; fi
  local waited=0 state=""
  while [ "$waited" -lt "$START_TIMEOUT" ]; do
    state=$(node_state)
    case "$state" in idle|mix|alloc) say "node $(hostname -s) is $state"; sinfo; return ;; esac
    sleep 1; waited=$((waited + 1))
  done
  sinfo >&2 || true
  tail -n 20 "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" >&2 || true
  die "the node is not idle after ${START_TIMEOUT}s (state: '${state:-no answer}'); logs above, in $LOG_DIR"
}

cmd_stop() {
  need_root stop
  stop_pidfile "$RUN_DIR/slurmd.pid" slurmd
  stop_pidfile "$RUN_DIR/slurmctld.pid" slurmctld
  if [ -f "$MUNGE_STARTED" ]; then
    stop_pidfile "$MUNGE_PID" munged
    rm -f "$MUNGE_STARTED"
  fi
}

cmd_status() {
  local name file
  for name in slurmctld slurmd; do
    file="$RUN_DIR/$name.pid"
    if alive "$file" "$name"; then echo "$name: running ($(cat "$file"))"; else echo "$name: stopped"; fi
  done
  if munge_works; then echo "munge: working"; else echo "munge: not working"; fi
  if command -v sinfo >/dev/null; then sinfo 2>&1 || true; else echo "sinfo: not installed"; fi
}

case "${1:-}" in
  install) cmd_install ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
