/* ingero-export's accelerator: the per-event loops of the slice sections in C.
 *
 * One shared object, two roles:
 *  - a CPython extension module (_fastslices) the exporter calls;
 *  - a SQLite loadable extension (entry point sqlite3_fastslices_init), loaded once into
 *    a scratch apsw connection only to receive the routines table of apsw's own SQLite.
 * The module then steps statements on the exporter's apsw connection through that table
 * (its sqlite3* comes from Connection.sqlite3_pointer()): the same SQLite library, so
 * printf and json_quote called from here give exactly the bytes the SQL of the Python
 * path gives. Nothing links against another libsqlite3; only the headers are needed.
 *
 * The Python path in streams.py is the reference: each function here mirrors one of
 * its loops (lane allocator, prefixes, 8192-event chunks) and tests compare the bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sqlite3ext.h>
#include <stdint.h>
#include <string.h>

static const sqlite3_api_routines *sqlite3_api = NULL;

__attribute__((visibility("default")))
int sqlite3_fastslices_init(sqlite3 *db, char **err, const sqlite3_api_routines *api)
{
    (void)db;
    (void)err;
    sqlite3_api = api;
    return SQLITE_OK;
}

#define CHUNK_EVENTS 8192

/* ------------------------------------------------------------------ byte buffer */

typedef struct {
    char *p;
    size_t len, cap;
} Buf;

static int buf_grow(Buf *b, size_t need)
{
    if (b->len + need <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->len + need)
        cap *= 2;
    char *p = PyMem_Realloc(b->p, cap);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static inline int buf_add(Buf *b, const char *s, size_t n)
{
    if (buf_grow(b, n))
        return -1;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    return 0;
}

#define BUF_LIT(b, s) buf_add((b), (s), sizeof(s) - 1)

static inline int buf_i64(Buf *b, sqlite3_int64 v)
{
    char tmp[24];
    char *e = tmp + sizeof tmp, *q = e;
    sqlite3_uint64 u = v < 0 ? (sqlite3_uint64)0 - (sqlite3_uint64)v : (sqlite3_uint64)v;
    do {
        *--q = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        *--q = '-';
    return buf_add(b, q, (size_t)(e - q));
}

/* ------------------------------------------------------------------ lane allocator */

/* Slice bounds as Python compares them: ints and floats exactly (a long double holds
 * every int64 and every double), NaN never ordered. */
typedef long double Num;

typedef struct {
    Num *v;
    Py_ssize_t n, cap;
} Stack;

typedef struct {
    Stack *s;
    Py_ssize_t n, cap;   /* lanes in use, allocated */
} Lanes;

static int stack_push(Stack *s, Num x)
{
    if (s->n == s->cap) {
        Py_ssize_t cap = s->cap ? s->cap * 2 : 8;
        Num *v = PyMem_Realloc(s->v, cap * sizeof *v);
        if (!v) {
            PyErr_NoMemory();
            return -1;
        }
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = x;
    return 0;
}

static int lanes_new(Lanes *l)
{
    if (l->n == l->cap) {
        Py_ssize_t cap = l->cap ? l->cap * 2 : 4;
        Stack *s = PyMem_Realloc(l->s, cap * sizeof *s);
        if (!s) {
            PyErr_NoMemory();
            return -1;
        }
        memset(s + l->cap, 0, (cap - l->cap) * sizeof *s);
        l->s = s;
        l->cap = cap;
    }
    l->s[l->n++].n = 0;
    return 0;
}

static void lanes_free(Lanes *l)
{
    for (Py_ssize_t i = 0; i < l->cap; i++)
        PyMem_Free(l->s[i].v);
    PyMem_Free(l->s);
}

/* tracks.place_lane: the first lane where [start, end) nests or follows. */
static Py_ssize_t lanes_place(Lanes *l, Num start, Num end)
{
    for (Py_ssize_t i = 0; i < l->n; i++) {
        Stack *s = &l->s[i];
        while (s->n && s->v[s->n - 1] <= start)
            s->n--;
        if (!s->n || end <= s->v[s->n - 1])
            return stack_push(s, end) ? -1 : i;
    }
    if (lanes_new(l) || stack_push(&l->s[l->n - 1], end))
        return -1;
    return l->n - 1;
}

/* Track state of one slice stream, as in the Python loops. */
typedef struct {
    Lanes lanes;
    int open;                /* lanes is not None */
    Num max_end;
} Track;

static void track_reset(Track *t, Num start)
{
    t->open = 0;
    t->max_end = start;
}

/* The lane of [start, end): 0 on the fast path, -1 on error. */
static Py_ssize_t track_lane(Track *t, Num start, Num end)
{
    if (start >= t->max_end) {
        t->open = 0;
        t->max_end = end;
        return 0;
    }
    if (!t->open) {
        t->lanes.n = 0;
        if (lanes_new(&t->lanes) || stack_push(&t->lanes.s[0], t->max_end))
            return -1;
        t->open = 1;
    }
    Py_ssize_t lane = lanes_place(&t->lanes, start, end);
    if (end > t->max_end)
        t->max_end = end;
    return lane;
}

/* ------------------------------------------------------------------ statements */

static PyObject *Unsupported;   /* a value the accelerator does not handle */

static int sql_error(sqlite3 *db)
{
    PyErr_Format(PyExc_RuntimeError, "%s", sqlite3_errmsg(db));
    return -1;
}

static sqlite3_stmt *prepare(sqlite3 *db, PyObject *sql)
{
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(sql, &n);
    if (!s)
        return NULL;
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(db, s, (int)n, &st, NULL) != SQLITE_OK) {
        sql_error(db);
        sqlite3_finalize(st);
        return NULL;
    }
    return st;
}

/* Binds :name parameters from a dict of int/None (as apsw would). */
static int bind_params(sqlite3 *db, sqlite3_stmt *st, PyObject *params)
{
    int n = sqlite3_bind_parameter_count(st);
    for (int i = 1; i <= n; i++) {
        const char *name = sqlite3_bind_parameter_name(st, i);
        if (!name || (name[0] != ':' && name[0] != '$' && name[0] != '@')) {
            PyErr_SetString(PyExc_ValueError, "only named parameters");
            return -1;
        }
        PyObject *v = PyDict_GetItemString(params, name + 1);
        int rc;
        if (!v || v == Py_None)
            rc = sqlite3_bind_null(st, i);
        else if (PyLong_Check(v)) {
            long long x = PyLong_AsLongLong(v);
            if (x == -1 && PyErr_Occurred())
                return -1;
            rc = sqlite3_bind_int64(st, i, x);
        } else {
            PyErr_Format(PyExc_TypeError, "parameter %s: int or None", name);
            return -1;
        }
        if (rc != SQLITE_OK)
            return sql_error(db);
    }
    return 0;
}

/* A column as apsw gives it to Python. */
static PyObject *column_object(sqlite3_stmt *st, int i)
{
    switch (sqlite3_column_type(st, i)) {
    case SQLITE_INTEGER:
        return PyLong_FromLongLong(sqlite3_column_int64(st, i));
    case SQLITE_FLOAT:
        return PyFloat_FromDouble(sqlite3_column_double(st, i));
    case SQLITE_TEXT: {
        const char *t = (const char *)sqlite3_column_text(st, i);
        return PyUnicode_DecodeUTF8(t, sqlite3_column_bytes(st, i), NULL);
    }
    case SQLITE_BLOB:
        return PyBytes_FromStringAndSize(sqlite3_column_blob(st, i), sqlite3_column_bytes(st, i));
    default:
        Py_RETURN_NONE;
    }
}

/* Text that apsw would fail to decode fails here the same way. */
static int check_utf8(const char *t, int n)
{
    for (int i = 0; i < n; i++) {
        if ((unsigned char)t[i] >= 0x80) {
            PyObject *u = PyUnicode_DecodeUTF8(t, n, NULL);
            if (!u)
                return -1;
            Py_DECREF(u);
            return 0;
        }
    }
    return 0;
}

/* A slice bound: an integer or a float; -1 with Unsupported set for anything else (the
 * Python path would compare text or None with numbers: the caller falls back to it). */
static int column_num(sqlite3_stmt *st, int i, Num *out)
{
    switch (sqlite3_column_type(st, i)) {
    case SQLITE_INTEGER:
        *out = (Num)sqlite3_column_int64(st, i);
        return 0;
    case SQLITE_FLOAT:
        *out = (Num)sqlite3_column_double(st, i);
        return 0;
    default:
        PyErr_Format(Unsupported, "column %d of a row is not a number", i);
        return -1;
    }
}

/* The chunk being built: events joined by ",\n", with ",\n" in front when it does not
 * start the section (as output.Sink.extend writes it). */
typedef struct {
    Buf buf;
    Py_ssize_t n;
    int first;
    PyObject *emit;
    Py_ssize_t total;
} Chunks;

static int chunk_begin_event(Chunks *c)
{
    if (c->n || !c->first)
        return BUF_LIT(&c->buf, ",\n");
    return 0;
}

/* Hand the buffered events (if any) to the Python sink and start a new chunk. */
static int chunk_finish(Chunks *c)
{
    if (!c->n)
        return 0;
    PyObject *r = PyObject_CallFunction(c->emit, "y#n", c->buf.p, (Py_ssize_t)c->buf.len, c->n);
    if (!r)
        return -1;
    Py_DECREF(r);
    c->total += c->n;
    c->first = 0;
    c->n = 0;
    c->buf.len = 0;
    return 0;
}

static int chunk_end_event(Chunks *c)
{
    if (++c->n < CHUNK_EVENTS)
        return 0;
    return chunk_finish(c);
}

static int add_prefix(Buf *b, long long pid, long long tid)
{
    if (BUF_LIT(b, "{\"ph\":\"X\",\"pid\":") || buf_i64(b, pid) || BUF_LIT(b, ",\"tid\":") ||
        buf_i64(b, tid) || BUF_LIT(b, ","))
        return -1;
    return 0;
}

static int lane_tid(PyObject *lane_cb, long long pid, long long base, Py_ssize_t lane,
                    long long *tid)
{
    PyObject *r = PyObject_CallFunction(lane_cb, "LLn", pid, base, lane);
    if (!r)
        return -1;
    *tid = PyLong_AsLongLong(r);
    Py_DECREF(r);
    return (*tid == -1 && PyErr_Occurred()) ? -1 : 0;
}

static sqlite3 *db_of(PyObject *ptr)
{
    if (!sqlite3_api) {
        PyErr_SetString(PyExc_RuntimeError, "_fastslices: SQLite routines not loaded");
        return NULL;
    }
    void *p = PyLong_AsVoidPtr(ptr);
    if (!p && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "null sqlite3 pointer");
    return p;
}

/* ------------------------------------------------------------------ tracks */

/* Key column as last seen: compared the way Python compares the objects. */
typedef struct {
    int type;
    sqlite3_int64 i;
    Buf text;
    PyObject *obj;
} KeyCol;

static int key_same(KeyCol *k, sqlite3_stmt *st, int col, int *same)
{
    int t = sqlite3_column_type(st, col);
    if (t == k->type) {
        if (t == SQLITE_NULL) {
            *same = 1;
            return 0;
        }
        if (t == SQLITE_INTEGER) {
            *same = sqlite3_column_int64(st, col) == k->i;
            return 0;
        }
        if (t == SQLITE_TEXT) {
            int n = sqlite3_column_bytes(st, col);
            const void *p = sqlite3_column_text(st, col);
            *same = (size_t)n == k->text.len && memcmp(p, k->text.p, n) == 0;
            return 0;
        }
    }
    PyObject *o = column_object(st, col);
    if (!o)
        return -1;
    int ne = PyObject_RichCompareBool(o, k->obj, Py_NE);
    Py_DECREF(o);
    if (ne < 0)
        return -1;
    *same = !ne;
    return 0;
}

static int key_set(KeyCol *k, sqlite3_stmt *st, int col)
{
    PyObject *o = column_object(st, col);
    if (!o)
        return -1;
    Py_XSETREF(k->obj, o);
    k->type = sqlite3_column_type(st, col);
    k->text.len = 0;
    if (k->type == SQLITE_INTEGER)
        k->i = sqlite3_column_int64(st, col);
    else if (k->type == SQLITE_TEXT)
        return buf_add(&k->text, (const char *)sqlite3_column_text(st, col),
                       sqlite3_column_bytes(st, col));
    return 0;
}

/* ------------------------------------------------------- events built here */

/* Values outside what the fast formatting handles are formatted by the same SQL
 * expressions the Python path uses, on the same connection: the bytes cannot differ. */
typedef struct {
    sqlite3 *db;
    sqlite3_stmt *quote;    /* json_quote(?1) */
    sqlite3_stmt *ts;       /* printf('%.3f', (?1 - ?2) / 1000.0) */
    sqlite3_stmt *dur;      /* printf('%.3f', (?1) / 1000.0) */
} Slow;

static int slow_text(Slow *sl, sqlite3_stmt **stp, const char *sql, sqlite3_value *a,
                     sqlite3_int64 b, int nb, Buf *out)
{
    if (!*stp && sqlite3_prepare_v2(sl->db, sql, -1, stp, NULL) != SQLITE_OK)
        return sql_error(sl->db);
    sqlite3_stmt *st = *stp;
    if (sqlite3_bind_value(st, 1, a) != SQLITE_OK ||
        (nb && sqlite3_bind_int64(st, 2, b) != SQLITE_OK))
        return sql_error(sl->db);
    int rc = sqlite3_step(st);
    if (rc != SQLITE_ROW) {
        sqlite3_reset(st);
        return sql_error(sl->db);
    }
    const char *t = (const char *)sqlite3_column_text(st, 0);
    int n = sqlite3_column_bytes(st, 0);
    int bad = check_utf8(t, n) || buf_add(out, t, n);
    sqlite3_reset(st);
    sqlite3_clear_bindings(st);
    return bad ? -1 : 0;
}

/* ns as microseconds with 3 decimals, exactly as SQLite's printf('%.3f', ns / 1000.0):
 * below 1e15 ns the double is within far less than half a thousandth of the decimal
 * value and SQLite keeps 16 significant digits, so integer arithmetic gives the same
 * digits. Anything larger goes through SQLite itself. */
#define FAST_US_LIMIT 1000000000000000LL

static int us3(Buf *b, sqlite3_int64 v)
{
    char tmp[32];
    char *e = tmp + sizeof tmp, *q = e;
    sqlite3_uint64 u = v < 0 ? (sqlite3_uint64)0 - (sqlite3_uint64)v : (sqlite3_uint64)v;
    unsigned frac = (unsigned)(u % 1000);
    u /= 1000;
    *--q = (char)('0' + frac % 10);
    *--q = (char)('0' + frac / 10 % 10);
    *--q = (char)('0' + frac / 100);
    *--q = '.';
    do {
        *--q = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        *--q = '-';
    return buf_add(b, q, (size_t)(e - q));
}

/* json_quote(column): plain printable ASCII and integers here, the rest by SQLite. */
static int quote_col(Slow *sl, sqlite3_stmt *st, int col, Buf *b)
{
    int t = sqlite3_column_type(st, col);
    if (t == SQLITE_INTEGER)
        return buf_i64(b, sqlite3_column_int64(st, col));
    if (t == SQLITE_NULL)
        return BUF_LIT(b, "null");
    if (t == SQLITE_TEXT) {
        const unsigned char *p = sqlite3_column_text(st, col);
        int n = sqlite3_column_bytes(st, col);
        int plain = 1;
        for (int i = 0; i < n; i++) {
            unsigned char ch = p[i];
            if (ch < 0x20 || ch >= 0x80 || ch == '"' || ch == '\\') {
                plain = 0;
                break;
            }
        }
        if (plain) {
            if (buf_grow(b, (size_t)n + 2))
                return -1;
            b->p[b->len++] = '"';
            memcpy(b->p + b->len, p, n);
            b->len += n;
            b->p[b->len++] = '"';
            return 0;
        }
    }
    return slow_text(sl, &sl->quote, "SELECT json_quote(?1)", sqlite3_column_value(st, col),
                     0, 0, b);
}

/* One layout of event text: its category and args (name, kind, column). */
typedef struct {
    Buf cat;                /* "<cat>" as bytes */
    Py_ssize_t nargs;
    Buf *keys;              /* ,"key": (the comma dropped for the first arg) */
    char *kinds;            /* 'q': json_quote(col); 'b': integer as true/false */
    int first_col;
} Layout;

static void layouts_free(Layout *ls, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; ls && i < n; i++) {
        PyMem_Free(ls[i].cat.p);
        for (Py_ssize_t k = 0; ls[i].keys && k < ls[i].nargs; k++)
            PyMem_Free(ls[i].keys[k].p);
        PyMem_Free(ls[i].keys);
        PyMem_Free(ls[i].kinds);
    }
    PyMem_Free(ls);
}

/* layouts: a tuple of (cat, (key, ...), kinds, first arg column). */
static Layout *layouts_parse(PyObject *spec, Py_ssize_t *n_out)
{
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) < 1) {
        PyErr_SetString(PyExc_TypeError, "layouts: a non-empty tuple");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(spec);
    Layout *ls = PyMem_Calloc(n, sizeof *ls);
    if (!ls)
        return (Layout *)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *cat, *kinds;
        Py_ssize_t cat_n, kinds_n;
        PyObject *keys;
        Layout *l = &ls[i];
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(spec, i), "s#O!s#i", &cat, &cat_n, &PyTuple_Type,
                              &keys, &kinds, &kinds_n, &l->first_col))
            goto fail;
        l->nargs = PyTuple_GET_SIZE(keys);
        if (kinds_n != l->nargs) {
            PyErr_SetString(PyExc_ValueError, "layouts: one kind per key");
            goto fail;
        }
        l->keys = PyMem_Calloc(l->nargs ? l->nargs : 1, sizeof *l->keys);
        l->kinds = PyMem_Malloc(kinds_n + 1);
        if (!l->keys || !l->kinds) {
            PyErr_NoMemory();
            goto fail;
        }
        memcpy(l->kinds, kinds, kinds_n + 1);
        if (BUF_LIT(&l->cat, "\"") || buf_add(&l->cat, cat, cat_n) || BUF_LIT(&l->cat, "\""))
            goto fail;
        for (Py_ssize_t k = 0; k < l->nargs; k++) {
            Py_ssize_t kn;
            const char *key = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(keys, k), &kn);
            if (!key || BUF_LIT(&l->keys[k], ",\"") || buf_add(&l->keys[k], key, kn) ||
                BUF_LIT(&l->keys[k], "\":"))
                goto fail;
        }
    }
    *n_out = n;
    return ls;
fail:
    layouts_free(ls, n);
    return NULL;
}

/* ts (column col) as the Python path's SQL formats it: printf('%.3f', (ts - :origin) /
 * 1000.0). */
static int ts_text(Slow *sl, sqlite3_stmt *st, int col, sqlite3_int64 origin, Buf *b)
{
    sqlite3_int64 rel;
    if (sqlite3_column_type(st, col) == SQLITE_INTEGER &&
        !__builtin_sub_overflow(sqlite3_column_int64(st, col), origin, &rel) &&
        rel < FAST_US_LIMIT && rel > -FAST_US_LIMIT)
        return us3(b, rel);
    return slow_text(sl, &sl->ts, "SELECT printf('%.3f', (?1 - ?2) / 1000.0)",
                     sqlite3_column_value(st, col), origin, 1, b);
}

/* "ts":…(,"dur":… | ,"s":"t"),"name":…,"cat":…,"args":{…}} after the prefix, as the
 * Python path's SQL (_head and _args in streams.py) writes it. */
static int event_text(Slow *sl, sqlite3_stmt *st, Buf *b, int slice, sqlite3_int64 origin,
                      Layout *ls, Py_ssize_t nl)
{
    sqlite3_int64 dur;
    if (BUF_LIT(b, "\"ts\":") || ts_text(sl, st, 5, origin, b))
        return -1;
    if (slice) {
        if (BUF_LIT(b, ",\"dur\":"))
            return -1;
        if (sqlite3_column_type(st, 6) == SQLITE_INTEGER &&
            (dur = sqlite3_column_int64(st, 6)) < FAST_US_LIMIT && dur > -FAST_US_LIMIT) {
            if (us3(b, dur))
                return -1;
        } else if (slow_text(sl, &sl->dur, "SELECT printf('%.3f', (?1) / 1000.0)",
                             sqlite3_column_value(st, 6), 0, 0, b))
            return -1;
    } else if (BUF_LIT(b, ",\"s\":\"t\""))
        return -1;
    Layout *l = ls;
    if (nl > 1) {
        sqlite3_int64 which = sqlite3_column_int64(st, 8);
        if (sqlite3_column_type(st, 8) != SQLITE_INTEGER || which < 0 || which >= nl) {
            PyErr_SetString(PyExc_ValueError, "bad layout column");
            return -1;
        }
        l = &ls[which];
    }
    if (BUF_LIT(b, ",\"name\":") || quote_col(sl, st, 7, b) || BUF_LIT(b, ",\"cat\":") ||
        buf_add(b, l->cat.p, l->cat.len) || BUF_LIT(b, ",\"args\":{"))
        return -1;
    int any = 0;
    for (Py_ssize_t k = 0; k < l->nargs; k++) {
        int col = l->first_col + (int)k;
        int t = sqlite3_column_type(st, col);
        if (t == SQLITE_NULL)
            continue;
        const Buf *key = &l->keys[k];
        if (buf_add(b, key->p + (any ? 0 : 1), key->len - (any ? 0 : 1)))
            return -1;
        any = 1;
        if (l->kinds[k] == 'b') {
            if (t != SQLITE_INTEGER) {
                PyErr_SetString(PyExc_ValueError, "bool arg: an integer column");
                return -1;
            }
            if (sqlite3_column_int64(st, col) ? BUF_LIT(b, "true") : BUF_LIT(b, "false"))
                return -1;
        } else if (quote_col(sl, st, col, b))
            return -1;
    }
    return BUF_LIT(b, "}}");
}

/* events(db, sql, params, emit, first, ph, origin, layouts, resolve, lane, overflowed)
 *   -> events
 *
 * Rows: (k0, k1, k2, start, end, ts, dur, name, layout, args...) ordered by track
 * (k0, k1, k2) and start. resolve(k0, k1, k2) -> (pid, tid) on each new track.
 * ph "X": slices placed by the lane allocator of _Exporter._slices (lane(pid, tid, n)
 * gives overflow lane n's tid; overflowed, a dict or None, gets
 * (k0, k1, k2, start, end) -> tid for those); ph "i": thread-scoped instants (start,
 * end and dur unused). The layout column picks one of several layouts (when more than
 * one). emit(chunk, n) receives the events in chunks of 8192. With emit2, rows whose dur
 * is NULL are thread instants of their track instead, a second stream to emit2 (CUDA:
 * slices and entry-only calls from one pass over the index). With sql2, a second
 * statement with the same columns, ordered the same way, is merged in row by row (NCCL:
 * the collectives in their index order and the few communicator events, instead of
 * SQLite sorting every wide row of their UNION ALL).
 */
/* ORDER BY's order of two values (SQLite's: NULL, numbers, text, blob; BINARY text). */
static int value_cmp(sqlite3_stmt *a, sqlite3_stmt *b, int col)
{
    int ta = sqlite3_column_type(a, col), tb = sqlite3_column_type(b, col);
    int ra = ta == SQLITE_NULL ? 0 : ta == SQLITE_TEXT ? 2 : ta == SQLITE_BLOB ? 3 : 1;
    int rb = tb == SQLITE_NULL ? 0 : tb == SQLITE_TEXT ? 2 : tb == SQLITE_BLOB ? 3 : 1;
    if (ra != rb)
        return ra < rb ? -1 : 1;
    if (ra == 0)
        return 0;
    if (ra == 1) {
        if (ta == SQLITE_INTEGER && tb == SQLITE_INTEGER) {
            sqlite3_int64 x = sqlite3_column_int64(a, col), y = sqlite3_column_int64(b, col);
            return x < y ? -1 : x > y;
        }
        Num x = ta == SQLITE_INTEGER ? (Num)sqlite3_column_int64(a, col)
                                     : (Num)sqlite3_column_double(a, col);
        Num y = tb == SQLITE_INTEGER ? (Num)sqlite3_column_int64(b, col)
                                     : (Num)sqlite3_column_double(b, col);
        return x < y ? -1 : x > y;
    }
    const void *pa = ra == 2 ? (const void *)sqlite3_column_text(a, col)
                             : sqlite3_column_blob(a, col);
    int na = sqlite3_column_bytes(a, col);
    const void *pb = ra == 2 ? (const void *)sqlite3_column_text(b, col)
                             : sqlite3_column_blob(b, col);
    int nb = sqlite3_column_bytes(b, col);
    int c = memcmp(pa, pb, (size_t)(na < nb ? na : nb));
    return c ? c : (na < nb ? -1 : na > nb);
}

/* 1: a row, 0: done, -1: error set. */
static int step_row(sqlite3 *db, sqlite3_stmt *st)
{
    int rc = sqlite3_step(st);
    if (rc == SQLITE_ROW)
        return 1;
    if (rc == SQLITE_DONE)
        return 0;
    return sql_error(db);
}

static PyObject *fs_events(PyObject *self, PyObject *args)
{
    PyObject *ptr, *sql, *params, *emit, *resolve, *lane_cb, *overflowed, *spec;
    PyObject *emit2 = Py_None, *sql2 = Py_None;
    int first;
    const char *ph;
    long long origin;
    if (!PyArg_ParseTuple(args, "OUO!OpsLOOOO|OO", &ptr, &sql, &PyDict_Type, &params, &emit,
                          &first, &ph, &origin, &spec, &resolve, &lane_cb, &overflowed,
                          &emit2, &sql2))
        return NULL;
    if (sql2 != Py_None && !PyUnicode_Check(sql2)) {
        PyErr_SetString(PyExc_TypeError, "sql2: str or None");
        return NULL;
    }
    int slice = ph[0] == 'X';
    if (!slice && ph[0] != 'i') {
        PyErr_SetString(PyExc_ValueError, "ph: X or i");
        return NULL;
    }
    sqlite3 *db = db_of(ptr);
    if (!db)
        return NULL;
    Py_ssize_t nl = 0;
    Layout *ls = layouts_parse(spec, &nl);
    if (!ls)
        return NULL;
    sqlite3_stmt *sa = prepare(db, sql), *sb = NULL;
    if (!sa || (sql2 != Py_None && !(sb = prepare(db, sql2)))) {
        sqlite3_finalize(sa);
        layouts_free(ls, nl);
        return NULL;
    }
    sqlite3_stmt *st = NULL;     /* the statement whose row is handled */
    int ha = 0, hb = 0;          /* each has a row */
    PyObject *result = NULL;
    Slow sl = {db, NULL, NULL, NULL};
    Chunks c = {{0}, 0, first, emit, 0};
    Chunks c2 = {{0}, 0, 1, emit2, 0};
    int reset = 0;
    Buf pre_i = {0};
    Track tr;
    memset(&tr, 0, sizeof tr);
    KeyCol key[3];
    memset(key, 0, sizeof key);
    for (int i = 0; i < 3; i++) {
        key[i].type = SQLITE_NULL;
        key[i].obj = Py_None;
        Py_INCREF(Py_None);
    }
    long long pid = 0, base = 0;
    long long *lane_tids = NULL;    /* overflow lane -> tid on the current track */
    Py_ssize_t nlane = 0;
    Buf pre = {0};
    if (bind_params(db, sa, params) || (sb && bind_params(db, sb, params)))
        goto done;
    if ((ha = step_row(db, sa)) < 0 || (sb && (hb = step_row(db, sb)) < 0))
        goto done;
    for (;;) {
        /* With sql2, two streams ordered by (k0, k1, k2, start) merged into one: at
         * equal keys sql's row first (the Python path's UNION ALL sorts by a source
         * column after them). */
        if (st == sa ? (ha = step_row(db, sa)) < 0 : st && (hb = step_row(db, sb)) < 0)
            goto done;
        if (!ha && !hb)
            break;
        if (ha && hb) {
            int c = 0;
            for (int i = 0; i < 4 && !c; i++)
                c = value_cmp(sa, sb, i);
            st = c <= 0 ? sa : sb;
        } else
            st = ha ? sa : sb;
        int same = 1, s;
        for (int i = 2; i >= 0 && same; i--) {    /* k2, k1, k0: as Python tests */
            if (key_same(&key[i], st, i, &s))
                goto done;
            same = s;
        }
        if (!same) {
            for (int i = 0; i < 3; i++)
                if (key_set(&key[i], st, i))
                    goto done;
            reset = 1;
            if (nlane)
                memset(lane_tids, 0, nlane * sizeof *lane_tids);
            PyObject *r = PyObject_CallFunctionObjArgs(resolve, key[0].obj, key[1].obj,
                                                       key[2].obj, NULL);
            if (!r)
                goto done;
            /* ints only: the Python path would print any other object as it is */
            int ok = PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2 &&
                     PyLong_CheckExact(PyTuple_GET_ITEM(r, 0)) &&
                     PyLong_CheckExact(PyTuple_GET_ITEM(r, 1));
            if (!ok)
                PyErr_SetString(Unsupported, "a track id that is not an integer");
            else
                ok = PyArg_ParseTuple(r, "LL", &pid, &base);
            Py_DECREF(r);
            if (!ok)
                goto done;
            pre.len = 0;
            if (BUF_LIT(&pre, "{\"ph\":\"") || buf_add(&pre, ph, 1) ||
                BUF_LIT(&pre, "\",\"pid\":") || buf_i64(&pre, pid) ||
                BUF_LIT(&pre, ",\"tid\":") || buf_i64(&pre, base) || BUF_LIT(&pre, ","))
                goto done;
            pre_i.len = 0;
            if (BUF_LIT(&pre_i, "{\"ph\":\"i\",\"pid\":") || buf_i64(&pre_i, pid) ||
                BUF_LIT(&pre_i, ",\"tid\":") || buf_i64(&pre_i, base) || BUF_LIT(&pre_i, ","))
                goto done;
        }
        if (emit2 != Py_None && sqlite3_column_type(st, 6) == SQLITE_NULL) {
            /* an instant of the same track, for the other stream */
            if (chunk_begin_event(&c2) || buf_add(&c2.buf, pre_i.p, pre_i.len) ||
                event_text(&sl, st, &c2.buf, 0, origin, ls, nl) || chunk_end_event(&c2))
                goto done;
            continue;
        }
        Num start = 0, end = 0;
        if (slice && (column_num(st, 3, &start) || column_num(st, 4, &end)))
            goto done;
        if (reset) {        /* the track's first slice */
            track_reset(&tr, start);
            reset = 0;
        }
        Py_ssize_t lane = slice ? track_lane(&tr, start, end) : 0;
        if (lane < 0 || chunk_begin_event(&c))
            goto done;
        if (lane == 0) {
            if (buf_add(&c.buf, pre.p, pre.len))
                goto done;
        } else {
            /* lane(pid, base, n) answers the same for the same track and lane (it
             * allocates on the first call): kept per lane until the track changes */
            long long tid;
            if (lane < nlane && lane_tids[lane])
                tid = lane_tids[lane];
            else {
                if (lane_tid(lane_cb, pid, base, lane, &tid))
                    goto done;
                if (lane >= nlane) {
                    Py_ssize_t n = lane * 2 + 8;
                    long long *p = PyMem_Realloc(lane_tids, n * sizeof *p);
                    if (!p) {
                        PyErr_NoMemory();
                        goto done;
                    }
                    memset(p + nlane, 0, (n - nlane) * sizeof *p);
                    lane_tids = p;
                    nlane = n;
                }
                lane_tids[lane] = tid;    /* 0 (never a lane's tid) is only not kept */
            }
            if (add_prefix(&c.buf, pid, tid))
                goto done;
            if (overflowed != Py_None) {
                PyObject *s0 = column_object(st, 3), *e0 = column_object(st, 4);
                PyObject *k = s0 && e0 ? PyTuple_Pack(5, key[0].obj, key[1].obj, key[2].obj,
                                                      s0, e0) : NULL;
                Py_XDECREF(s0);
                Py_XDECREF(e0);
                PyObject *v = k ? PyLong_FromLongLong(tid) : NULL;
                int bad = !v || PyObject_SetItem(overflowed, k, v);
                Py_XDECREF(k);
                Py_XDECREF(v);
                if (bad)
                    goto done;
            }
        }
        if (event_text(&sl, st, &c.buf, slice, origin, ls, nl) || chunk_end_event(&c))
            goto done;
    }
    if (chunk_finish(&c) || chunk_finish(&c2))
        goto done;
    result = PyLong_FromSsize_t(c.total);
done:
    sqlite3_finalize(sa);
    sqlite3_finalize(sb);
    sqlite3_finalize(sl.quote);
    sqlite3_finalize(sl.ts);
    sqlite3_finalize(sl.dur);
    PyMem_Free(c.buf.p);
    PyMem_Free(c2.buf.p);
    PyMem_Free(pre.p);
    PyMem_Free(pre_i.p);
    PyMem_Free(lane_tids);
    lanes_free(&tr.lanes);
    layouts_free(ls, nl);
    for (int i = 0; i < 3; i++) {
        Py_XDECREF(key[i].obj);
        PyMem_Free(key[i].text.p);
    }
    return result;
}

#define THREAD_CACHE 256

typedef struct {
    sqlite3_int64 node, pid, tid;
    long long cp, ct;
} ThreadTrack;

static int flow_event(Buf *b, const char *head, size_t head_n, long long id, long long pid,
                      long long tid, const Buf *ts)
{
    return buf_add(b, head, head_n) || buf_i64(b, id) || BUF_LIT(b, ",\"pid\":") ||
           buf_i64(b, pid) || BUF_LIT(b, ",\"tid\":") || buf_i64(b, tid) ||
           BUF_LIT(b, ",\"ts\":") || buf_add(b, ts->p, ts->len) ||
           BUF_LIT(b, ",\"name\":\"collective\",\"cat\":\"nccl\"}");
}

/* flows(db, sql, params, emit, first, origin, track, lane_of) -> arrows
 *
 * Mirrors _Exporter.flows: rows (comm, seq, node_id, pid, tid, timestamp_ns,
 * duration_ns) in arrival order per collective; track(node_id, pid, tid) -> (pid, tid)
 * of the thread's NCCL track, moved to lane_of[(node_id, pid, tid, ts, ts + dur)] when
 * that slice overflowed. An s/f pair per consecutive pair of rows of one collective.
 */
static PyObject *fs_flows(PyObject *self, PyObject *args)
{
    PyObject *ptr, *sql, *params, *emit, *track, *lane_of;
    int first;
    long long origin;
    if (!PyArg_ParseTuple(args, "OUO!OpLOO!", &ptr, &sql, &PyDict_Type, &params, &emit,
                          &first, &origin, &track, &PyDict_Type, &lane_of))
        return NULL;
    sqlite3 *db = db_of(ptr);
    if (!db)
        return NULL;
    sqlite3_stmt *st = prepare(db, sql);
    if (!st)
        return NULL;
    PyObject *result = NULL;
    Slow sl = {db, NULL, NULL, NULL};
    Chunks c = {{0}, 0, first, emit, 0};
    KeyCol key[2];
    memset(key, 0, sizeof key);
    int have = 0;
    long long flow_id = 0, prev_pid = 0, prev_tid = 0;
    /* track() per row was most of the loop: its answers for integer thread keys are
     * kept here (it allocates on the first call only; lane_of empty: no overflow) */
    ThreadTrack cache[THREAD_CACHE];
    Py_ssize_t ncache = 0, last = 0;
    Buf ts = {0}, prev_ts = {0};
    if (bind_params(db, st, params))
        goto done;
    for (;;) {
        int rc = sqlite3_step(st);
        if (rc == SQLITE_DONE)
            break;
        if (rc != SQLITE_ROW) {
            sql_error(db);
            goto done;
        }
        long long cp = 0, ct = 0;
        if (!PyDict_GET_SIZE(lane_of) && sqlite3_column_type(st, 2) == SQLITE_INTEGER &&
            sqlite3_column_type(st, 3) == SQLITE_INTEGER &&
            sqlite3_column_type(st, 4) == SQLITE_INTEGER) {
            /* the track of an integer thread key, as track() returned it before */
            sqlite3_int64 k0 = sqlite3_column_int64(st, 2), k1 = sqlite3_column_int64(st, 3),
                          k2 = sqlite3_column_int64(st, 4);
            Py_ssize_t i = 0;
            for (; i < ncache; i++) {
                ThreadTrack *t = &cache[(last + i) % ncache];
                if (t->node == k0 && t->pid == k1 && t->tid == k2)
                    break;
            }
            if (i < ncache) {
                last = (last + i) % ncache;
                cp = cache[last].cp;
                ct = cache[last].ct;
                goto have_track;
            }
        }
        PyObject *nid = column_object(st, 2), *pid_o = column_object(st, 3),
                 *tid_o = column_object(st, 4);
        PyObject *r = nid && pid_o && tid_o ?
                      PyObject_CallFunctionObjArgs(track, nid, pid_o, tid_o, NULL) : NULL;
        int ok = r && PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2;
        PyObject *ct_o = ok ? PyTuple_GET_ITEM(r, 1) : NULL;
        if (ok && PyDict_GET_SIZE(lane_of)) {
            PyObject *t0 = column_object(st, 5), *d = column_object(st, 6);
            PyObject *t1 = t0 && d ? PyNumber_Add(t0, d) : NULL;
            PyObject *k = t1 ? PyTuple_Pack(5, nid, pid_o, tid_o, t0, t1) : NULL;
            PyObject *moved = k ? PyDict_GetItemWithError(lane_of, k) : NULL;
            if (moved)
                ct_o = moved;
            else if (PyErr_Occurred())
                ok = 0;
            Py_XDECREF(t0);
            Py_XDECREF(d);
            Py_XDECREF(t1);
            Py_XDECREF(k);    /* moved stays alive: lane_of holds it */
        }
        if (ok && !(PyLong_CheckExact(PyTuple_GET_ITEM(r, 0)) && PyLong_CheckExact(ct_o))) {
            PyErr_SetString(Unsupported, "a track id that is not an integer");
            ok = 0;
        }
        if (ok) {
            cp = PyLong_AsLongLong(PyTuple_GET_ITEM(r, 0));
            ct = PyLong_AsLongLong(ct_o);
            ok = !PyErr_Occurred();
        }
        Py_XDECREF(nid);
        Py_XDECREF(pid_o);
        Py_XDECREF(tid_o);
        Py_XDECREF(r);
        if (!ok)
            goto done;
        if (!PyDict_GET_SIZE(lane_of) && sqlite3_column_type(st, 2) == SQLITE_INTEGER &&
            sqlite3_column_type(st, 3) == SQLITE_INTEGER &&
            sqlite3_column_type(st, 4) == SQLITE_INTEGER && ncache < THREAD_CACHE) {
            ThreadTrack t = {sqlite3_column_int64(st, 2), sqlite3_column_int64(st, 3),
                             sqlite3_column_int64(st, 4), cp, ct};
            last = ncache;
            cache[ncache++] = t;
        }
    have_track:
        ts.len = 0;
        if (ts_text(&sl, st, 5, origin, &ts))
            goto done;
        int same = have, s;
        for (int i = 0; i < 2 && same; i++) {
            if (key_same(&key[i], st, i, &s))
                goto done;
            same = s;
        }
        if (same) {
            flow_id++;
            if (chunk_begin_event(&c) ||
                flow_event(&c.buf, "{\"ph\":\"s\",\"id\":", 15, flow_id, prev_pid, prev_tid,
                           &prev_ts) ||
                chunk_end_event(&c) || chunk_begin_event(&c) ||
                flow_event(&c.buf, "{\"ph\":\"f\",\"bp\":\"e\",\"id\":", 24, flow_id, cp, ct,
                           &ts) ||
                chunk_end_event(&c))
                goto done;
        } else {
            have = 1;
            for (int i = 0; i < 2; i++)
                if (key_set(&key[i], st, i))
                    goto done;
        }
        prev_pid = cp;
        prev_tid = ct;
        Buf tmp = prev_ts;
        prev_ts = ts;
        ts = tmp;
    }
    if (chunk_finish(&c))
        goto done;
    result = PyLong_FromLongLong(flow_id);
done:
    sqlite3_finalize(st);
    sqlite3_finalize(sl.quote);
    sqlite3_finalize(sl.ts);
    sqlite3_finalize(sl.dur);
    PyMem_Free(c.buf.p);
    PyMem_Free(ts.p);
    PyMem_Free(prev_ts.p);
    for (int i = 0; i < 2; i++) {
        Py_XDECREF(key[i].obj);
        PyMem_Free(key[i].text.p);
    }
    return result;
}

/* counters(db, sql, params, emit, first, origin, head) -> events
 *
 * Mirrors _Exporter.host: rows (timestamp_ns, name, value text) ->
 * head "ts":…,"name":…,"cat":"host","args":{"value":…}} (head: '{"pid":P,"ph":"C",
 * "tid":0,'); the value is SQLite's printf('%!.15g') text, copied.
 */
static PyObject *fs_counters(PyObject *self, PyObject *args)
{
    PyObject *ptr, *sql, *params, *emit;
    int first;
    long long origin;
    const char *head;
    Py_ssize_t head_n;
    if (!PyArg_ParseTuple(args, "OUO!OpLs#", &ptr, &sql, &PyDict_Type, &params, &emit,
                          &first, &origin, &head, &head_n))
        return NULL;
    sqlite3 *db = db_of(ptr);
    if (!db)
        return NULL;
    sqlite3_stmt *st = prepare(db, sql);
    if (!st)
        return NULL;
    PyObject *result = NULL;
    Slow sl = {db, NULL, NULL, NULL};
    Chunks c = {{0}, 0, first, emit, 0};
    if (bind_params(db, st, params))
        goto done;
    for (;;) {
        int rc = sqlite3_step(st);
        if (rc == SQLITE_DONE)
            break;
        if (rc != SQLITE_ROW) {
            sql_error(db);
            goto done;
        }
        if (sqlite3_column_type(st, 2) != SQLITE_TEXT) {
            PyErr_SetString(PyExc_ValueError, "counter value: text expected");
            goto done;
        }
        const char *v = (const char *)sqlite3_column_text(st, 2);
        int vn = sqlite3_column_bytes(st, 2);
        if (chunk_begin_event(&c) || buf_add(&c.buf, head, head_n) ||
            BUF_LIT(&c.buf, "\"ts\":") || ts_text(&sl, st, 0, origin, &c.buf) ||
            BUF_LIT(&c.buf, ",\"name\":") || quote_col(&sl, st, 1, &c.buf) ||
            BUF_LIT(&c.buf, ",\"cat\":\"host\",\"args\":{\"value\":") ||
            check_utf8(v, vn) || buf_add(&c.buf, v, vn) || BUF_LIT(&c.buf, "}}") ||
            chunk_end_event(&c))
            goto done;
    }
    if (chunk_finish(&c))
        goto done;
    result = PyLong_FromSsize_t(c.total);
done:
    sqlite3_finalize(st);
    sqlite3_finalize(sl.quote);
    sqlite3_finalize(sl.ts);
    sqlite3_finalize(sl.dur);
    PyMem_Free(c.buf.p);
    return result;
}

/* id_ranges(db, sql, params) -> {key: (min id, max id)}
 *
 * Rows (key, id) with integer keys and ids (others are skipped: a key that is not an
 * integer matches no node): SELECT key, min(id), max(id) … GROUP BY key without SQLite's
 * sort of every row (the rows come in rowid order, usually in one run per key).
 */
static PyObject *fs_id_ranges(PyObject *self, PyObject *args)
{
    PyObject *ptr, *sql, *params;
    if (!PyArg_ParseTuple(args, "OUO!", &ptr, &sql, &PyDict_Type, &params))
        return NULL;
    sqlite3 *db = db_of(ptr);
    if (!db)
        return NULL;
    sqlite3_stmt *st = prepare(db, sql);
    if (!st)
        return NULL;
    PyObject *out = PyDict_New();
    int have = 0;
    sqlite3_int64 key = 0, lo = 0, hi = 0;
    if (!out || bind_params(db, st, params))
        goto fail;
    for (;;) {
        int rc = sqlite3_step(st);
        if (rc == SQLITE_DONE || rc == SQLITE_ROW) {
            sqlite3_int64 k = 0, id = 0;
            int row = rc == SQLITE_ROW;
            if (row) {
                if (sqlite3_column_type(st, 0) != SQLITE_INTEGER ||
                    sqlite3_column_type(st, 1) != SQLITE_INTEGER)
                    continue;
                k = sqlite3_column_int64(st, 0);
                id = sqlite3_column_int64(st, 1);
                if (have && k == key) {
                    if (id < lo)
                        lo = id;
                    if (id > hi)
                        hi = id;
                    continue;
                }
            }
            if (have) {     /* the run of ``key`` ended: widen its range in the dict */
                PyObject *ko = PyLong_FromLongLong(key);
                PyObject *prev = ko ? PyDict_GetItemWithError(out, ko) : NULL;
                if (!ko || (!prev && PyErr_Occurred())) {
                    Py_XDECREF(ko);
                    goto fail;
                }
                if (prev) {
                    sqlite3_int64 plo = PyLong_AsLongLong(PyTuple_GET_ITEM(prev, 0));
                    sqlite3_int64 phi = PyLong_AsLongLong(PyTuple_GET_ITEM(prev, 1));
                    if (plo < lo)
                        lo = plo;
                    if (phi > hi)
                        hi = phi;
                }
                PyObject *v = Py_BuildValue("(LL)", lo, hi);
                int bad = !v || PyDict_SetItem(out, ko, v);
                Py_DECREF(ko);
                Py_XDECREF(v);
                if (bad)
                    goto fail;
            }
            if (!row)
                break;
            have = 1;
            key = k;
            lo = hi = id;
            continue;
        }
        sql_error(db);
        goto fail;
    }
    sqlite3_finalize(st);
    return out;
fail:
    sqlite3_finalize(st);
    Py_XDECREF(out);
    return NULL;
}

static PyObject *fs_ready(PyObject *self, PyObject *noargs)
{
    return PyBool_FromLong(sqlite3_api != NULL);
}

static PyMethodDef methods[] = {
    {"events", fs_events, METH_VARARGS, "Slices or instants, text built here, in chunks."},
    {"flows", fs_flows, METH_VARARGS, "Flow arrows between a collective's slices."},
    {"counters", fs_counters, METH_VARARGS, "Host counter samples, text built here."},
    {"id_ranges", fs_id_ranges, METH_VARARGS, "Min and max id per key, in one scan."},
    {"ready", fs_ready, METH_NOARGS, "True once SQLite's routines are loaded."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastslices",
    "C loops for ingero-export's slice sections (see streams.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__fastslices(void)
{
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Unsupported = PyErr_NewException("_fastslices.Unsupported", PyExc_ValueError, NULL);
    if (!Unsupported || PyModule_AddObject(m, "Unsupported", Unsupported)) {
        Py_XDECREF(Unsupported);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(Unsupported);
    return m;
}
