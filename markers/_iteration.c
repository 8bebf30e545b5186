/* markers._speedups, third part: the iteration model's once-a-step verbs in C (optional).
 *
 * markers.iteration.Iterations is Python; what a step of the loop driver (_driver.c) or
 * of instrument()'s hooks (markers.hooks) asks of it once a step is here, each in its
 * common case, and the Python method otherwise, so the records are the same:
 *
 *   end_full_step_here (for _driver.c): Iterations.end_full_step's one-call case.
 *   end_whole(training_loop, validation_loop, check_every, model, end_ns):
 *     Iterations.end_iteration(end_ns) when the open iteration's context is the current
 *     one and its count is no GPU check: its loop record, then no iteration's context.
 *   begin_training(iteration_type, loading_id, model, start_ns, loaded_ns):
 *     Iterations.begin_training(start_ns, loaded_ns) (begin_iteration(False, start_ns,
 *     explicit_end=True), then data_loaded) when nothing is open, left or suspended: the
 *     iteration and its context, then its data loading slot.
 *   batch_done(model): Iterations.batch_done.
 * markers.iteration binds the ids and the type (functools.partial) and falls back to the
 * Python verbs where this is not built; tests/unit/test_iteration_speedups.py holds the
 * two to the same slots.
 */
#include "_speedups.h"

static PyObject *str_open, *str_context, *str_model_context, *str_left, *str_suspended,
    *str_contexts, *str_sent_since_context, *str_start_ns, *str_excluded_ns, *str_batches,
    *str_recorded, *str_epoch, *str_net_batches, *str_validation, *str_explicit_end,
    *str_buffer, *str_counts, *str_gpu, *str_end_iteration, *str_begin_training;

/* An integer attribute, or return -1 with an exception. */
#define GET_INT(obj, name, var)                                                          \
    long long var = buffer_int(obj, name);                                               \
    if (var == -1 && PyErr_Occurred()) {                                                 \
        return -1;                                                                       \
    }

/* Whether obj.name is expected (identity); -1 with an exception on error. */
static int
attr_is(PyObject *obj, PyObject *name, PyObject *expected)
{
    PyObject *value = slot_get(obj, name);
    if (value == NULL) {
        return -1;
    }
    int same = value == expected;
    Py_DECREF(value);
    return same;
}

/* Whether obj.name is falsy (an empty list, None); -1 with an exception. */
static int
attr_empty(PyObject *obj, PyObject *name)
{
    PyObject *value = slot_get(obj, name);
    if (value == NULL) {
        return -1;
    }
    int empty = PyObject_Not(value);
    Py_DECREF(value);
    return empty;
}

/* Whether the iteration's context is the model's current one (identity); -1 on error. */
static int
context_current(PyObject *model, PyObject *iteration)
{
    PyObject *context = slot_get(iteration, str_context);
    if (context == NULL) {
        return -1;
    }
    int current = attr_is(model, str_model_context, context);
    Py_DECREF(context);
    return current;
}

int
one_call_case(PyObject *model, PyObject *iteration)
{
    int open = attr_is(model, str_open, iteration);
    if (open != 1) {
        return open;
    }
    int current = context_current(model, iteration);
    if (current != 1) {
        return current;
    }
    int nothing_left = attr_empty(model, str_left);
    if (nothing_left != 1) {
        return nothing_left;
    }
    return attr_is(model, str_suspended, Py_None);
}

/* The buffer's current context slot's tag (its flags and epoch) and its offset. */
static int
current_context(PyObject *buffer, PyObject *contexts, long long *tag)
{
    Py_ssize_t count = PyList_Check(contexts) ? PyList_GET_SIZE(contexts) : 0;
    if (count == 0) {
        PyErr_SetString(PyExc_TypeError, "the buffer's contexts are no list, or empty");
        return -1;
    }
    long long at = PyLong_AsLongLong(PyList_GET_ITEM(contexts, count - 1));
    if (at == -1 && PyErr_Occurred()) {
        return -1;
    }
    PyObject *slots = slot_get(buffer, str_slots);
    if (slots == NULL) {
        return -1;
    }
    PyObject *value = PySequence_GetItem(slots, (Py_ssize_t)at);
    Py_DECREF(slots);
    if (value == NULL) {
        return -1;
    }
    *tag = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return *tag == -1 && PyErr_Occurred() ? -1 : 0;
}

/* The context slot packed at offset n: noted in the buffer's contexts, n moved past it. */
static int
note_context(PyObject *buffer, PyObject *contexts, long long n)
{
    PyObject *offset = PyLong_FromLongLong(n);
    if (offset == NULL || PyList_Append(contexts, offset) != 0) {
        Py_XDECREF(offset);
        return -1;
    }
    Py_DECREF(offset);
    if (slot_set(buffer, str_sent_since_context, Py_False) != 0) {
        return -1;
    }
    return set_int(buffer, str_n, n + 3);
}

/* RecordBuffer.record_and_context(tag, start, end, context): packed here when neither
 * would flush, else the Python method. */
static int
record_and_context(PyObject *buffer, long long tag, long long start, long long end,
                   PyObject *context, long long iteration, long long batch)
{
    GET_INT(buffer, str_n, n);
    GET_INT(buffer, str_flush_at, flush_at);
    GET_INT(buffer, str_deadline_ns, deadline_ns);
    if (n + 6 > flush_at || end >= deadline_ns) {
        PyObject *result = PyObject_CallMethod(buffer, "record_and_context", "LLLO", tag,
                                               start, end, context);
        Py_XDECREF(result);
        return result == NULL ? -1 : 0; /* rare: once a flush */
    }
    PyObject *contexts = slot_get(buffer, str_contexts);
    if (contexts == NULL) {
        return -1;
    }
    long long context_tag;
    int status = -1;
    if (current_context(buffer, contexts, &context_tag) == 0) {
        const long long values[6] = {tag, start, end, context_tag, iteration, batch};
        if (pack_values(buffer, n, values, 6) == 0) {
            status = note_context(buffer, contexts, n + 3);
        }
    }
    Py_DECREF(contexts);
    return status;
}

/* RecordBuffer.set_context(flags, epoch, iteration, batch), here while the array has
 * room for it and two more phases with GPU slots (else the Python method grows it). */
static int
set_context_here(PyObject *buffer, long long flags, long long epoch, long long iteration,
                 long long batch)
{
    GET_INT(buffer, str_n, n);
    PyObject *slots = slot_get(buffer, str_slots);
    if (slots == NULL) {
        return -1;
    }
    Py_ssize_t length = PyObject_Size(slots);
    Py_DECREF(slots);
    if (length < 0) {
        return -1;
    }
    if ((long long)length - (n + 3) < 12) {
        PyObject *result = PyObject_CallMethod(buffer, "set_context", "LLLL", flags, epoch,
                                               iteration, batch);
        Py_XDECREF(result);
        return result == NULL ? -1 : 0;
    }
    PyObject *contexts = slot_get(buffer, str_contexts);
    if (contexts == NULL) {
        return -1;
    }
    int status = -1;
    Py_ssize_t count = PyList_Check(contexts) ? PyList_GET_SIZE(contexts) : -1;
    if (count < 0) {
        PyErr_SetString(PyExc_TypeError, "the buffer's contexts are no list");
        goto done;
    }
    if (count > 0) { /* nothing recorded under the previous context: replace it */
        long long last = PyLong_AsLongLong(PyList_GET_ITEM(contexts, count - 1));
        if (last == -1 && PyErr_Occurred()) {
            goto done;
        }
        if (last == n - 3) {
            n -= 3;
            if (PyList_SetSlice(contexts, count - 1, count, NULL) != 0) {
                goto done;
            }
        }
    }
    const long long values[3] = {0xFFFF | flags << 16 | epoch << 32, iteration, batch};
    if (pack_values(buffer, n, values, 3) == 0) {
        status = note_context(buffer, contexts, n);
    }
done:
    Py_DECREF(contexts);
    return status;
}

int
end_full_step_here(PyObject *model, PyObject *iteration, PyObject *buffer, PyObject *counts,
                   int validation, long long loop_id, long long now, long long count)
{
    GET_INT(iteration, str_start_ns, start);
    GET_INT(iteration, str_excluded_ns, excluded_ns);
    GET_INT(iteration, str_batches, batches);
    GET_INT(model, str_epoch, epoch);
    GET_INT(model, str_net_batches, net_batches);
    PyObject *old = slot_get(iteration, str_context);
    if (old == NULL) {
        return -1;
    }
    PyObject *flags = PyTuple_Check(old) && PyTuple_GET_SIZE(old) == 4
                          ? Py_NewRef(PyTuple_GET_ITEM(old, 0))
                          : NULL;
    Py_DECREF(old);
    if (flags == NULL) {
        PyErr_SetString(PyExc_TypeError, "an iteration's context is no 4-tuple");
        return -1;
    }
    PyObject *number = PyLong_FromLongLong(count);
    if (number == NULL) {
        Py_DECREF(flags);
        return -1;
    }
    if (PyList_SetItem(counts, validation, Py_NewRef(number)) != 0) {
        Py_DECREF(flags);
        Py_DECREF(number);
        return -1;
    }
    PyObject *context = Py_BuildValue("(NLNL)", flags, epoch, number, net_batches);
    if (context == NULL) {
        return -1;
    }
    long long end = now - excluded_ns > start ? now - excluded_ns : start;
    int status = -1;
    if (set_int(iteration, str_start_ns, now) != 0 ||
        slot_set(iteration, str_context, context) != 0 ||
        set_int(iteration, str_batches, 0) != 0 ||
        set_int(iteration, str_excluded_ns, 0) != 0 ||
        slot_set(iteration, str_recorded, Py_False) != 0 ||
        slot_set(model, str_model_context, context) != 0) {
        goto done;
    }
    status = record_and_context(buffer, loop_id | batches << BATCHES_SHIFT, start, end,
                                context, count, net_batches);
done:
    Py_DECREF(context);
    return status;
}

/* model.<name>(args...) (at most two) for a case taken in Python; None or NULL. */
static PyObject *
in_python(PyObject *model, PyObject *name, PyObject *const *args, size_t nargs)
{
    PyObject *call[3] = {model};
    for (size_t i = 0; i < nargs; i++) {
        call[i + 1] = args[i];
    }
    PyObject *result = PyObject_VectorcallMethod(name, call, nargs + 1, NULL);
    if (result == NULL) {
        return NULL;
    }
    Py_DECREF(result);
    Py_RETURN_NONE;
}

/* counts[validation] += 1 (a list of two ints); the new count, -1 with an exception. */
static long long
count_iteration(PyObject *counts, int validation)
{
    if (!PyList_Check(counts) || PyList_GET_SIZE(counts) != 2) {
        PyErr_SetString(PyExc_TypeError, "the model's counts are no list of two");
        return -1;
    }
    long long count = PyLong_AsLongLong(PyList_GET_ITEM(counts, validation)) + 1;
    if (count == 0 && PyErr_Occurred()) {
        return -1;
    }
    PyObject *number = PyLong_FromLongLong(count);
    if (number == NULL || PyList_SetItem(counts, validation, number) != 0) {
        return -1;
    }
    return count;
}

/* end_whole's C case, the open iteration given: 1 done, 0 for Python, -1 error. */
static int
end_whole_here(PyObject *model, PyObject *open, long long end_ns, const long long *loop_ids,
               long long check_every)
{
    int current = context_current(model, open);
    if (current != 1) {
        return current;
    }
    int validation = attr_is(open, str_validation, Py_True);
    if (validation == -1) {
        return -1;
    }
    PyObject *buffer = slot_get(model, str_buffer);
    if (buffer == NULL) {
        return -1;
    }
    PyObject *counts = slot_get(model, str_counts);
    int status = counts == NULL ? -1 : 0;
    if (status == 0 && !validation) { /* a GPU check due at this count: Python's */
        long long count = PyList_Check(counts) && PyList_GET_SIZE(counts) == 2
                              ? PyLong_AsLongLong(PyList_GET_ITEM(counts, 0))
                              : -1;
        int no_gpu = attr_is(buffer, str_gpu, Py_None);
        if (count < 0 || no_gpu == -1) {
            status = -1;
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_TypeError, "the model's counts are no list of two");
            }
        }
        else if (no_gpu && check_every > 0 && (count + 1) % check_every == 0) {
            status = 1;
        }
    }
    if (status != 0) {
        Py_XDECREF(counts);
        Py_DECREF(buffer);
        return status == 1 ? 0 : -1;
    }
    status = -1;
    long long start = buffer_int(open, str_start_ns), excluded = 0, batches = 0;
    long long epoch = 0, net_batches = 0;
    if ((start == -1 && PyErr_Occurred()) ||
        ((excluded = buffer_int(open, str_excluded_ns)) == -1 && PyErr_Occurred()) ||
        ((batches = buffer_int(open, str_batches)) == -1 && PyErr_Occurred()) ||
        ((epoch = buffer_int(model, str_epoch)) == -1 && PyErr_Occurred()) ||
        ((net_batches = buffer_int(model, str_net_batches)) == -1 && PyErr_Occurred()) ||
        slot_set(model, str_open, Py_None) != 0 ||
        count_iteration(counts, validation) < 0) {
        goto done;
    }
    long long end = end_ns - excluded > start ? end_ns - excluded : start;
    if (record_slot(buffer, loop_ids[validation] | batches << BATCHES_SHIFT, start, end) != 0) {
        goto done;
    }
    /* set_outside: no iteration's context, kept by identity in the model */
    PyObject *outside = Py_BuildValue("(iLiL)", 0, epoch, -1, net_batches);
    if (outside == NULL) {
        goto done;
    }
    if (slot_set(model, str_model_context, outside) == 0 &&
        set_context_here(buffer, 0, epoch, -1, net_batches) == 0) {
        status = 1;
    }
    Py_DECREF(outside);
done:
    Py_DECREF(counts);
    Py_DECREF(buffer);
    return status;
}

/* Whether a verb was given its five arguments (else a TypeError is set). */
static int
five_args(const char *verb, Py_ssize_t nargs)
{
    if (nargs == 5) {
        return 1;
    }
    PyErr_Format(PyExc_TypeError, "%s takes 5 arguments (%zd given)", verb, nargs);
    return 0;
}

static PyObject *
end_whole(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (!five_args("end_whole", nargs)) {
        return NULL;
    }
    const long long loop_ids[2] = {PyLong_AsLongLong(args[0]), PyLong_AsLongLong(args[1])};
    long long check_every = PyLong_AsLongLong(args[2]);
    PyObject *model = args[3];
    long long end_ns = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    PyObject *open = slot_get(model, str_open);
    if (open == NULL) {
        return NULL;
    }
    int here = open == Py_None ? 1 : end_whole_here(model, open, end_ns, loop_ids, check_every);
    Py_DECREF(open);
    if (here == -1) {
        return NULL;
    }
    if (!here) {
        return in_python(model, str_end_iteration, &args[4], 1);
    }
    Py_RETURN_NONE;
}

/* begin_training's C case: nothing open, left or suspended. 1 done, 0 for Python. */
static int
begin_training_here(PyObject *type, long long loading_id, PyObject *model, PyObject *start,
                    long long loaded_ns)
{
    int here = attr_empty(model, str_left);
    if (here == 1) {
        here = attr_is(model, str_open, Py_None);
    }
    if (here == 1) {
        here = attr_is(model, str_suspended, Py_None);
    }
    if (here != 1 || !PyType_Check(type)) {
        return here == 1 ? 0 : here;
    }
    long long start_ns = PyLong_AsLongLong(start);
    GET_INT(model, str_epoch, epoch);
    GET_INT(model, str_net_batches, net_batches);
    PyObject *counts = slot_get(model, str_counts);
    if (counts == NULL) {
        return -1;
    }
    long long number = PyList_Check(counts) && PyList_GET_SIZE(counts) == 2
                           ? PyLong_AsLongLong(PyList_GET_ITEM(counts, 0))
                           : -1;
    Py_DECREF(counts);
    if (number == -1 || (start_ns == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "the model's counts are no list of two");
        }
        return -1;
    }
    PyObject *buffer = slot_get(model, str_buffer);
    if (buffer == NULL) {
        return -1;
    }
    int status = -1;
    PyObject *context = Py_BuildValue("(iLLL)", 1, epoch, number, net_batches);
    PyObject *empty = PyTuple_New(0);
    /* OpenIteration(False, start_ns, context, True), its slots set here: no __init__ frame */
    PyObject *iteration = context == NULL || empty == NULL
                              ? NULL
                              : ((PyTypeObject *)type)->tp_new((PyTypeObject *)type, empty, NULL);
    if (iteration != NULL && slot_set(iteration, str_validation, Py_False) == 0 &&
        slot_set(iteration, str_explicit_end, Py_True) == 0 &&
        slot_set(iteration, str_start_ns, start) == 0 &&
        slot_set(iteration, str_context, context) == 0 &&
        set_int(iteration, str_batches, 0) == 0 && set_int(iteration, str_excluded_ns, 0) == 0 &&
        slot_set(iteration, str_recorded, Py_False) == 0 &&
        slot_set(model, str_open, iteration) == 0 &&
        slot_set(model, str_model_context, context) == 0 &&
        set_context_here(buffer, 1, epoch, number, net_batches) == 0 &&
        record_slot(buffer, loading_id, start_ns, loaded_ns) == 0) {
        status = 1;
    }
    Py_XDECREF(iteration);
    Py_XDECREF(empty);
    Py_XDECREF(context);
    Py_DECREF(buffer);
    return status;
}

static PyObject *
begin_training(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (!five_args("begin_training", nargs)) {
        return NULL;
    }
    long long loading_id = PyLong_AsLongLong(args[1]);
    long long loaded_ns = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    int here = begin_training_here(args[0], loading_id, args[2], args[3], loaded_ns);
    if (here == -1) {
        return NULL;
    }
    if (!here) {
        return in_python(args[2], str_begin_training, &args[3], 2);
    }
    Py_RETURN_NONE;
}

/* obj.name += 1 */
int
count_one(PyObject *obj, PyObject *name)
{
    GET_INT(obj, name, value);
    return set_int(obj, name, value + 1);
}

int
model_batch_done(PyObject *model)
{
    if (count_one(model, str_net_batches) != 0) {
        return -1;
    }
    PyObject *open = slot_get(model, str_open);
    if (open == NULL) {
        return -1;
    }
    int status = open == Py_None ? 0 : count_one(open, str_batches);
    Py_DECREF(open);
    return status;
}

static PyObject *
batch_done(PyObject *Py_UNUSED(module), PyObject *model)
{
    return model_batch_done(model) == 0 ? Py_NewRef(Py_None) : NULL;
}

static PyMethodDef iteration_functions[] = {
    {"end_whole", (PyCFunction)(void (*)(void))end_whole, METH_FASTCALL,
     "Iterations.end_iteration(end_ns), its common case here (markers.iteration)."},
    {"begin_training", (PyCFunction)(void (*)(void))begin_training, METH_FASTCALL,
     "A training iteration begun with its data loading (markers.iteration)."},
    {"batch_done", batch_done, METH_O, "Iterations.batch_done (markers.iteration)."},
    {NULL, NULL, 0, NULL},
};

int
add_iteration(PyObject *module)
{
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&str_open, "open"},
        {&str_context, "context"},
        {&str_model_context, "_context"},
        {&str_left, "_left"},
        {&str_suspended, "_suspended"},
        {&str_contexts, "_contexts"},
        {&str_sent_since_context, "_sent_since_context"},
        {&str_start_ns, "start_ns"},
        {&str_excluded_ns, "excluded_ns"},
        {&str_batches, "batches"},
        {&str_recorded, "recorded"},
        {&str_epoch, "epoch"},
        {&str_net_batches, "net_batches"},
        {&str_validation, "validation"},
        {&str_explicit_end, "explicit_end"},
        {&str_buffer, "_buffer"},
        {&str_counts, "counts"},
        {&str_gpu, "gpu"},
        {&str_end_iteration, "end_iteration"},
        {&str_begin_training, "begin_training"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (*names[i].slot == NULL) {
            *names[i].slot = PyUnicode_InternFromString(names[i].text);
            if (*names[i].slot == NULL) {
                return -1;
            }
        }
    }
    return PyModule_AddFunctions(module, iteration_functions);
}
