"""Build a small but complete fleet.db with the real fleet schema (merge/fleet_schema.py).

Used by the export tests and bench/bench_export.py until (and beside) the
simulate -> merge pipeline: every table the exporter reads gets rows with the shapes the
merge writes. Deliberate oddities: a CUDA call that partially overlaps the previous one
(must land on an overflow track), concurrent block I/O, one straggler rank per step,
a node-wide metric and a per-device metric.
"""

from __future__ import annotations

import json
import random

import apsw

from ingero_forensics.merge.fleet_schema import all_index_ddl, fleet_ddl

BASE_NS = 1_736_000_000_123_456_789   # 2025-01-04, with sub-second digits
COMM = "00c0ffee00c0ffee"


def _ins(con, table, rows):
    if not rows:
        return
    cols = list(rows[0])
    sql = f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
    con.executemany(sql, [tuple(r[c] for c in cols) for r in rows])


def build_fleet(path, *, nodes=2, ranks_per_node=2, steps=5, straggler=3, seed=7,
                host_period_ns=100_000_000, cuda_per_step=4) -> dict:
    """Write fleet.db at path; return what was put in (counts the tests check against)."""
    rnd = random.Random(seed)
    con = apsw.Connection(str(path))
    con.execute("PRAGMA journal_mode = OFF")
    con.execute("PRAGMA synchronous = OFF")
    truth = {"nccl": 0, "comm": 0, "cuda_slices": 0, "cuda_instants": 0, "sched": 0,
             "block": 0, "tcp": 0, "host": 0, "stats_groups": 0, "collectives": 0,
             "windows": 0, "flows": 0, "nodes": nodes, "overlaps": 0}
    with con:
        for stmt in fleet_ddl():
            con.execute(stmt)
        _ins(con, "fleet_info", [{"key": "format_version", "value": "1"},
                                 {"key": "created_by", "value": '"fleetgen"'}])
        nranks = nodes * ranks_per_node
        step_ns = 50_000_000
        span_ns = steps * step_ns + 10_000_000
        node_rows, procs, threads, align = [], [], [], []
        for n in range(nodes):
            nid = n + 1
            ranks = list(range(n * ranks_per_node, (n + 1) * ranks_per_node))
            node_rows.append({"node_id": nid, "name": f"node-{n:02d}",
                              "claimed_name": f"node-{n:02d}", "hostname": f"h{n}",
                              "boot_id": f"boot{n}", "ranks": json.dumps(ranks),
                              "job_ids": '["job1"]', "bundles": 1,
                              "first_utc_ns": BASE_NS + n * 1000,
                              "last_utc_ns": BASE_NS + span_ns, "first_mono_ns": 10 ** 9,
                              "last_mono_ns": 10 ** 9 + span_ns})
            align.append({"node_id": nid, "method": "collectives", "offset_ns": BASE_NS,
                          "slope": 0.0, "drift_ppm": 0.5 * n, "uncertainty_ns": 20_000 + n,
                          "sync_points": steps, "sync_points_used": steps,
                          "violations_before": 0, "violations_after": 0,
                          "clock_samples": 10, "steps": 0, "exceeds_claim": 0,
                          "segments": "[]", "causal_moved_ns": 0, "rate_clamped": 0,
                          "message_pairs": 0})
            for lr, r in enumerate(ranks):
                pid = 1000 + lr
                procs.append({"node_id": nid, "bundle_id": nid, "pid": pid, "comm": "python",
                              "rank": r, "local_rank": lr, "world_size": nranks, "env": "{}",
                              "first_seen_ns": BASE_NS, "last_seen_ns": BASE_NS + span_ns,
                              "mono_ns": 10 ** 9})
                threads.append({"node_id": nid, "bundle_id": nid, "pid": pid, "tid": pid,
                                "comm": "python", "first_seen_ns": BASE_NS,
                                "last_seen_ns": BASE_NS + span_ns, "mono_ns": 10 ** 9})
        _ins(con, "nodes", node_rows)
        _ins(con, "clock_alignment", align)
        _ins(con, "processes", procs)
        _ins(con, "threads", threads)

        nccl, comm_ev, cuda, sched, block, tcp, host, stats, colls = ([] for _ in range(9))
        for n in range(nodes):
            nid = n + 1
            for lr in range(ranks_per_node):
                comm_ev.append({"node_id": nid, "bundle_id": nid, "mono_ns": 1,
                                "timestamp_ns": BASE_NS + 1_000_000, "duration_ns": 2_000_000,
                                "api": "ncclCommInitRank", "comm_id_hash": COMM,
                                "rank": n * ranks_per_node + lr, "nranks": nranks,
                                "return_code": 0, "pid": 1000 + lr, "tid": 1000 + lr})
        for s in range(steps):
            t0 = BASE_NS + 5_000_000 + s * step_ns
            entries = {}
            for r in range(nranks):
                late = 8_000_000 if r == straggler else rnd.randrange(0, 200_000)
                entries[r] = t0 + 20_000_000 + late + r   # + r: distinct entries
            first, last = min(entries.values()), max(entries.values())
            last_rank = max(entries, key=entries.get)
            completion = last + 3_000_000
            colls.append({"collective_id": s + 1, "comm_id_hash": COMM, "seq": s + 1,
                          "op": "ALL_REDUCE", "op_mismatch": 0, "nranks": nranks,
                          "ranks_seen": nranks, "bytes": 1 << 20, "first_entry_ns": first,
                          "last_entry_ns": last, "entry_spread_ns": last - first,
                          "last_rank": last_rank,
                          "last_node_id": last_rank // ranks_per_node + 1,
                          "completion_ns": completion, "completion_observations": nranks,
                          "completion_tight": nranks,
                          "completion_spread_ns": 1000})
            truth["windows"] += 1
            truth["flows"] += nranks - 1
            for r in range(nranks):
                nid, lr = r // ranks_per_node + 1, r % ranks_per_node
                pid = 1000 + lr
                e = entries[r]
                nccl.append({"node_id": nid, "bundle_id": nid, "mono_ns": 1, "timestamp_ns": e,
                             "duration_ns": completion - e, "call_duration_ns": 30_000,
                             "completion_ns": completion, "op": "ALL_REDUCE", "rank": r,
                             "nranks": nranks, "comm_id_hash": COMM, "seq": s + 1,
                             "count": 1 << 18, "datatype": "float32", "redop": "sum",
                             "stream": 7, "bytes": 1 << 20, "return_code": 0,
                             "pid": pid, "tid": pid})
                t = t0
                for k in range(cuda_per_step):
                    dur = rnd.randrange(100_000, 2_000_000)
                    cuda.append({"node_id": nid, "bundle_id": nid, "mono_ns": 1,
                                 "timestamp_ns": t, "duration_ns": dur,
                                 "api": "cudaMemcpyAsync" if k % 2 else "cudaStreamSynchronize",
                                 "layer": "runtime", "stream": 7, "bytes": 4096 * k,
                                 "memcpy_kind": "HtoD" if k % 2 else None, "return_code": 0,
                                 "pid": pid, "tid": pid})
                    if s == 1 and r == 0 and k == 0:
                        # partial overlap with the next call: an overflow track
                        cuda.append({"node_id": nid, "bundle_id": nid, "mono_ns": 1,
                                     "timestamp_ns": t + dur // 2, "duration_ns": dur,
                                     "api": "cuLaunchKernel", "layer": "driver",
                                     "stream": 7, "bytes": None, "memcpy_kind": None,
                                     "return_code": 0, "pid": pid, "tid": pid})
                        truth["overlaps"] += 1
                    t += dur + 50_000
                cuda.append({"node_id": nid, "bundle_id": nid, "mono_ns": 1, "timestamp_ns": t,
                             "duration_ns": None, "api": "cudaLaunchKernel", "layer": "runtime",
                             "stream": 7, "bytes": None, "memcpy_kind": None,
                             "return_code": None, "pid": pid, "tid": pid})
                sched.append({"node_id": nid, "bundle_id": nid, "mono_ns": 1,
                              "timestamp_ns": t0 + 15_000_000, "duration_ns": 1_500_000,
                              "kind": "off_cpu", "pid": pid, "tid": pid, "comm": "python",
                              "cpu": lr, "prev_state": "S"})
            for n in range(nodes):
                nid = n + 1
                for q in range(3):   # concurrent I/O: overlapping requests on one disk
                    block.append({"node_id": nid, "bundle_id": nid, "mono_ns": 1,
                                  "timestamp_ns": t0 + q * 100_000, "duration_ns": 1_000_000,
                                  "device": "nvme0n1", "sector": 8 * q, "bytes": 4096,
                                  "op": "write", "rwbs": "WS", "pid": None, "tid": None,
                                  "comm": None, "error": 0})
                tcp.append({"node_id": nid, "bundle_id": nid, "mono_ns": 1,
                            "timestamp_ns": t0 + 1_000, "event": "tcp_retransmit_skb",
                            "family": 4, "saddr": f"10.0.0.{n + 1}", "daddr": "10.0.0.9",
                            "sport": 40000 + n, "dport": 29500, "state": "ESTABLISHED",
                            "owner_pid": 1000, "scope": "job"})
                stats.append({"node_id": nid, "bundle_id": nid, "mono_ns": 1,
                              "interval_start_ns": t0, "interval_end_ns": t0 + step_ns,
                              "source": "cuda", "name": "cudaLaunchKernel", "pid": 1000,
                              "tid": 1000, "count": 500 + s, "total_ns": 10 ** 6,
                              "max_ns": 10 ** 4})
                stats.append({"node_id": nid, "bundle_id": nid, "mono_ns": 1,
                              "interval_start_ns": t0, "interval_end_ns": t0 + step_ns,
                              "source": "cuda", "name": "cudaLaunchKernel", "pid": 1001,
                              "tid": 1001, "count": 400, "total_ns": 10 ** 6, "max_ns": 10 ** 4})
                truth["stats_groups"] += 1
        for n in range(nodes):
            nid = n + 1
            t = BASE_NS
            while t < BASE_NS + span_ns:
                host.append({"node_id": nid, "bundle_id": nid, "mono_ns": 1, "timestamp_ns": t,
                             "metric": "cpu.busy_pct", "device": None,
                             "value": round(rnd.uniform(10, 90), 2)})
                host.append({"node_id": nid, "bundle_id": nid, "mono_ns": 1, "timestamp_ns": t,
                             "metric": "gpu.temp_c", "device": "0",
                             "value": float(rnd.randrange(40, 80))})
                t += host_period_ns
        for table, rows in (("nccl_events", nccl), ("nccl_comm_events", comm_ev),
                            ("cuda_events", cuda), ("sched_events", sched),
                            ("block_events", block), ("tcp_events", tcp),
                            ("host_samples", host), ("event_stats", stats),
                            ("collectives", colls)):
            _ins(con, table, rows)
        for stmt in all_index_ddl():
            con.execute(stmt)
    con.close()
    truth.update(nccl=len(nccl), comm=len(comm_ev),
                 cuda_slices=sum(1 for c in cuda if c["duration_ns"] is not None),
                 cuda_instants=sum(1 for c in cuda if c["duration_ns"] is None),
                 sched=len(sched), block=len(block), tcp=len(tcp), host=len(host),
                 collectives=len(colls), ranks=nodes * ranks_per_node)
    return truth
