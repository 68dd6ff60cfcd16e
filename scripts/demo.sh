#!/usr/bin/env bash
# Install ingero-forensics into .venv and run the demo end to end on the embedded
# demo fleet: simulate 8 nodes with a CPU-contention straggler, merge, export, report.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3 python3-venv >/dev/null
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
.venv/bin/python -m pip install -q .
exec .venv/bin/python -m ingero_forensics.demo -o "${1:-demo-out}"
