"""ingero-query: read-only SQL on fleet.db or a bundle (thin layer over export.query)."""

from __future__ import annotations

import signal
import sys

import click
import orjson

from ..cliutil import (EXIT_CODES_HELP, FiniteFloatRange, echo_json, handle_errors,
                       version_option)
from .query import (DEFAULT_TIMEOUT_S, FORMATS, Deadline, list_tables, open_database,
                    read_sql, run_query, starts_with_sql_comment, write_rows)


class _SqlCommand(click.Command):
    """Takes a word that opens with an SQL comment (``-- find slow ...``) as the SQL.

    click would parse it as an unknown option; it is moved behind ``--`` instead, so it
    stays the last positional argument while options after it still work.
    """

    def parse_args(self, ctx, args):
        if "--" not in args:
            sql = [a for a in args if starts_with_sql_comment(a)]
            if sql:
                args = [a for a in args if not starts_with_sql_comment(a)] + ["--", *sql]
        return super().parse_args(ctx, args)


@click.command(name="ingero-query", cls=_SqlCommand, epilog=EXIT_CODES_HELP,
               context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("database", type=click.Path(dir_okay=False))
@click.argument("sql", required=False)
@click.option("-f", "--file", "sql_file", type=click.Path(dir_okay=False, allow_dash=True),
              help="Read the SQL from this file ('-' for stdin) instead of the argument.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table",
              show_default=True, help="Output format.")
@click.option("--json", "json_", is_flag=True, help="Same as --format json (for scripts).")
@click.option("-p", "--param", "params", nargs=2, multiple=True, metavar="NAME VALUE",
              help="Bind :NAME in the query to VALUE (repeatable); VALUE stays text. "
                   "Every parameter of the query needs a value (a missing one, or a "
                   "positional ?, is a usage error, exit 2).")
@click.option("--schema", is_flag=True,
              help="List the tables with their row counts and what each holds.")
@click.option("--timeout", type=FiniteFloatRange(min=0), default=DEFAULT_TIMEOUT_S,
              show_default=True,
              help="Stop the statement after this many seconds (0: no limit).")
@click.option("-q", "--quiet", is_flag=True, help="No row count on stderr.")
@version_option("ingero-query")
@handle_errors
def main(database, sql, sql_file, fmt, json_, params, schema, quiet, timeout):
    """Run one read-only SQL statement on DATABASE: a fleet.db or a .bundle.

    The SQL is the SQL argument (it may begin with an SQL comment: "-- find slow ..."),
    or the file given with -f, or, when neither is given and stdin is not a terminal,
    stdin, as sqlite3 reads it.

    Table names are the same in bundles and fleet.db. A bundle is verified and opened
    read-only (its database is decompressed to a private temporary file). A statement
    that would write (INSERT, UPDATE, DELETE, CREATE, DROP, ATTACH, PRAGMA assignments,
    transactions, more than one statement) is refused and nothing runs.

    Rows go to stdout; with the table format the row count goes to stderr.

    \b
    Example:
      ingero-query fleet.db --schema
      ingero-query fleet.db "SELECT node_id, op, COUNT(*) FROM nccl_events GROUP BY 1, 2"
      ingero-query node-05+20250101T000000Z+000000.bundle \\
          "SELECT * FROM capture_log WHERE level = :lvl" -p lvl warning --format csv
      ingero-query fleet.db -f query.sql
      ingero-query fleet.db < query.sql
    """
    if json_:
        fmt = "json"
    if sql is not None and sql_file:
        raise click.UsageError("give the SQL either as an argument or with -f, not both")
    if schema and (sql is not None or sql_file):
        raise click.UsageError("give either SQL or --schema, not both")
    if not schema and sql is None:     # ("" given is blank SQL, below)
        if sql_file:
            sql = read_sql(sql_file)
        elif not sys.stdin.isatty():
            sql = sys.stdin.read()
            if not sql.strip():
                raise click.UsageError("missing SQL (or --schema): none given and stdin is empty")
        else:
            raise click.UsageError("missing SQL (or --schema)")
    if not schema and not sql.strip():
        # blank SQL is missing SQL, wherever it came from (one exit code for both)
        raise click.UsageError("missing SQL (or --schema): the SQL given is blank")
    out = sys.stdout.buffer
    with open_database(database) as db:
        if schema:
            tables = list_tables(db)
            if fmt == "json":
                echo_json([{"table": t.name, "rows": t.rows, "doc": t.doc,
                            "columns": t.columns} for t in tables])
            else:
                width = max((len(t.name) for t in tables), default=0)
                for t in tables:
                    click.echo(f"{t.name.ljust(width)}  {t.rows:>10}  {t.doc}")
            return
        bindings = {name: value for name, value in params} if params else None
        deadline = Deadline(timeout)
        with _sigint_stops(deadline):
            result = run_query(db, sql, bindings, deadline=deadline)
            n = write_rows(result, fmt, out)
            out.flush()
    if fmt == "table" and not quiet:
        click.echo(f"({n} row{'s' if n != 1 else ''})", err=True)


class _sigint_stops:
    """While a statement runs, Ctrl-C stops it: SQLite runs no Python code between its
    instructions, so the handler marks the deadline, whose progress handler stops the
    statement; a second Ctrl-C raises at once."""

    def __init__(self, deadline: Deadline):
        self.deadline = deadline

    def _handler(self, signum, frame):
        if self.deadline.interrupted:
            raise KeyboardInterrupt
        self.deadline.interrupt()

    def __enter__(self):
        try:
            self.old = signal.signal(signal.SIGINT, self._handler)
        except ValueError:          # not the main thread (an embedding): as it was
            self.old = None
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
        if self.deadline.interrupted and exc[0] is None:
            raise KeyboardInterrupt


__all__ = ["main", "orjson"]
