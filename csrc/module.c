/* kvflow._native module: setup(), evolve(), handle(). See native.h for the contract. */
#include "native.h"

PyObject *kv_ns = NULL;
static int kv_ready = 0;
static PyObject *rejected_cls = NULL; /* kvflow.errors.Rejected, bound by setup() */
static PyObject *event_types = NULL;   /* kvflow.events.EVENT_TYPES, bound by setup() */
static PyObject *command_types = NULL; /* kvflow.events.COMMAND_TYPES */
static PyObject *str_seq = NULL;


PyObject *kv_ref(const char *name)
{
    PyObject *value = PyDict_GetItemString(kv_ns, name); /* borrowed */
    if (value == NULL) {
        PyErr_Format(PyExc_KeyError, "kvflow._native: setup namespace lacks %s", name);
        return NULL;
    }
    Py_INCREF(value);
    return value;
}

static PyObject *native_setup(PyObject *self, PyObject *ns)
{
    if (!PyDict_Check(ns)) {
        PyErr_SetString(PyExc_TypeError, "setup() takes the namespace dict");
        return NULL;
    }
    Py_XDECREF(kv_ns);
    Py_INCREF(ns);
    kv_ns = ns;
    kv_ready = 0;
    Py_XDECREF(rejected_cls);
    Py_XDECREF(event_types);
    Py_XDECREF(command_types);
    rejected_cls = kv_ref("Rejected");
    event_types = kv_ref("EVENT_TYPES");
    command_types = kv_ref("COMMAND_TYPES");
    if (str_seq == NULL)
        str_seq = PyUnicode_InternFromString("seq");
    if (rejected_cls == NULL || event_types == NULL || command_types == NULL || str_seq == NULL)
        return NULL;
    if (!PyTuple_Check(event_types) || !PyTuple_Check(command_types)) {
        PyErr_SetString(PyExc_TypeError, "EVENT_TYPES and COMMAND_TYPES must be tuples");
        return NULL;
    }
    if (kv_evolve_init() < 0 || kv_decide_init() < 0)
        return NULL;
    kv_ready = 1;
    Py_RETURN_NONE;
}

static int not_ready(void)
{
    if (!kv_ready) {
        PyErr_SetString(PyExc_RuntimeError, "kvflow._native.setup() was not called");
        return 1;
    }
    return 0;
}

static PyObject *native_evolve(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "evolve(state, event, check)");
        return NULL;
    }
    if (not_ready())
        return NULL;
    int check = PyObject_IsTrue(args[2]);
    if (check < 0)
        return NULL;
    int r = kv_apply(args[0], args[1], check);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

static PyObject *native_handle(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "handle(state, command, check)");
        return NULL;
    }
    if (not_ready())
        return NULL;
    int check = PyObject_IsTrue(args[2]);
    if (check < 0)
        return NULL;
    return kv_handle(args[0], args[1], check);
}

/* --- manager.py's boundary normalisation (_ints / _hashes) ------------------------------ */


/* tuple(r) for a range r whose values all fit in a long long (the values range iteration
 * gives, computed directly); NULL with nothing raised when r is outside that (the caller
 * then iterates), NULL with an error set on a real error. */
static PyObject *range_tuple(PyObject *r)
{
    Py_ssize_t n = PyObject_Size(r);
    if (n < 0) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError))
            PyErr_Clear();
        return NULL;
    }
    PyObject *start_obj = PyObject_GetAttrString(r, "start"), *step_obj = NULL;
    long long start = 0, step = 0;
    int overflow = 0, ok = 0;
    if (start_obj != NULL && (step_obj = PyObject_GetAttrString(r, "step")) != NULL) {
        start = PyLong_AsLongLongAndOverflow(start_obj, &overflow);
        if (!overflow && !(start == -1 && PyErr_Occurred()))
            step = PyLong_AsLongLongAndOverflow(step_obj, &overflow);
        ok = !overflow && !PyErr_Occurred();
    }
    Py_XDECREF(start_obj);
    Py_XDECREF(step_obj);
    if (!ok)
        return NULL;
    /* the last value must fit too: start + (n - 1) * step, checked without overflowing */
    if (n > 1) {
        unsigned long long span = (unsigned long long)(n - 1);
        unsigned long long mag = step < 0 ? 0ULL - (unsigned long long)step : (unsigned long long)step;
        unsigned long long room = step < 0 ? (unsigned long long)start - (unsigned long long)LLONG_MIN
                                            : (unsigned long long)LLONG_MAX - (unsigned long long)start;
        if (mag != 0 && span > room / mag)
            return NULL;
    }
    PyObject *out = PyTuple_New(n);
    if (out == NULL)
        return NULL;
    long long v = start;
    for (Py_ssize_t i = 0; i < n; i++, v += (i < n ? step : 0)) {
        PyObject *item = PyLong_FromLongLong(v);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, item);
    }
    return out;
}

/* tuple(values) of exact ints, as manager._ints: tuples and lists of exact ints and ranges
 * pass straight through; anything else goes through operator.index (bool -> int, numpy
 * integers accepted, 1.5 refused); a refusal raises Rejected naming the first values. */
static PyObject *to_ints(PyObject *values)
{
    if (PyTuple_CheckExact(values) || PyList_CheckExact(values)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(values);
        PyObject **items = PySequence_Fast_ITEMS(values);
        Py_ssize_t i = 0;
        while (i < n && PyLong_CheckExact(items[i]))
            i++;
        if (i == n)
            return PySequence_Tuple(values); /* a tuple is returned as is */
    } else if (PyRange_Check(values)) {
        PyObject *out = range_tuple(values);
        if (out != NULL || PyErr_Occurred())
            return out;
        return PySequence_Tuple(values);
    }
    PyObject *seq = PySequence_List(values);
    if (seq == NULL)
        goto refuse;
    Py_ssize_t n = PyList_GET_SIZE(seq);
    PyObject *out = PyTuple_New(n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyNumber_Index(PyList_GET_ITEM(seq, i));
        if (v == NULL) {
            Py_DECREF(out);
            Py_DECREF(seq);
            goto refuse;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    Py_DECREF(seq);
    return out;

refuse:
    if (!PyErr_ExceptionMatches(PyExc_TypeError))
        return NULL;
    PyErr_Clear();
    {
        PyObject *all = PySequence_List(values);
        PyObject *head = all ? PyList_GetSlice(all, 0, 4) : NULL;
        if (head != NULL)
            PyErr_Format(rejected_cls, "expected integers, got %R", head);
        Py_XDECREF(head);
        Py_XDECREF(all);
    }
    return NULL;
}

static PyObject *native_ints(PyObject *self, PyObject *values)
{
    if (rejected_cls == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "kvflow._native.setup() was not called");
    return rejected_cls == NULL ? NULL : to_ints(values);
}

/* SMALL_INT(v): the exact int v surely fits in a signed 64-bit integer, read from its size
 * alone (a cheap test; 0 sends v to the full check). Up to 3.11 an int's Py_SIZE is its
 * signed number of PyLong_SHIFT-bit digits; from 3.12 on, a compact int has one digit. */
#if PY_VERSION_HEX >= 0x030C0000
#define SMALL_INT(v) PyUnstable_Long_IsCompact((PyLongObject *)(v))
#else
#if PY_VERSION_HEX < 0x030B0000
#include "longintrepr.h" /* PyLong_SHIFT (Python.h includes it from 3.11 on) */
#endif
#define SMALL_INT(v) (Py_ABS(Py_SIZE(v)) * PyLong_SHIFT <= 63)
#endif

/* manager._hashes: to_ints, then every value must fit in 64 bits, signed or unsigned. */
static PyObject *native_hashes(PyObject *self, PyObject *values)
{
    PyObject *out = native_ints(self, values);
    if (out == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        int overflow = 0;
        if (PyLong_CheckExact(PyTuple_GET_ITEM(out, i)) && SMALL_INT(PyTuple_GET_ITEM(out, i)))
            continue;
        PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(out, i), &overflow);
        if (overflow == 0)
            continue;
        if (overflow > 0) {
            PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(out, i));
            if (!PyErr_Occurred())
                continue;
            PyErr_Clear();
        }
        Py_DECREF(out);
        PyErr_SetString(rejected_cls,
                        "block hashes must fit in 64 bits; hash a longer digest down to 8 bytes first");
        return NULL;
    }
    return out;
}

/* --- replay's fold loop ---------------------------------------------------------------- */


static int type_in(PyObject *types, PyTypeObject *tp)
{
    Py_ssize_t n = PyTuple_GET_SIZE(types);
    for (Py_ssize_t i = 0; i < n; i++)
        if ((PyObject *)tp == PyTuple_GET_ITEM(types, i))
            return 1;
    return 0;
}

/* fold_chunk(state, records, start, limit) -> (status, index, applied, commands)
 *
 * Folds records[start:] (decoded trace records) with kv_apply until something needs Python:
 *   status 0: the chunk is done (index == len(records));
 *   status 1: records[index] is an event past ``limit`` (its seq > limit; limit None = no limit);
 *   status 2: records[index] is an event the C evolve declined (illegal, or left to Python):
 *             nothing was changed, the caller runs the Python evolve on it;
 *   status 3: records[index] is neither an event nor a command (a checkpoint).
 * ``applied`` and ``commands`` count the events applied and commands passed over in
 * records[start:index]. The same loop as replay._fold, without a Python frame per record. */
static PyObject *native_fold_chunk(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "fold_chunk(state, records: list, start, limit)");
        return NULL;
    }
    if (not_ready())
        return NULL;
    PyObject *state = args[0], *records = args[1];
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    long long limit = LLONG_MAX;
    if (args[3] != Py_None) {
        limit = PyLong_AsLongLong(args[3]);
        if (limit == -1 && PyErr_Occurred())
            return NULL;
    }
    Py_ssize_t i = start < 0 ? 0 : start, applied = 0, commands = 0;
    int status = 0;
    for (; i < PyList_GET_SIZE(records); i++) {
        PyObject *rec = PyList_GET_ITEM(records, i);
        PyTypeObject *tp = Py_TYPE(rec);
        if (type_in(event_types, tp)) {
            PyObject *seq_obj = PyObject_GetAttr(rec, str_seq);
            if (seq_obj == NULL)
                return NULL;
            long long seq = PyLong_AsLongLong(seq_obj);
            Py_DECREF(seq_obj);
            if (seq == -1 && PyErr_Occurred())
                return NULL;
            if (seq > limit) {
                status = 1;
                break;
            }
            Py_INCREF(rec); /* the list could change under a policy callback */
            int r = kv_apply(state, rec, 1);
            Py_DECREF(rec);
            if (r < 0)
                return NULL;
            if (r == 0) {
                status = 2;
                break;
            }
            applied++;
        } else if (type_in(command_types, tp)) {
            commands++;
        } else {
            status = 3;
            break;
        }
    }
    return Py_BuildValue("(innn)", status, i, applied, commands);
}

static PyMethodDef native_methods[] = {
    {"fold_chunk", (PyCFunction)(void (*)(void))native_fold_chunk, METH_FASTCALL,
     "fold_chunk(state, records, start, limit) -> (status, index, applied, commands)."},
    {"ints", (PyCFunction)native_ints, METH_O, "manager._ints in C."},
    {"hashes", (PyCFunction)native_hashes, METH_O, "manager._hashes in C."},
    {"setup", (PyCFunction)native_setup, METH_O, "setup(namespace): bind kvflow's classes."},
    {"evolve", (PyCFunction)(void (*)(void))native_evolve, METH_FASTCALL,
     "evolve(state, event, check) -> bool: True if applied; False: nothing changed, use the "
     "Python evolve (illegal event or not handled here)."},
    {"handle", (PyCFunction)(void (*)(void))native_handle, METH_FASTCALL,
     "handle(state, command, check) -> (answer, events) | NotImplemented; raises Rejected."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "kvflow._native",
    "Optional C accelerator of kvflow's pure core (see csrc/README.md).", -1, native_methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL)
        return NULL;
    /* bumped whenever the contract with the Python side changes */
    if (PyModule_AddIntConstant(m, "ABI", 1) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
