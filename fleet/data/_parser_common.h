/* Shared by fleet.data's compiled parser (_parser.c: the MultiSlot parse and the module;
 * _parser_columns.c: gathers of column rows across chunks, line counts, the heap). See _parser.c
 * for the list of functions. */
#ifndef FLEETDATA_PARSER_COMMON_H
#define FLEETDATA_PARSER_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* the '\n' in q[0 .. len) */
size_t fleetdata_count_newlines(const char *q, Py_ssize_t len);

/* module functions defined in _parser_columns.c */
PyObject *fleetdata_gather_rows(PyObject *self, PyObject *args);
PyObject *fleetdata_jagged_take(PyObject *self, PyObject *args);
PyObject *fleetdata_count_lines(PyObject *self, PyObject *args);
PyObject *fleetdata_trim_heap(PyObject *self, PyObject *args);

#endif
