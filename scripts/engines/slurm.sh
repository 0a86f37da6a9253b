#!/usr/bin/env bash
# Installs and starts a one-host Slurm 22.05 cluster for the test suite: munge, MariaDB + slurmdbd
# (accounting), slurmctld and four virtual nodes (node1..node4, one slurmd each) on this host.
#
# Heterogeneous jobs need one node per component, hence the virtual nodes; their names map to
# 127.0.0.1 in /etc/hosts so that jobs can reach their rank-0 node by name. Nothing here uses
# systemd. Safe to run again: running daemons are kept, configs are rewritten only when they change
# (and then the Slurm daemons restart), and the controller's state directory is kept so job ids
# keep growing across restarts.
#
# Environment:
#   ASYNCTORCHX_SLURM_CPUS  CPUs declared per virtual node (default 16; oversubscribes this host so
#                           that many small test jobs run at once).
set -euo pipefail

CLUSTER=asynctorchx
CPUS_PER_NODE=${ASYNCTORCHX_SLURM_CPUS:-16}
NODES=(node1 node2 node3 node4)
CONF_DIR=/etc/slurm
STATE_DIR=/var/lib/slurm/slurmctld
SPOOL_DIR=/var/spool/slurmd
LOG_DIR=/var/log/slurm
RUN_DIR=/run/slurm
DB_NAME=slurm_acct_db
DB_USER=slurm
DB_PASS=asynctorchx-slurmdbd
WAIT_SECONDS=${ASYNCTORCHX_SLURM_WAIT:-60}

log() { printf 'slurm.sh: %s\n' "$*" >&2; }
die() { printf 'slurm.sh: error: %s\n' "$*" >&2; exit 1; }

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

# ---------------------------------------------------------------------------------------------
# packages
# ---------------------------------------------------------------------------------------------
PACKAGES=(slurm-wlm munge slurmdbd slurm-wlm-mysql-plugin mariadb-server mariadb-client)
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
for bin in sbatch squeue sacct scancel scontrol slurmctld slurmd slurmdbd munged mariadbd; do
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
# munge
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
# MariaDB and slurmdbd (accounting)
# ---------------------------------------------------------------------------------------------
install -d -o mysql -g mysql -m 0755 /run/mysqld
if [[ ! -d /var/lib/mysql/mysql ]]; then
  log "initialising the MariaDB data directory"
  mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
fi
db_ok() { mariadb-admin --protocol=socket ping; }
if ! db_ok >/dev/null 2>&1; then
  log "starting MariaDB"
  setsid nohup /usr/sbin/mariadbd --user=mysql --datadir=/var/lib/mysql \
    --socket=/run/mysqld/mysqld.sock --pid-file=/run/mysqld/mysqld.pid \
    --bind-address=127.0.0.1 --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 \
    </dev/null >>/var/log/asynctorchx-mariadb.log 2>&1 &
  wait_for "$WAIT_SECONDS" MariaDB db_ok
fi
mariadb --protocol=socket <<SQL
CREATE DATABASE IF NOT EXISTS ${DB_NAME};
CREATE USER IF NOT EXISTS '${DB_USER}'@'localhost' IDENTIFIED BY '${DB_PASS}';
GRANT ALL ON ${DB_NAME}.* TO '${DB_USER}'@'localhost';
FLUSH PRIVILEGES;
SQL

install -d -m 0755 "$CONF_DIR" "$LOG_DIR" "$RUN_DIR" /var/lib/slurm
install -d -m 0700 "$STATE_DIR"

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

dbd_changed=0
write_if_changed "$CONF_DIR/slurmdbd.conf" 0600 <<EOF && dbd_changed=1 || true
# Written by asynctorchx scripts/engines/slurm.sh
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
PidFile=${RUN_DIR}/slurmdbd.pid
LogFile=${LOG_DIR}/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=${DB_USER}
StoragePass=${DB_PASS}
StorageLoc=${DB_NAME}
EOF

# ---------------------------------------------------------------------------------------------
# slurm.conf
# ---------------------------------------------------------------------------------------------
host=$(hostname -s)
real_mem=$(/usr/sbin/slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -n1)
[[ -n $real_mem ]] || die "could not read RealMemory from 'slurmd -C'"

# Job ids must keep growing: the controller's saved state carries the sequence; when that state is
# missing (first start, or wiped) start after the highest id the accounting database has seen.
first_job_id_file=/var/lib/slurm/asynctorchx-first-job-id
if ! pid_alive "$RUN_DIR/slurmctld.pid" && [[ ! -f $STATE_DIR/job_state || ! -f $first_job_id_file ]]; then
  max_db_id=$(mariadb --protocol=socket -N -B -e \
    "SELECT COALESCE(MAX(id_job), 0) FROM ${DB_NAME}.${CLUSTER}_job_table" 2>/dev/null || echo 0)
  prev=$(cat "$first_job_id_file" 2>/dev/null || echo 1)
  next=$((max_db_id + 1))
  ((next > prev)) || next=$prev
  if [[ ! -f $STATE_DIR/job_state ]]; then
    echo "$next" >"$first_job_id_file"
  elif [[ ! -f $first_job_id_file ]]; then
    echo "$prev" >"$first_job_id_file"
  fi
fi
first_job_id=$(cat "$first_job_id_file")

slurm_changed=0
write_if_changed "$CONF_DIR/slurm.conf" 0644 <<EOF && slurm_changed=1 || true
# Written by asynctorchx scripts/engines/slurm.sh: a one-host cluster with four virtual nodes.
ClusterName=${CLUSTER}
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=10
FirstJobId=${first_job_id}
StateSaveLocation=${STATE_DIR}
SlurmdSpoolDir=${SPOOL_DIR}/%n
SlurmctldPidFile=${RUN_DIR}/slurmctld.pid
SlurmdPidFile=${RUN_DIR}/slurmd-%n.pid
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldPort=6817
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
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
NodeName=node[1-4] NodeHostname=${host} NodeAddr=127.0.0.1 Port=[17001-17004] CPUs=${CPUS_PER_NODE} Boards=1 SocketsPerBoard=1 CoresPerSocket=${CPUS_PER_NODE} ThreadsPerCore=1 RealMemory=${real_mem} Feature=virtual State=UNKNOWN
PartitionName=debug Nodes=node[1-4] Default=YES MaxTime=INFINITE State=UP
PartitionName=short Nodes=node[1-4] Default=NO MaxTime=10 State=UP
EOF

# slurmdbd first: slurmctld registers with it, and sacctmgr needs slurm.conf.
if ((dbd_changed)); then
  stop_pidfile "$RUN_DIR/slurmdbd.pid" slurmdbd
fi
if ! pid_alive "$RUN_DIR/slurmdbd.pid"; then
  log "starting slurmdbd"
  /usr/sbin/slurmdbd
fi
wait_for "$WAIT_SECONDS" slurmdbd sacctmgr -n show cluster
if ! sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER"; then
  sacctmgr -i add cluster "$CLUSTER" >/dev/null
fi

# ---------------------------------------------------------------------------------------------
# slurmctld and the four slurmd
# ---------------------------------------------------------------------------------------------
if ((slurm_changed)); then
  for n in "${NODES[@]}"; do stop_pidfile "$RUN_DIR/slurmd-$n.pid" "slurmd $n"; done
  stop_pidfile "$RUN_DIR/slurmctld.pid" slurmctld
fi
ctld_ok() { scontrol ping | grep -q 'is UP'; }
if ! pid_alive "$RUN_DIR/slurmctld.pid"; then
  log "starting slurmctld"
  /usr/sbin/slurmctld
fi
wait_for "$WAIT_SECONDS" slurmctld ctld_ok
for n in "${NODES[@]}"; do
  install -d -m 0755 "$SPOOL_DIR/$n"
  if ! pid_alive "$RUN_DIR/slurmd-$n.pid"; then
    log "starting slurmd $n"
    /usr/sbin/slurmd -N "$n"
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
  nodes_ready || scontrol update NodeName=node[1-4] State=RESUME >/dev/null 2>&1 || true
fi
wait_for "$WAIT_SECONDS" "4 idle Slurm nodes ($(sinfo -h -N -o '%N:%t' | tr '\n' ' '))" nodes_ready
wait_for "$WAIT_SECONDS" "accounting (sacct)" sacct -n -X -S now

# The backfill scheduler (the only one that starts heterogeneous jobs) skips a cycle when no job,
# node or partition changed since the last one. On an idle cluster a requeued job that becomes
# eligible again (after cred_expire) would wait for the next unrelated event; a busy cluster has
# them all the time. A no-op partition update every 2 s stands in for that traffic here.
tick_pidfile=$RUN_DIR/asynctorchx-tick.pid
if ! pid_alive "$tick_pidfile"; then
  log "starting the scheduler tick"
  setsid nohup bash -c "echo \$\$ >'$tick_pidfile'; while sleep 2; do scontrol update PartitionName=debug State=UP >/dev/null 2>&1 || true; done" \
    </dev/null >/dev/null 2>&1 &
  wait_for 10 "the scheduler tick" pid_alive "$tick_pidfile"
fi

log "ready: cluster ${CLUSTER}, nodes ${NODES[*]}, accounting on (slurmdbd)"
