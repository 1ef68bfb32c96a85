/* Row copies (gather, scatter) and the routing hashes (group, owned) of the compiled kernels;
 * documented with the others at the top of _kernels.c. */
#include "_kernels_common.h"

PyObject *psk_group(PyObject *self, PyObject *args) {
    PyObject *o_keys, *o_out, *o_kout = NULL;
    unsigned long long salt;
    long long shards, servers;
    if (!PyArg_ParseTuple(args, "OKLLO|O", &o_keys, &salt, &shards, &servers, &o_out, &o_kout))
        return NULL;
    if (shards < 1 || servers < 1 || servers > shards) {
        PyErr_Format(PyExc_ValueError, "group: need 1 <= num_servers <= num_shards, got %lld, %lld",
                     servers, shards);
        return NULL;
    }
    Py_buffer bk, bo, bko;
    int with_keys = o_kout != NULL && o_kout != Py_None;
    if (!get_buf(o_keys, &bk, 8, 0, "keys")) return NULL;
    if (!get_buf(o_out, &bo, 8, 1, "out")) { PyBuffer_Release(&bk); return NULL; }
    if (with_keys && !get_buf(o_kout, &bko, 8, 1, "keys_out")) {
        PyBuffer_Release(&bo); PyBuffer_Release(&bk); return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = bk.len / 8;
    int32_t *srv = malloc(sizeof(int32_t) * (n ? n : 1));
    int64_t *start = calloc((size_t)servers + 1, sizeof(int64_t));
    int32_t *owner = malloc(sizeof(int32_t) * (size_t)shards); /* shard -> server */
    if (owner)
        for (long long h = 0; h < shards; h++) owner[h] = (int32_t)(h % servers);
    if (bo.len / 8 != n || (with_keys && bko.len / 8 != n)) {
        PyErr_SetString(PyExc_ValueError, "group: out and keys_out need one slot per key");
    } else if (!srv || !start || !owner) {
        PyErr_NoMemory();
    } else {
        const uint64_t *k = (const uint64_t *)bk.buf;
        int64_t *out = (int64_t *)bo.buf;
        uint64_t ns = (uint64_t)shards, pow2 = (ns & (ns - 1)) == 0;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t h = mix64(k[i] ^ (uint64_t)salt);
            int32_t s = owner[pow2 ? (h & (ns - 1)) : (h % ns)];
            srv[i] = s;
            start[s + 1]++;
        }
        for (long long s = 0; s < servers; s++) start[s + 1] += start[s];
        if (with_keys) {
            int64_t *kout = (int64_t *)bko.buf;
            for (Py_ssize_t i = 0; i < n; i++) {
                int64_t at = start[srv[i]]++;
                out[at] = i;
                kout[at] = (int64_t)k[i];
            }
        } else {
            for (Py_ssize_t i = 0; i < n; i++) out[start[srv[i]]++] = i;
        }
        Py_END_ALLOW_THREADS
        /* start[s] is now the end of server s's run: counts are the differences */
        result = PyList_New((Py_ssize_t)servers);
        for (long long s = 0; result && s < servers; s++) {
            long long c = start[s] - (s ? start[s - 1] : 0);
            PyObject *v = PyLong_FromLongLong(c);
            if (!v) { Py_CLEAR(result); break; }
            PyList_SET_ITEM(result, (Py_ssize_t)s, v);
        }
    }
    free(srv); free(start); free(owner);
    if (with_keys) PyBuffer_Release(&bko);
    PyBuffer_Release(&bo); PyBuffer_Release(&bk);
    return result;
}

/* Row copies between C-contiguous arrays whose first axis is the row: a row is row_bytes
   bytes (any dtype); copies of 8 / 32 bytes (keys, dim-8 rows) are inlined by the compiler. */
static inline void copy_row(char *dst, const char *src, Py_ssize_t row_bytes) {
    if (row_bytes == 8) memcpy(dst, src, 8);
    else if (row_bytes == 32) memcpy(dst, src, 32);
    else memcpy(dst, src, (size_t)row_bytes);
}

/* The index array and the two row arrays of a row copy (gather / scatter); 0 and an error if
   they do not fit (rows: len(idx) rows of `few`, `many` a whole number of such rows). */
static int rows_args(PyObject *args, const char *name, Py_buffer *bmany, Py_buffer *bidx,
                     Py_buffer *bfew, int many_pos, Py_ssize_t *row_bytes, Py_ssize_t *cap) {
    PyObject *o[3];
    if (!PyArg_ParseTuple(args, "OOO", &o[0], &o[1], &o[2])) return 0;
    int few_pos = 2 - many_pos; /* gather(src=many, idx, out=few); scatter(src=few, idx, dst=many) */
    if (!get_buf(o[many_pos], bmany, -1, many_pos == 2, many_pos == 0 ? "src" : "dst")) return 0;
    if (!get_buf(o[1], bidx, 8, 0, "index")) { PyBuffer_Release(bmany); return 0; }
    if (!get_buf(o[few_pos], bfew, -1, few_pos == 2, few_pos == 0 ? "src" : "out")) {
        PyBuffer_Release(bidx); PyBuffer_Release(bmany); return 0;
    }
    Py_ssize_t n = bidx->len / 8;
    *row_bytes = n ? bfew->len / n : 0;
    *cap = *row_bytes ? bmany->len / *row_bytes : 0;
    if (n && (bfew->len != n * *row_bytes || bmany->len != *cap * *row_bytes)) {
        PyErr_Format(PyExc_ValueError, "%s: the arrays' rows do not have the same size", name);
        goto fail;
    }
    const int64_t *idx = (const int64_t *)bidx->buf;
    for (Py_ssize_t i = 0; *row_bytes && i < n; i++) {
        if (idx[i] >= *cap || (many_pos == 2 && idx[i] < 0)) {
            PyErr_Format(PyExc_ValueError, "%s: row %lld out of range", name, (long long)idx[i]);
            goto fail;
        }
    }
    return 1;
fail:
    PyBuffer_Release(bfew); PyBuffer_Release(bidx); PyBuffer_Release(bmany);
    return 0;
}

typedef struct {
    const char *src;
    const int64_t *idx;
    char *out;
    Py_ssize_t rb;
} gather_ctx;

static int gather_part(void *arg, int part, Py_ssize_t lo, Py_ssize_t hi) {
    const gather_ctx *c = (const gather_ctx *)arg;
    (void)part;
    Py_ssize_t rb = c->rb;
    enum { PF = 16 };
    for (Py_ssize_t i = lo; i < hi; i++) {
        if (i + PF < hi && c->idx[i + PF] >= 0) __builtin_prefetch(c->src + c->idx[i + PF] * rb);
        int64_t r = c->idx[i];
        if (r >= 0) copy_row(c->out + i * rb, c->src + r * rb, rb);
    }
    return 0;
}

PyObject *psk_gather(PyObject *self, PyObject *args) {
    Py_buffer bs, bi, bo;
    Py_ssize_t rb, cap;
    int threads = 1;
    PyObject *o_src, *o_idx, *o_out;
    if (!PyArg_ParseTuple(args, "OOO|i", &o_src, &o_idx, &o_out, &threads)) return NULL;
    PyObject *triple = PyTuple_Pack(3, o_src, o_idx, o_out);
    if (!triple) return NULL;
    int ok = rows_args(triple, "gather", &bs, &bi, &bo, 0, &rb, &cap);
    Py_DECREF(triple);
    if (!ok) return NULL;
    gather_ctx c = {(const char *)bs.buf, (const int64_t *)bi.buf, (char *)bo.buf, rb};
    Py_ssize_t n = bi.len / 8;
    Py_BEGIN_ALLOW_THREADS
    if (rb) run_parts(threads, n, gather_part, &c);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&bo); PyBuffer_Release(&bi); PyBuffer_Release(&bs);
    Py_RETURN_NONE;
}

PyObject *psk_scatter(PyObject *self, PyObject *args) {
    Py_buffer bd, bi, bs;
    Py_ssize_t rb, cap;
    if (!rows_args(args, "scatter", &bd, &bi, &bs, 2, &rb, &cap)) return NULL;
    Py_ssize_t n = bi.len / 8;
    const int64_t *idx = (const int64_t *)bi.buf;
    const char *src = (const char *)bs.buf;
    char *dst = (char *)bd.buf;
    Py_BEGIN_ALLOW_THREADS
    enum { PF = 16 };
    for (Py_ssize_t i = 0; rb && i < n; i++) {
        if (i + PF < n) __builtin_prefetch(dst + idx[i + PF] * rb, 1);
        copy_row(dst + idx[i] * rb, src + i * rb, rb);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&bs); PyBuffer_Release(&bi); PyBuffer_Release(&bd);
    Py_RETURN_NONE;
}

PyObject *psk_owned(PyObject *self, PyObject *args) {
    PyObject *o_keys, *o_owned;
    unsigned long long salt;
    if (!PyArg_ParseTuple(args, "OKO", &o_keys, &salt, &o_owned)) return NULL;
    Py_buffer bk, bw;
    if (!get_buf(o_keys, &bk, 8, 0, "keys")) return NULL;
    if (!get_buf(o_owned, &bw, 1, 0, "owned")) { PyBuffer_Release(&bk); return NULL; }
    Py_ssize_t n = bk.len / 8, bad = -1;
    uint64_t ns = (uint64_t)bw.len;
    if (ns == 0) {
        PyErr_SetString(PyExc_ValueError, "owned: the shard mask is empty");
        PyBuffer_Release(&bw); PyBuffer_Release(&bk);
        return NULL;
    }
    const uint64_t *k = (const uint64_t *)bk.buf;
    const uint8_t *own = (const uint8_t *)bw.buf;
    Py_BEGIN_ALLOW_THREADS
    int pow2 = (ns & (ns - 1)) == 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = mix64(k[i] ^ (uint64_t)salt);
        if (!own[pow2 ? (h & (ns - 1)) : (h % ns)]) { bad = i; break; }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&bw); PyBuffer_Release(&bk);
    return PyLong_FromSsize_t(bad);
}

