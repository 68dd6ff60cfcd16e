"""The evidence a verdict cites: the facts behind a straggler's cause in its windows
(the run queue's tasks, the job's block I/O, its retransmits, its memory cgroups, its
GPUs) and the next step they point to (docs/report.md, rule 5)."""

from __future__ import annotations

from collections import defaultdict

from ..merge.messages import plain_address
from ..merge.ranks import process_ranks
from ..merge.summaries import JOB_BLOCK
from .evidence import (LEAVES_NODE, NODE_MEMORY_UNITS, REFAULT_FLOOR, window_clause,
                       window_seconds)
from .gpus import gpu_ranks

def _and_list(items) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def cited_evidence(con, cause, target, windows, nodes,
                   bins=None) -> tuple[list[str], list[dict], dict]:
    """(evidence sentences, the table's rows, facts the next step needs beyond the rows:
    for the network, every peer and source address in the windows)."""
    w, p = window_clause(windows)
    wb = bins.clause(windows) if bins is not None else None
    secs = window_seconds(windows)
    ev: list[str] = []
    top: list[dict] = []
    facts: dict = {}
    if cause == "cpu":
        for comm, opid, n, tot in con.execute(
                f"SELECT other_comm, other_pid, COUNT(*), SUM(duration_ns) FROM sched_events "
                f"WHERE node_id = ? AND kind = 'runq_delay' AND {w} "
                f"GROUP BY other_comm, other_pid ORDER BY SUM(duration_ns) DESC LIMIT 5",
                [target] + p):
            top.append({"task": comm or "?", "pid": opid, "spans": n, "total_ms": round(tot / 1e6, 1)})
        if top:
            # the total over every task, not the five the table lists
            total_s = (con.execute(f"SELECT SUM(duration_ns) FROM sched_events WHERE "
                                   f"node_id = ? AND kind = 'runq_delay' AND {w}",
                                   [target] + p).fetchone()[0] or 0) / 1e9
            ev.append(f"Its traced threads waited {total_s:,.1f} s in the run queue during the "
                      f"windows (summed over threads), most of it behind {top[0]['task']} "
                      f"(pid {top[0]['pid']}).")
    elif cause == "io":
        for dev, n, mx, avg in con.execute(
                f"SELECT device, COUNT(*), MAX(duration_ns), AVG(duration_ns) FROM block_events b "
                f"WHERE node_id = ? AND {w} AND {JOB_BLOCK} "
                "GROUP BY device ORDER BY MAX(duration_ns) DESC LIMIT 5",
                [target] + p):
            top.append({"device": dev, "requests": n, "max_ms": round(mx / 1e6, 1),
                        "mean_ms": round(avg / 1e6, 2)})
        if top:
            ev.append(f"Block I/O of the job's own processes on {top[0]['device']} took up "
                      f"to {top[0]['max_ms']} ms per request in the windows (mean "
                      f"{top[0]['mean_ms']} ms).")
    elif cause == "network":
        # per peer, not per connection: a lossy NIC resends towards every peer it sends
        # to, over as many connections as the job opened to each (a review: one
        # connection to one neighbour and eight to the other, as many segments each);
        # an IPv4-mapped address (a v4 peer on a v6 socket) is that IPv4 peer
        sa, da = plain_address("saddr"), plain_address("daddr")
        where = (f"FROM tcp_events WHERE node_id = ? AND scope = 'job' AND "
                 f"event = 'tcp_retransmit_skb' AND {LEAVES_NODE} AND {w}")
        # every connection counts, not only the five the table lists
        total, peers, sources = con.execute(
            f"SELECT COUNT(*), COUNT(DISTINCT {da}), group_concat(DISTINCT {sa}) {where}",
            [target] + p).fetchone()
        facts = {"peers": peers, "sources": sorted(sources.split(",")) if sources else []}
        # (by peer alone: a node with two source addresses still has one path to it)
        for dst, srcs, conns, n in con.execute(
                f"SELECT {da} AS dst, group_concat(DISTINCT {sa}), "
                f"COUNT(DISTINCT {sa} || ' ' || sport || ' ' || dport), COUNT(*) {where} "
                f"GROUP BY dst ORDER BY COUNT(*) DESC, dst LIMIT 5", [target] + p):
            top.append({"from": ", ".join(sorted(srcs.split(","))), "to": dst,
                        "connections": conns, "retransmits": n,
                        "share": round(n / total, 4)})
        if top:
            shown = sorted({t['to'] for t in top})
            more = f" and {peers - len(shown)} more" if peers > len(shown) else ""
            ev.append(f"{total:,} TCP retransmits on the job's own connections "
                      f"({total / secs:.1f}/s in the windows) from "
                      f"{_and_list(facts['sources'])} to " + ", ".join(shown) + more + ".")
        bg = con.execute(f"SELECT COUNT(*) FROM tcp_events WHERE scope = 'background' AND {w}",
                         p).fetchone()[0]
        if bg:
            ev.append(f"{bg} other retransmits in the windows belong to background traffic "
                      "(not the job's connections) and are not counted.")
    elif cause == "memory":
        for t in job_memory(con, target, w, p):
            top.append(t)
            held = (f"used up to {t['used_mib']:,.1f} of its {t['limit_mib']:,.1f} MiB limit "
                    f"and " if t["limit_mib"] else f"used up to {t['used_mib']:,.1f} MiB and ")
            stall = (f"; its tasks stalled on memory {t['memory_stall_pct']:.1f}% of the time"
                     if t["memory_stall_pct"] is not None else "")
            ev.append(f"The job's memory cgroup {t['cgroup']} {held}read back, on average, "
                      f"{t['read_back_mib_per_s']:,.1f} MiB/s of pages that had been evicted "
                      f"(workingset refaults; {t['major_faults_per_s']:,.0f} major faults/s) "
                      f"in the windows{stall}.")
        if top:
            # the job's own figures say it; the node's are every tenant's
            return ev, top, facts
        sql, params = (
            (bins.memory_peaks_sql(wb[0]), wb[1]) if wb is not None else
            ("SELECT metric, MAX(value) FROM host_samples WHERE node_id = ? AND metric IN "
             "('psi.memory.some_pct', 'vm.pgmajfault_per_s', 'vm.pgscan_per_s', "
             f"'vm.refault_bytes_per_s') AND {w} "
             "GROUP BY metric ORDER BY metric", p))
        for metric, mx in con.execute(sql, [target] + params):
            if mx:             # a counter that stayed at zero is no evidence
                top.append({"metric": metric, "peak": round(mx / 2**20, 1)
                            if metric == "vm.refault_bytes_per_s" else round(mx, 1),
                            "unit": NODE_MEMORY_UNITS[metric]})
        if top:
            ev.append("Memory pressure on the node, at its peak in the windows: " + ", ".join(
                f"{t['metric']} {t['peak']:,} {t['unit']}" for t in top) + ".")
    elif cause == "gpu":
        sql, params = (
            (bins.gpu_devices_sql(wb[0]), wb[1]) if wb is not None else
            ("SELECT device, AVG(CASE WHEN metric = 'gpu.sm_clock_mhz' THEN value END), "
             "AVG(CASE WHEN metric = 'gpu.temp_c' THEN value END) FROM host_samples "
             "WHERE node_id = ? AND metric IN ('gpu.sm_clock_mhz', 'gpu.temp_c') "
             f"AND {w} GROUP BY device ORDER BY 2 ASC LIMIT 3", p))
        for dev, clk, temp in con.execute(sql, [target] + params):
            top.append({"gpu": dev, "sm_clock_mhz": round(clk or 0), "temp_c": round(temp or 0, 1)})
        if top:
            on = gpu_ranks(con, target, process_ranks(con, target))
            for t in top:
                t["ranks"] = on.get(t["gpu"], [])
            used = (f" (used by rank {', '.join(map(str, top[0]['ranks']))})"
                    if top[0]["ranks"] else " (no rank known to use it)")
            ev.append(f"GPU {top[0]['gpu']}{used} ran at {top[0]['sm_clock_mhz']} MHz SM "
                      f"clock, {top[0]['temp_c']} °C, in the windows.")
    return ev, top, facts


def job_memory(con, target, w, p) -> list[dict]:
    """The target's memory cgroups in the windows, the one with most refaults first: its
    memory use at most and its limit (MiB), refaults (MiB/s) and major faults per
    second, and the share of time the tasks of the v2 cgroup of the same path stalled on
    memory (psi.job.memory.some_pct; None where no v2 cgroup has that path: on a hybrid
    machine the v1 memory cgroup's path may not be the v2 one)."""
    per: dict[str, dict[str, float]] = defaultdict(dict)
    for dev, metric, avg, mx in con.execute(
            "SELECT device, metric, AVG(value), MAX(value) FROM host_samples WHERE "
            "node_id = ? AND metric IN ('mem.job.usage_bytes', 'mem.job.limit_bytes', "
            "'vm.job.refault_bytes_per_s', 'vm.job.pgmajfault_per_s', "
            f"'psi.job.memory.some_pct') AND {w} GROUP BY device, metric", [target] + p):
        per[dev][metric] = mx if metric in ("mem.job.usage_bytes", "mem.job.limit_bytes") else avg
    out = [{"cgroup": dev,
            "used_mib": round(m["mem.job.usage_bytes"] / 2**20, 1),
            "limit_mib": round(m["mem.job.limit_bytes"] / 2**20, 1)
            if "mem.job.limit_bytes" in m else None,
            "read_back_mib_per_s": round(m.get("vm.job.refault_bytes_per_s", 0.0) / 2**20, 2),
            "major_faults_per_s": round(m.get("vm.job.pgmajfault_per_s", 0.0), 1),
            "memory_stall_pct": round(m["psi.job.memory.some_pct"], 2)
            if "psi.job.memory.some_pct" in m else None}
           for dev, m in per.items() if dev is not None and "mem.job.usage_bytes" in m]
    # cited where it read back at least the refault floor, or stalled on memory 3 % or more
    return sorted((t for t in out if t["read_back_mib_per_s"] * 2**20 >= REFAULT_FLOOR
                   or (t["memory_stall_pct"] or 0.0) >= 3.0),
                  key=lambda t: (-t["read_back_mib_per_s"], -(t["memory_stall_pct"] or 0.0),
                                 t["cgroup"]))


#: One peer took at least this share of a node's retransmits: its path is the suspect;
#: below it, what the peers share (the node's own NIC).
ONE_PEER_SHARE = 0.75


def next_step(cause, node: str, top: list[dict], facts: dict | None = None) -> str:
    """What to do about it, from the evidence found (never a generic tip); facts:
    cited_evidence's third part."""
    facts = facts or {}
    if cause == "cpu" and top:
        t = top[0]
        return (f"On {node}, {t['task']} (pid {t['pid']}) kept the job's threads waiting "
                f"for a CPU {t['total_ms'] / 1e3:,.1f} s in the windows (summed over "
                "threads): move it off the node or "
                "confine it (cpuset or cgroup cpu.max) away from the training processes' "
                "CPUs.")
    if cause == "io" and top:
        t = top[0]
        return (f"On {node}, requests of the job's processes on {t['device']} took up to "
                f"{t['max_ms']} ms: check what else uses {t['device']} in the windows "
                "(ingero-query on block_events) and move the data loader's files to a disk "
                "or cache of their own.")
    if cause == "network" and top:
        t = top[0]
        sources = facts.get("sources") or sorted(t["from"].split(", "))
        nics = (f"{node}'s NIC, cable and switch port" if len(sources) == 1 else
                f"{node}'s NICs, cables and switch ports, those of its source addresses "
                f"{_and_list(sources)}")
        if t["share"] >= ONE_PEER_SHARE:
            return (f"Retransmits to {t['to']} ({t['retransmits']:,} of them, "
                    f"{t['share']:.0%}, on {t['connections']} connection"
                    f"{'s' if t['connections'] != 1 else ''}): check {nics} (ethtool -S "
                    "errors and drops) and the path to that peer.")
        peers = facts.get("peers") or len(top)
        listed = [f"{x['to']} ({x['retransmits']:,})" for x in top]
        if peers > len(top):
            listed.append(f"{peers - len(top)} more")
        what = (f"What they share is {node}'s own NIC, cable and switch port: check them"
                if len(sources) == 1 else f"What they share is {node}: check {nics}")
        return (f"Retransmits towards {peers} peers, {_and_list(listed)}, none with three "
                f"quarters of them. {what} (ethtool -S errors and drops) before the paths "
                "to the peers.")
    if cause == "gpu" and top:
        t = top[0]
        return (f"GPU {t['gpu']} on {node} ran at {t['sm_clock_mhz']} MHz, "
                f"{t['temp_c']} °C: read its throttle reasons (nvidia-smi -q -d "
                "PERFORMANCE) and check its cooling and power cap.")
    if cause == "gpu":
        return (f"Read the clocks, temperature and throttle reasons of {node}'s GPUs "
                "(nvidia-smi -q -d PERFORMANCE,CLOCK,TEMPERATURE) and compare them with a "
                "healthy node's: the capture has no GPU samples (NVML) from it in the "
                "windows.")
    if cause == "memory" and top and "cgroup" in top[0]:
        t = top[0]
        if t["limit_mib"] and t["used_mib"] >= 0.9 * t["limit_mib"]:
            return (f"The job's memory cgroup {t['cgroup']} on {node} reached its "
                    f"{t['limit_mib']:,.1f} MiB limit (its own or a parent's) and read back "
                    f"{t['read_back_mib_per_s']:,.1f} MiB/s of evicted pages: raise the "
                    "limit (memory.max or memory.limit_in_bytes, or the job's memory "
                    "request) or shrink what it keeps in memory (a memory-mapped dataset, "
                    "the loader's page cache).")
        return (f"The job's memory cgroup {t['cgroup']} on {node} read back "
                f"{t['read_back_mib_per_s']:,.1f} MiB/s of evicted pages, under no limit "
                "of its own: find what took the memory (other tenants, the page cache of "
                "other files) and leave the job its working set.")
    if cause == "memory" and top:
        return (f"Memory pressure on {node} (" + ", ".join(
            f"{t['metric']} up to {t['peak']:,} {t['unit']}" for t in top) + "): find what grew (other "
            "tenants, page cache of the loader) and leave the job its memory.")
    return (f"Open the windows of {node} in the trace (ingero-export) and compare its "
            "threads with a healthy node's.")
