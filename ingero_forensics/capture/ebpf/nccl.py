"""NCCL: uprobes on libnccl.so.2 for collectives, point-to-point calls, groups and the
communicator lifecycle.

The kernel side keeps a map from (process, ncclComm_t) to the communicator's identity
(hash of the ncclUniqueId, rank, nranks) and its call counter, so each collective leaves
the kernel already carrying comm_id_hash and an exact per-communicator ``seq``; a record
the ring buffer drops leaves a gap in seq and is counted in capture_log. Collectives keep
one row each (they are the forensic backbone); group start/end only track the nesting
depth in the kernel.

A capture attached to a running job has missed ncclCommInitRank: a collective on a
ncclComm_t the map does not know enters it as "late", with no hash, and its calls are
counted from the attach (nccl_events.handle_seq, with comm_handle). The merge matches
such streams across ranks by their shape and time (merge/lateattach.py).

Calling convention (x86-64 SysV): integer arguments 1-6 in registers, the rest on the
stack above the return address; a 128-byte struct passed by value (ncclUniqueId) goes on
the stack and takes no register, so in ncclCommInitRank(comm, nranks, id, rank) the rank
is the third register argument and the id starts at SP + 8 at function entry.
"""

from __future__ import annotations

import struct
import time

from ...bundle.schema import NCCL_COMM_APIS, NCCL_DATATYPES, NCCL_OPS, NCCL_REDOPS
from ..source import CaptureContext, RowSink
from .base import SITE_STACKS, UPROBE_ARG_C, BccSource, signed64
from .hashing import hex_hash
from .uprobes import Probe, dispatch_programs
from .libs import LibraryTracker

#: (symbol, op index in NCCL_OPS, C expressions for count, dtype, redop, peer, comm, stream)
#: ARG(n) is the n-th integer argument, n > 6 read from the stack.
COLLECTIVES = (
    ("ncclAllReduce", "ALL_REDUCE", "ARG(3)", "ARG(4)", "ARG(5)", "-1", "ARG(6)", "ARG(7)"),
    ("ncclAllGather", "ALL_GATHER", "ARG(3)", "ARG(4)", "-1", "-1", "ARG(5)", "ARG(6)"),
    ("ncclReduceScatter", "REDUCE_SCATTER", "ARG(3)", "ARG(4)", "ARG(5)", "-1", "ARG(6)", "ARG(7)"),
    ("ncclBroadcast", "BROADCAST", "ARG(3)", "ARG(4)", "-1", "ARG(5)", "ARG(6)", "ARG(7)"),
    ("ncclBcast", "BROADCAST", "ARG(2)", "ARG(3)", "-1", "ARG(4)", "ARG(5)", "ARG(6)"),
    ("ncclReduce", "REDUCE", "ARG(3)", "ARG(4)", "ARG(5)", "ARG(6)", "ARG(7)", "ARG(8)"),
    ("ncclAlltoAll", "ALL_TO_ALL", "ARG(3)", "ARG(4)", "-1", "-1", "ARG(5)", "ARG(6)"),
    ("ncclSend", "SEND", "ARG(2)", "ARG(3)", "-1", "ARG(4)", "ARG(5)", "ARG(6)"),
    ("ncclRecv", "RECV", "ARG(2)", "ARG(3)", "-1", "ARG(4)", "ARG(5)", "ARG(6)"),
)
API_INDEX = {name: i for i, name in enumerate(NCCL_COMM_APIS)}

PROGRAM = UPROBE_ARG_C + r"""

static __always_inline u64 mix64(u64 z) {      /* splitmix64 finalizer */
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static __always_inline int hash_unique_id(u64 uaddr, u64 *out) {
    u64 w[16];
    if (bpf_probe_read_user(w, sizeof(w), (void *)uaddr)) return 0;
    u64 h = 0;
#pragma unroll
    for (int i = 0; i < 16; i++) h = mix64(h ^ w[i]);
    *out = h;
    return 1;
}

struct comm_key { u64 handle; u32 tgid; u32 pad; };
/* late: first seen at a collective, its init before the attach: no hash, and seq counts
 * from the attach (handle_seq; the merge infers the communicator, docs/merge.md) */
struct comm_info { u64 hash; u64 seq; u64 splits; s32 rank; s32 nranks; u32 late; u32 pad; };
BPF_HASH(comms, struct comm_key, struct comm_info, 16384);
BPF_HASH(group_depth, u32, u32, 65536);
__SITE_STACKS__

/* In flight on a thread, entry to return. nest counts calls made from inside the
 * traced one (ncclBcast calls ncclBroadcast): only the outermost becomes a row. */
struct call {
    u64 ts; u64 count; u64 stream; u64 comm; u64 hash; u64 seq; u64 ret_addr; u64 parent;
    u64 out;
    s32 stack_id; s32 rank; s32 nranks; s32 dtype; s32 redop; s32 peer; s32 color; s32 key;
    u32 depth; u32 nest; u32 tgid; u8 kind; u8 op; u8 known;
};
BPF_HASH(calls, u32, struct call, 65536);

struct event {
    u64 ts; u64 dur; u64 hash; u64 parent; u64 count; u64 stream; u64 comm; u64 seq;
    u64 ret_addr;
    u32 pid; u32 tid; s32 stack_id; s32 ret; s32 rank; s32 nranks; s32 dtype; s32 redop;
    s32 peer; s32 color; s32 key; u32 depth;
    u8 kind; u8 op; u8 known; u8 pad[5];
};

static __always_inline struct call *begin(u64 id) {
    u32 tid = id;
    struct call *prev = calls.lookup(&tid);
    if (prev) { prev->nest++; return 0; }
    struct call c = {};
    c.ts = bpf_ktime_get_ns();
    c.tgid = id >> 32;    /* read from user space for a call still open (in_flight) */
    c.rank = -1; c.nranks = -1; c.dtype = -1; c.redop = -1; c.peer = -1;
    c.color = -1; c.key = -1;
    calls.update(&tid, &c);
    return calls.lookup(&tid);
}

/* A collective: built on the stack and inserted in one map operation; an entry that
 * finds its thread already in a call is nested and only counts. seq is committed to
 * the communicator only once the call is known to be the outer one. */
static __always_inline int coll_entry(struct pt_regs *ctx, u8 op, u64 count, s64 dtype,
                                      s64 redop, s64 peer, u64 comm, u64 stream) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = id;
    if (!is_target(tgid)) return 0;
    struct call c = {};
    c.ts = bpf_ktime_get_ns();
    c.rank = -1; c.nranks = -1; c.color = -1; c.key = -1;
    c.op = op; c.count = count; c.dtype = dtype; c.redop = redop;
    c.peer = peer; c.comm = comm; c.stream = stream; c.tgid = tgid;
    struct comm_key k = {.handle = comm, .tgid = tgid};
    struct comm_info *ci = comms.lookup(&k);
    if (!ci && comm) {
        struct comm_info late = {.rank = -1, .nranks = -1, .late = 1};
        comms.insert(&k, &late);
        ci = comms.lookup(&k);
    }
    if (ci) {
        c.known = ci->late ? 2 : 1; c.hash = ci->hash; c.seq = ci->seq + 1;
        c.rank = ci->rank; c.nranks = ci->nranks;
    }
    u32 *d = group_depth.lookup(&tid);
    c.depth = d ? *d : 0;
    c.stack_id = -1;
#if __STACKS__
    struct site s = {.tgid = tgid};
    read_site(ctx, &s);
    c.ret_addr = s.ret;
    c.stack_id = site_stack(ctx, &s);
#endif
    if (calls.insert(&tid, &c)) {
        struct call *prev = calls.lookup(&tid);
        if (prev) prev->nest++;
        return 0;
    }
    /* one thread drives a communicator at a time (NCCL's rule), so this is exact */
    if (ci) ci->seq = c.seq;
    return 0;
}

static __always_inline void emit(struct pt_regs *ctx, struct call *c, u64 id) {
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) { count_lost(); return; }
    e->ts = c->ts; e->dur = bpf_ktime_get_ns() - c->ts; e->hash = c->hash;
    e->parent = c->parent; e->count = c->count; e->stream = c->stream; e->comm = c->comm;
    e->seq = c->seq; e->ret_addr = c->ret_addr; e->pid = id >> 32; e->tid = id;
    e->stack_id = c->stack_id; e->ret = PT_REGS_RC(ctx); e->rank = c->rank;
    e->nranks = c->nranks; e->dtype = c->dtype; e->redop = c->redop; e->peer = c->peer;
    e->color = c->color; e->key = c->key; e->depth = c->depth; e->kind = c->kind;
    e->op = c->op; e->known = c->known;
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
}

int nccl_return(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = id;
    struct call *c = calls.lookup(&tid);
    if (!c) return 0;
    if (c->nest) { c->nest--; return 0; }
    if (c->kind == 1 && c->out) {
        /* init or split: the new communicator was written through the out-parameter */
        u64 handle = 0;
        bpf_probe_read_user(&handle, sizeof(handle), (void *)c->out);
        c->comm = handle;
        if (handle && c->known) {
            struct comm_key k = {.handle = handle, .tgid = tgid};
            struct comm_info ci = {.hash = c->hash, .rank = c->rank, .nranks = c->nranks};
            comms.update(&k, &ci);
        }
    }
    emit(ctx, c, id);
    calls.delete(&tid);
    return 0;
}

/* ncclCommInitAll return: comms[i] is rank i of one communicator of nranks. The first 8
 * enter the map; one row names the call (comm_handle = comms[0]). */
static __always_inline void register_rank(struct call *c, u32 tgid, int n, int i) {
    if (i >= n) return;
    u64 handle = 0;
    bpf_probe_read_user(&handle, sizeof(handle), (void *)(c->out + 8 * i));
    struct comm_key k = {.handle = handle, .tgid = tgid};
    struct comm_info ci = {.hash = c->hash, .rank = i, .nranks = n};
    if (handle) comms.update(&k, &ci);
}
int nccl_return_all(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = id;
    struct call *c = calls.lookup(&tid);
    if (!c) return 0;
    if (c->nest) { c->nest--; return 0; }
    int n = c->nranks;
    c->comm = 0;
    bpf_probe_read_user(&c->comm, sizeof(c->comm), (void *)c->out);
    /* written out, not as a loop: the verifier walks each step once */
    register_rank(c, tgid, n, 0); register_rank(c, tgid, n, 1);
    register_rank(c, tgid, n, 2); register_rank(c, tgid, n, 3);
    register_rank(c, tgid, n, 4); register_rank(c, tgid, n, 5);
    register_rank(c, tgid, n, 6); register_rank(c, tgid, n, 7);
    emit(ctx, c, id);
    calls.delete(&tid);
    return 0;
}

/* Every probe honours the target filter (--pid/--comm): lifecycle calls of other
 * processes would otherwise give this node their ranks. */
static __always_inline struct call *comm_entry(u8 api) {
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32)) return 0;
    struct call *c = begin(id);
    if (!c) return 0;
    c->kind = 1; c->op = api;
    return c;
}

/* ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) and
 * ncclCommInitRankConfig(..., int rank, ncclConfig_t *config) */
static __always_inline int init_by_value(struct pt_regs *ctx, u8 api) {
    struct call *c = comm_entry(api);
    if (!c) return 0;
    c->out = PT_REGS_PARM1(ctx);
    c->nranks = PT_REGS_PARM2(ctx);
    c->rank = PT_REGS_PARM3(ctx);
    c->known = hash_unique_id(PT_REGS_SP(ctx) + 8, &c->hash);
    return 0;
}
static __always_inline int on_init_rank(struct pt_regs *ctx) { return init_by_value(ctx, __API_ncclCommInitRank__); }
static __always_inline int on_init_rank_config(struct pt_regs *ctx) {
    return init_by_value(ctx, __API_ncclCommInitRankConfig__);
}

/* ncclCommInitRankScalable(ncclComm_t *newcomm, int nranks, int myrank, int nId,
 *                          ncclUniqueId *commIds, ncclConfig_t *config): all ranks get the
 * same id array; the first id names the communicator. */
static __always_inline int on_init_rank_scalable(struct pt_regs *ctx) {
    struct call *c = comm_entry(__API_ncclCommInitRankScalable__);
    if (!c) return 0;
    c->out = PT_REGS_PARM1(ctx);
    c->nranks = PT_REGS_PARM2(ctx);
    c->rank = PT_REGS_PARM3(ctx);
    if ((int)PT_REGS_PARM4(ctx) > 0)
        c->known = hash_unique_id(PT_REGS_PARM5(ctx), &c->hash);
    return 0;
}

/* ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist): one process, no
 * unique id; the hash is made from the process and the call time. */
static __always_inline int on_init_all(struct pt_regs *ctx) {
    struct call *c = comm_entry(__API_ncclCommInitAll__);
    if (!c) return 0;
    c->out = PT_REGS_PARM1(ctx);
    c->nranks = PT_REGS_PARM2(ctx);
    c->hash = mix64(mix64(bpf_get_current_pid_tgid() >> 32) ^ c->ts);
    c->known = 1;
    return 0;
}

/* ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *) */
static __always_inline int on_split(struct pt_regs *ctx) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct call *c = comm_entry(__API_ncclCommSplit__);
    if (!c) return 0;
    c->comm = PT_REGS_PARM1(ctx);
    c->color = PT_REGS_PARM2(ctx);
    c->key = PT_REGS_PARM3(ctx);
    c->out = PT_REGS_PARM4(ctx);
    struct comm_key k = {.handle = c->comm, .tgid = tgid};
    struct comm_info *parent = comms.lookup(&k);
    if (parent && !parent->late) {
        parent->splits += 1;    /* collective over the parent: same count on every rank */
        c->parent = parent->hash;
        c->hash = mix64(mix64(mix64(parent->hash) ^ (u32)c->color) ^ parent->splits);
        c->known = c->color >= 0;    /* NCCL_SPLIT_NOCOLOR: no child */
    }
    return 0;
}

static __always_inline int end_comm(struct pt_regs *ctx, u8 api) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct call *c = comm_entry(api);
    if (!c) return 0;
    c->comm = PT_REGS_PARM1(ctx);
    struct comm_key k = {.handle = c->comm, .tgid = tgid};
    struct comm_info *ci = comms.lookup(&k);
    if (ci && !ci->late) {
        c->known = 1; c->hash = ci->hash; c->rank = ci->rank; c->nranks = ci->nranks;
        c->seq = ci->seq;
    }
    if (ci) {
        comms.delete(&k);   /* the handle is freed: a later comm may reuse the address */
    }
    return 0;
}
static __always_inline int on_destroy(struct pt_regs *ctx) { return end_comm(ctx, __API_ncclCommDestroy__); }
static __always_inline int on_abort(struct pt_regs *ctx) { return end_comm(ctx, __API_ncclCommAbort__); }

static __always_inline int on_group_start(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32)) return 0;
    u32 tid = id, one = 1;
    u32 *d = group_depth.lookup(&tid);
    if (d) (*d)++; else group_depth.update(&tid, &one);
    return 0;
}
static __always_inline int on_group_end(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32)) return 0;
    u32 tid = id;
    u32 *d = group_depth.lookup(&tid);
    if (d && *d > 1) (*d)--; else if (d) group_depth.delete(&tid);
    return 0;
}
"""

COMM_PROBES = (
    ("ncclCommInitRank", "on_init_rank"), ("ncclCommInitRankConfig", "on_init_rank_config"),
    ("ncclCommInitRankScalable", "on_init_rank_scalable"), ("ncclCommInitAll", "on_init_all"),
    ("ncclCommSplit", "on_split"), ("ncclCommDestroy", "on_destroy"),
    ("ncclCommAbort", "on_abort"),
)
GROUP_PROBES = (("ncclGroupStart", "on_group_start"), ("ncclGroupEnd", "on_group_end"))

# struct event, unpacked as is (see PROGRAM)
EVENT = struct.Struct("<9Q2I9iI3B5x")
_DTYPE_NAMES = tuple(n for n, _ in NCCL_DATATYPES)
_DTYPE_SIZES = tuple(s for _, s in NCCL_DATATYPES)
_REDOP_OPS = {"ALL_REDUCE", "REDUCE", "REDUCE_SCATTER"}
_PEER_OPS = {"SEND", "RECV", "BROADCAST", "REDUCE"}


#: the function named for a collective still open: its op's first symbol (ncclBcast and
#: ncclBroadcast are one op; the kernel side keeps the op, not the symbol)
_OP_API = {}
for _sym, _op, *_ in COLLECTIVES:
    _OP_API.setdefault(_op, _sym)


def entry_calls() -> dict[int, str]:
    """The entry probes' C calls by cookie: the collectives of COLLECTIVES, then the
    communicator and group functions."""
    calls = {i: f"coll_entry(ctx, {NCCL_OPS.index(op)}, {count}, (int){dtype}, (int){redop}, "
                f"(int){peer}, {comm}, {stream})"
             for i, (sym, op, count, dtype, redop, peer, comm, stream) in enumerate(COLLECTIVES)}
    for j, (_sym, fn) in enumerate(COMM_PROBES + GROUP_PROBES):
        calls[len(COLLECTIVES) + j] = f"{fn}(ctx)"
    return calls


def probes() -> list[Probe]:
    """Every libnccl function probed, with its entry and return programs."""
    out = [Probe(sym, f"nccl_entry_{i}", "nccl_entry_multi", i, "nccl_return")
           for i, (sym, *_rest) in enumerate(COLLECTIVES)]
    for j, (sym, _fn) in enumerate(COMM_PROBES + GROUP_PROBES):
        i = len(COLLECTIVES) + j
        ret = None
        if j < len(COMM_PROBES):
            ret = "nccl_return_all" if sym == "ncclCommInitAll" else "nccl_return"
        out.append(Probe(sym, f"nccl_entry_{i}", "nccl_entry_multi", i, ret))
    return out


def redop_name(v: int) -> str | None:
    if v < 0:
        return None
    return NCCL_REDOPS[v] if v < len(NCCL_REDOPS) else f"premul_sum:{v}"


class NcclSource(BccSource):
    compile_first = True
    name = "nccl"
    probe_detail = ("uprobes on the libnccl each traced process maps (found in its memory "
                    "maps at run time; --lib PATH adds one)")
    LIBRARIES = ("nccl",)
    uses_sites = True
    open_call_map = "tid"

    def __init__(self, options):
        super().__init__(options)
        self.libs = LibraryTracker(("nccl",), options.lib_paths)
        self._last_scan = 0.0

    def program(self, ctx: CaptureContext) -> str:
        text = PROGRAM + dispatch_programs("nccl_entry", entry_calls())
        for api, idx in API_INDEX.items():
            text = text.replace(f"__API_{api}__", str(idx))
        return (text.replace("__SITE_STACKS__", SITE_STACKS).replace("__STACK_ENTRIES__", "16384")
                    .replace("__STACKS__", "1" if self.options.stacks else "0"))

    def filter_targets(self, ctx: CaptureContext) -> bool:
        # In automatic mode every process calling into libnccl is a target by definition;
        # not filtering also catches a communicator created before the process scan.
        return not getattr(ctx.targets, "auto", False)

    def attach(self, ctx: CaptureContext) -> None:
        every = probes()
        self.attach_libraries(
            ctx, [p.entry for p in every] + ["nccl_return", "nccl_return_all"],
            ["nccl_entry_multi", "nccl_return", "nccl_return_all"],
            "no libnccl yet: waiting for target processes to map it")

    def _attach_new(self, pids) -> None:
        every = probes()
        for _kind, path in self.libs.new_libraries(pids):
            self.note_attached(path, "uprobes", len(every), self.attach_probes(path, every))

    def housekeeping(self, sink: RowSink) -> None:
        now = time.monotonic()
        if now - self._last_scan >= self.libs.RESCAN_S:
            self._last_scan = now
            self._attach_new(self.ctx.targets.pids())

    def handle(self, raw: list[bytes], sink: RowSink) -> None:
        coll, comm = [], []
        for rec in raw:
            (ts, dur, h, parent, count, stream, handle, seq, ret_addr, pid, tid, stack_id, ret,
             rank, nranks, dtype, redop, peer, color, key, depth, kind, op, known) = EVENT.unpack(rec)
            hash_ = hex_hash(h) if known == 1 else None
            if kind == 0:
                opname = NCCL_OPS[op]
                size = _DTYPE_SIZES[dtype] if 0 <= dtype < len(_DTYPE_SIZES) else None
                nbytes = None
                if size is not None:
                    nbytes = count * size
                    if opname == "REDUCE_SCATTER" and nranks > 0:
                        nbytes *= nranks   # count is the receive count
                coll.append((
                    ts, dur, opname, rank if rank >= 0 else None,
                    nranks if nranks >= 0 else None, hash_, seq if known == 1 else None, count,
                    _DTYPE_NAMES[dtype] if 0 <= dtype < len(_DTYPE_NAMES) else None,
                    redop_name(redop) if opname in _REDOP_OPS else None,
                    peer if opname in _PEER_OPS else None, signed64(stream), nbytes, depth,
                    ret, pid, tid, self.stack_row_id(sink, pid, stack_id, ret_addr),
                    signed64(handle) or None, seq if known == 2 else None))
            else:
                api = NCCL_COMM_APIS[op]
                is_split = api == "ncclCommSplit"
                comm.append((
                    ts, dur, api, hash_, hex_hash(parent) if is_split and parent else None,
                    color if is_split else None, key if is_split else None,
                    rank if rank >= 0 else None, nranks if nranks >= 0 else None,
                    signed64(handle) or None, ret, pid, tid))
        if coll:
            sink.add_many("nccl_events", coll)
        if comm:
            sink.add_many("nccl_comm_events", comm)
        self.events += len(coll) + len(comm)

    def in_flight_rows(self, sink: RowSink, now: int, why: str) -> list[tuple]:
        """The collectives, p2p and communicator calls open now (entry seen, no return)."""
        rows = []
        for tid, c in self.open_calls():
            known = c.known == 1      # 2: a communicator first seen after its init
            if c.kind == 0:
                opname = NCCL_OPS[c.op]
                api = _OP_API[opname]
                dtype = c.dtype if 0 <= c.dtype < len(_DTYPE_NAMES) else None
                nbytes = None if dtype is None else c.count * _DTYPE_SIZES[dtype]
                if nbytes is not None and opname == "REDUCE_SCATTER" and c.nranks > 0:
                    nbytes *= c.nranks
                args = (c.count, None if dtype is None else _DTYPE_NAMES[dtype],
                        c.peer if opname in _PEER_OPS else None, signed64(c.stream), nbytes)
            else:
                opname, api, args = None, NCCL_COMM_APIS[c.op], (None,) * 5
            rows.append((c.ts, now, why, "nccl", api, opname,
                         hex_hash(c.hash) if known else None,
                         c.seq if known and c.kind == 0 else None,
                         c.rank if c.rank >= 0 else None, c.nranks if c.nranks >= 0 else None)
                        + args + (None, c.tgid, tid,
                                  self.stack_row_id(sink, c.tgid, c.stack_id, c.ret_addr),
                                  signed64(c.comm) or None,
                                  c.seq if c.known == 2 and c.kind == 0 else None))
        return rows
