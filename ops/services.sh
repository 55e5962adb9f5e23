#!/usr/bin/env bash
# Ensure Postgres (127.0.0.1:$SPOOL_PG_PORT, default 5432) and Redis (127.0.0.1:6379) run locally and
# that Spool can log into Postgres. Installs them from Debian's packages only if they are missing.
#
# A fresh Debian/Ubuntu cluster refuses password-less TCP logins (scram-sha-256). When Spool's
# database URL cannot log in, this creates a `spool` role with a generated password (through the
# local socket, as the postgres user) and writes SPOOL_DATABASE_URL to .env, which Spool reads.
# Safe to run again: it only does what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
PG_PORT=${SPOOL_PG_PORT:-5432}
ENV_FILE=${SPOOL_ENV_FILE:-.env}

apt_install() {
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}
as_postgres() {
  if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else sudo -u postgres "$@"; fi
}

pg_up() { pg_isready -q -h 127.0.0.1 -p "$PG_PORT" 2>/dev/null; }
if ! pg_up; then
  command -v pg_ctlcluster >/dev/null || apt_install postgresql
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  $SUDO pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  for _ in $(seq 1 30); do pg_up && break; sleep 1; done
  pg_up || { echo "Postgres did not come up on 127.0.0.1:$PG_PORT" >&2; exit 1; }
fi

# The URL Spool will use: the environment's, else .env's, else the default.
url=${SPOOL_DATABASE_URL:-}
if [ -z "$url" ] && [ -f "$ENV_FILE" ]; then
  url=$(sed -n 's/^SPOOL_DATABASE_URL=//p' "$ENV_FILE" | tail -n 1)
fi
url=${url:-postgresql+psycopg://postgres@127.0.0.1:$PG_PORT/spool}
libpq_url=${url/postgresql+psycopg:/postgresql:}
admin_url=${libpq_url%/*}/postgres  # the server's own database: Spool's may not exist yet
if ! PGCONNECT_TIMEOUT=5 psql "$admin_url" -w -qAtc 'SELECT 1' >/dev/null 2>&1; then
  if [ -n "${SPOOL_DATABASE_URL:-}" ]; then
    echo "SPOOL_DATABASE_URL is set but cannot log in to Postgres; fix it or unset it" >&2
    exit 1
  fi
  password=$(head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | head -c 24)
  as_postgres psql -p "$PG_PORT" -qAtc "SELECT 1 FROM pg_roles WHERE rolname = 'spool'" | grep -q 1 \
    && as_postgres psql -p "$PG_PORT" -qc "ALTER ROLE spool WITH LOGIN CREATEDB PASSWORD '$password'" \
    || as_postgres psql -p "$PG_PORT" -qc "CREATE ROLE spool WITH LOGIN CREATEDB PASSWORD '$password'"
  url="postgresql+psycopg://spool:$password@127.0.0.1:$PG_PORT/spool"
  touch "$ENV_FILE" && chmod 600 "$ENV_FILE"
  # The file holds a password: created private (umask) rather than chmod-ed after it was readable.
  (umask 077 && { grep -v '^SPOOL_DATABASE_URL=' "$ENV_FILE" > "$ENV_FILE.tmp" || true; })
  echo "SPOOL_DATABASE_URL=$url" >> "$ENV_FILE.tmp" && mv "$ENV_FILE.tmp" "$ENV_FILE" && chmod 600 "$ENV_FILE"
  PGCONNECT_TIMEOUT=5 psql "${url/postgresql+psycopg:/postgresql:}" -w -qAtc 'SELECT 1' >/dev/null 2>&1 \
    || psql "postgresql://spool:$password@127.0.0.1:$PG_PORT/postgres" -w -qAtc 'SELECT 1' >/dev/null
  echo "created Postgres role 'spool' (password in $ENV_FILE)"
fi

redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; }
if ! redis_up; then
  command -v redis-server >/dev/null || apt_install redis-server
  mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
  # A memory bound with `noeviction`, as docker-compose.yml: queues and streams are never evicted; past
  # the bound writes are refused (OOM), which Spool waits out (a 503 + Retry-After, workers retry).
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --maxmemory "${REDIS_MAXMEMORY:-1gb}" --maxmemory-policy noeviction \
    --dir /var/lib/redis --logfile /var/log/redis/spool.log
  for _ in $(seq 1 30); do redis_up && break; sleep 0.5; done
  redis_up || { echo "Redis did not come up on 127.0.0.1:6379" >&2; exit 1; }
fi
echo "postgres and redis are up"
