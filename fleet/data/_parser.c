/* MultiSlot text -> columnar arrays, compiled (optional; fleet/data/parser.py has the Python twin).
 *
 * fleet/data/parser.py loads this module when it was built (pip install builds it when a C
 * compiler is there; setup.py makes the build optional) and otherwise parses in Python with the
 * same grammar, the same numbers and the same errors (tests/test_data_parser.py compares them).
 * Input arrives through the buffer protocol; output buffers are malloc'ed here and handed to
 * Python as `Buffer` objects (np.frombuffer wraps them without a copy). The parse runs without the
 * GIL, so the dataset's parser threads (one block of lines each) run on all cores. The functions
 * after parse() are in _parser_columns.c (declared in _parser_common.h).
 *
 *   parse(text, kinds, dims, header_fields, skip_bad, hints[, newlines])
 *       -> (n_examples, n_lines, n_skipped, error, buffers)
 *     text: bytes-like, complete lines ('\n'-separated; the last may lack its '\n').
 *     kinds: bytes, one per slot in line order: bit 0 = float32 values (else int64), bit 1 =
 *       dense (exactly dims[s] values per example; else a variable count).
 *     header_fields: leading "1 <token>" fields skipped per line (Paddle's ins_id / content).
 *     skip_bad: 0 = stop at the first bad line, 1 = drop bad lines and count them.
 *     hints: tuple of floats, expected values per example of each slot (initial capacity);
 *       newlines: the '\n' in text when the caller counted them (else counted here).
 *     error: None, or (line index in text, slot index or -1, code, token bytes, line bytes) of
 *       the first bad line (the one that stopped the parse, or the first one skipped).
 *     buffers: per slot, a dense slot's values Buffer [n_examples * dim], or a sparse slot's
 *       (values Buffer, lengths Buffer int64 [n_examples]).
 *   gather_rows(sources, row_bytes, chunk i64[B], row i64[B], out)
 *       out row i = row row[i] of sources[chunk[i]] (a dense column split in chunks).
 *   jagged_take(values, offsets, itemsize, chunk i64[B], row i64[B], out_offsets i64[B+1]
 *               [, out_values]) -> total values
 *       the same for a jagged column: without out_values fills out_offsets, with it copies.
 *   count_lines(text, length) -> the '\n' in text[:length].
 *   trim_heap() -> None: gives freed heap pages back to the OS (glibc malloc_trim; else no-op).
 *
 * Grammar (one line = one example; blank lines are ignored): per slot `<count> <v1> .. <vcount>`,
 * tokens separated by ' ', '\t', '\r', '\v', '\f'. count: [0-9]+. int64 value: [+-]?[0-9]+ in
 * [-2^63, 2^64 - 1] (values >= 2^63 keep their 64 bits, as Paddle's uint64 feasigns). float32
 * value: [+-]?([0-9]+.?[0-9]* | .[0-9]+)([eE][+-]?[0-9]+)? or [+-]?(inf|infinity|nan), any case;
 * the value is the nearest double rounded to float32 (what float() then numpy's cast give).
 */
#include "_parser_common.h"
#include <math.h>

/* error codes: fleet/data/parser.py ERROR_CODES names them */
enum { E_COUNT = 1, E_MISSING, E_SHORT, E_NUMBER, E_RANGE, E_DIM, E_TRAILING, E_HEADER, E_NOMEM };
enum { K_FLOAT = 1, K_DENSE = 2, MAX_SLOTS = 4096, MAX_HEADER = 4 };

/* -- Buffer: a malloc'ed block exposed through the buffer protocol ------------------------- */
typedef struct {
    PyObject_HEAD
    char *data;
    Py_ssize_t size;
} Buf;

static void buf_dealloc(Buf *b) {
    free(b->data);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static int buf_getbuffer(Buf *b, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)b, b->data, b->size, 0, flags);
}

static PyBufferProcs buf_procs = {(getbufferproc)buf_getbuffer, NULL};

static PyTypeObject BufType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fleet.data._parser.Buffer",
    .tp_basicsize = sizeof(Buf),
    .tp_dealloc = (destructor)buf_dealloc,
    .tp_as_buffer = &buf_procs,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Bytes owned by the parser (wrap with numpy.frombuffer).",
};

/* -- growable arrays ----------------------------------------------------------------------- */
typedef struct {
    char *data;
    size_t len, cap, item; /* len and cap in items */
} vec;

static int vec_reserve(vec *v, size_t extra) {
    if (v->len + extra <= v->cap) return 0;
    size_t cap = v->cap ? v->cap : 16;
    while (cap < v->len + extra) cap *= 2;
    char *p = realloc(v->data, cap * v->item);
    if (!p) return -1;
    v->data = p;
    v->cap = cap;
    return 0;
}

/* -- tokens -------------------------------------------------------------------------------- */
typedef const unsigned char *cptr;

static inline int is_ws(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f';
}
static inline int is_digit(unsigned char c) { return (unsigned)(c - '0') <= 9; }
static inline cptr skip_ws(cptr p, cptr e) {
    while (p < e && is_ws(*p)) p++;
    return p;
}
static inline cptr token_end(cptr p, cptr e) {
    while (p < e && !is_ws(*p)) p++;
    return p;
}
static inline int at_end(cptr p, cptr e) { return p == e || is_ws(*p); }

/* 8 ASCII digits at p (little-endian load) -> their value; fast_float's SWAR trick */
static inline int eight_digits(cptr p, uint32_t *out) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, 8);
    if (((v + 0x4646464646464646ULL) | (v - 0x3030303030303030ULL)) & 0x8080808080808080ULL)
        return 0;
    v -= 0x3030303030303030ULL;
    v = (v * 10) + (v >> 8);
    v = (((v & 0x000000FF000000FFULL) * 0x000F424000000064ULL) +
         (((v >> 16) & 0x000000FF000000FFULL) * 0x0000271000000001ULL)) >> 32;
    *out = (uint32_t)v;
    return 1;
#else
    (void)p;
    (void)out;
    return 0;
#endif
}

static int parse_i64(cptr *pp, cptr e, int64_t *out) {
    cptr p = *pp;
    int neg = 0;
    if (p < e && (*p == '-' || *p == '+')) neg = *p++ == '-';
    if (p == e || !is_digit(*p)) return E_NUMBER;
    while (p + 1 < e && *p == '0' && is_digit(p[1])) p++; /* leading zeros */
    cptr first = p;
    uint64_t v = 0;
    uint32_t eight;
    /* up to 19 digits cannot overflow a uint64: 8 at a time, then one by one */
    while (p + 8 <= e && p - first <= 11 && eight_digits(p, &eight)) {
        v = v * 100000000ULL + eight;
        p += 8;
    }
    while (p < e && is_digit(*p) && p - first < 19) v = v * 10 + (unsigned)(*p++ - '0');
    int over = 0;
    if (p < e && is_digit(*p)) { /* a 20th digit: fits only below 2^64 */
        unsigned d = (unsigned)(*p++ - '0');
        if (v > (UINT64_MAX - d) / 10) over = 1;
        else v = v * 10 + d;
        if (p < e && is_digit(*p)) over = 1;
        while (p < e && is_digit(*p)) p++;
    }
    if (!at_end(p, e)) return E_NUMBER;
    if (over || (neg && v > ((uint64_t)1 << 63))) return E_RANGE;
    *out = neg ? (int64_t)(0 - v) : (int64_t)v; /* >= 2^63 wraps: the same 64 bits */
    *pp = p;
    return 0;
}

static int match_word(cptr p, cptr e, const char *w) { /* case-insensitive, whole token */
    size_t n = strlen(w);
    if ((size_t)(e - p) < n) return 0;
    for (size_t i = 0; i < n; i++)
        if ((p[i] | 0x20) != (unsigned char)w[i]) return 0;
    return at_end(p + n, e);
}

static const double P10[23] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                               1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                               1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

static int parse_f32(cptr *pp, cptr e, float *out) {
    cptr start = *pp, p = start;
    int neg = 0, nd = 0, big = 0, ndig = 0;
    long exp10 = 0;
    uint64_t m = 0;
    if (p < e && (*p == '-' || *p == '+')) neg = *p++ == '-';
    cptr word = p;
    for (; p < e && is_digit(*p); p++, ndig++) {
        unsigned d = *p - '0';
        if (m == 0 && d == 0) continue; /* leading zeros */
        if (nd < 19) { m = m * 10 + d; nd++; } else big = 1;
    }
    if (p < e && *p == '.') {
        for (p++; p < e && is_digit(*p); p++, ndig++) {
            unsigned d = *p - '0';
            if (m == 0 && d == 0) { exp10--; continue; }
            if (nd < 19) { m = m * 10 + d; nd++; exp10--; } else big = 1;
        }
    }
    if (ndig == 0) { /* inf / infinity / nan, or not a number */
        if (match_word(word, e, "infinity") || match_word(word, e, "inf") ||
            match_word(word, e, "nan")) {
            int nan = (word[0] | 0x20) == 'n';
            *out = (float)copysign(nan ? NAN : INFINITY, neg ? -1.0 : 1.0);
            *pp = token_end(word, e);
            return 0;
        }
        return E_NUMBER;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        cptr q = p + 1;
        int eneg = 0;
        long ev = 0;
        if (q < e && (*q == '-' || *q == '+')) eneg = *q++ == '-';
        if (q == e || !is_digit(*q)) return E_NUMBER;
        for (; q < e && is_digit(*q); q++)
            if (ev < 100000) ev = ev * 10 + (*q - '0');
        exp10 += eneg ? -ev : ev;
        p = q;
    }
    if (!at_end(p, e)) return E_NUMBER;
    double d;
    if (m == 0) {
        d = 0.0;
    } else if (!big && m <= ((uint64_t)1 << 53) && exp10 >= -22 && exp10 <= 22) {
        /* Clinger's fast path: both operands exact, one correctly rounded operation */
        d = (double)m;
        d = exp10 < 0 ? d / P10[-exp10] : d * P10[exp10];
    } else { /* strtod on a NUL-terminated copy (the grammar is already checked) */
        char small[128], *tmp = small;
        size_t n = (size_t)(p - start);
        if (n >= sizeof small && !(tmp = malloc(n + 1))) return E_NOMEM;
        memcpy(tmp, start, n);
        tmp[n] = 0;
        d = fabs(strtod(tmp, NULL));
        if (tmp != small) free(tmp);
    }
    *out = (float)(neg ? -d : d); /* out of float range -> +-inf, as numpy's cast */
    *pp = p;
    return 0;
}

/* -- the block parse ----------------------------------------------------------------------- */
typedef struct {
    int nslots, header, skip_bad;
    const unsigned char *kinds;
    const Py_ssize_t *dims;
    vec *values, *lengths; /* per slot */
    size_t *marks;         /* per slot: values and lengths lengths at the line start */
    size_t n_examples, n_lines, n_skipped;
    /* the first error */
    int err_code, err_slot;
    size_t err_line;
    cptr err_tok, err_tok_end, err_line_start, err_line_end;
} parse_ctx;

/* parse one line [p, e); 0 = ok (appended), else an error code (c->err_* of this line set) */
static int parse_line(parse_ctx *c, cptr p, cptr e, int *slot, cptr *tok) {
    for (int h = 0; h < c->header; h++) {
        p = skip_ws(p, e);
        *slot = -1;
        *tok = p;
        if (p == e || *p != '1' || !at_end(p + 1, e)) return E_HEADER;
        p = skip_ws(p + 1, e);
        *tok = p;
        if (p == e) return E_HEADER;
        p = token_end(p, e);
    }
    for (int s = 0; s < c->nslots; s++) {
        int kind = c->kinds[s];
        vec *v = &c->values[s];
        *slot = s;
        p = skip_ws(p, e);
        *tok = p;
        if (p == e) return E_MISSING;
        uint64_t count = 0;
        for (; p < e && is_digit(*p); p++)
            if (count < ((uint64_t)1 << 40)) count = count * 10 + (*p - '0');
        if (p == *tok || !at_end(p, e)) return E_COUNT;
        if ((kind & K_DENSE) && count != (uint64_t)c->dims[s]) return E_DIM;
        /* each value takes >= 2 bytes: reserve no more than the line can hold (a huge count
           then fails at the first missing or bad value, in token order like the Python parser) */
        uint64_t fit = (uint64_t)(e - p) / 2;
        if (vec_reserve(v, (size_t)(count < fit ? count : fit))) return E_NOMEM;
        for (uint64_t k = 0; k < count; k++) {
            p = skip_ws(p, e);
            *tok = p;
            if (p == e) return E_SHORT;
            if (v->len == v->cap && vec_reserve(v, 1)) return E_NOMEM;
            int rc = (kind & K_FLOAT) ? parse_f32(&p, e, (float *)v->data + v->len)
                                      : parse_i64(&p, e, (int64_t *)v->data + v->len);
            if (rc) return rc;
            v->len++;
        }
        if (!(kind & K_DENSE)) {
            vec *l = &c->lengths[s];
            if (vec_reserve(l, 1)) return E_NOMEM;
            ((int64_t *)l->data)[l->len++] = (int64_t)count;
        }
    }
    p = skip_ws(p, e);
    *slot = -1;
    *tok = p;
    return p == e ? 0 : E_TRAILING;
}

static void parse_all(parse_ctx *c, cptr text, size_t size) {
    size_t *marks = c->marks;
    cptr p = text, end = text + size;
    while (p < end) {
        cptr e = memchr(p, '\n', (size_t)(end - p));
        if (!e) e = end;
        size_t line = c->n_lines++;
        if (skip_ws(p, e) == e) { p = e + 1; continue; } /* blank line */
        for (int s = 0; s < c->nslots; s++) {
            marks[2 * s] = c->values[s].len;
            marks[2 * s + 1] = c->lengths[s].len;
        }
        int slot = -1;
        cptr tok = p;
        int rc = parse_line(c, p, e, &slot, &tok);
        if (rc == 0) {
            c->n_examples++;
        } else {
            if (!c->err_code) {
                c->err_code = rc;
                c->err_slot = slot;
                c->err_line = line;
                c->err_tok = tok;
                c->err_tok_end = token_end(tok, e);
                c->err_line_start = p;
                c->err_line_end = e;
            }
            if (!c->skip_bad || rc == E_NOMEM) return;
            for (int s = 0; s < c->nslots; s++) { /* drop what the bad line appended */
                c->values[s].len = marks[2 * s];
                c->lengths[s].len = marks[2 * s + 1];
            }
            c->n_skipped++;
        }
        p = e + 1;
    }
}

static PyObject *to_buffer(vec *v) {
    Buf *b = PyObject_New(Buf, &BufType);
    if (!b) return NULL;
    size_t bytes = v->len * v->item;
    char *data = v->data;
    if (data && bytes < v->cap * v->item) { /* give back the unused capacity */
        char *shrunk = realloc(data, bytes ? bytes : 1);
        if (shrunk) data = shrunk;
    }
    b->data = data ? data : malloc(1);
    b->size = (Py_ssize_t)bytes;
    v->data = NULL;
    if (!b->data) {
        Py_DECREF(b);
        return PyErr_NoMemory();
    }
    return (PyObject *)b;
}

static PyObject *p_parse(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *text_obj, *hints;
    Py_buffer text, kinds;
    PyObject *dims_obj;
    int header, skip_bad;
    Py_ssize_t known_lines = 0;
    if (!PyArg_ParseTuple(args, "Oy*OiiO|n", &text_obj, &kinds, &dims_obj, &header, &skip_bad,
                          &hints, &known_lines))
        return NULL;
    parse_ctx *c = calloc(1, sizeof(parse_ctx));
    if (c && kinds.len > 0 && kinds.len <= MAX_SLOTS) {
        c->values = calloc((size_t)kinds.len, sizeof(vec));
        c->lengths = calloc((size_t)kinds.len, sizeof(vec));
        c->marks = calloc(2 * (size_t)kinds.len, sizeof(size_t));
    }
    Py_ssize_t *dims = NULL;
    PyObject *result = NULL, *buffers = NULL, *error = Py_None;
    Py_INCREF(Py_None);
    int have_text = 0;
    if (!c) { PyErr_NoMemory(); goto done; }
    c->nslots = (int)kinds.len;
    if (c->nslots < 1 || c->nslots > MAX_SLOTS || header < 0 || header > MAX_HEADER ||
        !PyTuple_Check(dims_obj) || PyTuple_GET_SIZE(dims_obj) != kinds.len ||
        !PyTuple_Check(hints) || PyTuple_GET_SIZE(hints) != kinds.len) {
        PyErr_SetString(PyExc_ValueError, "parse: 1..4096 slots, dims and hints one per slot");
        goto done;
    }
    if (!c->values || !c->lengths || !c->marks) { PyErr_NoMemory(); goto done; }
    if (PyObject_GetBuffer(text_obj, &text, PyBUF_SIMPLE) != 0) goto done;
    have_text = 1;
    dims = calloc((size_t)c->nslots, sizeof(Py_ssize_t));
    if (!dims) { PyErr_NoMemory(); goto done; }
    c->kinds = kinds.buf;
    c->dims = dims;
    c->header = header;
    c->skip_bad = skip_bad;
    /* initial capacities: lines in the text x the expected values per example */
    size_t lines = 1 + (known_lines > 0 ? (size_t)known_lines
                                        : fleetdata_count_newlines(text.buf, text.len));
    for (int s = 0; s < c->nslots; s++) {
        dims[s] = PyLong_AsSsize_t(PyTuple_GET_ITEM(dims_obj, s));
        double hint = PyFloat_AsDouble(PyTuple_GET_ITEM(hints, s));
        if (PyErr_Occurred()) goto done;
        int kind = c->kinds[s];
        if ((kind & K_DENSE) && dims[s] < 1) {
            PyErr_SetString(PyExc_ValueError, "parse: a dense slot needs dim >= 1");
            goto done;
        }
        c->values[s].item = (kind & K_FLOAT) ? 4 : 8;
        c->lengths[s].item = 8;
        double per = (kind & K_DENSE) ? (double)dims[s] : (hint > 0 ? hint * 1.05 + 0.01 : 1.0);
        if (vec_reserve(&c->values[s], (size_t)(per * (double)lines) + 1) ||
            (!(kind & K_DENSE) && vec_reserve(&c->lengths[s], lines))) {
            PyErr_NoMemory();
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    parse_all(c, text.buf, (size_t)text.len);
    Py_END_ALLOW_THREADS
    if (c->err_code == E_NOMEM) { PyErr_NoMemory(); goto done; }
    if (c->err_code) {
        Py_DECREF(error);
        error = Py_BuildValue(
            "(niiy#y#)", (Py_ssize_t)c->err_line, c->err_slot, c->err_code, c->err_tok,
            (Py_ssize_t)(c->err_tok_end - c->err_tok), c->err_line_start,
            (Py_ssize_t)(c->err_line_end - c->err_line_start));
        if (!error) goto done;
    }
    if (c->err_code && !c->skip_bad) { /* nothing of the block is kept */
        for (int s = 0; s < c->nslots; s++) c->values[s].len = c->lengths[s].len = 0;
        c->n_examples = 0;
    }
    buffers = PyTuple_New(c->nslots);
    if (!buffers) goto done;
    for (int s = 0; s < c->nslots; s++) {
        PyObject *item;
        if (c->kinds[s] & K_DENSE) {
            item = to_buffer(&c->values[s]);
        } else {
            PyObject *vals = to_buffer(&c->values[s]);
            PyObject *lens = vals ? to_buffer(&c->lengths[s]) : NULL;
            item = lens ? PyTuple_Pack(2, vals, lens) : NULL;
            Py_XDECREF(vals);
            Py_XDECREF(lens);
        }
        if (!item) goto done;
        PyTuple_SET_ITEM(buffers, s, item);
    }
    result = Py_BuildValue("(nnnOO)", (Py_ssize_t)c->n_examples, (Py_ssize_t)c->n_lines,
                           (Py_ssize_t)c->n_skipped, error, buffers);
done:
    if (c) {
        for (int s = 0; c->values && c->lengths && s < c->nslots && s < MAX_SLOTS; s++) {
            free(c->values[s].data);
            free(c->lengths[s].data);
        }
        free(c->values);
        free(c->lengths);
        free(c->marks);
    }
    free(c);
    free(dims);
    Py_XDECREF(buffers);
    Py_XDECREF(error);
    if (have_text) PyBuffer_Release(&text);
    PyBuffer_Release(&kinds);
    return result;
}

static PyMethodDef methods[] = {
    {"parse", p_parse, METH_VARARGS,
     "parse(text, kinds, dims, header_fields, skip_bad, hints) -> (n_examples, n_lines, "
     "n_skipped, error, buffers)"},
    {"gather_rows", fleetdata_gather_rows, METH_VARARGS,
     "gather_rows(sources, row_bytes, chunk, row, out): fixed-size rows from chunks"},
    {"jagged_take", fleetdata_jagged_take, METH_VARARGS,
     "jagged_take(values, offsets, itemsize, chunk, row, out_offsets[, out_values]) -> total"},
    {"count_lines", fleetdata_count_lines, METH_VARARGS,
     "count_lines(text, length) -> the '\\n' in text[:length] (without the GIL)"},
    {"trim_heap", fleetdata_trim_heap, METH_NOARGS,
     "trim_heap(): return freed heap pages to the OS"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_parser",
                                    "MultiSlot text parser (fleet.data)", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__parser(void) {
    if (PyType_Ready(&BufType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&BufType);
    if (PyModule_AddObject(m, "Buffer", (PyObject *)&BufType) < 0) {
        Py_DECREF(&BufType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
