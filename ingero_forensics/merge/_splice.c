/*
 * merge/_splice.c: tables built beside the main thread, moved into fleet.db by their
 * pages instead of row by row.
 *
 * A fresh merge builds some fleet tables in a helper thread (core._TableBuilder), each
 * in a database of its own. Moving such a table in with INSERT ... SELECT costs the main
 * thread about 100 ns per row and index entry while the other core waits (7 s of a
 * 16 x 2 M merge). Instead, each built database is written as a *region* of the
 * temporary fleet.db file itself, far past the end of the main database (the file is
 * sparse), through the VFS registered here ("ingero-region": a file descriptor and a
 * byte offset given in the URI). Once the main connection is closed, splice():
 *
 *   1. closes the gap between the main database and each region (fallocate
 *      FALLOC_FL_COLLAPSE_RANGE: the blocks move, no byte is copied; a filesystem
 *      without it gets the region copied down instead), so that region page k is
 *      fleet page E + k, E being the fleet's page count;
 *   2. rewrites the pages that hold page numbers (interior b-tree pages, cells that
 *      spill to overflow pages, overflow pages: 1-2% of them; scan() listed them while
 *      the builder still had the pages in cache) with the numbers + E;
 *   3. puts each root page's content into the root page that the fleet's empty table
 *      or index of the same name already has, so sqlite_schema stays as it is;
 *   4. moves the one page that would land on the lock-byte page (the page holding byte
 *      offset 2^30, which SQLite never uses), if any, to the end;
 *   5. adds the pages left unused (each region's page 1, the old places of the roots,
 *      a region's own lock-byte page) to the freelist, and writes the page count.
 *
 * The result is an ordinary SQLite file: the tests run PRAGMA integrity_check on it and
 * compare its rows with a merge that moved the same tables with INSERT ... SELECT.
 * The file format: https://www.sqlite.org/fileformat2.html (b-tree pages 1.6, overflow
 * 1.6, freelist 1.5, the lock-byte page 1.4).
 *
 * Loaded like _fastcoll: a CPython module, and a SQLite extension loaded once into a
 * scratch apsw connection, which registers the VFS in apsw's SQLite.
 */
#define _GNU_SOURCE         /* fallocate */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sqlite3ext.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <linux/falloc.h>
SQLITE_EXTENSION_INIT1

#define PENDING_BYTE 0x40000000LL

/* ------------------------------------------------------------------ the region VFS */

typedef struct {
    sqlite3_file base;
    int fd;                     /* the fleet file, owned by the caller */
    sqlite3_int64 offset;       /* where the region's page 1 starts in it */
    sqlite3_int64 size;         /* the region's size: what SQLite wrote */
    sqlite3_int64 limit;        /* where the next region starts: never written past */
} RegionFile;

static sqlite3_vfs *orig_vfs;   /* temporary files (sorts) go to the default VFS */
static sqlite3_vfs region_vfs;

static int rg_close(sqlite3_file *f)
{
    (void)f;                    /* the descriptor is the caller's to close */
    return SQLITE_OK;
}

static int rg_read(sqlite3_file *f, void *buf, int n, sqlite3_int64 ofs)
{
    RegionFile *r = (RegionFile *)f;
    char *p = buf;
    int want = ofs >= r->size ? 0 : (int)(ofs + n > r->size ? r->size - ofs : n), got = 0;
    while (got < want) {
        ssize_t k = pread(r->fd, p + got, (size_t)(want - got), r->offset + ofs + got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return SQLITE_IOERR_READ;
        if (k == 0)
            break;
        got += (int)k;
    }
    if (got < n) {
        memset(p + got, 0, (size_t)(n - got));
        return SQLITE_IOERR_SHORT_READ;
    }
    return SQLITE_OK;
}

static int rg_write(sqlite3_file *f, const void *buf, int n, sqlite3_int64 ofs)
{
    RegionFile *r = (RegionFile *)f;
    const char *p = buf;
    int done = 0;
    if (r->limit && ofs + n > r->limit)
        return SQLITE_FULL;
    while (done < n) {
        ssize_t k = pwrite(r->fd, p + done, (size_t)(n - done), r->offset + ofs + done);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return errno == ENOSPC ? SQLITE_FULL : SQLITE_IOERR_WRITE;
        done += (int)k;
    }
    if (ofs + n > r->size)
        r->size = ofs + n;
    return SQLITE_OK;
}

static int rg_truncate(sqlite3_file *f, sqlite3_int64 size)
{
    RegionFile *r = (RegionFile *)f;
    if (size < r->size)         /* the bytes stay; splice() never reads past the size */
        r->size = size;
    return SQLITE_OK;
}

static int rg_sync(sqlite3_file *f, int flags)
{
    (void)f;
    (void)flags;                /* the merge fsyncs the whole file once, at the end */
    return SQLITE_OK;
}

static int rg_size(sqlite3_file *f, sqlite3_int64 *size)
{
    *size = ((RegionFile *)f)->size;
    return SQLITE_OK;
}

/* One connection, in one process, ever opens a region: no locks to take. */
static int rg_lock(sqlite3_file *f, int level)
{
    (void)f;
    (void)level;
    return SQLITE_OK;
}

static int rg_reserved(sqlite3_file *f, int *out)
{
    (void)f;
    *out = 0;
    return SQLITE_OK;
}

static int rg_control(sqlite3_file *f, int op, void *arg)
{
    (void)f;
    (void)op;
    (void)arg;
    return SQLITE_NOTFOUND;
}

static int rg_sector(sqlite3_file *f)
{
    (void)f;
    return 4096;
}

static int rg_caps(sqlite3_file *f)
{
    (void)f;
    return 0;
}

static const sqlite3_io_methods region_io = {
    1, rg_close, rg_read, rg_write, rg_truncate, rg_sync, rg_size, rg_lock, rg_lock,
    rg_reserved, rg_control, rg_sector, rg_caps,
};

/* file:NAME?vfs=ingero-region&fd=N&offset=BYTES[&size=BYTES][&limit=BYTES]: NAME is
 * never opened; a write past `limit` bytes is SQLITE_FULL. */
static int rg_open(sqlite3_vfs *vfs, sqlite3_filename name, sqlite3_file *f, int flags,
                   int *out)
{
    (void)vfs;
    /* A region runs with journal_mode = OFF: a journal here would be a bug, and its
     * name must never reach the disk (it could be another connection's). */
    if (flags & (SQLITE_OPEN_MAIN_JOURNAL | SQLITE_OPEN_WAL | SQLITE_OPEN_SUPER_JOURNAL))
        return SQLITE_CANTOPEN;
    /* Temporary files (sorts), and databases ATTACHed by a region's connection (which
     * inherit its VFS) without a descriptor: ordinary files. */
    sqlite3_int64 fd = (flags & SQLITE_OPEN_MAIN_DB) && name
                       ? sqlite3_uri_int64(name, "fd", -1) : -1;
    if (fd < 0)
        return orig_vfs->xOpen(orig_vfs, name, f, flags, out);
    sqlite3_int64 ofs = sqlite3_uri_int64(name, "offset", -1);
    sqlite3_int64 size = sqlite3_uri_int64(name, "size", 0);
    sqlite3_int64 limit = sqlite3_uri_int64(name, "limit", 0);
    if (fd > INT32_MAX || ofs < 0 || size < 0 || limit < 0 || fcntl((int)fd, F_GETFL) < 0)
        return SQLITE_CANTOPEN;
    RegionFile *r = (RegionFile *)f;
    memset(r, 0, sizeof *r);
    r->base.pMethods = &region_io;
    r->fd = (int)fd;
    r->offset = ofs;
    r->size = size;
    r->limit = limit;
    if (out)
        *out = flags;
    return SQLITE_OK;
}

/* No journal of a region ever exists, and nothing is deleted by name: a region's
 * "journal" could share a name with a real file. */
static int rg_delete(sqlite3_vfs *vfs, const char *name, int sync)
{
    (void)vfs;
    (void)name;
    (void)sync;
    return SQLITE_OK;
}

static int rg_access(sqlite3_vfs *vfs, const char *name, int flags, int *out)
{
    (void)vfs;
    (void)name;
    (void)flags;
    *out = 0;
    return SQLITE_OK;
}

static int rg_fullpath(sqlite3_vfs *vfs, const char *name, int n, char *out)
{
    (void)vfs;
    return orig_vfs->xFullPathname(orig_vfs, name, n, out);
}

static void *rg_dlopen(sqlite3_vfs *vfs, const char *name)
{
    (void)vfs;
    return orig_vfs->xDlOpen(orig_vfs, name);
}

static void rg_dlerror(sqlite3_vfs *vfs, int n, char *msg)
{
    (void)vfs;
    orig_vfs->xDlError(orig_vfs, n, msg);
}

static void (*rg_dlsym(sqlite3_vfs *vfs, void *h, const char *sym))(void)
{
    (void)vfs;
    return orig_vfs->xDlSym(orig_vfs, h, sym);
}

static void rg_dlclose(sqlite3_vfs *vfs, void *h)
{
    (void)vfs;
    orig_vfs->xDlClose(orig_vfs, h);
}

static int rg_random(sqlite3_vfs *vfs, int n, char *out)
{
    (void)vfs;
    return orig_vfs->xRandomness(orig_vfs, n, out);
}

static int rg_sleep(sqlite3_vfs *vfs, int us)
{
    (void)vfs;
    return orig_vfs->xSleep(orig_vfs, us);
}

static int rg_time(sqlite3_vfs *vfs, double *t)
{
    (void)vfs;
    return orig_vfs->xCurrentTime(orig_vfs, t);
}

static int rg_lasterror(sqlite3_vfs *vfs, int n, char *msg)
{
    (void)vfs;
    return orig_vfs->xGetLastError ? orig_vfs->xGetLastError(orig_vfs, n, msg) : 0;
}

static int rg_time64(sqlite3_vfs *vfs, sqlite3_int64 *t)
{
    (void)vfs;
    if (orig_vfs->iVersion >= 2 && orig_vfs->xCurrentTimeInt64)
        return orig_vfs->xCurrentTimeInt64(orig_vfs, t);
    double d;
    int rc = orig_vfs->xCurrentTime(orig_vfs, &d);
    *t = (sqlite3_int64)(d * 86400000.0);
    return rc;
}

#ifdef _WIN32
__declspec(dllexport)
#else
__attribute__((visibility("default")))
#endif
int sqlite3_splice_init(sqlite3 *db, char **err, const sqlite3_api_routines *api)
{
    (void)db;
    (void)err;
    SQLITE_EXTENSION_INIT2(api);
    if (orig_vfs == NULL) {
        orig_vfs = sqlite3_vfs_find(NULL);
        if (orig_vfs == NULL)
            return SQLITE_ERROR;
        sqlite3_vfs v = {
            2, orig_vfs->szOsFile > (int)sizeof(RegionFile) ? orig_vfs->szOsFile
                                                             : (int)sizeof(RegionFile),
            orig_vfs->mxPathname, NULL, "ingero-region", NULL,
            rg_open, rg_delete, rg_access, rg_fullpath, rg_dlopen, rg_dlerror, rg_dlsym,
            rg_dlclose, rg_random, rg_sleep, rg_time, rg_lasterror, rg_time64,
            NULL, NULL, NULL,
        };
        region_vfs = v;
        int rc = sqlite3_vfs_register(&region_vfs, 0);
        if (rc != SQLITE_OK) {
            orig_vfs = NULL;
            return rc;
        }
    }
    /* The VFS must outlive the scratch connection that loaded this. */
    return SQLITE_OK_LOAD_PERMANENTLY;
}

/* ------------------------------------------------------------------ pages */

typedef struct {
    char msg[400];
    int errnum;                 /* an I/O error's errno (ENOSPC: the disk is full), or 0 */
} Err;

static int fail(Err *e, const char *fmt, long long a, long long b)
{
    snprintf(e->msg, sizeof e->msg, fmt, a, b);
    return -1;
}

static int fail_io(Err *e, const char *what, long long page)
{
    e->errnum = errno;
    snprintf(e->msg, sizeof e->msg, "%s %lld: %s", what, page, strerror(errno));
    return -1;
}

static uint32_t be32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static void put32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

static int varint(const unsigned char *p, const unsigned char *end, uint64_t *v)
{
    uint64_t x = 0;
    for (int i = 0; i < 9; i++) {
        if (p + i >= end)
            return 0;
        if (i == 8) {
            *v = x << 8 | p[i];
            return 9;
        }
        x = x << 7 | (p[i] & 0x7f);
        if (!(p[i] & 0x80)) {
            *v = x;
            return i + 1;
        }
    }
    return 0;
}

static int read_at(int fd, void *buf, size_t n, off_t ofs)
{
    size_t got = 0;
    while (got < n) {
        ssize_t k = pread(fd, (char *)buf + got, n - got, ofs + (off_t)got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        got += (size_t)k;
    }
    return 0;
}

static int write_at(int fd, const void *buf, size_t n, off_t ofs)
{
    size_t done = 0;
    while (done < n) {
        ssize_t k = pwrite(fd, (const char *)buf + done, n - done, ofs + (off_t)done);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return -1;
        done += (size_t)k;
    }
    return 0;
}

/* The header facts a move depends on, from the first 100 bytes of a database. */
typedef struct {
    uint32_t page_size, pages;
} Header;

static int header(const unsigned char *h, Header *out, Err *e, const char *what)
{
    if (memcmp(h, "SQLite format 3", 16) != 0) {
        snprintf(e->msg, sizeof e->msg, "%s is not a SQLite database", what);
        return -1;
    }
    uint32_t ps = (uint32_t)h[16] << 8 | h[17];
    out->page_size = ps == 1 ? 65536 : ps;
    out->pages = be32(h + 28);
    if (h[20] != 0 || be32(h + 24) != be32(h + 92) || out->pages == 0 || be32(h + 52) != 0) {
        snprintf(e->msg, sizeof e->msg, "%s: reserved bytes, auto-vacuum or a stale page "
                 "count in the header", what);
        return -1;
    }
    return 0;
}

/* Page pointers in b-tree page `pg` (whole page in `buf`, page number `no`), each
 * handed to `visit` with its byte offset in the page; overflow chains' first pages are
 * reported with kind 2, children with kind 1. Returns the number of pointers or -1. */
typedef int (*Visit)(void *ctx, unsigned char *slot, int kind);

static int btree_pointers(unsigned char *buf, uint32_t P, Visit visit, void *ctx, Err *e,
                          uint32_t no)
{
    unsigned char *hdr = buf, *end = buf + P;
    int type = hdr[0], interior = type == 2 || type == 5;
    if (type != 2 && type != 5 && type != 10 && type != 13)
        return fail(e, "page %lld is not a b-tree page (type %lld)", no, type);
    int ncells = hdr[3] << 8 | hdr[4], n = 0;
    unsigned char *cellptr = hdr + (interior ? 12 : 8);
    if (cellptr + 2 * ncells > end)
        return fail(e, "page %lld: %lld cells do not fit", no, ncells);
    uint32_t U = P;
    uint32_t maxlocal = type == 13 ? U - 35 : (U - 12) * 64 / 255 - 23;
    uint32_t minlocal = (U - 12) * 32 / 255 - 23;
    if (interior) {
        if (visit(ctx, hdr + 8, 1))
            return -1;
        n++;
    }
    for (int i = 0; i < ncells; i++) {
        uint32_t c = (uint32_t)cellptr[2 * i] << 8 | cellptr[2 * i + 1];
        if (c < 8 || c + 4 > P)
            return fail(e, "page %lld: cell offset %lld out of the page", no, c);
        unsigned char *p = buf + c;
        if (interior) {
            if (visit(ctx, p, 1))
                return -1;
            n++;
            p += 4;
            if (type == 5)
                continue;       /* interior table cell: child and rowid, no payload */
        }
        uint64_t payload, rowid;
        int k = varint(p, end, &payload);
        if (!k)
            return fail(e, "page %lld: cell %lld has a bad payload size", no, i);
        p += k;
        if (type == 13) {
            k = varint(p, end, &rowid);
            if (!k)
                return fail(e, "page %lld: cell %lld has a bad rowid", no, i);
            p += k;
        }
        if (payload <= maxlocal)
            continue;
        uint64_t local = minlocal + (payload - minlocal) % (U - 4);
        if (local > maxlocal)
            local = minlocal;
        if (p + local + 4 > end)
            return fail(e, "page %lld: cell %lld spills past the page", no, i);
        if (visit(ctx, p + local, 2))
            return -1;
        n++;
    }
    return n;
}

/* ------------------------------------------------------------------ scan */

typedef struct {
    int fd;
    off_t offset;
    uint32_t P, N, lock;
    unsigned char *seen;        /* one byte per page */
    uint32_t *stack;
    size_t nstack, capstack;
    uint32_t *out;              /* pages holding pointers; bit 31: an overflow page */
    size_t nout, capout;
    uint32_t visited;
    Err *e;
    uint32_t current;
} Scan;

static int push(uint32_t **a, size_t *n, size_t *cap, uint32_t v)
{
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 1024;
        uint32_t *b = realloc(*a, c * sizeof **a);
        if (!b)
            return -1;
        *a = b;
        *cap = c;
    }
    (*a)[(*n)++] = v;
    return 0;
}

static int claim(Scan *s, uint32_t pg)
{
    if (pg < 2 || pg > s->N || pg == s->lock)
        return fail(s->e, "page %lld points to page %lld, outside the region", s->current, pg);
    if (s->seen[pg])
        return fail(s->e, "page %lld is referenced twice (from page %lld)", pg, s->current);
    s->seen[pg] = 1;
    s->visited++;
    return 0;
}

static int scan_visit(void *ctx, unsigned char *slot, int kind)
{
    Scan *s = ctx;
    uint32_t pg = be32(slot);
    if (claim(s, pg))
        return -1;
    if (kind == 1)
        return push(&s->stack, &s->nstack, &s->capstack, pg) ? fail(s->e, "out of memory", 0, 0) : 0;
    /* an overflow chain: each page starts with the next one's number */
    unsigned char next[4];
    for (;;) {
        if (push(&s->out, &s->nout, &s->capout, pg | 0x80000000u))
            return fail(s->e, "out of memory", 0, 0);
        if (read_at(s->fd, next, 4, s->offset + (off_t)(pg - 1) * s->P))
            return fail(s->e, "cannot read page %lld", pg, 0);
        uint32_t nx = be32(next);
        if (nx == 0)
            return 0;
        s->current = pg;
        if (claim(s, nx))
            return -1;
        pg = nx;
    }
}

static PyObject *sp_scan(PyObject *self, PyObject *args)
{
    (void)self;
    int fd;
    long long offset;
    PyObject *roots_obj;
    if (!PyArg_ParseTuple(args, "iLO", &fd, &offset, &roots_obj))
        return NULL;
    PyObject *roots = PySequence_Fast(roots_obj, "roots must be a sequence");
    if (!roots)
        return NULL;
    Py_ssize_t nroots = PySequence_Fast_GET_SIZE(roots);
    uint32_t *root = malloc((size_t)(nroots ? nroots : 1) * sizeof *root);
    if (!root) {
        Py_DECREF(roots);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < nroots; i++) {
        unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(roots, i));
        if (PyErr_Occurred()) {
            free(root);
            Py_DECREF(roots);
            return NULL;
        }
        root[i] = (uint32_t)v;
    }
    Py_DECREF(roots);

    Err e = {{0}};
    Scan s = {0};
    s.fd = fd;
    s.offset = (off_t)offset;
    s.e = &e;
    unsigned char h[100], *buf = NULL;
    int ok = 0;
    Py_BEGIN_ALLOW_THREADS
    Header hd;
    if (read_at(fd, h, 100, s.offset)) {
        fail(&e, "cannot read the region header at offset %lld", offset, 0);
        goto done;
    }
    if (header(h, &hd, &e, "the region"))
        goto done;
    s.P = hd.page_size;
    s.N = hd.pages;
    s.lock = (uint32_t)(PENDING_BYTE / s.P + 1);
    if (be32(h + 36) != 0 || be32(h + 32) != 0) {
        fail(&e, "the region has %lld free pages", be32(h + 36), 0);
        goto done;
    }
    s.seen = calloc((size_t)s.N + 1, 1);
    buf = malloc(s.P);
    if (!s.seen || !buf) {
        fail(&e, "out of memory", 0, 0);
        goto done;
    }
    /* sqlite_schema must be page 1 alone: nothing of it moves */
    if (read_at(fd, buf, s.P, s.offset) || buf[100] != 13) {
        fail(&e, "the region's schema is more than its first page", 0, 0);
        goto done;
    }
    for (Py_ssize_t i = 0; i < nroots; i++) {
        s.current = 1;
        if (claim(&s, root[i]) || push(&s.stack, &s.nstack, &s.capstack, root[i]))
            goto done;
    }
    while (s.nstack) {
        uint32_t pg = s.stack[--s.nstack];
        s.current = pg;
        if (read_at(fd, buf, s.P, s.offset + (off_t)(pg - 1) * s.P)) {
            fail(&e, "cannot read page %lld", pg, 0);
            goto done;
        }
        int n = btree_pointers(buf, s.P, scan_visit, &s, &e, pg);
        if (n < 0)
            goto done;
        if (n > 0 && push(&s.out, &s.nout, &s.capout, pg)) {
            fail(&e, "out of memory", 0, 0);
            goto done;
        }
    }
    uint32_t expect = s.N - 1 - (s.lock <= s.N ? 1 : 0);
    if (s.visited != expect) {
        fail(&e, "the b-trees use %lld of the region's %lld pages", s.visited, expect);
        goto done;
    }
    ok = 1;
done:
    Py_END_ALLOW_THREADS
    free(root);
    free(buf);
    free(s.seen);
    free(s.stack);
    if (!ok) {
        free(s.out);
        PyErr_SetString(PyExc_ValueError, e.msg);
        return NULL;
    }
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)s.out,
                                                (Py_ssize_t)(s.nout * sizeof *s.out));
    free(s.out);
    if (!bytes)
        return NULL;
    return Py_BuildValue("(kN)", (unsigned long)s.N, bytes);
}

/* ------------------------------------------------------------------ splice */

typedef struct {
    uint32_t E, N, moved_from, moved_to;           /* moved: the page on the lock page */
    uint32_t *root_local, *root_fleet;
    Py_ssize_t nroots;
} Map;

static uint32_t map_page(const Map *m, uint32_t k)
{
    for (Py_ssize_t i = 0; i < m->nroots; i++)
        if (m->root_local[i] == k)
            return m->root_fleet[i];
    if (m->moved_from && k == m->moved_from)
        return m->moved_to;
    return m->E + k;
}

typedef struct {
    const Map *m;
    Err *e;
} Patch;

static int patch_visit(void *ctx, unsigned char *slot, int kind)
{
    (void)kind;
    Patch *p = ctx;
    uint32_t k = be32(slot);
    if (k < 2 || k > p->m->N)
        return fail(p->e, "a pointer to page %lld, outside the region of %lld pages", k,
                    p->m->N);
    put32(slot, map_page(p->m, k));
    return 0;
}

typedef struct {
    off_t offset;               /* where the region starts in the file (before any gap
                                 * is closed) */
    PyObject *pointers;         /* bytes from scan() */
    uint32_t *root_local, *root_fleet;
    Py_ssize_t nroots;
} Region;

static int move_region(int fd, off_t from, off_t to, off_t len, int *collapse, Err *e)
{
    if (from == to)
        return 0;
    if (*collapse) {
        if (fallocate(fd, FALLOC_FL_COLLAPSE_RANGE, to, from - to) == 0)
            return 0;
        if (errno != EOPNOTSUPP && errno != EINVAL && errno != ENOSYS)
            return fail_io(e, "cannot close the gap before the region at byte", from);
        *collapse = 0;          /* this filesystem cannot: copy (tmpfs, btrfs, NFS...) */
    }
    size_t chunk = 8u << 20;
    char *buf = malloc(chunk);
    if (!buf)
        return fail(e, "out of memory", 0, 0);
    for (off_t x = 0; x < len; x += (off_t)chunk) {
        size_t n = (size_t)(len - x < (off_t)chunk ? len - x : (off_t)chunk);
        if (read_at(fd, buf, n, from + x) || write_at(fd, buf, n, to + x)) {
            free(buf);
            return fail_io(e, "cannot copy the region down to byte", to + x);
        }
    }
    free(buf);
    return 0;
}

static int splice_all(int fd, Region *rg, Py_ssize_t nrg, int *collapse, uint32_t *total,
                      Err *e)
{
    unsigned char h[100];
    Header fh;
    if (read_at(fd, h, 100, 0))
        return fail(e, "cannot read the fleet header", 0, 0);
    if (header(h, &fh, e, "the fleet file"))
        return -1;
    uint32_t P = fh.page_size, E = fh.pages, lock = (uint32_t)(PENDING_BYTE / P + 1);
    uint32_t *freed = NULL;
    size_t nfreed = 0, capfreed = 0;
    unsigned char *buf = malloc(P), *seen = NULL;
    off_t shift = 0;            /* bytes collapsed so far: later regions moved down */
    int rc = -1;
    if (!buf) {
        fail(e, "out of memory", 0, 0);
        goto bad;
    }
    for (Py_ssize_t r = 0; r < nrg; r++) {
        off_t at = rg[r].offset - shift;
        if (at < (off_t)E * P) {
            fail(e, "the fleet database (%lld pages) reaches into a region at byte %lld",
                 E, (long long)at);
            goto bad;
        }
        unsigned char rh[100];
        Header hd;
        if (read_at(fd, rh, 100, at) || header(rh, &hd, e, "a region"))
            goto bad;
        if (hd.page_size != P) {
            fail(e, "a region has %lld-byte pages, the fleet %lld", hd.page_size, P);
            goto bad;
        }
        uint32_t N = hd.pages;
        if ((uint64_t)E + N + 1 >= 0xfffffff0u) {
            fail(e, "too many pages (%lld + %lld)", E, N);
            goto bad;
        }
        if (move_region(fd, at, (off_t)E * P, (off_t)N * P, collapse, e))
            goto bad;
        if (*collapse)
            shift += at - (off_t)E * P;

        Map m = {E, N, 0, 0, rg[r].root_local, rg[r].root_fleet, rg[r].nroots};
        /* the region page that would land on the lock-byte page goes to the end */
        if (lock > E + 1 && lock <= E + N) {
            uint32_t c = lock - E;
            int is_root = 0;
            for (Py_ssize_t i = 0; i < m.nroots; i++)
                is_root |= m.root_local[i] == c;
            if (!is_root) {
                m.moved_from = c;
                m.moved_to = E + N + 1;
            }
        }
        free(seen);
        seen = calloc((size_t)N + 1, 1);
        if (!seen) {
            fail(e, "out of memory", 0, 0);
            goto bad;
        }
        const uint32_t *ptrs = (const uint32_t *)PyBytes_AS_STRING(rg[r].pointers);
        size_t nptrs = (size_t)PyBytes_GET_SIZE(rg[r].pointers) / sizeof *ptrs;
        Patch pt = {&m, e};
        for (size_t i = 0; i < nptrs; i++) {
            uint32_t k = ptrs[i] & 0x7fffffffu;
            if (k < 2 || k > N) {
                fail(e, "scan listed page %lld of %lld", k, N);
                goto bad;
            }
            seen[k] = 1;
            if (read_at(fd, buf, P, (off_t)(E + k - 1) * P)) {
                fail(e, "cannot read page %lld", E + k, 0);
                goto bad;
            }
            if (ptrs[i] & 0x80000000u) {
                uint32_t nx = be32(buf);
                if (nx && patch_visit(&pt, buf, 2))
                    goto bad;
            } else if (btree_pointers(buf, P, patch_visit, &pt, e, k) < 0) {
                goto bad;
            }
            if (write_at(fd, buf, P, (off_t)(map_page(&m, k) - 1) * P)) {
                fail_io(e, "cannot write page", map_page(&m, k));
                goto bad;
            }
        }
        /* pages that move but hold no pointer: leaf roots, the one on the lock page */
        for (Py_ssize_t i = 0; i <= m.nroots; i++) {
            uint32_t k = i < m.nroots ? m.root_local[i] : m.moved_from;
            if (!k || k > N || seen[k])
                continue;
            if (read_at(fd, buf, P, (off_t)(E + k - 1) * P) ||
                    write_at(fd, buf, P, (off_t)(map_page(&m, k) - 1) * P)) {
                fail_io(e, "cannot move page", E + k);
                goto bad;
            }
        }
        /* left unused: the region's page 1, where the roots were, its own lock page */
        uint32_t unused[3 + 64];
        size_t nunused = 0;
        unused[nunused++] = E + 1;
        for (Py_ssize_t i = 0; i < m.nroots && nunused < 66; i++)
            unused[nunused++] = E + m.root_local[i];
        if (lock <= N)
            unused[nunused++] = E + lock;
        for (size_t i = 0; i < nunused; i++)
            if (unused[i] != lock && push(&freed, &nfreed, &capfreed, unused[i])) {
                fail(e, "out of memory", 0, 0);
                goto bad;
            }
        E += N + (m.moved_from ? 1 : 0);
    }
    /* the freelist: new trunk pages, each listing up to P/4 - 8 leaves (the limit
     * every SQLite version accepts), in front of the fleet's own trunks */
    uint32_t head = be32(h + 32), count = be32(h + 36) + (uint32_t)nfreed;
    size_t per = P / 4 - 8;
    for (size_t i = 0; i < nfreed;) {
        uint32_t trunk = freed[i++];
        size_t n = nfreed - i < per ? nfreed - i : per;
        memset(buf, 0, P);
        put32(buf, head);
        put32(buf + 4, (uint32_t)n);
        for (size_t j = 0; j < n; j++)
            put32(buf + 8 + 4 * j, freed[i + j]);
        i += n;
        if (write_at(fd, buf, P, (off_t)(trunk - 1) * P)) {
            fail_io(e, "cannot write freelist page", trunk);
            goto bad;
        }
        head = trunk;
    }
    uint32_t counter = be32(h + 24) + 1;
    put32(h + 24, counter);
    put32(h + 92, counter);
    put32(h + 28, E);
    put32(h + 32, nfreed ? head : be32(h + 32));
    put32(h + 36, count);
    if (write_at(fd, h, 100, 0) || ftruncate(fd, (off_t)E * P)) {
        fail_io(e, "cannot write the fleet header and size, page count", E);
        goto bad;
    }
    *total = E;
    rc = 0;
bad:
    free(buf);
    free(seen);
    free(freed);
    return rc;
}

static PyObject *sp_splice(PyObject *self, PyObject *args)
{
    (void)self;
    int fd, collapse;
    PyObject *regions_obj;
    if (!PyArg_ParseTuple(args, "iOp", &fd, &regions_obj, &collapse))
        return NULL;
    PyObject *regions = PySequence_Fast(regions_obj, "regions must be a sequence");
    if (!regions)
        return NULL;
    Py_ssize_t nrg = PySequence_Fast_GET_SIZE(regions);
    Region *rg = calloc((size_t)(nrg ? nrg : 1), sizeof *rg);
    PyObject *out = NULL;
    if (!rg) {
        Py_DECREF(regions);
        return PyErr_NoMemory();
    }
    long long prev = -1;
    for (Py_ssize_t r = 0; r < nrg; r++) {
        long long offset;
        PyObject *roots;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(regions, r), "LSO", &offset,
                              &rg[r].pointers, &roots))
            goto done;
        if (offset <= prev) {
            PyErr_SetString(PyExc_ValueError, "regions must be in increasing offset order");
            goto done;
        }
        prev = offset;
        rg[r].offset = (off_t)offset;
        PyObject *seq = PySequence_Fast(roots, "roots must be (local, fleet) pairs");
        if (!seq)
            goto done;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        rg[r].nroots = n;
        rg[r].root_local = calloc((size_t)(n ? n : 1), sizeof(uint32_t));
        rg[r].root_fleet = calloc((size_t)(n ? n : 1), sizeof(uint32_t));
        if (!rg[r].root_local || !rg[r].root_fleet || n > 64) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "at most 64 roots per region");
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            unsigned long a, b;
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "kk", &a, &b)) {
                Py_DECREF(seq);
                goto done;
            }
            rg[r].root_local[i] = (uint32_t)a;
            rg[r].root_fleet[i] = (uint32_t)b;
        }
        Py_DECREF(seq);
    }
    Err e = {{0}};
    uint32_t total = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = splice_all(fd, rg, nrg, &collapse, &total, &e);
    Py_END_ALLOW_THREADS
    if (rc && !e.errnum) {
        PyErr_SetString(PyExc_OSError, e.msg);
    } else if (rc) {            /* OSError(errno, message): ENOSPC reads "disk full" */
        PyObject *exc = PyObject_CallFunction(PyExc_OSError, "is", e.errnum, e.msg);
        if (exc) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
    }
    else
        out = Py_BuildValue("(ks)", (unsigned long)total, collapse ? "collapse" : "copy");
done:
    for (Py_ssize_t r = 0; r < nrg; r++) {
        free(rg[r].root_local);
        free(rg[r].root_fleet);
    }
    free(rg);
    Py_DECREF(regions);
    return out;
}

static PyObject *sp_ready(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyBool_FromLong(orig_vfs != NULL);
}

static PyMethodDef methods[] = {
    {"scan", sp_scan, METH_VARARGS, "(fd, offset, root pages) of a region -> (pages, "
     "the pages holding page numbers as uint32s, bit 31 set for overflow pages); "
     "ValueError when the region is not one splice() can move."},
    {"splice", sp_splice, METH_VARARGS, "(fd, [(offset, scan bytes, [(root, fleet "
     "root)...])...], collapse) -> (fleet page count, 'collapse' or 'copy'); OSError "
     "on failure. The fleet file must be closed by SQLite."},
    {"ready", sp_ready, METH_NOARGS, "True once the VFS is registered in apsw's SQLite."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_splice",
    "Tables built beside the merge moved into fleet.db by their pages.", -1, methods,
};

PyMODINIT_FUNC PyInit__splice(void)
{
    return PyModule_Create(&module);
}
