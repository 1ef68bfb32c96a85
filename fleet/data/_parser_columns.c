/* fleet.data's compiled column helpers (part of the fleet.data._parser module; _parser.c lists
 * them): rows of a dense or jagged column gathered across the chunks a dataset holds (one memcpy
 * per row, without the GIL), newline counts of a text block, and giving freed heap pages back.
 * fleet/data/columns.py has their numpy twins. */
#include "_parser_common.h"
#ifdef __GLIBC__
#include <malloc.h>
#endif

size_t fleetdata_count_newlines(const char *q, Py_ssize_t len) {
    size_t n = 0;
    for (const char *qe = q + len; (q = memchr(q, '\n', (size_t)(qe - q))); q++) n++;
    return n;
}

/* -- gathers over chunks ------------------------------------------------------------------ */
/* A tuple of buffers (the same column of each chunk of a dataset) */
typedef struct {
    Py_ssize_t n;
    Py_buffer *views;
} bufs_t;

static void bufs_release(bufs_t *b) {
    for (Py_ssize_t i = 0; i < b->n; i++) PyBuffer_Release(&b->views[i]);
    free(b->views);
    b->views = NULL;
    b->n = 0;
}

static int bufs_get(PyObject *tuple, bufs_t *b) {
    b->n = 0;
    b->views = NULL;
    if (!PyTuple_Check(tuple)) {
        PyErr_SetString(PyExc_TypeError, "expected a tuple of arrays (one per chunk)");
        return 0;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    b->views = calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    if (!b->views) { PyErr_NoMemory(); return 0; }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(tuple, i), &b->views[i], PyBUF_SIMPLE) != 0) {
            bufs_release(b);
            return 0;
        }
        b->n = i + 1;
    }
    return 1;
}

/* gather_rows(sources, row_bytes, chunk i64[B], row i64[B], out): out row i = row `row[i]` of
   sources[chunk[i]] (fixed-size rows: a dense column) */
PyObject *fleetdata_gather_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *src_obj;
    Py_ssize_t rb;
    Py_buffer cid, row, out;
    bufs_t src;
    if (!PyArg_ParseTuple(args, "Ony*y*w*", &src_obj, &rb, &cid, &row, &out)) return NULL;
    int bad = !bufs_get(src_obj, &src);
    int failed = bad;
    Py_ssize_t b = cid.len / 8;
    if (!bad && (rb < 1 || row.len != cid.len || out.len < b * rb)) bad = 1;
    if (!bad) {
        const int64_t *c = cid.buf, *r = row.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < b; i++) {
            if (c[i] < 0 || c[i] >= src.n || r[i] < 0 || (r[i] + 1) * rb > src.views[c[i]].len) {
                bad = 1;
                break;
            }
            memcpy((char *)out.buf + i * rb, (const char *)src.views[c[i]].buf + r[i] * rb,
                   (size_t)rb);
        }
        Py_END_ALLOW_THREADS
    }
    if (!failed) bufs_release(&src);
    PyBuffer_Release(&cid);
    PyBuffer_Release(&row);
    PyBuffer_Release(&out);
    if (failed) return NULL;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "gather_rows: chunk or row out of range");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* the rows (c[i], r[i]) of a jagged column: fill o (without out) or copy into out; 1 = a row
   or offset out of range. Random rows: the offsets PF rows ahead and the values PF/2 rows ahead
   are prefetched, so many cache misses are in flight at once. */
static int jagged_loop(const bufs_t *vals, const bufs_t *offs, Py_ssize_t item, const int64_t *c,
                       const int64_t *r, Py_ssize_t b, int64_t *o, const Py_buffer *out) {
    enum { PF = 16 };
    if (!out) o[0] = 0;
    for (Py_ssize_t i = 0; i < b; i++) {
        if (i + PF < b && c[i + PF] >= 0 && c[i + PF] < offs->n && r[i + PF] >= 0 &&
            (r[i + PF] + 2) * 8 <= offs->views[c[i + PF]].len)
            __builtin_prefetch((const int64_t *)offs->views[c[i + PF]].buf + r[i + PF]);
        if (out && i + PF / 2 < b) {
            int64_t cc = c[i + PF / 2], rr = r[i + PF / 2];
            if (cc >= 0 && cc < offs->n && rr >= 0 && (rr + 2) * 8 <= offs->views[cc].len) {
                int64_t lo = ((const int64_t *)offs->views[cc].buf)[rr];
                if (lo >= 0 && lo * item < vals->views[cc].len)
                    __builtin_prefetch((const char *)vals->views[cc].buf + lo * item);
            }
        }
        if (c[i] < 0 || c[i] >= offs->n || r[i] < 0 || (r[i] + 2) * 8 > offs->views[c[i]].len)
            return 1;
        const int64_t *off = offs->views[c[i]].buf;
        int64_t lo = off[r[i]], hi = off[r[i] + 1];
        if (lo < 0 || hi < lo || hi * item > vals->views[c[i]].len) return 1;
        if (!out) {
            o[i + 1] = o[i] + (hi - lo);
            continue;
        }
        if (o[i + 1] - o[i] != hi - lo || o[i + 1] * item > out->len) return 1;
        const char *from = (const char *)vals->views[c[i]].buf + lo * item;
        char *to = (char *)out->buf + o[i] * item;
        if (item == 8 && hi - lo == 1) memcpy(to, from, 8); /* the common one-id row, inlined */
        else memcpy(to, from, (size_t)((hi - lo) * item));
    }
    return 0;
}

/* jagged_take(values, offsets, itemsize, chunk i64[B], row i64[B], out_offsets i64[B+1][,
   out_values]): with out_values None fills out_offsets (the lengths of the rows, summed) and
   returns the total; else copies the rows' values into out_values */
PyObject *fleetdata_jagged_take(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *val_obj, *off_obj, *outv_obj = Py_None;
    Py_ssize_t item;
    Py_buffer cid, row, oo, outv;
    bufs_t vals = {0, NULL}, offs = {0, NULL};
    if (!PyArg_ParseTuple(args, "OOny*y*w*|O", &val_obj, &off_obj, &item, &cid, &row, &oo,
                          &outv_obj))
        return NULL;
    int have_out = 0, failed = 0, bad = 0;
    Py_ssize_t b = cid.len / 8;
    int64_t total = 0;
    if (!bufs_get(val_obj, &vals) || !bufs_get(off_obj, &offs)) failed = 1;
    if (!failed && outv_obj != Py_None) {
        if (PyObject_GetBuffer(outv_obj, &outv, PyBUF_WRITABLE) != 0) failed = 1;
        else have_out = 1;
    }
    if (!failed && (item < 1 || row.len != cid.len || oo.len != (b + 1) * 8 ||
                    vals.n != offs.n))
        bad = 1;
    if (!failed && !bad) {
        const int64_t *c = cid.buf, *r = row.buf;
        int64_t *o = oo.buf;
        Py_BEGIN_ALLOW_THREADS
        bad = jagged_loop(&vals, &offs, item, c, r, b, o, have_out ? &outv : NULL);
        total = o[b];
        Py_END_ALLOW_THREADS
    }
    bufs_release(&vals);
    bufs_release(&offs);
    if (have_out) PyBuffer_Release(&outv);
    PyBuffer_Release(&cid);
    PyBuffer_Release(&row);
    PyBuffer_Release(&oo);
    if (failed) return NULL;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "jagged_take: chunk, row or offsets out of range");
        return NULL;
    }
    return PyLong_FromLongLong(total);
}

PyObject *fleetdata_count_lines(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer text;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "y*n", &text, &length)) return NULL;
    if (length < 0 || length > text.len) length = text.len;
    size_t n;
    Py_BEGIN_ALLOW_THREADS
    n = fleetdata_count_newlines(text.buf, length);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&text);
    return PyLong_FromSize_t(n);
}

PyObject *fleetdata_trim_heap(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
#ifdef __GLIBC__
    Py_BEGIN_ALLOW_THREADS
    malloc_trim(0);
    Py_END_ALLOW_THREADS
#endif
    Py_RETURN_NONE;
}
