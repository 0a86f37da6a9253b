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

SCRIPT_NAME=slurm.sh
# shellcheck source=lib/slurm_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/slurm_common.sh"

# ---------------------------------------------------------------------------------------------
# packages
# ---------------------------------------------------------------------------------------------
install_packages slurm-wlm munge slurmdbd slurm-wlm-mysql-plugin mariadb-server mariadb-client
require_binaries sbatch squeue sacct scancel scontrol slurmctld slurmd slurmdbd munged mariadbd

# ---------------------------------------------------------------------------------------------
# /etc/hosts: the virtual node names resolve to this host
# ---------------------------------------------------------------------------------------------
map_to_localhost "${NODES[@]}"

# ---------------------------------------------------------------------------------------------
# munge
# ---------------------------------------------------------------------------------------------
start_munge

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
# Converges whatever MariaDB holds (a user of an earlier install with another password, lost grants).
converge_db_user "$DB_NAME" "$DB_USER" "$DB_PASS"

install -d -m 0755 "$CONF_DIR" "$LOG_DIR" "$RUN_DIR" /var/lib/slurm
install -d -m 0700 "$STATE_DIR"

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
real_mem=$(real_memory)

# Job ids must keep growing: the controller's saved state carries the sequence; when that state is
# missing (first start, or wiped) start after the highest id the accounting database has seen.
first_job_id_file=/var/lib/slurm/asynctorchx-first-job-id
if ! pid_alive "$RUN_DIR/slurmctld.pid" slurmctld "-f $CONF_DIR/slurm.conf " && [[ ! -f $STATE_DIR/job_state || ! -f $first_job_id_file ]]; then
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
{
  cat <<EOF
# Written by asynctorchx scripts/engines/slurm.sh: a one-host cluster with four virtual nodes.
ClusterName=${CLUSTER}
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=6817
FirstJobId=${first_job_id}
StateSaveLocation=${STATE_DIR}
SlurmdSpoolDir=${SPOOL_DIR}/%n
SlurmctldPidFile=${RUN_DIR}/slurmctld.pid
SlurmdPidFile=${RUN_DIR}/slurmd-%n.pid
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/slurmd-%n.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
NodeName=node[1-4] NodeHostname=${host} NodeAddr=127.0.0.1 Port=[17001-17004] CPUs=${CPUS_PER_NODE} Boards=1 SocketsPerBoard=1 CoresPerSocket=${CPUS_PER_NODE} ThreadsPerCore=1 RealMemory=${real_mem} Feature=virtual State=UNKNOWN
PartitionName=debug Nodes=node[1-4] Default=YES MaxTime=INFINITE State=UP
PartitionName=short Nodes=node[1-4] Default=NO MaxTime=10 State=UP
EOF
  slurm_conf_common
} | write_if_changed "$CONF_DIR/slurm.conf" 0644 && slurm_changed=1 || true

# slurmdbd first: slurmctld registers with it, and sacctmgr needs slurm.conf. A slurmdbd that runs
# but does not answer (e.g. it lost its database connection while the password was wrong) restarts.
dbd_answers() { timeout 15 sacctmgr -n show cluster >/dev/null 2>&1; }
if ((dbd_changed)); then
  stop_pidfile "$RUN_DIR/slurmdbd.pid" slurmdbd slurmdbd
elif pid_alive "$RUN_DIR/slurmdbd.pid" slurmdbd && ! dbd_answers; then
  log "slurmdbd does not answer: restarting it"
  stop_pidfile "$RUN_DIR/slurmdbd.pid" slurmdbd slurmdbd
fi
if ! pid_alive "$RUN_DIR/slurmdbd.pid" slurmdbd; then
  log "starting slurmdbd"
  /usr/sbin/slurmdbd
fi
wait_for "$WAIT_SECONDS" slurmdbd sacctmgr -n show cluster
if ! sacctmgr -n -P show cluster format=cluster | grep -x "$CLUSTER" >/dev/null; then
  sacctmgr -i add cluster "$CLUSTER" >/dev/null
fi

# ---------------------------------------------------------------------------------------------
# slurmctld and the four slurmd
# ---------------------------------------------------------------------------------------------
start_slurm_daemons "$CONF_DIR/slurm.conf" "$RUN_DIR" "$SPOOL_DIR" "$LOG_DIR" "$slurm_changed" "${NODES[@]}"
wait_for "$WAIT_SECONDS" "accounting (sacct)" sacct -n -X -S now

start_scheduler_tick "$CONF_DIR/slurm.conf" "$RUN_DIR"

log "ready: cluster ${CLUSTER}, nodes ${NODES[*]}, accounting on (slurmdbd)"
