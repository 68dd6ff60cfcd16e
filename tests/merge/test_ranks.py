"""Global ranks of the traced processes (merge/ranks.py)."""

import apsw

from ingero_forensics.merge.ranks import process_ranks


def _fleet(processes=(), comm_events=(), collectives=()):
    """The columns process_ranks reads, of the fleet tables it reads."""
    con = apsw.Connection(":memory:")
    con.execute("CREATE TABLE processes (node_id, bundle_id, pid, rank)")
    con.execute("CREATE TABLE nccl_comm_events (node_id, bundle_id, pid, api, rank, nranks, "
                "timestamp_ns)")
    con.execute("CREATE TABLE nccl_events (node_id, bundle_id, pid, tid, comm_id_hash, rank, "
                "nranks, timestamp_ns)")
    con.executemany("INSERT INTO processes (node_id, bundle_id, pid, rank) VALUES (?, 1, ?, ?)",
                    processes)
    con.executemany("INSERT INTO nccl_comm_events (node_id, bundle_id, pid, api, rank, nranks, "
                    "timestamp_ns) VALUES (?, 1, ?, ?, ?, ?, 0)", comm_events)
    con.executemany("INSERT INTO nccl_events (node_id, bundle_id, pid, tid, comm_id_hash, rank, "
                    "nranks, timestamp_ns) VALUES (?, 1, ?, ?, ?, ?, ?, ?)",
                    [(n, p, p, c, r, k, i) for i, (n, p, c, r, k) in enumerate(collectives)])
    return con


def test_rank_environment_first_then_the_largest_communicator():
    con = _fleet(processes=[(1, 10, 3), (1, 11, None)],
                 comm_events=[(1, 11, "ncclCommInitRank", 1, 2),       # tensor-parallel pair
                              (1, 11, "ncclCommInitRank", 6, 8),       # the world
                              (1, 11, "ncclCommSplit", 0, 16)])        # a split: not counted
    assert process_ranks(con) == {(1, 10): 3, (1, 11): 6}


def test_ranks_from_the_collectives_when_nothing_else_names_them():
    # every row of one process in a 2-rank and an 8-rank communicator, many times over:
    # the world's rank wins, whichever communicator's rows come first
    rows = [(2, 20, "tp", 1, 2), (2, 20, "world", 5, 8)] * 50 + [(2, 21, "world", 4, 8)]
    con = _fleet(processes=[(2, 20, None), (2, 21, None)], collectives=rows[::-1])
    assert process_ranks(con) == {(2, 20): 5, (2, 21): 4}
    assert process_ranks(con, 2) == {(2, 20): 5, (2, 21): 4}
    assert process_ranks(con, 3) == {}


def test_equal_communicators_give_the_lowest_rank_whatever_the_row_order():
    rows = [(1, 30, "a", 7, 8), (1, 30, "b", 2, 8)]
    assert process_ranks(_fleet(collectives=rows)) == {(1, 30): 2}
    assert process_ranks(_fleet(collectives=rows[::-1])) == {(1, 30): 2}


def test_a_rank_that_is_not_an_integer_is_no_rank():
    con = _fleet(collectives=[(1, 40, "w", "x", 16), (1, 40, "w", 3, 8), (1, 41, "w", 1, "8")])
    assert process_ranks(con) == {(1, 40): 3}


def test_collective_rows_read_before_give_the_same_ranks_without_a_scan():
    from ingero_forensics.merge.ranks import COLLECTIVE_RANKS_SQL
    rows = [(2, 20, "tp", 1, 2), (2, 20, "world", 5, 8), (2, 21, "world", 4, 8),
            (1, 30, "a", 7, 8), (1, 30, "b", 2, 8), (1, 40, "w", "x", 16), (1, 41, "w", 1, "8")]
    con = _fleet(processes=[(2, 20, None), (2, 21, None)], collectives=rows)
    read = con.execute(COLLECTIVE_RANKS_SQL).fetchall()
    for node in (None, 1, 2, 3):
        expected = process_ranks(con, node)
        assert expected == process_ranks(con, node, collective_rows=read[::-1])
    # the rows given are what is read: nccl_events is not scanned again
    con.execute("DELETE FROM nccl_events")
    assert process_ranks(con, collective_rows=read[::-1]) == \
        {(2, 20): 5, (2, 21): 4, (1, 30): 2}
    assert process_ranks(con) == {}
