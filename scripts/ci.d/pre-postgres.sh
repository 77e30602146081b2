# Sourced by scripts/test.sh before pytest: a throw-away PostgreSQL server for the tuner's
# shared-study tests. Installs Debian's postgresql if missing, runs a private cluster on
# 127.0.0.1 (data under ${ATTNBENCH_PG_DIR:-/tmp/attnbench-pg}), creates database "attnbench",
# installs the Python driver (psycopg 3) into .venv, and exports ATTNBENCH_TEST_PG_URL and
# ATTNBENCH_REQUIRE_PG=1. Idempotent: a running server is reused and left running; a server this
# step starts is stopped when test.sh exits (attnbench_on_exit, scripts/ci.d/on-exit.sh).
# shellcheck shell=bash
_attnbench_pg() {
  local dir=${ATTNBENCH_PG_DIR:-/tmp/attnbench-pg} port=${ATTNBENCH_PG_PORT:-54329} bin
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then echo "pre-postgres: postgresql missing and not root" >&2; return 1; fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq postgresql >/dev/null || return 1
  fi
  bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
  # initdb/postgres refuse to run as root: run them as the postgres user (or as ourselves).
  local as=()
  if [ "$(id -u)" -eq 0 ]; then as=(runuser -u postgres --); fi
  mkdir -p "$dir"
  if [ "$(id -u)" -eq 0 ]; then chown postgres "$dir"; fi
  if [ ! -f "$dir/data/PG_VERSION" ]; then
    "${as[@]}" "$bin/initdb" -D "$dir/data" -A trust -U postgres >/dev/null || return 1
  fi
  if ! "${as[@]}" "$bin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
    "${as[@]}" "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
      -o "-c listen_addresses=127.0.0.1 -p $port -k $dir" start >/dev/null || {
      cat "$dir/server.log" >&2; return 1; }
    if declare -F attnbench_on_exit >/dev/null; then
      attnbench_on_exit "${as[@]}" "$bin/pg_ctl" -D "$dir/data" stop -m fast -s
    fi
  fi
  if ! "$bin/psql" -h 127.0.0.1 -p "$port" -U postgres -tAc \
       "SELECT 1 FROM pg_database WHERE datname='attnbench'" | grep -q 1; then
    "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres attnbench || return 1
  fi
  local py=.venv/bin/python
  [ -x "$py" ] || py=python
  if ! "$py" -c "import psycopg" >/dev/null 2>&1; then
    "$py" -m pip install -q "psycopg[binary]" >/dev/null || return 1
  fi
  export ATTNBENCH_TEST_PG_URL="postgresql+psycopg://postgres@127.0.0.1:$port/attnbench"
  export ATTNBENCH_REQUIRE_PG=1
}
_attnbench_pg || { echo "pre-postgres: could not start PostgreSQL" >&2; exit 1; }
unset -f _attnbench_pg
