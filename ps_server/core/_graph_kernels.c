/* Compiled loops of the graph tables (ps_server/core/graph_kernels.py loads them; numpy otherwise).
 *
 * parse_edges(data, src, dst, weight) -> (n, weighted) or None
 *     Parses "src<TAB>dst[<TAB>weight]" lines of the bytes object `data` into the int64 buffers
 *     src, dst and the float32 buffer weight (one slot per line at least); blank lines are
 *     skipped. None when a line is anything else (the caller's line-by-line scan names it).
 * radix_order(keys, lo, key_bits, order, sorted)
 *     The stable sorting permutation of int64 keys in [lo, lo + 2^key_bits) into order and the
 *     sorted keys into sorted: each key packed above its position into one word, then LSD radix
 *     passes of 11 bits over the key bits only (positions stay in order: every pass is stable).
 * owned_mask(keys, salt, num_shards, num_servers, index, out)
 *     out[i] = 1 where mix64(keys[i] ^ salt) % num_shards % num_servers == index (uint8).
 * sample_uniform(src, indptr, nodes, fanout, seed, pos, counts) -> total
 *     For each node (binary search in the sorted src), up to `fanout` distinct CSR positions of
 *     its edges: all of them in CSR order when the degree is <= fanout, else a uniform subset
 *     (Floyd's algorithm on a splitmix64 stream seeded by `seed`); appended to pos in node order.
 * place_segments(offsets, positions, counts, values, out)
 *     Jagged per-server replies back in the caller's order: the counts[i] items of position
 *     positions[i] (taken from values in turn) go to out[offsets[p] : offsets[p + 1]].
 * All loops run without the GIL.
 */
#include "_kernels_common.h" /* Python.h, get_buf, mix64 */

/* -- parse_edges ---------------------------------------------------------------------------- */
static inline int is_pad(char c) { return c == ' ' || c == '\r'; }

/* An int64 token in [p, end) with optional padding and sign; 0 if not exactly one. */
static int parse_i64(const char *p, const char *end, int64_t *out) {
    while (p < end && is_pad(*p)) p++;
    while (end > p && is_pad(end[-1])) end--;
    int neg = 0;
    if (p < end && (*p == '-' || *p == '+')) { neg = *p == '-'; p++; }
    if (p == end || end - p > 19) return 0;
    uint64_t v = 0;
    for (; p < end; p++) {
        unsigned d = (unsigned)(*p - '0');
        if (d > 9) return 0;
        v = v * 10 + d;
    }
    if (neg ? v > (uint64_t)INT64_MAX + 1 : v > (uint64_t)INT64_MAX) return 0;
    *out = neg ? (int64_t)(0 - v) : (int64_t)v;
    return 1;
}

/* A decimal float token (digits, sign, point, exponent only; nan/inf/underscores go to the
   Python path); 0 if not exactly one. */
static int parse_f(const char *p, const char *end, float *out) {
    while (p < end && is_pad(*p)) p++;
    while (end > p && is_pad(end[-1])) end--;
    Py_ssize_t n = end - p;
    if (n == 0 || n > 63) return 0;
    char tmp[64];
    for (Py_ssize_t i = 0; i < n; i++) {
        char c = p[i];
        if (!((c >= '0' && c <= '9') || c == '.' || c == '-' || c == '+' || c == 'e' || c == 'E'))
            return 0;
        tmp[i] = c;
    }
    tmp[n] = 0;
    char *stop;
    double v = strtod(tmp, &stop);
    if (stop != tmp + n) return 0;
    *out = (float)v;
    return 1;
}

static PyObject *gk_parse_edges(PyObject *self, PyObject *args) {
    PyObject *o_data, *o_src, *o_dst, *o_w;
    if (!PyArg_ParseTuple(args, "SOOO", &o_data, &o_src, &o_dst, &o_w)) return NULL;
    Py_buffer bs, bd, bw;
    if (!get_buf(o_src, &bs, 8, 1, "src")) return NULL;
    if (!get_buf(o_dst, &bd, 8, 1, "dst")) { PyBuffer_Release(&bs); return NULL; }
    if (!get_buf(o_w, &bw, 4, 1, "weight")) {
        PyBuffer_Release(&bd); PyBuffer_Release(&bs); return NULL;
    }
    const char *p = PyBytes_AS_STRING(o_data), *end = p + PyBytes_GET_SIZE(o_data);
    Py_ssize_t cap = bs.len / 8, n = 0;
    int ok = bd.len / 8 >= cap && bw.len / 4 >= cap, weighted = 0;
    int64_t *src = (int64_t *)bs.buf, *dst = (int64_t *)bd.buf;
    float *w = (float *)bw.buf;
    Py_BEGIN_ALLOW_THREADS
    while (ok && p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *le = nl ? nl : end;
        const char *t1 = memchr(p, '\t', (size_t)(le - p));
        if (!t1) { /* blank (padding only) or malformed */
            for (const char *q = p; q < le; q++)
                if (!is_pad(*q)) { ok = 0; break; }
        } else if (n >= cap) {
            ok = 0;
        } else {
            const char *f2 = t1 + 1;
            const char *t2 = memchr(f2, '\t', (size_t)(le - f2));
            const char *e2 = t2 ? t2 : le;
            if (!parse_i64(p, t1, &src[n]) || !parse_i64(f2, e2, &dst[n])) {
                /* a line of tabs and padding only is blank */
                for (const char *q = p; q < le; q++)
                    if (!is_pad(*q) && *q != '\t') { ok = 0; break; }
            } else if (t2) {
                if (memchr(t2 + 1, '\t', (size_t)(le - t2 - 1)) || !parse_f(t2 + 1, le, &w[n]))
                    ok = 0;
                else { weighted = 1; n++; }
            } else {
                w[n++] = 1.0f;
            }
        }
        p = le + 1;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&bw); PyBuffer_Release(&bd); PyBuffer_Release(&bs);
    if (!ok) Py_RETURN_NONE;
    return Py_BuildValue("(ni)", n, weighted);
}

/* -- radix_order --------------------------------------------------------------------------- */
enum { DIGIT = 11, BUCKETS = 1 << DIGIT };

static PyObject *gk_radix_order(PyObject *self, PyObject *args) {
    PyObject *o_keys, *o_order, *o_sorted;
    long long lo;
    int key_bits;
    if (!PyArg_ParseTuple(args, "OLiOO", &o_keys, &lo, &key_bits, &o_order, &o_sorted))
        return NULL;
    Py_buffer bk, bo, bs;
    if (!get_buf(o_keys, &bk, 8, 0, "keys")) return NULL;
    if (!get_buf(o_order, &bo, 8, 1, "order")) { PyBuffer_Release(&bk); return NULL; }
    if (!get_buf(o_sorted, &bs, 8, 1, "sorted")) {
        PyBuffer_Release(&bo); PyBuffer_Release(&bk); return NULL;
    }
    Py_ssize_t n = bk.len / 8;
    int idx_bits = 0;
    while (idx_bits < 63 && ((Py_ssize_t)1 << idx_bits) < n) idx_bits++;
    const int64_t *k = (const int64_t *)bk.buf;
    int bad = bo.len / 8 != n || bs.len / 8 != n || key_bits < 0 || key_bits + idx_bits > 63;
    if (!bad) {
        for (Py_ssize_t i = 0; i < n; i++)
            if (((uint64_t)k[i] - (uint64_t)lo) >> key_bits) { bad = 1; break; }
    }
    if (bad) {
        PyBuffer_Release(&bs); PyBuffer_Release(&bo); PyBuffer_Release(&bk);
        PyErr_SetString(PyExc_ValueError,
                        "radix_order: keys must lie in [lo, lo + 2^key_bits), key_bits plus the "
                        "bits of a position at most 63, and order and sorted one slot per key");
        return NULL;
    }
    int passes = (key_bits + DIGIT - 1) / DIGIT;
    int64_t *hist = calloc((size_t)(passes ? passes : 1) * BUCKETS, sizeof(int64_t));
    if (!hist) {
        PyBuffer_Release(&bs); PyBuffer_Release(&bo); PyBuffer_Release(&bk);
        return PyErr_NoMemory();
    }
    uint64_t *a = (uint64_t *)bo.buf, *b = (uint64_t *)bs.buf;
    uint64_t mask = idx_bits ? (((uint64_t)1 << idx_bits) - 1) : 0;
    Py_BEGIN_ALLOW_THREADS
    /* packed word: key - lo above the position; LSD passes over the key bits keep positions
       in order within a key (every pass is stable) */
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key = (uint64_t)k[i] - (uint64_t)lo;
        a[i] = (key << idx_bits) | (uint64_t)i;
        for (int p = 0; p < passes; p++) hist[p * BUCKETS + ((key >> (p * DIGIT)) & (BUCKETS - 1))]++;
    }
    for (int p = 0; p < passes; p++) {
        int64_t *h = hist + p * BUCKETS, acc = 0;
        for (int j = 0; j < BUCKETS; j++) { int64_t c = h[j]; h[j] = acc; acc += c; }
        int shift = idx_bits + p * DIGIT;
        for (Py_ssize_t i = 0; i < n; i++) b[h[(a[i] >> shift) & (BUCKETS - 1)]++] = a[i];
        uint64_t *t = a; a = b; b = t;
    }
    /* a holds the sorted words: split them into positions (order) and keys (sorted) */
    int64_t *order = (int64_t *)bo.buf, *sorted = (int64_t *)bs.buf;
    if (a == (uint64_t *)bo.buf) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t v = a[i];
            sorted[i] = (int64_t)((v >> idx_bits) + (uint64_t)lo);
            order[i] = (int64_t)(v & mask);
        }
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t v = a[i];
            order[i] = (int64_t)(v & mask);
            sorted[i] = (int64_t)((v >> idx_bits) + (uint64_t)lo);
        }
    }
    Py_END_ALLOW_THREADS
    free(hist);
    PyBuffer_Release(&bs); PyBuffer_Release(&bo); PyBuffer_Release(&bk);
    Py_RETURN_NONE;
}

/* -- owned_mask ----------------------------------------------------------------------------- */
static PyObject *gk_owned_mask(PyObject *self, PyObject *args) {
    PyObject *o_keys, *o_out;
    unsigned long long salt;
    long long shards, servers, index;
    if (!PyArg_ParseTuple(args, "OKLLLO", &o_keys, &salt, &shards, &servers, &index, &o_out))
        return NULL;
    if (shards < 1 || servers < 1 || index < 0 || index >= servers) {
        PyErr_SetString(PyExc_ValueError, "owned_mask: need shards, servers >= 1, 0 <= index < servers");
        return NULL;
    }
    Py_buffer bk, bo;
    if (!get_buf(o_keys, &bk, 8, 0, "keys")) return NULL;
    if (!get_buf(o_out, &bo, 1, 1, "out")) { PyBuffer_Release(&bk); return NULL; }
    Py_ssize_t n = bk.len / 8;
    if (bo.len != n) {
        PyBuffer_Release(&bo); PyBuffer_Release(&bk);
        PyErr_SetString(PyExc_ValueError, "owned_mask: out needs one byte per key");
        return NULL;
    }
    const uint64_t *k = (const uint64_t *)bk.buf;
    uint8_t *out = (uint8_t *)bo.buf;
    uint64_t ns = (uint64_t)shards, nv = (uint64_t)servers, me = (uint64_t)index;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = (mix64(k[i] ^ (uint64_t)salt) % ns) % nv == me;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&bo); PyBuffer_Release(&bk);
    Py_RETURN_NONE;
}

/* -- sample_uniform ------------------------------------------------------------------------- */
static inline uint64_t splitmix(uint64_t *state) {
    *state += 0x9E3779B97F4A7C15ULL;
    uint64_t z = *state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* uniform in [0, m) (Lemire's multiply-shift; the bias is below 2^-32 for m < 2^32) */
static inline int64_t below(uint64_t *state, int64_t m) {
    return (int64_t)(((unsigned __int128)splitmix(state) * (uint64_t)m) >> 64);
}

static PyObject *gk_sample_uniform(PyObject *self, PyObject *args) {
    PyObject *o_src, *o_indptr, *o_nodes, *o_pos, *o_counts;
    long long fanout;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OOOLKOO", &o_src, &o_indptr, &o_nodes, &fanout, &seed, &o_pos,
                          &o_counts))
        return NULL;
    if (fanout < 1 || fanout > 1 << 20) {
        PyErr_SetString(PyExc_ValueError, "sample_uniform: fanout must be in [1, 2^20]");
        return NULL;
    }
    Py_buffer bs, bi, bn, bp, bc;
    if (!get_buf(o_src, &bs, 8, 0, "src")) return NULL;
    if (!get_buf(o_indptr, &bi, 8, 0, "indptr")) { PyBuffer_Release(&bs); return NULL; }
    if (!get_buf(o_nodes, &bn, 8, 0, "nodes")) goto fail2;
    if (!get_buf(o_pos, &bp, 8, 1, "pos")) goto fail3;
    if (!get_buf(o_counts, &bc, 8, 1, "counts")) goto fail4;
    Py_ssize_t ns = bs.len / 8, nq = bn.len / 8, total = 0;
    if (bi.len / 8 != ns + 1 || bc.len / 8 != nq || bp.len / 8 < nq * fanout) {
        PyErr_SetString(PyExc_ValueError, "sample_uniform: indptr needs len(src) + 1 items, "
                                          "counts one per node, pos fanout per node");
        goto fail5;
    }
    const int64_t *src = (const int64_t *)bs.buf, *indptr = (const int64_t *)bi.buf;
    const int64_t *nodes = (const int64_t *)bn.buf;
    int64_t *pos = (int64_t *)bp.buf, *counts = (int64_t *)bc.buf;
    uint64_t state = seed;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t q = 0; q < nq; q++) {
        int64_t v = nodes[q];
        Py_ssize_t a = 0, b = ns; /* first index with src >= v */
        while (a < b) {
            Py_ssize_t m = a + ((b - a) >> 1);
            if (src[m] < v) a = m + 1; else b = m;
        }
        int64_t start = 0, deg = 0;
        if (a < ns && src[a] == v) { start = indptr[a]; deg = indptr[a + 1] - start; }
        int64_t *out = pos + total;
        if (deg <= fanout) {
            for (int64_t j = 0; j < deg; j++) out[j] = start + j;
            counts[q] = deg;
            total += deg;
            continue;
        }
        /* Floyd: for j in [deg - fanout, deg): t = U[0, j]; take t, or j when t is taken */
        int64_t k = 0;
        for (int64_t j = deg - fanout; j < deg; j++) {
            int64_t t = below(&state, j + 1);
            for (int64_t i = 0; i < k; i++)
                if (out[i] == start + t) { t = j; break; }
            out[k++] = start + t;
        }
        counts[q] = fanout;
        total += fanout;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&bc); PyBuffer_Release(&bp); PyBuffer_Release(&bn);
    PyBuffer_Release(&bi); PyBuffer_Release(&bs);
    return PyLong_FromSsize_t(total);
fail5:
    PyBuffer_Release(&bc);
fail4:
    PyBuffer_Release(&bp);
fail3:
    PyBuffer_Release(&bn);
fail2:
    PyBuffer_Release(&bi); PyBuffer_Release(&bs);
    return NULL;
}

/* -- place_segments ------------------------------------------------------------------------ */
static PyObject *gk_place_segments(PyObject *self, PyObject *args) {
    PyObject *o_offsets, *o_positions, *o_counts, *o_values, *o_out;
    if (!PyArg_ParseTuple(args, "OOOOO", &o_offsets, &o_positions, &o_counts, &o_values, &o_out))
        return NULL;
    Py_buffer bo, bp, bc, bv, bu;
    if (!get_buf(o_offsets, &bo, 8, 0, "offsets")) return NULL;
    if (!get_buf(o_positions, &bp, 8, 0, "positions")) { PyBuffer_Release(&bo); return NULL; }
    if (!get_buf(o_counts, &bc, 8, 0, "counts")) goto fail2;
    if (PyObject_GetBuffer(o_values, &bv, PyBUF_C_CONTIGUOUS) != 0) goto fail3;
    if (PyObject_GetBuffer(o_out, &bu, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) goto fail4;
    Py_ssize_t n = bp.len / 8, slots = bo.len / 8, item = bu.itemsize;
    const int64_t *off = (const int64_t *)bo.buf, *p = (const int64_t *)bp.buf;
    const int64_t *c = (const int64_t *)bc.buf;
    int bad = bc.len / 8 != n || bv.itemsize != item || item < 1;
    int64_t total = 0;
    for (Py_ssize_t i = 0; !bad && i < n; i++) {
        if (p[i] < 0 || p[i] + 1 >= slots || c[i] != off[p[i] + 1] - off[p[i]] || c[i] < 0 ||
            off[p[i]] < 0 || (off[p[i] + 1]) * item > bu.len)
            bad = 1;
        total += c[i];
    }
    if (bad || total * item != bv.len) {
        PyErr_SetString(PyExc_ValueError,
                        "place_segments: each position's count must match its offsets, the values "
                        "be the counts' sum and fit out, of out's item size");
        goto fail5;
    }
    const char *v = (const char *)bv.buf;
    char *out = (char *)bu.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t len = (size_t)(c[i] * item);
        memcpy(out + off[p[i]] * item, v, len);
        v += len;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&bu); PyBuffer_Release(&bv); PyBuffer_Release(&bc);
    PyBuffer_Release(&bp); PyBuffer_Release(&bo);
    Py_RETURN_NONE;
fail5:
    PyBuffer_Release(&bu);
fail4:
    PyBuffer_Release(&bv);
fail3:
    PyBuffer_Release(&bc);
fail2:
    PyBuffer_Release(&bp); PyBuffer_Release(&bo);
    return NULL;
}

static PyMethodDef methods[] = {
    {"parse_edges", gk_parse_edges, METH_VARARGS, "Parse src<TAB>dst[<TAB>weight] lines."},
    {"radix_order", gk_radix_order, METH_VARARGS, "Stable LSD radix sort of int64 keys."},
    {"owned_mask", gk_owned_mask, METH_VARARGS, "The keys a server owns."},
    {"place_segments", gk_place_segments, METH_VARARGS, "Jagged replies back in the caller's order."},
    {"sample_uniform", gk_sample_uniform, METH_VARARGS, "Uniform neighbour sampling on a CSR."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_graph_kernels",
                                    "Compiled loops of the graph tables.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__graph_kernels(void) { return PyModule_Create(&module); }
