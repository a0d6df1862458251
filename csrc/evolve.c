/* C mirror of kvflow/state.py's evolve (see native.h). Placeholder: handles nothing yet. */
#include "native.h"

int kv_evolve_init(void) { return 0; }

int kv_apply(PyObject *state, PyObject *event, int check)
{
    (void)state; (void)event; (void)check;
    return 0;
}
