#!/usr/bin/env bash
# Install everything the test suite needs on Debian 12 and run it.
# Runs as root (CI does) or through sudo. The eBPF tests need root: as root they run,
# and under CI (CI=true) a skipped eBPF test fails the run instead of passing quietly.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"

apt_pkgs=(python3 python3-venv python3-pip python3-dev gcc make libc6-dev
          bpfcc-tools python3-bpfcc linux-headers-amd64
          zstd sqlite3 strace iproute2 util-linux procps chromium rsync)
missing=()
for p in "${apt_pkgs[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "== apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# Matching headers when the distribution has them; otherwise setup-ebpf.sh links the
# generic ones (enough for tracepoint and uprobe programs).
$SUDO apt-get install -y -qq "linux-headers-$(uname -r)" >/dev/null 2>&1 || true

# A real Trace Event Format consumer for the export tests: Chrome DevTools' trace engine.
if ! command -v npm >/dev/null; then
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nodejs npm >/dev/null
fi
if [ ! -f .cache/trace-engine/node_modules/@paulirish/trace_engine/package.json ]; then
  npm install --silent --no-audit --no-fund --prefix .cache/trace-engine @paulirish/trace_engine@0.0.65 >/dev/null
fi
export INGERO_TRACE_ENGINE="$PWD/.cache/trace-engine/node_modules/@paulirish/trace_engine"

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test]' nvidia-nccl-cu12 nvidia-cuda-runtime-cu12

$SUDO bash scripts/setup-ebpf.sh

export PATH="$PWD/.venv/bin:$PATH"   # console scripts the tests run as subprocesses
export INGERO_REQUIRE_EBPF=${INGERO_REQUIRE_EBPF:-${CI:+1}}
exec .venv/bin/python -m pytest -ra "$@"
