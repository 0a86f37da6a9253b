#!/usr/bin/env bash
# Starts a second one-host Slurm 22.05 cluster WITHOUT accounting (no slurmdbd, sacct answers "Slurm
# accounting storage is disabled"), for the tests of the slurm backend on such clusters: its own
# slurmctld (port 6827) and four virtual nodes nacct1..nacct4 (slurmd ports 17011-17014), from the
# config dir /etc/slurm-noacct. Client commands reach it with SLURM_CONF=/etc/slurm-noacct/slurm.conf.
#
# It shares nothing with the cluster of scripts/engines/slurm.sh but munge (same key, same munged):
# other ports, node names, state, spool, pid and log paths, and job ids starting at 1000000 (so
# that an id of one cluster never names a job of the other). Runs after slurm.sh (scripts/test.sh
# runs scripts/engines/*.sh in order) but does not need it. Nothing here uses systemd. Safe to run
# again: running daemons are kept, the config is rewritten only when it changes (and then this
# cluster's daemons restart), and the controller's state directory is kept.
#
# Environment:
#   ASYNCTORCHX_SLURM_CPUS  CPUs declared per virtual node (default 16, like slurm.sh).
#   ASYNCTORCHX_SLURM_WAIT  seconds to wait for each daemon (default 60).
set -euo pipefail

CLUSTER=atxnoacct
CPUS_PER_NODE=${ASYNCTORCHX_SLURM_CPUS:-16}
NODES=(nacct1 nacct2 nacct3 nacct4)
NODE_RANGE='nacct[1-4]'
NODE_PORTS='[17011-17014]'
CTLD_PORT=6827
CONF_DIR=/etc/slurm-noacct
CONF=$CONF_DIR/slurm.conf
STATE_DIR=/var/lib/slurm-noacct/slurmctld
SPOOL_DIR=/var/spool/slurmd-noacct
LOG_DIR=/var/log/slurm-noacct
RUN_DIR=/run/slurm-noacct
FIRST_JOB_ID=1000000
WAIT_SECONDS=${ASYNCTORCHX_SLURM_WAIT:-60}

# Every Slurm command below (and every daemon) talks to / reads this cluster's config.
export SLURM_CONF=$CONF

log() { printf 'slurm_noacct.sh: %s\n' "$*" >&2; }
die() { printf 'slurm_noacct.sh: error: %s\n' "$*" >&2; exit 1; }

# wait_for SECONDS DESCRIPTION COMMAND... : polls COMMAND every 0.2 s until it succeeds.
wait_for() {
  local seconds=$1 what=$2
  shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      die "timed out after ${seconds}s waiting for ${what}"
    fi
    sleep 0.2
  done
}

pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# stop_pidfile PIDFILE NAME : stops the daemon whose pid is in PIDFILE (if it runs), bounded.
stop_pidfile() {
  local pidfile=$1 name=$2
  pid_alive "$pidfile" || return 0
  local pid
  pid=$(cat "$pidfile")
  log "stopping $name (pid $pid)"
  kill "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + 20))
  while kill -0 "$pid" 2>/dev/null; do
    if ((SECONDS >= deadline)); then
      kill -9 "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.2
  done
  rm -f "$pidfile"
}

# write_if_changed PATH MODE : writes stdin to PATH when it differs; returns 0 when it changed.
write_if_changed() {
  local path=$1 mode=$2 tmp
  tmp=$(mktemp "${path}.XXXXXX")
  cat >"$tmp"
  chmod "$mode" "$tmp"
  if [[ -f $path ]] && cmp -s "$tmp" "$path"; then
    rm -f "$tmp"
    return 1
  fi
  mv -f "$tmp" "$path"
  return 0
}

# ---------------------------------------------------------------------------------------------
# packages (no slurmdbd, no database: this cluster has no accounting)
# ---------------------------------------------------------------------------------------------
PACKAGES=(slurm-wlm munge)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || die "apt-get update failed"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed"
fi
for bin in sbatch squeue sacct scancel scontrol sinfo slurmctld slurmd munged; do
  command -v "$bin" >/dev/null || [[ -x /usr/sbin/$bin ]] || die "$bin is missing after install"
done

# ---------------------------------------------------------------------------------------------
# /etc/hosts: the virtual node names resolve to this host
# ---------------------------------------------------------------------------------------------
for n in "${NODES[@]}"; do
  if ! grep -Eq "^[[:space:]]*127\.0\.0\.1([[:space:]].*)?[[:space:]]${n}([[:space:]]|$)" /etc/hosts; then
    printf '127.0.0.1 %s\n' "$n" >>/etc/hosts
  fi
done

# ---------------------------------------------------------------------------------------------
# munge (shared with the other cluster: started here only if slurm.sh has not done it)
# ---------------------------------------------------------------------------------------------
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
if [[ ! -s /etc/munge/munge.key ]]; then
  log "creating the munge key"
  if command -v mungekey >/dev/null; then
    runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
  else
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  fi
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
munge_ok() { munge -n | unmunge; }
if ! munge_ok >/dev/null 2>&1; then
  log "starting munged"
  runuser -u munge -- /usr/sbin/munged --force
  wait_for "$WAIT_SECONDS" munged munge_ok
fi

# ---------------------------------------------------------------------------------------------
# slurm.conf
# ---------------------------------------------------------------------------------------------
install -d -m 0755 "$CONF_DIR" "$LOG_DIR" "$RUN_DIR" "$SPOOL_DIR" "$(dirname "$STATE_DIR")"
install -d -m 0700 "$STATE_DIR"

host=$(hostname -s)
real_mem=$(/usr/sbin/slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -n1)
[[ -n $real_mem ]] || die "could not read RealMemory from 'slurmd -C'"

slurm_changed=0
write_if_changed "$CONF" 0644 <<EOF && slurm_changed=1 || true
# Written by asynctorchx scripts/engines/slurm_noacct.sh: a one-host cluster with four virtual nodes
# and NO accounting (no slurmdbd: sacct says "Slurm accounting storage is disabled").
ClusterName=${CLUSTER}
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=10
FirstJobId=${FIRST_JOB_ID}
StateSaveLocation=${STATE_DIR}
SlurmdSpoolDir=${SPOOL_DIR}/%n
SlurmctldPidFile=${RUN_DIR}/slurmctld.pid
SlurmdPidFile=${RUN_DIR}/slurmd-%n.pid
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldPort=${CTLD_PORT}
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,bf_hetjob_immediate
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
EnforcePartLimits=ALL
JobRequeue=1
KillWait=5
MinJobAge=300
InactiveLimit=0
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=${NODE_RANGE} NodeHostname=${host} NodeAddr=127.0.0.1 Port=${NODE_PORTS} CPUs=${CPUS_PER_NODE} Boards=1 SocketsPerBoard=1 CoresPerSocket=${CPUS_PER_NODE} ThreadsPerCore=1 RealMemory=${real_mem} Feature=virtual State=UNKNOWN
PartitionName=debug Nodes=${NODE_RANGE} Default=YES MaxTime=INFINITE State=UP
PartitionName=short Nodes=${NODE_RANGE} Default=NO MaxTime=10 State=UP
EOF

# ---------------------------------------------------------------------------------------------
# slurmctld and the four slurmd
# ---------------------------------------------------------------------------------------------
if ((slurm_changed)); then
  for n in "${NODES[@]}"; do stop_pidfile "$RUN_DIR/slurmd-$n.pid" "slurmd $n"; done
  stop_pidfile "$RUN_DIR/slurmctld.pid" slurmctld
fi
ctld_ok() { scontrol ping | grep -q 'is UP'; }
if ! pid_alive "$RUN_DIR/slurmctld.pid"; then
  log "starting slurmctld (port ${CTLD_PORT})"
  /usr/sbin/slurmctld -f "$CONF"
fi
wait_for "$WAIT_SECONDS" "slurmctld on port ${CTLD_PORT} (log: $LOG_DIR/slurmctld.log)" ctld_ok
for n in "${NODES[@]}"; do
  install -d -m 0755 "$SPOOL_DIR/$n"
  if ! pid_alive "$RUN_DIR/slurmd-$n.pid"; then
    log "starting slurmd $n"
    /usr/sbin/slurmd -f "$CONF" -N "$n"
  fi
done

nodes_ready() {
  local states
  states=$(sinfo -h -N -p debug -o '%N %t' | sort -u)
  [[ $(grep -cE ' (idle|mix|alloc)$' <<<"$states") -eq ${#NODES[@]} ]]
}
if ! nodes_ready; then
  # Nodes left DOWN/DRAIN by an earlier run come back here.
  sleep 1
  nodes_ready || scontrol update NodeName="$NODE_RANGE" State=RESUME >/dev/null 2>&1 || true
fi
wait_for "$WAIT_SECONDS" "4 idle Slurm nodes ($(sinfo -h -N -o '%N:%t' | tr '\n' ' '))" nodes_ready

# The point of this cluster: sacct must refuse, with the message the backend detects.
sacct_err=$(sacct -n -X -S now 2>&1 >/dev/null) && die "sacct works on ${CLUSTER}: accounting is not off"
[[ $sacct_err == *"accounting storage is disabled"* ]] \
  || die "sacct on ${CLUSTER} failed with an unexpected message: ${sacct_err}"

# The same scheduler tick as slurm.sh (see there): without traffic the backfill scheduler skips
# cycles, and a requeued job would wait for an unrelated event to start again.
tick_pidfile=$RUN_DIR/asynctorchx-tick.pid
if ! pid_alive "$tick_pidfile"; then
  log "starting the scheduler tick"
  setsid nohup env SLURM_CONF="$CONF" bash -c "echo \$\$ >'$tick_pidfile'; while sleep 2; do scontrol update PartitionName=debug State=UP >/dev/null 2>&1 || true; done" \
    </dev/null >/dev/null 2>&1 &
  wait_for 10 "the scheduler tick" pid_alive "$tick_pidfile"
fi

log "ready: cluster ${CLUSTER} (SLURM_CONF=${CONF}), nodes ${NODES[*]}, accounting off"
