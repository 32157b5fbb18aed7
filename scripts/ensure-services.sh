#!/usr/bin/env bash
# Makes sure PostgreSQL and RabbitMQ are reachable, on any fresh Debian machine.
#
# Order of preference, for each of the two:
#   1. CONVEYOR_DATABASE_URL / CONVEYOR_AMQP_URL when set: trusted as given;
#   2. a server already listening on its usual loopback port: reused;
#   3. installed from Debian's packages (when root) and started.
# It never touches a server it did not have to start.
set -euo pipefail

log() { printf '[ensure-services] %s\n' "$*" >&2; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() {
  local port=$1 what=$2 tries=${3:-120}
  for _ in $(seq "$tries"); do
    port_open "$port" && return 0
    sleep 1
  done
  log "$what did not open port $port in ${tries}s"; return 1
}

apt_install() {
  if [ "$(id -u)" != 0 ]; then
    log "$* missing and not root: install it, or set CONVEYOR_DATABASE_URL / CONVEYOR_AMQP_URL"
    exit 1
  fi
  if [ -z "${_APT_UPDATED:-}" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    _APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2
}

ensure_postgres() {
  if [ -n "${CONVEYOR_DATABASE_URL:-}" ]; then log "PostgreSQL: using CONVEYOR_DATABASE_URL"; return; fi
  if port_open 5432; then log "PostgreSQL: reusing 127.0.0.1:5432"; return; fi
  if ! command -v pg_ctlcluster >/dev/null 2>&1 || [ -z "$(ls /etc/postgresql 2>/dev/null)" ]; then
    log "PostgreSQL: installing"
    apt_install postgresql
  fi
  local version
  version=$(ls /etc/postgresql | sort -V | tail -n1)
  # Trust on loopback, as on the development machines: tests create databases freely.
  local hba="/etc/postgresql/$version/main/pg_hba.conf"
  if [ -w "$hba" ] && ! grep -q '^host all all 127.0.0.1/32 trust' "$hba"; then
    sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
  fi
  if pg_lsclusters --no-header 2>/dev/null | awk -v v="$version" '$1 == v && $2 == "main"' \
     | grep -q online; then
    # Running but not on 127.0.0.1:5432 yet (e.g. listening on the socket only): reload the
    # trust line and say so rather than failing on "already running".
    log "PostgreSQL: cluster $version/main already running; reloading its configuration"
    pg_ctlcluster --skip-systemctl-redirect "$version" main reload 2>/dev/null \
      || pg_ctlcluster "$version" main reload || true
  else
    log "PostgreSQL: starting cluster $version/main"
    pg_ctlcluster --skip-systemctl-redirect "$version" main start 2>/dev/null \
      || pg_ctlcluster "$version" main start
  fi
  wait_port 5432 PostgreSQL 60
}

ensure_rabbitmq() {
  if [ -n "${CONVEYOR_AMQP_URL:-}" ]; then log "RabbitMQ: using CONVEYOR_AMQP_URL"; return; fi
  if port_open 5672; then log "RabbitMQ: reusing 127.0.0.1:5672"; return; fi
  if ! command -v rabbitmq-server >/dev/null 2>&1; then
    log "RabbitMQ: installing"
    apt_install rabbitmq-server
  fi
  log "RabbitMQ: starting"
  rabbitmq-server -detached >&2 2>/dev/null || true
  wait_port 5672 RabbitMQ 120
}

# `ensure-services.sh apt PACKAGE…`: the Makefile's one way to install a Debian package.
if [ "${1:-}" = apt ]; then shift; apt_install "$@"; exit 0; fi

ensure_postgres
ensure_rabbitmq
