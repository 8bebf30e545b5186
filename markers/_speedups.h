/* markers._speedups: what its four parts (_speedups.c: the phase marker; _driver.c: the
 * loop driver's step; _iteration.c: the iteration model's once-a-step verbs; _slots.c:
 * attribute access by slot offset) share: the clock, the record buffer's slots and the
 * attribute names interned once for the process. */
#ifndef MARKERS_SPEEDUPS_H
#define MARKERS_SPEEDUPS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

#if PY_BIG_ENDIAN
#error "markers._speedups writes little-endian slots with native stores"
#endif

#if defined(__linux__)
#include <time.h>
#elif PY_VERSION_HEX < 0x030D0000
#error "markers._speedups: no perf_counter_ns clock on this platform before Python 3.13"
#endif

/* time.perf_counter_ns(); -1 with an exception set on failure. */
static inline long long
now_ns(void)
{
#if defined(__linux__)
    struct timespec ts;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
#else
    PyTime_t t;
    if (PyTime_PerfCounterRaw(&t) != 0) {
        return -1;
    }
    return (long long)t;
#endif
}

/* The record buffer's (markers.buffer.RecordBuffer) attribute names. */
extern PyObject *str_n, *str_slots, *str_flush_at, *str_deadline_ns, *str_flush;

/* obj.name (a new reference; NULL with an exception) and obj.name = value (-1 with an
 * exception), a plain __slots__ attribute read or written at its offset (_slots.c);
 * ``name`` must be one of the interned names, which live for the process. */
PyObject *slot_get(PyObject *obj, PyObject *name);
int slot_set(PyObject *obj, PyObject *name, PyObject *value);

/* An integer attribute as a C long long; -1 with an exception on error. */
long long buffer_int(PyObject *obj, PyObject *name);
/* obj.name = value; -1 with an exception on error. */
int set_int(PyObject *obj, PyObject *name, long long value);
/* Pack count values at offset n of buffer.slots (acquired for this write only, as the
 * buffer may grow it between two writes); -1 with an exception on error. */
int pack_values(PyObject *buffer, long long n, const long long *values, long long count);
int pack_slot(PyObject *buffer, long long n, long long id, long long start, long long end);
/* RecordBuffer.record(id, start, end): one slot at buffer.n, flushed when due. */
int record_slot(PyObject *buffer, long long id, long long start, long long end);

#define BATCHES_SHIFT 16 /* markers.wire.BATCHES_SHIFT; markers.driver compares them */

/* Adds DriverBase (and BATCHES_SHIFT) to the module (_driver.c). */
int add_driver(PyObject *module);

/* The iteration model's verbs (_iteration.c). obj.name += 1; -1 with an exception. */
int count_one(PyObject *obj, PyObject *name);
/* Iterations.batch_done(model). */
int model_batch_done(PyObject *model);
/* Whether Iterations.end_full_step takes its one-call case for ``iteration``: it is the
 * open one, its context the current one, no loop left, nothing suspended; -1 on error. */
int one_call_case(PyObject *model, PyObject *iteration);
/* That case (the count no GPU check): the iteration's loop record and the next context
 * in the buffer (counts[validation] = count); the iteration goes on as the next one. */
int end_full_step_here(PyObject *model, PyObject *iteration, PyObject *buffer,
                       PyObject *counts, int validation, long long loop_id, long long now,
                       long long count);
/* Adds end_whole, begin_training and batch_done to the module (_iteration.c). */
int add_iteration(PyObject *module);

#endif
