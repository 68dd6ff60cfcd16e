#!/usr/bin/env bash
# Rehearse docs/airgap.md end to end on this one machine (tests/test_airgap.py runs it and
# checks that every command of the runbook is a line of this script or of a test).
#   bash scripts/airgap-rehearsal.sh WORKDIR
# The "connected machine", the USB disk, the nodes and the workstation are directories
# of WORKDIR; the install and the capture run in a network namespace with no interfaces
# when this runs as root (unshare -n). With eBPF here (root, BCC, headers) the node
# capture is strict; without, it runs with --no-ebpf.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mkdir -p "$1" && cd "$1" && pwd)
NONET=()
if [ "$(id -u)" = 0 ] && unshare -n true 2>/dev/null; then NONET=(unshare -n); fi
step() { printf '== %s\n' "$*"; }
export INGERO_PYZ_CACHE=$WORK/pyz-cache   # not /var/cache/ingero-capture of this machine
STRICT_OK_PYZ=1
"$REPO/.venv/bin/ingero-capture" --check --strict >/dev/null 2>&1 || STRICT_OK_PYZ=0

# --- on the connected machine: build the kit onto the carrier ---------------------
DIST=$WORK/usb
cd "$REPO"
step "build the kit"
bash scripts/build-kit.sh -o "$DIST"
# written down apart from the carrier: the archive's name and sha256
read -r WRITTEN ARCHIVE < "$(ls "$DIST"/ingero-kit-*.tar.gz.sha256)"
KIT=${ARCHIVE%.tar.gz}

# --- on the site: verify, install on a node --------------------------------------
PREFIX=$WORK/node/opt/ingero-forensics
mkdir -p "$WORK/node"
cd "$DIST"
step "verify what was carried"
sha256sum "$KIT.tar.gz"     # must print the value written down
[ "$(sha256sum "$KIT.tar.gz" | cut -d' ' -f1)" = "$WRITTEN" ]
tar xzf "$KIT.tar.gz"
cd "$KIT"
sha256sum -c --quiet SHA256SUMS
step "the one-file capture"
python3 ingero-capture.pyz --check --strict || [ "$STRICT_OK_PYZ" = 0 ]
step "install with no network"
env -u PIP_FIND_LINKS -u PIP_INDEX_URL PIP_CONFIG_FILE=/dev/null "${NONET[@]}" \
  sh install.sh "$PREFIX"
export PATH="$PREFIX/bin:$PATH"
step "check the node"
STRICT_OK=1
"$PREFIX/bin/ingero-capture" --check --strict || STRICT_OK=0
if [ "$STRICT_OK" = 0 ] && [ "${INGERO_REQUIRE_EBPF:-}" = 1 ]; then
  echo "eBPF is required here but --check --strict failed" >&2; exit 1
fi
step "prove the capture opens no network socket"
strace -f -qq -e trace=socket,socketpair -o /tmp/ingero-sockets.log "$PREFIX/bin/ingero-capture" --bundle /tmp/ingero-strace --duration 5
! grep -E 'socket(pair)?\(AF_' /tmp/ingero-sockets.log | grep -vE '\(AF_(UNIX|LOCAL),' || { echo "a network socket was opened" >&2; exit 1; }
rm -rf /tmp/ingero-strace
step "the systemd unit"
sed "s|/opt/ingero-forensics|$PREFIX|" "$PREFIX/share/ingero-capture.service" > "$WORK/ingero-capture.service"
if command -v systemd-analyze >/dev/null; then systemd-analyze verify "$WORK/ingero-capture.service"; fi

# --- a job on the node: capture around it (Slurm prolog/epilog, srun or torchrun) ----
step "capture one job"
BUNDLE_ROOT=$WORK/node/var/ingero
export SLURM_JOB_ID=4242 SLURMD_NODENAME=gpu-node-01
[ "$STRICT_OK" = 1 ] || export INGERO_STRICT=0 INGERO_CAPTURE_ARGS=--no-ebpf
"$PREFIX/share/ingero-job-capture.sh" start "$BUNDLE_ROOT"
RANK=0 WORLD_SIZE=1 python3 -c 'import time; time.sleep(3)' --api-key=sk-rehearsal0123456789abcdef
"$PREFIX/share/ingero-job-capture.sh" stop "$BUNDLE_ROOT"
unset SLURM_JOB_ID SLURMD_NODENAME INGERO_STRICT INGERO_CAPTURE_ARGS

# --- on the workstation: collect, verify, merge, export, report ------------------
step "collect"
mkdir -p "$WORK/workstation"
cd "$WORK/workstation"
JOB=4242
SRC=$BUNDLE_ROOT/$JOB
mkdir -p "bundles/$JOB"
rsync -a --include='*.bundle' --exclude='*' "$SRC/" "bundles/$JOB/"
scp -p "$SRC"/*.bundle "bundles/$JOB/"
step "verify, merge, export, report"
ingero-merge --verify "bundles/$JOB"
ingero-merge "bundles/$JOB" -o fleet.db
ingero-export fleet.db --chrome-trace -o trace.json.gz
ingero-export fleet.db --chrome-trace -o trace.json
ingero-report fleet.db -o report.html
ingero-query fleet.db "SELECT name, hostname, ranks FROM nodes"
# the secret on the job's command line was masked at capture time
ingero-query fleet.db "SELECT cmdline FROM processes WHERE cmdline LIKE '%api-key%'" --format csv | grep -qF -- '--api-key=***'
! grep -qF sk-rehearsal fleet.db || { echo "a secret reached fleet.db" >&2; exit 1; }
step "what leaves the site"
ingero-redact fleet.db -o fleet-redacted.db
ingero-report fleet-redacted.db -o report-redacted.html
ingero-export fleet-redacted.db --chrome-trace -o trace-redacted.json.gz
sha256sum fleet-redacted.db report-redacted.html trace-redacted.json.gz > SHA256SUMS
! zgrep -l -e gpu-node-01 -e sk-rehearsal trace-redacted.json.gz report-redacted.html fleet-redacted.db || { echo "redaction left a name" >&2; exit 1; }
step "view the trace offline"
mkdir -p perfetto-ui
cp trace.json.gz perfetto-ui/
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 -m http.server "$PORT" --bind 127.0.0.1 --directory perfetto-ui &
SERVER=$!
PORT=$PORT python3 - <<'PY'
import os, time, urllib.request
for _ in range(100):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{os.environ['PORT']}/trace.json.gz") as r:
            assert r.status == 200 and len(r.read()) > 0
            break
    except OSError:
        time.sleep(0.1)
else:
    raise SystemExit("the local server did not answer")
PY
kill "$SERVER"
step "rehearsal complete"
