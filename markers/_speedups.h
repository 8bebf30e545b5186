/* markers._speedups: what its two parts (_speedups.c: the phase marker; _driver.c: the
 * loop driver's step) share: the clock, the record buffer's slots and the attribute
 * names interned once for the process. */
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

/* Adds DriverBase (and BATCHES_SHIFT) to the module (_driver.c). */
int add_driver(PyObject *module);

#endif
