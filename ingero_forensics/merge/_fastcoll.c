/* ingero-merge's accelerator: sync points and per-collective results in C (docs/merge.md).
 *
 * Same two roles as export/_fastslices.c: a CPython module, and a SQLite loadable
 * extension (entry point sqlite3_fastcoll_init) loaded once into a scratch apsw
 * connection only to receive the routines of apsw's own SQLite. The statements it steps
 * come from Python, on apsw connections Python opened and hardened.
 *
 *  runs()      one bundle (or one node's earlier rows): its collective rows and waiting
 *              synchronizations, read once, sorted here into thread order to pair each
 *              sync with the event before it (the SQL rule of syncpoints.py), then every
 *              collective row, with the completion it observed if any (and whether that
 *              observation is tight: nothing substantial queued between), written to a
 *              "run" file sorted by (comm_id_hash, seq, pid, tid, t, id).
 *  sample()    the observations of every k-th seq of a run: the alignment's input
 *              (sample_into() inserts them with a statement of the caller's instead).
 *  aggregate() a k-way merge of all runs by (comm_id_hash, seq), one collective at a
 *              time: completions, the collectives, the sampled sync points and the
 *              clock-condition violations per run, the SQL of collectives.py in one pass.
 *
 * The SQL path stays the reference (INGERO_NO_ACCEL=1); tests compare the two. The GIL
 * is released while runs() and aggregate() work: the merge calls them from helper
 * threads. Memory: runs() holds one partition of a bundle (the caller picks partitions
 * by thread so that it stays bounded), aggregate() a read buffer per run and one
 * collective's rows.
 */
#define _GNU_SOURCE         /* qsort_r */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sqlite3ext.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const sqlite3_api_routines *sqlite3_api = NULL;

__attribute__((visibility("default")))
int sqlite3_fastcoll_init(sqlite3 *db, char **err, const sqlite3_api_routines *api)
{
    (void)db;
    (void)err;
    sqlite3_api = api;
    return SQLITE_OK;
}

static PyObject *TooLarge;   /* one collective has more rows than a group may hold */

/* An error met with the GIL released: the message, raised once it is taken again. */
typedef struct {
    char msg[512];
    int set, interrupted, too_large, oom;
} Err;

static int fail(Err *e, const char *what, const char *detail)
{
    if (!e->set) {
        snprintf(e->msg, sizeof e->msg, "%s%s%s", what, detail ? ": " : "", detail ? detail : "");
        e->set = 1;
    }
    return -1;
}

static int fail_sql(Err *e, sqlite3 *db, int rc, const char *what)
{
    if (rc == SQLITE_INTERRUPT)
        e->interrupted = 1;
    return fail(e, what, sqlite3_errmsg(db));
}

static int fail_oom(Err *e)
{
    e->oom = 1;
    return fail(e, "out of memory", NULL);
}

static PyObject *raise_err(Err *e)
{
    if (e->oom)
        return PyErr_NoMemory();
    if (e->too_large)
        PyErr_SetString(TooLarge, e->msg);
    else if (e->interrupted)
        PyErr_SetString(PyExc_KeyboardInterrupt, e->msg);
    else
        PyErr_SetString(PyExc_RuntimeError, e->msg);
    return NULL;
}

static void *grow(void *p, size_t *cap, size_t need, size_t size)
{
    if (need <= *cap)
        return p;
    size_t c = *cap ? *cap : 1024;
    while (c < need)
        c *= 2;
    void *q = realloc(p, c * size);
    if (q)
        *cap = c;
    return q;
}

/* ------------------------------------------------------------------ records */

enum { F_ENT = 1, F_OBS = 2, F_EV = 4, F_RANK = 8, F_BYTES = 16, F_NRANKS = 32, F_TIGHT = 64 };

/* One collective row of a bundle: its entry (F_ENT: a row nccl_events gets) and the
 * completion it observed (F_OBS: the end of the waiting sync right after it; F_TIGHT:
 * nothing but a trivial copy was queued between the two, so the end stands for the
 * completion itself, not for work queued after it). */
typedef struct {
    int64_t seq, t, d, obs, wait, pid, tid, id, bundle, rank, bytes, nranks;
    int32_t comm;     /* index into the run's communicator table (sorted by bytes) */
    uint8_t flags, op;
    uint8_t pad[2];
} Rec;

/* Communicator ids of one run: interned, compared like SQLite's BINARY collation. */
typedef struct {
    char *s;
    uint32_t n;
} Str;

static int str_cmp(const Str *a, const Str *b)
{
    uint32_t n = a->n < b->n ? a->n : b->n;
    int c = memcmp(a->s, b->s, n);
    return c ? c : (a->n > b->n) - (a->n < b->n);
}

typedef struct {
    Str *v;
    size_t len, cap;
    int32_t *slots;
    size_t nslots;
} Intern;

static uint64_t fnv1a(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ULL;
    }
    return h;
}

static void intern_free(Intern *in)
{
    for (size_t i = 0; i < in->len; i++)
        free(in->v[i].s);
    free(in->v);
    free(in->slots);
    memset(in, 0, sizeof *in);
}

static int32_t intern(Intern *in, const char *s, uint32_t n)
{
    if ((in->len + 1) * 2 > in->nslots) {
        size_t ns = in->nslots ? in->nslots * 2 : 64;
        int32_t *sl = calloc(ns, sizeof *sl);
        if (!sl)
            return -1;
        for (size_t i = 0; i < in->len; i++) {
            size_t j = fnv1a(in->v[i].s, in->v[i].n) & (ns - 1);
            while (sl[j])
                j = (j + 1) & (ns - 1);
            sl[j] = (int32_t)i + 1;
        }
        free(in->slots);
        in->slots = sl;
        in->nslots = ns;
    }
    size_t m = in->nslots - 1, j = fnv1a(s, n) & m;
    while (in->slots[j]) {
        Str *x = &in->v[in->slots[j] - 1];
        if (x->n == n && memcmp(x->s, s, n) == 0)
            return in->slots[j] - 1;
        j = (j + 1) & m;
    }
    Str *v = grow(in->v, &in->cap, in->len + 1, sizeof *v);
    char *copy = malloc(n ? n : 1);
    if (!v || !copy) {
        free(copy);
        if (v)
            in->v = v;
        return -1;
    }
    in->v = v;
    memcpy(copy, s, n);
    in->v[in->len].s = copy;
    in->v[in->len].n = n;
    in->slots[j] = (int32_t)++in->len;
    return (int32_t)in->len - 1;
}

/* ------------------------------------------------------------------ run files
 *
 * "INGRUN01", the records, the communicator table (u32 length + bytes each), then the
 * trailer: u64 records, u64 communicators, u64 offset of the table, "INGRUN01".
 * A private scratch file of this merge, written and read by this module only. */

static const char RUN_MAGIC[8] = {'I', 'N', 'G', 'R', 'U', 'N', '0', '1'};

static int write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

static int pread_all(int fd, void *p, size_t n, off_t off)
{
    char *c = p;
    while (n) {
        ssize_t r = pread(fd, c, n, off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        c += r;
        n -= (size_t)r;
        off += r;
    }
    return 0;
}

static int write_run(const char *path, const Rec *recs, size_t n, const Str *comms,
                     size_t ncomms, Err *e)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return fail(e, path, strerror(errno));
    uint64_t trailer[3] = {n, ncomms, 8 + (uint64_t)n * sizeof(Rec)};
    int bad = write_all(fd, RUN_MAGIC, 8) || write_all(fd, recs, n * sizeof(Rec));
    for (size_t i = 0; !bad && i < ncomms; i++)
        bad = write_all(fd, &comms[i].n, 4) || write_all(fd, comms[i].s, comms[i].n);
    bad = bad || write_all(fd, trailer, sizeof trailer) || write_all(fd, RUN_MAGIC, 8);
    if (close(fd) && !bad)
        bad = 1;
    return bad ? fail(e, path, strerror(errno ? errno : EIO)) : 0;
}

/* A run being read: its communicator table in memory, its records through a buffer. */
typedef struct {
    const char *path;
    int64_t node, bundle, off, pre;     /* bundle: of every record, or -1: their own */
    double slope;
    uint64_t nrecs, next;       /* records in the file; index of the next to deliver */
    Str *comms;
    uint64_t ncomms;
    char *commbuf;
    Rec *buf;
    size_t bufcap, buflen, bufpos;
    int64_t before, after, counted;
} Run;

static int run_open(Run *r, size_t bufcap, Err *e)
{
    int fd = open(r->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return fail(e, r->path, strerror(errno));
    struct {
        uint64_t n, ncomms, table;
        char magic[8];
    } tr;
    off_t end = lseek(fd, 0, SEEK_END);
    int bad = end < (off_t)(8 + sizeof tr) || pread_all(fd, &tr, sizeof tr, end - sizeof tr) ||
              memcmp(tr.magic, RUN_MAGIC, 8) || tr.table != 8 + tr.n * sizeof(Rec) ||
              tr.table > (uint64_t)end - sizeof tr;
    size_t tlen = bad ? 0 : (size_t)((uint64_t)end - sizeof tr - tr.table);
    if (!bad) {
        r->nrecs = tr.n;
        r->ncomms = tr.ncomms;
        r->commbuf = malloc(tlen ? tlen : 1);
        r->comms = calloc(tr.ncomms ? tr.ncomms : 1, sizeof(Str));
        r->bufcap = bufcap;
        r->buf = malloc(bufcap * sizeof(Rec));
        if (!r->commbuf || !r->comms || !r->buf) {
            close(fd);
            return fail_oom(e);
        }
        bad = pread_all(fd, r->commbuf, tlen, (off_t)tr.table);
    }
    close(fd);
    if (bad)
        return fail(e, r->path, "not a complete run file");
    size_t pos = 0;
    for (uint64_t i = 0; i < r->ncomms; i++) {
        uint32_t n;
        if (pos + 4 > tlen)
            return fail(e, r->path, "communicator table truncated");
        memcpy(&n, r->commbuf + pos, 4);
        pos += 4;
        if (n > tlen - pos)
            return fail(e, r->path, "communicator table truncated");
        r->comms[i].s = r->commbuf + pos;
        r->comms[i].n = n;
        pos += n;
    }
    return 0;
}

static void run_close(Run *r)
{
    free(r->commbuf);
    free(r->comms);
    free(r->buf);
    r->commbuf = NULL;
    r->comms = NULL;
    r->buf = NULL;
}

/* The run's current record, or NULL at its end (or on error, with e set). */
static const Rec *run_peek(Run *r, Err *e)
{
    if (r->bufpos < r->buflen)
        return &r->buf[r->bufpos];
    if (r->next >= r->nrecs)
        return NULL;
    size_t n = r->nrecs - r->next < r->bufcap ? (size_t)(r->nrecs - r->next) : r->bufcap;
    int fd = open(r->path, O_RDONLY | O_CLOEXEC);
    int bad = fd < 0 || pread_all(fd, r->buf, n * sizeof(Rec), (off_t)(8 + r->next * sizeof(Rec)));
    if (fd >= 0)
        close(fd);
    if (bad) {
        fail(e, r->path, "cannot read the run file");
        return NULL;
    }
    for (size_t i = 0; i < n; i++)
        if (r->buf[i].comm < 0 || (uint64_t)r->buf[i].comm >= r->ncomms) {
            fail(e, r->path, "bad communicator index");
            return NULL;
        }
    if (r->bundle >= 0)
        for (size_t i = 0; i < n; i++)
            r->buf[i].bundle = r->bundle;
    r->next += n;
    r->buflen = n;
    r->bufpos = 0;
    return &r->buf[0];
}

/* ------------------------------------------------------------------ runs() */

typedef struct {
    int64_t pid, tid, t, key;   /* key: is_sync << 62 | ordinal in its source */
} Ev;

#define SYNC_BIT ((int64_t)1 << 62)

static int cmp_ev(const void *pa, const void *pb)
{
    const Ev *a = pa, *b = pb;
    if (a->pid != b->pid)
        return a->pid < b->pid ? -1 : 1;
    if (a->tid != b->tid)
        return a->tid < b->tid ? -1 : 1;
    if (a->t != b->t)
        return a->t < b->t ? -1 : 1;
    return (a->key > b->key) - (a->key < b->key);
}

/* Records whose comm is already the communicator's rank in byte order. */
static int cmp_rec(const void *pa, const void *pb)
{
    const Rec *a = pa, *b = pb;
    if (a->comm != b->comm)
        return a->comm < b->comm ? -1 : 1;
#define CMP(f) if (a->f != b->f) return a->f < b->f ? -1 : 1
    CMP(seq);
    CMP(pid);
    CMP(tid);
    CMP(t);
    CMP(id);
#undef CMP
    return 0;
}

static int cmp_comm_idx(const void *pa, const void *pb, void *strs)
{
    const Str *v = strs;
    return str_cmp(&v[*(const int32_t *)pa], &v[*(const int32_t *)pb]);
}

typedef struct {
    int64_t pid, tid, t, d, queued, gap;    /* queued -1: not recorded */
} Sync;

static int bind_all(sqlite3_stmt *st, const int64_t *binds, int nb)
{
    int np = sqlite3_bind_parameter_count(st);
    for (int i = 0; i < np && i < nb; i++)
        if (sqlite3_bind_int64(st, i + 1, binds[i]) != SQLITE_OK)
            return -1;
    return 0;
}

/* Collective rows: id, pid, tid, t, d, comm_id_hash (text), seq (integer), rank, op,
 * bytes, nranks, ent (a row nccl_events gets), bundle_id.
 * Syncs: pid, tid, t, d (all integers), queued_ops, queue_gap_ns, in id order.
 * A sync's observation is tight when it queued nothing after the collective, or at most
 * tight_ops operations all enqueued within tight_lag of the collective's return. */
static int do_runs(sqlite3 *db, const char *coll_sql, const char *sync_sql, const int64_t *binds,
                   int nb, const char *const *ops, int nops, int64_t min_wait,
                   int64_t tight_ops, int64_t tight_lag,
                   const char *out, int64_t *n_out, int64_t *n_distinct, Err *e)
{
    sqlite3_stmt *st = NULL;
    Rec *recs = NULL;
    Sync *syncs = NULL;
    Ev *evs = NULL;
    int32_t *order = NULL, *rank = NULL;
    Str *sorted = NULL;
    size_t nrec = 0, caprec = 0, nsync = 0, capsync = 0;
    Intern in = {0};
    int rc, ret = -1;

    rc = sqlite3_prepare_v2(db, coll_sql, -1, &st, NULL);
    if (rc != SQLITE_OK || bind_all(st, binds, nb)) {
        fail_sql(e, db, rc, "collective rows");
        goto done;
    }
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        Rec *r = grow(recs, &caprec, nrec + 1, sizeof *r);
        if (!r) {
            fail_oom(e);
            goto done;
        }
        recs = r;
        r = &recs[nrec];
        memset(r, 0, sizeof *r);
        r->id = sqlite3_column_int64(st, 0);
        r->pid = sqlite3_column_int64(st, 1);
        r->tid = sqlite3_column_int64(st, 2);
        r->t = sqlite3_column_int64(st, 3);
        r->d = sqlite3_column_int64(st, 4);
        const char *c = (const char *)sqlite3_column_text(st, 5);
        int cn = sqlite3_column_bytes(st, 5);
        r->seq = sqlite3_column_int64(st, 6);
        if (sqlite3_column_type(st, 7) == SQLITE_INTEGER) {
            r->rank = sqlite3_column_int64(st, 7);
            r->flags |= F_RANK;
        }
        const char *op = (const char *)sqlite3_column_text(st, 8);
        r->op = 255;
        for (int k = 0; op && k < nops; k++)
            if (strcmp(op, ops[k]) == 0)
                r->op = (uint8_t)k;
        if (sqlite3_column_type(st, 9) == SQLITE_INTEGER) {
            r->bytes = sqlite3_column_int64(st, 9);
            r->flags |= F_BYTES;
        }
        if (sqlite3_column_type(st, 10) == SQLITE_INTEGER) {
            r->nranks = sqlite3_column_int64(st, 10);
            r->flags |= F_NRANKS;
        }
        /* the sync rule's collectives (EVENTS_SQL): a known op, integer thread and times */
        if (r->op != 255 && sqlite3_column_type(st, 1) == SQLITE_INTEGER &&
            sqlite3_column_type(st, 2) == SQLITE_INTEGER &&
            sqlite3_column_type(st, 3) == SQLITE_INTEGER &&
            sqlite3_column_type(st, 4) == SQLITE_INTEGER)
            r->flags |= F_EV;
        if (sqlite3_column_int(st, 11))
            r->flags |= F_ENT;
        if (!(r->flags & (F_EV | F_ENT)))
            continue;
        r->bundle = sqlite3_column_int64(st, 12);
        if (!c || (r->flags & F_ENT && r->op == 255)) {
            fail(e, "collective rows", "unexpected value (the SQL checks types first)");
            goto done;
        }
        r->comm = intern(&in, c, (uint32_t)cn);
        if (r->comm < 0) {
            fail_oom(e);
            goto done;
        }
        nrec++;
    }
    if (rc != SQLITE_DONE) {
        fail_sql(e, db, rc, "collective rows");
        goto done;
    }
    sqlite3_finalize(st);
    st = NULL;

    rc = sqlite3_prepare_v2(db, sync_sql, -1, &st, NULL);
    if (rc != SQLITE_OK || bind_all(st, binds, nb)) {
        fail_sql(e, db, rc, "synchronizations");
        goto done;
    }
    while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        Sync *s = grow(syncs, &capsync, nsync + 1, sizeof *s);
        if (!s) {
            fail_oom(e);
            goto done;
        }
        syncs = s;
        syncs[nsync].pid = sqlite3_column_int64(st, 0);
        syncs[nsync].tid = sqlite3_column_int64(st, 1);
        syncs[nsync].t = sqlite3_column_int64(st, 2);
        syncs[nsync].d = sqlite3_column_int64(st, 3);
        syncs[nsync].queued = sqlite3_column_type(st, 4) == SQLITE_INTEGER
                                  ? sqlite3_column_int64(st, 4) : -1;
        syncs[nsync].gap = sqlite3_column_type(st, 5) == SQLITE_INTEGER
                               ? sqlite3_column_int64(st, 5) : INT64_MAX;
        nsync++;
    }
    if (rc != SQLITE_DONE) {
        fail_sql(e, db, rc, "synchronizations");
        goto done;
    }
    sqlite3_finalize(st);
    st = NULL;

    /* Thread order (pid, tid, t, collective before sync, id): a sync observes the
     * completion of the collective right before it, when it waited long enough. */
    size_t nev = 0;
    evs = malloc((nrec + nsync + 1) * sizeof *evs);
    if (!evs) {
        fail_oom(e);
        goto done;
    }
    for (size_t i = 0; i < nrec; i++)
        if (recs[i].flags & F_EV)
            evs[nev++] = (Ev){recs[i].pid, recs[i].tid, recs[i].t, (int64_t)i};
    for (size_t i = 0; i < nsync; i++)
        evs[nev++] = (Ev){syncs[i].pid, syncs[i].tid, syncs[i].t, SYNC_BIT | (int64_t)i};
    if (nev > 1)
        qsort(evs, nev, sizeof *evs, cmp_ev);
    for (size_t i = 1; i < nev; i++) {
        if (!(evs[i].key & SYNC_BIT) || (evs[i - 1].key & SYNC_BIT))
            continue;
        const Sync *s = &syncs[evs[i].key & ~SYNC_BIT];
        Rec *c = &recs[evs[i - 1].key];
        if (s->d >= min_wait && c->pid == s->pid && c->tid == s->tid) {
            /* checked: times come from an untrusted bundle (the SQL bounds them first,
             * syncpoints.TIME_BOUND; this only keeps the C free of overflow) */
            if (__builtin_add_overflow(s->t, s->d, &c->obs)) {
                fail(e, "integer overflow", "end of a synchronization");
                goto done;
            }
            c->wait = s->d;
            c->flags |= F_OBS;
            /* the last queued op's entry, relative to the collective's return (in
             * __int128: times and gaps come from an untrusted bundle) */
            __int128 lag = (__int128)s->t - s->gap - c->t - c->d;
            if (s->queued == 0 || (s->queued > 0 && s->queued <= tight_ops && s->gap != INT64_MAX
                                   && lag <= tight_lag))
                c->flags |= F_TIGHT;
        }
    }
    free(evs);
    evs = NULL;
    free(syncs);
    syncs = NULL;

    size_t keep = 0;
    for (size_t i = 0; i < nrec; i++)
        if (recs[i].flags & (F_ENT | F_OBS)) {
            recs[keep++] = recs[i];
        }
    nrec = keep;

    /* Communicators in byte order, then the records in (comm, seq, pid, tid, t, id). */
    order = malloc((in.len + 1) * sizeof *order);
    rank = malloc((in.len + 1) * sizeof *rank);
    sorted = malloc((in.len + 1) * sizeof *sorted);
    if (!order || !rank || !sorted) {
        fail_oom(e);
        goto done;
    }
    for (size_t i = 0; i < in.len; i++)
        order[i] = (int32_t)i;
    if (in.len > 1)
        qsort_r(order, in.len, sizeof *order, cmp_comm_idx, in.v);
    for (size_t i = 0; i < in.len; i++) {
        rank[order[i]] = (int32_t)i;
        sorted[i] = in.v[order[i]];
    }
    for (size_t i = 0; i < nrec; i++)
        recs[i].comm = rank[recs[i].comm];
    if (nrec > 1)               /* recs is NULL when there is none */
        qsort(recs, nrec, sizeof *recs, cmp_rec);
    int64_t distinct = 0;
    for (size_t i = 0, prev = SIZE_MAX; i < nrec; i++) {
        if (!(recs[i].flags & F_OBS))
            continue;
        if (prev == SIZE_MAX || recs[i].comm != recs[prev].comm || recs[i].seq != recs[prev].seq)
            distinct++;
        prev = i;
    }
    if (write_run(out, recs, nrec, sorted, in.len, e))
        goto done;
    *n_out = (int64_t)nrec;
    *n_distinct = distinct;
    ret = 0;
done:
    sqlite3_finalize(st);
    free(recs);
    free(syncs);
    free(evs);
    free(order);
    free(rank);
    free(sorted);
    intern_free(&in);
    return ret;
}

/* ------------------------------------------------------------------ the k-way merge */

typedef struct {
    Rec r;
    int32_t run;
} Row;

typedef struct {
    Run *runs;
    int nruns;
    int *heap;          /* runs with records left, by their current (comm, seq) */
    int nheap;
    Row *rows;          /* the current collective's rows */
    size_t nrows, caprows, max_rows;
    Err *e;
} Merge;

static int key_cmp(const Merge *m, int ra, const Rec *a, int rb, const Rec *b)
{
    int c = str_cmp(&m->runs[ra].comms[a->comm], &m->runs[rb].comms[b->comm]);
    return c ? c : (a->seq > b->seq) - (a->seq < b->seq);
}

static int heap_less(const Merge *m, int i, int j)
{
    int a = m->heap[i], b = m->heap[j];
    const Run *ra = &m->runs[a], *rb = &m->runs[b];
    int c = key_cmp(m, a, &ra->buf[ra->bufpos], b, &rb->buf[rb->bufpos]);
    return c ? c < 0 : a < b;
}

static void heap_down(Merge *m, int i)
{
    for (;;) {
        int l = 2 * i + 1, s = i;
        if (l < m->nheap && heap_less(m, l, s))
            s = l;
        if (l + 1 < m->nheap && heap_less(m, l + 1, s))
            s = l + 1;
        if (s == i)
            return;
        int t = m->heap[i];
        m->heap[i] = m->heap[s];
        m->heap[s] = t;
        i = s;
    }
}

static int merge_init(Merge *m, Run *runs, int nruns, size_t max_rows, Err *e)
{
    memset(m, 0, sizeof *m);
    m->runs = runs;
    m->nruns = nruns;
    m->max_rows = max_rows;
    m->e = e;
    m->heap = malloc((nruns + 1) * sizeof *m->heap);
    if (!m->heap)
        return fail_oom(e);
    /* read buffers: 64 MiB in all, at least 64 records each */
    size_t per = (64u << 20) / sizeof(Rec) / (nruns ? nruns : 1);
    per = per < 64 ? 64 : per > 65536 ? 65536 : per;
    for (int i = 0; i < nruns; i++) {
        if (run_open(&runs[i], per, e))
            return -1;
        if (run_peek(&runs[i], e))
            m->heap[m->nheap++] = i;
        else if (e->set)
            return -1;
    }
    for (int i = m->nheap / 2 - 1; i >= 0; i--)
        heap_down(m, i);
    return 0;
}

/* The next collective's rows into m->rows: 1, or 0 at the end, -1 on error. */
static int merge_next(Merge *m)
{
    m->nrows = 0;
    if (!m->nheap)
        return 0;
    int k = m->heap[0];
    Run *kr = &m->runs[k];
    Rec key = kr->buf[kr->bufpos];
    while (m->nheap) {
        int i = m->heap[0];
        Run *r = &m->runs[i];
        const Rec *c = &r->buf[r->bufpos];
        if (key_cmp(m, i, c, k, &key) != 0)
            break;
        while (c && key_cmp(m, i, c, k, &key) == 0) {
            if (m->nrows >= m->max_rows) {
                m->e->too_large = 1;
                return fail(m->e, "a collective has too many rows", NULL);
            }
            Row *rows = grow(m->rows, &m->caprows, m->nrows + 1, sizeof *rows);
            if (!rows)
                return fail_oom(m->e);
            m->rows = rows;
            rows[m->nrows].r = *c;
            rows[m->nrows++].run = i;
            r->bufpos++;
            c = run_peek(r, m->e);
            if (!c && m->e->set)
                return -1;
        }
        if (!c)
            m->heap[0] = m->heap[--m->nheap];
        heap_down(m, 0);
    }
    return 1;
}

static void merge_free(Merge *m)
{
    for (int i = 0; i < m->nruns; i++)
        run_close(&m->runs[i]);
    free(m->heap);
    free(m->rows);
}

/* The SQL the merge uses for an aligned time: off + m + CAST(ROUND(m * slope) AS INTEGER)
 * (SQLite's round(): half away from zero, nothing to do beyond 2^52). */
static inline int64_t aligned(const Run *r, int64_t m)
{
    double x = (double)m * r->slope;
    if (x > -4503599627370496.0 && x < 4503599627370496.0)
        x = (double)(int64_t)(x + (x < 0 ? -0.5 : 0.5));
    /* Inputs are bounded (syncpoints.TIME_BOUND, |off| < 2^61, |slope| < 1) so none of
     * this overflows; should it, the result saturates rather than being undefined. */
    if (!(x > -9.2e18 && x < 9.2e18))
        return x < 0 ? INT64_MIN : INT64_MAX;
    int64_t out;
    if (__builtin_add_overflow(r->off, m, &out) || __builtin_add_overflow(out, (int64_t)x, &out))
        return m < 0 ? INT64_MIN : INT64_MAX;
    return out;
}

static int cmp_i64(const void *pa, const void *pb)
{
    int64_t a = *(const int64_t *)pa, b = *(const int64_t *)pb;
    return (a > b) - (a < b);
}

typedef struct {
    int64_t every, ref, min_lat;
    const char *const *ops;
    sqlite3 *db;
    sqlite3_stmt *comp, *agg, *sp;
    volatile const char *stop;
    int64_t *keys;
    size_t capkeys;
} Agg;

static int step_reset(Agg *a, sqlite3_stmt *st, Err *e)
{
    int rc = sqlite3_step(st);
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    return rc == SQLITE_DONE ? 0 : fail_sql(e, a->db, rc, "writing the collectives");
}

/* One collective: the SQL of collectives.py (completion, used, coll_agg, violations). */
static int agg_group(Agg *a, Merge *m, Err *e)
{
    const Row *rows = m->rows;
    size_t n = m->nrows;
    const Run *r0 = &m->runs[rows[0].run];
    const Str *comm = &r0->comms[rows[0].r.comm];
    int64_t seq = rows[0].r.seq;

    /* The completion: the trimmed mean of the tight observations; without any, the
     * earliest observation (an upper bound: work queued after the collective delayed
     * every one of them). */
    int64_t nobs = 0, ntight = 0, sum = 0, amin = 0, amax = 0, omin = 0, omax = 0;
    int64_t completion = 0;
    for (size_t i = 0; i < n; i++) {
        if (!(rows[i].r.flags & F_OBS))
            continue;
        int64_t v;
        if (__builtin_sub_overflow(aligned(&m->runs[rows[i].run], rows[i].r.obs), a->ref, &v))
            return fail(e, "integer overflow", "completion time");
        omin = nobs ? (v < omin ? v : omin) : v;
        omax = nobs ? (v > omax ? v : omax) : v;
        nobs++;
        if (!(rows[i].r.flags & F_TIGHT))
            continue;
        if (__builtin_add_overflow(sum, v, &sum))
            return fail(e, "integer overflow", "sum of completion times");
        amin = ntight ? (v < amin ? v : amin) : v;
        amax = ntight ? (v > amax ? v : amax) : v;
        ntight++;
    }
    if (nobs) {
        if (ntight) {
            double mean = ntight >= 3 ? (double)(sum - amin - amax) / ((double)ntight - 2.0)
                                      : (double)sum / (double)ntight;
            if (!(mean > -9.2e18 && mean < 9.2e18) ||
                __builtin_add_overflow(a->ref, (int64_t)mean, &completion))
                return fail(e, "integer overflow", "completion time");
        } else {
            if (__builtin_add_overflow(a->ref, omin, &completion))
                return fail(e, "integer overflow", "completion time");
            amin = omin;
            amax = omax;
        }
        int64_t spread;
        if (__builtin_sub_overflow(amax, amin, &spread))
            return fail(e, "integer overflow", "completion spread");
        sqlite3_bind_text(a->comp, 1, comm->s, (int)comm->n, SQLITE_STATIC);
        sqlite3_bind_int64(a->comp, 2, seq);
        sqlite3_bind_int64(a->comp, 3, completion);
        sqlite3_bind_int64(a->comp, 4, ntight ? ntight : nobs);
        sqlite3_bind_int64(a->comp, 5, spread);
        sqlite3_bind_int64(a->comp, 6, ntight);
        if (step_reset(a, a->comp, e))
            return -1;
    }

    size_t nent = 0, nkeys = 0;
    int op_min = 256, op_max = -1, have_bytes = 0, have_nranks = 0;
    int64_t bytes_min = 0, bytes_max = 0, nranks = 0, first = 0, last = 0, last_pre = 0;
    const Row *best = NULL;
    if (!(a->keys = grow(a->keys, &a->capkeys, n, sizeof *a->keys)))
        return fail_oom(e);
    for (size_t i = 0; i < n; i++) {
        const Rec *c = &rows[i].r;
        const Run *r = &m->runs[rows[i].run];
        if (!(c->flags & F_ENT))
            continue;
        int64_t at = aligned(r, c->t), pre;
        if (__builtin_add_overflow(r->pre, c->t, &pre))
            return fail(e, "integer overflow", "entry time");
        op_min = c->op < op_min ? c->op : op_min;
        op_max = c->op > op_max ? c->op : op_max;
        if (c->flags & F_BYTES) {
            bytes_min = have_bytes && bytes_min < c->bytes ? bytes_min : c->bytes;
            bytes_max = have_bytes && bytes_max > c->bytes ? bytes_max : c->bytes;
            have_bytes = 1;
        }
        if (c->flags & F_NRANKS) {
            nranks = have_nranks && nranks > c->nranks ? nranks : c->nranks;
            have_nranks = 1;
        }
        /* a rank, else the process (node, pid): an inferred communicator's rows have none */
        a->keys[nkeys++] = c->flags & F_RANK ? c->rank
                           : -1 - (((int64_t)r->node << 32) | (int64_t)(uint32_t)c->pid);
        if (!nent || at < first)
            first = at;
        if (!nent || pre > last_pre)
            last_pre = pre;
        /* the last rank in: ties go to the lowest (node, bundle, row id) */
        if (!best || at > last ||
            (at == last && (r->node < m->runs[best->run].node ||
                            (r->node == m->runs[best->run].node &&
                             (c->bundle < best->r.bundle ||
                              (c->bundle == best->r.bundle && c->id < best->r.id)))))) {
            best = &rows[i];
            last = at;
        }
        nent++;
    }
    if (nent) {
        if (nkeys > 1)
            qsort(a->keys, nkeys, sizeof *a->keys, cmp_i64);
        int64_t distinct = 0;
        for (size_t i = 0; i < nkeys; i++)
            distinct += !i || a->keys[i] != a->keys[i - 1];
        sqlite3_stmt *g = a->agg;
        sqlite3_bind_text(g, 1, comm->s, (int)comm->n, SQLITE_STATIC);
        sqlite3_bind_int64(g, 2, seq);
        sqlite3_bind_text(g, 3, a->ops[op_min], -1, SQLITE_STATIC);
        sqlite3_bind_int(g, 4, op_min != op_max || (have_bytes && bytes_min != bytes_max));
        if (have_nranks)
            sqlite3_bind_int64(g, 5, nranks);
        sqlite3_bind_int64(g, 6, distinct);
        if (have_bytes)
            sqlite3_bind_int64(g, 7, bytes_max);
        sqlite3_bind_int64(g, 8, first);
        sqlite3_bind_int64(g, 9, last_pre);
        sqlite3_bind_int64(g, 10, last);
        if (best->r.flags & F_RANK)
            sqlite3_bind_int64(g, 11, best->r.rank);
        sqlite3_bind_int64(g, 12, m->runs[best->run].node);
        if (step_reset(a, g, e))
            return -1;
    }

    for (size_t i = 0; i < n; i++) {
        const Rec *c = &rows[i].r;
        Run *r = &m->runs[rows[i].run];
        if (!(c->flags & F_OBS))
            continue;
        int64_t at = aligned(r, c->obs);
        if (nent) {     /* Scalasca's clock condition, before and after the alignment */
            r->before += (__int128)c->obs + r->pre < (__int128)last_pre + a->min_lat;
            r->after += (__int128)at < (__int128)last + a->min_lat;
            r->counted = 1;
        }
        if (c->seq % a->every == 0) {
            int64_t d;
            if (__builtin_sub_overflow(at, completion, &d))
                return fail(e, "integer overflow", "observation offset");
            sqlite3_stmt *s = a->sp;
            sqlite3_bind_int64(s, 1, r->node);
            sqlite3_bind_int64(s, 2, c->bundle);
            sqlite3_bind_text(s, 3, comm->s, (int)comm->n, SQLITE_STATIC);
            sqlite3_bind_int64(s, 4, c->seq);
            sqlite3_bind_int64(s, 5, c->pid);
            sqlite3_bind_int64(s, 6, c->tid);
            sqlite3_bind_int64(s, 7, c->obs);
            sqlite3_bind_int64(s, 8, c->wait);
            sqlite3_bind_int(s, 9, (c->flags & F_TIGHT) && ntight > 1 && d <= 50000 &&
                                   d >= -50000);
            sqlite3_bind_int(s, 10, (c->flags & F_TIGHT) != 0);
            if (step_reset(a, s, e))
                return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ Python */

static sqlite3 *db_of(PyObject *ptr)
{
    if (!sqlite3_api) {
        PyErr_SetString(PyExc_RuntimeError, "_fastcoll: SQLite routines not loaded");
        return NULL;
    }
    void *p = PyLong_AsVoidPtr(ptr);
    if (!p && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "null sqlite3 pointer");
    return p;
}

/* A tuple of str as a NULL-terminated array (borrowed UTF-8, alive with the tuple). */
static const char **str_array(PyObject *tup, int *n)
{
    if (!PyTuple_Check(tup) || PyTuple_GET_SIZE(tup) > 250) {
        PyErr_SetString(PyExc_TypeError, "expected a tuple of at most 250 str");
        return NULL;
    }
    *n = (int)PyTuple_GET_SIZE(tup);
    const char **v = PyMem_Calloc(*n + 1, sizeof *v);
    if (!v)
        return (const char **)PyErr_NoMemory();
    for (int i = 0; i < *n; i++)
        if (!(v[i] = PyUnicode_AsUTF8(PyTuple_GET_ITEM(tup, i)))) {
            PyMem_Free(v);
            return NULL;
        }
    return v;
}

static PyObject *fc_runs(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *ptr, *binds, *ops;
    const char *coll_sql, *sync_sql, *out;
    long long min_wait, tight_ops, tight_lag;
    if (!PyArg_ParseTuple(args, "OssO!O!LLLs", &ptr, &coll_sql, &sync_sql, &PyTuple_Type,
                          &binds, &PyTuple_Type, &ops, &min_wait, &tight_ops, &tight_lag, &out))
        return NULL;
    sqlite3 *db = db_of(ptr);
    if (!db)
        return NULL;
    int64_t b[8];
    int nb = (int)PyTuple_GET_SIZE(binds);
    if (nb > 8)
        return PyErr_Format(PyExc_ValueError, "at most 8 binds");
    for (int i = 0; i < nb; i++) {
        b[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(binds, i));
        if (b[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    int nops;
    const char **opv = str_array(ops, &nops);
    if (!opv)
        return NULL;
    Err e = {0};
    int64_t n = 0, distinct = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = do_runs(db, coll_sql, sync_sql, b, nb, opv, nops, min_wait, tight_ops, tight_lag, out,
                 &n, &distinct, &e);
    Py_END_ALLOW_THREADS
    PyMem_Free(opv);
    if (rc)
        return raise_err(&e);
    return Py_BuildValue("(LL)", (long long)n, (long long)distinct);
}

static int spec_runs(PyObject *specs, Run **out, PyObject **keep)
{
    /* specs: (path, node_id, bundle_id or -1, offset_ns, slope, pre_offset_ns) each */
    PyObject *seq = PySequence_Fast(specs, "runs: a sequence of tuples");
    if (!seq)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Run *runs = calloc(n ? n : 1, sizeof *runs);
    if (!runs) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Run *r = &runs[i];
        long long node, bundle, off, pre;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "sLLLdL", &r->path, &node,
                              &bundle, &off, &r->slope, &pre)) {
            free(runs);
            Py_DECREF(seq);
            return -1;
        }
        r->node = node;
        r->bundle = bundle;
        r->off = off;
        r->pre = pre;
    }
    *out = runs;
    *keep = seq;        /* the paths' UTF-8 lives as long as the tuples */
    return (int)n;
}

/* The run's next observation of a collective whose seq is a multiple of every, or NULL
 * at its end (or on error, with e set). */
static const Rec *next_sampled(Run *r, long long every, Err *e)
{
    const Rec *c;
    while ((c = run_peek(r, e))) {
        r->bufpos++;
        if (c->flags & F_OBS && c->seq % every == 0)
            return c;
    }
    return NULL;
}

static PyObject *fc_sample(PyObject *self, PyObject *args)
{
    (void)self;
    const char *path;
    long long every;
    if (!PyArg_ParseTuple(args, "sL", &path, &every))
        return NULL;
    if (every < 1)
        return PyErr_Format(PyExc_ValueError, "every must be >= 1");
    Run r = {0};
    r.path = path;
    r.bundle = -1;
    Err e = {0};
    PyObject *out = PyList_New(0);
    if (!out || run_open(&r, 65536, &e))
        goto fail;
    const Rec *c;
    while ((c = next_sampled(&r, every, &e))) {
        const Str *s = &r.comms[c->comm];
        PyObject *t = Py_BuildValue("(s#LL)", s->s, (Py_ssize_t)s->n, (long long)c->seq,
                                    (long long)c->obs);
        if (!t || PyList_Append(out, t)) {
            Py_XDECREF(t);
            run_close(&r);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(t);
    }
    if (e.set)
        goto fail;
    run_close(&r);
    return out;
fail:
    run_close(&r);
    Py_XDECREF(out);
    return e.set ? raise_err(&e) : NULL;
}

/* The alignment's sample straight into SQLite: every record of a sampled seq (entry,
 * observation or both) bound as (?1 node, ?2 comm_id_hash, ?3 seq, ?4 observed
 * completion or NULL, ?5 entry or NULL, ?6 tight, ?7 op index in SORTED_OPS or NULL,
 * and for an observation ?8 pid, ?9 tid, ?10 the sync's wait, else NULL: where the
 * statement has them) to insert_sql and stepped, without a Python object per row (a fleet of 128 ranks
 * samples over a million of them). */
static int do_sample_into(sqlite3 *db, Run *r, long long every, const char *insert_sql,
                          long long node, int64_t *n, Err *e)
{
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(db, insert_sql, -1, &st, NULL);
    if (rc != SQLITE_OK)
        return fail_sql(e, db, rc, "sample_into: prepare");
    int nparams = sqlite3_bind_parameter_count(st);
    const Rec *c;
    while ((c = run_peek(r, e))) {
        r->bufpos++;
        if (c->seq % every != 0 || !(c->flags & (F_OBS | F_ENT)))
            continue;
        const Str *s = &r->comms[c->comm];
        sqlite3_bind_int64(st, 1, node);
        sqlite3_bind_text(st, 2, s->s, (int)s->n, SQLITE_STATIC);
        sqlite3_bind_int64(st, 3, c->seq);
        if (c->flags & F_OBS)
            sqlite3_bind_int64(st, 4, c->obs);
        else
            sqlite3_bind_null(st, 4);
        if (c->flags & F_ENT)
            sqlite3_bind_int64(st, 5, c->t);
        else
            sqlite3_bind_null(st, 5);
        sqlite3_bind_int(st, 6, (c->flags & F_TIGHT) != 0);
        if (c->op != 255)
            sqlite3_bind_int(st, 7, c->op);
        else
            sqlite3_bind_null(st, 7);
        if (nparams >= 10 && (c->flags & F_OBS)) {
            sqlite3_bind_int64(st, 8, c->pid);
            sqlite3_bind_int64(st, 9, c->tid);
            sqlite3_bind_int64(st, 10, c->wait);
        } else if (nparams >= 10) {
            for (int k = 8; k <= 10; k++)
                sqlite3_bind_null(st, k);
        }
        rc = sqlite3_step(st);
        sqlite3_reset(st);
        if (rc != SQLITE_DONE) {
            fail_sql(e, db, rc, "sample_into: insert");
            break;
        }
        (*n)++;
    }
    sqlite3_finalize(st);
    return e->set ? -1 : 0;
}

static PyObject *fc_sample_into(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *ptr;
    const char *path, *insert_sql;
    long long every, node;
    if (!PyArg_ParseTuple(args, "OsLsL", &ptr, &path, &every, &insert_sql, &node))
        return NULL;
    if (every < 1)
        return PyErr_Format(PyExc_ValueError, "every must be >= 1");
    sqlite3 *db = db_of(ptr);
    if (!db)
        return NULL;
    Run r = {0};
    r.path = path;
    r.bundle = -1;
    Err e = {0};
    int64_t n = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = run_open(&r, 65536, &e) || do_sample_into(db, &r, every, insert_sql, node, &n, &e);
    Py_END_ALLOW_THREADS
    run_close(&r);
    if (rc)
        return raise_err(&e);
    return PyLong_FromLongLong((long long)n);
}

static PyObject *fc_distinct(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *specs, *keep = NULL;
    if (!PyArg_ParseTuple(args, "O", &specs))
        return NULL;
    Run *runs;
    int n = spec_runs(specs, &runs, &keep);
    if (n < 0)
        return NULL;
    Err e = {0};
    Merge m;
    long long distinct = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = merge_init(&m, runs, n, SIZE_MAX, &e);
    while (!rc && (rc = merge_next(&m)) == 1) {
        for (size_t i = 0; i < m.nrows; i++)
            if (m.rows[i].r.flags & F_OBS) {
                distinct++;
                break;
            }
        rc = 0;
    }
    merge_free(&m);
    Py_END_ALLOW_THREADS
    free(runs);
    Py_DECREF(keep);
    if (rc < 0)
        return raise_err(&e);
    return PyLong_FromLongLong(distinct);
}

static PyObject *fc_aggregate(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *specs, *ptr, *ops, *keep = NULL;
    const char *comp_sql, *agg_sql, *sp_sql;
    long long every, ref, min_lat;
    Py_ssize_t max_rows;
    Py_buffer stop;
    if (!PyArg_ParseTuple(args, "OLLLOsssO!w*n", &specs, &every, &ref, &min_lat, &ptr, &comp_sql,
                          &agg_sql, &sp_sql, &PyTuple_Type, &ops, &stop, &max_rows))
        return NULL;
    Agg a = {0};
    Run *runs = NULL;
    PyObject *out = NULL;
    int nops, n = -1;
    a.db = db_of(ptr);
    a.ops = str_array(ops, &nops);
    if (!a.db || !a.ops || stop.len < 1 || every < 1) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "bad arguments");
        goto done;
    }
    if ((n = spec_runs(specs, &runs, &keep)) < 0)
        goto done;
    a.every = every;
    a.ref = ref;
    a.min_lat = min_lat;
    a.stop = stop.buf;
    Err e = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    Merge m;
    rc = merge_init(&m, runs, n, (size_t)max_rows, &e);
    if (!rc) {
        int r1 = sqlite3_prepare_v2(a.db, comp_sql, -1, &a.comp, NULL);
        int r2 = r1 ? r1 : sqlite3_prepare_v2(a.db, agg_sql, -1, &a.agg, NULL);
        int r3 = r2 ? r2 : sqlite3_prepare_v2(a.db, sp_sql, -1, &a.sp, NULL);
        if (r3)
            rc = fail_sql(&e, a.db, r3, "preparing the collectives' statements");
    }
    while (!rc && (rc = merge_next(&m)) == 1) {
        if (*a.stop) {
            e.interrupted = 1;
            rc = fail(&e, "interrupted", NULL);
            break;
        }
        rc = agg_group(&a, &m, &e);
    }
    sqlite3_finalize(a.comp);
    sqlite3_finalize(a.agg);
    sqlite3_finalize(a.sp);
    merge_free(&m);
    free(a.keys);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        raise_err(&e);
        goto done;
    }
    out = PyList_New(0);
    for (int i = 0; out && i < n; i++) {
        if (!runs[i].counted)
            continue;
        PyObject *t = Py_BuildValue("(LLL)", (long long)runs[i].node, (long long)runs[i].before,
                                    (long long)runs[i].after);
        if (!t || PyList_Append(out, t)) {
            Py_XDECREF(t);
            Py_CLEAR(out);
        }
        Py_XDECREF(t);
    }
done:
    PyBuffer_Release(&stop);
    PyMem_Free((void *)a.ops);
    free(runs);
    Py_XDECREF(keep);
    return out;
}

static PyObject *fc_ready(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyBool_FromLong(sqlite3_api != NULL);
}

static PyMethodDef methods[] = {
    {"runs", fc_runs, METH_VARARGS, "One bundle's collective rows and sync points -> a run file."},
    {"sample", fc_sample, METH_VARARGS, "(comm, seq, observed completion) of every k-th seq."},
    {"sample_into", fc_sample_into, METH_VARARGS, "The alignment's sample inserted by a "
     "statement: (db pointer, run path, every, insert SQL binding node, comm, seq, "
     "completion, entry, tight, op index; node) -> rows inserted."},
    {"distinct", fc_distinct, METH_VARARGS, "Distinct observed collectives over some runs."},
    {"aggregate", fc_aggregate, METH_VARARGS, "Completions, collectives, violations: all runs."},
    {"ready", fc_ready, METH_NOARGS, "True once SQLite's routines are loaded."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastcoll",
    "C loops for ingero-merge's collectives (see collectives.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__fastcoll(void)
{
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    TooLarge = PyErr_NewException("_fastcoll.TooLarge", PyExc_ValueError, NULL);
    if (!TooLarge || PyModule_AddObject(m, "TooLarge", TooLarge)) {
        Py_XDECREF(TooLarge);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(TooLarge);
    return m;
}
