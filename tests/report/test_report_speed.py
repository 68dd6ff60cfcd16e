"""The report's faster statements and loops give what the plain ones gave (issue 19: the
report at 64 nodes must be fast WITHOUT changing a figure): the reservoir filled in one
call keeps the same sample, rows read in row id order give the same aggregates, and the
lateness grouped collective by collective gives the same arrivals as one GROUP BY."""

import json
import random

import pytest

from ingero_forensics.db import connect_readonly
from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.evidence import (Reservoir, _source, in_rowid_order,
                                              window_clause)


@pytest.mark.parametrize("k, n", [(5, 3), (5, 5), (5, 6), (20, 1000), (1, 50)])
def test_extend_keeps_the_sample_of_add(k, n):
    rng = random.Random(n)
    values = [rng.random() for _ in range(n)]
    one = Reservoir(k, seed=7)
    for v in values:
        one.add(v)
    bulk = Reservoir(k, seed=7).extend(iter(values))
    assert (bulk.n, list(bulk.values)) == (one.n, list(one.values))
    # in pieces too (a reservoir already part full, then past its size)
    parts = Reservoir(k, seed=7).extend(values[:k // 2]).extend(values[k // 2:])
    assert (parts.n, list(parts.values)) == (one.n, list(one.values))
    # past its size, later values replaced earlier ones (the draws were exercised)
    assert n <= k or set(one.values) != set(values[:k])


def test_lateness_arrivals_as_one_group_by(fleets):
    db, _ = fleets("cpu")
    a = analyze_fleet(db)
    (stmt,) = [e["sql"] for e in a.sql["lateness"]]
    con = connect_readonly(db)
    try:
        grouped = {(cid, nid): t for cid, *_, arrivals in con.execute(stmt)
                   for nid, t in json.loads(arrivals)}
        plain = {(cid, nid): t for cid, nid, t in con.execute(
            "SELECT c.collective_id, e.node_id, MAX(e.timestamp_ns) FROM collectives c "
            "JOIN nccl_events e ON e.comm_id_hash = c.comm_id_hash AND e.seq = c.seq "
            "WHERE c.ranks_seen >= 2 GROUP BY c.collective_id, e.node_id")}
    finally:
        con.close()
    assert grouped == plain and len(plain) > 100


@pytest.mark.parametrize("metric", ["psi.cpu.some_pct", "gpu.temp_c", "gpu.sm_clock_mhz"])
def test_rows_in_rowid_order_same_aggregates(fleets, metric):
    db, _ = fleets("cpu")
    a = analyze_fleet(db)
    w, p = window_clause([(x.start_ns, x.end_ns) for x in a.windows])
    con = connect_readonly(db)
    try:
        plain = list(con.execute(
            "SELECT node_id, device, COUNT(*), AVG(value) FROM host_samples "
            f"WHERE metric = ? AND {w} GROUP BY node_id, device", [metric] + p))
        fast = list(con.execute(
            "SELECT node_id, device, COUNT(*), AVG(value) FROM host_samples WHERE "
            f"{in_rowid_order('host_samples', 'metric = ? AND ' + w)} "
            "GROUP BY node_id, device", [metric] + p))
    finally:
        con.close()
    assert len(plain) >= 6 and [r[:3] for r in fast] == [r[:3] for r in plain]
    assert [r[3] for r in fast] == pytest.approx([r[3] for r in plain], rel=1e-12)


def test_whole_table_read_only_for_long_windows(fleets):
    db, _ = fleets("cpu")
    con = connect_readonly(db)
    try:
        lo, hi = con.execute("SELECT MIN(timestamp_ns), MAX(timestamp_ns) "
                             "FROM sched_events").fetchone()
        third = (hi - lo) // 3
        assert _source(con, "sched_events", [(lo, hi)]) == "sched_events NOT INDEXED"
        assert _source(con, "block_events", [(lo - 10**12, hi + 10**12)], "b") \
            == "block_events b NOT INDEXED"
        # two windows that together cover a third
        assert _source(con, "sched_events", [(lo, lo + third // 2 + 1),
                                             (hi - third // 2 - 1, hi)]) \
            == "sched_events NOT INDEXED"
        assert _source(con, "sched_events", [(lo, lo + third // 2)]) == "sched_events"
        assert _source(con, "sched_events", []) == "sched_events"
        # the hint changes the plan, never the rows
        w, p = window_clause([(lo, lo + third // 2)])
        sql = "SELECT node_id, SUM(duration_ns) FROM {} WHERE {} GROUP BY node_id"
        assert list(con.execute(sql.format("sched_events NOT INDEXED", w), p)) \
            == list(con.execute(sql.format("sched_events", w), p))
    finally:
        con.close()
