"""The SQL behind every figure of the report, as the analysis ran it.

The analysis runs its queries through a :class:`Recorder`: inside ``with
con.figure("name")`` every statement executed is kept under that figure, with its
parameters inlined as SQL literals, so that the page can show, under each figure and
table, statements that run as they are with ``ingero-query fleet.db`` or ``sqlite3
fleet.db``. There is one source of truth: the statement shown is the statement that
computed the figure (medians and the other steps done in Python over its rows are said
in the text beside it).
"""

from __future__ import annotations

import itertools
import math
import re
from contextlib import contextmanager
from operator import itemgetter

__all__ = ["Recorder", "inline", "literal", "one_line", "pretty", "shell_quote"]


def literal(v) -> str:
    """A parameter as an SQL literal: integers and finite floats as numbers, text quoted
    with its quotes doubled, bytes as a blob literal, None as NULL."""
    if v is None:
        return "NULL"
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"no SQL literal for {v!r}")
        return repr(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return "X'" + bytes(v).hex() + "'"
    s = str(v)
    if "\x00" in s:
        raise ValueError("no SQL literal for text with a NUL character")
    return "'" + s.replace("'", "''") + "'"


def _segments(sql: str):
    """(is_code, text) pieces: quoted strings, quoted identifiers and comments are not code."""
    i, n, start = 0, len(sql), 0
    while i < n:
        c = sql[i]
        if c in "'\"":
            if start < i:
                yield True, sql[start:i]
            j = i + 1
            while j < n:
                if sql[j] == c:
                    if j + 1 < n and sql[j + 1] == c:   # a doubled quote
                        j += 2
                        continue
                    break
                j += 1
            yield False, sql[i:j + 1]
            i = start = j + 1
        elif sql.startswith("--", i):
            if start < i:
                yield True, sql[start:i]
            j = sql.find("\n", i)
            j = n if j < 0 else j
            yield False, sql[i:j] + "\n"
            i = start = j + 1 if j < n else n
        else:
            i += 1
    if start < n:
        yield True, sql[start:]


_NAMED = re.compile(r"\?|[:@$][A-Za-z_][A-Za-z0-9_]*")


def inline(sql: str, params=()) -> str:
    """sql with its ``?`` (positional) or ``:name`` (mapping) parameters replaced by
    literals; placeholders inside strings and comments are left alone."""
    named = isinstance(params, dict)
    seq = iter(() if named else params)
    out = []
    for code, text in _segments(sql):
        if code:
            def sub(m):
                tok = m.group(0)
                if tok == "?":
                    if named:
                        raise ValueError("positional placeholder with named parameters")
                    return literal(next(seq))
                if named:
                    return literal(params[tok[1:]])
                return tok
            text = _NAMED.sub(sub, text)
        out.append(text)
    if not named and next(seq, _END) is not _END:
        raise ValueError("more parameters than placeholders")
    return "".join(out)


_END = object()
_BREAK = re.compile(r"\s+(FROM|WHERE|GROUP BY|ORDER BY|LIMIT|JOIN|UNION ALL|UNION|SELECT)\b")


def pretty(sql: str) -> str:
    """One clause a line (outside strings), runs of spaces collapsed, ending with ';'."""
    out = []
    for code, text in _segments(sql.strip()):
        if code:
            text = re.sub(r"\s+", " ", text)
            text = _BREAK.sub(lambda m: "\n  " + m.group(1) if m.group(1) in (
                "JOIN",) else "\n" + m.group(1), text)
        out.append(text)
    s = "".join(out).strip().rstrip(";")
    # "(\nSELECT" reads better as "(SELECT"
    s = re.sub(r"\(\n(SELECT)", r"(\1", s)
    return s + ";"


def one_line(sql: str) -> str:
    """The statement on one line (runs of whitespace outside strings made one space)."""
    return "".join(re.sub(r"\s+", " ", t) if code else t
                   for code, t in _segments(sql.strip())).strip()


def shell_quote(s: str) -> str:
    """s as one shell word: in double quotes when nothing in it is special there (SQL
    with single-quoted strings stays readable), else in single quotes."""
    if not re.search(r'["$`\\!]', s):
        return '"' + s + '"'
    return "'" + s.replace("'", "'\"'\"'") + "'"


class _Counting:
    """A cursor whose rows are counted as they are read, at C speed (zip with a counter;
    the count is read when the report is done: Recorder.finish)."""

    def __init__(self, cur, entry):
        counter = itertools.count()
        entry["_counter"] = counter
        self._it = map(itemgetter(0), zip(cur, counter))

    def __iter__(self):
        return self._it

    def __next__(self):
        return next(self._it)

    def fetchone(self):
        return next(self._it, None)

    def fetchall(self):
        return list(self._it)


class Recorder:
    """A connection whose statements, inside ``figure(name)``, are kept per figure:
    ``figures[name]`` is a list of ``{"sql": runnable text, "rows": rows read}`` (the
    counts are filled in by finish())."""

    def __init__(self, con):
        self._con = con
        self._tag: str | None = None
        self.figures: dict[str, list[dict]] = {}

    @contextmanager
    def figure(self, name: str | None):
        prev, self._tag = self._tag, name
        try:
            yield self
        finally:
            self._tag = prev

    def execute(self, sql: str, params=()):
        cur = self._con.cursor().execute(sql, params)
        if self._tag is None or "sqlite_schema" in sql:   # about the file, not a figure
            return cur
        text = pretty(inline(sql, params))
        entries = self.figures.setdefault(self._tag, [])
        for e in entries:
            if e["sql"] == text:       # the same statement again (a loop): counted once
                return cur
        entry = {"sql": text, "rows": 0}
        entries.append(entry)
        return _Counting(cur, entry)

    def cursor(self):
        return self

    def finish(self) -> dict[str, list[dict]]:
        """The figures, with the rows each statement returned (as far as it was read)."""
        for entries in self.figures.values():
            for e in entries:
                counter = e.pop("_counter", None)
                if counter is not None:
                    e["rows"] = next(counter)
        return self.figures

    def close(self):
        self._con.close()
