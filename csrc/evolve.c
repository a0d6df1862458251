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

/* obj.name = value. The mirror of getattr_fast: a slot (a member descriptor of obj's type,
 * found first in the MRO as PyObject_GenericSetAttr finds it) is stored directly, as
 * PyMember_SetOne does; anything else goes through PyObject_SetAttr. */
static int setattr_fast(PyObject *obj, PyObject *name, PyObject *value)
{
    PyTypeObject *tp = Py_TYPE(obj);
    if (tp->tp_setattro == PyObject_GenericSetAttr) {
        PyObject *descr = _PyType_Lookup(tp, name); /* borrowed, from the type cache */
        if (descr != NULL && Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
            PyObject_TypeCheck(obj, PyDescr_TYPE(descr))) {
            PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
            if (member->type == Py_T_OBJECT_EX && member->flags == 0) {
                PyObject **addr = (PyObject **)((char *)obj + member->offset);
                PyObject *old = *addr;
                *addr = Py_NewRef(value);
                Py_XDECREF(old);
                return 0;
            }
        }
    }
    return PyObject_SetAttr(obj, name, value);
}

/* mapping[key] = value / del mapping[key]: the dict functions for an exact dict (what its
 * mp_ass_subscript calls), the generic protocol otherwise. */
static int set_item(PyObject *mapping, PyObject *key, PyObject *value)
{
    return PyDict_CheckExact(mapping) ? PyDict_SetItem(mapping, key, value)
                                      : PyObject_SetItem(mapping, key, value);
}

static int del_item(PyObject *mapping, PyObject *key)
{
    return PyDict_CheckExact(mapping) ? PyDict_DelItem(mapping, key)
                                      : PyObject_DelItem(mapping, key);
}

/* v + delta (delta is 1 or -1) as a new reference: for an exact int in C (the same value and
 * type as int.__add__ gives), anything else through the number protocol. */
static PyObject *int_step(PyObject *v, int delta)
{
    if (PyLong_CheckExact(v)) {
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (!overflow && x > LLONG_MIN + 1 && x < LLONG_MAX - 1)
            return PyLong_FromLongLong(x + delta);
        if (x == -1 && PyErr_Occurred())
            return NULL;
    }
    return delta > 0 ? PyNumber_Add(v, py_one) : PyNumber_Subtract(v, py_one);
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
    if ((expected = keep(refs, int_step(last, 1))) == NULL)
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
        if (count == py_one) { /* the usual case: the last pin goes (1 - 1 is falsy) */
            APPLY(PyDict_DelItem(pins, h));
            continue;
        }
        if ((left = int_step(count, -1)) == NULL)
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

/* --- kvflow.policies.lru.LRUPolicy, on its OrderedDict directly ---------------------------
 * For a policy whose type is exactly LRUPolicy and whose bulk method is still the one read at
 * setup, policy_many runs that method's body here, on policy._order (an exact OrderedDict),
 * with the same resulting order and the same errors; any other policy (ARC, a subclass, a
 * patched class) gets the generic call. */

enum { LRU_INSERT, LRU_TOUCH, LRU_REFRESH, LRU_REMOVE, LRU_NUM_OPS };

static PyObject *lru_cls = NULL;                 /* LRUPolicy, or NULL: no fast path */
static PyObject *lru_methods[LRU_NUM_OPS];       /* LRUPolicy.<op>_many as read at setup */
static PyObject *odict_move_to_end = NULL;       /* OrderedDict.move_to_end (a descriptor) */
static PyObject *a__order = NULL;

/* policy._order (borrowed) when the fast path applies to policy.<bulk_name>, else NULL (no
 * error set; the generic path then runs). */
static PyObject *lru_order(PyObject *policy, PyObject *bulk_name, int op)
{
    PyTypeObject *tp = Py_TYPE(policy);
    PyObject *descr, *order;
    PyMemberDef *member;
    if ((PyObject *)tp != lru_cls || tp->tp_getattro != PyObject_GenericGetAttr ||
        _PyType_Lookup(tp, bulk_name) != lru_methods[op])
        return NULL;
    descr = _PyType_Lookup(tp, a__order);
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type) ||
        PyDescr_TYPE(descr) != tp)
        return NULL;
    member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != Py_T_OBJECT_EX || (member->flags & Py_AUDIT_READ))
        return NULL;
    order = *(PyObject **)((char *)policy + member->offset);
    if (order == NULL || !PyODict_CheckExact(order))
        return NULL;
    {   /* order.move_to_end etc. are the OrderedDict's own: nothing in its instance dict */
        PyObject **dictptr = _PyObject_GetDictPtr(order);
        if (dictptr != NULL && *dictptr != NULL && PyDict_GET_SIZE(*dictptr) != 0)
            return NULL;
    }
    return order;
}

/* LRUPolicy.insert_many for exact-int hashes (1 done, 0 not taken: another shape, -1 error).
 * All-or-nothing like the Python method: the first hash (in order) that is already resident
 * or repeated raises its ValueError with the order as it was. The keys are inserted one by
 * one as order.update(dict.fromkeys(hashes)) does; a repeat is seen when the size does not
 * grow (every hash was checked absent before), and the keys inserted so far are removed
 * again, so the order holds exactly the keys it held, in their order. */
static int lru_insert_many(PyObject *order, PyObject *hashes)
{
    Py_ssize_t i, k, n = PyTuple_GET_SIZE(hashes), size;
    PyObject *bad = NULL, *msg;
    for (i = 0; i < n; i++)
        if (!PyLong_CheckExact(PyTuple_GET_ITEM(hashes, i)))
            return 0;
    for (i = 0; i < n; i++) {
        int found = PyDict_Contains(order, PyTuple_GET_ITEM(hashes, i));
        if (found < 0)
            return -1;
        if (found)
            break;
    }
    /* a repeat before the first resident hash is reported first, as Python's loop does */
    size = PyDict_GET_SIZE(order);
    for (k = 0; k < i; k++) {
        if (PyODict_SetItem(order, PyTuple_GET_ITEM(hashes, k), Py_None) < 0)
            goto undo;
        if (PyDict_GET_SIZE(order) != size + k + 1) { /* a repeat of an earlier hash */
            bad = PyTuple_GET_ITEM(hashes, k);
            goto undo;
        }
    }
    if (i == n)
        return 1;
    bad = PyTuple_GET_ITEM(hashes, i); /* already resident */
undo:
    {
        /* remove what was inserted (k keys, all new), newest first; keep the error */
        PyObject *exc_type, *exc_value, *exc_tb;
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
        while (k > 0) {
            if (PyODict_DelItem(order, PyTuple_GET_ITEM(hashes, --k)) < 0) {
                Py_XDECREF(exc_type), Py_XDECREF(exc_value), Py_XDECREF(exc_tb);
                return -1;
            }
        }
        PyErr_Restore(exc_type, exc_value, exc_tb);
    }
    if (bad == NULL)
        return -1; /* the error of a failed insert */
    msg = PyUnicode_FromFormat("block hash %S is already resident in the lru policy", bad);
    if (msg != NULL) {
        PyErr_SetObject(PyExc_ValueError, msg);
        Py_DECREF(msg);
    }
    return -1;
}

/* LRUPolicy.<op>_many(hashes) on order; 0 or -1. */
static int lru_many(PyObject *order, int op, PyObject *hashes)
{
    Py_ssize_t i, n = PyTuple_GET_SIZE(hashes);
    if (op == LRU_REMOVE) { /* deque(map(order.__delitem__, hashes), 0) */
        for (i = 0; i < n; i++)
            APPLY(PyODict_DelItem(order, PyTuple_GET_ITEM(hashes, i)));
        return 0;
    }
    /* touch / refresh: deque(map(order.move_to_end, hashes), 0) */
    for (i = 0; i < n; i++) {
        PyObject *args[2] = {order, PyTuple_GET_ITEM(hashes, i)};
        PyObject *res = PyObject_Vectorcall(odict_move_to_end, args, 2, NULL);
        if (res == NULL)
            return -1;
        Py_DECREF(res);
    }
    return 0;
}

/* _policy_many: policy.<op>_many(hashes) if the policy has it (and it is not None), else
 * policy.<op>(h) for each hash in order. op is one of LRU_* (for the LRU fast path). */
static int policy_many(PyObject *policy, PyObject *bulk_name, PyObject *name, int op,
                       PyObject *hashes)
{
    PyObject *method, *res, *order;
    Py_ssize_t i, n;
    int found;
    if (lru_cls != NULL && (order = lru_order(policy, bulk_name, op)) != NULL) {
        if (op != LRU_INSERT)
            return lru_many(order, op, hashes);
        found = lru_insert_many(order, hashes);
        if (found != 0)
            return found < 0 ? -1 : 0;
        /* (not exact ints: the Python method) */
    }
    found = lookup_attr(policy, bulk_name, &method);
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

/* --- Job(...) and Request(...) without running their Python __init__ --------------------
 * Both classes use __slots__. When the class is still the one checked at setup (same
 * __init__, object's __new__ and allocator), an instance is allocated and every slot set
 * directly to exactly what __init__ sets; kv_evolve_init builds one of each both ways and
 * compares every slot, and leaves the fast path off (the class is called) if they differ. */

enum { J_JOB_ID, J_DIRECTION, J_REQUEST_ID, J_HASHES, J_DEVICE_BLOCKS, J_SLOTS, J_STATE,
       J_DEADLINE_MS, J_ACKS, J_NUM };
static const char *const job_slot_names[J_NUM] = {
    "job_id", "direction", "request_id", "hashes", "device_blocks", "slots", "state",
    "deadline_ms", "acks"};
enum { R_REQUEST_ID, R_OFFERED, R_LOADING, R_JOBS, R_FINISHED, R_PREEMPTED, R_NUM };
static const char *const request_slot_names[R_NUM] = {
    "request_id", "offered", "loading", "jobs", "finished", "preempted"};

typedef struct {
    PyObject *cls;  /* the class (cls_Job / cls_Request) when the fast path is on, else NULL */
    PyObject *init; /* its __init__ as checked at setup */
    Py_ssize_t offsets[J_NUM];
} FastClass;

static FastClass fast_job = {NULL, NULL, {0}}, fast_request = {NULL, NULL, {0}};
static PyObject *a___init__ = NULL, *float_zero = NULL, *empty_tuple = NULL;

/* A new instance of fc->cls with every slot NULL, or NULL: NULL with no error set when the
 * fast path does not apply now (the caller calls the class). */
static PyObject *fast_alloc(FastClass *fc)
{
    PyTypeObject *tp = (PyTypeObject *)fc->cls;
    if (tp == NULL || tp->tp_new != PyBaseObject_Type.tp_new ||
        tp->tp_alloc != PyType_GenericAlloc || _PyType_Lookup(tp, a___init__) != fc->init)
        return NULL;
    return tp->tp_alloc(tp, 0);
}

static inline void fast_set(PyObject *obj, Py_ssize_t offset, PyObject *value)
{
    *(PyObject **)((char *)obj + offset) = Py_NewRef(value); /* the slot was NULL */
}

/* Job(job_id, direction, request_id, hashes, device_blocks, slots) (new reference). */
static PyObject *new_job(PyObject *const *args, int fast)
{
    PyObject *job;
    int i;
    if (fast && (job = fast_alloc(&fast_job)) != NULL) {
        for (i = 0; i < 6; i++)
            fast_set(job, fast_job.offsets[i], args[i]);
        fast_set(job, fast_job.offsets[J_STATE], js_QUEUED);
        fast_set(job, fast_job.offsets[J_DEADLINE_MS], float_zero);
        fast_set(job, fast_job.offsets[J_ACKS], py_zero);
        return job;
    }
    if (PyErr_Occurred())
        return NULL;
    return PyObject_Vectorcall(cls_Job, args, 6, NULL);
}

/* Request(request_id) (new reference). */
static PyObject *new_request(PyObject *rid, int fast)
{
    PyObject *req, *loading, *jobs;
    if (fast && (req = fast_alloc(&fast_request)) != NULL) {
        if ((loading = PyDict_New()) == NULL || (jobs = PyDict_New()) == NULL) {
            Py_XDECREF(loading);
            Py_DECREF(req);
            return NULL;
        }
        fast_set(req, fast_request.offsets[R_REQUEST_ID], rid);
        fast_set(req, fast_request.offsets[R_OFFERED], empty_tuple);
        fast_set(req, fast_request.offsets[R_LOADING], loading);
        fast_set(req, fast_request.offsets[R_JOBS], jobs);
        fast_set(req, fast_request.offsets[R_FINISHED], Py_False);
        fast_set(req, fast_request.offsets[R_PREEMPTED], Py_False);
        Py_DECREF(loading);
        Py_DECREF(jobs);
        return req;
    }
    if (PyErr_Occurred())
        return NULL;
    return PyObject_CallOneArg(cls_Request, rid);
}

/* Set up fc for cls: its slots must be exactly `names` (object slots of its own, base
 * object, no __dict__), read through their member descriptors. 1 when usable, 0 if not,
 * -1 on error. */
static int fast_class_setup(FastClass *fc, PyObject *cls, const char *const *names, int count)
{
    PyTypeObject *tp = (PyTypeObject *)cls;
    PyMemberDef *m;
    int i, seen = 0;
    Py_CLEAR(fc->init);
    Py_CLEAR(fc->cls);
    if (!PyType_Check(cls) || !(tp->tp_flags & Py_TPFLAGS_HEAPTYPE) ||
        tp->tp_base != &PyBaseObject_Type || tp->tp_dictoffset != 0 || tp->tp_itemsize != 0 ||
        tp->tp_new != PyBaseObject_Type.tp_new || tp->tp_alloc != PyType_GenericAlloc ||
        tp->tp_members == NULL)
        return 0;
    for (m = tp->tp_members; m->name != NULL; m++) {
        for (i = 0; i < count; i++)
            if (strcmp(m->name, names[i]) == 0)
                break;
        if (i == count || m->type != Py_T_OBJECT_EX || m->flags != 0 || (seen >> i) & 1)
            return 0; /* a slot this file does not know, or of another kind */
        seen |= 1 << i;
        fc->offsets[i] = m->offset;
    }
    if (seen != (1 << count) - 1)
        return 0;
    for (i = 0; i < count; i++) { /* and each name reads that slot */
        PyObject *name = PyUnicode_InternFromString(names[i]), *descr;
        if (name == NULL)
            return -1;
        descr = _PyType_Lookup(tp, name);
        Py_DECREF(name);
        if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type) ||
            PyDescr_TYPE(descr) != tp ||
            ((PyMemberDescrObject *)descr)->d_member->offset != fc->offsets[i])
            return 0;
    }
    if ((fc->init = _PyType_Lookup(tp, a___init__)) == NULL)
        return 0;
    Py_INCREF(fc->init);
    fc->cls = Py_NewRef(cls);
    return 1;
}

/* Slot by slot: same type, equal values, and the very objects passed in where the class
 * call kept them. 1 same, 0 different, -1 error. */
static int same_slots(FastClass *fc, int count, PyObject *a, PyObject *b, PyObject *const *args,
                      int nargs)
{
    int i, j;
    for (i = 0; i < count; i++) {
        PyObject *x = *(PyObject **)((char *)a + fc->offsets[i]);
        PyObject *y = *(PyObject **)((char *)b + fc->offsets[i]);
        if (x == NULL || y == NULL || Py_TYPE(x) != Py_TYPE(y))
            return 0;
        for (j = 0; j < nargs; j++)
            if ((x == args[j]) != (y == args[j]))
                return 0;
        if (PyFloat_CheckExact(x)) { /* 0.0 is not -0.0 */
            double dx = PyFloat_AS_DOUBLE(x), dy = PyFloat_AS_DOUBLE(y);
            if (memcmp(&dx, &dy, sizeof(double)) != 0)
                return 0;
        }
        if (x != y) {
            int eq = PyObject_RichCompareBool(x, y, Py_EQ);
            if (eq != 1)
                return eq;
        }
    }
    return 1;
}

/* kv_evolve_init's check of the fast Job and Request against the classes themselves. */
static int fast_classes_init(void)
{
    PyObject *args[6] = {NULL}, *a = NULL, *b = NULL;
    int i, ok, rc = -1;
    ok = fast_class_setup(&fast_job, cls_Job, job_slot_names, J_NUM);
    if (ok < 0)
        return -1;
    if (ok) {
        args[0] = PyLong_FromLong(7);
        args[1] = Py_NewRef(s_STORE);
        args[2] = PyUnicode_FromString("kvflow-native-check");
        args[3] = Py_BuildValue("(ii)", 11, 12);
        args[4] = Py_BuildValue("(ii)", 13, 14);
        args[5] = Py_BuildValue("(ii)", 15, 16);
        for (i = 0; i < 6; i++)
            if (args[i] == NULL)
                goto done;
        if ((a = new_job(args, 0)) == NULL || (b = new_job(args, 1)) == NULL)
            goto done;
        if ((ok = same_slots(&fast_job, J_NUM, a, b, args, 6)) < 0)
            goto done;
        if (!ok)
            Py_CLEAR(fast_job.cls);
        Py_CLEAR(a);
        Py_CLEAR(b);
    }
    ok = fast_class_setup(&fast_request, cls_Request, request_slot_names, R_NUM);
    if (ok < 0)
        goto done;
    if (ok) {
        PyObject *c = NULL;
        if (args[2] == NULL && (args[2] = PyUnicode_FromString("kvflow-native-check")) == NULL)
            goto done;
        if ((a = new_request(args[2], 0)) == NULL || (b = new_request(args[2], 1)) == NULL ||
            (c = new_request(args[2], 1)) == NULL) {
            Py_XDECREF(c);
            goto done;
        }
        ok = same_slots(&fast_request, R_NUM, a, b, &args[2], 1);
        /* and two requests share no dict */
        if (ok == 1)
            for (i = 0; i < R_NUM; i++) {
                PyObject *x = *(PyObject **)((char *)b + fast_request.offsets[i]);
                PyObject *y = *(PyObject **)((char *)c + fast_request.offsets[i]);
                if (x == y && !PyUnicode_CheckExact(x) && !PyTuple_CheckExact(x) &&
                    !PyBool_Check(x))
                    ok = 0;
            }
        Py_DECREF(c);
        if (ok < 0)
            goto done;
        if (!ok)
            Py_CLEAR(fast_request.cls);
    }
    rc = 0;
done:
    if (rc < 0) {
        Py_CLEAR(fast_job.cls);
        Py_CLEAR(fast_request.cls);
    }
    Py_XDECREF(a);
    Py_XDECREF(b);
    for (i = 0; i < 6; i++)
        Py_XDECREF(args[i]);
    return rc;
}

/* _request(state, request_id) for a request_id that is not None: the existing request
 * (req, found while validating) or a new Request(request_id) added to state.requests.
 * Returns a kept reference. */
static PyObject *ensure_request(Refs *refs, PyObject *requests, PyObject *rid, PyObject *req)
{
    if (req != NULL)
        return req;
    req = keep(refs, new_request(rid, 1));
    if (req == NULL || PyDict_SetItem(requests, rid, req) < 0)
        return NULL;
    return req;
}

/* _add_job: Job(...) (as the Python class builds it), listed as live and queued, its device
 * blocks held, and its request (created if needed) told. req: the request found while
 * validating, or NULL. */
static int add_job(Refs *refs, PyObject *state, PyObject *jobs, PyObject *queued,
                   PyObject *held, PyObject *requests, PyObject *req, PyObject *job_id,
                   PyObject *direction, PyObject *rid, PyObject *hashes,
                   PyObject *device_blocks, PyObject *slots)
{
    PyObject *args[6] = {job_id, direction, rid, hashes, device_blocks, slots};
    PyObject *job, *req_jobs;
    Py_ssize_t i, n;
    job = keep(refs, new_job(args, 1));
    if (job == NULL)
        return -1;
    APPLY(PyDict_SetItem(jobs, job_id, job));
    APPLY(PyDict_SetItem(queued, job_id, Py_None));
    APPLY(setattr_fast(state, a_last_job_id, job_id));
    n = PyTuple_GET_SIZE(device_blocks);
    for (i = 0; i < n; i++)
        APPLY(PyDict_SetItem(held, PyTuple_GET_ITEM(device_blocks, i), job_id));
    if (rid == Py_None)
        return 0;
    if ((req = ensure_request(refs, requests, rid, req)) == NULL)
        return -1;
    if ((req_jobs = get(refs, req, a_jobs)) == NULL)
        return -1;
    return set_item(req_jobs, job_id, Py_None);
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
    APPLY(setattr_fast(req, a_offered, rest));
    APPLY(set_item(loading, job_id, hashes));
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
        rc = (setattr_fast(job, a_state, js_IN_FLIGHT) < 0 ||
              setattr_fast(job, a_deadline_ms, deadline) < 0 ||
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
    APPLY(setattr_fast(job, a_acks, new_acks));
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
        APPLY(del_item(req_jobs, jid));
    if (abandoned) { /* frees its quarantined slots; nothing becomes visible */
        APPLY(release_quarantine(quarantine, free_slots, jid, slots));
        return 1;
    }
    n = PyTuple_GET_SIZE(hashes);
    if (store) {
        for (i = 0; i < n; i++)
            APPLY(PyDict_DelItem(pending, PyTuple_GET_ITEM(hashes, i)));
        if (kind == KIND_COMPLETED) { /* RESIDENT: visible from now on */
            APPLY(policy_many(policy, a_insert_many, a_insert, LRU_INSERT, hashes));
        } else { /* free_slots.extend(map(slot_of.pop, reversed(hashes))) */
            for (i = n - 1; i >= 0; i--)
                APPLY(pop_onto(slot_of, PyTuple_GET_ITEM(hashes, i), free_slots));
        }
    } else { /* a load: its pins are released, the entries stay */
        APPLY(del_item(loading, jid));
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
    APPLY(policy_many(policy, a_remove_many, a_remove, LRU_REMOVE, hashes));
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
    APPLY(again ? policy_many(policy, a_touch_many, a_touch, LRU_TOUCH, hashes)
                : policy_many(policy, a_refresh_many, a_refresh, LRU_REFRESH, hashes));
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
        more = count == NULL ? Py_NewRef(py_one) : int_step(count, 1); /* 0 + 1 is 1 itself */
        if (more == NULL)
            return -1;
        rc = PyDict_SetItem(pins, h, more);
        Py_DECREF(more);
        APPLY(rc);
    }
    APPLY(setattr_fast(req, a_offered, hashes));
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
    APPLY(setattr_fast(req, a_offered, rest));
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
    APPLY(setattr_fast(req, a_finished, Py_True));
    APPLY(setattr_fast(req, a_preempted, preempted));
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

/* The LRU fast path's setup: LRUPolicy and its bulk methods, OrderedDict.move_to_end; then
 * the same calls through the class and through this file on two fresh policies, the errors
 * included, must leave the same orders and raise the same errors, or the fast path stays
 * off. -1 only on a real error (MemoryError...). */
static const char *const lru_method_names[LRU_NUM_OPS] = {
    "insert_many", "touch_many", "refresh_many", "remove_many"};

/* One step of the check: op(hashes) on p (through the class) and on q (here); 1 when both
 * returned, or both raised the same exception type with the same message; 0 otherwise. */
static int lru_check_step(PyObject *p, PyObject *q, int op, PyObject *hashes)
{
    PyObject *res, *t1 = NULL, *v1 = NULL, *tb1 = NULL, *t2 = NULL, *v2 = NULL, *tb2 = NULL;
    PyObject *name;
    int same = 0, rc;
    if ((name = PyUnicode_InternFromString(lru_method_names[op])) == NULL)
        return 0;
    res = PyObject_CallMethodOneArg(p, name, hashes);
    Py_XDECREF(res);
    if (res == NULL)
        PyErr_Fetch(&t1, &v1, &tb1);
    rc = policy_many(q, name, name, op, hashes); /* (the fast path: checked by the caller) */
    Py_DECREF(name);
    if (rc < 0)
        PyErr_Fetch(&t2, &v2, &tb2);
    if ((t1 == NULL) != (t2 == NULL))
        goto done;
    if (t1 != NULL) {
        PyObject *s1, *s2;
        PyErr_NormalizeException(&t1, &v1, &tb1);
        PyErr_NormalizeException(&t2, &v2, &tb2);
        if (t1 != t2 || v1 == NULL || v2 == NULL)
            goto done;
        s1 = PyObject_Str(v1);
        s2 = PyObject_Str(v2);
        same = s1 != NULL && s2 != NULL && PyUnicode_Compare(s1, s2) == 0;
        Py_XDECREF(s1);
        Py_XDECREF(s2);
        PyErr_Clear();
    } else {
        same = 1;
    }
done:
    Py_XDECREF(t1), Py_XDECREF(v1), Py_XDECREF(tb1);
    Py_XDECREF(t2), Py_XDECREF(v2), Py_XDECREF(tb2);
    return same;
}

static int lru_init(void)
{
    PyObject *mod, *cls = NULL, *od = NULL, *p = NULL, *q = NULL, *lp = NULL, *lq = NULL;
    int i, ok = 0;
    static const struct {
        int op;
        const char *hashes;
    } steps[] = {
        {LRU_INSERT, "(lllll)"}, {LRU_TOUCH, "(ll)"},   {LRU_REFRESH, "(l)"},
        {LRU_REMOVE, "(l)"},     {LRU_INSERT, "(ll)"},  {LRU_INSERT, "(lll)"},
        {LRU_INSERT, "(lll)"},   {LRU_TOUCH, "(ll)"},   {LRU_REMOVE, "(ll)"},
        {LRU_INSERT, "(l)"},
    };
    static const long values[][5] = {
        {1, 2, 3, 4, 5}, {2, 4},    {1},       {3},       {6, 7},
        {8, 9, 2},       {10, 11, 10}, {4, 99}, {5, 98},  {12},
    };
    Py_CLEAR(lru_cls);
    for (i = 0; i < LRU_NUM_OPS; i++)
        Py_CLEAR(lru_methods[i]);
    Py_XSETREF(a__order, PyUnicode_InternFromString("_order"));
    if (a__order == NULL)
        return -1;
    if ((mod = PyImport_ImportModule("collections")) == NULL)
        return -1;
    od = PyObject_GetAttrString(mod, "OrderedDict");
    Py_DECREF(mod);
    if (od == NULL)
        return -1;
    Py_XSETREF(odict_move_to_end, PyObject_GetAttrString(od, "move_to_end"));
    Py_DECREF(od);
    if (odict_move_to_end == NULL)
        return -1;
    if ((mod = PyImport_ImportModule("kvflow.policies.lru")) == NULL)
        return -1;
    cls = PyObject_GetAttrString(mod, "LRUPolicy");
    Py_DECREF(mod);
    if (cls == NULL)
        return -1;
    if (!PyType_Check(cls)) {
        Py_DECREF(cls);
        return 0;
    }
    for (i = 0; i < LRU_NUM_OPS; i++) {
        PyObject *name = PyUnicode_InternFromString(lru_method_names[i]);
        if (name == NULL)
            goto error;
        lru_methods[i] = _PyType_Lookup((PyTypeObject *)cls, name);
        Py_DECREF(name);
        if (lru_methods[i] == NULL)
            goto off;
        Py_INCREF(lru_methods[i]);
    }
    lru_cls = cls; /* on for the check */
    cls = NULL;
    if ((p = PyObject_CallNoArgs(lru_cls)) == NULL || (q = PyObject_CallNoArgs(lru_cls)) == NULL)
        goto error;
    for (i = 0; i < (int)(sizeof(steps) / sizeof(steps[0])); i++) {
        const long *v = values[i];
        PyObject *hashes = Py_BuildValue(steps[i].hashes, v[0], v[1], v[2], v[3], v[4]);
        PyObject *name;
        int same;
        if (hashes == NULL)
            goto error;
        name = PyUnicode_InternFromString(lru_method_names[steps[i].op]);
        if (name == NULL || lru_order(q, name, steps[i].op) == NULL) { /* the path is taken */
            Py_XDECREF(name);
            Py_DECREF(hashes);
            if (PyErr_Occurred())
                goto error;
            goto off;
        }
        Py_DECREF(name);
        same = lru_check_step(p, q, steps[i].op, hashes);
        Py_DECREF(hashes);
        if (PyErr_Occurred())
            goto error;
        if (!same)
            goto off;
        if ((lp = PyObject_GetAttr(p, a__order)) == NULL)
            goto error;
        Py_SETREF(lp, PySequence_List(lp));
        if (lp == NULL || (lq = PyObject_GetAttr(q, a__order)) == NULL)
            goto error;
        Py_SETREF(lq, PySequence_List(lq));
        if (lq == NULL)
            goto error;
        if (PyObject_RichCompareBool(lp, lq, Py_EQ) != 1) {
            if (PyErr_Occurred())
                goto error;
            goto off;
        }
        Py_CLEAR(lp);
        Py_CLEAR(lq);
    }
    ok = 1;
off:
    if (!ok) {
        Py_CLEAR(lru_cls);
        for (i = 0; i < LRU_NUM_OPS; i++)
            Py_CLEAR(lru_methods[i]);
    }
    Py_XDECREF(cls);
    Py_XDECREF(p);
    Py_XDECREF(q);
    Py_XDECREF(lp);
    Py_XDECREF(lq);
    return 0;
error:
    ok = 0;
    Py_CLEAR(lru_cls);
    for (i = 0; i < LRU_NUM_OPS; i++)
        Py_CLEAR(lru_methods[i]);
    Py_XDECREF(cls);
    Py_XDECREF(p);
    Py_XDECREF(q);
    Py_XDECREF(lp);
    Py_XDECREF(lq);
    return -1;
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
    Py_XSETREF(float_zero, PyFloat_FromDouble(0.0));
    Py_XSETREF(empty_tuple, PyTuple_New(0));
    Py_XSETREF(a___init__, PyUnicode_InternFromString("__init__"));
    if (py_zero == NULL || py_one == NULL || float_zero == NULL || empty_tuple == NULL ||
        a___init__ == NULL)
        return -1;
    if (fast_classes_init() < 0 || lru_init() < 0)
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
        bumped = PyLong_CheckExact(next_seq) ? int_step(next_seq, 1) /* next_seq += 1 */
                                             : PyNumber_InPlaceAdd(next_seq, py_one);
        if (bumped == NULL || setattr_fast(state, a_next_seq, bumped) < 0)
            result = -1;
        Py_XDECREF(bumped);
    }
done:
    release(&refs);
    return result;
}
