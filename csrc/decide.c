/* C mirror of kvflow/decide.py's hot deciders (see native.h for the contract).
 *
 * One section per decider, each named after the Python function it mirrors; read them side
 * by side. The rules kept throughout:
 *   - Validation happens in the same order as in decide.py and raises the same Rejected
 *     subclass with the same message before the first event, so a refused command changes
 *     nothing.
 *   - Every event is built by calling its Python class with keyword arguments (the field
 *     values are the very objects Python would pass) and applied at once (kv_apply, else
 *     evolve_python) before the next value is computed, exactly as OffloadManager.handle
 *     resumes the generator only after applying what it yielded.
 *   - Hashes, request ids, job ids and ranks stay Python objects: membership, comparisons
 *     and arithmetic go through the protocols Python uses (dict/set lookups,
 *     PyObject_RichCompare, PyNumber_*). C integers stand in for them only where they give
 *     the same verdict: positions and lengths, and (in small commands made of exact ints)
 *     the duplicate / minimum checks on device block ids and _decide_store's `seen` set.
 *   - Sets are used for membership only. The one place decide.py iterates a set (min() over
 *     the unique device blocks) is followed step by step on the same kind of set, unless
 *     every block is an exact int, where the minimum does not depend on the order.
 *   - The properties and small methods of kvflow's own classes (Config.enabled,
 *     Job.abandoned, Request.holds_pins) are evaluated from their one-line bodies; for any
 *     other class they are called.
 *   - Anything this file does not expect (another State class, a command whose sequence
 *     field is not a tuple or list, a state container that is not a plain dict) is left to
 *     the Python decider by returning NotImplemented before anything happened.
 *   - An error after the first event was applied (only possible for a malformed command,
 *     e.g. an unhashable hash in a repeated Lookup, or an IllegalTransition under check)
 *     leaves the state where Python's would be, but the caller only gets the exception, not
 *     the events already applied.
 */
#include "native.h"

#ifndef Py_T_OBJECT_EX /* before 3.12 the member types live in structmember.h */
#include "structmember.h"
#define Py_T_OBJECT_EX T_OBJECT_EX
#define Py_READONLY READONLY
#endif

/* obj.name (a new reference). The attributes read here are mostly __slots__ of kvflow's own
 * classes and fields of msgspec structs, both member descriptors: those are read directly,
 * as member_get / PyMember_GetOne do, instead of through the generic attribute machinery.
 * Anything else (a property, an instance dict, an unset slot, a type with its own
 * __getattribute__, a member with flags other than READONLY) goes through PyObject_GetAttr,
 * which raises what Python raises.
 *
 * The slot's offset is remembered per (type, name) together with the type's version tag, the
 * guard CPython's own LOAD_ATTR_SLOT specialisation uses: any change to the type or its
 * bases (a new attribute, __getattribute__, __bases__) gives the type a new tag, so a
 * remembered offset is only used while the type is exactly as it was. Names are always the
 * interned S_* strings below, which live as long as the module. */
#if PY_VERSION_HEX < 0x030B0000
/* 3.10's PyType_Modified clears Py_TPFLAGS_VALID_VERSION_TAG but leaves the old number in
 * tp_version_tag; from 3.11 on it also sets tp_version_tag to 0 (never a valid tag). */
#define VERSION_VALID(tp) PyType_HasFeature((tp), Py_TPFLAGS_VALID_VERSION_TAG)
#else
#define VERSION_VALID(tp) 1
#endif

typedef struct {
    PyTypeObject *type;
    PyObject *name;
    unsigned int version; /* 0: empty */
    Py_ssize_t offset;
} SlotCache;

#define SLOT_CACHE_SIZE 256
static SlotCache slot_cache[SLOT_CACHE_SIZE];

static inline SlotCache *slot_cache_entry(PyTypeObject *tp, PyObject *name)
{
    uint64_t h = ((uint64_t)(uintptr_t)tp ^ ((uint64_t)(uintptr_t)name >> 4)) * 0x9E3779B97F4A7C15ULL;
    return &slot_cache[h >> 56]; /* 256 entries */
}

static PyObject *attr_slow(PyObject *obj, PyObject *name, SlotCache *entry)
{
    PyTypeObject *tp = Py_TYPE(obj);
    if (tp->tp_getattro == PyObject_GenericGetAttr) {
        PyObject *descr = _PyType_Lookup(tp, name); /* borrowed, from the type cache */
        if (descr != NULL && Py_IS_TYPE(descr, &PyMemberDescr_Type)
            && PyObject_TypeCheck(obj, PyDescr_TYPE(descr))) {
            PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
            if (member->type == Py_T_OBJECT_EX && (member->flags & ~Py_READONLY) == 0) {
                if (tp->tp_version_tag != 0 && VERSION_VALID(tp)) { /* the lookup above
                                                                      assigned one if it could */
                    entry->type = tp;
                    entry->name = name;
                    entry->version = tp->tp_version_tag;
                    entry->offset = member->offset;
                }
                PyObject *value = *(PyObject **)((char *)obj + member->offset);
                if (value != NULL)
                    return Py_NewRef(value);
            }
        }
    }
    return PyObject_GetAttr(obj, name);
}

static inline PyObject *attr(PyObject *obj, PyObject *name)
{
    PyTypeObject *tp = Py_TYPE(obj);
    SlotCache *entry = slot_cache_entry(tp, name);
    if (entry->type == tp && entry->name == name && entry->version == tp->tp_version_tag
        && entry->version != 0 && VERSION_VALID(tp)) {
        PyObject *value = *(PyObject **)((char *)obj + entry->offset);
        if (value != NULL)
            return Py_NewRef(value);
        return PyObject_GetAttr(obj, name); /* an unset slot: AttributeError */
    }
    return attr_slow(obj, name, entry);
}

/* --- names bound at setup ------------------------------------------------------------------ */

/* Classes and constants from the setup namespace (strong references, replaced at each setup). */
static PyObject *State_cls, *Config_cls, *Job_cls, *Request_cls;
static PyObject *Lookup_cls, *AcceptHits_cls, *BlocksComputed_cls, *DeviceBlocksEvicting_cls,
    *Touch_cls, *PlanStep_cls, *JobResult_cls, *JobResults_cls, *FinishRequest_cls;
static PyObject *PinsAcquired_cls, *PinsReleased_cls, *LoadQueued_cls, *StoreQueued_cls,
    *BlocksEvicted_cls, *StoreRejected_cls, *BlocksTouched_cls, *JobsSubmitted_cls,
    *LateResultIgnored_cls, *RankSucceeded_cls, *JobFailed_cls, *JobCompleted_cls,
    *RequestClosed_cls, *RequestFinished_cls, *TransferJob_cls;
static PyObject *Rejected_exc, *UnknownJob_exc, *UnknownRequest_exc, *BlockHeld_exc;
static PyObject *evolve_python_fn, *STORE_str, *QUEUED_state, *ABANDONED_state;

/* Interned attribute names (S_x is the str "x"). */
#define KV_ATTR_NAMES(X)                                                                         \
    X(config) X(enabled) X(next_seq) X(last_job_id) X(slot_of) X(pending) X(held) X(jobs)        \
    X(queued) X(requests) X(free_slots) X(policy) X(evictable) X(capacity) X(victims)            \
    X(resident) X(index) X(holds_pins) X(request_id) X(block_hashes) X(num_tokens)               \
    X(device_hit_blocks) X(device_blocks) X(reuse) X(now_ms) X(job_id) X(rank) X(ok) X(error)    \
    X(results) X(preempted) X(offered) X(finished) X(state) X(acks) X(abandoned) X(direction)    \
    X(hashes) X(slots) X(block_tokens) X(store_mode) X(world_size) X(job_deadline_ms) X(get)    \
    X(cpu_blocks) X(loading)
#define KV_DECLARE_NAME(n) static PyObject *S_##n;
KV_ATTR_NAMES(KV_DECLARE_NAME)
#undef KV_DECLARE_NAME

/* Literals: "eager", "lazy", "capacity" (an eviction reason), "unknown error", 0 and 1. */
static PyObject *str_eager, *str_lazy, *str_capacity, *str_unknown_error, *int_zero, *int_one;

/* kwnames tuples for the vectorcalls; the first name of every event's tuple is "seq". */
static PyObject *KW_PinsAcquired, *KW_PinsReleased, *KW_LoadQueued, *KW_StoreQueued,
    *KW_BlocksEvicted, *KW_StoreRejected, *KW_BlocksTouched, *KW_JobsSubmitted,
    *KW_LateResultIgnored, *KW_RankSucceeded, *KW_JobFailed, *KW_JobCompleted,
    *KW_RequestClosed, *KW_RequestFinished, *KW_TransferJob;

#define MAX_FIELDS 12

/* Replace *slot by value (a new reference, may be NULL on error). -1 when value is NULL. */
static int keep(PyObject **slot, PyObject *value)
{
    Py_XSETREF(*slot, value);
    return value == NULL ? -1 : 0;
}

/* A kwnames tuple of interned names from a NULL-terminated list. */
static PyObject *kwnames(const char *first, ...)
{
    PyObject *names[MAX_FIELDS];
    Py_ssize_t n = 0;
    va_list ap;
    va_start(ap, first);
    for (const char *s = first; s != NULL; s = va_arg(ap, const char *)) {
        if (n == MAX_FIELDS) {
            va_end(ap);
            PyErr_SetString(PyExc_SystemError, "kvflow._native: too many fields");
            goto fail;
        }
        names[n] = PyUnicode_InternFromString(s);
        if (names[n] == NULL) {
            va_end(ap);
            goto fail;
        }
        n++;
    }
    va_end(ap);
    PyObject *tuple = PyTuple_New(n);
    if (tuple == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(tuple, i, names[i]); /* steals */
    return tuple;
fail:
    while (n > 0)
        Py_DECREF(names[--n]);
    return NULL;
}

int kv_decide_init(void)
{
    memset(slot_cache, 0, sizeof slot_cache);
#define KV_INTERN_NAME(n)                                                                        \
    if (keep(&S_##n, PyUnicode_InternFromString(#n)) < 0)                                        \
        return -1;
    KV_ATTR_NAMES(KV_INTERN_NAME)
#undef KV_INTERN_NAME
#define REF(var, name)                                                                           \
    if (keep(&var, kv_ref(name)) < 0)                                                            \
        return -1;
    REF(State_cls, "State");
    REF(Config_cls, "Config");
    REF(Job_cls, "Job");
    REF(Request_cls, "Request");
    REF(Lookup_cls, "Lookup");
    REF(AcceptHits_cls, "AcceptHits");
    REF(BlocksComputed_cls, "BlocksComputed");
    REF(DeviceBlocksEvicting_cls, "DeviceBlocksEvicting");
    REF(Touch_cls, "Touch");
    REF(PlanStep_cls, "PlanStep");
    REF(JobResult_cls, "JobResult");
    REF(JobResults_cls, "JobResults");
    REF(FinishRequest_cls, "FinishRequest");
    REF(PinsAcquired_cls, "PinsAcquired");
    REF(PinsReleased_cls, "PinsReleased");
    REF(LoadQueued_cls, "LoadQueued");
    REF(StoreQueued_cls, "StoreQueued");
    REF(BlocksEvicted_cls, "BlocksEvicted");
    REF(StoreRejected_cls, "StoreRejected");
    REF(BlocksTouched_cls, "BlocksTouched");
    REF(JobsSubmitted_cls, "JobsSubmitted");
    REF(LateResultIgnored_cls, "LateResultIgnored");
    REF(RankSucceeded_cls, "RankSucceeded");
    REF(JobFailed_cls, "JobFailed");
    REF(JobCompleted_cls, "JobCompleted");
    REF(RequestClosed_cls, "RequestClosed");
    REF(RequestFinished_cls, "RequestFinished");
    REF(TransferJob_cls, "TransferJob");
    REF(Rejected_exc, "Rejected");
    REF(UnknownJob_exc, "UnknownJob");
    REF(UnknownRequest_exc, "UnknownRequest");
    REF(BlockHeld_exc, "BlockHeld");
    REF(evolve_python_fn, "evolve_python");
    REF(STORE_str, "STORE");
    REF(QUEUED_state, "JobState.QUEUED");
    REF(ABANDONED_state, "JobState.ABANDONED");
#undef REF
    if (keep(&str_eager, PyUnicode_InternFromString("eager")) < 0
        || keep(&str_lazy, PyUnicode_InternFromString("lazy")) < 0
        || keep(&str_capacity, PyUnicode_InternFromString("capacity")) < 0
        || keep(&str_unknown_error, PyUnicode_InternFromString("unknown error")) < 0
        || keep(&int_zero, PyLong_FromLong(0)) < 0 || keep(&int_one, PyLong_FromLong(1)) < 0)
        return -1;
#define TERMINAL "abandoned", "job_id", "direction", "request_id", "hashes", "device_blocks", "slots"
    if (keep(&KW_PinsAcquired, kwnames("seq", "request_id", "hashes", "num_tokens", NULL)) < 0
        || keep(&KW_PinsReleased, kwnames("seq", "request_id", "hashes", NULL)) < 0
        || keep(&KW_LoadQueued, kwnames("seq", "job_id", "request_id", "hashes", "device_blocks",
                                        "slots", NULL)) < 0
        || keep(&KW_StoreQueued, kwnames("seq", "job_id", "request_id", "hashes", "device_blocks",
                                         "slots", NULL)) < 0
        || keep(&KW_BlocksEvicted, kwnames("seq", "hashes", "slots", "reason", NULL)) < 0
        || keep(&KW_StoreRejected, kwnames("seq", "request_id", "hashes", "device_blocks",
                                           "reason", NULL)) < 0
        || keep(&KW_BlocksTouched, kwnames("seq", "hashes", "reuse", NULL)) < 0
        || keep(&KW_JobsSubmitted, kwnames("seq", "job_ids", "now_ms", "deadline_ms", NULL)) < 0
        || keep(&KW_LateResultIgnored, kwnames("seq", "job_id", "rank", "ok", "error", NULL)) < 0
        || keep(&KW_RankSucceeded, kwnames("seq", "job_id", "rank", NULL)) < 0
        || keep(&KW_JobFailed, kwnames("seq", "rank", "error", TERMINAL, NULL)) < 0
        || keep(&KW_JobCompleted, kwnames("seq", "rank", TERMINAL, NULL)) < 0
        || keep(&KW_RequestClosed, kwnames("seq", "request_id", NULL)) < 0
        || keep(&KW_RequestFinished, kwnames("seq", "request_id", "preempted", NULL)) < 0
        || keep(&KW_TransferJob, kwnames("job_id", "direction", "device_blocks", "slots",
                                         "hashes", "request_id", NULL)) < 0)
        return -1;
#undef TERMINAL
    return 0;
}

/* --- helpers -------------------------------------------------------------------------------- */

/* One decision in progress: the state, the events applied so far, the check flag. */
typedef struct {
    PyObject *state;
    PyObject *events; /* list */
    int check;
} Decision;

/* What a decider returns instead of an answer to leave the command to Python (nothing was
 * applied yet). Answers are ints, None, lists: never NotImplemented. */
#define DEFER Py_NotImplemented

static PyObject *defer(void)
{
    Py_RETURN_NOTIMPLEMENTED;
}

/* decide.py's _whole: an int and not a bool. */
static int whole(PyObject *v)
{
    return PyLong_Check(v) && !PyBool_Check(v);
}

/* state.<name> when it is a plain dict (1), another kind of object (0: leave the command to
 * Python, *out is NULL), or -1 on error. */
static int state_dict(PyObject *state, PyObject *name, PyObject **out)
{
    PyObject *value = attr(state, name);
    *out = NULL;
    if (value == NULL)
        return -1;
    if (!PyDict_CheckExact(value)) {
        Py_DECREF(value);
        return 0;
    }
    *out = value;
    return 1;
}

/* cmd.<name> as a tuple: a tuple as is, a list snapshotted (1); another kind of sequence
 * (0: leave the command to Python, *out is NULL); -1 on error. The deciders only read these
 * sequences (len, index, iterate, slice), so a tuple of the same items reads the same. */
static int command_seq(PyObject *cmd, PyObject *name, PyObject **out)
{
    PyObject *value = attr(cmd, name);
    *out = NULL;
    if (value == NULL)
        return -1;
    if (PyTuple_CheckExact(value)) {
        *out = value;
        return 1;
    }
    if (PyList_CheckExact(value)) {
        *out = PyList_AsTuple(value);
        Py_DECREF(value);
        return *out == NULL ? -1 : 1;
    }
    Py_DECREF(value);
    return 0;
}

/* Attribute read as a truth value: 1, 0, -1 on error. */
static int attr_true(PyObject *obj, PyObject *name)
{
    PyObject *value = attr(obj, name);
    if (value == NULL)
        return -1;
    int r = PyObject_IsTrue(value);
    Py_DECREF(value);
    return r;
}

/* state.config.<name> (new reference). */
static PyObject *config_attr(PyObject *state, PyObject *name)
{
    PyObject *config = attr(state, S_config);
    if (config == NULL)
        return NULL;
    PyObject *value = attr(config, name);
    Py_DECREF(config);
    return value;
}

/* state.config.enabled as 1 / 0, -1 on error. For kvflow's own Config the property's body
 * (cpu_blocks > 0) is evaluated here rather than through a Python frame. */
static int offload_enabled(PyObject *state)
{
    PyObject *config = attr(state, S_config), *value;
    int r = -1;
    if (config == NULL)
        return -1;
    if ((PyObject *)Py_TYPE(config) == Config_cls) {
        if ((value = attr(config, S_cpu_blocks)) != NULL)
            r = PyObject_RichCompareBool(value, int_zero, Py_GT);
    } else if ((value = attr(config, S_enabled)) != NULL) {
        r = PyObject_IsTrue(value);
    }
    Py_XDECREF(value);
    Py_DECREF(config);
    return r;
}

/* job.abandoned (a new reference to a bool); for kvflow's own Job the property's body,
 * `self.state is JobState.ABANDONED`. */
static PyObject *job_abandoned(PyObject *job)
{
    if ((PyObject *)Py_TYPE(job) != Job_cls)
        return attr(job, S_abandoned);
    PyObject *st = attr(job, S_state);
    if (st == NULL)
        return NULL;
    PyObject *r = PyBool_FromLong(st == ABANDONED_state);
    Py_DECREF(st);
    return r;
}

/* req.holds_pins() as 1 / 0, -1 on error; for kvflow's own Request the method's body,
 * `bool(self.offered or self.loading)`. */
static int holds_pins(PyObject *req)
{
    PyObject *value;
    int r;
    if ((PyObject *)Py_TYPE(req) != Request_cls) {
        if ((value = PyObject_CallMethodNoArgs(req, S_holds_pins)) == NULL)
            return -1;
        r = PyObject_IsTrue(value);
        Py_DECREF(value);
        return r;
    }
    if ((r = attr_true(req, S_offered)) != 0)
        return r;
    return attr_true(req, S_loading);
}

/* d[key] with dict semantics (KeyError when absent), as a new reference. */
static PyObject *dict_item(PyObject *d, PyObject *key)
{
    PyObject *value = PyDict_GetItemWithError(d, key);
    if (value != NULL) {
        Py_INCREF(value);
        return value;
    }
    if (PyErr_Occurred())
        return NULL;
    return PyObject_GetItem(d, key); /* raises the KeyError dict[key] raises */
}

/* state.last_job_id + 1 */
static PyObject *next_job_id(PyObject *state)
{
    PyObject *last = attr(state, S_last_job_id);
    if (last == NULL)
        return NULL;
    PyObject *job_id = PyNumber_Add(last, int_one);
    Py_DECREF(last);
    return job_id;
}

/* tuple(map(d.__getitem__, seq)) for a dict d and any iterable seq. */
static PyObject *tuple_of_items(PyObject *d, PyObject *seq)
{
    if (PyTuple_CheckExact(seq) || PyList_CheckExact(seq)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        PyObject *out = PyTuple_New(n);
        for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
            PyObject *value = dict_item(d, PySequence_Fast_GET_ITEM(seq, i));
            if (value == NULL)
                Py_CLEAR(out);
            else
                PyTuple_SET_ITEM(out, i, value);
        }
        return out;
    }
    PyObject *it = PyObject_GetIter(seq);
    if (it == NULL)
        return NULL;
    PyObject *out = PyList_New(0), *key;
    if (out == NULL) {
        Py_DECREF(it);
        return NULL;
    }
    while ((key = PyIter_Next(it)) != NULL) {
        PyObject *value = dict_item(d, key);
        Py_DECREF(key);
        if (value == NULL || PyList_Append(out, value) < 0) {
            Py_XDECREF(value);
            goto fail;
        }
        Py_DECREF(value);
    }
    if (PyErr_Occurred())
        goto fail;
    Py_DECREF(it);
    Py_SETREF(out, PyList_AsTuple(out));
    return out;
fail:
    Py_DECREF(it);
    Py_DECREF(out);
    return NULL;
}

/* Build one event, cls(seq=state.next_seq, <kwnames[1:]>=values...), apply it (kv_apply,
 * else evolve_python, which applies or raises IllegalTransition) and append it to the
 * decision's events. 0 on success, -1 with an exception set. */
static int emit(Decision *dc, PyObject *cls, PyObject *names, PyObject *const *values)
{
    PyObject *args[MAX_FIELDS];
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    args[0] = attr(dc->state, S_next_seq);
    if (args[0] == NULL)
        return -1;
    for (Py_ssize_t i = 1; i < n; i++)
        args[i] = values[i - 1];
    PyObject *event = PyObject_Vectorcall(cls, args, 0, names);
    Py_DECREF(args[0]);
    if (event == NULL)
        return -1;
    int applied = kv_apply(dc->state, event, dc->check);
    if (applied == 0) {
        PyObject *call[3] = {dc->state, event, dc->check ? Py_True : Py_False};
        PyObject *r = PyObject_Vectorcall(evolve_python_fn, call, 3, NULL);
        if (r == NULL)
            applied = -1;
        Py_XDECREF(r);
    }
    if (applied < 0 || PyList_Append(dc->events, event) < 0) {
        Py_DECREF(event);
        return -1;
    }
    Py_DECREF(event);
    return 0;
}

/* decide.py's hit_cap_blocks: max(0, (num_tokens - 1) // block_tokens), as a slice bound
 * (clamped like a slice index). -1 on error. */
static Py_ssize_t hit_cap_blocks(PyObject *num_tokens, PyObject *block_tokens)
{
    PyObject *less = PyNumber_Subtract(num_tokens, int_one);
    if (less == NULL)
        return -1;
    PyObject *cap = PyNumber_FloorDivide(less, block_tokens);
    Py_DECREF(less);
    if (cap == NULL)
        return -1;
    Py_ssize_t n = PyNumber_AsSsize_t(cap, NULL); /* clamps like a slice index */
    Py_DECREF(cap);
    if (n == -1 && PyErr_Occurred())
        return -1;
    return n < 0 ? 0 : n;
}

/* `h in slot_of and h not in pending` (RESIDENT): 1, 0, -1 on error. */
static int is_resident(PyObject *slot_of, PyObject *pending, PyObject *h)
{
    int r = PyDict_Contains(slot_of, h);
    if (r <= 0)
        return r;
    r = PyDict_Contains(pending, h);
    return r < 0 ? -1 : !r;
}

/* req.offered truthy: emit PinsReleased(request_id=request_id, hashes=req.offered). */
static int release_offered(Decision *dc, PyObject *req, PyObject *request_id)
{
    PyObject *offered = attr(req, S_offered);
    if (offered == NULL)
        return -1;
    int r = PyObject_IsTrue(offered);
    if (r > 0) {
        PyObject *values[] = {request_id, offered};
        r = emit(dc, PinsReleased_cls, KW_PinsReleased, values);
    }
    Py_DECREF(offered);
    return r < 0 ? -1 : 0;
}

/* --- decide_lookup -------------------------------------------------------------------------- */

static PyObject *decide_lookup(Decision *dc, PyObject *cmd)
{
    PyObject *state = dc->state, *answer = NULL;
    PyObject *request_id = NULL, *num_tokens = NULL, *skip = NULL, *hashes = NULL;
    PyObject *requests = NULL, *slot_of = NULL, *pending = NULL, *req = NULL;
    PyObject *block_tokens = NULL, *hits = NULL;
    int r;

    if ((r = command_seq(cmd, S_block_hashes, &hashes)) <= 0
        || (r = state_dict(state, S_requests, &requests)) <= 0
        || (r = state_dict(state, S_slot_of, &slot_of)) <= 0
        || (r = state_dict(state, S_pending, &pending)) <= 0) {
        answer = r == 0 ? defer() : NULL;
        goto done;
    }
    if ((request_id = attr(cmd, S_request_id)) == NULL
        || (num_tokens = attr(cmd, S_num_tokens)) == NULL)
        goto done;
    r = whole(num_tokens) ? PyObject_RichCompareBool(num_tokens, int_zero, Py_LT) : 1;
    if (r != 0) {
        if (r > 0)
            PyErr_Format(Rejected_exc, "lookup of request %S: num_tokens must be >= 0", request_id);
        goto done;
    }
    if ((skip = attr(cmd, S_device_hit_blocks)) == NULL)
        goto done;
    r = whole(skip) ? PyObject_RichCompareBool(skip, int_zero, Py_LT) : 1;
    if (r != 0) {
        if (r > 0)
            PyErr_Format(Rejected_exc, "lookup of request %S: device_hit_blocks must be >= 0",
                         request_id);
        goto done;
    }
    if ((r = offload_enabled(state)) <= 0) {
        if (r == 0)
            answer = PyLong_FromLong(0);
        goto done;
    }
    req = PyDict_GetItemWithError(requests, request_id);
    if (req == NULL && PyErr_Occurred())
        goto done;
    Py_XINCREF(req);
    if (req != NULL && (r = attr_true(req, S_finished)) != 0) {
        if (r > 0)
            PyErr_Format(Rejected_exc, "lookup of request %S: the request is finished", request_id);
        goto done;
    }
    if ((block_tokens = config_attr(state, S_block_tokens)) == NULL)
        goto done;
    Py_ssize_t cap = hit_cap_blocks(num_tokens, block_tokens);
    if (cap < 0)
        goto done;
    /* A repeated lookup replaces the hits it offered before, so pins never pile up. */
    if (req != NULL && release_offered(dc, req, request_id) < 0)
        goto done;
    /* hits: cmd.block_hashes[device_hit_blocks : cap] up to the first block that is not
     * RESIDENT (on the tier and not pending) */
    Py_ssize_t n = PyTuple_GET_SIZE(hashes);
    Py_ssize_t start = PyNumber_AsSsize_t(skip, NULL); /* >= 0, clamped like a slice index */
    if (start == -1 && PyErr_Occurred())
        goto done;
    Py_ssize_t stop = cap < n ? cap : n, end = start;
    for (; end < stop; end++) {
        if ((r = is_resident(slot_of, pending, PyTuple_GET_ITEM(hashes, end))) < 0)
            goto done;
        if (r == 0)
            break;
    }
    if (end < start)
        end = start;
    if ((hits = PyTuple_GetSlice(hashes, start, end)) == NULL)
        goto done;
    PyObject *values[] = {request_id, hits, num_tokens};
    if (emit(dc, PinsAcquired_cls, KW_PinsAcquired, values) < 0)
        goto done;
    answer = PyLong_FromSsize_t(PyTuple_GET_SIZE(hits));
done:
    Py_XDECREF(request_id);
    Py_XDECREF(num_tokens);
    Py_XDECREF(skip);
    Py_XDECREF(hashes);
    Py_XDECREF(requests);
    Py_XDECREF(slot_of);
    Py_XDECREF(pending);
    Py_XDECREF(req);
    Py_XDECREF(block_tokens);
    Py_XDECREF(hits);
    return answer;
}

/* --- _check_device_blocks ------------------------------------------------------------------- */

/* Rejected(f"device blocks must be integers, got {list(device_blocks)[:4]!r}") */
static void reject_non_integers(PyObject *blocks)
{
    PyObject *head = PyTuple_GetSlice(blocks, 0, 4);
    PyObject *shown = head == NULL ? NULL : PySequence_List(head);
    if (shown != NULL)
        PyErr_Format(Rejected_exc, "device blocks must be integers, got %R", shown);
    Py_XDECREF(head);
    Py_XDECREF(shown);
}

/* held.keys().isdisjoint(blocks): 1 disjoint, 0 not, -1 error. (isdisjoint iterates the
 * shorter side; the answer is the same whichever side is iterated.) */
static int keys_disjoint(PyObject *held, PyObject *blocks)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(blocks); i++) {
        int r = PyDict_Contains(held, PyTuple_GET_ITEM(blocks, i));
        if (r != 0)
            return r < 0 ? -1 : 0;
    }
    return 1;
}

#define SMALL 64 /* commands up to this many blocks take the allocation-free paths */

/* The checks on the ids themselves: `len(set(device_blocks)) != len(device_blocks)`, then
 * `min(unique) < 0` (a TypeError from min() is a Rejected). Up to SMALL exact ints that fit
 * in a long long are checked on a sorted copy of their values (for exact ints, set equality
 * is value equality and the minimum does not depend on the order); anything else goes
 * through a real set, iterated as min() does. 0 / -1. */
static int check_block_ids(PyObject *blocks)
{
    Py_ssize_t n = PyTuple_GET_SIZE(blocks), i;
    if (n <= SMALL) {
        long long v[SMALL];
        for (i = 0; i < n; i++) {
            PyObject *item = PyTuple_GET_ITEM(blocks, i);
            int overflow = 0;
            if (!PyLong_CheckExact(item))
                break;
            v[i] = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow)
                break;
        }
        if (i == n) {
            Py_ssize_t rising = 1; /* strictly increasing already (a range, say): sorted, */
            while (rising < n && v[rising - 1] < v[rising]) /* and no value twice */
                rising++;
            if (rising < n) {
                for (i = 1; i < n; i++) { /* insertion sort: n is small */
                    long long x = v[i];
                    Py_ssize_t j = i;
                    for (; j > 0 && v[j - 1] > x; j--)
                        v[j] = v[j - 1];
                    v[j] = x;
                }
                for (i = 1; i < n; i++)
                    if (v[i] == v[i - 1]) {
                        PyErr_SetString(Rejected_exc, "a device block is named twice in one call");
                        return -1;
                    }
            }
            if (n && v[0] < 0) {
                PyErr_Format(Rejected_exc, "device block %lld is not a block id", v[0]);
                return -1;
            }
            return 0;
        }
    }
    PyObject *unique = NULL, *it = NULL, *lowest = NULL, *item;
    int result = -1, r;
    if ((unique = PySet_New(blocks)) == NULL)
        goto done;
    if (PySet_GET_SIZE(unique) != n) {
        PyErr_SetString(Rejected_exc, "a device block is named twice in one call");
        goto done;
    }
    if ((it = PyObject_GetIter(unique)) == NULL)
        goto done;
    while ((item = PyIter_Next(it)) != NULL) { /* min(), step by step */
        if (lowest == NULL) {
            lowest = item;
            continue;
        }
        r = PyObject_RichCompareBool(item, lowest, Py_LT);
        if (r > 0)
            Py_SETREF(lowest, item);
        else
            Py_DECREF(item);
        if (r < 0)
            break;
    }
    if (PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            reject_non_integers(blocks);
        }
        goto done;
    }
    if ((r = PyObject_RichCompareBool(lowest, int_zero, Py_LT)) != 0) {
        if (r > 0)
            PyErr_Format(Rejected_exc, "device block %S is not a block id", lowest);
        goto done;
    }
    result = 0;
done:
    Py_XDECREF(unique);
    Py_XDECREF(it);
    Py_XDECREF(lowest);
    return result;
}

/* The held device block d (held by job_id) may be reused when its live job is a store of
 * the hash the caller asks for it (allow_same_store[d]) and not abandoned by a reset:
 * 1 allowed, 0 not, -1 error. */
static int same_store(PyObject *job, PyObject *d, PyObject *allow_same_store)
{
    PyObject *direction = NULL, *blocks = NULL, *index = NULL, *hashes = NULL, *stored = NULL;
    int r;
    if ((direction = attr(job, S_direction)) == NULL)
        return -1;
    r = PyObject_RichCompareBool(direction, STORE_str, Py_EQ);
    Py_DECREF(direction);
    if (r <= 0)
        return r;
    PyObject *abandoned = job_abandoned(job);
    if (abandoned == NULL)
        return -1;
    r = PyObject_Not(abandoned);
    Py_DECREF(abandoned);
    if (r <= 0)
        return r;
    if (allow_same_store == NULL) /* d in {} */
        return 0;
    if ((r = PyDict_Contains(allow_same_store, d)) <= 0)
        return r;
    r = -1;
    if ((blocks = attr(job, S_device_blocks)) == NULL
        || (index = PyObject_CallMethodOneArg(blocks, S_index, d)) == NULL
        || (hashes = attr(job, S_hashes)) == NULL
        || (stored = PyObject_GetItem(hashes, index)) == NULL)
        goto done;
    PyObject *asked = PyDict_GetItemWithError(allow_same_store, d); /* borrowed */
    if (asked == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, d);
        goto done;
    }
    Py_INCREF(asked);
    r = PyObject_RichCompareBool(stored, asked, Py_EQ);
    Py_DECREF(asked);
done:
    Py_XDECREF(blocks);
    Py_XDECREF(index);
    Py_XDECREF(hashes);
    Py_XDECREF(stored);
    return r;
}

/* Device blocks must not be held by a live job (F12), except a store of the same hash (a
 * duplicate, F3). allow_same_store: device block -> hash asked; NULL for {}. held_disjoint:
 * held.keys().isdisjoint(device_blocks) when the caller already knows it, else -1. 0 / -1. */
static int check_device_blocks(PyObject *state, PyObject *blocks, PyObject *allow_same_store,
                               int held_disjoint)
{
    Py_ssize_t n = PyTuple_GET_SIZE(blocks);
    PyObject *held = NULL, *jobs = NULL;
    int result = -1, r = held_disjoint;
    if (n == 0)
        return 0;
    if (check_block_ids(blocks) < 0)
        return -1;
    if ((held = attr(state, S_held)) == NULL)
        goto done;
    if (!PyDict_CheckExact(held)) { /* the deciders checked it before anything happened */
        PyErr_SetString(PyExc_SystemError, "kvflow._native: state.held is not a dict");
        goto done;
    }
    if (PyDict_GET_SIZE(held) == 0) {
        result = 0;
        goto done;
    }
    if (r < 0 && (r = keys_disjoint(held, blocks)) < 0)
        goto done;
    if (r == 1) {
        result = 0;
        goto done;
    }
    if ((jobs = attr(state, S_jobs)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(blocks, i);
        PyObject *job_id = PyDict_GetItemWithError(held, d);
        if (job_id == NULL) {
            if (PyErr_Occurred())
                goto done;
            continue;
        }
        Py_INCREF(job_id);
        PyObject *job = PyObject_GetItem(jobs, job_id), *direction = NULL;
        r = job == NULL ? -1 : same_store(job, d, allow_same_store);
        if (r == 0 && (direction = attr(job, S_direction)) != NULL)
            PyErr_Format(BlockHeld_exc,
                         "device block %S is held by live %S job %S; "
                         "wait for the job to finish before reusing it",
                         d, direction, job_id);
        Py_XDECREF(direction);
        Py_XDECREF(job);
        Py_DECREF(job_id);
        if (r <= 0)
            goto done;
    }
    result = 0;
done:
    Py_XDECREF(held);
    Py_XDECREF(jobs);
    return result;
}

/* --- decide_accept_hits --------------------------------------------------------------------- */

static PyObject *decide_accept_hits(Decision *dc, PyObject *cmd)
{
    PyObject *state = dc->state, *answer = NULL;
    PyObject *request_id = NULL, *blocks = NULL, *requests = NULL, *slot_of = NULL, *req = NULL;
    PyObject *held = NULL, *offered = NULL, *hashes = NULL, *job_id = NULL, *slots = NULL;
    int r;

    if ((r = command_seq(cmd, S_device_blocks, &blocks)) <= 0
        || (r = state_dict(state, S_requests, &requests)) <= 0
        || (r = state_dict(state, S_slot_of, &slot_of)) <= 0
        || (r = state_dict(state, S_held, &held)) <= 0) {
        answer = r == 0 ? defer() : NULL;
        goto done;
    }
    if ((request_id = attr(cmd, S_request_id)) == NULL)
        goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(blocks);
    if ((r = offload_enabled(state)) <= 0) {
        if (r == 0 && n > 0)
            PyErr_Format(Rejected_exc,
                         "accept_hits: offload is disabled, request %S was offered nothing",
                         request_id);
        else if (r == 0)
            answer = Py_NewRef(Py_None);
        goto done;
    }
    req = PyDict_GetItemWithError(requests, request_id);
    if (req == NULL && PyErr_Occurred())
        goto done;
    Py_XINCREF(req);
    if (req == NULL || (r = attr_true(req, S_finished)) != 0) {
        if (req == NULL || r > 0)
            PyErr_Format(UnknownRequest_exc, "accept_hits: request %S has no live lookup",
                         request_id);
        goto done;
    }
    if ((offered = attr(req, S_offered)) == NULL)
        goto done;
    Py_ssize_t num_offered = PyObject_Size(offered);
    if (num_offered < 0)
        goto done;
    if (n > num_offered) {
        PyErr_Format(Rejected_exc,
                     "accept_hits: request %S was offered %zd blocks, cannot accept %zd",
                     request_id, num_offered, n);
        goto done;
    }
    if (check_device_blocks(state, blocks, NULL, -1) < 0)
        goto done;
    if (n) {
        if ((hashes = PySequence_GetSlice(offered, 0, n)) == NULL
            || (job_id = next_job_id(state)) == NULL
            || (slots = tuple_of_items(slot_of, hashes)) == NULL)
            goto done;
        PyObject *values[] = {job_id, request_id, hashes, blocks, slots};
        if (emit(dc, LoadQueued_cls, KW_LoadQueued, values) < 0)
            goto done;
    }
    if (release_offered(dc, req, request_id) < 0)
        goto done;
    answer = job_id != NULL ? Py_NewRef(job_id) : Py_NewRef(Py_None);
done:
    Py_XDECREF(request_id);
    Py_XDECREF(blocks);
    Py_XDECREF(requests);
    Py_XDECREF(slot_of);
    Py_XDECREF(held);
    Py_XDECREF(req);
    Py_XDECREF(offered);
    Py_XDECREF(hashes);
    Py_XDECREF(job_id);
    Py_XDECREF(slots);
    return answer;
}

/* --- _victims_up_to ------------------------------------------------------------------------- */

/* policy.victims(wanted, state.evictable) */
static PyObject *policy_victims(PyObject *state, PyObject *wanted)
{
    PyObject *policy = attr(state, S_policy);
    PyObject *evictable = policy == NULL ? NULL : attr(state, S_evictable);
    PyObject *victims = NULL;
    if (evictable != NULL)
        victims = PyObject_CallMethodObjArgs(policy, S_victims, wanted, evictable, NULL);
    Py_XDECREF(policy);
    Py_XDECREF(evictable);
    return victims;
}

/* As many victims as the policy can give, up to wanted, in eviction order. */
static PyObject *victims_up_to(PyObject *state, Py_ssize_t wanted)
{
    PyObject *count = NULL, *victims = NULL, *policy = NULL, *resident = NULL, *it = NULL;
    PyObject *evictable = NULL, *h;
    if (wanted <= 0)
        return PyList_New(0);
    if ((count = PyLong_FromSsize_t(wanted)) == NULL
        || (victims = policy_victims(state, count)) == NULL || victims != Py_None)
        goto done;
    /* fewer than wanted: as many as are evictable */
    Py_CLEAR(victims);
    Py_ssize_t num_evictable = 0;
    if ((policy = attr(state, S_policy)) == NULL
        || (resident = PyObject_CallMethodNoArgs(policy, S_resident)) == NULL
        || (it = PyObject_GetIter(resident)) == NULL
        || (evictable = attr(state, S_evictable)) == NULL)
        goto done;
    while ((h = PyIter_Next(it)) != NULL) {
        PyObject *yes = PyObject_CallOneArg(evictable, h);
        Py_DECREF(h);
        int r = yes == NULL ? -1 : PyObject_IsTrue(yes);
        Py_XDECREF(yes);
        if (r < 0)
            goto done;
        num_evictable += r;
    }
    if (PyErr_Occurred())
        goto done;
    if (num_evictable == 0) {
        victims = PyList_New(0);
        goto done;
    }
    Py_SETREF(count, PyLong_FromSsize_t(num_evictable));
    if (count == NULL || (victims = policy_victims(state, count)) == NULL)
        goto done;
    int r = PyObject_IsTrue(victims); /* victims(...) or [] */
    if (r <= 0)
        Py_SETREF(victims, r < 0 ? NULL : PyList_New(0));
done:
    Py_XDECREF(count);
    Py_XDECREF(policy);
    Py_XDECREF(resident);
    Py_XDECREF(it);
    Py_XDECREF(evictable);
    return victims;
}

/* --- _decide_store -------------------------------------------------------------------------- */

/* tuple(free[len(free) - k :][::-1]) with Python's slice rules (a negative start counts
 * from the end). */
static PyObject *last_free_reversed(PyObject *free, Py_ssize_t k)
{
    Py_ssize_t n = PyObject_Size(free);
    if (n < 0)
        return NULL;
    if (PyList_CheckExact(free)) {
        Py_ssize_t start = n - k;
        if (start < 0 && (start += n) < 0)
            start = 0;
        PyObject *out = PyTuple_New(n - start);
        if (out != NULL)
            for (Py_ssize_t i = 0; i < n - start; i++)
                PyTuple_SET_ITEM(out, i, Py_NewRef(PyList_GET_ITEM(free, n - 1 - i)));
        return out;
    }
    PyObject *tail = PySequence_GetSlice(free, n - k, PY_SSIZE_T_MAX);
    if (tail == NULL)
        return NULL;
    PyObject *items = PySequence_Tuple(tail);
    Py_DECREF(tail);
    if (items == NULL)
        return NULL;
    Py_ssize_t m = PyTuple_GET_SIZE(items);
    PyObject *out = PyTuple_New(m);
    if (out != NULL)
        for (Py_ssize_t i = 0; i < m; i++)
            PyTuple_SET_ITEM(out, i, Py_NewRef(PyTuple_GET_ITEM(items, m - 1 - i)));
    Py_DECREF(items);
    return out;
}

/* 1 when `h in entries and h not in gone`: the block is on the tier and stays there.
 * gone is NULL while no victim was taken (an empty set). */
static int stays_on_tier(PyObject *entries, PyObject *gone, PyObject *h)
{
    int r = PyDict_Contains(entries, h);
    if (r <= 0 || gone == NULL)
        return r;
    r = PySequence_Contains(gone, h);
    return r < 0 ? -1 : !r;
}

/* An exact int in [-2**63, 2**64) as a C key: two such ints are equal (as dict and set keys)
 * exactly when their keys are. */
typedef struct {
    unsigned long long bits;
    int negative;
} IntKey;

/* 1 with *key set; 0 when h is not an exact int in that range (nothing raised). */
static int int_key(PyObject *h, IntKey *key)
{
    int overflow = 0;
    if (!PyLong_CheckExact(h))
        return 0;
    long long v = PyLong_AsLongLongAndOverflow(h, &overflow);
    if (!overflow) {
        key->bits = (unsigned long long)v;
        key->negative = v < 0;
        return 1;
    }
    if (overflow < 0)
        return 0;
    unsigned long long u = PyLong_AsUnsignedLongLong(h);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear(); /* >= 2**64: not representable, nothing to report */
        return 0;
    }
    key->bits = u;
    key->negative = 0;
    return 1;
}

/* The block-by-block walk of _decide_store (DESIGN §7 step 3, see decide_store). */
typedef struct {
    /* `seen`: the hashes admitted so far (it also gets the block that is rejected, but the
     * walk stops there). For a small command of exact ints (the usual case) membership is
     * looked up in a small hash table of C keys, the same verdict as the set's; otherwise a
     * real set. */
    IntKey *keys;         /* keys[i] of hashes[i] when scanning, else NULL */
    unsigned char table[2 * SMALL]; /* with keys: open addressing over the admitted
                                     * positions, position + 1 per used cell, 0 = empty */
    PyObject *seen;       /* the set when not scanning */
    Py_ssize_t *admit;    /* positions of the admitted blocks, in order */
    Py_ssize_t admitted;
    PyObject *victims;    /* list, NULL until the first eviction */
    PyObject *gone;       /* set of the victims, NULL until the first eviction */
    PyObject *candidates; /* _victims_up_to's answer, NULL until needed */
    Py_ssize_t rejected_from;
} StoreWalk;

/* The cell of key k in w->table: where it is, or the empty cell where it would go. */
static unsigned char *seen_cell(StoreWalk *w, IntKey k)
{
    size_t mask = 2 * SMALL - 1, c = (size_t)((k.bits * 0x9E3779B97F4A7C15ULL) >> 57) & mask;
    for (;; c = (c + 1) & mask) { /* never full: at most SMALL of 2 * SMALL cells are used */
        unsigned char p = w->table[c];
        if (p == 0)
            return &w->table[c];
        IntKey o = w->keys[p - 1];
        if (o.bits == k.bits && o.negative == k.negative)
            return &w->table[c];
    }
}

/* `h in seen` for hashes[i]: 1, 0, -1 on error. */
static int walk_seen(StoreWalk *w, PyObject *hashes, Py_ssize_t i)
{
    if (w->keys == NULL)
        return PySequence_Contains(w->seen, PyTuple_GET_ITEM(hashes, i));
    return *seen_cell(w, w->keys[i]) != 0;
}

/* The walk: fills w (admitted positions, victims, rejected_from). 0 / -1. */
static int store_walk(StoreWalk *w, PyObject *state, PyObject *entries, PyObject *hashes)
{
    Py_ssize_t n = PyTuple_GET_SIZE(hashes);
    PyObject *free = attr(state, S_free_slots);
    if (free == NULL)
        return -1;
    Py_ssize_t free_avail = PyObject_Size(free);
    Py_DECREF(free);
    if (free_avail < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyTuple_GET_ITEM(hashes, i);
        int r = walk_seen(w, hashes, i);
        if (r == 0)
            r = stays_on_tier(entries, w->gone, h);
        if (r != 0) {
            if (r < 0)
                return -1;
            continue;
        }
        if (w->seen != NULL && PySet_Add(w->seen, h) < 0)
            return -1;
        if (free_avail) {
            free_avail--;
        } else {
            if (w->candidates == NULL) { /* each later block needs at most one victim */
                if ((w->candidates = victims_up_to(state, n - i)) == NULL)
                    return -1;
                if ((w->victims = PyList_New(0)) == NULL || (w->gone = PySet_New(NULL)) == NULL)
                    return -1;
            }
            Py_ssize_t num_candidates = PyObject_Size(w->candidates);
            if (num_candidates < 0)
                return -1;
            if (PyList_GET_SIZE(w->victims) == num_candidates) {
                w->rejected_from = i;
                return 0;
            }
            PyObject *victim = PySequence_GetItem(w->candidates, PyList_GET_SIZE(w->victims));
            if (victim == NULL)
                return -1;
            r = PyList_Append(w->victims, victim) < 0 || PySet_Add(w->gone, victim) < 0 ? -1 : 0;
            Py_DECREF(victim);
            if (r < 0)
                return -1;
        }
        if (w->keys != NULL) /* seen.add(h) */
            *seen_cell(w, w->keys[i]) = (unsigned char)(i + 1);
        w->admit[w->admitted++] = i;
    }
    return 0;
}

/* tuple(seq[p] for p in positions) */
static PyObject *tuple_at(PyObject *seq, const Py_ssize_t *positions, Py_ssize_t k)
{
    PyObject *out = PyTuple_New(k);
    if (out != NULL)
        for (Py_ssize_t j = 0; j < k; j++)
            PyTuple_SET_ITEM(out, j, Py_NewRef(PyTuple_GET_ITEM(seq, positions[j])));
    return out;
}

/* StoreRejected for every block from rejected_from on that is not admitted, not repeated,
 * and not on the tier (or evicted by this very command). 0 / -1. */
static int reject_rest(Decision *dc, PyObject *request_id, PyObject *hashes, PyObject *blocks,
                       PyObject *entries, StoreWalk *w)
{
    PyObject *taken = NULL, *rej_hashes = NULL, *rej_blocks = NULL, *capacity = NULL;
    PyObject *t_hashes = NULL, *t_blocks = NULL, *reason = NULL;
    int result = -1, r;
    if ((taken = PySet_New(NULL)) == NULL || (rej_hashes = PyList_New(0)) == NULL
        || (rej_blocks = PyList_New(0)) == NULL)
        goto done;
    for (Py_ssize_t j = 0; j < w->admitted; j++) /* taken = set(admit_hashes) */
        if (PySet_Add(taken, PyTuple_GET_ITEM(hashes, w->admit[j])) < 0)
            goto done;
    for (Py_ssize_t i = w->rejected_from; i < PyTuple_GET_SIZE(hashes); i++) {
        PyObject *h = PyTuple_GET_ITEM(hashes, i), *d = PyTuple_GET_ITEM(blocks, i);
        /* h not in taken and (h not in entries or h in gone) */
        if ((r = PySequence_Contains(taken, h)) != 0) {
            if (r < 0)
                goto done;
            continue;
        }
        if ((r = stays_on_tier(entries, w->gone, h)) != 0) {
            if (r < 0)
                goto done;
            continue;
        }
        if (PySet_Add(taken, h) < 0 || PyList_Append(rej_hashes, h) < 0
            || PyList_Append(rej_blocks, d) < 0)
            goto done;
    }
    if ((capacity = attr(dc->state, S_capacity)) == NULL
        || (t_hashes = PyList_AsTuple(rej_hashes)) == NULL
        || (t_blocks = PyList_AsTuple(rej_blocks)) == NULL
        || (reason = PyUnicode_FromFormat(
                "tier full: %S slots held by pinned or in-flight entries", capacity))
               == NULL)
        goto done;
    PyObject *values[] = {request_id, t_hashes, t_blocks, reason};
    result = emit(dc, StoreRejected_cls, KW_StoreRejected, values);
done:
    Py_XDECREF(taken);
    Py_XDECREF(rej_hashes);
    Py_XDECREF(rej_blocks);
    Py_XDECREF(capacity);
    Py_XDECREF(t_hashes);
    Py_XDECREF(t_blocks);
    Py_XDECREF(reason);
    return result;
}

/* DESIGN §7 step 3, block by block in prefix order: a block not on the tier (resident,
 * queued or in flight; F3) takes a free slot, else evicts the policy's next victim; if
 * nothing is evictable it and every later block are rejected. A victim may be a later block
 * of this very command: when its turn comes it is no longer on the tier, so it is stored
 * again. Evictions and admissions are emitted as one event each. */
static PyObject *decide_store(Decision *dc, PyObject *request_id, PyObject *hashes,
                              PyObject *blocks)
{
    PyObject *state = dc->state, *answer = NULL;
    PyObject *requests = NULL, *entries = NULL, *held = NULL, *same = NULL, *free = NULL;
    PyObject *job_id = NULL, *t_hashes = NULL, *t_blocks = NULL, *t_slots = NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(hashes), nd = PyTuple_GET_SIZE(blocks);
    Py_ssize_t admit_small[SMALL];
    IntKey keys_small[SMALL];
    StoreWalk w = {NULL, {0}, NULL, admit_small, 0, NULL, NULL, NULL, -1};
    int r, disjoint = 1;

    if ((r = state_dict(state, S_requests, &requests)) <= 0
        || (r = state_dict(state, S_slot_of, &entries)) <= 0
        || (r = state_dict(state, S_held, &held)) <= 0) {
        answer = r == 0 ? defer() : NULL;
        goto done;
    }
    if (n != nd) {
        PyErr_Format(Rejected_exc, "store: %zd hashes but %zd device blocks", n, nd);
        goto done;
    }
    if (request_id != Py_None) {
        PyObject *req = PyDict_GetItemWithError(requests, request_id);
        if (req == NULL && PyErr_Occurred())
            goto done;
        if (req != NULL) {
            Py_INCREF(req);
            r = attr_true(req, S_finished);
            Py_DECREF(req);
            if (r != 0) {
                if (r > 0)
                    PyErr_Format(Rejected_exc, "store: request %S is finished", request_id);
                goto done;
            }
        }
    }
    /* same = dict(zip(device_blocks, block_hashes)) if held and not
     * held.keys().isdisjoint(device_blocks) else {} */
    if (PyDict_GET_SIZE(held) && (disjoint = keys_disjoint(held, blocks)) < 0)
        goto done;
    if (!disjoint) {
        if ((same = PyDict_New()) == NULL)
            goto done;
        for (Py_ssize_t i = 0; i < nd; i++)
            if (PyDict_SetItem(same, PyTuple_GET_ITEM(blocks, i), PyTuple_GET_ITEM(hashes, i)) < 0)
                goto done;
    }
    if (check_device_blocks(state, blocks, same, disjoint) < 0)
        goto done;
    if ((r = offload_enabled(state)) <= 0) {
        if (r == 0)
            answer = Py_NewRef(Py_None);
        goto done;
    }

    /* the walk's working memory */
    if (n > SMALL && (w.admit = PyMem_New(Py_ssize_t, n)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (n <= SMALL) {
        Py_ssize_t i = 0;
        while (i < n && int_key(PyTuple_GET_ITEM(hashes, i), &keys_small[i]))
            i++;
        if (i == n)
            w.keys = keys_small;
    }
    if (w.keys == NULL && (w.seen = PySet_New(NULL)) == NULL)
        goto done;
    if (store_walk(&w, state, entries, hashes) < 0)
        goto done;

    if (w.victims != NULL && PyList_GET_SIZE(w.victims)) {
        if ((t_hashes = PyList_AsTuple(w.victims)) == NULL
            || (t_slots = tuple_of_items(entries, w.victims)) == NULL)
            goto done;
        PyObject *values[] = {t_hashes, t_slots, str_capacity};
        if (emit(dc, BlocksEvicted_cls, KW_BlocksEvicted, values) < 0)
            goto done;
        Py_CLEAR(t_hashes);
        Py_CLEAR(t_slots);
    }
    if (w.admitted) {
        if ((free = attr(state, S_free_slots)) == NULL
            || (job_id = next_job_id(state)) == NULL
            || (t_hashes = tuple_at(hashes, w.admit, w.admitted)) == NULL
            || (t_blocks = tuple_at(blocks, w.admit, w.admitted)) == NULL
            || (t_slots = last_free_reversed(free, w.admitted)) == NULL)
            goto done;
        PyObject *values[] = {job_id, request_id, t_hashes, t_blocks, t_slots};
        if (emit(dc, StoreQueued_cls, KW_StoreQueued, values) < 0)
            goto done;
    }
    if (w.rejected_from >= 0 && reject_rest(dc, request_id, hashes, blocks, entries, &w) < 0)
        goto done;
    answer = job_id != NULL ? Py_NewRef(job_id) : Py_NewRef(Py_None);
done:
    if (w.admit != admit_small)
        PyMem_Free(w.admit);
    Py_XDECREF(w.seen);
    Py_XDECREF(w.victims);
    Py_XDECREF(w.gone);
    Py_XDECREF(w.candidates);
    Py_XDECREF(requests);
    Py_XDECREF(entries);
    Py_XDECREF(held);
    Py_XDECREF(same);
    Py_XDECREF(free);
    Py_XDECREF(job_id);
    Py_XDECREF(t_hashes);
    Py_XDECREF(t_blocks);
    Py_XDECREF(t_slots);
    return answer;
}

/* state.config.store_mode != mode: 1, 0, -1 on error. */
static int store_mode_is_not(PyObject *state, PyObject *mode)
{
    PyObject *current = config_attr(state, S_store_mode);
    if (current == NULL)
        return -1;
    int r = PyObject_RichCompareBool(current, mode, Py_NE);
    Py_DECREF(current);
    return r;
}

/* --- decide_blocks_computed ----------------------------------------------------------------- */

static PyObject *decide_blocks_computed(Decision *dc, PyObject *cmd)
{
    PyObject *answer = NULL, *request_id = NULL, *hashes = NULL, *blocks = NULL, *same = NULL;
    PyObject *held = NULL;
    int r;
    if ((r = command_seq(cmd, S_block_hashes, &hashes)) <= 0
        || (r = command_seq(cmd, S_device_blocks, &blocks)) <= 0
        || (r = state_dict(dc->state, S_held, &held)) <= 0) {
        answer = r == 0 ? defer() : NULL;
        goto done;
    }
    if ((r = store_mode_is_not(dc->state, str_eager)) < 0)
        goto done;
    if (r) {
        /* _check_device_blocks(state, device_blocks, dict(zip(device_blocks, block_hashes))) */
        Py_ssize_t n = PyTuple_GET_SIZE(blocks);
        if (PyTuple_GET_SIZE(hashes) < n)
            n = PyTuple_GET_SIZE(hashes);
        if ((same = PyDict_New()) == NULL)
            goto done;
        for (Py_ssize_t i = 0; i < n; i++)
            if (PyDict_SetItem(same, PyTuple_GET_ITEM(blocks, i), PyTuple_GET_ITEM(hashes, i)) < 0)
                goto done;
        if (check_device_blocks(dc->state, blocks, same, -1) == 0)
            answer = Py_NewRef(Py_None);
        goto done;
    }
    if ((request_id = attr(cmd, S_request_id)) != NULL)
        answer = decide_store(dc, request_id, hashes, blocks);
done:
    Py_XDECREF(request_id);
    Py_XDECREF(hashes);
    Py_XDECREF(blocks);
    Py_XDECREF(same);
    Py_XDECREF(held);
    return answer;
}

/* --- decide_device_evicting ----------------------------------------------------------------- */

static PyObject *decide_device_evicting(Decision *dc, PyObject *cmd)
{
    PyObject *answer = NULL, *hashes = NULL, *blocks = NULL;
    int r;
    if ((r = command_seq(cmd, S_block_hashes, &hashes)) <= 0
        || (r = command_seq(cmd, S_device_blocks, &blocks)) <= 0) {
        answer = r == 0 ? defer() : NULL;
        goto done;
    }
    if ((r = store_mode_is_not(dc->state, str_lazy)) < 0)
        goto done;
    answer = r ? Py_NewRef(Py_None) : decide_store(dc, Py_None, hashes, blocks);
done:
    Py_XDECREF(hashes);
    Py_XDECREF(blocks);
    return answer;
}

/* --- decide_touch --------------------------------------------------------------------------- */

static PyObject *decide_touch(Decision *dc, PyObject *cmd)
{
    PyObject *answer = NULL, *hashes = NULL, *slot_of = NULL, *pending = NULL;
    PyObject *touched = NULL, *reuse = NULL;
    int r;
    if ((r = command_seq(cmd, S_block_hashes, &hashes)) <= 0
        || (r = state_dict(dc->state, S_slot_of, &slot_of)) <= 0
        || (r = state_dict(dc->state, S_pending, &pending)) <= 0) {
        answer = r == 0 ? defer() : NULL;
        goto done;
    }
    /* touched = tuple(h for h in cmd.block_hashes if h in slot_of and h not in pending) */
    if ((touched = PyList_New(0)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(hashes); i++) {
        PyObject *h = PyTuple_GET_ITEM(hashes, i);
        if ((r = is_resident(slot_of, pending, h)) > 0)
            r = PyList_Append(touched, h);
        if (r < 0)
            goto done;
    }
    Py_SETREF(touched, PyList_AsTuple(touched));
    if (touched == NULL)
        goto done;
    if (PyTuple_GET_SIZE(touched)) {
        if ((reuse = attr(cmd, S_reuse)) == NULL)
            goto done;
        PyObject *values[] = {touched, reuse};
        if (emit(dc, BlocksTouched_cls, KW_BlocksTouched, values) < 0)
            goto done;
    }
    answer = PyLong_FromSsize_t(PyTuple_GET_SIZE(touched));
done:
    Py_XDECREF(hashes);
    Py_XDECREF(slot_of);
    Py_XDECREF(pending);
    Py_XDECREF(touched);
    Py_XDECREF(reuse);
    return answer;
}

/* --- decide_plan_step (with _transfer_job) -------------------------------------------------- */

/* TransferJob(job_id=..., direction=..., device_blocks=..., slots=..., hashes=...,
 * request_id=...) from a live Job. */
static PyObject *transfer_job(PyObject *job)
{
    static PyObject **const names[] = {&S_job_id, &S_direction, &S_device_blocks,
                                        &S_slots,  &S_hashes,    &S_request_id};
    PyObject *values[6] = {NULL};
    PyObject *out = NULL;
    for (int i = 0; i < 6; i++)
        if ((values[i] = attr(job, *names[i])) == NULL)
            goto done;
    out = PyObject_Vectorcall(TransferJob_cls, values, 0, KW_TransferJob);
done:
    for (int i = 0; i < 6; i++)
        Py_XDECREF(values[i]);
    return out;
}

static PyObject *decide_plan_step(Decision *dc, PyObject *cmd)
{
    PyObject *state = dc->state, *answer = NULL;
    PyObject *queued = NULL, *jobs = NULL, *job_ids = NULL, *transfer = NULL, *now = NULL;
    PyObject *now_ms = NULL, *deadline = NULL, *sum = NULL, *deadline_ms = NULL;
    int r;
    if ((r = state_dict(state, S_queued, &queued)) <= 0
        || (r = state_dict(state, S_jobs, &jobs)) <= 0) {
        answer = r == 0 ? defer() : NULL;
        goto done;
    }
    if (PyDict_GET_SIZE(queued) == 0) {
        answer = PyList_New(0);
        goto done;
    }
    /* job_ids = tuple(state.queued); jobs = [_transfer_job(state.jobs[j]) for j in job_ids] */
    Py_ssize_t n = PyDict_GET_SIZE(queued), pos = 0, i = 0;
    PyObject *key, *value;
    if ((job_ids = PyTuple_New(n)) == NULL || (transfer = PyList_New(n)) == NULL)
        goto done;
    while (i < n && PyDict_Next(queued, &pos, &key, &value))
        PyTuple_SET_ITEM(job_ids, i++, Py_NewRef(key));
    for (i = 0; i < n; i++) {
        PyObject *job = dict_item(jobs, PyTuple_GET_ITEM(job_ids, i));
        PyObject *tj = job == NULL ? NULL : transfer_job(job);
        Py_XDECREF(job);
        if (tj == NULL)
            goto done;
        PyList_SET_ITEM(transfer, i, tj);
    }
    if ((now = attr(cmd, S_now_ms)) == NULL
        || (now_ms = PyNumber_Float(now)) == NULL
        || (deadline = config_attr(state, S_job_deadline_ms)) == NULL
        || (sum = PyNumber_Add(now, deadline)) == NULL
        || (deadline_ms = PyNumber_Float(sum)) == NULL)
        goto done;
    PyObject *values[] = {job_ids, now_ms, deadline_ms};
    if (emit(dc, JobsSubmitted_cls, KW_JobsSubmitted, values) < 0)
        goto done;
    answer = Py_NewRef(transfer);
done:
    Py_XDECREF(queued);
    Py_XDECREF(jobs);
    Py_XDECREF(job_ids);
    Py_XDECREF(transfer);
    Py_XDECREF(now);
    Py_XDECREF(now_ms);
    Py_XDECREF(deadline);
    Py_XDECREF(sum);
    Py_XDECREF(deadline_ms);
    return answer;
}

/* state.<name>.get(key): 1 with *out a new reference, 0 when absent, -1 on error. */
static int state_get(PyObject *state, PyObject *name, PyObject *key, PyObject **out)
{
    PyObject *mapping = attr(state, name), *value;
    *out = NULL;
    if (mapping == NULL)
        return -1;
    if (PyDict_Check(mapping)) {
        value = PyDict_GetItemWithError(mapping, key);
        Py_XINCREF(value);
    } else {
        value = PyObject_CallMethodOneArg(mapping, S_get, key);
    }
    Py_DECREF(mapping);
    if (value == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (value == Py_None) {
        Py_DECREF(value);
        return 0;
    }
    *out = value;
    return 1;
}

/* --- _maybe_close --------------------------------------------------------------------------- */

/* A finished request with no live jobs and no pins left is closed (RequestClosed). */
static int maybe_close(Decision *dc, PyObject *request_id)
{
    PyObject *req = NULL, *jobs = NULL;
    int result = -1, r;
    if (request_id == Py_None)
        return 0;
    if ((r = state_get(dc->state, S_requests, request_id, &req)) <= 0)
        return r;
    /* req.finished and not req.jobs and not req.holds_pins() */
    if ((r = attr_true(req, S_finished)) <= 0) {
        result = r;
        goto done;
    }
    if ((jobs = attr(req, S_jobs)) == NULL || (r = PyObject_IsTrue(jobs)) < 0)
        goto done;
    if (r) {
        result = 0;
        goto done;
    }
    if ((r = holds_pins(req)) < 0)
        goto done;
    if (r) {
        result = 0;
        goto done;
    }
    PyObject *values[] = {request_id};
    result = emit(dc, RequestClosed_cls, KW_RequestClosed, values);
done:
    Py_XDECREF(req);
    Py_XDECREF(jobs);
    return result;
}

/* --- decide_job_result ---------------------------------------------------------------------- */

/* a <op> b for two ids or counts: compared as C integers when both are exact ints that fit
 * in a long long (the same verdict), else through PyObject_RichCompareBool. 1, 0, -1. */
static int compare(PyObject *a, PyObject *b, int op)
{
    if (PyLong_CheckExact(a) && PyLong_CheckExact(b)) {
        int oa = 0, ob = 0;
        long long x = PyLong_AsLongLongAndOverflow(a, &oa);
        long long y = PyLong_AsLongLongAndOverflow(b, &ob);
        if (!oa && !ob) {
            switch (op) {
            case Py_LT: return x < y;
            case Py_LE: return x <= y;
            case Py_EQ: return x == y;
            case Py_NE: return x != y;
            case Py_GT: return x > y;
            case Py_GE: return x >= y;
            }
        }
    }
    return PyObject_RichCompareBool(a, b, op);
}

/* The checks decide_job_result and decide_job_results share, in their order:
 * `not _whole(res.job_id) or not 0 < res.job_id <= last` -> UnknownJob, then
 * `not _whole(res.rank) or not 0 <= res.rank < world` -> Rejected. 0 with new references
 * in *job_id_out and *rank_out when both pass; -1 with the exception set (and *_out NULL). */
static int check_result_ids(PyObject *res, PyObject *last, PyObject *world,
                            PyObject **job_id_out, PyObject **rank_out)
{
    PyObject *job_id = NULL, *rank = NULL;
    *job_id_out = *rank_out = NULL;
    if ((job_id = attr(res, S_job_id)) == NULL)
        return -1;
    int r = whole(job_id);
    if (r > 0 && (r = compare(int_zero, job_id, Py_LT)) > 0)
        r = compare(job_id, last, Py_LE);
    if (r == 0)
        PyErr_Format(UnknownJob_exc, "result for unknown job %R (last issued: %S)", job_id, last);
    if (r <= 0 || (rank = attr(res, S_rank)) == NULL) {
        Py_DECREF(job_id);
        return -1;
    }
    r = whole(rank);
    if (r > 0 && (r = compare(int_zero, rank, Py_LE)) > 0)
        r = compare(rank, world, Py_LT);
    if (r == 0)
        PyErr_Format(Rejected_exc, "result for job %S: rank %R outside world size %S", job_id,
                     rank, world);
    if (r <= 0) {
        Py_DECREF(job_id);
        Py_DECREF(rank);
        return -1;
    }
    *job_id_out = job_id;
    *rank_out = rank;
    return 0;
}

/* job.state is JobState.QUEUED: 1, 0, -1 on error. */
static int job_is_queued(PyObject *job)
{
    PyObject *st = attr(job, S_state);
    if (st == NULL)
        return -1;
    int r = st == QUEUED_state;
    Py_DECREF(st);
    return r;
}

/* LateResultIgnored(job_id=cmd.job_id, rank=cmd.rank, ok=cmd.ok, error=cmd.error) */
static int late_result(Decision *dc, PyObject *res, PyObject *job_id, PyObject *rank)
{
    PyObject *ok = attr(res, S_ok);
    PyObject *error = ok == NULL ? NULL : attr(res, S_error);
    int r = -1;
    if (error != NULL) {
        PyObject *values[] = {job_id, rank, ok, error};
        r = emit(dc, LateResultIgnored_cls, KW_LateResultIgnored, values);
    }
    Py_XDECREF(ok);
    Py_XDECREF(error);
    return r;
}

/* One executor outcome (decide_job_result): 0 / -1. */
static int job_result(Decision *dc, PyObject *res)
{
    PyObject *state = dc->state;
    PyObject *job_id = NULL, *rank = NULL, *last = NULL, *world = NULL, *job = NULL;
    PyObject *bit = NULL, *acks = NULL, *mask = NULL, *request_id = NULL, *ok = NULL;
    PyObject *error = NULL, *all = NULL, *full = NULL;
    /* _terminal_fields(job), in KW_JobFailed / KW_JobCompleted order after rank (, error) */
    static PyObject **const terminal_names[] = {NULL /* job.abandoned */, &S_job_id,
                                                 &S_direction, &S_request_id, &S_hashes,
                                                 &S_device_blocks, &S_slots};
    PyObject *terminal[7] = {NULL};
    int result = -1, r;

    if ((last = attr(state, S_last_job_id)) == NULL
        || (world = config_attr(state, S_world_size)) == NULL
        || check_result_ids(res, last, world, &job_id, &rank) < 0
        || (r = state_get(state, S_jobs, job_id, &job)) < 0)
        goto done;
    if (r == 0) { /* already terminal */
        result = late_result(dc, res, job_id, rank);
        goto done;
    }
    if ((r = job_is_queued(job)) != 0) {
        if (r > 0)
            PyErr_Format(Rejected_exc, "result for job %S, which was never submitted", job_id);
        goto done;
    }
    /* bit = 1 << rank; job.acks & bit. With an exact int world of at most 62 ranks (so
     * 0 <= rank < 62) and exact int acks that fit in a long long, the C bit operations give
     * what Python's give (two's complement, as Python's ints behave). */
    long long c_world = 0, c_rank = 0, c_acks = 0;
    int c_ints = 0;
    if ((acks = attr(job, S_acks)) == NULL)
        goto done;
    if (PyLong_CheckExact(world) && PyLong_CheckExact(rank) && PyLong_CheckExact(acks)) {
        int o1 = 0, o2 = 0, o3 = 0;
        c_world = PyLong_AsLongLongAndOverflow(world, &o1);
        c_rank = PyLong_AsLongLongAndOverflow(rank, &o2);
        c_acks = PyLong_AsLongLongAndOverflow(acks, &o3);
        c_ints = !o1 && !o2 && !o3 && c_world >= 1 && c_world <= 62 && c_rank >= 0
                 && c_rank < c_world;
    }
    if (c_ints) {
        r = (c_acks & (1LL << c_rank)) != 0;
    } else if ((bit = PyNumber_Lshift(int_one, rank)) == NULL
               || (mask = PyNumber_And(acks, bit)) == NULL || (r = PyObject_IsTrue(mask)) < 0) {
        goto done;
    }
    if (r) { /* this rank already reported success */
        result = late_result(dc, res, job_id, rank);
        goto done;
    }
    if ((terminal[0] = job_abandoned(job)) == NULL)
        goto done;
    for (int i = 1; i < 7; i++)
        if ((terminal[i] = attr(job, *terminal_names[i])) == NULL)
            goto done;
    /* request_id = None if job.abandoned else job.request_id */
    if ((r = PyObject_IsTrue(terminal[0])) < 0)
        goto done;
    request_id = Py_NewRef(r ? Py_None : terminal[3]);
    if ((ok = attr(res, S_ok)) == NULL || (r = PyObject_IsTrue(ok)) < 0)
        goto done;
    if (!r) {
        if ((error = attr(res, S_error)) == NULL || (r = PyObject_IsTrue(error)) < 0)
            goto done;
        PyObject *values[] = {rank, r ? error : str_unknown_error, terminal[0], terminal[1],
                              terminal[2], terminal[3], terminal[4], terminal[5], terminal[6]};
        if (emit(dc, JobFailed_cls, KW_JobFailed, values) < 0)
            goto done;
    } else {
        /* job.acks | bit == (1 << world_size) - 1 */
        if (c_ints) {
            r = (c_acks | (1LL << c_rank)) == (1LL << c_world) - 1;
        } else {
            PyObject *shifted = PyNumber_Lshift(int_one, world);
            full = shifted == NULL ? NULL : PyNumber_Subtract(shifted, int_one);
            Py_XDECREF(shifted);
            if (full == NULL || (all = PyNumber_Or(acks, bit)) == NULL
                || (r = PyObject_RichCompareBool(all, full, Py_EQ)) < 0)
                goto done;
        }
        if (r) {
            PyObject *values[] = {rank, terminal[0], terminal[1], terminal[2], terminal[3],
                                  terminal[4], terminal[5], terminal[6]};
            if (emit(dc, JobCompleted_cls, KW_JobCompleted, values) < 0)
                goto done;
        } else {
            PyObject *values[] = {terminal[1], rank};
            result = emit(dc, RankSucceeded_cls, KW_RankSucceeded, values);
            goto done;
        }
    }
    result = maybe_close(dc, request_id);
done:
    Py_XDECREF(job_id);
    Py_XDECREF(rank);
    Py_XDECREF(last);
    Py_XDECREF(world);
    Py_XDECREF(job);
    Py_XDECREF(bit);
    Py_XDECREF(acks);
    Py_XDECREF(mask);
    Py_XDECREF(request_id);
    Py_XDECREF(ok);
    Py_XDECREF(error);
    Py_XDECREF(all);
    Py_XDECREF(full);
    for (int i = 0; i < 7; i++)
        Py_XDECREF(terminal[i]);
    return result;
}

static PyObject *decide_job_result(Decision *dc, PyObject *cmd)
{
    return job_result(dc, cmd) < 0 ? NULL : Py_NewRef(Py_None);
}

/* --- decide_job_results --------------------------------------------------------------------- */

/* Many executor outcomes at once. All are checked before anything is applied, so a bad one
 * refuses the whole batch. */
static PyObject *decide_job_results(Decision *dc, PyObject *cmd)
{
    PyObject *state = dc->state, *answer = NULL;
    PyObject *results = NULL, *jobs = NULL, *last = NULL, *world = NULL;
    int r;
    if ((r = command_seq(cmd, S_results, &results)) <= 0
        || (r = state_dict(state, S_jobs, &jobs)) <= 0) {
        answer = r == 0 ? defer() : NULL;
        goto done;
    }
    if ((last = attr(state, S_last_job_id)) == NULL
        || (world = config_attr(state, S_world_size)) == NULL)
        goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(results);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *job_id, *rank, *job = NULL;
        r = check_result_ids(PyTuple_GET_ITEM(results, i), last, world, &job_id, &rank);
        if (r == 0 && (job = PyDict_GetItemWithError(jobs, job_id)) == NULL && PyErr_Occurred())
            r = -1;
        Py_XINCREF(job);
        if (r == 0 && job != NULL && (r = job_is_queued(job)) > 0) {
            PyErr_Format(Rejected_exc, "result for job %S, which was never submitted", job_id);
            r = -1;
        }
        Py_XDECREF(job_id);
        Py_XDECREF(rank);
        Py_XDECREF(job);
        if (r < 0)
            goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (job_result(dc, PyTuple_GET_ITEM(results, i)) < 0)
            goto done;
    answer = Py_NewRef(Py_None);
done:
    Py_XDECREF(results);
    Py_XDECREF(jobs);
    Py_XDECREF(last);
    Py_XDECREF(world);
    return answer;
}

/* --- decide_finish -------------------------------------------------------------------------- */

static PyObject *decide_finish(Decision *dc, PyObject *cmd)
{
    PyObject *state = dc->state, *answer = NULL;
    PyObject *requests = NULL, *request_id = NULL, *req = NULL, *preempted = NULL;
    int r;
    if ((r = state_dict(state, S_requests, &requests)) <= 0) {
        answer = r == 0 ? defer() : NULL;
        goto done;
    }
    if ((request_id = attr(cmd, S_request_id)) == NULL)
        goto done;
    req = PyDict_GetItemWithError(requests, request_id);
    if (req == NULL) {
        if (PyErr_Occurred() || (r = offload_enabled(state)) < 0)
            goto done;
        if (r)
            PyErr_Format(UnknownRequest_exc, "finish: unknown request %R", request_id);
        else
            answer = Py_NewRef(Py_None);
        goto done;
    }
    Py_INCREF(req);
    if ((r = attr_true(req, S_finished)) != 0) {
        if (r > 0)
            PyErr_Format(Rejected_exc, "finish: request %R is already finished", request_id);
        goto done;
    }
    if (release_offered(dc, req, request_id) < 0
        || (preempted = attr(cmd, S_preempted)) == NULL)
        goto done;
    PyObject *values[] = {request_id, preempted};
    if (emit(dc, RequestFinished_cls, KW_RequestFinished, values) < 0
        || maybe_close(dc, request_id) < 0)
        goto done;
    answer = Py_NewRef(Py_None);
done:
    Py_XDECREF(requests);
    Py_XDECREF(request_id);
    Py_XDECREF(req);
    Py_XDECREF(preempted);
    return answer;
}

/* --- kv_handle: dispatch (decide.py's DECIDERS) --------------------------------------------- */

typedef PyObject *(*Decider)(Decision *, PyObject *);

PyObject *kv_handle(PyObject *state, PyObject *command, int check)
{
    PyObject *kind = (PyObject *)Py_TYPE(command);
    Decider decider = NULL;
    if (kind == Lookup_cls)
        decider = decide_lookup;
    else if (kind == AcceptHits_cls)
        decider = decide_accept_hits;
    else if (kind == BlocksComputed_cls)
        decider = decide_blocks_computed;
    else if (kind == DeviceBlocksEvicting_cls)
        decider = decide_device_evicting;
    else if (kind == Touch_cls)
        decider = decide_touch;
    else if (kind == PlanStep_cls)
        decider = decide_plan_step;
    else if (kind == JobResult_cls)
        decider = decide_job_result;
    else if (kind == JobResults_cls)
        decider = decide_job_results;
    else if (kind == FinishRequest_cls)
        decider = decide_finish;
    /* Evict, Tick, ResetAll, anything else, or a State of another class: Python decides */
    if (decider == NULL || (PyObject *)Py_TYPE(state) != State_cls)
        Py_RETURN_NOTIMPLEMENTED;

    Decision dc = {state, PyList_New(0), check};
    if (dc.events == NULL)
        return NULL;
    PyObject *answer = decider(&dc, command), *result = NULL;
    if (answer == DEFER) {
        /* the decider declined before producing anything */
        assert(PyList_GET_SIZE(dc.events) == 0);
        result = answer;
    } else if (answer != NULL) {
        result = PyTuple_Pack(2, answer, dc.events);
        Py_DECREF(answer);
    }
    Py_DECREF(dc.events);
    return result;
}
