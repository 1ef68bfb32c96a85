/* Row copies (gather, scatter), the routing hashes (group, owned) and row creation (insert,
 * distinct, uniform, normal) of the compiled kernels; documented with the others at the top of _kernels.c. */
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

/* pack(records u8[n * stride], template u8[stride], rows i64[n], fields[, threads]): record i =
   the template with each field (src, row_bytes, offset) of `fields` set to row rows[i] of its
   src: an SSD table's evicted rows packed in one pass over the records, no temporaries. */
enum { PACK_MAX_FIELDS = 8 };
typedef struct {
    const char *src[PACK_MAX_FIELDS];
    Py_ssize_t rb[PACK_MAX_FIELDS], off[PACK_MAX_FIELDS];
    int nf;
    const char *tmpl;
    const int64_t *idx;
    char *out;
    Py_ssize_t stride;
} pack_ctx;

static int pack_part(void *arg, int part, Py_ssize_t lo, Py_ssize_t hi) {
    const pack_ctx *c = (const pack_ctx *)arg;
    (void)part;
    enum { PF = 16 };
    for (Py_ssize_t i = lo; i < hi; i++) {
        if (i + PF < hi)
            for (int f = 0; f < c->nf; f++)
                __builtin_prefetch(c->src[f] + c->idx[i + PF] * c->rb[f]);
        char *rec = c->out + i * c->stride;
        memcpy(rec, c->tmpl, (size_t)c->stride);
        for (int f = 0; f < c->nf; f++)
            memcpy(rec + c->off[f], c->src[f] + c->idx[i] * c->rb[f], (size_t)c->rb[f]);
    }
    return 0;
}

PyObject *psk_pack(PyObject *self, PyObject *args) {
    PyObject *o_out, *o_tmpl, *o_idx, *o_fields;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OOOO!|i", &o_out, &o_tmpl, &o_idx, &PyTuple_Type, &o_fields,
                          &threads))
        return NULL;
    Py_ssize_t nf = PyTuple_GET_SIZE(o_fields);
    if (nf > PACK_MAX_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "pack: at most 8 fields");
        return NULL;
    }
    Py_buffer bo, bt, bi, bf[PACK_MAX_FIELDS];
    int got = 0;
    const char *err = NULL;
    pack_ctx c;
    c.nf = (int)nf;
    if (!get_buf(o_out, &bo, 1, 1, "records")) return NULL;
    if (!get_buf(o_tmpl, &bt, 1, 0, "template")) { PyBuffer_Release(&bo); return NULL; }
    if (!get_buf(o_idx, &bi, 8, 0, "rows")) {
        PyBuffer_Release(&bt); PyBuffer_Release(&bo); return NULL;
    }
    Py_ssize_t n = bi.len / 8, stride = bt.len;
    c.idx = (const int64_t *)bi.buf;
    if (stride < 1 || bo.len != n * stride) err = "records must be one template-sized record a row";
    for (; !err && got < (int)nf; got++) {
        PyObject *o_src;
        Py_ssize_t rb, off;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(o_fields, got), "Onn", &o_src, &rb, &off)) break;
        if (!get_buf(o_src, &bf[got], -1, 0, "src")) break;
        Py_ssize_t cap = rb > 0 ? bf[got].len / rb : 0;
        c.src[got] = (const char *)bf[got].buf;
        c.rb[got] = rb;
        c.off[got] = off;
        if (rb < 1 || bf[got].len != cap * rb) err = "a field's src must be whole rows";
        else if (off < 0 || off + rb > stride) err = "a field must fit the record";
        for (Py_ssize_t i = 0; !err && i < n; i++)
            if (c.idx[i] < 0 || c.idx[i] >= cap) err = "a row is out of range";
    }
    if (!err && got == (int)nf) {
        c.tmpl = (const char *)bt.buf;
        c.out = (char *)bo.buf;
        c.stride = stride;
        Py_BEGIN_ALLOW_THREADS
        run_parts(threads, n, pack_part, &c);
        Py_END_ALLOW_THREADS
    } else if (err) {
        PyErr_Format(PyExc_ValueError, "pack: %s", err); /* `got` counts the field's buffer */
    }
    int ok = !err && !PyErr_Occurred();
    for (int f = 0; f < got; f++) PyBuffer_Release(&bf[f]);
    PyBuffer_Release(&bi); PyBuffer_Release(&bt); PyBuffer_Release(&bo);
    if (!ok) return NULL;
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


/* -- row creation ------------------------------------------------------------------------- */

/* Puts row `row` (key `key`) in the first empty slot from the key's home slot on; 0 if full. */
static inline int place(int32_t *slots, uint64_t mask, int64_t key, int32_t row) {
    uint64_t pos = mix64((uint64_t)key ^ INDEX_SALT) & mask;
    for (uint64_t step = 0; step <= mask; step++) {
        if (slots[pos] == -1) {
            slots[pos] = row;
            return 1;
        }
        pos = (pos + 1) & mask;
    }
    return 0;
}

/* insert(slots, stored_keys, query, rows) or, with query None, reindex: the live rows (>= 0) of
   the slot array `rows` (i32, an old index) placed into `slots` (a new one). */
PyObject *psk_insert(PyObject *self, PyObject *args) {
    PyObject *o_slots, *o_keys, *o_query, *o_rows;
    if (!PyArg_ParseTuple(args, "OOOO", &o_slots, &o_keys, &o_query, &o_rows)) return NULL;
    int reindex = o_query == Py_None;
    Py_buffer bs, bk, bq, br;
    if (!get_buf(o_slots, &bs, 4, 1, "slots")) return NULL;
    if (!get_buf(o_keys, &bk, 8, 0, "stored_keys")) { PyBuffer_Release(&bs); return NULL; }
    if (!reindex && !get_buf(o_query, &bq, 8, 0, "query")) {
        PyBuffer_Release(&bk); PyBuffer_Release(&bs); return NULL;
    }
    if (!get_buf(o_rows, &br, reindex ? 4 : 8, 0, "rows")) {
        if (!reindex) PyBuffer_Release(&bq);
        PyBuffer_Release(&bk); PyBuffer_Release(&bs); return NULL;
    }
    Py_ssize_t nslots = bs.len / 4, ncap = bk.len / 8;
    Py_ssize_t n = reindex ? br.len / 4 : bq.len / 8;
    const char *err = NULL;
    if ((!reindex && br.len / 8 != n) || nslots == 0 || (nslots & (nslots - 1)) != 0)
        err = "insert: rows must match query; slots a power of two";
    const int64_t *rows64 = (const int64_t *)br.buf;
    const int32_t *rows32 = (const int32_t *)br.buf;
    for (Py_ssize_t i = 0; !err && i < n; i++) {
        int64_t r = reindex ? rows32[i] : rows64[i];
        if (r >= ncap || r > INT32_MAX || (!reindex && r < 0))
            err = "insert: a row is outside the key column";
    }
    if (!err) {
        int32_t *slots = (int32_t *)bs.buf;
        const int64_t *keys = (const int64_t *)bk.buf;
        const int64_t *query = reindex ? NULL : (const int64_t *)bq.buf;
        uint64_t mask = (uint64_t)nslots - 1;
        int full = 0;
        Py_BEGIN_ALLOW_THREADS
        enum { PF = 16 };
        if (reindex) { /* the old slots in order: their keys are random reads, prefetched, and
                          the new slots are written nearly in order */
            for (Py_ssize_t i = 0; i < n && !full; i++) {
                if (i + PF < n && rows32[i + PF] >= 0) __builtin_prefetch(&keys[rows32[i + PF]]);
                if (rows32[i] >= 0) full = !place(slots, mask, keys[rows32[i]], rows32[i]);
            }
        } else {
            for (Py_ssize_t i = 0; i < n && !full; i++) {
                if (i + PF < n)
                    __builtin_prefetch(
                        &slots[mix64((uint64_t)query[i + PF] ^ INDEX_SALT) & mask], 1);
                full = !place(slots, mask, query[i], (int32_t)rows64[i]);
            }
        }
        Py_END_ALLOW_THREADS
        if (full) err = "insert: the index has no empty slot";
    }
    if (err) PyErr_SetString(PyExc_ValueError, err);
    PyBuffer_Release(&br);
    if (!reindex) PyBuffer_Release(&bq);
    PyBuffer_Release(&bk); PyBuffer_Release(&bs);
    if (err) return NULL;
    Py_RETURN_NONE;
}

typedef struct {
    const uint64_t *keys;
    const int64_t *rows; /* NULL: row i is dst row i */
    float *dst;
    uint64_t stream;
    double low, span;
    Py_ssize_t dim;
} uniform_ctx;

static int uniform_part(void *arg, int part, Py_ssize_t lo, Py_ssize_t hi) {
    const uniform_ctx *c = (const uniform_ctx *)arg;
    (void)part;
    Py_ssize_t dim = c->dim;
    for (Py_ssize_t i = lo; i < hi; i++) {
        /* hashing.KeyRNG(table, seed, keys, "init").column_uniform(dim), then Uniform.generate:
           the same uint64 words, the same float64 arithmetic, one rounding to float32 */
        uint64_t base = mix64(mix64(c->keys[i]) ^ c->stream);
        float *out = c->dst + (c->rows ? c->rows[i] : i) * dim;
        for (Py_ssize_t j = 0; j < dim; j++) {
            uint64_t bits = mix64(base + (((uint64_t)j << 9) + 1) * 0x9E3779B97F4A7C15ULL);
            double u = (double)(bits >> 11) * (1.0 / 9007199254740992.0);
            out[j] = (float)(c->low + c->span * u);
        }
    }
    return 0;
}

/* The buffers of a row-creation call (keys, dst float32[rows, dim], optional rows): opened and
   checked by rows_open (0 with a Python error set: every buffer released), released by
   rows_close. */
typedef struct {
    Py_buffer bk, bd, br;
    int with_rows;
    const int64_t *rows; /* NULL: row i is dst row i */
    Py_ssize_t n;
} rows_bufs;

static int rows_open(rows_bufs *b, const char *name, PyObject *o_keys, PyObject *o_dst,
                     PyObject *o_rows, Py_ssize_t dim) {
    b->with_rows = o_rows != Py_None;
    if (!get_buf(o_keys, &b->bk, 8, 0, "keys")) return 0;
    if (!get_buf(o_dst, &b->bd, 4, 1, "dst")) { PyBuffer_Release(&b->bk); return 0; }
    if (b->with_rows && !get_buf(o_rows, &b->br, 8, 0, "rows")) {
        PyBuffer_Release(&b->bd); PyBuffer_Release(&b->bk); return 0;
    }
    Py_ssize_t n = b->bk.len / 8, cap = dim > 0 ? b->bd.len / 4 / dim : 0;
    const char *err = NULL;
    if (dim < 1 || b->bd.len != cap * dim * 4) err = "dst must be float32[rows, dim]";
    else if (b->with_rows ? b->br.len / 8 != n : cap != n) err = "one row per key";
    b->rows = b->with_rows ? (const int64_t *)b->br.buf : NULL;
    for (Py_ssize_t i = 0; !err && b->rows && i < n; i++)
        if (b->rows[i] < 0 || b->rows[i] >= cap) err = "a row is out of range";
    b->n = n;
    if (err) {
        PyErr_Format(PyExc_ValueError, "%s: %s", name, err);
        if (b->with_rows) PyBuffer_Release(&b->br);
        PyBuffer_Release(&b->bd); PyBuffer_Release(&b->bk);
        return 0;
    }
    return 1;
}

static void rows_close(rows_bufs *b) {
    if (b->with_rows) PyBuffer_Release(&b->br);
    PyBuffer_Release(&b->bd); PyBuffer_Release(&b->bk);
}

PyObject *psk_uniform(PyObject *self, PyObject *args) {
    PyObject *o_keys, *o_dst, *o_rows = Py_None;
    unsigned long long stream;
    double low, span;
    Py_ssize_t dim;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OKddnO|Oi", &o_keys, &stream, &low, &span, &dim, &o_dst,
                          &o_rows, &threads))
        return NULL;
    rows_bufs b;
    if (!rows_open(&b, "uniform", o_keys, o_dst, o_rows, dim)) return NULL;
    uniform_ctx c = {(const uint64_t *)b.bk.buf, b.rows, (float *)b.bd.buf, stream, low, span,
                     dim};
    Py_BEGIN_ALLOW_THREADS
    run_parts(threads, b.n, uniform_part, &c);
    Py_END_ALLOW_THREADS
    rows_close(&b);
    Py_RETURN_NONE;
}

typedef struct {
    const uint64_t *keys;
    const int64_t *rows; /* NULL: row i is dst row i */
    float *dst;
    uint64_t stream, attempt;
    double mean, std;
    Py_ssize_t dim;
} normal_ctx;

static int normal_part(void *arg, int part, Py_ssize_t lo, Py_ssize_t hi) {
    const normal_ctx *c = (const normal_ctx *)arg;
    (void)part;
    Py_ssize_t dim = c->dim;
    const double two_pi = 2.0 * 3.141592653589793;
    for (Py_ssize_t i = lo; i < hi; i++) {
        /* hashing.KeyRNG(table, seed, keys, "init").normal(dim, attempt), then Normal.generate:
           u1 = 1 - unit(j << 9 | a << 1), u2 = unit(... | 1), z = sqrt(-2 log u1) cos(2 pi u2),
           float32(mean + std * z); the same float64 operations in the same order */
        uint64_t base = mix64(mix64(c->keys[i]) ^ c->stream);
        float *out = c->dst + (c->rows ? c->rows[i] : i) * dim;
        for (Py_ssize_t j = 0; j < dim; j++) {
            uint64_t ctr = ((uint64_t)j << 9) | (c->attempt << 1);
            uint64_t b1 = mix64(base + (ctr + 1) * 0x9E3779B97F4A7C15ULL);
            uint64_t b2 = mix64(base + ((ctr | 1) + 1) * 0x9E3779B97F4A7C15ULL);
            double u1 = 1.0 - (double)(b1 >> 11) * (1.0 / 9007199254740992.0);
            double u2 = (double)(b2 >> 11) * (1.0 / 9007199254740992.0);
            double z = sqrt(-2.0 * log(u1)) * cos(two_pi * u2);
            out[j] = (float)(c->mean + c->std * z);
        }
    }
    return 0;
}

PyObject *psk_normal(PyObject *self, PyObject *args) {
    PyObject *o_keys, *o_dst, *o_rows = Py_None;
    unsigned long long stream, attempt;
    double mean, std;
    Py_ssize_t dim;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OKKddnO|Oi", &o_keys, &stream, &attempt, &mean, &std, &dim,
                          &o_dst, &o_rows, &threads))
        return NULL;
    if (attempt >= 256) {
        PyErr_SetString(PyExc_ValueError, "normal: attempt must be in [0, 256)");
        return NULL;
    }
    rows_bufs b;
    if (!rows_open(&b, "normal", o_keys, o_dst, o_rows, dim)) return NULL;
    normal_ctx c = {(const uint64_t *)b.bk.buf, b.rows, (float *)b.bd.buf, stream, attempt,
                    mean, std, dim};
    Py_BEGIN_ALLOW_THREADS
    run_parts(threads, b.n, normal_part, &c);
    Py_END_ALLOW_THREADS
    rows_close(&b);
    Py_RETURN_NONE;
}

PyObject *psk_distinct(PyObject *self, PyObject *args) {
    PyObject *o_keys, *o_uniq, *o_inv, *o_cnt;
    if (!PyArg_ParseTuple(args, "OOOO", &o_keys, &o_uniq, &o_inv, &o_cnt)) return NULL;
    Py_buffer bk, bu, bi, bc;
    if (!get_buf(o_keys, &bk, 8, 0, "keys")) return NULL;
    if (!get_buf(o_uniq, &bu, 8, 1, "uniq")) { PyBuffer_Release(&bk); return NULL; }
    if (!get_buf(o_inv, &bi, 8, 1, "inverse")) {
        PyBuffer_Release(&bu); PyBuffer_Release(&bk); return NULL;
    }
    if (!get_buf(o_cnt, &bc, 8, 1, "counts")) {
        PyBuffer_Release(&bi); PyBuffer_Release(&bu); PyBuffer_Release(&bk); return NULL;
    }
    Py_ssize_t n = bk.len / 8, nu = -1;
    int32_t *table = NULL;
    Py_ssize_t tsize = 16;
    while (tsize < 2 * n) tsize <<= 1;
    if (bu.len / 8 != n || bi.len / 8 != n || bc.len / 8 != n || n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "distinct: uniq, inverse and counts need n slots");
    } else if (!(table = calloc((size_t)tsize, sizeof(int32_t)))) {
        PyErr_NoMemory();
    } else {
        const int64_t *k = (const int64_t *)bk.buf;
        int64_t *u = (int64_t *)bu.buf, *inv = (int64_t *)bi.buf, *cnt = (int64_t *)bc.buf;
        uint64_t mask = (uint64_t)tsize - 1;
        nu = 0;
        Py_BEGIN_ALLOW_THREADS
        enum { PF = 16 };
        for (Py_ssize_t i = 0; i < n; i++) {
            if (i + PF < n) __builtin_prefetch(&table[mix64((uint64_t)k[i + PF]) & mask]);
            uint64_t p = mix64((uint64_t)k[i]) & mask;
            while (table[p] != 0 && u[table[p] - 1] != k[i]) p = (p + 1) & mask;
            if (table[p] == 0) { /* slot = 1 + index into u, 0 = empty */
                table[p] = (int32_t)(nu + 1);
                u[nu] = k[i];
                cnt[nu] = 0;
                nu++;
            }
            inv[i] = table[p] - 1;
            cnt[inv[i]]++;
        }
        Py_END_ALLOW_THREADS
        free(table);
    }
    PyBuffer_Release(&bc); PyBuffer_Release(&bi); PyBuffer_Release(&bu); PyBuffer_Release(&bk);
    return nu < 0 ? NULL : PyLong_FromSsize_t(nu);
}
