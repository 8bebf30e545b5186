/* markers._speedups, second part: the loop driver's step as a C type (optional).
 *
 * DriverBase.__next__ does what markers.driver.PureStep.__next__ does, in C: a step of
 * ``for batch in run.train_batches(loader)`` then runs no Python frame of the driver
 * (the loader's and the batch size reader's only). markers/driver.py mixes its
 * once-a-loop methods (_begin, _exhausted, _failed, close) into this type when it is
 * importable; tests/unit/test_driver_speedups.py holds the two steps to the same records.
 *
 * A step, exactly as PureStep's:
 *   state NEW: self._begin() (Python). state DONE: StopIteration.
 *   state RUNNING (the body had the batch): _fetched_n = -1; model.batch_done() (its
 *     net_batches and the open iteration's batches counted); _start_ns = now; when the
 *     iteration holds _per_iteration batches, Iterations.end_full_step(iteration, now):
 *     here (_iteration.c) when its one-call case holds (the iteration open, its context the current
 *     one, no loop left, nothing suspended) and this count is no GPU check, else the
 *     Python method.
 *   then: batch = next(iterator) (exhausted: self._exhausted(), StopIteration); the data
 *     loading slot (RecordBuffer.record); seen(validation, counts[validation],
 *     iteration.batches, batch), whose common case is here: a batch whose size reads
 *     directly (markers.batches.batch_size's fast path) as the size in force only
 *     notes itself as the batch read last; _fetched_n/_fetched_flushes =
 *     buffer.n/flushes.
 *   Any error after _begin: self._failed() (Python), then the error goes on.
 */
#include "_speedups.h"

enum { NEW = 0, RUNNING = 1, DONE = 2 }; /* markers.driver's states */

typedef struct {
    PyObject_HEAD
    PyObject *buffer, *counts, *iteration, *iterator, *loader, *model, *prepare, *seen, *sizes;
    long long check_every, fetched_flushes, fetched_n, loading, loop_id, per_iteration;
    long long start_ns, state;
    char suspended, validation;
} DriverObject;

static PyObject *str_begin, *str_exhausted, *str_failed, *str_batches, *str_flushes, *str_shape,
    *str_read, *str_sized;

static int
Driver_traverse(DriverObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->buffer);
    Py_VISIT(self->counts);
    Py_VISIT(self->iteration);
    Py_VISIT(self->iterator);
    Py_VISIT(self->loader);
    Py_VISIT(self->model);
    Py_VISIT(self->prepare);
    Py_VISIT(self->seen);
    Py_VISIT(self->sizes);
    return 0;
}

static int
Driver_clear(DriverObject *self)
{
    Py_CLEAR(self->buffer);
    Py_CLEAR(self->counts);
    Py_CLEAR(self->iteration);
    Py_CLEAR(self->iterator);
    Py_CLEAR(self->loader);
    Py_CLEAR(self->model);
    Py_CLEAR(self->prepare);
    Py_CLEAR(self->seen);
    Py_CLEAR(self->sizes);
    return 0;
}

static void
Driver_dealloc(DriverObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Driver_clear(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* self.<name>() for the once-a-loop methods (Python, from markers.driver). */
static int
call_own(DriverObject *self, PyObject *name)
{
    PyObject *result = PyObject_CallMethodNoArgs((PyObject *)self, name);
    if (result == NULL) {
        return -1;
    }
    Py_DECREF(result);
    return 0;
}

/* An integer attribute of the iteration, or -1 with an exception. */
#define GET_INT(obj, name, var)                                                          \
    long long var = buffer_int(obj, name);                                               \
    if (var == -1 && PyErr_Occurred()) {                                                 \
        return -1;                                                                       \
    }

/* The step's end: the batch went through the network; a full iteration ends. */
static int
step_end(DriverObject *self)
{
    PyObject *model = self->model;
    if (model_batch_done(model) != 0) {
        return -1;
    }
    long long now = now_ns();
    if (now == -1 && PyErr_Occurred()) {
        return -1;
    }
    self->start_ns = now;
    GET_INT(self->iteration, str_batches, batches);
    if (batches != self->per_iteration) {
        return 0;
    }
    int here = one_call_case(model, self->iteration);
    if (here == -1) {
        return -1;
    }
    PyObject *counted = PyList_Check(self->counts)
                            ? PyList_GetItem(self->counts, self->validation)
                            : NULL;
    if (counted == NULL) {
        PyErr_SetString(PyExc_TypeError, "the model's counts are no list of two");
        return -1;
    }
    long long count = PyLong_AsLongLong(counted) + 1;
    if (count == 0 && PyErr_Occurred()) {
        return -1;
    }
    if (here && self->check_every > 0 && count % self->check_every != 0) {
        return end_full_step_here(model, self->iteration, self->buffer, self->counts,
                                  self->validation, self->loop_id, now, count);
    }
    /* else Python takes it: a GPU check is due, or something was left or suspended */
    PyObject *next = PyObject_CallMethod(model, "end_full_step", "OL", self->iteration, now);
    if (next == NULL) {
        return -1;
    }
    Py_SETREF(self->iteration, next);
    return 0;
}

/* The first dimension of ``item``'s ``shape`` into *size when it is a non-empty tuple
 * starting with an int and *size is 0 or that same dimension: 1; else 0 (not a shape,
 * or a disagreement); -1 with an exception. */
static int
agreeing_dim(PyObject *item, long long *size)
{
    PyObject *shape = PyObject_GetAttr(item, str_shape);
    if (shape == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    int found = 0;
    if (PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) > 0 &&
        PyLong_CheckExact(PyTuple_GET_ITEM(shape, 0))) {
        long long dim = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 0));
        if (dim == -1 && PyErr_Occurred()) {
            Py_DECREF(shape);
            return -1;
        }
        found = *size == 0 ? dim > 0 : dim == *size;
        if (found) {
            *size = dim;
        }
    }
    Py_DECREF(shape);
    return found;
}

/* markers.batches.batch_size's direct read: a tensor, or a tuple, list or dict of
 * tensors, every first dimension the same: that size (> 0); 0 when it takes the
 * general reader (or the size is 0); -1 with an exception. */
static long long
direct_size(PyObject *batch)
{
    long long size = 0;
    PyTypeObject *kind = Py_TYPE(batch);
    if (kind == &PyDict_Type) {
        Py_ssize_t at = 0;
        PyObject *key, *value;
        while (PyDict_Next(batch, &at, &key, &value)) {
            Py_INCREF(value);
            int found = agreeing_dim(value, &size);
            Py_DECREF(value);
            if (found != 1) {
                return found;
            }
        }
        return size;
    }
    if (kind == &PyTuple_Type || kind == &PyList_Type) {
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(batch); i++) {
            PyObject *item = Py_NewRef(PySequence_Fast_GET_ITEM(batch, i));
            int found = agreeing_dim(item, &size);
            Py_DECREF(item);
            if (found != 1) {
                return found;
            }
        }
        return size;
    }
    int found = agreeing_dim(batch, &size);
    return found == 1 ? size : found;
}

/* BatchSizes.seen's case of a batch read directly whose size is the one in force: only
 * the batch read last is noted (nothing to send). 1 when it was that case, 0 when
 * BatchSizes.seen must read it, -1 with an exception. */
static int
same_size_seen(DriverObject *self, PyObject *batch, PyObject *counted, PyObject *position)
{
    if (self->sizes == NULL || self->sizes == Py_None) {
        return 0;
    }
    long long size = direct_size(batch);
    if (size <= 0) {
        return (int)size;
    }
    PyObject *read = slot_get(self->sizes, str_read);
    if (read == NULL) {
        return -1;
    }
    PyObject *in_force = PyList_Check(read) && PyList_GET_SIZE(read) == 2
                             ? PyList_GET_ITEM(read, (Py_ssize_t)self->validation)
                             : NULL;
    int same = in_force != NULL && PyLong_CheckExact(in_force) &&
               PyLong_AsLongLong(in_force) == size;
    Py_DECREF(read);
    if (!same) {
        return PyErr_Occurred() ? -1 : 0;
    }
    PyObject *sized = slot_get(self->sizes, str_sized);
    if (sized == NULL) {
        return -1;
    }
    int status = -1;
    if (!PyList_Check(sized) || PyList_GET_SIZE(sized) != 2) {
        PyErr_SetString(PyExc_TypeError, "the batch sizes' last read is no list of two");
    }
    else {
        PyObject *where = PyTuple_Pack(2, counted, position);
        if (where != NULL) {
            status = PyList_SetItem(sized, self->validation, where) == 0 ? 1 : -1;
        }
    }
    Py_DECREF(sized);
    return status;
}

/* The fetched batch: its data loading slot, its size read, the buffer noted. */
static int
batch_fetched(DriverObject *self, PyObject *batch)
{
    long long now = now_ns();
    if (now == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (record_slot(self->buffer, self->loading, self->start_ns, now) != 0) {
        return -1;
    }
    PyObject *position = slot_get(self->iteration, str_batches);
    if (position == NULL) {
        return -1;
    }
    PyObject *counted = PyList_Check(self->counts)
                            ? PyList_GetItem(self->counts, self->validation)
                            : NULL;
    if (counted == NULL) {
        Py_DECREF(position);
        PyErr_SetString(PyExc_TypeError, "the model's counts are no list of two");
        return -1;
    }
    Py_INCREF(counted);
    int seen = same_size_seen(self, batch, counted, position);
    if (seen == 0) {
        PyObject *args[4] = {self->validation ? Py_True : Py_False, counted, position, batch};
        PyObject *result = PyObject_Vectorcall(self->seen, args, 4, NULL);
        Py_XDECREF(result);
        seen = result == NULL ? -1 : 1;
    }
    Py_DECREF(counted);
    Py_DECREF(position);
    if (seen != 1) {
        return -1;
    }
    long long n = buffer_int(self->buffer, str_n);
    if (n == -1 && PyErr_Occurred()) {
        return -1;
    }
    long long flushes = buffer_int(self->buffer, str_flushes);
    if (flushes == -1 && PyErr_Occurred()) {
        return -1;
    }
    self->fetched_n = n;
    self->fetched_flushes = flushes;
    return 0;
}

static PyObject *
Driver_next(DriverObject *self)
{
    if (self->state == DONE) {
        return NULL; /* StopIteration */
    }
    if (self->model == NULL || self->buffer == NULL || self->seen == NULL ||
        self->counts == NULL) {
        PyErr_SetString(PyExc_TypeError, "a loop driver used before its __init__");
        return NULL;
    }
    if (self->state == NEW) {
        if (call_own(self, str_begin) != 0) {
            return NULL; /* _begin settled what it began */
        }
    }
    else {
        self->fetched_n = -1;
        if (self->iteration == NULL || step_end(self) != 0) {
            goto failed;
        }
    }
    if (self->iterator == NULL || self->iteration == NULL) {
        PyErr_SetString(PyExc_TypeError, "a loop driver begun without its loader");
        goto failed;
    }
    PyObject *batch = PyIter_Next(self->iterator);
    if (batch == NULL) {
        if (PyErr_Occurred()) {
            goto failed;
        }
        call_own(self, str_exhausted); /* its error, if any, goes on */
        return NULL;
    }
    if (batch_fetched(self, batch) != 0) {
        Py_DECREF(batch);
        goto failed;
    }
    return batch;
failed:;
    /* the error goes on once _failed settled the loop (an error of its own replaces it) */
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (call_own(self, str_failed) != 0) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return NULL;
    }
    PyErr_Restore(type, value, traceback);
    return NULL;
}

static PyMemberDef Driver_members[] = {
    {"_buffer", T_OBJECT, offsetof(DriverObject, buffer), 0, NULL},
    {"_counts", T_OBJECT, offsetof(DriverObject, counts), 0, NULL},
    {"_iteration", T_OBJECT, offsetof(DriverObject, iteration), 0, NULL},
    {"_iterator", T_OBJECT, offsetof(DriverObject, iterator), 0, NULL},
    {"_loader", T_OBJECT, offsetof(DriverObject, loader), 0, NULL},
    {"_model", T_OBJECT, offsetof(DriverObject, model), 0, NULL},
    {"_prepare", T_OBJECT, offsetof(DriverObject, prepare), 0, NULL},
    {"_seen", T_OBJECT, offsetof(DriverObject, seen), 0, NULL},
    {"_sizes", T_OBJECT, offsetof(DriverObject, sizes), 0, NULL},
    {"_check_every", T_LONGLONG, offsetof(DriverObject, check_every), 0, NULL},
    {"_fetched_flushes", T_LONGLONG, offsetof(DriverObject, fetched_flushes), 0, NULL},
    {"_fetched_n", T_LONGLONG, offsetof(DriverObject, fetched_n), 0, NULL},
    {"_loading", T_LONGLONG, offsetof(DriverObject, loading), 0, NULL},
    {"_loop_id", T_LONGLONG, offsetof(DriverObject, loop_id), 0, NULL},
    {"_per_iteration", T_LONGLONG, offsetof(DriverObject, per_iteration), 0, NULL},
    {"_start_ns", T_LONGLONG, offsetof(DriverObject, start_ns), 0, NULL},
    {"_state", T_LONGLONG, offsetof(DriverObject, state), 0, NULL},
    {"_suspended", T_BOOL, offsetof(DriverObject, suspended), 0, NULL},
    {"_validation", T_BOOL, offsetof(DriverObject, validation), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot Driver_slots[] = {
    {Py_tp_doc, "A loop driver's state and its step, in C (markers.driver)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_traverse, Driver_traverse},
    {Py_tp_clear, Driver_clear},
    {Py_tp_dealloc, Driver_dealloc},
    {Py_tp_iter, PyObject_SelfIter},
    {Py_tp_iternext, Driver_next},
    {Py_tp_members, Driver_members},
    {0, NULL},
};

static PyType_Spec Driver_spec = {
    .name = "markers._speedups.DriverBase",
    .basicsize = sizeof(DriverObject),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = Driver_slots,
};

int
add_driver(PyObject *module)
{
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&str_begin, "_begin"},
        {&str_exhausted, "_exhausted"},
        {&str_failed, "_failed"},
        {&str_batches, "batches"},
        {&str_flushes, "flushes"},
        {&str_shape, "shape"},
        {&str_read, "_read"},
        {&str_sized, "_sized"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (*names[i].slot == NULL) {
            *names[i].slot = PyUnicode_InternFromString(names[i].text);
            if (*names[i].slot == NULL) {
                return -1;
            }
        }
    }
    if (PyModule_AddIntConstant(module, "BATCHES_SHIFT", BATCHES_SHIFT) != 0) {
        return -1;
    }
    PyObject *type = PyType_FromModuleAndSpec(module, &Driver_spec, NULL);
    if (type == NULL) {
        return -1;
    }
    int status = PyModule_AddObjectRef(module, "DriverBase", type);
    Py_DECREF(type);
    return status;
}
