#!/usr/bin/env bash
# Install what the tests need (into .venv; PostgreSQL from Debian's package when missing)
# and run lint, types and the test suite (the PostgreSQL tests on a throw-away server).
# Usage: bash scripts/test.sh [extra pytest args]      (CI: .ci/run calls this)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
.venv/bin/python -m pip install --quiet -e '.[test,docs]'
echo "== ruff"
.venv/bin/ruff check src tests bench scripts docs
.venv/bin/ruff format --check src tests bench scripts docs
echo "== mypy (strict)"
.venv/bin/mypy
echo "== manual (mkdocs build --strict)"
.venv/bin/python scripts/cli_reference.py --check
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
echo "== mutation check (deliberate breakages of the engine must be caught)"
.venv/bin/python scripts/mutation_check.py
echo "== pytest"
# A throw-away server for the PostgreSQL tests (unless FLEETWAVE_TEST_PG_URL names one):
# installed when missing, on a unix socket in a temporary directory, stopped at the end
# whatever happens. Without it those tests skip, or fail in CI (CI=true).
PG_DIR=""
stop_pg() {
  if [ -n "$PG_DIR" ]; then
    bash scripts/pg.sh stop "$PG_DIR"
  fi
}
trap stop_pg EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
if [ -z "${FLEETWAVE_TEST_PG_URL:-}" ]; then
  if bash scripts/pg.sh install; then
    PG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/fleetwave-pg.XXXXXX")
    FLEETWAVE_TEST_PG_URL=$(bash scripts/pg.sh start "$PG_DIR")
    export FLEETWAVE_TEST_PG_URL
    echo "throw-away server: $FLEETWAVE_TEST_PG_URL"
  else
    echo "no PostgreSQL server: its tests are skipped (and fail in CI)"
  fi
fi
# OpenSSH's sshd for the ssh driver's tests (each test starts its own, unprivileged on a
# loopback port): Debian's openssh-server, installed when missing, its system service
# never started (policy-rc.d refuses it while apt-get runs)
if [ ! -x /usr/sbin/sshd ] && ! command -v sshd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing openssh-server (Debian package; its service is not started)"
    policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      policy=/usr/sbin/policy-rc.d
      printf '#!/bin/sh\nexit 101\n' >"$policy"
      chmod 755 "$policy"
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq openssh-server >/dev/null
    if [ -n "$policy" ]; then
      rm -f "$policy"
    fi
  else
    echo "no sshd, and cannot install openssh-server: the ssh driver's tests are skipped (and fail in CI)"
  fi
fi
# Debian's chromium for the dashboard's browser test (Playwright drives it; no browser is
# downloaded: 'playwright install' is never run)
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing chromium (Debian package)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq chromium >/dev/null
  else
    echo "no /usr/bin/chromium, and cannot install it: the dashboard's browser test is skipped (and fails in CI)"
  fi
fi
# In 4 worker processes (pytest-xdist; FLEETWAVE_TEST_WORKERS=N changes the count, 0
# runs them in this one): each worker has its own tmp dirs, PostgreSQL databases (named
# by pid) and loopback ports. Most tests wait on processes, timers and sockets more than
# they compute, so 4 go faster than the 2 cores alone would suggest.
WORKERS=${FLEETWAVE_TEST_WORKERS:-4}
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 -n "$WORKERS" --dist worksteal "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests"
  exit 1
fi
exit "$rc"
