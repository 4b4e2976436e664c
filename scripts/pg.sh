#!/usr/bin/env bash
# A throw-away PostgreSQL cluster for the tests, on a unix socket in its own directory.
#
#   bash scripts/pg.sh install     install Debian's postgresql package if no server is found
#   bash scripts/pg.sh start DIR   initdb in DIR (new, empty or missing), start the server
#                                  listening only on a socket in DIR (no TCP), fsync on;
#                                  prints the URL to reach it (superuser, no password);
#                                  PG_SERVER_OPTS adds server settings ("-c name=value ...")
#   bash scripts/pg.sh stop DIR    stop that server (fast) and remove DIR
#
# Run as root (CI), the cluster belongs to the 'postgres' user the package creates
# (initdb refuses root); otherwise to the user running this.
set -euo pipefail

bindir() {
  local dir
  if command -v pg_config >/dev/null 2>&1; then
    dir=$(pg_config --bindir)
    if [ -x "$dir/initdb" ]; then
      echo "$dir"
      return 0
    fi
  fi
  # Debian's layout: /usr/lib/postgresql/<major>/bin (pg_config may be libpq-dev's)
  dir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -n "$dir" ] && [ -x "$dir/initdb" ]; then
    echo "$dir"
    return 0
  fi
  return 1
}

as_owner() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

cmd=${1:-}
case "$cmd" in
  install)
    if bindir >/dev/null; then
      exit 0
    fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
      echo "pg.sh: no PostgreSQL server binaries, and cannot install them (not root, or no apt-get)" >&2
      exit 1
    fi
    echo "== installing postgresql (Debian package)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq postgresql >/dev/null
    # the package starts a system cluster: the tests use their own, not that one
    ;;
  start)
    dir=${2:?usage: pg.sh start DIR}
    bin=$(bindir) || { echo "pg.sh: no PostgreSQL server binaries found" >&2; exit 1; }
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    if [ "$(id -u)" = 0 ]; then
      chown postgres: "$dir"
    fi
    chmod 700 "$dir"
    as_owner "$bin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-locale >"$dir/initdb.log" 2>&1 \
      || { cat "$dir/initdb.log" >&2; exit 1; }
    # A role that needs a password (the tests' wrong-password case); the superuser is
    # trusted on the socket, which only this directory's owner and root can reach.
    {
      echo "local all fleetwave_pw scram-sha-256"
      echo "local all all trust"
    } >"$dir/data/pg_hba.conf"
    as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
      -o "-c listen_addresses='' -c unix_socket_directories='$dir' -c fsync=on \
          -c max_connections=300 -c shared_buffers=32MB ${PG_SERVER_OPTS:-}" start >/dev/null \
      || { cat "$dir/server.log" >&2; exit 1; }
    # the directory is the socket's: it must be reachable by the tests' user (root or owner)
    chmod 755 "$dir"
    "$bin/psql" -h "$dir" -U postgres -d postgres -q -v ON_ERROR_STOP=1 \
      -c "CREATE ROLE fleetwave_pw LOGIN SUPERUSER PASSWORD 'fw-secret-pw'" >/dev/null
    echo "postgresql://postgres@/postgres?host=$dir"
    ;;
  stop)
    dir=${2:?usage: pg.sh stop DIR}
    if [ -d "$dir/data" ]; then
      bin=$(bindir) || true
      if [ -n "${bin:-}" ]; then
        as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null 2>&1 || true
      fi
    fi
    rm -rf "$dir"
    ;;
  *)
    echo "usage: pg.sh install | start DIR | stop DIR" >&2
    exit 2
    ;;
esac
