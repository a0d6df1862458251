/* kvflow._native module: setup(), evolve(), handle(). See native.h for the contract. */
#include "native.h"

PyObject *kv_ns = NULL;
static int kv_ready = 0;
static PyObject *rejected_cls = NULL; /* kvflow.errors.Rejected, bound by setup() */

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
    rejected_cls = kv_ref("Rejected");
    if (rejected_cls == NULL || kv_evolve_init() < 0 || kv_decide_init() < 0)
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

/* manager._hashes: to_ints, then every value must fit in 64 bits, signed or unsigned. */
static PyObject *native_hashes(PyObject *self, PyObject *values)
{
    PyObject *out = native_ints(self, values);
    if (out == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        int overflow = 0;
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

static PyMethodDef native_methods[] = {
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
