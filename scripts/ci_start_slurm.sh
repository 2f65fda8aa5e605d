#!/usr/bin/env bash
# Start (or stop) a private one-node SLURM cluster on this machine, for the SLURM submission test.
#
# Usage:
#   scripts/ci_start_slurm.sh [start]    install nothing; configure + start munged, slurmctld, slurmd
#   scripts/ci_start_slurm.sh stop       stop the daemons this script started (by their pid files)
#   scripts/ci_start_slurm.sh status     print the status file
#
# Needs Debian's `slurm-wlm` and `munge` packages (`apt-get install slurm-wlm munge`) and root
# (SlurmUser=root). Everything lives under $NEMO_FP8_SLURM_DIR (default /tmp/nemo_fp8_slurm): its
# own munge key and socket, slurm.conf, spool/state directories, logs and pid files, on
# non-default ports — so a SLURM already configured on the machine (/etc/slurm) is never touched
# and never used. Clients reach this cluster through SLURM_CONF=$NEMO_FP8_SLURM_DIR/slurm.conf.
#
# The result is written to $NEMO_FP8_SLURM_DIR/status as shell-style KEY=VALUE lines:
#   SLURM_STATUS=ok|failed   SLURM_REASON=<why it failed>   SLURM_CONF=<path>   SLURM_NODE=<name>
# tests/launch/test_slurm.py reads that file: it runs the real submission when the status is ok and skips
# with SLURM_REASON otherwise. This script exits 0 in both cases (CI carries on; the test says why
# it skipped) unless called with --strict, which makes a failure exit 1.
set -uo pipefail

# ---- CONFIG ----------------------------------------------------------------------------------
DIR="${NEMO_FP8_SLURM_DIR:-/tmp/nemo_fp8_slurm}"
CTLD_PORT="${NEMO_FP8_SLURMCTLD_PORT:-16817}"   # not the default 6817: never clash with a real cluster
SLURMD_PORT="${NEMO_FP8_SLURMD_PORT:-16818}"
WAIT_S="${NEMO_FP8_SLURM_WAIT_S:-60}"          # how long to wait for the node to become idle
STATUS="$DIR/status"
CONF="$DIR/slurm.conf"
SOCKET="$DIR/munge/munge.socket"

action="start"
strict=0
for arg in "$@"; do
  case "$arg" in
    start|stop|status) action="$arg" ;;
    --strict) strict=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "ci_start_slurm.sh: unknown argument '$arg' (use start, stop, status, --strict)" >&2; exit 2 ;;
  esac
done

log() { echo "[ci_start_slurm] $*"; }

stop_daemons() {
  # Only the processes this script started, by the pids they wrote.
  local name pidfile pid
  for name in slurmd slurmctld munged; do
    pidfile="$DIR/run/$name.pid"
    [ -f "$pidfile" ] || continue
    pid="$(cat "$pidfile" 2>/dev/null || true)"
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
      log "stopping $name (pid $pid)"
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$pidfile"
  done
}

write_status() {  # write_status ok|failed "reason"
  mkdir -p "$DIR"
  {
    printf 'SLURM_STATUS=%s\n' "$1"
    printf 'SLURM_REASON=%s\n' "$(printf '%s' "$2" | tr '\n' ' ')"
    printf 'SLURM_CONF=%s\n' "$CONF"
    printf 'SLURM_NODE=%s\n' "${NODE:-}"
    printf 'SLURM_DIR=%s\n' "$DIR"
  } > "$STATUS"
}

fail() {
  log "FAILED: $1"
  for f in "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log" "$DIR/log/munged.log"; do
    if [ -s "$f" ]; then log "last lines of $f:"; tail -n 15 "$f" | sed 's/^/    /'; fi
  done
  write_status failed "$1"
  stop_daemons
  if [ "$strict" = 1 ]; then exit 1; fi
  exit 0
}

case "$action" in
  stop) stop_daemons; [ -f "$STATUS" ] && write_status failed "stopped by ci_start_slurm.sh stop"; exit 0 ;;
  status) cat "$STATUS" 2>/dev/null || echo "no status file at $STATUS"; exit 0 ;;
esac

# ---- preconditions -----------------------------------------------------------------------------
NODE="$(hostname -s 2>/dev/null || hostname)"
[ "$(id -u)" = 0 ] || fail "needs root (SlurmUser=root for a throwaway one-node cluster); running as uid $(id -u)"
for bin in munged mungekey slurmctld slurmd sinfo sbatch scontrol; do
  command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || \
    fail "'$bin' not found: install Debian's slurm-wlm and munge (apt-get install slurm-wlm munge)"
done
export PATH="$PATH:/usr/sbin:/sbin"

stop_daemons  # a previous run of this script
rm -rf "$DIR"
mkdir -p "$DIR"/{munge,log,run,spool/slurmd,state/slurmctld}
chmod 0755 "$DIR" "$DIR"/{log,run,spool,state}
chmod 0700 "$DIR/munge"

# ---- munge -------------------------------------------------------------------------------------
mungekey --create --keyfile="$DIR/munge/munge.key" --force >"$DIR/log/mungekey.log" 2>&1 \
  || fail "mungekey could not create a key: $(cat "$DIR/log/mungekey.log")"
chmod 0400 "$DIR/munge/munge.key"
munged --force --socket="$SOCKET" --key-file="$DIR/munge/munge.key" \
  --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
  --seed-file="$DIR/munge/munged.seed" >"$DIR/log/munged.start" 2>&1 \
  || fail "munged did not start: $(cat "$DIR/log/munged.start")"
for _ in $(seq 1 50); do [ -S "$SOCKET" ] && break; sleep 0.1; done
[ -S "$SOCKET" ] || fail "munged started but its socket $SOCKET did not appear"
if command -v munge >/dev/null && command -v unmunge >/dev/null; then
  munge -S "$SOCKET" -n | unmunge -S "$SOCKET" >/dev/null 2>&1 || fail "munge round trip failed on $SOCKET"
fi

# ---- slurm.conf: one node, this machine, every CPU ------------------------------------------------
CPUS="$(nproc)"
cat > "$CONF" <<EOF
# Written by scripts/ci_start_slurm.sh: a private one-node cluster for tests. Not for production.
ClusterName=nemofp8ci
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
StateSaveLocation=$DIR/state/slurmctld
SlurmdSpoolDir=$DIR/spool/slurmd
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
MinJobAge=3600
InactiveLimit=0
KillWait=5
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$CONF"

# ---- daemons -----------------------------------------------------------------------------------
slurmctld -f "$CONF" >"$DIR/log/slurmctld.start" 2>&1 \
  || fail "slurmctld did not start: $(cat "$DIR/log/slurmctld.start")"
slurmd -f "$CONF" -N "$NODE" >"$DIR/log/slurmd.start" 2>&1 \
  || fail "slurmd did not start: $(cat "$DIR/log/slurmd.start")"

state=""
deadline=$(( $(date +%s) + WAIT_S ))
resumed=0
while [ "$(date +%s)" -lt "$deadline" ]; do
  state="$(sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n1)"
  case "$state" in
    idle|idle\*) [ "$state" = idle ] && break ;;
    down*|drain*|fail*)
      if [ "$resumed" = 0 ]; then
        log "node $NODE is '$state'; resuming it"
        scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
        resumed=1
      fi ;;
  esac
  sleep 1
done
[ "$state" = idle ] || fail "node $NODE did not become idle within ${WAIT_S}s (sinfo state: '${state:-no answer}')"

write_status ok ""
log "one-node cluster up: node $NODE, $CPUS CPUs, partition debug; export SLURM_CONF=$CONF"
sinfo
exit 0
