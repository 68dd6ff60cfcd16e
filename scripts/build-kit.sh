#!/usr/bin/env bash
# Build the offline kit (docs/airgap.md) on a connected machine, from this clone:
#   bash scripts/build-kit.sh -o dist/ [--python 3.11] [--platform manylinux_2_28_x86_64]
# Uses the project's .venv (created with `pip install -e .` when missing); the arguments
# go to ingero-kit (ingero_forensics/kit.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/ingero-kit ]; then
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q -e .
fi
# --source: this clone, also when .venv holds a plain install (scripts/demo.sh makes one)
exec .venv/bin/ingero-kit --source "$PWD" "$@"
