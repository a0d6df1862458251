/* C mirror of kvflow/state.py's evolve_python (see native.h for the contract).
 *
 * Every evolver below mirrors the Python function named in its comment, in two phases:
 *
 *   1. validate: read everything the apply needs and run exactly the checks the Python code
 *      runs (those under `if check:` only when check is set). Nothing is changed here, so a
 *      failed check, an unexpected type or an ordinary exception *declines* the event
 *      (return 0): the caller then runs evolve_python, which raises its precise error (or
 *      applies an event in a shape this file leaves to Python). Declining is always safe.
 *   2. apply: the same mutations as the Python code, in the same order, on the same objects
 *      (dict insertion order and list order are observable). An exception here is a real
 *      error (MemoryError, a failing policy call, or the KeyError Python itself would raise
 *      on an inconsistent state with check=False) and returns -1; the state is then changed
 *      exactly as far as the Python code would have changed it before raising.
 *
 * Hashes are never converted to C integers: they are only dict keys and compared with
 * Python's ==. Ranks, world sizes and ack masks are converted when small (see small_int);
 * outside that range the event is declined so that Python handles it.
 *
 * References: every new reference taken while applying one event goes into a Refs arena
 * released once at the end of kv_apply, so the early returns (declines) cannot leak; per-hash
 * temporaries in the loops are released on the spot.
 *
 * Reset is declined (rare: the Python evolve applies it).
 */
#include "native.h"

#ifndef Py_T_OBJECT_EX /* before 3.12 the member types live in structmember.h */
#include "structmember.h"
#define Py_T_OBJECT_EX T_OBJECT_EX
#define Py_AUDIT_READ PY_AUDIT_READ
#endif

/* --- names bound at setup --------------------------------------------------------------- */

/* interned attribute names: a_seq is "seq", etc. */
#define KV_ATTR_NAMES(X)                                                                      \
    X(seq) X(next_seq) X(last_job_id) X(slot_of) X(pending) X(pin_count) X(free_slots)        \
    X(quarantine) X(jobs) X(queued) X(held) X(requests) X(policy) X(config) X(world_size)     \
    X(job_id) X(job_ids) X(request_id) X(hashes) X(device_blocks) X(slots) X(direction)       \
    X(state) X(deadline_ms) X(acks) X(rank) X(abandoned) X(reuse) X(offered) X(loading)       \
    X(finished) X(preempted) X(insert) X(insert_many) X(touch) X(touch_many) X(refresh)       \
    X(refresh_many) X(remove) X(remove_many)

#define KV_DECLARE_ATTR(name) static PyObject *a_##name = NULL;
KV_ATTR_NAMES(KV_DECLARE_ATTR)
#undef KV_DECLARE_ATTR

static PyObject *js_QUEUED = NULL, *js_IN_FLIGHT = NULL, *js_ABANDONED = NULL; /* JobState */
static PyObject *s_STORE = NULL, *s_LOAD = NULL; /* kvflow.events.STORE / LOAD */
static PyObject *cls_Job = NULL, *cls_Request = NULL; /* kvflow.state.Job / Request */
static PyObject *py_zero = NULL, *py_one = NULL;

/* --- per-event reference arena ------------------------------------------------------------ */

#define KV_MAX_REFS 48 /* the most any evolver keeps is about 30 */

typedef struct {
    PyObject *items[KV_MAX_REFS];
    int n;
} Refs;

/* Keep the new reference obj until the end of kv_apply; returns obj (NULL stays NULL). */
static PyObject *keep(Refs *refs, PyObject *obj)
{
    if (obj == NULL)
        return NULL;
    if (refs->n == KV_MAX_REFS) {
        Py_DECREF(obj);
        PyErr_SetString(PyExc_SystemError, "kvflow._native evolve: KV_MAX_REFS exceeded");
        return NULL;
    }
    refs->items[refs->n++] = obj;
    return obj;
}

static void release(Refs *refs)
{
    while (refs->n > 0)
        Py_DECREF(refs->items[--refs->n]);
}

/* obj.name (a new reference). Slots (msgspec Struct fields, Job's and Request's __slots__)
 * are member descriptors: read them directly, as PyMember_GetOne does, rather than through
 * the generic attribute machinery; anything else (State's instance attributes, an unset
 * slot, a type with its own __getattribute__) goes through PyObject_GetAttr. */
static PyObject *getattr_fast(PyObject *obj, PyObject *name)
{
    PyTypeObject *tp = Py_TYPE(obj);
    if (tp->tp_getattro == PyObject_GenericGetAttr) {
        PyObject *descr = _PyType_Lookup(tp, name); /* borrowed, from the type cache */
        /* (member_get's own test: the descriptor belongs to a base of obj's type) */
        if (descr != NULL && Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
            PyObject_TypeCheck(obj, PyDescr_TYPE(descr))) {
            PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
            if (member->type == Py_T_OBJECT_EX && !(member->flags & Py_AUDIT_READ)) {
                PyObject *value = *(PyObject **)((char *)obj + member->offset);
                if (value != NULL)
                    return Py_NewRef(value);
            }
        }
    }
    return PyObject_GetAttr(obj, name);
}

/* obj.name, kept; NULL on error. */
static PyObject *get(Refs *refs, PyObject *obj, PyObject *name)
{
    return keep(refs, getattr_fast(obj, name));
}

/* obj.name when it is exactly a dict / list / tuple; NULL otherwise (with no error set when
 * it merely has another type: the event is then declined). */
static PyObject *get_dict(Refs *refs, PyObject *obj, PyObject *name)
{
    PyObject *v = get(refs, obj, name);
    return v != NULL && PyDict_CheckExact(v) ? v : NULL;
}

static PyObject *get_list(Refs *refs, PyObject *obj, PyObject *name)
{
    PyObject *v = get(refs, obj, name);
    return v != NULL && PyList_CheckExact(v) ? v : NULL;
}

static PyObject *get_tuple(Refs *refs, PyObject *obj, PyObject *name)
{
    PyObject *v = get(refs, obj, name);
    return v != NULL && PyTuple_CheckExact(v) ? v : NULL;
}

/* dict.get(key), kept: NULL when missing (no error set) or on error (error set). */
static PyObject *lookup(Refs *refs, PyObject *dict, PyObject *key)
{
    PyObject *v = PyDict_GetItemWithError(dict, key);
    if (v == NULL)
        return NULL;
    Py_INCREF(v);
    return keep(refs, v);
}

/* --- validation helpers ----------------------------------------------------------------- */

/* The event is declined (nothing was changed): an ordinary exception raised while
 * validating is dropped, since the Python evolve raises it (or its precise error) itself.
 * Only a non-Exception (KeyboardInterrupt...) or our own SystemError propagates. */
static int declined(void)
{
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_SystemError))
            return -1;
        PyErr_Clear();
    }
    return 0;
}

/* In an evolver's validation phase: go on only if cond holds / a test returning 1 (holds),
 * 0 (does not) or -1 (error) came out 1 / came out 0; otherwise decline. */
#define NEED(cond)                                                                           \
    do {                                                                                     \
        if (!(cond))                                                                         \
            goto decline;                                                                    \
    } while (0)
#define NEED_TRUE(test) NEED((test) == 1)
#define NEED_FALSE(test) NEED((test) == 0)

/* In a helper returning 1 / 0 / -1: return unless the test came out 1 / came out 0. */
#define REQUIRE_TRUE(test)                                                                   \
    do {                                                                                     \
        int t_ = (test);                                                                     \
        if (t_ != 1)                                                                         \
            return t_;                                                                       \
    } while (0)
#define REQUIRE_FALSE(test)                                                                  \
    do {                                                                                     \
        int t_ = (test);                                                                     \
        if (t_ != 0)                                                                         \
            return t_ < 0 ? -1 : 0;                                                          \
    } while (0)

/* In an evolver's apply phase: any error is a real one. */
#define APPLY(call)                                                                          \
    do {                                                                                     \
        if ((call) < 0)                                                                      \
            return -1;                                                                       \
    } while (0)

/* v as a C long long in [lo, hi): 1; 0 when v is not an int or is out of range (the
 * caller declines or treats it as illegal, as the comment at each use says); -1 on error. */
static int small_int(PyObject *v, long long lo, long long hi, long long *out)
{
    int overflow;
    long long x;
    if (!PyLong_Check(v))
        return 0;
    x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred())
        return -1;
    if (overflow || x < lo || x >= hi)
        return 0;
    *out = x;
    return 1;
}

/* len(set(items)) != len(items) for a tuple. */
static int has_duplicates(PyObject *items)
{
    PyObject *set;
    int dup;
    if (PyTuple_GET_SIZE(items) < 2)
        return 0;
    set = PySet_New(items);
    if (set == NULL)
        return -1;
    dup = PySet_GET_SIZE(set) != PyTuple_GET_SIZE(items);
    Py_DECREF(set);
    return dup;
}

/* _check_resident's test: every hash is on the tier (slot_of) and not pending. */
static int all_resident(PyObject *slot_of, PyObject *pending, PyObject *hashes)
{
    Py_ssize_t i, n = PyTuple_GET_SIZE(hashes);
    for (i = 0; i < n; i++) {
        PyObject *h = PyTuple_GET_ITEM(hashes, i);
        REQUIRE_FALSE(PyDict_Contains(pending, h));
        REQUIRE_TRUE(PyDict_Contains(slot_of, h));
    }
    return 1;
}

/* _check_pending's test: set(map(pending.get, hashes)) == {job_id}. Values that are neither
 * job_id itself nor exact ints count as a mismatch (declined: Python decides). */
static int pending_on(PyObject *pending, PyObject *hashes, PyObject *job_id)
{
    Py_ssize_t i, n = PyTuple_GET_SIZE(hashes);
    if (n == 0)
        return 0;
    for (i = 0; i < n; i++) {
        PyObject *v = PyDict_GetItemWithError(pending, PyTuple_GET_ITEM(hashes, i));
        if (v == NULL)
            return PyErr_Occurred() ? -1 : 0;
        if (v != job_id) {
            if (!PyLong_CheckExact(v) || !PyLong_CheckExact(job_id))
                return 0;
            REQUIRE_TRUE(PyObject_RichCompareBool(v, job_id, Py_EQ));
        }
    }
    return 1;
}

/* _check_free_slots's test: tuple(free[len(free) - n:][::-1]) == slots, n = len(slots). */
static int next_free_slots(PyObject *free_slots, PyObject *slots)
{
    Py_ssize_t i, n = PyTuple_GET_SIZE(slots), top = PyList_GET_SIZE(free_slots);
    if (n > top)
        return 0;
    for (i = 0; i < n; i++) {
        PyObject *f = PyList_GET_ITEM(free_slots, top - 1 - i);
        REQUIRE_TRUE(PyObject_RichCompareBool(f, PyTuple_GET_ITEM(slots, i), Py_EQ));
    }
    return 1;
}

/* _new_job_checks: the next job id, matching non-empty lengths, device blocks not held and
 * not repeated (_check_device_blocks_free). */
static int new_job_checks(Refs *refs, PyObject *state, PyObject *job_id, PyObject *hashes,
                          PyObject *device_blocks, PyObject *slots, PyObject *held)
{
    PyObject *last, *expected;
    Py_ssize_t i, n = PyTuple_GET_SIZE(hashes);
    if ((last = get(refs, state, a_last_job_id)) == NULL)
        return -1;
    if ((expected = keep(refs, PyNumber_Add(last, py_one))) == NULL)
        return -1;
    REQUIRE_FALSE(PyObject_RichCompareBool(job_id, expected, Py_NE));
    if (n == 0 || PyTuple_GET_SIZE(device_blocks) != n || PyTuple_GET_SIZE(slots) != n)
        return 0;
    for (i = 0; i < n; i++)
        REQUIRE_FALSE(PyDict_Contains(held, PyTuple_GET_ITEM(device_blocks, i)));
    REQUIRE_FALSE(has_duplicates(device_blocks));
    return 1;
}

/* --- apply helpers ------------------------------------------------------------------------ */

static void set_key_error(PyObject *key)
{
    PyObject *args = PyTuple_Pack(1, key);
    if (args != NULL) {
        PyErr_SetObject(PyExc_KeyError, args);
        Py_DECREF(args);
    }
}

/* list.append(dict.pop(key)), KeyError if missing. */
static int pop_onto(PyObject *dict, PyObject *key, PyObject *list)
{
    int rc;
    PyObject *v = PyDict_GetItemWithError(dict, key);
    if (v == NULL) {
        if (!PyErr_Occurred())
            set_key_error(key);
        return -1;
    }
    Py_INCREF(v);
    rc = PyDict_DelItem(dict, key) < 0 ? -1 : PyList_Append(list, v);
    Py_DECREF(v);
    return rc;
}

/* _unpin: for h in hashes: pins[h] - 1, deleting the entry at 0. */
static int unpin(PyObject *pins, PyObject *hashes)
{
    Py_ssize_t i, n = PyTuple_GET_SIZE(hashes);
    for (i = 0; i < n; i++) {
        PyObject *h = PyTuple_GET_ITEM(hashes, i), *count, *left;
        int nonzero, rc;
        count = PyDict_GetItemWithError(pins, h);
        if (count == NULL) {
            if (!PyErr_Occurred())
                set_key_error(h);
            return -1;
        }
        if ((left = PyNumber_Subtract(count, py_one)) == NULL)
            return -1;
        nonzero = PyObject_IsTrue(left);
        rc = nonzero < 0 ? -1 : nonzero ? PyDict_SetItem(pins, h, left) : PyDict_DelItem(pins, h);
        Py_DECREF(left);
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* getattr(obj, name, None) as 1 (found, *result a new reference) / 0 (AttributeError) / -1. */
static int lookup_attr(PyObject *obj, PyObject *name, PyObject **result)
{
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttr(obj, name, result);
#else
    return _PyObject_LookupAttr(obj, name, result);
#endif
}

/* _policy_many: policy.<op>_many(hashes) if the policy has it (and it is not None), else
 * policy.<op>(h) for each hash in order. */
static int policy_many(PyObject *policy, PyObject *bulk_name, PyObject *name, PyObject *hashes)
{
    PyObject *method, *res;
    Py_ssize_t i, n;
    int found = lookup_attr(policy, bulk_name, &method);
    if (found < 0)
        return -1;
    if (found && method != Py_None) {
        res = PyObject_CallOneArg(method, hashes);
        Py_DECREF(method);
        if (res == NULL)
            return -1;
        Py_DECREF(res);
        return 0;
    }
    if (found)
        Py_DECREF(method); /* getattr(...) returned None */
    if ((method = PyObject_GetAttr(policy, name)) == NULL)
        return -1;
    n = PyTuple_GET_SIZE(hashes);
    for (i = 0; i < n; i++) {
        res = PyObject_CallOneArg(method, PyTuple_GET_ITEM(hashes, i));
        if (res == NULL) {
            Py_DECREF(method);
            return -1;
        }
        Py_DECREF(res);
    }
    Py_DECREF(method);
    return 0;
}

/* _request(state, request_id) for a request_id that is not None: the existing request
 * (req, found while validating) or a new Request(request_id) added to state.requests.
 * Returns a kept reference. */
static PyObject *ensure_request(Refs *refs, PyObject *requests, PyObject *rid, PyObject *req)
{
    if (req != NULL)
        return req;
    req = keep(refs, PyObject_CallOneArg(cls_Request, rid));
    if (req == NULL || PyDict_SetItem(requests, rid, req) < 0)
        return NULL;
    return req;
}

/* _add_job: Job(...) built by the Python class, listed as live and queued, its device blocks
 * held, and its request (created if needed) told. req: the request found while validating,
 * or NULL. */
static int add_job(Refs *refs, PyObject *state, PyObject *jobs, PyObject *queued,
                   PyObject *held, PyObject *requests, PyObject *req, PyObject *job_id,
                   PyObject *direction, PyObject *rid, PyObject *hashes,
                   PyObject *device_blocks, PyObject *slots)
{
    PyObject *args[6] = {job_id, direction, rid, hashes, device_blocks, slots};
    PyObject *job, *req_jobs;
    Py_ssize_t i, n;
    job = keep(refs, PyObject_Vectorcall(cls_Job, args, 6, NULL));
    if (job == NULL)
        return -1;
    APPLY(PyDict_SetItem(jobs, job_id, job));
    APPLY(PyDict_SetItem(queued, job_id, Py_None));
    APPLY(PyObject_SetAttr(state, a_last_job_id, job_id));
    n = PyTuple_GET_SIZE(device_blocks);
    for (i = 0; i < n; i++)
        APPLY(PyDict_SetItem(held, PyTuple_GET_ITEM(device_blocks, i), job_id));
    if (rid == Py_None)
        return 0;
    if ((req = ensure_request(refs, requests, rid, req)) == NULL)
        return -1;
    if ((req_jobs = get(refs, req, a_jobs)) == NULL)
        return -1;
    return PyObject_SetItem(req_jobs, job_id, Py_None);
}

/* _release_quarantine: for s in reversed(dict.fromkeys(job.slots)), drop the job from the
 * slot's users; a slot nobody uses any more goes back to the free stack. */
static int release_quarantine(PyObject *quarantine, PyObject *free_slots, PyObject *job_id,
                              PyObject *slots)
{
    PyObject *unique, *order = NULL;
    Py_ssize_t i, n = PyTuple_GET_SIZE(slots);
    int rc = -1;
    if ((unique = PyDict_New()) == NULL)
        return -1;
    for (i = 0; i < n; i++)
        if (PyDict_SetItem(unique, PyTuple_GET_ITEM(slots, i), Py_None) < 0)
            goto done;
    if ((order = PyDict_Keys(unique)) == NULL)
        goto done;
    for (i = PyList_GET_SIZE(order) - 1; i >= 0; i--) {
        PyObject *s = PyList_GET_ITEM(order, i), *users, *it, *j, *left, *kept;
        int ok = 0;
        if ((users = PyDict_GetItemWithError(quarantine, s)) == NULL) {
            if (!PyErr_Occurred())
                set_key_error(s);
            goto done;
        }
        /* tuple(j for j in quarantine[s] if j != job_id) */
        if ((left = PyList_New(0)) == NULL)
            goto done;
        if ((it = PyObject_GetIter(users)) == NULL) {
            Py_DECREF(left);
            goto done;
        }
        while ((j = PyIter_Next(it)) != NULL) {
            int ne = PyObject_RichCompareBool(j, job_id, Py_NE);
            if (ne < 0 || (ne && PyList_Append(left, j) < 0)) {
                Py_DECREF(j);
                break;
            }
            Py_DECREF(j);
        }
        Py_DECREF(it);
        kept = PyErr_Occurred() ? NULL : PyList_AsTuple(left);
        Py_DECREF(left);
        if (kept == NULL)
            goto done;
        if (PyTuple_GET_SIZE(kept) > 0)
            ok = PyDict_SetItem(quarantine, s, kept) == 0;
        else
            ok = PyDict_DelItem(quarantine, s) == 0 && PyList_Append(free_slots, s) == 0;
        Py_DECREF(kept);
        if (!ok)
            goto done;
    }
    rc = 0;
done:
    Py_XDECREF(order);
    Py_DECREF(unique);
    return rc;
}

/* --- the evolvers ---------------------------------------------------------------------------
 * Each returns 1 (applied), 0 (declined, nothing changed) or -1 (error); kv_apply does the
 * seq check before and `state.next_seq += 1` after. */

enum { KIND_OTHER, KIND_COMPLETED, KIND_FAILED, KIND_TIMED_OUT };

typedef int (*evolver_fn)(Refs *refs, PyObject *state, PyObject *ev, int check, int kind);

/* _evolve_store_queued */
static int evolve_store_queued(Refs *r, PyObject *state, PyObject *ev, int check, int kind)
{
    PyObject *slot_of, *pending, *free_slots, *jobs, *queued, *held, *requests;
    PyObject *job_id, *rid, *hashes, *device_blocks, *slots, *req = NULL, *finished;
    Py_ssize_t i, n, top;
    (void)kind;
    NEED(slot_of = get_dict(r, state, a_slot_of));
    NEED(pending = get_dict(r, state, a_pending));
    NEED(free_slots = get_list(r, state, a_free_slots));
    NEED(jobs = get_dict(r, state, a_jobs));
    NEED(queued = get_dict(r, state, a_queued));
    NEED(held = get_dict(r, state, a_held));
    NEED(requests = get_dict(r, state, a_requests));
    NEED(job_id = get(r, ev, a_job_id));
    NEED(rid = get(r, ev, a_request_id));
    NEED(hashes = get_tuple(r, ev, a_hashes));
    NEED(device_blocks = get_tuple(r, ev, a_device_blocks));
    NEED(slots = get_tuple(r, ev, a_slots));
    n = PyTuple_GET_SIZE(hashes);
    top = PyList_GET_SIZE(free_slots);
    /* also without check: the apply below is Python's only for matching lengths (zip) and
     * enough free slots (the slice deletion) */
    NEED(PyTuple_GET_SIZE(device_blocks) == n && PyTuple_GET_SIZE(slots) == n && n <= top);
    if (rid != Py_None) {
        req = lookup(r, requests, rid);
        NEED(req != NULL || !PyErr_Occurred());
    }
    if (check) {
        NEED_TRUE(new_job_checks(r, state, job_id, hashes, device_blocks, slots, held));
        for (i = 0; i < n; i++) /* no block already on the tier, none repeated */
            NEED_FALSE(PyDict_Contains(slot_of, PyTuple_GET_ITEM(hashes, i)));
        NEED_FALSE(has_duplicates(hashes));
        NEED_TRUE(next_free_slots(free_slots, slots));
        if (req != NULL) { /* the request is not finished */
            NEED(finished = get(r, req, a_finished));
            NEED_FALSE(PyObject_IsTrue(finished));
        }
    }
    /* apply: take the slots off the free stack; the blocks become STORE_QUEUED */
    APPLY(PyList_SetSlice(free_slots, top - n, top, NULL));
    for (i = 0; i < n; i++)
        APPLY(PyDict_SetItem(slot_of, PyTuple_GET_ITEM(hashes, i), PyTuple_GET_ITEM(slots, i)));
    for (i = 0; i < n; i++)
        APPLY(PyDict_SetItem(pending, PyTuple_GET_ITEM(hashes, i), job_id));
    APPLY(add_job(r, state, jobs, queued, held, requests, req, job_id, s_STORE, rid, hashes,
                  device_blocks, slots));
    return 1;
decline:
    return declined();
}

/* _evolve_load_queued */
static int evolve_load_queued(Refs *r, PyObject *state, PyObject *ev, int check, int kind)
{
    PyObject *slot_of, *pending, *jobs, *queued, *held, *requests;
    PyObject *job_id, *rid, *hashes, *device_blocks, *slots, *req, *offered, *loading;
    PyObject *finished, *rest;
    Py_ssize_t i, n;
    (void)kind;
    NEED(jobs = get_dict(r, state, a_jobs));
    NEED(queued = get_dict(r, state, a_queued));
    NEED(held = get_dict(r, state, a_held));
    NEED(requests = get_dict(r, state, a_requests));
    NEED(job_id = get(r, ev, a_job_id));
    NEED(rid = get(r, ev, a_request_id));
    NEED(hashes = get_tuple(r, ev, a_hashes));
    NEED(device_blocks = get_tuple(r, ev, a_device_blocks));
    NEED(slots = get_tuple(r, ev, a_slots));
    n = PyTuple_GET_SIZE(hashes);
    /* without check too: Python asserts the request exists */
    NEED(req = lookup(r, requests, rid));
    NEED(offered = get_tuple(r, req, a_offered));
    NEED(loading = get(r, req, a_loading));
    if (check) {
        NEED_TRUE(new_job_checks(r, state, job_id, hashes, device_blocks, slots, held));
        NEED(finished = get(r, req, a_finished)); /* the request is live */
        NEED_FALSE(PyObject_IsTrue(finished));
        /* req.offered[:n] == hashes: the load takes the offered hits, in order */
        NEED(PyTuple_GET_SIZE(offered) >= n);
        for (i = 0; i < n; i++)
            NEED_TRUE(PyObject_RichCompareBool(PyTuple_GET_ITEM(offered, i),
                                               PyTuple_GET_ITEM(hashes, i), Py_EQ));
        NEED(slot_of = get_dict(r, state, a_slot_of));
        NEED(pending = get_dict(r, state, a_pending));
        NEED_TRUE(all_resident(slot_of, pending, hashes));
        for (i = 0; i < n; i++) { /* the slots are where the blocks live */
            PyObject *slot = PyDict_GetItemWithError(slot_of, PyTuple_GET_ITEM(hashes, i));
            NEED(slot != NULL);
            NEED_TRUE(PyObject_RichCompareBool(slot, PyTuple_GET_ITEM(slots, i), Py_EQ));
        }
    }
    /* apply: the request's pins move from "offered" to the job (counts are unchanged) */
    if ((rest = keep(r, PyTuple_GetSlice(offered, n, PyTuple_GET_SIZE(offered)))) == NULL)
        return -1;
    APPLY(PyObject_SetAttr(req, a_offered, rest));
    APPLY(PyObject_SetItem(loading, job_id, hashes));
    APPLY(add_job(r, state, jobs, queued, held, requests, req, job_id, s_LOAD, rid, hashes,
                  device_blocks, slots));
    return 1;
decline:
    return declined();
}

/* _evolve_jobs_submitted */
static int evolve_jobs_submitted(Refs *r, PyObject *state, PyObject *ev, int check, int kind)
{
    PyObject *jobs, *queued, *job_ids, *deadline;
    Py_ssize_t i, n;
    (void)kind;
    NEED(jobs = get_dict(r, state, a_jobs));
    NEED(queued = get_dict(r, state, a_queued));
    NEED(job_ids = get_tuple(r, ev, a_job_ids));
    NEED(deadline = get(r, ev, a_deadline_ms));
    n = PyTuple_GET_SIZE(job_ids);
    for (i = 0; i < n; i++) { /* (per-job references are borrowed or dropped at once) */
        PyObject *jid = PyTuple_GET_ITEM(job_ids, i), *job, *job_state;
        /* without check too: Python's jobs[jid] and del queued[jid] need them */
        NEED(job = PyDict_GetItemWithError(jobs, jid));
        NEED_TRUE(PyDict_Contains(queued, jid));
        if (check) { /* _check_job: QUEUED */
            NEED(job_state = getattr_fast(job, a_state));
            Py_DECREF(job_state); /* only its identity is used */
            NEED(job_state == js_QUEUED);
        }
    }
    if (check) /* each job once */
        NEED_FALSE(has_duplicates(job_ids));
    /* apply: queued -> in flight (its pending blocks are STORING from now on) */
    for (i = 0; i < n; i++) {
        PyObject *jid = PyTuple_GET_ITEM(job_ids, i);
        PyObject *job = PyDict_GetItemWithError(jobs, jid);
        int rc;
        if (job == NULL) {
            if (!PyErr_Occurred())
                set_key_error(jid);
            return -1;
        }
        Py_INCREF(job);
        rc = (PyObject_SetAttr(job, a_state, js_IN_FLIGHT) < 0 ||
              PyObject_SetAttr(job, a_deadline_ms, deadline) < 0 ||
              PyDict_DelItem(queued, jid) < 0) ? -1 : 0;
        Py_DECREF(job);
        APPLY(rc);
    }
    return 1;
decline:
    return declined();
}

/* the world size and a rank as C integers: 1; 0 when the world is too large for a C ack
 * mask (declined) or the rank is not an int in range (Python raises: declined). */
static int world_and_rank(Refs *r, PyObject *state, PyObject *ev, long long *world,
                          long long *rank)
{
    PyObject *config, *world_size, *rank_obj;
    if ((config = get(r, state, a_config)) == NULL ||
        (world_size = get(r, config, a_world_size)) == NULL ||
        (rank_obj = get(r, ev, a_rank)) == NULL)
        return -1;
    REQUIRE_TRUE(small_int(world_size, 1, 63, world));
    return small_int(rank_obj, 0, *world, rank);
}

/* _evolve_rank_succeeded (checks always) */
static int evolve_rank_succeeded(Refs *r, PyObject *state, PyObject *ev, int check, int kind)
{
    PyObject *jobs, *job_id, *job, *job_state, *acks_obj, *new_acks;
    long long world, rank, acks, bit;
    (void)check, (void)kind;
    NEED(jobs = get_dict(r, state, a_jobs));
    NEED(job_id = get(r, ev, a_job_id));
    NEED(job = lookup(r, jobs, job_id)); /* _check_job: IN_FLIGHT or ABANDONED */
    NEED(job_state = get(r, job, a_state));
    NEED(job_state == js_IN_FLIGHT || job_state == js_ABANDONED);
    NEED_TRUE(world_and_rank(r, state, ev, &world, &rank));
    NEED(acks_obj = get(r, job, a_acks));
    NEED_TRUE(small_int(acks_obj, 0, 1LL << 62, &acks));
    bit = 1LL << rank;
    NEED(!(acks & bit));                        /* the rank has not reported yet */
    NEED((acks | bit) != (1LL << world) - 1);   /* the last rank's success is JobCompleted */
    /* apply */
    if ((new_acks = keep(r, PyLong_FromLongLong(acks | bit))) == NULL)
        return -1;
    APPLY(PyObject_SetAttr(job, a_acks, new_acks));
    return 1;
decline:
    return declined();
}

/* _evolve_terminal (JobCompleted, JobFailed, JobTimedOut, told apart by kind) with
 * _check_terminal, _finish_job, _release_quarantine and _unpin */
static int evolve_terminal(Refs *r, PyObject *state, PyObject *ev, int check, int kind)
{
    PyObject *jobs, *queued, *held, *requests, *free_slots, *job_id, *job, *job_state, *jid;
    PyObject *direction, *hashes, *device_blocks, *jrid, *other;
    PyObject *pending = NULL, *slot_of = NULL, *pins = NULL, *quarantine = NULL, *slots = NULL;
    PyObject *policy = NULL, *req = NULL, *req_jobs = NULL, *loading = NULL;
    Py_ssize_t i, n;
    int abandoned, store;
    NEED(jobs = get_dict(r, state, a_jobs));
    NEED(queued = get_dict(r, state, a_queued));
    NEED(held = get_dict(r, state, a_held));
    NEED(requests = get_dict(r, state, a_requests));
    NEED(free_slots = get_list(r, state, a_free_slots));
    NEED(pending = get_dict(r, state, a_pending));
    NEED(job_id = get(r, ev, a_job_id));
    NEED(job = lookup(r, jobs, job_id)); /* without check: Python's jobs[job_id] */
    NEED(job_state = get(r, job, a_state));
    NEED(jid = get(r, job, a_job_id));
    NEED(direction = get(r, job, a_direction));
    NEED(hashes = get_tuple(r, job, a_hashes));
    NEED(device_blocks = get_tuple(r, job, a_device_blocks));
    NEED(jrid = get(r, job, a_request_id));
    abandoned = job_state == js_ABANDONED;
    NEED((store = PyObject_RichCompareBool(direction, s_STORE, Py_EQ)) >= 0);
    if (check) {
        /* _check_job: the job's state allows the event */
        NEED(job_state == js_IN_FLIGHT || abandoned ||
             (kind == KIND_FAILED && job_state == js_QUEUED));
        /* the event describes the job */
        NEED(other = get(r, ev, a_hashes));
        NEED_FALSE(PyObject_RichCompareBool(hashes, other, Py_NE));
        NEED(other = get(r, ev, a_direction));
        NEED_FALSE(PyObject_RichCompareBool(direction, other, Py_NE));
        NEED(other = get(r, ev, a_device_blocks));
        NEED_FALSE(PyObject_RichCompareBool(device_blocks, other, Py_NE));
        if (!abandoned) {
            if (store) { /* _check_pending */
                NEED_TRUE(pending_on(pending, hashes, jid));
            } else {
                NEED(slot_of = get_dict(r, state, a_slot_of));
                NEED_TRUE(all_resident(slot_of, pending, hashes));
            }
        }
        NEED(other = get(r, ev, a_abandoned));
        NEED_FALSE(PyObject_RichCompareBool(other, abandoned ? Py_True : Py_False, Py_NE));
        if (kind == KIND_COMPLETED) {
            /* every rank succeeded: acks | (1 << rank) == (1 << world_size) - 1 */
            long long world, rank, acks;
            NEED_TRUE(world_and_rank(r, state, ev, &world, &rank));
            NEED(other = get(r, job, a_acks));
            NEED_TRUE(small_int(other, 0, 1LL << 62, &acks));
            NEED((acks | (1LL << rank)) == (1LL << world) - 1);
        }
    }
    /* everything the apply touches, found before changing anything */
    if (jrid != Py_None && !abandoned) {
        NEED(req = lookup(r, requests, jrid));
        NEED(req_jobs = get(r, req, a_jobs));
    }
    if (abandoned) {
        NEED(quarantine = get_dict(r, state, a_quarantine));
        NEED(slots = get_tuple(r, job, a_slots));
    } else if (store) {
        if (kind == KIND_COMPLETED)
            NEED(policy = get(r, state, a_policy));
        else
            NEED(slot_of = get_dict(r, state, a_slot_of));
    } else {
        NEED(req != NULL);
        NEED(loading = get(r, req, a_loading));
        NEED(pins = get_dict(r, state, a_pin_count));
    }
    /* apply: _finish_job */
    APPLY(PyDict_DelItem(jobs, jid));
    {
        int was_queued = PyDict_Contains(queued, jid);
        APPLY(was_queued);
        if (was_queued)
            APPLY(PyDict_DelItem(queued, jid));
    }
    n = PyTuple_GET_SIZE(device_blocks);
    for (i = 0; i < n; i++)
        APPLY(PyDict_DelItem(held, PyTuple_GET_ITEM(device_blocks, i)));
    if (req_jobs != NULL)
        APPLY(PyObject_DelItem(req_jobs, jid));
    if (abandoned) { /* frees its quarantined slots; nothing becomes visible */
        APPLY(release_quarantine(quarantine, free_slots, jid, slots));
        return 1;
    }
    n = PyTuple_GET_SIZE(hashes);
    if (store) {
        for (i = 0; i < n; i++)
            APPLY(PyDict_DelItem(pending, PyTuple_GET_ITEM(hashes, i)));
        if (kind == KIND_COMPLETED) { /* RESIDENT: visible from now on */
            APPLY(policy_many(policy, a_insert_many, a_insert, hashes));
        } else { /* free_slots.extend(map(slot_of.pop, reversed(hashes))) */
            for (i = n - 1; i >= 0; i--)
                APPLY(pop_onto(slot_of, PyTuple_GET_ITEM(hashes, i), free_slots));
        }
    } else { /* a load: its pins are released, the entries stay */
        APPLY(PyObject_DelItem(loading, jid));
        APPLY(unpin(pins, hashes));
    }
    return 1;
decline:
    return declined();
}

/* _evolve_late (checks always; changes nothing) */
static int evolve_late(Refs *r, PyObject *state, PyObject *ev, int check, int kind)
{
    PyObject *jobs, *job_id, *job, *rank_obj, *acks_obj, *last;
    long long rank, acks;
    (void)check, (void)kind;
    NEED(jobs = get_dict(r, state, a_jobs));
    NEED(job_id = get(r, ev, a_job_id));
    job = lookup(r, jobs, job_id);
    if (job != NULL) {
        /* a live job: only as a repeat of a rank that already reported success */
        NEED(rank_obj = get(r, ev, a_rank));
        NEED_TRUE(small_int(rank_obj, 0, 64, &rank));
        NEED(acks_obj = get(r, job, a_acks));
        NEED_TRUE(small_int(acks_obj, 0, 1LL << 62, &acks));
        NEED(((unsigned long long)acks >> rank) & 1);
    } else {
        /* a terminal job: 0 < job_id <= last_job_id */
        NEED(!PyErr_Occurred());
        NEED(last = get(r, state, a_last_job_id));
        NEED_TRUE(PyObject_RichCompareBool(py_zero, job_id, Py_LT));
        NEED_TRUE(PyObject_RichCompareBool(job_id, last, Py_LE));
    }
    return 1;
decline:
    return declined();
}

/* _evolve_evicted */
static int evolve_evicted(Refs *r, PyObject *state, PyObject *ev, int check, int kind)
{
    PyObject *slot_of, *free_slots, *policy, *hashes, *pending, *pins, *slots;
    Py_ssize_t i, n;
    (void)kind;
    NEED(slot_of = get_dict(r, state, a_slot_of));
    NEED(free_slots = get_list(r, state, a_free_slots));
    NEED(policy = get(r, state, a_policy));
    NEED(hashes = get_tuple(r, ev, a_hashes));
    n = PyTuple_GET_SIZE(hashes);
    if (check) {
        NEED(pending = get_dict(r, state, a_pending));
        NEED(pins = get_dict(r, state, a_pin_count));
        NEED(slots = get_tuple(r, ev, a_slots));
        NEED(PyTuple_GET_SIZE(slots) == n);
        for (i = 0; i < n; i++) {
            /* RESIDENT, unpinned, and the slot is where the block lives */
            PyObject *h = PyTuple_GET_ITEM(hashes, i), *slot;
            NEED_FALSE(PyDict_Contains(pending, h));
            NEED_FALSE(PyDict_Contains(pins, h));
            NEED(slot = PyDict_GetItemWithError(slot_of, h));
            NEED_TRUE(PyObject_RichCompareBool(slot, PyTuple_GET_ITEM(slots, i), Py_EQ));
        }
        NEED_FALSE(has_duplicates(hashes)); /* each block once */
    }
    /* apply: free_slots.extend(map(slot_of.pop, reversed(hashes))), then the policy */
    for (i = n - 1; i >= 0; i--)
        APPLY(pop_onto(slot_of, PyTuple_GET_ITEM(hashes, i), free_slots));
    APPLY(policy_many(policy, a_remove_many, a_remove, hashes));
    return 1;
decline:
    return declined();
}

/* _evolve_touched */
static int evolve_touched(Refs *r, PyObject *state, PyObject *ev, int check, int kind)
{
    PyObject *policy, *hashes, *reuse, *slot_of, *pending;
    int again;
    (void)kind;
    NEED(policy = get(r, state, a_policy));
    NEED(hashes = get_tuple(r, ev, a_hashes));
    if (check) {
        NEED(slot_of = get_dict(r, state, a_slot_of));
        NEED(pending = get_dict(r, state, a_pending));
        NEED_TRUE(all_resident(slot_of, pending, hashes));
    }
    NEED(reuse = get(r, ev, a_reuse));
    NEED((again = PyObject_IsTrue(reuse)) >= 0);
    /* apply: "touch" if event.reuse else "refresh" */
    APPLY(again ? policy_many(policy, a_touch_many, a_touch, hashes)
                : policy_many(policy, a_refresh_many, a_refresh, hashes));
    return 1;
decline:
    return declined();
}

/* _evolve_rejected (checks always) */
static int evolve_rejected(Refs *r, PyObject *state, PyObject *ev, int check, int kind)
{
    PyObject *hashes, *rid, *requests, *req;
    (void)check, (void)kind;
    NEED(hashes = get(r, ev, a_hashes));
    NEED_TRUE(PyObject_IsTrue(hashes)); /* at least one block */
    NEED(rid = get(r, ev, a_request_id));
    if (rid == Py_None)
        return 1;
    NEED(requests = get_dict(r, state, a_requests));
    req = lookup(r, requests, rid);
    NEED(req != NULL || !PyErr_Occurred());
    /* apply: _request(state, request_id) */
    if (ensure_request(r, requests, rid, req) == NULL)
        return -1;
    return 1;
decline:
    return declined();
}

/* _evolve_pins_acquired */
static int evolve_pins_acquired(Refs *r, PyObject *state, PyObject *ev, int check, int kind)
{
    PyObject *requests, *pins, *rid, *hashes, *req, *flag, *slot_of, *pending;
    Py_ssize_t i, n;
    (void)kind;
    NEED(requests = get_dict(r, state, a_requests));
    NEED(pins = get_dict(r, state, a_pin_count));
    NEED(rid = get(r, ev, a_request_id));
    NEED(hashes = get_tuple(r, ev, a_hashes));
    NEED(rid != Py_None); /* Python asserts a request */
    req = lookup(r, requests, rid);
    NEED(req != NULL || !PyErr_Occurred());
    n = PyTuple_GET_SIZE(hashes);
    if (check) {
        if (req != NULL) { /* no offered pins yet, not finished */
            NEED(flag = get(r, req, a_finished));
            NEED_FALSE(PyObject_IsTrue(flag));
            NEED(flag = get(r, req, a_offered));
            NEED_FALSE(PyObject_IsTrue(flag));
        }
        if (n > 0) {
            NEED(slot_of = get_dict(r, state, a_slot_of));
            NEED(pending = get_dict(r, state, a_pending));
            NEED_TRUE(all_resident(slot_of, pending, hashes));
        }
    }
    /* apply: pins[h] = pins.get(h, 0) + 1; req.offered = event.hashes */
    if ((req = ensure_request(r, requests, rid, req)) == NULL)
        return -1;
    for (i = 0; i < n; i++) {
        PyObject *h = PyTuple_GET_ITEM(hashes, i), *count, *more;
        int rc;
        count = PyDict_GetItemWithError(pins, h);
        if (count == NULL && PyErr_Occurred())
            return -1;
        more = count == NULL ? PyNumber_Add(py_zero, py_one) : PyNumber_Add(count, py_one);
        if (more == NULL)
            return -1;
        rc = PyDict_SetItem(pins, h, more);
        Py_DECREF(more);
        APPLY(rc);
    }
    APPLY(PyObject_SetAttr(req, a_offered, hashes));
    return 1;
decline:
    return declined();
}

/* _evolve_pins_released (checks always) */
static int evolve_pins_released(Refs *r, PyObject *state, PyObject *ev, int check, int kind)
{
    PyObject *requests, *pins, *rid, *hashes, *req, *offered, *rest;
    Py_ssize_t i, n, size;
    (void)check, (void)kind;
    NEED(requests = get_dict(r, state, a_requests));
    NEED(pins = get_dict(r, state, a_pin_count));
    NEED(rid = get(r, ev, a_request_id));
    NEED(hashes = get_tuple(r, ev, a_hashes));
    NEED(req = lookup(r, requests, rid));
    NEED(offered = get_tuple(r, req, a_offered));
    /* offered[len(offered) - n:] == hashes and n > 0: the last offered pins */
    n = PyTuple_GET_SIZE(hashes);
    size = PyTuple_GET_SIZE(offered);
    NEED(n > 0 && n <= size);
    for (i = 0; i < n; i++)
        NEED_TRUE(PyObject_RichCompareBool(PyTuple_GET_ITEM(offered, size - n + i),
                                           PyTuple_GET_ITEM(hashes, i), Py_EQ));
    /* apply */
    if ((rest = keep(r, PyTuple_GetSlice(offered, 0, size - n))) == NULL)
        return -1;
    APPLY(PyObject_SetAttr(req, a_offered, rest));
    APPLY(unpin(pins, hashes));
    return 1;
decline:
    return declined();
}

/* _evolve_finished (checks always) */
static int evolve_finished(Refs *r, PyObject *state, PyObject *ev, int check, int kind)
{
    PyObject *requests, *rid, *req, *flag, *preempted;
    (void)check, (void)kind;
    NEED(requests = get_dict(r, state, a_requests));
    NEED(rid = get(r, ev, a_request_id));
    NEED(req = lookup(r, requests, rid));
    NEED(flag = get(r, req, a_finished)); /* not finished yet */
    NEED_FALSE(PyObject_IsTrue(flag));
    NEED(flag = get(r, req, a_offered)); /* offered pins released first */
    NEED_FALSE(PyObject_IsTrue(flag));
    NEED(preempted = get(r, ev, a_preempted));
    /* apply */
    APPLY(PyObject_SetAttr(req, a_finished, Py_True));
    APPLY(PyObject_SetAttr(req, a_preempted, preempted));
    return 1;
decline:
    return declined();
}

/* _evolve_closed (checks always) */
static int evolve_closed(Refs *r, PyObject *state, PyObject *ev, int check, int kind)
{
    PyObject *requests, *rid, *req, *flag;
    (void)check, (void)kind;
    NEED(requests = get_dict(r, state, a_requests));
    NEED(rid = get(r, ev, a_request_id));
    NEED(req = lookup(r, requests, rid));
    /* finished, no live jobs, no pins (req.holds_pins(): offered or loading) */
    NEED(flag = get(r, req, a_finished));
    NEED_TRUE(PyObject_IsTrue(flag));
    NEED(flag = get(r, req, a_jobs));
    NEED_FALSE(PyObject_IsTrue(flag));
    NEED(flag = get(r, req, a_offered));
    NEED_FALSE(PyObject_IsTrue(flag));
    NEED(flag = get(r, req, a_loading));
    NEED_FALSE(PyObject_IsTrue(flag));
    /* apply */
    APPLY(PyDict_DelItem(requests, rid));
    return 1;
decline:
    return declined();
}

/* --- dispatch (_EVOLVERS) ---------------------------------------------------------------- */

typedef struct {
    const char *name; /* the event class in the setup namespace */
    evolver_fn fn;
    int kind;
    PyObject *cls; /* bound at setup */
} Evolver;

/* most frequent first; Reset is not here (declined) */
static Evolver evolvers[] = {
    {"BlocksTouched", evolve_touched, KIND_OTHER, NULL},
    {"StoreQueued", evolve_store_queued, KIND_OTHER, NULL},
    {"JobsSubmitted", evolve_jobs_submitted, KIND_OTHER, NULL},
    {"JobCompleted", evolve_terminal, KIND_COMPLETED, NULL},
    {"PinsAcquired", evolve_pins_acquired, KIND_OTHER, NULL},
    {"RequestFinished", evolve_finished, KIND_OTHER, NULL},
    {"RequestClosed", evolve_closed, KIND_OTHER, NULL},
    {"PinsReleased", evolve_pins_released, KIND_OTHER, NULL},
    {"LoadQueued", evolve_load_queued, KIND_OTHER, NULL},
    {"BlocksEvicted", evolve_evicted, KIND_OTHER, NULL},
    {"JobFailed", evolve_terminal, KIND_FAILED, NULL},
    {"JobTimedOut", evolve_terminal, KIND_TIMED_OUT, NULL},
    {"RankSucceeded", evolve_rank_succeeded, KIND_OTHER, NULL},
    {"LateResultIgnored", evolve_late, KIND_OTHER, NULL},
    {"StoreRejected", evolve_rejected, KIND_OTHER, NULL},
};
#define KV_NUM_EVOLVERS ((int)(sizeof(evolvers) / sizeof(evolvers[0])))

/* Bind a static to kv_ns[name] (replacing an earlier binding). */
static int bind_ref(PyObject **slot, const char *name)
{
    PyObject *value = kv_ref(name);
    if (value == NULL)
        return -1;
    Py_XSETREF(*slot, value);
    return 0;
}

int kv_evolve_init(void)
{
    int i;
#define KV_INTERN_ATTR(name)                                                                 \
    Py_XSETREF(a_##name, PyUnicode_InternFromString(#name));                                 \
    if (a_##name == NULL)                                                                    \
        return -1;
    KV_ATTR_NAMES(KV_INTERN_ATTR)
#undef KV_INTERN_ATTR
    for (i = 0; i < KV_NUM_EVOLVERS; i++) {
        if (bind_ref(&evolvers[i].cls, evolvers[i].name) < 0)
            return -1;
        if (!PyType_Check(evolvers[i].cls)) {
            PyErr_Format(PyExc_TypeError, "kvflow._native: %s is not a class", evolvers[i].name);
            return -1;
        }
    }
    if (bind_ref(&js_QUEUED, "JobState.QUEUED") < 0 ||
        bind_ref(&js_IN_FLIGHT, "JobState.IN_FLIGHT") < 0 ||
        bind_ref(&js_ABANDONED, "JobState.ABANDONED") < 0 || bind_ref(&s_STORE, "STORE") < 0 ||
        bind_ref(&s_LOAD, "LOAD") < 0 || bind_ref(&cls_Job, "Job") < 0 ||
        bind_ref(&cls_Request, "Request") < 0)
        return -1;
    Py_XSETREF(py_zero, PyLong_FromLong(0));
    Py_XSETREF(py_one, PyLong_FromLong(1));
    if (py_zero == NULL || py_one == NULL)
        return -1;
    return 0;
}

/* evolve_python: the seq check, the evolver of the event's exact type, next_seq += 1. */
int kv_apply(PyObject *state, PyObject *event, int check)
{
    const Evolver *evolver = NULL;
    PyObject *seq, *next_seq, *bumped;
    Refs refs;
    int i, result;
    for (i = 0; i < KV_NUM_EVOLVERS; i++) {
        if ((PyObject *)Py_TYPE(event) == evolvers[i].cls) {
            evolver = &evolvers[i];
            break;
        }
    }
    if (evolver == NULL)
        return 0; /* Reset, or not an event: the Python evolve */
    refs.n = 0;
    if ((seq = get(&refs, event, a_seq)) == NULL ||
        (next_seq = get(&refs, state, a_next_seq)) == NULL) {
        result = declined();
        goto done;
    }
    /* events must be gapless */
    result = PyObject_RichCompareBool(seq, next_seq, Py_NE);
    if (result != 0) {
        result = result < 0 ? declined() : 0;
        goto done;
    }
    result = evolver->fn(&refs, state, event, check, evolver->kind);
    if (result == 1) {
        bumped = PyNumber_InPlaceAdd(next_seq, py_one);
        if (bumped == NULL || PyObject_SetAttr(state, a_next_seq, bumped) < 0)
            result = -1;
        Py_XDECREF(bumped);
    }
done:
    release(&refs);
    return result;
}
