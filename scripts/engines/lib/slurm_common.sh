# shellcheck shell=bash
# Shared by scripts/engines/slurm.sh, slurm_noacct.sh and registry.sh (sourced, not run:
# scripts/test.sh runs only scripts/engines/*.sh). Each caller sets SCRIPT_NAME and WAIT_SECONDS before sourcing this file.
# Nothing here uses systemd.

log() { printf '%s: %s\n' "$SCRIPT_NAME" "$*" >&2; }
die() { printf '%s: error: %s\n' "$SCRIPT_NAME" "$*" >&2; exit 1; }

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

# pid_matches PID TEXT... : PID is a live process whose command line contains every TEXT (a
# zombie's command line is empty, so one that has exited but is not reaped yet does not match).
pid_matches() {
  local pid=$1 cmdline text
  shift
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  cmdline=$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline") || return 1
  for text in "$@"; do
    [[ $cmdline == *"$text"* ]] || return 1
  done
}

# pid_alive PIDFILE TEXT... : the pid in PIDFILE is a live process whose command line contains
# every TEXT. Pid files outlive their daemons (a new machine or a CI run starts with /run as the
# last one left it), and a pid they name may belong to an unrelated process by now: a bare
# `kill -0` would take that process for the daemon, never start the daemon, and stop_pidfile would
# kill the stranger.
pid_alive() {
  [[ -s $1 ]] && pid_matches "$(<"$1")" "${@:2}"
}

# stop_pidfile PIDFILE NAME TEXT... : stops the daemon whose pid is in PIDFILE (when it runs and its
# command line contains every TEXT, see pid_alive), bounded.
stop_pidfile() {
  local pidfile=$1 name=$2
  shift 2
  pid_alive "$pidfile" "$@" || { rm -f "$pidfile"; return 0; }
  local pid
  pid=$(<"$pidfile")
  log "stopping $name (pid $pid)"
  kill "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + 20))
  while pid_matches "$pid" "$@"; do
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

# converge_db_user DATABASE USER PASSWORD : makes MariaDB (reached through its socket as root) hold
# DATABASE and USER@localhost with exactly PASSWORD, unlocked and not expiring, with every privilege
# on DATABASE, whatever it held before: no such user, the user with another password or another
# authentication plugin (e.g. left by an earlier install), locked, or without its grants. Then checks
# that USER logs in to DATABASE with PASSWORD, as slurmdbd will; dies with the reason otherwise.
converge_db_user() {
  local db=$1 user=$2 pass=$3
  [[ $db =~ ^[A-Za-z0-9_]+$ && $user =~ ^[A-Za-z0-9_]+$ ]] \
    || die "converge_db_user: database and user names must be [A-Za-z0-9_]+, got '$db' and '$user'"
  [[ -n $pass && $pass != *[\'\\]* ]] \
    || die "converge_db_user: the password must be non-empty, without quotes or backslashes"
  mariadb --protocol=socket <<SQL || die "could not set up MariaDB database ${db} and user ${user}"
CREATE DATABASE IF NOT EXISTS \`${db}\`;
CREATE USER IF NOT EXISTS '${user}'@'localhost' IDENTIFIED BY '${pass}';
ALTER USER '${user}'@'localhost' IDENTIFIED BY '${pass}' PASSWORD EXPIRE NEVER ACCOUNT UNLOCK;
GRANT ALL PRIVILEGES ON \`${db}\`.* TO '${user}'@'localhost';
FLUSH PRIVILEGES;
SQL
  local err
  err=$(MYSQL_PWD=$pass mariadb --protocol=socket -u "$user" -N -B -e 'SELECT 1' "$db" 2>&1 >/dev/null) \
    || die "MariaDB user ${user} cannot use ${db} with the configured password: ${err}"
}

# install_packages PACKAGE... : apt-installs the packages not installed yet.
install_packages() {
  local p missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep "install ok installed" >/dev/null || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
      || die "apt-get install ${missing[*]} failed"
  fi
}

# require_binaries NAME... : dies unless each program is on PATH or in /usr/sbin.
require_binaries() {
  local bin
  for bin in "$@"; do
    command -v "$bin" >/dev/null || [[ -x /usr/sbin/$bin ]] || die "$bin is missing after install"
  done
}

# map_to_localhost NAME... : makes each name resolve to 127.0.0.1 through /etc/hosts.
map_to_localhost() {
  local n
  for n in "$@"; do
    if ! grep -Eq "^[[:space:]]*127\.0\.0\.1([[:space:]].*)?[[:space:]]${n}([[:space:]]|$)" /etc/hosts; then
      printf '127.0.0.1 %s\n' "$n" >>/etc/hosts
    fi
  done
}

# start_munge : the munge key and daemon (one for every cluster on this host).
start_munge() {
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
  if ! munge_ok >/dev/null 2>&1; then
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged --force
    wait_for "$WAIT_SECONDS" munged munge_ok
  fi
}
munge_ok() { munge -n | unmunge; }

# real_memory : the RealMemory slurmd detects on this host (MB).
real_memory() {
  local mem
  mem=$(/usr/sbin/slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -n1)
  [[ -n $mem ]] || die "could not read RealMemory from 'slurmd -C'"
  printf '%s\n' "$mem"
}

# slurm_conf_common : the slurm.conf lines both test clusters share (daemon behaviour, scheduling).
slurm_conf_common() {
  cat <<'EOF_COMMON'
SlurmUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=10
SlurmctldDebug=info
SlurmdDebug=info
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
EOF_COMMON
}

# start_slurm_daemons CONF RUN_DIR SPOOL_DIR LOG_DIR CHANGED NODE... : (re)starts slurmctld and one
# slurmd per virtual node from CONF (restarting them first when CHANGED is 1), then waits until
# every node is usable.
start_slurm_daemons() {
  local conf=$1 run_dir=$2 spool_dir=$3 log_dir=$4 changed=$5
  shift 5
  local nodes=("$@") n
  if ((changed)); then
    for n in "${nodes[@]}"; do stop_pidfile "$run_dir/slurmd-$n.pid" "slurmd $n" slurmd "-N $n "; done
    stop_pidfile "$run_dir/slurmctld.pid" slurmctld slurmctld "-f $conf "
  fi
  if ! pid_alive "$run_dir/slurmctld.pid" slurmctld "-f $conf "; then
    log "starting slurmctld"
    SLURM_CONF=$conf /usr/sbin/slurmctld -f "$conf"
  fi
  wait_for "$WAIT_SECONDS" "slurmctld (log: $log_dir/slurmctld.log)" ctld_ok "$conf"
  for n in "${nodes[@]}"; do
    install -d -m 0755 "$spool_dir/$n"
    if ! pid_alive "$run_dir/slurmd-$n.pid" slurmd "-N $n "; then
      log "starting slurmd $n"
      SLURM_CONF=$conf /usr/sbin/slurmd -f "$conf" -N "$n"
    fi
  done
  if ! nodes_ready "$conf" "${#nodes[@]}"; then
    # Nodes left DOWN/DRAIN by an earlier run come back here.
    sleep 1
    nodes_ready "$conf" "${#nodes[@]}" \
      || SLURM_CONF=$conf scontrol update NodeName="$(IFS=,; echo "${nodes[*]}")" State=RESUME \
        >/dev/null 2>&1 || true
  fi
  wait_for "$WAIT_SECONDS" "${#nodes[@]} idle Slurm nodes ($(SLURM_CONF=$conf sinfo -h -N -o '%N:%t' | tr '\n' ' '))" \
    nodes_ready "$conf" "${#nodes[@]}"
}
ctld_ok() { SLURM_CONF=$1 scontrol ping | grep 'is UP' >/dev/null; }
nodes_ready() {
  local states
  states=$(SLURM_CONF=$1 sinfo -h -N -p debug -o '%N %t' | sort -u)
  [[ $(grep -cE ' (idle|mix|alloc)$' <<<"$states") -eq $2 ]]
}

# start_scheduler_tick CONF RUN_DIR : a no-op partition update every 2 s. The backfill scheduler
# (the only one that starts heterogeneous jobs) skips a cycle when no job, node or partition changed
# since the last one: on an idle cluster a requeued job that becomes eligible again (after
# cred_expire) would wait for the next unrelated event; a busy cluster has them all the time.
start_scheduler_tick() {
  local conf=$1 tick_pidfile=$2/asynctorchx-tick.pid
  if ! pid_alive "$tick_pidfile" "$tick_pidfile"; then
    log "starting the scheduler tick"
    setsid nohup env SLURM_CONF="$conf" bash -c "echo \$\$ >'$tick_pidfile'; while sleep 2; do scontrol update PartitionName=debug State=UP >/dev/null 2>&1 || true; done" \
      </dev/null >/dev/null 2>&1 &
    wait_for 10 "the scheduler tick" pid_alive "$tick_pidfile" "$tick_pidfile"
  fi
}
