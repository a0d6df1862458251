/* C mirror of kvflow/decide.py's hot deciders (see native.h). Placeholder: handles nothing. */
#include "native.h"

int kv_decide_init(void) { return 0; }

PyObject *kv_handle(PyObject *state, PyObject *command, int check)
{
    (void)state; (void)command; (void)check;
    Py_RETURN_NOTIMPLEMENTED;
}
