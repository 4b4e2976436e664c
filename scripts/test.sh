#!/usr/bin/env bash
# Install what the tests need (into .venv) and run lint, types and the test suite.
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
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests"
  exit 1
fi
exit "$rc"
