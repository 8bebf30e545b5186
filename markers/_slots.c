/* markers._speedups, fourth part: the __slots__ attributes of the markers' own Python
 * objects (the record buffer, the iteration model and its open iteration, the batch
 * sizes, the loop driver) read and written by their offset.
 *
 * PyObject_GetAttr on a slot hashes the name into the interpreter's method cache, then
 * calls the member descriptor it finds there. Between two steps of a training loop,
 * torch's work evicts those lines: the attribute reads and writes of one marked step cost
 * several times more than they do warm (bench/cold_cache.py measures both). Here a
 * (type, name) pair is resolved once to the slot's offset, then read with one load, for
 * as long as the type's version tag stands: CPython gives a type a new tag, never reused,
 * whenever it or a base class changes. Anything that is not a plain writable slot of a
 * type with the generic attribute access (a property, a custom __getattribute__, an
 * unset slot, a deletion) takes PyObject_GetAttr / PyObject_SetAttr, errors included.
 */
#include "_speedups.h"

#define SLOT_ENTRIES 64 /* (type, name) pairs; the markers use about thirty */
#define SLOT_PROBES 4

typedef struct {
    PyObject *name;       /* interned, borrowed: the str_ names live for the process */
    PyTypeObject *type;   /* borrowed, only compared: its version tag vouches for it */
    unsigned int version; /* the type's tp_version_tag when resolved (never 0) */
    Py_ssize_t offset;    /* of the slot's PyObject * in an instance; 0: not a slot */
} SlotEntry;

static SlotEntry entries[SLOT_ENTRIES];

/* The offset of ``type``'s plain writable slot ``name``; 0 when it is something else. */
static Py_ssize_t
resolve(PyTypeObject *type, PyObject *name)
{
    if (type->tp_getattro != PyObject_GenericGetAttr ||
        type->tp_setattro != PyObject_GenericSetAttr) {
        return 0;
    }
    PyObject *descr = _PyType_Lookup(type, name); /* borrowed */
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        return 0;
    }
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != T_OBJECT_EX || (member->flags & READONLY) || member->offset <= 0) {
        return 0;
    }
    return member->offset;
}

/* ``name``'s slot offset in instances of ``type``, cached; 0 when not a plain slot. */
static Py_ssize_t
slot_offset(PyTypeObject *type, PyObject *name)
{
    size_t at = (((uintptr_t)type >> 4) ^ ((uintptr_t)name >> 4) * 31) % SLOT_ENTRIES;
    SlotEntry *free = NULL;
    for (int probe = 0; probe < SLOT_PROBES; probe++) {
        SlotEntry *entry = &entries[(at + (size_t)probe) % SLOT_ENTRIES];
        if (entry->type == type && entry->name == name) {
            if (entry->version == type->tp_version_tag) {
                return entry->offset;
            }
            free = entry; /* the type changed: resolve it again in its place */
            break;
        }
        if (free == NULL && entry->name == NULL) { /* never filled */
            free = entry;
        }
    }
    Py_ssize_t offset = resolve(type, name);
    /* _PyType_Lookup gave the type a version tag when it could; without one, no cache */
    if (free != NULL && type->tp_version_tag != 0) {
        *free = (SlotEntry){name, type, type->tp_version_tag, offset};
    }
    return offset;
}

PyObject *
slot_get(PyObject *obj, PyObject *name)
{
    Py_ssize_t offset = slot_offset(Py_TYPE(obj), name);
    if (offset > 0) {
        PyObject *value = *(PyObject **)((char *)obj + offset);
        if (value != NULL) {
            return Py_NewRef(value);
        }
    }
    return PyObject_GetAttr(obj, name);
}

int
slot_set(PyObject *obj, PyObject *name, PyObject *value)
{
    Py_ssize_t offset = value != NULL ? slot_offset(Py_TYPE(obj), name) : 0;
    if (offset > 0) {
        PyObject **field = (PyObject **)((char *)obj + offset);
        PyObject *old = *field;
        *field = Py_NewRef(value);
        Py_XDECREF(old);
        return 0;
    }
    return PyObject_SetAttr(obj, name, value);
}
