/* Row screens for untrusted bundles, as SQL functions in C (docs/merge.md, "Hostile input").
 *
 * Same two roles as merge/_fastcoll.c: a CPython module, and a SQLite loadable extension
 * (entry point sqlite3_screen_init) loaded once into a scratch apsw connection only to
 * receive the routines of apsw's own SQLite. register(pointer) then adds two functions
 * to one of our connections:
 *
 *  ingero_utf8_ok(v, ...)   1 when every argument that is text is valid UTF-8 (as Python's
 *                           strict decoder defines it), else 0. reader.py _check_text.
 *  ingero_row_ok(spec, v, ...)
 *                           1 when every value obeys its column's rule in spec, else 0:
 *                           the per-row rules of merge/screen.py (column_rules) in one
 *                           call instead of a dozen opcodes per column.
 *
 * spec (built by merge/screen.py rules_spec, one token per value, ';' between):
 *     K N lo , hi [ = e1 | e2 ... ]
 * K: storage classes allowed: 'i' integer, 'r' real or integer, 't' text.
 * N: '1' NULL allowed, '0' not.  lo,hi: an inclusive int64 range for integers ('' = none).
 * e1|e2...: the text values allowed (an enum column).
 * The parsed spec is cached per statement (sqlite3_set_auxdata: the argument is a literal).
 *
 * Both are SQLITE_DIRECTONLY: a view or trigger stored in a bundle cannot call them.
 * The SQL expressions stay the reference (INGERO_NO_ACCEL=1); tests compare the two.
 * Measured: docs/performance.md ("Merge").
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sqlite3ext.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const sqlite3_api_routines *sqlite3_api = NULL;

__attribute__((visibility("default")))
int sqlite3_screen_init(sqlite3 *db, char **err, const sqlite3_api_routines *api)
{
    (void)db;
    (void)err;
    sqlite3_api = api;
    return SQLITE_OK;
}

/* ------------------------------------------------------------------ UTF-8 */

/* Well-formed UTF-8 (Unicode 15, table 3-7): no overlong forms, no surrogates, nothing
 * above U+10FFFF; the rule of Python's bytes.decode("utf-8"). */
static int utf8_valid(const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        /* ASCII eight bytes at a time: most text in a bundle is names and hex */
        while (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (w & 0x8080808080808080ULL)
                break;
            i += 8;
        }
        if (i >= n)
            break;
        unsigned char c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF)
            len = 2;
        else if (c >= 0xE0 && c <= 0xEF) {
            len = 3;
            if (c == 0xE0)
                lo = 0xA0;
            else if (c == 0xED)
                hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4;
            if (c == 0xF0)
                lo = 0x90;
            else if (c == 0xF4)
                hi = 0x8F;
        } else
            return 0;
        if (i + len > n)
            return 0;
        if (s[i + 1] < lo || s[i + 1] > hi)
            return 0;
        for (size_t k = 2; k < len; k++)
            if ((s[i + k] & 0xC0) != 0x80)
                return 0;
        i += len;
    }
    return 1;
}

static void fn_utf8_ok(sqlite3_context *ctx, int argc, sqlite3_value **argv)
{
    for (int a = 0; a < argc; a++) {
        if (sqlite3_value_type(argv[a]) != SQLITE_TEXT)
            continue;
        /* the stored bytes, unconverted: CAST(v AS BLOB) of the SQL path */
        const unsigned char *p = sqlite3_value_blob(argv[a]);
        int n = sqlite3_value_bytes(argv[a]);
        if (n > 0 && !utf8_valid(p, (size_t)n)) {
            sqlite3_result_int(ctx, 0);
            return;
        }
    }
    sqlite3_result_int(ctx, 1);
}

/* ------------------------------------------------------------------ row rules */

typedef struct {
    char kind;          /* 'i', 'r', 't' */
    char nullable;
    char ranged;
    int64_t lo, hi;
    int nenum;          /* 0: any text */
    const char **enums; /* into Spec.text */
    int *enum_len;
} Rule;

typedef struct {
    int n;
    Rule *rules;
    char *text;         /* a copy of the spec, split in place */
} Spec;

static void spec_free(void *p)
{
    Spec *s = p;
    if (!s)
        return;
    for (int i = 0; i < s->n; i++) {
        free(s->rules[i].enums);
        free(s->rules[i].enum_len);
    }
    free(s->rules);
    free(s->text);
    free(s);
}

static int parse_i64(const char *s, const char *end, int64_t *out)
{
    char buf[32];
    size_t n = (size_t)(end - s);
    if (n == 0 || n >= sizeof buf)
        return -1;
    memcpy(buf, s, n);
    buf[n] = 0;
    char *e;
    errno = 0;
    long long v = strtoll(buf, &e, 10);
    if (errno || *e)
        return -1;
    *out = (int64_t)v;
    return 0;
}

/* One token "KNlo,hi[=a|b]" (NUL-terminated, modified in place) into r. */
static int parse_rule(char *tok, Rule *r)
{
    if (strlen(tok) < 3 || !strchr("irt", tok[0]) || (tok[1] != '0' && tok[1] != '1'))
        return -1;
    r->kind = tok[0];
    r->nullable = tok[1] == '1';
    char *eq = strchr(tok, '=');
    char *rend = eq ? eq : tok + strlen(tok);
    char *comma = memchr(tok + 2, ',', (size_t)(rend - tok - 2));
    if (!comma)
        return -1;
    if (comma > tok + 2 || rend > comma + 1) {
        if (parse_i64(tok + 2, comma, &r->lo) || parse_i64(comma + 1, rend, &r->hi))
            return -1;
        r->ranged = 1;
    }
    if (eq) {
        int n = 1;
        for (char *p = eq + 1; *p; p++)
            n += *p == '|';
        r->enums = calloc((size_t)n, sizeof *r->enums);
        r->enum_len = calloc((size_t)n, sizeof *r->enum_len);
        if (!r->enums || !r->enum_len)
            return -1;
        char *p = eq + 1;
        for (int k = 0; k < n; k++) {
            char *bar = strchr(p, '|');
            if (bar)
                *bar = 0;
            r->enums[k] = p;
            r->enum_len[k] = (int)strlen(p);
            p = bar ? bar + 1 : p + strlen(p);
        }
        r->nenum = n;
    }
    return 0;
}

static Spec *spec_parse(const char *text)
{
    Spec *s = calloc(1, sizeof *s);
    if (!s || !(s->text = strdup(text))) {
        free(s);
        return NULL;
    }
    int n = 1;
    for (const char *p = text; *p; p++)
        n += *p == ';';
    if (!(s->rules = calloc((size_t)n, sizeof *s->rules))) {
        spec_free(s);
        return NULL;
    }
    char *p = s->text;
    for (int i = 0; i < n; i++) {
        char *semi = strchr(p, ';');
        if (semi)
            *semi = 0;
        s->n = i + 1;
        if (parse_rule(p, &s->rules[i])) {
            spec_free(s);
            return NULL;
        }
        p = semi ? semi + 1 : p + strlen(p);
    }
    return s;
}

static int value_ok(const Rule *r, sqlite3_value *v)
{
    switch (sqlite3_value_type(v)) {
    case SQLITE_NULL:
        return r->nullable;
    case SQLITE_INTEGER:
        if (r->kind == 't')
            return 0;
        if (r->ranged) {
            int64_t x = sqlite3_value_int64(v);
            return x >= r->lo && x <= r->hi;
        }
        return 1;
    case SQLITE_FLOAT:
        return r->kind == 'r';
    case SQLITE_TEXT: {
        if (r->kind != 't')
            return 0;
        if (!r->nenum)
            return 1;
        const char *p = (const char *)sqlite3_value_text(v);
        int n = sqlite3_value_bytes(v);
        for (int k = 0; k < r->nenum; k++)
            if (r->enum_len[k] == n && memcmp(r->enums[k], p, (size_t)n) == 0)
                return 1;
        return 0;
    }
    default:            /* a blob fits no declared column */
        return 0;
    }
}

static void fn_row_ok(sqlite3_context *ctx, int argc, sqlite3_value **argv)
{
    if (argc < 1 || sqlite3_value_type(argv[0]) != SQLITE_TEXT) {
        sqlite3_result_error(ctx, "ingero_row_ok: the first argument is the spec", -1);
        return;
    }
    Spec *s = sqlite3_get_auxdata(ctx, 0), *own = NULL;
    if (!s) {
        const char *text = (const char *)sqlite3_value_text(argv[0]);
        if (!(s = spec_parse(text))) {
            sqlite3_result_error(ctx, "ingero_row_ok: malformed spec", -1);
            return;
        }
        /* SQLite keeps it for the statement when the argument is a literal; it may
         * instead free it at once: then this row parses its own copy */
        sqlite3_set_auxdata(ctx, 0, s, spec_free);
        if (!(s = sqlite3_get_auxdata(ctx, 0))) {
            if (!(s = own = spec_parse(text))) {
                sqlite3_result_error_nomem(ctx);
                return;
            }
        }
    }
    int ok = s->n == argc - 1;
    for (int i = 0; ok && i < s->n; i++)
        ok = value_ok(&s->rules[i], argv[i + 1]);
    if (s->n != argc - 1)
        sqlite3_result_error(ctx, "ingero_row_ok: spec and values differ in number", -1);
    else
        sqlite3_result_int(ctx, ok);
    spec_free(own);
}

/* ------------------------------------------------------------------ Python */

static PyObject *sc_register(PyObject *self, PyObject *arg)
{
    (void)self;
    if (!sqlite3_api) {
        PyErr_SetString(PyExc_RuntimeError, "_screen: SQLite routines not loaded");
        return NULL;
    }
    sqlite3 *db = PyLong_AsVoidPtr(arg);
    if (!db) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "null sqlite3 pointer");
        return NULL;
    }
    int flags = SQLITE_UTF8 | SQLITE_DETERMINISTIC | SQLITE_DIRECTONLY;
    if (sqlite3_create_function_v2(db, "ingero_utf8_ok", -1, flags, NULL, fn_utf8_ok,
                                   NULL, NULL, NULL) != SQLITE_OK ||
        sqlite3_create_function_v2(db, "ingero_row_ok", -1, flags, NULL, fn_row_ok,
                                   NULL, NULL, NULL) != SQLITE_OK) {
        PyErr_SetString(PyExc_RuntimeError, sqlite3_errmsg(db));
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *sc_utf8_valid(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE))
        return NULL;
    int ok = utf8_valid(b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyBool_FromLong(ok);
}

static PyObject *sc_ready(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyBool_FromLong(sqlite3_api != NULL);
}

static PyMethodDef methods[] = {
    {"register", sc_register, METH_O, "Add ingero_utf8_ok() and ingero_row_ok() to a "
     "connection (its sqlite3 pointer)."},
    {"utf8_valid", sc_utf8_valid, METH_O, "The C UTF-8 rule on bytes (for tests)."},
    {"ready", sc_ready, METH_NOARGS, "True once SQLite's routines are loaded."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_screen",
    "Row screens for untrusted bundles as SQL functions (see merge/screen.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__screen(void)
{
    return PyModule_Create(&module);
}
