/* kvflow._native: an optional C accelerator for the pure core.
 *
 * The Python modules kvflow.state (evolve) and kvflow.decide (deciders) are the reference
 * implementation and the fallback. This extension mirrors them for the hot paths and works on
 * the very same Python objects (State, Job, Request, dicts, lists, policies): nothing here
 * owns state, so inspect, digests and invariants see one state whichever path applied it.
 *
 * Contract of every function here (see csrc/README.md):
 *   - kv_apply(state, event, check): 1 = applied; 0 = not applied and NOTHING changed (the
 *     event is illegal, or this path does not handle it): the caller runs the Python
 *     evolve, which raises the precise IllegalTransition or applies it; -1 = a Python
 *     exception is set (only for real errors such as MemoryError).
 *   - kv_handle(state, command, check): a new reference to (answer, [events]) when the
 *     decision ran here; Py_NotImplemented (new ref) when this command is left to the Python
 *     decider; NULL with an exception set when the command is refused (the same Rejected
 *     subclass and message as decide.py) or on a real error. A refused command changes
 *     nothing.
 *   - The pure-core rules hold here too: no clock, randomness, environment or I/O; no
 *     iteration over a set or dict where order matters except in insertion order.
 */
#ifndef KVFLOW_NATIVE_H
#define KVFLOW_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The namespace handed to _native.setup(): every public name of kvflow.events,
 * kvflow.errors, kvflow.state and kvflow.decide (classes, JobState members as
 * "JobState.QUEUED" etc., STORE/LOAD, evolve_python, decide_python). Borrowed. */
extern PyObject *kv_ns;

/* A new reference to kv_ns[name], or NULL with KeyError set. */
PyObject *kv_ref(const char *name);

/* evolve.c */
int kv_evolve_init(void);
int kv_apply(PyObject *state, PyObject *event, int check);

/* decide.c */
int kv_decide_init(void);
PyObject *kv_handle(PyObject *state, PyObject *command, int check);

#endif
