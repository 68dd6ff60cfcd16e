"""Track ids for the trace, and the lane allocator that keeps slices on one track
nested (Perfetto spills or drops partial overlaps)."""

from __future__ import annotations


from .fleet import Node
from .options import SYNTHETIC_TID


# ------------------------------------------------------------------------- tracks

class Tracks:
    """Chrome (pid, tid) per logical track, with overflow lanes and their names."""

    def __init__(self, nodes: list[Node], proc_rank: dict, thread_comm: dict):
        self.by_node = {n.node_id: n for n in nodes}
        self.proc_rank = proc_rank        # (node_id, os pid) -> global rank
        self.thread_comm = thread_comm    # (node_id, os tid) -> thread name
        self.names: dict[tuple[int, int], tuple[int, str]] = {}   # (pid, tid) -> (sort, name)
        self._next = {}                   # chrome pid -> next synthetic tid
        self._synthetic: dict[tuple, int] = {}
        self.overflow = 0

    def synthetic(self, chrome_pid: int, key: tuple, sort: int, name: str) -> int:
        tid = self._synthetic.get((chrome_pid,) + key)
        if tid is None:
            tid = self._next.get(chrome_pid, SYNTHETIC_TID)
            self._next[chrome_pid] = tid + 1
            self._synthetic[(chrome_pid,) + key] = tid
            self.names[(chrome_pid, tid)] = (sort, name)
        return tid

    def thread_label(self, node_id: int, pid: int, tid: int) -> tuple[int, str]:
        rank = self.proc_rank.get((node_id, pid))
        comm = self.thread_comm.get((node_id, tid)) or "?"
        who = f"rank {rank}" if rank is not None else f"pid {pid}"
        sort = (rank if rank is not None else 1_000_000 + pid) * 16
        return sort, f"{who} · {comm} (tid {tid})"

    def thread(self, node_id: int, pid: int, tid: int) -> tuple[int, int]:
        chrome_pid = self.by_node[node_id].pid
        if (chrome_pid, tid) not in self.names:
            self.names[(chrome_pid, tid)] = self.thread_label(node_id, pid, tid)
        return chrome_pid, tid

    def family(self, node_id: int, pid: int, tid: int, family: str, order: int) -> tuple[int, int]:
        chrome_pid = self.by_node[node_id].pid
        sort, label = self.thread_label(node_id, pid, tid)
        return chrome_pid, self.synthetic(chrome_pid, (family, pid, tid), sort + order,
                                          f"{label} · {family}")

    def lane(self, chrome_pid: int, base_tid: int, lane: int) -> int:
        sort, name = self.names[(chrome_pid, base_tid)]
        key = ("lane", base_tid, lane)
        if (chrome_pid,) + key not in self._synthetic:
            self.overflow += 1
        return self.synthetic(chrome_pid, key, sort + 1, f"{name} (overlap {lane})")


def place_lane(lanes: list[list[int]], start: int, end: int) -> int:
    """First lane where [start, end) nests or follows; a new lane if none."""
    for i, stack in enumerate(lanes):
        while stack and stack[-1] <= start:
            stack.pop()
        if not stack or end <= stack[-1]:
            stack.append(end)
            return i
    lanes.append([end])
    return len(lanes) - 1
