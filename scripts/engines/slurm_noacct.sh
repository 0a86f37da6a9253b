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

SCRIPT_NAME=slurm_noacct.sh
# shellcheck source=lib/slurm_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/slurm_common.sh"

# ---------------------------------------------------------------------------------------------
# packages (no slurmdbd, no database: this cluster has no accounting)
# ---------------------------------------------------------------------------------------------
install_packages slurm-wlm munge
require_binaries sbatch squeue sacct scancel scontrol sinfo slurmctld slurmd munged

# ---------------------------------------------------------------------------------------------
# /etc/hosts: the virtual node names resolve to this host
# ---------------------------------------------------------------------------------------------
map_to_localhost "${NODES[@]}"

# ---------------------------------------------------------------------------------------------
# munge (shared with the other cluster: started here only if slurm.sh has not done it)
# ---------------------------------------------------------------------------------------------
start_munge

# ---------------------------------------------------------------------------------------------
# slurm.conf
# ---------------------------------------------------------------------------------------------
install -d -m 0755 "$CONF_DIR" "$LOG_DIR" "$RUN_DIR" "$SPOOL_DIR" "$(dirname "$STATE_DIR")"
install -d -m 0700 "$STATE_DIR"

host=$(hostname -s)
real_mem=$(real_memory)

slurm_changed=0
{
  cat <<EOF
# Written by asynctorchx scripts/engines/slurm_noacct.sh: a one-host cluster with four virtual nodes
# and NO accounting (no slurmdbd: sacct says "Slurm accounting storage is disabled").
ClusterName=${CLUSTER}
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
FirstJobId=${FIRST_JOB_ID}
StateSaveLocation=${STATE_DIR}
SlurmdSpoolDir=${SPOOL_DIR}/%n
SlurmctldPidFile=${RUN_DIR}/slurmctld.pid
SlurmdPidFile=${RUN_DIR}/slurmd-%n.pid
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/slurmd-%n.log
AccountingStorageType=accounting_storage/none
NodeName=${NODE_RANGE} NodeHostname=${host} NodeAddr=127.0.0.1 Port=${NODE_PORTS} CPUs=${CPUS_PER_NODE} Boards=1 SocketsPerBoard=1 CoresPerSocket=${CPUS_PER_NODE} ThreadsPerCore=1 RealMemory=${real_mem} Feature=virtual State=UNKNOWN
PartitionName=debug Nodes=${NODE_RANGE} Default=YES MaxTime=INFINITE State=UP
PartitionName=short Nodes=${NODE_RANGE} Default=NO MaxTime=10 State=UP
EOF
  slurm_conf_common
} | write_if_changed "$CONF" 0644 && slurm_changed=1 || true

# ---------------------------------------------------------------------------------------------
# slurmctld and the four slurmd
# ---------------------------------------------------------------------------------------------
start_slurm_daemons "$CONF" "$RUN_DIR" "$SPOOL_DIR" "$LOG_DIR" "$slurm_changed" "${NODES[@]}"

# The point of this cluster: sacct must refuse, with the message the backend detects.
sacct_err=$(sacct -n -X -S now 2>&1 >/dev/null) && die "sacct works on ${CLUSTER}: accounting is not off"
[[ $sacct_err == *"accounting storage is disabled"* ]] \
  || die "sacct on ${CLUSTER} failed with an unexpected message: ${sacct_err}"

start_scheduler_tick "$CONF" "$RUN_DIR"

log "ready: cluster ${CLUSTER} (SLURM_CONF=${CONF}), nodes ${NODES[*]}, accounting off"
