#!/usr/bin/env bash
# Build or preview the manual (docs/, mkdocs.yml) with MkDocs and the Material theme.
# Usage: bash scripts/docs.sh build          the site into ./site (git-ignored), strict
#        bash scripts/docs.sh serve [PORT]   a live preview on http://127.0.0.1:PORT (8000)
# Needs the docs extra: .venv/bin/pip install -e '.[docs]'
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/mkdocs ]; then
  echo "error: .venv/bin/mkdocs not found: run .venv/bin/pip install -e '.[docs]' first" >&2
  exit 2
fi
case "${1:-}" in
  build | serve)
    # the CLI reference is written from the command tree itself, never by hand
    .venv/bin/python scripts/cli_reference.py
    ;;
  *)
    echo "usage: bash scripts/docs.sh build|serve [PORT]" >&2
    exit 2
    ;;
esac
case "$1" in
  build)
    NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
    echo "manual built in site/ (open site/index.html)"
    ;;
  serve)
    NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs serve --dev-addr "127.0.0.1:${2:-8000}"
    ;;
esac
