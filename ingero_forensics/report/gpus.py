"""Which ranks use which GPU of a node (docs/bundle-format.md, section 8).

host_samples name a GPU by its index (NVML's, which is CUDA's ordinal when the node's
GPUs are all alike or CUDA_DEVICE_ORDER=PCI_BUS_ID). A process's GPU, by the documented
rule, from its allow-listed environment (processes.env, processes.local_rank):

1. CUDA_VISIBLE_DEVICES lists one index: that GPU;
2. it lists several indexes and the local rank is known: the entry at the local rank
   (the process uses cuda:LOCAL_RANK among the visible devices, as torchrun sets up);
3. it is not set and the local rank is known: GPU LOCAL_RANK;
4. otherwise (UUIDs, MIG instances, no local rank): unknown.
"""

from __future__ import annotations

import json

__all__ = ["gpu_of", "gpu_ranks"]


def gpu_of(env_json, local_rank) -> str | None:
    """The GPU index (as host_samples.device text) of one process, or None."""
    try:
        env = json.loads(env_json or "{}")
    except ValueError:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES") if isinstance(env, dict) else None
    if visible is None:
        return str(local_rank) if isinstance(local_rank, int) and local_rank >= 0 else None
    entries = [e.strip() for e in str(visible).split(",") if e.strip()]
    if not entries or not all(e.isdigit() for e in entries):
        return None
    if len(entries) == 1:
        return str(int(entries[0]))
    if isinstance(local_rank, int) and 0 <= local_rank < len(entries):
        return str(int(entries[local_rank]))
    return None


def gpu_ranks(con, node_id: int, ranks: dict) -> dict[str, list[int]]:
    """GPU index -> sorted global ranks of the node's processes on it. ``ranks``:
    (node_id, pid) -> global rank (merge.ranks.process_ranks)."""
    out: dict[str, set] = {}
    for pid, env, local_rank in con.execute(
            "SELECT pid, env, local_rank FROM processes WHERE node_id = ?", (node_id,)):
        gpu = gpu_of(env, local_rank)
        rank = ranks.get((node_id, pid))
        if gpu is not None and rank is not None:
            out.setdefault(gpu, set()).add(rank)
    return {g: sorted(r) for g, r in out.items()}
