#!/usr/bin/env bash
# Ensure Postgres (127.0.0.1:5432, user postgres) and Redis (127.0.0.1:6379) are running locally.
# Installs them from Debian's packages only if they are missing altogether.
set -euo pipefail

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

apt_install() {
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}

pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }
if ! pg_up; then
  command -v pg_ctlcluster >/dev/null || apt_install postgresql
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  $SUDO pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  for _ in $(seq 1 30); do pg_up && break; sleep 1; done
  pg_up || { echo "Postgres did not come up on 127.0.0.1:5432" >&2; exit 1; }
fi

redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; }
if ! redis_up; then
  command -v redis-server >/dev/null || apt_install redis-server
  mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/spool.log
  for _ in $(seq 1 30); do redis_up && break; sleep 0.5; done
  redis_up || { echo "Redis did not come up on 127.0.0.1:6379" >&2; exit 1; }
fi
echo "postgres and redis are up"
