"""Shared click plumbing so the commands behave alike.

Exit codes (documented in docs/cli.md and each --help):
  0  success
  1  error: a one-line message on stderr, nothing half-written
  2  usage error (bad option or argument; click's convention)
  3  partial success: some inputs were skipped (each named on stderr); the rest processed
  130 interrupted (Ctrl-C); outputs left as they were before the command
"""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import re
import sys
from pathlib import Path

import apsw
import click
import orjson

from . import __version__
from .errors import IngeroError

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PARTIAL = 3
EXIT_INTERRUPTED = 130

EXIT_CODES_HELP = "Exit codes: 0 success; 1 error; 2 usage error; 130 interrupted."
#: ingero-merge's, the one command that processes what it can and skips the rest
MERGE_EXIT_CODES_HELP = ("Exit codes: 0 success; 1 error; 2 usage error; 3 some inputs "
                         "skipped; 130 interrupted.")


class BadUsage(IngeroError):
    """A bad option or argument that shows only once the inputs are looked at or the
    options are taken together (-o naming an input, --to before --from, a query
    parameter without a value): one line ``Error: ...`` and exit 2, like click's usage
    errors but without the usage block. Library code may raise it (or a subclass)."""

    exit_code = EXIT_USAGE


def refuse_output_over_input(output, *inputs) -> None:
    """BadUsage when the file output names already exists and is one of inputs (the same
    file however it is spelt: a relative path, a hard or symbolic link), so that a
    command never replaces what it reads. Called before any work; None or '-' (stdout)
    and inputs that do not exist pass (the command names what is wrong with them)."""
    if output is None or str(output) == "-":
        return
    for src in inputs:
        try:
            same = os.path.samefile(src, output)
        except (OSError, ValueError):
            continue
        if same:
            what = "the input" if len(inputs) == 1 else f"an input ({src})"
            raise BadUsage(f"{output}: the output would replace {what}; choose another -o")


def evidence_kind(path) -> str | None:
    """'a fleet.db' or 'a bundle' when the existing file at path is one (by its first
    bytes: SQLite's header with ingero-merge's application_id, or a bundle's manifest
    frame), else None."""
    from .bundle.container import SKIPPABLE_MAGIC, SQLITE_MAGIC
    from .merge.fleet_schema import FLEET_APPLICATION_ID
    try:
        if not os.path.isfile(path):
            return None
        with open(path, "rb") as f:
            head = f.read(100)
    except OSError:
        return None
    if head[:16] == SQLITE_MAGIC and len(head) >= 72 and \
            int.from_bytes(head[68:72], "big") == FLEET_APPLICATION_ID:
        return "a fleet.db"
    if head[:4] == SKIPPABLE_MAGIC.to_bytes(4, "little"):
        return "a bundle"
    return None


def refuse_output_over_evidence(output, what: str) -> None:
    """BadUsage when output names an existing fleet.db or bundle: a report, a trace or a
    redacted copy never replaces the evidence (a slip of -o, or of a shell's history).
    Other files are replaced, as the commands document."""
    if output is None or str(output) == "-":
        return
    kind = evidence_kind(output)
    if kind is not None:
        raise BadUsage(f"{output}: is {kind}; refusing to replace it with {what} (remove "
                       "it first, or choose another -o)")


def require_output_dir(output) -> None:
    """IngeroError (exit 1) when the directory of the file output names does not exist:
    said before any work (a --redact copy, an analysis), not after it."""
    if output is None or str(output) == "-":
        return
    parent = Path(output).parent
    if not parent.is_dir():
        raise IngeroError(f"{output}: directory {parent} does not exist")


#: SQLite errors that say the database file cannot be read (damaged pages, not a
#: database, an I/O error, a lock, no room for temporary data), as opposed to an error in
#: the tools' own SQL (SQLError, MisuseError, ...), which stays a traceback: a bug.
DATABASE_READ_ERRORS = (apsw.CorruptError, apsw.NotADBError, apsw.IOError,
                        apsw.CantOpenError, apsw.PermissionsError, apsw.BusyError,
                        apsw.LockedError, apsw.FullError)


def sqlite_message(e: BaseException) -> str:
    """SQLite's words for an apsw error (older apsw prefixes its class name)."""
    msg = str(e)
    head, sep, rest = msg.partition(": ")
    return rest if sep and head.endswith("Error") and " " not in head else msg


@contextlib.contextmanager
def reading_database(path, what: str = "fleet.db"):
    """Turn a DATABASE_READ_ERRORS error met inside into the one-line IngeroError
    ``PATH: cannot read fleet.db (database disk image is malformed)`` (as ingero-export
    words it)."""
    try:
        yield
    except DATABASE_READ_ERRORS as e:
        raise IngeroError(f"{path}: cannot read {what} ({sqlite_message(e)})") from None


def version_option(prog: str):
    return click.version_option(__version__, "--version", prog_name=prog,
                                message="%(prog)s %(version)s")


#: C0 controls but tab and newline, DEL and the C1 controls: what a terminal acts on
#: (ESC starts ANSI/OSC sequences that retitle it or erase lines, CR overwrites one).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean(text: str) -> str:
    """text with every control character a terminal would act on written as \\xNN."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class SafeStream:
    """A text stream that escapes control characters in everything written to it
    (node names, file names, query values come from bundles: untrusted). ``raw`` is the
    stream itself, for the few sequences the tools write on purpose (progress bars)."""

    def __init__(self, raw):
        self.raw = raw

    def write(self, text):
        if isinstance(text, str):
            self.raw.write(clean(text))
        else:
            self.raw.write(text)
        return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self.raw, name)


class ClosedStream:
    """Standard output when the command was started with it closed (`>&-`: Python then
    has none): a write fails as a full disk's does, and says why (handle_errors)."""

    def write(self, text):
        raise OSError(errno.EBADF, "standard output is closed")

    def flush(self):
        pass

    def isatty(self):
        return False

    @property
    def buffer(self):
        return self


def raw_stream(stream):
    """The stream under a SafeStream (for deliberate terminal control)."""
    return getattr(stream, "raw", stream) if isinstance(stream, SafeStream) else stream


@contextlib.contextmanager
def safe_output():
    """stdout and stderr as SafeStreams while a command runs."""
    saved = sys.stdout, sys.stderr
    if sys.stdout is None:
        sys.stdout = ClosedStream()
    sys.stdout = SafeStream(sys.stdout) if not isinstance(sys.stdout, SafeStream) else sys.stdout
    sys.stderr = SafeStream(sys.stderr) if not isinstance(sys.stderr, SafeStream) else sys.stderr
    try:
        yield
    finally:
        # (None: a broken pipe, its stream let go so that exit does not flush it)
        sys.stdout = saved[0] if sys.stdout is not None else None
        sys.stderr = saved[1]


def handle_errors(fn):
    """Turn library errors into one line on stderr and a documented exit code; every
    character printed meanwhile that a terminal would act on is escaped (SafeStream)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with safe_output():
            return _run(fn, args, kwargs)

    return wrapper


def _run(fn, args, kwargs):
    try:
        rv = fn(*args, **kwargs)
        if sys.stdout is not None:
            sys.stdout.flush()      # a write that fails fails here, not at exit
        return rv
    except IngeroError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(getattr(e, "exit_code", EXIT_ERROR))
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        # stdout closed by a pager or `head`: not an error of ours.
        with contextlib.suppress(Exception):
            sys.stdout = None
        sys.exit(EXIT_OK)
    except OSError as e:
        # One the library did not turn into an error of its own, which names its files:
        # writing to standard output, as a rule (`--json > /mnt/usb/out.json` onto a
        # full transfer medium). Nothing more goes there, not even at exit.
        with contextlib.suppress(Exception):
            sys.stdout = None
        what = f"{e.filename}: cannot use it" if e.filename else "<stdout>: cannot write"
        click.echo(f"Error: {what}: {e.strerror or e}", err=True)
        sys.exit(EXIT_ERROR)


def echo_json(obj) -> None:
    sys.stdout.buffer.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
    sys.stdout.buffer.write(b"\n")
    sys.stdout.flush()


def is_tty(stream=None) -> bool:
    stream = stream or sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@contextlib.contextmanager
def progress(length: int, label: str, *, enabled: bool = True):
    """A progress bar on stderr when it is a terminal; a no-op updater otherwise."""
    if enabled and is_tty():
        with click.progressbar(length=length, label=label,
                               file=raw_stream(sys.stderr)) as bar:
            yield bar.update
    else:
        yield lambda n=1: None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def parse_size(text: str) -> int:
    """'256M', '1.5G', '4096' -> bytes (binary units); a size is at least one byte (0 is
    no "unlimited": --max-disk 0 would evict every sealed segment)."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if s and s[-1] in mult:
            v = float(s[:-1]) * mult[s[-1]]
            if not math.isfinite(v):
                raise ValueError(text)
            n = int(v)
        else:
            n = int(s)
    except ValueError:
        raise click.BadParameter(f"not a size: {text!r} (use e.g. 512M, 2G)") from None
    if n < 1:
        raise click.BadParameter(f"{text!r}: a size must be at least 1 byte")
    return n


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf (nan passes every comparison: a
    --duration nan never ended)."""

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return v
