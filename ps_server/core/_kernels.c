/* Compiled kernels of the sparse table's hot path (lookup and push), optional.
 *
 * ps_server/core/kernels.py loads this module when it was built (pip install builds it with the C
 * compiler it finds; setup.py makes the build optional) and falls back to the numpy code
 * otherwise. Both paths compute the same thing; tests/test_ps_kernels.py checks them against
 * each other. Arrays arrive through the buffer protocol (no numpy headers needed); kernels run
 * without the GIL so gRPC threads keep moving bytes meanwhile.
 * The optional `threads` argument splits a large batch (parts of >= 8192 keys) over that many
 * threads, the calling one included: probe and gather per key, push per distinct row after
 * the (serial) duplicate detection.
 *
 *   probe(slots i32[S], stored_keys i64[C], query i64[n], out i64[n][, threads])
 *       the row of each key in the open-addressing index of ps_server/core/hash_index.py
 *       (home slot = mix64(key ^ INDEX_SALT) & (S - 1), linear probing, -1 empty,
 *       -2 tombstone), -1 where absent.
 *   gather(src [C, ...], rows i64[n], out [n, ...][, threads])
 *       out[i] = src[rows[i]] where rows[i] >= 0 (out[i] untouched where < 0), prefetching
 *       the rows ahead. Rows are byte rows (any dtype).
 *   scatter(src [n, ...], positions i64[n], dst [C, ...])
 *       dst[positions[i]] = src[i] (the client's reply rows back into the caller's order).
 *   pack(records u8[n * stride], template u8[stride], rows i64[n],
 *        ((src [C, ...], row_bytes, offset), ...)[, threads])
 *       record i = the template with each field at `offset` set to src[rows[i]] (an SSD
 *       table's evicted rows packed in one pass over the records; every row in range).
 *   owned(keys i64[n], salt u64, owned u8[num_shards]) -> position or -1
 *       the first key whose shard (mix64(key ^ salt) % num_shards) has owned[shard] == 0,
 *       -1 when this server owns every key (the servers' routing check).
 *   push(rule, hyper f64[8], values f32[C,dim], state f32[C,sd], count u32[C], unseen u16[C],
 *        flags u8[C], rows i64[n], grads f32[n,dim][, threads]) -> distinct rows updated
 *       sums the gradients of duplicated rows (float64 accumulation, occurrence order), then
 *       applies rule 0 = sgd, 1 = adagrad, 2 = adam with the same float32 arithmetic as
 *       ps_server/core/optimizers.py, clips to the weight bounds, adds the occurrences to count
 *       (saturating), sets unseen = 0 and flags |= SEEN | CHANGED (both change logs).
 *   insert(slots i32[S], stored_keys i64[C], query i64[n], rows i64[n])
 *       indexes new (absent, distinct) keys: each takes the first empty (-1) slot from its home
 *       slot on (tombstones are not reused, as in hash_index.py's numpy insert); the caller
 *       keeps the index below its maximum load. With query None, `rows` is the i32 slot
 *       array of an old index and its live rows (>= 0) go into `slots` (a rebuild).
 *   distinct(keys i64[n], uniq i64[n], inverse i64[n], counts i64[n]) -> nu
 *       the distinct keys in order of first occurrence (uniq[:nu]), the index of each key in
 *       them (keys == uniq[inverse]) and their occurrences (counts[:nu]).
 *   uniform(keys i64[n], stream u64, low f64, span f64, dim, dst f32[C,dim][, rows i64[n]
 *           [, threads]])
 *       the Uniform initializer's rows (ps_server/core/initializers.py): dst[rows[i]] (dst[i]
 *       without rows) = float32(low + span * u(key, j)), u the KeyRNG uniform of column j
 *       (ps_server/core/hashing.py, stream = its per-(table, seed, purpose) word),
 *       bit-identical to the numpy code.
 *   normal(keys i64[n], stream u64, attempt, mean f64, std f64, dim, dst f32[C,dim]
 *          [, rows i64[n][, threads]])
 *       the Normal initializer's rows: float32(mean + std * z), z the KeyRNG's Box-Muller
 *       normal of column j and `attempt` (libm's log and cos, as numpy's float64 ufuncs
 *       without AVX-512; kernels.py checks the two agree before it uses this kernel).
 *   group(keys i64[n], salt u64, num_shards, num_servers, out i64[n][, keys_out i64[n]])
 *         -> [count per server]
 *       the client's routing (ps_server/core/routing.py): server = mix64(key ^ salt) % num_shards
 *       % num_servers; out = the positions of the keys grouped by server, ascending within
 *       a server (a stable counting sort); keys_out = keys[out], written in the same pass.
 */
#include "_kernels_common.h"

typedef struct {
    const int32_t *slots;
    const int64_t *stored, *query;
    int64_t *out;
    Py_ssize_t nslots, ncap, n;
} probe_ctx;

/* returns 1 when a slot points past the key column (a corrupt index) */
static int probe_part(void *arg, int part, Py_ssize_t lo, Py_ssize_t hi) {
    (void)part;
    const probe_ctx *c = (const probe_ctx *)arg;
    const int32_t *slots = c->slots;
    const int64_t *stored = c->stored, *query = c->query;
    Py_ssize_t nslots = c->nslots, ncap = c->ncap;
    uint64_t mask = (uint64_t)nslots - 1;
    int bad = 0;
    /* memory latency dominates (random slots, random keys): keep many loads in flight by
       prefetching the home slot PF keys ahead and the key it points to PF/2 ahead */
    enum { PF = 16 };
    for (Py_ssize_t i = lo; i < hi; i++) {
        if (i + PF < hi) __builtin_prefetch(&slots[mix64((uint64_t)query[i + PF] ^ INDEX_SALT) & mask]);
        if (i + PF / 2 < hi) {
            /* the keys of the first slots of its run (a missing key compares them all up to
               the next empty slot: without this, one cache miss after the other) */
            uint64_t p = mix64((uint64_t)query[i + PF / 2] ^ INDEX_SALT) & mask;
            for (int k = 0; k < 4; k++, p = (p + 1) & mask) {
                int32_t ahead = slots[p];
                if (ahead == -1) break;
                if (ahead >= 0 && ahead < ncap) __builtin_prefetch(&stored[ahead]);
            }
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
        c->out[i] = row;
    }
    return bad;
}

static PyObject *k_probe(PyObject *self, PyObject *args) {
    PyObject *o_slots, *o_keys, *o_query, *o_out;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OOOO|i", &o_slots, &o_keys, &o_query, &o_out, &threads))
        return NULL;
    Py_buffer b_slots, b_keys, b_query, b_out;
    if (!get_buf(o_slots, &b_slots, 4, 0, "slots")) return NULL;
    if (!get_buf(o_keys, &b_keys, 8, 0, "stored_keys")) goto e1;
    if (!get_buf(o_query, &b_query, 8, 0, "query")) goto e2;
    if (!get_buf(o_out, &b_out, 8, 1, "out")) goto e3;
    probe_ctx c;
    c.nslots = b_slots.len / 4;
    c.ncap = b_keys.len / 8;
    c.n = b_query.len / 8;
    if (b_out.len / 8 != c.n || c.nslots == 0 || (c.nslots & (c.nslots - 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, "probe: out must match query; slots a power of two");
        goto e4;
    }
    c.slots = (const int32_t *)b_slots.buf;
    c.stored = (const int64_t *)b_keys.buf;
    c.query = (const int64_t *)b_query.buf;
    c.out = (int64_t *)b_out.buf;
    int bad;
    Py_BEGIN_ALLOW_THREADS
    bad = run_parts(threads, c.n, probe_part, &c);
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

typedef struct {
    int rule;
    const double *h;
    float *w, *st;
    uint32_t *count;
    uint16_t *unseen;
    uint8_t *flags;
    const float *g;
    const int64_t *ur;
    const uint32_t *occ;
    const int32_t *order, *start;
    float *g32; /* dim floats per part */
    double *acc; /* dim doubles per part */
    Py_ssize_t dim, sd, nu;
    int distinct, dups;
} push_ctx;

/* The update of distinct rows ur[lo:hi] (each row once in the whole batch, so parts never
   touch the same row). */
static int push_part(void *arg, int part, Py_ssize_t lo, Py_ssize_t hi) {
    const push_ctx *c = (const push_ctx *)arg;
    Py_ssize_t dim = c->dim, sd = c->sd;
    float *w = c->w, *st = c->st;
    uint32_t *count = c->count;
    uint16_t *unseen = c->unseen;
    uint8_t *flags = c->flags;
    const float *g = c->g;
    const int64_t *ur = c->ur;
    float *g32 = c->g32 + (Py_ssize_t)part * dim;
    double *acc = c->acc + (Py_ssize_t)part * dim;
    for (Py_ssize_t u = lo; u < hi; u++) {
        int64_t r = ur[u];
        if (u + 24 < hi) { /* the same latency argument as in probe */
            int64_t q = ur[u + 24];
            __builtin_prefetch(w + q * dim, 1);
            if (sd) __builtin_prefetch(st + q * sd, 1);
            __builtin_prefetch(count + q, 1);
            __builtin_prefetch(unseen + q, 1);
            __builtin_prefetch(flags + q, 1);
        }
        const float *gu = g + u * dim; /* no duplicates: distinct row u is occurrence u */
        if (c->dups) {
            const int32_t *o = c->order + c->start[u];
            gu = g + (Py_ssize_t)o[0] * dim;
            if (c->occ[u] > 1) {
                for (Py_ssize_t j = 0; j < dim; j++) acc[j] = (double)gu[j];
                for (uint32_t k = 1; k < c->occ[u]; k++) {
                    const float *gk = g + (Py_ssize_t)o[k] * dim;
                    for (Py_ssize_t j = 0; j < dim; j++) acc[j] += (double)gk[j];
                }
                for (Py_ssize_t j = 0; j < dim; j++) g32[j] = (float)acc[j];
                gu = g32;
            }
        }
        apply_row(c->rule, c->h, w + r * dim, st + r * sd, gu, dim);
        uint64_t cnt = (uint64_t)count[r] + (c->distinct ? 1U : c->occ[u]);
        count[r] = cnt > 0xFFFFFFFFULL ? 0xFFFFFFFFU : (uint32_t)cnt;
        unseen[r] = 0;
        flags[r] = (uint8_t)((flags[r] & ~FLAG_MARK) | FLAG_SEEN | FLAG_CHANGED);
    }
    return 0;
}

static PyObject *k_push(PyObject *self, PyObject *args) {
    int rule, threads = 1;
    PyObject *o_h, *o_w, *o_st, *o_cnt, *o_uns, *o_flags, *o_rows, *o_g;
    if (!PyArg_ParseTuple(args, "iOOOOOOOO|i", &rule, &o_h, &o_w, &o_st, &o_cnt, &o_uns,
                          &o_flags, &o_rows, &o_g, &threads))
        return NULL;
    if (rule < RULE_SGD || rule > RULE_ADAM) {
        PyErr_Format(PyExc_ValueError, "push: unknown rule %d", rule);
        return NULL;
    }
    Py_buffer bh, bw, bst, bc, bu, bf, br, bg;
    int got = 0;
    PyObject *result = NULL;
    if (!get_buf(o_h, &bh, 8, 0, "hyper"))
        goto done;
    got = 1;
    if (!get_buf(o_w, &bw, 4, 1, "values"))
        goto done;
    got = 2;
    if (!get_buf(o_st, &bst, 4, 1, "state"))
        goto done;
    got = 3;
    if (!get_buf(o_cnt, &bc, 4, 1, "count"))
        goto done;
    got = 4;
    if (!get_buf(o_uns, &bu, 2, 1, "unseen"))
        goto done;
    got = 5;
    if (!get_buf(o_flags, &bf, 1, 1, "flags"))
        goto done;
    got = 6;
    if (!get_buf(o_rows, &br, 8, 0, "rows"))
        goto done;
    got = 7;
    if (!get_buf(o_g, &bg, 4, 0, "grads"))
        goto done;
    got = 8;
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
        Py_ssize_t np_ = parts_for(threads, n);
        float *g32 = malloc(sizeof(float) * d1 * np_);
        double *acc = malloc(sizeof(double) * d1 * np_);
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
        push_ctx pc = {rule, h, w, st, count, unseen, flags, g, ur, occ, order, start, g32, acc,
                       dim, sd, nu, distinct, dups};
        run_parts(threads, nu, push_part, &pc);
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

static PyMethodDef methods[] = {
    {"gather", psk_gather, METH_VARARGS,
     "gather(src, rows, out[, threads]): out[i] = src[rows[i]] where rows[i] >= 0"},
    {"scatter", psk_scatter, METH_VARARGS, "scatter(src, positions, dst): dst[positions] = src"},
    {"pack", psk_pack, METH_VARARGS,
     "pack(records, template, rows, ((src, row_bytes, offset), ...)[, threads]): records"},
    {"owned", psk_owned, METH_VARARGS, "owned(keys, salt, owned) -> first unowned position or -1"},
    {"probe", k_probe, METH_VARARGS, "probe(slots, stored_keys, query, out): rows of keys"},
    {"push", k_push, METH_VARARGS,
     "push(rule, hyper, values, state, count, unseen, flags, rows, grads) -> distinct rows"},
    {"insert", psk_insert, METH_VARARGS,
     "insert(slots, stored_keys, query | None, rows): index new keys (or an old index's rows)"},
    {"distinct", psk_distinct, METH_VARARGS,
     "distinct(keys, uniq, inverse, counts) -> n distinct, in first-occurrence order"},
    {"uniform", psk_uniform, METH_VARARGS,
     "uniform(keys, stream, low, span, dim, dst[, rows[, threads]]): Uniform initial rows"},
    {"normal", psk_normal, METH_VARARGS,
     "normal(keys, stream, attempt, mean, std, dim, dst[, rows[, threads]]): Normal rows"},
    {"group", psk_group, METH_VARARGS,
     "group(keys, salt, num_shards, num_servers, out[, keys_out]) -> [count per server]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                                    "Compiled sparse-table kernels (see kernels.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    PyObject *m = PyModule_Create(&module);
    /* the flags a push sets: kernels.py refuses a build whose value differs from row_store's */
    if (m != NULL && PyModule_AddIntConstant(m, "CHANGED_FLAGS", FLAG_CHANGED) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
