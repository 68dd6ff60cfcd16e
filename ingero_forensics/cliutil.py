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
import functools
import sys

import click
import orjson

from . import __version__
from .errors import IngeroError

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PARTIAL = 3
EXIT_INTERRUPTED = 130

EXIT_CODES_HELP = ("Exit codes: 0 success; 1 error; 2 usage error; 3 some inputs "
                   "skipped; 130 interrupted.")


def version_option(prog: str):
    return click.version_option(__version__, "--version", prog_name=prog,
                                message="%(prog)s %(version)s")


def handle_errors(fn):
    """Turn library errors into one line on stderr and a documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except IngeroError as e:
            click.echo(f"Error: {e}", err=True)
            sys.exit(EXIT_ERROR)
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:
            # stdout closed by a pager or `head`: not an error of ours.
            with contextlib.suppress(Exception):
                sys.stdout = None
            sys.exit(EXIT_OK)

    return wrapper


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
        with click.progressbar(length=length, label=label, file=sys.stderr) as bar:
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
    """'256M', '1.5G', '4096' -> bytes (binary units)."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if s and s[-1] in mult:
            return int(float(s[:-1]) * mult[s[-1]])
        return int(s)
    except ValueError:
        raise click.BadParameter(f"not a size: {text!r} (use e.g. 512M, 2G)") from None
