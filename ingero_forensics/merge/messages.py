"""Message bounds on the clocks: TCP bytes received on one node were sent from another.

Bundle table ``tcp_progress`` (bundle format 1.1) holds sampled send and receive calls of
the traced processes with their byte position in the connection's stream, counted on
both ends from the connection's establishment. A receive on node j that returned bytes up
to position P (or an arrival that queued them) happened after the send on node i that
began copying the byte at position N < P, and after any instant at which node i had not
sent byte N yet ('unsent' rows): a send before its receive, the message constraint of
post-mortem trace synchronization (causal.py), exact whatever the clocks say. On a quiet
link a send and the receive it wakes are tens of microseconds apart, so these bound a
node's clock far more tightly than collectives, whose ranks leave together only to within
hundreds of microseconds to milliseconds. Where the sender waits for the receiver's
window, its send began long before its bytes left, and the 'unsent' row of the ACK that
opened the window is the tight one: each receive is paired with the latest row of
either kind below it, and the later of the two bounds it.

What is paired, and what is not (each rule keeps a pairing from crossing connections):
one 4-tuple is one connection when exactly one node sends on it and exactly one other
node receives on it, each with one establishment time (``connected_ns``; a 4-tuple
reused after a close is left out); loopback and unspecified addresses never leave their
node and are left out. Pairs are reduced in SQL to the tightest per sending node,
receiving node and time bin, so the causal solve sees a few hundred per node pair.
"""

from __future__ import annotations

from .syncpoints import attached

#: Bins per connection over its receiver's span, at most PAIR_BIN_MAX_NS wide: the
#: tightest pair of each is kept (causal.py bins again per node).
PAIR_BINS = 64
PAIR_BIN_MAX_NS = 30_000_000_000
#: connected_ns values of one 4-tuple on one node further apart than this are different
#: connections (the rows of earlier merges are mapped back to raw time through the old
#: alignment, exact to rounding).
SAME_CONNECTION_NS = 1_000_000
#: Addresses that never leave a node.
LOCAL_ADDRESSES = ("127.%", "::1", "0.0.0.0", "::", "::ffff:127.%")
_LOCAL = LOCAL_ADDRESSES


def plain_address(col: str) -> str:
    """SQL: an address column with an IPv4-mapped IPv6 address (a v4 peer on a v6
    socket) written as the IPv4 address. The capture writes tcp_progress that way and
    tcp_events as IPv6; a bundle from another writer may do either, and the two ends of
    a connection must compare equal."""
    return f"(CASE WHEN {col} LIKE '::ffff:%.%' THEN substr({col}, 8) ELSE {col} END)"


_COLS = ("(node_id, dir, kind, laddr, lport, raddr, rport, connected_ns, mono_ns, pos, "
         "attached)")
#: send: the first byte the call copied; unsent: the first byte not sent yet; recv and
#: arrive: the end of what the call returned or the socket held
_POS = ("CASE WHEN e.direction IN ('send', 'unsent') THEN e.stream_offset "
        "ELSE e.stream_offset + e.bytes END")
#: 0: the sending end, 1: the receiving end
_DIR = "CASE WHEN e.direction IN ('send', 'unsent') THEN 0 ELSE 1 END"
#: on the sending end, 0: a send's start, 1: an instant its bytes had not left (each kind's
#: positions grow with time, so the largest one below a receive, the latest of equal
#: ones, is that kind's latest row: 'unsent' rows repeat a position while a send waits)
_KIND = "CASE e.direction WHEN 'unsent' THEN 1 ELSE 0 END"


def sample_progress(con, pending, bundle_predicate) -> int:
    """temp.flow_sp: every tcp_progress row of the new bundles (raw times) and of the
    earlier merges in fleet.db (raw times from mono_ns and the old alignment); returns
    how many rows."""
    con.execute("DROP TABLE IF EXISTS temp.flow_sp")
    con.execute("CREATE TEMP TABLE flow_sp (node_id INTEGER, dir INTEGER, kind INTEGER, "
                "laddr TEXT, lport INTEGER, raddr TEXT, rport INTEGER, connected_ns INTEGER, "
                "mono_ns INTEGER, pos INTEGER, attached INTEGER)")
    if _has_table(con, "main", "tcp_progress"):
        # earlier merges: connected_ns is aligned; back to the node's raw clock through
        # the alignment it was written with
        con.execute(f"INSERT INTO temp.flow_sp {_COLS} SELECT e.node_id, {_DIR}, {_KIND}, "
                    f"{plain_address('e.saddr')}, "
                    f"e.sport, {plain_address('e.daddr')}, e.dport, CAST(ROUND((e.connected_ns - a.offset_ns) / "
                    f"(1.0 + a.slope)) AS INTEGER), e.mono_ns, {_POS}, "
                    "COALESCE(e.attached, 0) FROM main.tcp_progress "
                    "e JOIN main.clock_alignment a USING (node_id)")
    for item in pending:
        bundle = item["bundle"]
        if "tcp_progress" in getattr(bundle, "absent_tables", ()):
            continue
        # a bundle written before the column: every connection counted from establishment
        late = ("0" if "attached" in getattr(bundle, "absent", {}).get("tcp_progress", ())
                else "COALESCE(e.attached, 0)")
        with attached(con, bundle.db_path, "b"):
            con.execute(f"INSERT INTO temp.flow_sp {_COLS} SELECT ?, {_DIR}, {_KIND}, "
                        f"{plain_address('e.saddr')}, "
                        f"e.sport, {plain_address('e.daddr')}, e.dport, e.connected_ns, "
                        "e.timestamp_ns, "
                        f"{_POS}, {late} FROM b.tcp_progress e WHERE "
                        f"{bundle_predicate(bundle, 'tcp_progress')}", (item["node_id"],))
    return con.execute("SELECT COUNT(*) FROM temp.flow_sp").fetchone()[0]


def _has_table(con, schema: str, table: str) -> bool:
    return con.execute(f"SELECT 1 FROM {schema}.sqlite_schema WHERE type = 'table' AND "
                       "name = ?", (table,)).fetchone() is not None


def message_pairs(con) -> tuple[list[tuple[int, int, int, int, int]],
                                 dict[int, tuple[int, int, int, int]], dict]:
    """The tightest (connection, send node, send raw ns, receive node, receive raw ns) per
    connection and time bin, from temp.flow_sp; per connection (send node, its
    establishment raw ns, receive node, its establishment raw ns, and whether each end's
    capture attached to it established: that end's time is then when it first saw it);
    and counts for the
    merge log: connections paired, 4-tuples left out as ambiguous."""
    if not _has_table(con, "temp", "flow_sp"):
        return [], {}, {"connections": 0, "left_out": 0}
    local = " OR ".join(f"{c} LIKE '{p}'" for c in ("laddr", "raddr") for p in _LOCAL)
    # one connection per 4-tuple: one sending node, one receiving node (another one),
    # one establishment time on each end
    con.execute("DROP TABLE IF EXISTS temp.flow_conn")
    con.execute(
        "CREATE TEMP TABLE flow_conn AS WITH ends AS (SELECT dir, laddr, lport, raddr, "
        "rport, MIN(node_id) AS node_id, COUNT(DISTINCT node_id) AS nodes, "
        "MIN(connected_ns) AS connected, MAX(connected_ns) - MIN(connected_ns) AS span, "
        "MAX(attached) AS attached "
        f"FROM temp.flow_sp WHERE NOT ({local}) GROUP BY 1, 2, 3, 4, 5) "
        # an end attached to has no establishment time: when it was first seen instead
        "SELECT s.laddr, s.lport, s.raddr, s.rport, s.node_id AS sn, s.connected AS sc, "
        "r.node_id AS rn, r.connected AS rc, s.attached AS sa, r.attached AS ra, "
        "s.nodes = 1 AND r.nodes = 1 AND s.node_id != r.node_id AND s.span <= ?1 AND "
        "r.span <= ?1 AS ok FROM ends s JOIN ends r ON r.dir = 1 AND r.laddr = s.raddr "
        "AND r.lport = s.rport AND r.raddr = s.laddr AND r.rport = s.lport "
        "WHERE s.dir = 0", (SAME_CONNECTION_NS,))
    connections, left_out = con.execute(
        "SELECT COALESCE(SUM(ok), 0), COALESCE(SUM(NOT ok), 0) FROM temp.flow_conn"
        ).fetchone()
    con.execute("DELETE FROM temp.flow_conn WHERE NOT ok")
    stats = {"connections": connections, "left_out": left_out}
    if not connections:
        return [], {}, stats
    conns = {cid: (sn, sc, rn, rc, bool(sa), bool(ra))
             for cid, sn, sc, rn, rc, sa, ra in con.execute(
                 "SELECT rowid, sn, sc, rn, rc, sa, ra FROM temp.flow_conn")}
    con.execute("CREATE INDEX temp.flow_send ON flow_sp (laddr, lport, raddr, rport, kind, "
                "pos, mono_ns) WHERE dir = 0")
    # each receive with, of each kind, the sending end's row of the largest position
    # below its end: the send that began copying the last byte it could have returned
    # first, and the last instant that byte was known not to have left; the later of
    # the two, then the tightest per connection and bin (a connection the alignment
    # refuses takes only its own pairs)
    latest = ("(SELECT s.mono_ns FROM temp.flow_sp s WHERE s.dir = 0 AND s.laddr = c.laddr "
              "AND s.lport = c.lport AND s.raddr = c.raddr AND s.rport = c.rport AND "
              "s.kind = {kind} AND s.pos < r.pos ORDER BY s.pos DESC, s.mono_ns DESC "
              "LIMIT 1)")
    rows = con.execute(
        "WITH q AS (SELECT c.rowid AS cid, c.sn, r.mono_ns AS rt, c.rn, "
        f"{latest.format(kind=0)} AS st0, {latest.format(kind=1)} AS st1 "
        "FROM temp.flow_conn c JOIN temp.flow_sp r ON r.dir = 1 AND "
        "r.laddr = c.raddr AND r.lport = c.rport AND r.raddr = c.laddr AND "
        "r.rport = c.lport), "
        # scalar MAX() is NULL when either is: a missing kind gives way to the other
        "p AS (SELECT cid, sn, rt, rn, MAX(COALESCE(st0, st1), COALESCE(st1, st0)) AS st "
        "FROM q), "
        "span AS (SELECT cid, MIN(rt) AS t0, MAX(MIN((MAX(rt) - MIN(rt)) / ?1, ?2), 1) "
        "AS w FROM p GROUP BY cid) "
        # SQLite: the bare columns of a MAX() aggregate come from the row that has it
        "SELECT p.cid, p.sn, p.st, p.rn, p.rt, MAX(p.st - p.rt) FROM p JOIN span "
        "USING (cid) WHERE p.st IS NOT NULL GROUP BY p.cid, (p.rt - span.t0) / span.w",
        (PAIR_BINS, PAIR_BIN_MAX_NS)).fetchall()
    return [(cid, sn, st, rn, rt) for cid, sn, st, rn, rt, _ in rows], conns, stats
