/* Compiled kernels of the sparse table's hot path (lookup and push), optional.
 *
 * ps_server/kernels.py loads this module when it was built (pip install builds it with the C
 * compiler it finds; setup.py makes the build optional) and falls back to the numpy code
 * otherwise. Both paths compute the same thing; tests/test_ps_kernels.py checks them against
 * each other. Arrays arrive through the buffer protocol (no numpy headers needed); kernels run
 * without the GIL so gRPC threads keep moving bytes meanwhile.
 *
 *   probe(slots i32[S], stored_keys i64[C], query i64[n], out i64[n])
 *       the row of each key in the open-addressing index of ps_server/hash_index.py
 *       (home slot = mix64(key ^ INDEX_SALT) & (S - 1), linear probing, -1 empty,
 *       -2 tombstone), -1 where absent.
 *   scatter(src [n, ...], positions i64[n], dst [C, ...])
 *       dst[positions[i]] = src[i] (the client's reply rows back into the caller's order).
 *   owned(keys i64[n], salt u64, owned u8[num_shards]) -> position or -1
 *       the first key whose shard (mix64(key ^ salt) % num_shards) has owned[shard] == 0,
 *       -1 when this server owns every key (the servers' routing check).
 *   push(rule, hyper f64[8], values f32[C,dim], state f32[C,sd], count u32[C], unseen u16[C],
 *        flags u8[C], rows i64[n], grads f32[n,dim]) -> distinct rows updated
 *       sums the gradients of duplicated rows (float64 accumulation, occurrence order), then
 *       applies rule 0 = sgd, 1 = adagrad, 2 = adam with the same float32 arithmetic as
 *       ps_server/optimizers.py, clips to the weight bounds, adds the occurrences to count
 *       (saturating), sets unseen = 0 and flags |= SEEN | DIRTY.
 *   group(keys i64[n], salt u64, num_shards, num_servers, out i64[n][, keys_out i64[n]])
 *         -> [count per server]
 *       the client's routing (ps_server/routing.py): server = mix64(key ^ salt) % num_shards
 *       % num_servers; out = the positions of the keys grouped by server, ascending within
 *       a server (a stable counting sort); keys_out = keys[out], written in the same pass.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INDEX_SALT 0x2545F4914F6CDD1DULL
#define FLAG_DIRTY 2
#define FLAG_SEEN 4
#define FLAG_MARK 0x80 /* transient, inside push only (never left set) */

static inline uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* A buffer with an expected item size and writability; returns 0 and sets an error if not. */
static int get_buf(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable,
                   const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) != 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected a C-contiguous%s array", name,
                     writable ? " writable" : "");
        return 0;
    }
    if (itemsize > 0 && view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: expected %zd-byte items, got %zd", name, itemsize,
                     view->itemsize);
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

static PyObject *k_probe(PyObject *self, PyObject *args) {
    PyObject *o_slots, *o_keys, *o_query, *o_out;
    if (!PyArg_ParseTuple(args, "OOOO", &o_slots, &o_keys, &o_query, &o_out)) return NULL;
    Py_buffer b_slots, b_keys, b_query, b_out;
    if (!get_buf(o_slots, &b_slots, 4, 0, "slots")) return NULL;
    if (!get_buf(o_keys, &b_keys, 8, 0, "stored_keys")) goto e1;
    if (!get_buf(o_query, &b_query, 8, 0, "query")) goto e2;
    if (!get_buf(o_out, &b_out, 8, 1, "out")) goto e3;
    Py_ssize_t nslots = b_slots.len / 4, ncap = b_keys.len / 8, n = b_query.len / 8;
    if (b_out.len / 8 != n || nslots == 0 || (nslots & (nslots - 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, "probe: out must match query; slots a power of two");
        goto e4;
    }
    const int32_t *slots = (const int32_t *)b_slots.buf;
    const int64_t *stored = (const int64_t *)b_keys.buf;
    const int64_t *query = (const int64_t *)b_query.buf;
    int64_t *out = (int64_t *)b_out.buf;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    uint64_t mask = (uint64_t)nslots - 1;
    /* memory latency dominates (random slots, random keys): keep many loads in flight by
       prefetching the home slot PF keys ahead and the key it points to PF/2 ahead */
    enum { PF = 16 };
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PF < n) __builtin_prefetch(&slots[mix64((uint64_t)query[i + PF] ^ INDEX_SALT) & mask]);
        if (i + PF / 2 < n) {
            int32_t ahead = slots[mix64((uint64_t)query[i + PF / 2] ^ INDEX_SALT) & mask];
            if (ahead >= 0 && ahead < ncap) __builtin_prefetch(&stored[ahead]);
        }
        int64_t key = query[i];
        uint64_t pos = mix64((uint64_t)key ^ INDEX_SALT) & mask;
        int64_t row = -1;
        for (Py_ssize_t step = 0; step < nslots; step++) {
            int32_t r = slots[pos];
            if (r == -1) break;
            if (r >= 0) {
                if (r >= ncap) { bad = 1; break; }
                if (stored[r] == key) { row = r; break; }
            }
            pos = (pos + 1) & mask;
        }
        out[i] = row;
    }
    Py_END_ALLOW_THREADS
    if (bad) PyErr_SetString(PyExc_ValueError, "probe: a slot points past the key column");
    PyBuffer_Release(&b_out); PyBuffer_Release(&b_query); PyBuffer_Release(&b_keys);
    PyBuffer_Release(&b_slots);
    if (bad) return NULL;
    Py_RETURN_NONE;
e4: PyBuffer_Release(&b_out);
e3: PyBuffer_Release(&b_query);
e2: PyBuffer_Release(&b_keys);
e1: PyBuffer_Release(&b_slots);
    return NULL;
}

enum { RULE_SGD = 0, RULE_ADAGRAD = 1, RULE_ADAM = 2 };

/* One row's update: w[dim], st[sd], g[dim] (float32, summed). */
static inline void apply_row(int rule, const double *h, float *w, float *st, const float *g,
                             Py_ssize_t dim) {
    float lr = (float)h[0];
    if (rule == RULE_SGD) {
        for (Py_ssize_t j = 0; j < dim; j++) w[j] -= lr * g[j];
    } else if (rule == RULE_ADAGRAD) {
        float eps = (float)h[1];
        for (Py_ssize_t j = 0; j < dim; j++) {
            st[j] += g[j] * g[j];
            float sd = sqrtf(st[j]);
            sd += eps;
            w[j] -= lr * (g[j] / sd);
        }
    } else {
        double b1 = h[1], b2 = h[2];
        float eps = (float)h[3];
        float *m = st, *v = st + dim, *step = st + 2 * dim;
        float omb1 = (float)(1.0 - b1), fb2 = (float)b2, omb2 = (float)(1.0 - b2);
        *step += 1.0f;
        double t = (double)*step;
        float step_size = (float)(h[0] / (1.0 - pow(b1, t)));
        float bc2 = (float)sqrt(1.0 - pow(b2, t));
        for (Py_ssize_t j = 0; j < dim; j++) {
            m[j] += omb1 * (g[j] - m[j]);
            v[j] *= fb2;
            v[j] += omb2 * (g[j] * g[j]);
            float denom = sqrtf(v[j]) / bc2;
            denom += eps;
            w[j] -= step_size * (m[j] / denom);
        }
    }
    if (h[6] != 0.0) {
        float lo = (float)h[4], hi = (float)h[5];
        for (Py_ssize_t j = 0; j < dim; j++) w[j] = w[j] < lo ? lo : (w[j] > hi ? hi : w[j]);
    }
}

static PyObject *k_push(PyObject *self, PyObject *args) {
    int rule;
    PyObject *o_h, *o_w, *o_st, *o_cnt, *o_uns, *o_flags, *o_rows, *o_g;
    if (!PyArg_ParseTuple(args, "iOOOOOOOO", &rule, &o_h, &o_w, &o_st, &o_cnt, &o_uns, &o_flags,
                          &o_rows, &o_g))
        return NULL;
    if (rule < RULE_SGD || rule > RULE_ADAM) {
        PyErr_Format(PyExc_ValueError, "push: unknown rule %d", rule);
        return NULL;
    }
    Py_buffer bh, bw, bst, bc, bu, bf, br, bg;
    int got = 0;
    PyObject *result = NULL;
    if (!get_buf(o_h, &bh, 8, 0, "hyper")) goto done; got = 1;
    if (!get_buf(o_w, &bw, 4, 1, "values")) goto done; got = 2;
    if (!get_buf(o_st, &bst, 4, 1, "state")) goto done; got = 3;
    if (!get_buf(o_cnt, &bc, 4, 1, "count")) goto done; got = 4;
    if (!get_buf(o_uns, &bu, 2, 1, "unseen")) goto done; got = 5;
    if (!get_buf(o_flags, &bf, 1, 1, "flags")) goto done; got = 6;
    if (!get_buf(o_rows, &br, 8, 0, "rows")) goto done; got = 7;
    if (!get_buf(o_g, &bg, 4, 0, "grads")) goto done; got = 8;
    {
        Py_ssize_t cap = bc.len / 4, n = br.len / 8;
        if (bh.len / 8 < 7 || cap == 0 || bw.len / 4 % cap != 0 || bst.len / 4 % cap != 0 ||
            bu.len / 2 != cap || bf.len != cap) {
            PyErr_SetString(PyExc_ValueError, "push: column shapes disagree");
            goto done;
        }
        Py_ssize_t dim = bw.len / 4 / cap, sd = bst.len / 4 / cap;
        Py_ssize_t need_sd = rule == RULE_SGD ? 0 : (rule == RULE_ADAGRAD ? dim : 2 * dim + 1);
        if ((n > 0 && bg.len / 4 != n * dim) || sd != need_sd) {
            PyErr_SetString(PyExc_ValueError, "push: grads or state have the wrong width");
            goto done;
        }
        const int64_t *rows = (const int64_t *)br.buf;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (rows[i] < 0 || rows[i] >= cap) {
                PyErr_Format(PyExc_ValueError, "push: row %lld out of range", (long long)rows[i]);
                goto done;
            }
        }
        /* distinct rows through a small open-addressing table over the batch (slot = 1 +
           index into urow, 0 = empty). Without duplicates distinct row u is occurrence u and
           its gradient is applied as it is. With duplicates the occurrences are grouped per
           distinct row by a stable counting sort (start/order: 4 bytes per key), and each
           group is summed in float64 in occurrence order into one dim-wide buffer — no
           batch-sized float64 array, whose fresh pages cost more than the sum itself. */
        Py_ssize_t tsize = 16;
        while (tsize < 2 * n) tsize <<= 1;
        Py_ssize_t n1 = n ? n : 1, d1 = dim ? dim : 1;
        int32_t *table = calloc(tsize, sizeof(int32_t));
        int32_t *uid = malloc(sizeof(int32_t) * n1);
        int64_t *urow = malloc(sizeof(int64_t) * n1);
        uint32_t *occ = malloc(sizeof(uint32_t) * n1);
        int32_t *start = malloc(sizeof(int32_t) * (n1 + 1));
        int32_t *order = malloc(sizeof(int32_t) * n1);
        float *g32 = malloc(sizeof(float) * d1);
        double *acc = malloc(sizeof(double) * d1);
        if (!table || !uid || !urow || !occ || !start || !order || !g32 || !acc) {
            free(table); free(uid); free(urow); free(occ); free(start); free(order);
            free(g32); free(acc);
            PyErr_NoMemory();
            goto done;
        }
        Py_ssize_t nu = 0;
        const double *h = (const double *)bh.buf;
        float *w = (float *)bw.buf, *st = (float *)bst.buf;
        uint32_t *count = (uint32_t *)bc.buf;
        uint16_t *unseen = (uint16_t *)bu.buf;
        uint8_t *flags = (uint8_t *)bf.buf;
        const float *g = (const float *)bg.buf;
        Py_BEGIN_ALLOW_THREADS
        /* A batch of distinct rows (what trainers send: DistributedEmbedding deduplicates) is
           recognised with one transient bit of the row flags, one access per key to an array
           the update touches anyway, instead of the batch hash table. The bit is cleared by
           the update below, or right here when a duplicate turns up. */
        Py_ssize_t marked = 0;
        while (marked < n && !(flags[rows[marked]] & FLAG_MARK)) {
            if (marked + 16 < n) __builtin_prefetch(flags + rows[marked + 16], 1);
            flags[rows[marked++]] |= FLAG_MARK;
        }
        int distinct = marked == n;
        if (!distinct)
            for (Py_ssize_t i = 0; i < marked; i++) flags[rows[i]] &= (uint8_t)~FLAG_MARK;
        uint64_t mask = (uint64_t)tsize - 1;
        for (Py_ssize_t i = 0; !distinct && i < n; i++) {
            int64_t r = rows[i];
            uint64_t p = mix64((uint64_t)r) & mask;
            while (table[p] != 0 && urow[table[p] - 1] != r) p = (p + 1) & mask;
            if (table[p] == 0) {
                table[p] = (int32_t)(nu + 1);
                urow[nu] = r;
                occ[nu] = 0;
                nu++;
            }
            uid[i] = table[p] - 1;
            occ[uid[i]]++;
        }
        if (distinct) nu = n; /* urow / occ stay untouched: row u is rows[u], seen once */
        const int64_t *ur = distinct ? rows : urow;
        int dups = nu < n;
        if (dups) {
            start[0] = 0;
            for (Py_ssize_t u = 0; u < nu; u++) start[u + 1] = start[u] + (int32_t)occ[u];
            for (Py_ssize_t i = 0; i < n; i++) order[start[uid[i]]++] = (int32_t)i;
            for (Py_ssize_t u = nu; u > 0; u--) start[u] = start[u - 1];  /* back to starts */
            start[0] = 0;
        }
        for (Py_ssize_t u = 0; u < nu; u++) {
            int64_t r = ur[u];
            if (u + 24 < nu) { /* the same latency argument as in probe */
                int64_t q = ur[u + 24];
                __builtin_prefetch(w + q * dim, 1);
                if (sd) __builtin_prefetch(st + q * sd, 1);
                __builtin_prefetch(count + q, 1);
                __builtin_prefetch(unseen + q, 1);
                __builtin_prefetch(flags + q, 1);
            }
            const float *gu = g + u * dim; /* no duplicates: distinct row u is occurrence u */
            if (dups) {
                const int32_t *o = order + start[u];
                gu = g + (Py_ssize_t)o[0] * dim;
                if (occ[u] > 1) {
                    for (Py_ssize_t j = 0; j < dim; j++) acc[j] = (double)gu[j];
                    for (uint32_t k = 1; k < occ[u]; k++) {
                        const float *gk = g + (Py_ssize_t)o[k] * dim;
                        for (Py_ssize_t j = 0; j < dim; j++) acc[j] += (double)gk[j];
                    }
                    for (Py_ssize_t j = 0; j < dim; j++) g32[j] = (float)acc[j];
                    gu = g32;
                }
            }
            apply_row(rule, h, w + r * dim, st + r * sd, gu, dim);
            uint64_t c = (uint64_t)count[r] + (distinct ? 1U : occ[u]);
            count[r] = c > 0xFFFFFFFFULL ? 0xFFFFFFFFU : (uint32_t)c;
            unseen[r] = 0;
            flags[r] = (uint8_t)((flags[r] & ~FLAG_MARK) | FLAG_SEEN | FLAG_DIRTY);
        }
        Py_END_ALLOW_THREADS
        free(table); free(uid); free(urow); free(occ); free(start); free(order); free(g32);
        free(acc);
        result = PyLong_FromSsize_t(nu);
    }
done:
    if (got >= 8) PyBuffer_Release(&bg);
    if (got >= 7) PyBuffer_Release(&br);
    if (got >= 6) PyBuffer_Release(&bf);
    if (got >= 5) PyBuffer_Release(&bu);
    if (got >= 4) PyBuffer_Release(&bc);
    if (got >= 3) PyBuffer_Release(&bst);
    if (got >= 2) PyBuffer_Release(&bw);
    if (got >= 1) PyBuffer_Release(&bh);
    return result;
}

static PyObject *k_group(PyObject *self, PyObject *args) {
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

/* The index array and the two row arrays of a row copy (scatter); 0 and an error if they do
   not fit (rows: len(idx) rows of `few`, `many` a whole number of such rows). */
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

static PyObject *k_scatter(PyObject *self, PyObject *args) {
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

static PyObject *k_owned(PyObject *self, PyObject *args) {
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

static PyMethodDef methods[] = {
    {"scatter", k_scatter, METH_VARARGS, "scatter(src, positions, dst): dst[positions] = src"},
    {"owned", k_owned, METH_VARARGS, "owned(keys, salt, owned) -> first unowned position or -1"},
    {"probe", k_probe, METH_VARARGS, "probe(slots, stored_keys, query, out): rows of keys"},
    {"push", k_push, METH_VARARGS,
     "push(rule, hyper, values, state, count, unseen, flags, rows, grads) -> distinct rows"},
    {"group", k_group, METH_VARARGS,
     "group(keys, salt, num_shards, num_servers, out[, keys_out]) -> [count per server]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                                    "Compiled sparse-table kernels (see kernels.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
