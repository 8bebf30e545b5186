/* markers._speedups: the phase marker's enter and exit as a C type (optional).
 *
 * PhaseBase does what markers.phase.PurePhase does, in C: the hot path of every phase
 * of every step then runs no Python frame (two per phase in Python: __enter__ and
 * __exit__). markers/phase.py builds Phase on this type when it is importable and on
 * PurePhase otherwise; tests/unit/test_phase_speedups.py holds the two to the same slots.
 *
 * The semantics, exactly as PurePhase's:
 *   enter: if already entered (_start != 0) count one more depth; else _start = now.
 *   exit:  if depth, count it down; else pack (id, _start, now) at buffer.n into
 *          buffer.slots (little-endian int64, as markers.wire.SLOT), buffer.n += 3,
 *          _start = 0, and call buffer.flush() once n >= buffer.flush_at or
 *          now >= buffer.deadline_ns.
 * "now" is time.perf_counter_ns()'s clock: CLOCK_MONOTONIC on Linux (what CPython's
 * perf_counter uses there), PyTime_PerfCounterRaw from Python 3.13 elsewhere; with
 * neither the module does not compile and the markers stay on the Python path.
 *
 * A heap type (PyType_FromSpec) so that Python subclasses of it can swap __class__
 * (PhaseTable.use_gpu turns a Phase into a GpuPhase and back).
 */
#include "_speedups.h"

typedef struct {
    PyObject_HEAD
    PyObject *buffer; /* markers.buffer.RecordBuffer */
    long long id;     /* the phase's id on the wire */
    long long start;  /* perf_counter_ns at entry; 0: not entered */
    long long slot;   /* the GPU timer slot of the current entry (GpuPhase) */
    long long depth;  /* entries inside the open one */
} PhaseObject;

/* Attribute and method names, interned once for the process: module state would cost a
 * lookup per call (hence the module declines subinterpreters, see speedups_slots). */
PyObject *str_n, *str_slots, *str_flush_at, *str_deadline_ns, *str_flush;
static PyObject *str_enter, *str_exit;

static int
Phase_init(PhaseObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"buffer", "phase_id", NULL};
    PyObject *buffer;
    long long phase_id;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OL", keywords, &buffer, &phase_id)) {
        return -1;
    }
    Py_XSETREF(self->buffer, Py_NewRef(buffer));
    self->id = phase_id;
    self->start = 0;
    self->slot = -1;
    self->depth = 0;
    return 0;
}

static int
Phase_traverse(PhaseObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self)); /* instances of heap types own a reference to it */
    Py_VISIT(self->buffer);
    return 0;
}

static int
Phase_clear(PhaseObject *self)
{
    Py_CLEAR(self->buffer);
    return 0;
}

static void
Phase_dealloc(PhaseObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Phase_clear(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

long long
buffer_int(PyObject *buffer, PyObject *name)
{
    PyObject *value = slot_get(buffer, name);
    if (value == NULL) {
        return -1;
    }
    long long result = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return result;
}

static PyObject *
Phase_enter(PhaseObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->start) { /* entered again inside itself: the outer entry measures */
        self->depth++;
        return Py_NewRef(self);
    }
    long long start = now_ns();
    if (start == -1 && PyErr_Occurred()) {
        return NULL;
    }
    self->start = start;
    return Py_NewRef(self);
}

int
pack_slot(PyObject *buffer, long long n, long long id, long long start, long long end)
{
    const long long values[3] = {id, start, end};
    return pack_values(buffer, n, values, 3);
}

int
pack_values(PyObject *buffer, long long n, const long long *values, long long count)
{
    PyObject *slots = slot_get(buffer, str_slots);
    if (slots == NULL) {
        return -1;
    }
    Py_buffer view;
    int status = PyObject_GetBuffer(slots, &view, PyBUF_WRITABLE);
    Py_DECREF(slots);
    if (status != 0) {
        return -1;
    }
    if (n < 0 || n > (long long)(view.len / 8) - count) {
        PyErr_Format(PyExc_IndexError,
                     "slot at %lld out of the buffer's %zd values", n, view.len / 8);
        PyBuffer_Release(&view);
        return -1;
    }
    memcpy((char *)view.buf + n * 8, values, (size_t)count * 8);
    PyBuffer_Release(&view);
    return 0;
}

int
record_slot(PyObject *buffer, long long id, long long start, long long end)
{
    long long n = buffer_int(buffer, str_n);
    if (n == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (pack_slot(buffer, n, id, start, end) != 0) {
        return -1;
    }
    n += 3;
    if (set_int(buffer, str_n, n) != 0) {
        return -1;
    }
    long long flush_at = buffer_int(buffer, str_flush_at);
    if (flush_at == -1 && PyErr_Occurred()) {
        return -1;
    }
    int due = n >= flush_at;
    if (!due) {
        long long deadline_ns = buffer_int(buffer, str_deadline_ns);
        if (deadline_ns == -1 && PyErr_Occurred()) {
            return -1;
        }
        due = end >= deadline_ns;
    }
    if (due) {
        PyObject *result = PyObject_CallMethodNoArgs(buffer, str_flush);
        if (result == NULL) {
            return -1;
        }
        Py_DECREF(result);
    }
    return 0;
}

int
set_int(PyObject *obj, PyObject *name, long long value)
{
    PyObject *number = PyLong_FromLongLong(value);
    if (number == NULL) {
        return -1;
    }
    int status = slot_set(obj, name, number);
    Py_DECREF(number);
    return status;
}

static PyObject *
Phase_exit_impl(PhaseObject *self)
{
    if (self->depth) {
        self->depth--;
        Py_RETURN_NONE;
    }
    long long end = now_ns();
    if (end == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *buffer = self->buffer;
    if (buffer == NULL) { /* made by __new__ alone: as PurePhase, no _buffer */
        PyErr_SetString(PyExc_AttributeError, "_buffer");
        return NULL;
    }
    if (record_slot(buffer, self->id, self->start, end) != 0) {
        return NULL;
    }
    self->start = 0;
    Py_RETURN_NONE;
}

static PyObject *
Phase_exit(PhaseObject *self, PyObject *const *Py_UNUSED(args), Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "__exit__ takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    return Phase_exit_impl(self);
}

/* begin and end go through the type's own __enter__ / __exit__, as PurePhase's do, so a
 * subclass (GpuPhase) that overrides them is begun and ended its own way. args[0] is the
 * marker; no PY_VECTORCALL_ARGUMENTS_OFFSET: there is no args[-1] to lend. */
static PyObject *
call_own(PyObject *name, PyObject *const *args, size_t nargs)
{
    PyObject *result = PyObject_VectorcallMethod(name, args, nargs, NULL);
    if (result == NULL) {
        return NULL;
    }
    Py_DECREF(result);
    Py_RETURN_NONE;
}

static PyObject *
Phase_begin(PhaseObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *args[1] = {(PyObject *)self};
    return call_own(str_enter, args, 1);
}

static PyObject *
Phase_end(PhaseObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *args[4] = {(PyObject *)self, Py_None, Py_None, Py_None};
    return call_own(str_exit, args, 4);
}

static PyObject *
Phase_get_phase_id(PhaseObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(self->id);
}

static PyMethodDef Phase_methods[] = {
    {"__enter__", (PyCFunction)Phase_enter, METH_NOARGS, "Enter the phase (now)."},
    {"__exit__", (PyCFunction)(void (*)(void))Phase_exit, METH_FASTCALL,
     "Leave the phase: its slot goes into the buffer."},
    {"begin", (PyCFunction)Phase_begin, METH_NOARGS,
     "Start the phase now (for hooks and callbacks that cannot use ``with``)."},
    {"end", (PyCFunction)Phase_end, METH_NOARGS, "End the phase started by ``begin``."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Phase_members[] = {
    {"_buffer", T_OBJECT_EX, offsetof(PhaseObject, buffer), READONLY, NULL},
    {"_id", T_LONGLONG, offsetof(PhaseObject, id), READONLY, NULL},
    {"_start", T_LONGLONG, offsetof(PhaseObject, start), 0, NULL},
    {"_slot", T_LONGLONG, offsetof(PhaseObject, slot), 0, NULL},
    {"_depth", T_LONGLONG, offsetof(PhaseObject, depth), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Phase_getset[] = {
    {"phase_id", (getter)Phase_get_phase_id, NULL, "The phase's id on the wire.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Phase_slots[] = {
    {Py_tp_doc, "A phase marker's state and its enter/exit, in C (markers.phase)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Phase_init},
    {Py_tp_traverse, Phase_traverse},
    {Py_tp_clear, Phase_clear},
    {Py_tp_dealloc, Phase_dealloc},
    {Py_tp_methods, Phase_methods},
    {Py_tp_members, Phase_members},
    {Py_tp_getset, Phase_getset},
    {0, NULL},
};

static PyType_Spec Phase_spec = {
    .name = "markers._speedups.PhaseBase",
    .basicsize = sizeof(PhaseObject),
    .itemsize = 0,
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = Phase_slots,
};

static int
intern_names(void)
{
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&str_n, "n"},
        {&str_slots, "slots"},
        {&str_flush_at, "flush_at"},
        {&str_deadline_ns, "deadline_ns"},
        {&str_flush, "flush"},
        {&str_enter, "__enter__"},
        {&str_exit, "__exit__"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (*names[i].slot == NULL) {
            *names[i].slot = PyUnicode_InternFromString(names[i].text);
            if (*names[i].slot == NULL) {
                return -1;
            }
        }
    }
    return 0;
}

static int
speedups_exec(PyObject *module)
{
    if (intern_names() != 0) {
        return -1;
    }
    PyObject *type = PyType_FromModuleAndSpec(module, &Phase_spec, NULL);
    if (type == NULL) {
        return -1;
    }
    int status = PyModule_AddObjectRef(module, "PhaseBase", type);
    Py_DECREF(type);
    if (status != 0) {
        return -1;
    }
    if (add_driver(module) != 0) {
        return -1;
    }
    return add_iteration(module);
}

static PyModuleDef_Slot speedups_slots[] = {
    {Py_mod_exec, speedups_exec},
#ifdef Py_mod_multiple_interpreters
    /* the attribute names above are process-wide, not per interpreter */
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "markers._speedups",
    .m_doc = "The phase marker's, the loop driver's and the iteration model's hot paths in "
             "C (markers.phase, markers.driver and markers.iteration use them when "
             "importable).",
    .m_size = 0,
    .m_slots = speedups_slots,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModuleDef_Init(&speedups_module);
}
