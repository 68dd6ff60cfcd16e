#!/bin/sh
# Start or stop ingero-capture for one job on this node (docs/airgap.md). Run as root:
# from a Slurm prolog and epilog, through srun, or before and after torchrun.
#
#   ingero-job-capture.sh start BUNDLE_ROOT     # returns once every source has started
#   ingero-job-capture.sh stop  BUNDLE_ROOT     # SIGTERM, waits for the seal; exits with
#                                               # the capture's own exit code
#
# Node name: $SLURMD_NODENAME, else $INGERO_NODE, else the short host name.
# Job: $SLURM_JOB_ID, else $TORCHELASTIC_RUN_ID, else $INGERO_JOB, else "adhoc".
# Bundles go to BUNDLE_ROOT/JOB/ (log: .capture.log there). The capture runs with
# --strict (start fails when an eBPF source is off) unless INGERO_STRICT=0. Extra
# options: $INGERO_CAPTURE_ARGS. start waits up to $INGERO_START_TIMEOUT seconds (default
# 120: BCC compiles every probe at idle priority, slow on a busy node); a capture not on
# by then is stopped (it seals what it has) and start fails.
# The capture command: $INGERO_CAPTURE (default: ../bin/ingero-capture beside this
# script; for the one-file capture: INGERO_CAPTURE="python3 /opt/ingero-capture.pyz").
# The capture runs in a session of its own (setsid): slurmd kills a prolog's process
# group when the prolog exits. A start's log is .capture.log (the one before it:
# .capture.log.1), so that a start never reads an earlier run's lines.
set -eu
umask 077   # the job's bundle directory and log: root's alone, as the capture's bundles
ACTION=${1:?usage: ingero-job-capture.sh start|stop BUNDLE_ROOT}
ROOT=${2:?usage: ingero-job-capture.sh start|stop BUNDLE_ROOT}
HERE=$(cd "$(dirname "$0")" && pwd)
CAPTURE=${INGERO_CAPTURE:-$HERE/../bin/ingero-capture}
NODE=${SLURMD_NODENAME:-${INGERO_NODE:-$(hostname -s)}}
JOB=${SLURM_JOB_ID:-${TORCHELASTIC_RUN_ID:-${INGERO_JOB:-adhoc}}}
DIR=$ROOT/$JOB
PIDFILE=$DIR/.capture.pid
RCFILE=$DIR/.capture.rc
LOG=$DIR/.capture.log
STRICT=--strict
[ "${INGERO_STRICT:-1}" = 0 ] && STRICT=
TIMEOUT=${INGERO_START_TIMEOUT:-120}
case "$TIMEOUT" in
  ''|*[!0-9]*) echo "Error: INGERO_START_TIMEOUT=$TIMEOUT: give whole seconds" >&2; exit 2 ;;
esac

# whether pid $1 is this job's capture: a pid saved earlier may be another process's
# by now (never signal that one); a capture names its directory in its arguments
is_ours() {
  [ -n "$1" ] && [ -r "/proc/$1/cmdline" ] && tr '\0' '\n' < "/proc/$1/cmdline" | grep -qxF -- "$DIR"
}

case "$ACTION" in
start)
  # start knows the capture is on by its "sources on:" line, which --quiet hides
  set -f      # the arguments as words, not globs
  for a in ${INGERO_CAPTURE_ARGS:-}; do
    case "$a" in
      --quiet) ;;
      --*) continue ;;
      -*q*) ;;        # -q, or -q among grouped short options (-qp 123)
      *) continue ;;
    esac
    echo "Error: INGERO_CAPTURE_ARGS: $a hides the line start waits for; leave it out" >&2
    exit 2
  done
  set +f
  mkdir -p "$DIR"
  OLD=$(cat "$PIDFILE" 2>/dev/null || true)
  if [ ! -f "$RCFILE" ] && is_ours "$OLD"; then
    echo "Error: $DIR: a capture (pid $OLD) is still running for job $JOB" >&2
    exit 1
  fi
  rm -f "$PIDFILE" "$RCFILE"
  [ -f "$LOG" ] && mv -f "$LOG" "$LOG.1"
  DETACH=
  command -v setsid > /dev/null 2>&1 && DETACH=setsid
  # shellcheck disable=SC2086  # INGERO_CAPTURE and INGERO_CAPTURE_ARGS are word lists
  $DETACH nohup sh -c 'cmd=$1; shift; $cmd "$@" & echo $! > "'"$PIDFILE"'"; wait $!; echo $? > "'"$RCFILE"'.tmp"; mv -f "'"$RCFILE"'.tmp" "'"$RCFILE"'"' \
    sh "$CAPTURE" --bundle "$DIR" --node "$NODE" $STRICT ${INGERO_CAPTURE_ARGS:-} \
    >> "$LOG" 2>&1 < /dev/null &
  i=0
  while [ $i -lt $((TIMEOUT * 10)) ]; do
    if [ -f "$RCFILE" ]; then
      echo "Error: $DIR: capture exited with $(cat "$RCFILE"): $(tail -n 1 "$LOG")" >&2
      exit 1
    fi
    if grep -q "sources on:" "$LOG" 2>/dev/null; then
      echo "capturing as $NODE into $DIR (pid $(cat "$PIDFILE"))"
      exit 0
    fi
    sleep 0.1; i=$((i + 1))
  done
  # not left running behind a failed start: stopped, it seals what it has (waited for,
  # so that a later stop finds it ended and signals no pid the system gave to another)
  PID=$(cat "$PIDFILE" 2>/dev/null || true)
  is_ours "$PID" && kill -TERM "$PID" 2>/dev/null || true
  i=0
  while [ ! -f "$RCFILE" ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i + 1)); done
  echo "Error: $DIR: capture did not start within $TIMEOUT s; stopped it (see $LOG)" >&2
  exit 1
  ;;
stop)
  [ -f "$PIDFILE" ] || { echo "Error: $PIDFILE: no capture started for job $JOB" >&2; exit 1; }
  PID=$(cat "$PIDFILE" 2>/dev/null || true)
  # an ended capture's pid may be another process's by now: signal only our own
  if [ ! -f "$RCFILE" ] && is_ours "$PID"; then kill -TERM "$PID" 2>/dev/null || true; fi
  i=0
  while [ ! -f "$RCFILE" ] && [ $i -lt 1200 ]; do
    if ! is_ours "$PID"; then
      sleep 0.5     # its exit code is written just after it ends
      [ -f "$RCFILE" ] && break
      # the shell that waited for it is gone: the code is unknown, the spool says more
      n=$(find "$DIR" -maxdepth 1 -name "$NODE+*.bundle" | wc -l)
      if ls "$DIR/.spool/"segment-*.db > /dev/null 2>&1; then
        echo "Error: $DIR: the capture (pid $PID) ended without an exit code (killed?);" \
             "its open segment stays in $DIR/.spool and is sealed by the next start there;" \
             "$n bundle(s) in $DIR" >&2
        exit 1
      fi
      echo "capture of $NODE stopped (exit code unknown: the shell that waited for it" \
           "was killed; nothing left unsealed); $n bundle(s) in $DIR"
      exit 0
    fi
    sleep 0.1; i=$((i + 1))
  done
  [ -f "$RCFILE" ] || { echo "Error: $DIR: capture did not stop within 120 s" >&2; exit 1; }
  rc=$(cat "$RCFILE")
  n=$(find "$DIR" -maxdepth 1 -name "$NODE+*.bundle" | wc -l)
  echo "capture of $NODE stopped (exit $rc); $n bundle(s) in $DIR"
  exit "$rc"
  ;;
*)
  echo "usage: ingero-job-capture.sh start|stop BUNDLE_ROOT" >&2; exit 2 ;;
esac
