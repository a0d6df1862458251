/* kvflow._native module: setup(), evolve(), handle(). See native.h for the contract. */
#include "native.h"

PyObject *kv_ns = NULL;
static int kv_ready = 0;

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

static PyMethodDef native_methods[] = {
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
