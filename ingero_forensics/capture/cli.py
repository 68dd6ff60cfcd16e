"""ingero-capture: the click layer over capture.runner.run_capture / check_sources."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import click

from ..cliutil import (EXIT_ERROR, FiniteFloatRange, echo_json, handle_errors, is_tty,
                       parse_size, version_option)
from .runner import CaptureConfig, check_sources, run_capture, strict_failures
from .source import CaptureOptions
from .status import Reporter


def _size(ctx, param, value):
    return None if value is None else parse_size(value)


def _libs(ctx, param, values):
    """--lib paths: files whose name says which library they are (the probes are chosen
    by it); a path the capture would skip is a usage error, not silence."""
    from .ebpf.libs import KINDS, lib_kind, not_the_library
    for path in values:
        if not os.path.isfile(path):
            raise click.BadParameter(f"{path}: no such file")
        if lib_kind(path) is None:
            raise click.BadParameter(
                f"{path}: the file name does not say which library it is (it must start "
                f"with {', '.join(KINDS.values())}): the probes are chosen by it; give a "
                "symbolic link with such a name instead")
        why = not_the_library(path)
        if why:
            raise click.BadParameter(f"{path}: {why}")
    return values


def _path(ctx, param, value):
    """A path given as "" (the "$DIR" of an unset variable in a unit file) is a usage
    error, not the current directory (which pathlib would make of it)."""
    if value is None:
        return None
    if value == "":
        raise click.BadParameter("an empty path (an unset variable?)")
    return Path(value)


#: --strict and an eBPF source off at start: not an error that a restart may cure (the
#: systemd unit's RestartPreventExitStatus), unlike 1 (a full disk, a busy directory).
EXIT_SOURCE_OFF = 4


def _comm_names(ctx, param, values):
    # the kernel keeps 15 bytes of a process name (/proc/PID/comm): a longer one would
    # match nothing, and the capture would trace nothing without saying why (a review)
    for v in values:
        if len(v.encode()) > 15:
            short = v.encode()[:15].decode(errors="ignore")
            raise click.BadParameter(f"{v!r} is longer than the 15 bytes the kernel keeps "
                                     f"of a process name: it would match nothing (the "
                                     f"process is named {short!r} there)")
    return values


@click.command(name="ingero-capture", context_settings={"help_option_names": ["-h", "--help"]},
               epilog="Exit codes: 0 success (including stop by SIGTERM/SIGINT); 1 error "
                      "(bad configuration, directory in use, file system full: sealed "
                      "segments are kept; --check --strict: a source would be off); 2 "
                      "usage error; 4 --strict capture stopped at start because an eBPF "
                      "source was off (a node that cannot run it: a service should not be "
                      "restarted on it).")
@click.option("--bundle", "bundle_dir", type=click.Path(file_okay=False), callback=_path,
              default="/var/ingero", show_default=True,
              help="Directory for sealed segments (and its .spool/ for the live one).")
@click.option("--node", help="Node name (1-63 of A-Z a-z 0-9 . _ -, not starting with - or .). Default: the config "
              "file's node, else $INGERO_NODE, else the hostname.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), callback=_path,
              help="TOML config file with a top-level node = \"...\" "
                   "[default: /etc/ingero-forensics/config.toml if present].")
@click.option("-p", "--pid", "pids", type=int, multiple=True,
              help="Trace this process and its children, e.g. data-loader workers "
                   "(repeatable).")
@click.option("--comm", "comms", multiple=True, callback=_comm_names,
              help="Trace processes with this name, and their children (repeatable). "
                   "Without --pid/--comm: "
                   "processes that map libnccl/libcudart or have RANK in their environment.")
@click.option("--duration", type=FiniteFloatRange(min=0, min_open=True),
              help="Stop this many seconds after every source is on (the eBPF "
                   "compile at start does not count).")
@click.option("--segment-seconds", type=FiniteFloatRange(min=0, min_open=True), default=300,
              show_default=True, help="Rotate to a new segment after this long.")
@click.option("--segment-size", default="256M", show_default=True, callback=_size,
              help="Rotate when the live segment reaches this size.")
@click.option("--max-disk", callback=_size,
              help="Keep only the newest sealed segments within this size (flight recorder).")
@click.option("--clock-interval", type=FiniteFloatRange(min=0.01), default=1.0,
              show_default=True, help="Seconds between clock-sync samples.")
@click.option("--host-interval", type=FiniteFloatRange(min=0.01), default=0.1,
              show_default=True, help="Seconds between host samples (0.1 = 10 Hz).")
@click.option("--no-ebpf", is_flag=True, help="Turn the eBPF sources off on purpose.")
@click.option("--lib", "lib_paths", multiple=True, callback=_libs,
              help="Path of libnccl/libcudart/libcuda to probe (eBPF sources; repeatable). "
                   "Its file name says which it is: libnccl.so*, libcudart.so* or "
                   "libcuda.so* (a symbolic link so named will do).")
@click.option("--tcp-probe", is_flag=True,
              help="Also sample tcp:tcp_probe: smoothed RTT (srtt_us) and congestion window "
                   "(snd_cwnd) of every TCP connection on the node, as tcp_events rows with "
                   "event 'tcp_probe', at most one per connection per --tcp-probe-interval "
                   "(sampled in the kernel). Off by default.")
@click.option("--tcp-probe-interval", type=click.IntRange(min=1), default=100,
              show_default=True, metavar="MS",
              help="Milliseconds between two tcp_probe rows of one connection "
                   "(needs --tcp-probe).")
@click.option("--no-tcp-progress", is_flag=True,
              help="Do not record the traced processes' TCP byte progress (table "
                   "tcp_progress: sampled send and receive calls with their position in "
                   "the connection's stream, the kernel's arrivals, and, from incoming "
                   "ACKs, the bytes a sender still held). The merge pairs one node's "
                   "sends with another's receives of the same bytes to bound the nodes' "
                   "clocks far tighter than collectives can. It costs every TCP send and "
                   "receive call of every process on the node, and every segment it "
                   "takes in, a few map operations in the kernel (0.6-1.2 us per call "
                   "on a 2-core VM: docs/performance.md).")
@click.option("--tcp-progress-interval", type=click.IntRange(min=1), default=1000,
              show_default=True, metavar="MS",
              help="Milliseconds between two time-based tcp_progress rows of one "
                   "connection and kind (send, receive, arrival, unsent; a call that "
                   "starts a burst is preferred). Rows at fixed stream positions, the "
                   "same bytes on both ends, come on top: 32 per doubling of the bytes "
                   "moved.")
@click.option("--launch-budget", type=click.IntRange(min=0), default=5000, show_default=True,
              metavar="CALLS_PER_S",
              help="Kernel launches the capture counts per second before it samples them. "
                   "Each launch costs the job one uprobe trap (0.65 us on a plain VM, 5-6 us "
                   "measured on a GPU VM: docs/capture.md); above this "
                   "rate (all traced processes together) the launch probes are on for only "
                   "a share of the 1 s stats intervals (budget / rate, at least 2 %), and "
                   "event_stats.observed_ns marks the others. 0: count every launch.")
@click.option("--level", "compression_level", type=click.IntRange(1, 19), default=3,
              show_default=True, help="zstd level used when sealing.")
@click.option("--check", is_flag=True,
              help="Print which sources would work here and why not, then exit.")
@click.option("--cmdline", "cmdline", type=click.Choice(["full", "masked", "none"]),
              default="masked", show_default=True,
              help="How traced processes' command lines are written: masked (values of "
                   "secret-looking options such as --api-key, --password, --token and of "
                   "NAME=value words with such names, URL passwords and well-known token "
                   "shapes become ***), full (verbatim), none (not written).")
@click.option("--strict", is_flag=True,
              help="Fail when any eBPF source is off: with --check, after printing "
                   "(exit 1); on a capture, at start (exit 4; what was recorded is sealed). For "
                   "fleet roll-outs that must not go on with clock and host samples only.")
@click.option("--start-priority", type=click.Choice(["idle", "normal"]), default="idle",
              show_default=True,
              help="CPU priority of the probe compile at start (about a CPU-second per "
                   "source): idle (SCHED_IDLE and nice 19; a running job barely notices, "
                   "but on a node whose CPUs are all busy the sources come on late: after "
                   "30 s it goes on at nice 19) or normal (the capture's own priority: on "
                   "in seconds, the job pays those CPU-seconds).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the run summary (or --check result) as JSON on stdout.")
@click.option("-q", "--quiet", is_flag=True, help="Only errors on stderr.")
@version_option("ingero-capture")
@handle_errors
def main(bundle_dir, node, config_file, pids, comms, duration, segment_seconds, segment_size,
         max_disk, clock_interval, host_interval, no_ebpf, lib_paths, tcp_probe,
         tcp_probe_interval, no_tcp_progress, tcp_progress_interval, launch_budget, compression_level, cmdline, check, strict,
         start_priority, as_json, quiet):
    """Record this node's training processes into sealed bundles, with no network.

    Runs as root on every GPU node. Writes <node>+<UTC start>Z+<index>.bundle files
    into --bundle; each is sealed atomically. SIGTERM or SIGINT seals the open segment
    and exits 0; SIGHUP starts a new segment. After a crash the next start seals the
    segment the crash left. Sources that cannot run (no root, BCC, kernel headers or
    tracefs) are reported with the fix; clock and host sampling always run.

    \b
    Example:
      ingero-capture --bundle /var/ingero --node gpu-017
      ingero-capture --bundle /var/ingero --max-disk 20G --segment-seconds 120
      ingero-capture --bundle /var/ingero --tcp-probe --tcp-probe-interval 250
      ingero-capture --check
      ingero-capture --check --strict        # exit 1 unless every eBPF source can run
    """
    if (click.get_current_context().get_parameter_source("tcp_probe_interval")
            is click.core.ParameterSource.COMMANDLINE and not tcp_probe):
        raise click.UsageError("--tcp-probe-interval needs --tcp-probe")
    if (click.get_current_context().get_parameter_source("tcp_progress_interval")
            is click.core.ParameterSource.COMMANDLINE and no_tcp_progress):
        raise click.UsageError("--tcp-progress-interval contradicts --no-tcp-progress")
    if strict and no_ebpf:
        raise click.UsageError("--strict requires the eBPF sources: drop --no-ebpf")
    config = CaptureConfig(
        bundle_dir=bundle_dir, node=node, config_file=config_file, pids=pids, comms=comms,
        duration=duration, segment_seconds=segment_seconds, segment_size=segment_size,
        max_disk=max_disk, clock_interval=clock_interval, host_interval=host_interval,
        ebpf=not no_ebpf,
        options=CaptureOptions(lib_paths=list(lib_paths), tcp_probe=tcp_probe,
                               tcp_probe_interval_ms=tcp_probe_interval,
                               tcp_progress=not no_tcp_progress,
                               tcp_progress_interval_ms=tcp_progress_interval,
                               launch_budget=launch_budget),
        output="quiet" if quiet else ("tty" if is_tty() else "plain"),
        compression_level=compression_level, strict=strict, cmdline=cmdline,
        idle_start=start_priority == "idle")
    if check:
        statuses = check_sources(config)
        node_ok = statuses[0].available
        failed = strict_failures(statuses) if strict else []
        # the verdict first, on stderr and in the exit code: a table piped into `head`
        # that closes early must not turn a failed check into a success (a review)
        if not node_ok:
            click.echo(f"Error: {statuses[0].reason}", err=True)
        for s in failed:
            if s.name != "node":
                click.echo(f"Error: {s.name} source off: {s.reason} (--strict)", err=True)
        code = 0 if node_ok and not failed else EXIT_ERROR
        try:
            if as_json:
                echo_json([s.__dict__ for s in statuses])
            else:
                for s in statuses:
                    line = f"{s.name:<14} {'ok ' if s.available else 'off'}  {s.reason or ''}"
                    if not s.available and s.fix:
                        line += f" (fix: {s.fix})"
                    click.echo(line)
            sys.stdout.flush()
        except BrokenPipeError:
            with contextlib.suppress(Exception):
                sys.stdout = None
        sys.exit(code)
    # bundles hold the traced processes' (masked) command lines, ranks and job ids:
    # what the capture creates is its owner's alone, whatever the caller's umask
    old_umask = os.umask(0o077)
    try:
        summary = run_capture(config, reporter=Reporter(config.output))
    finally:
        os.umask(old_umask)     # main() may run inside another program (tests, a wrapper)
    if as_json:
        echo_json(summary.as_dict())
    elif not quiet:
        click.echo(f"{len(summary.segments)} segment(s) sealed in {summary.bundle_dir}", err=True)
    if strict and summary.ebpf_off():
        off = ", ".join(f"{k} ({v})" for k, v in summary.ebpf_off().items())
        click.echo(f"Error: {summary.bundle_dir}: capture stopped at start (--strict): eBPF "
                   f"source(s) off: {off}", err=True)
        sys.exit(EXIT_SOURCE_OFF)


if __name__ == "__main__":
    main()
