/* Shared by the compiled kernels of ps_server (_kernels.c: the table's probe and push, and the
 * module; _kernels_rows.c: row copies, the routing hashes and row creation). See _kernels.c for the list. */
#ifndef FLEETPS_KERNELS_COMMON_H
#define FLEETPS_KERNELS_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INDEX_SALT 0x2545F4914F6CDD1DULL
#define FLAG_DIRTY 2        /* changed since the last save (row_store.DIRTY) */
#define FLAG_EXPORT_DIRTY 8 /* changed since the last serving export (row_store.EXPORT_DIRTY) */
#define FLAG_CHANGED (FLAG_DIRTY | FLAG_EXPORT_DIRTY) /* what a change sets (row_store.CHANGED) */
#define FLAG_SEEN 4
#define FLAG_MARK 0x80 /* transient, inside push only (never left set) */

static inline uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* A buffer with an expected item size and writability; returns 0 and sets an error if not. */
static inline int get_buf(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable,
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

/* -- splitting a batch over threads ------------------------------------------------------- */
/* The per-key loops below are independent per key (probe, gather) or per distinct row (the
   push update), so a large batch is split into contiguous parts run on `threads` threads (the
   calling one included), without the GIL. Parts under MIN_PART keys are not worth a thread. */
enum { MIN_PART = 8192, MAX_THREADS = 64 };

typedef int (*part_fn)(void *ctx, int part, Py_ssize_t lo, Py_ssize_t hi);

typedef struct {
    part_fn fn;
    void *ctx;
    int part;
    Py_ssize_t lo, hi;
    int ret;
} part_t;

static inline void *part_main(void *arg) {
    part_t *p = (part_t *)arg;
    p->ret = p->fn(p->ctx, p->part, p->lo, p->hi);
    return NULL;
}

/* The number of parts run_parts makes of n items for `threads` threads. */
static inline int parts_for(int threads, Py_ssize_t n) {
    Py_ssize_t most = n / MIN_PART;
    if (threads > most) threads = (int)most;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    return threads < 1 ? 1 : threads;
}

/* Runs fn over [0, n) in parts_for(threads, n) parts (fn learns its part's index: per-part
   scratch); returns the OR of the parts' results. A thread that cannot be started has its
   part run by the caller. */
static inline int run_parts(int threads, Py_ssize_t n, part_fn fn, void *ctx) {
    threads = parts_for(threads, n);
    if (threads <= 1) return fn(ctx, 0, 0, n);
    part_t parts[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        parts[t].fn = fn;
        parts[t].ctx = ctx;
        parts[t].part = t;
        parts[t].lo = n * t / threads;
        parts[t].hi = n * (t + 1) / threads;
        parts[t].ret = 0;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&tid[t], NULL, part_main, &parts[t]) == 0;
    int ret = fn(ctx, 0, parts[0].lo, parts[0].hi);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else parts[t].ret = fn(ctx, t, parts[t].lo, parts[t].hi);
        ret |= parts[t].ret;
    }
    return ret;
}

/* -- defined in _kernels_rows.c ------------------------------------------------------------ */
PyObject *psk_gather(PyObject *self, PyObject *args);
PyObject *psk_scatter(PyObject *self, PyObject *args);
PyObject *psk_pack(PyObject *self, PyObject *args);
PyObject *psk_group(PyObject *self, PyObject *args);
PyObject *psk_owned(PyObject *self, PyObject *args);
PyObject *psk_insert(PyObject *self, PyObject *args);
PyObject *psk_uniform(PyObject *self, PyObject *args);
PyObject *psk_normal(PyObject *self, PyObject *args);
PyObject *psk_distinct(PyObject *self, PyObject *args);

#endif
