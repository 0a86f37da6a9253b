#!/usr/bin/env bash
# Installs and starts a container registry for the workspace tests (kubernetes pushes its workspace
# images to one): Debian's docker-registry (distribution 2.8), listening on 127.0.0.1 only, with a
# data directory and a config of its own (the package's service and its /etc/docker/registry are
# left alone). The Docker engine pushes to and pulls from a 127.0.0.1 registry over plain HTTP.
# Nothing here uses systemd. Safe to run again: a registry that runs with this config is kept.
#
# Environment:
#   ASYNCTORCHX_REGISTRY       where it listens (default 127.0.0.1:5000; the tests read it too)
#   ASYNCTORCHX_REGISTRY_WAIT  seconds to wait for it to answer (default 30)
set -euo pipefail

SCRIPT_NAME=registry.sh
WAIT_SECONDS=${ASYNCTORCHX_REGISTRY_WAIT:-30}
# shellcheck source=lib/slurm_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/slurm_common.sh"

ADDR=${ASYNCTORCHX_REGISTRY:-127.0.0.1:5000}
DATA_DIR=/var/lib/asynctorchx-registry
CONF_DIR=/etc/asynctorchx-registry
CONF=$CONF_DIR/config.yml
PIDFILE=/run/asynctorchx-registry.pid
LOGFILE=/var/log/asynctorchx-registry.log

[[ $(id -u) == 0 ]] || die "must run as root (installs a package and starts a daemon)"
[[ $ADDR =~ ^(127\.0\.0\.1|localhost):[0-9]+$ ]] \
  || die "ASYNCTORCHX_REGISTRY must be 127.0.0.1:PORT (the registry listens on this host only), got '$ADDR'"

install_packages docker-registry curl
require_binaries docker-registry curl

install -d -m 0755 "$DATA_DIR" "$CONF_DIR"
conf_changed=0
write_if_changed "$CONF" 0644 <<EOF && conf_changed=1 || true
# Written by scripts/engines/registry.sh
version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $DATA_DIR
  delete:
    enabled: true
http:
  addr: $ADDR
EOF

answers() { curl -fsS --max-time 2 "http://$ADDR/v2/" >/dev/null 2>&1; }

if pid_alive "$PIDFILE" docker-registry "$CONF"; then
  if ((conf_changed)); then
    stop_pidfile "$PIDFILE" "the registry" docker-registry "$CONF"
  elif answers; then
    log "the registry answers on $ADDR (pid $(<"$PIDFILE"))"
    exit 0
  fi
else
  rm -f "$PIDFILE"
fi

if ! pid_alive "$PIDFILE" docker-registry "$CONF"; then
  if answers; then
    die "something else answers on $ADDR; stop it or set ASYNCTORCHX_REGISTRY to a free port"
  fi
  log "starting the registry on $ADDR (data: $DATA_DIR, log: $LOGFILE)"
  setsid nohup docker-registry serve "$CONF" >>"$LOGFILE" 2>&1 </dev/null &
  echo $! >"$PIDFILE"
fi
# While the registry starts, it is watched by pid alone. Between the fork and the exec of setsid, the
# child's command line is still this script's, so the command-line check of pid_alive can take a
# registry that is starting for one that is gone (it failed a CI run on a busy machine that way).
pid=$(<"$PIDFILE")
deadline=$((SECONDS + WAIT_SECONDS))
until answers; do
  if ! kill -0 "$pid" 2>/dev/null; then
    tail -n 20 "$LOGFILE" >&2 || true
    die "the registry (pid $pid) exited before it answered on $ADDR (see $LOGFILE)"
  fi
  if ((SECONDS >= deadline)); then
    tail -n 20 "$LOGFILE" >&2 || true
    die "the registry did not answer on $ADDR within ${WAIT_SECONDS}s (see $LOGFILE)"
  fi
  sleep 0.2
done
log "ready: http://$ADDR/v2/"
