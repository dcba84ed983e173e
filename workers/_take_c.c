/* The learner's common case of SamplerPool.next(), compiled: hand the held slot back to its
 * worker, take up the slots workers handed back, hold the first ready one. What
 * RingDelivery.take_ready does in Python (_assign, _collect, _pop_ready) for a quick, unordered
 * pool, in one call: a learner that wakes cold from a train step pays about a microsecond for
 * each Python frame and object its path reaches, and this path is word loads and stores.
 *
 * An optional speed-up, built by setup.py where a C compiler is at hand; without it the Python
 * path runs, with the same effects (tests/test_take_compiled.py runs both). The learner's
 * records stay the Python objects RingDelivery owns (the book's dict of assigned slots and
 * deque of ready ones, the generations, the per-worker counts): this file only changes them as
 * the Python path would.
 *
 * Ordering (workers/staging.py): a worker stores a slot's data, then READY in its STATE word;
 * the learner loads STATE with acquire before it hands out views of the data. Handing a slot
 * back stores GENERATION and OWNER, then STATE with release, then a full fence before it reads
 * the owner's waiting word (the waker's half of the handshake): if it is set, the worker
 * sleeps or is about to, and wake(owner, slot, generation) wakes it. The words are
 * not held (no buffer export) while that Python callback runs.
 *
 * BatchCore is what workers.batch.Batch is made on: its fields and _invalidate() in C, so the
 * take can let go of the learner's batch and make the next one (the slot's cached views, as
 * Delivery.hold does for a plain batch) with no Python frame. batch.py has the same fields in
 * Python (BatchFields) for where this file was not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <time.h>

static PyObject *one; /* the int 1, for the per-worker counts */

/* -- BatchCore ------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *data, *indices, *lanes, *weights; /* the views (data: field -> view) */
    PyObject *release_fn, *to_fn;               /* release(batch), to(batch, device); or NULL */
    PyObject *epoch;                            /* NULL: None */
    Py_ssize_t slot;
    long long generation;
    char released, ends_epoch;
} BatchCore;

static int core_traverse(BatchCore *self, visitproc visit, void *arg) {
    Py_VISIT(self->data);
    Py_VISIT(self->indices);
    Py_VISIT(self->lanes);
    Py_VISIT(self->weights);
    Py_VISIT(self->release_fn);
    Py_VISIT(self->to_fn);
    Py_VISIT(self->epoch);
    return 0;
}

static int core_clear(BatchCore *self) {
    Py_CLEAR(self->data);
    Py_CLEAR(self->indices);
    Py_CLEAR(self->lanes);
    Py_CLEAR(self->weights);
    Py_CLEAR(self->release_fn);
    Py_CLEAR(self->to_fn);
    Py_CLEAR(self->epoch);
    return 0;
}

static void core_dealloc(BatchCore *self) {
    PyObject_GC_UnTrack(self);
    core_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Released: the views dropped too (a released batch must not keep the staging ring mapped),
 * what it held decref'd last (a view's dealloc may run Python). */
static int invalidate(BatchCore *self) {
    PyObject *empty = PyDict_New();
    if (!empty) return -1;
    PyObject *was[6] = {self->data, self->indices, self->lanes, self->weights, self->release_fn,
                        self->to_fn};
    self->data = empty;
    self->indices = self->lanes = self->weights = self->release_fn = self->to_fn = NULL;
    self->released = 1;
    for (int i = 0; i < 6; i++) Py_XDECREF(was[i]);
    return 0;
}

static PyObject *core_invalidate(BatchCore *self, PyObject *Py_UNUSED(ignored)) {
    if (invalidate(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef core_methods[] = {
    {"_invalidate", (PyCFunction)core_invalidate, METH_NOARGS,
     "Released: its views and release/to calls dropped."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef core_members[] = {
    {"_data", T_OBJECT, offsetof(BatchCore, data), 0, NULL},
    {"_indices", T_OBJECT, offsetof(BatchCore, indices), 0, NULL},
    {"_lanes", T_OBJECT, offsetof(BatchCore, lanes), 0, NULL},
    {"_weights", T_OBJECT, offsetof(BatchCore, weights), 0, NULL},
    {"_release_fn", T_OBJECT, offsetof(BatchCore, release_fn), 0, NULL},
    {"_to_fn", T_OBJECT, offsetof(BatchCore, to_fn), 0, NULL},
    {"_released", T_BOOL, offsetof(BatchCore, released), 0, NULL},
    {"slot", T_PYSSIZET, offsetof(BatchCore, slot), 0, "the staging slot it occupies"},
    {"generation", T_LONGLONG, offsetof(BatchCore, generation), 0, "the slot's generation"},
    {"epoch", T_OBJECT, offsetof(BatchCore, epoch), 0, "its epoch (sampler='epoch'), or None"},
    {"ends_epoch", T_BOOL, offsetof(BatchCore, ends_epoch), 0, "the last batch of its epoch"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject BatchCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "workers._take_c.BatchCore",
    .tp_basicsize = sizeof(BatchCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The fields of a Batch, and its _invalidate(), in C.",
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_methods = core_methods,
    .tp_members = core_members,
};

/* -- Taker ----------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_ssize_t n_slots, n_workers, n_words;
    Py_ssize_t *state_at, *generation_at, *owner_at, *waiter_at; /* word indices */
    Py_ssize_t batches_at, wait_at; /* the stats line's batches and wait words */
    int64_t assigned, ready, stale, held;                          /* STATE values */
    PyObject *book_assigned;   /* dict: slots out with a worker, in assignment order */
    PyObject *ready_append;    /* the book's ready deque: append and popleft */
    PyObject *ready_popleft;
    PyObject *ready_deque;
    PyObject *generations;     /* list: each slot's generation */
    PyObject *filled;          /* list: batches each worker handed back */
    PyObject *tickets;         /* iterator of generations */
    PyObject *wake;            /* wake(owner, slot, generation) */
    PyTypeObject *batch_type;  /* workers.batch.Batch (a BatchCore) */
    PyObject *batch_views;     /* dict: slot -> (fields, indices, lanes, weights), cached */
    PyObject *cache_views;     /* cache_views(slot): that tuple, cached */
    PyObject *release_fn;      /* each batch's release(batch) */
    PyObject *to_fn;           /* each batch's to(batch, device), or NULL */
    int made;                  /* __init__ done, not cleared */
} Taker;

static int word_indices(PyObject *seq, Py_ssize_t n, Py_ssize_t **out, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd word indices, expected %zd", what,
                     PySequence_Fast_GET_SIZE(fast), n);
        Py_DECREF(fast);
        return -1;
    }
    *out = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t));
    if (!*out) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t v = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        if (v < 0) {
            Py_DECREF(fast);
            PyErr_Format(PyExc_ValueError, "%s: a negative word index", what);
            return -1;
        }
        (*out)[i] = v;
    }
    Py_DECREF(fast);
    return 0;
}

/* (The records and calls refer back to the delivery that refers to this Taker: a cycle the
 * collector must see.) */
static int taker_traverse(Taker *self, visitproc visit, void *arg) {
    Py_VISIT(self->book_assigned);
    Py_VISIT(self->ready_append);
    Py_VISIT(self->ready_popleft);
    Py_VISIT(self->ready_deque);
    Py_VISIT(self->generations);
    Py_VISIT(self->filled);
    Py_VISIT(self->tickets);
    Py_VISIT(self->wake);
    Py_VISIT(self->batch_type);
    Py_VISIT(self->batch_views);
    Py_VISIT(self->cache_views);
    Py_VISIT(self->release_fn);
    Py_VISIT(self->to_fn);
    return 0;
}

/* (book_assigned stays: it says the Taker was made, see taker_init) */
static int taker_clear(Taker *self) {
    self->made = 0;
    Py_CLEAR(self->ready_append);
    Py_CLEAR(self->ready_popleft);
    Py_CLEAR(self->ready_deque);
    Py_CLEAR(self->generations);
    Py_CLEAR(self->filled);
    Py_CLEAR(self->tickets);
    Py_CLEAR(self->wake);
    Py_CLEAR(self->batch_type);
    Py_CLEAR(self->batch_views);
    Py_CLEAR(self->cache_views);
    Py_CLEAR(self->release_fn);
    Py_CLEAR(self->to_fn);
    return 0;
}

static void taker_dealloc(Taker *self) {
    PyObject_GC_UnTrack(self);
    PyMem_Free(self->state_at);
    PyMem_Free(self->generation_at);
    PyMem_Free(self->owner_at);
    PyMem_Free(self->waiter_at);
    taker_clear(self);
    Py_CLEAR(self->book_assigned);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Taker(state_at, generation_at, owner_at, waiter_at, stats_at, states, assigned, ready,
 *       generations, filled, tickets, wake, batch_type, batch_views, cache_views, release_fn,
 *       to_fn): the word indices of each slot's STATE, GENERATION and OWNER, of each waiting
 * word (the learner's first, then each worker's) and of the stats line's batches and wait
 * words (PoolStats.batch_delivered); states = (ASSIGNED, READY, STALE, HELD); the book's dict
 * of assigned slots and deque of ready ones, the list of generations (one per slot), of
 * per-worker counts, the iterator of generations and the wake-up call; what Delivery.hold
 * makes a plain batch of: the Batch class, the dict of each slot's cached views and the call
 * that caches them, each batch's release and to (or None) calls. */
static int taker_init(Taker *self, PyObject *args, PyObject *kwds) {
    PyObject *state_at, *generation_at, *owner_at, *waiter_at, *assigned_o, *ready, *gens,
        *filled, *tickets, *wake, *batch_type, *batch_views, *cache_views, *release_fn, *to_fn;
    long long assigned, ready_state, stale, held;
    static char *kw[] = {"state_at", "generation_at", "owner_at", "waiter_at", "stats_at", "states",
                         "assigned", "ready", "generations", "filled", "tickets", "wake",
                         "batch_type", "batch_views", "cache_views", "release_fn", "to_fn", NULL};
    if (self->book_assigned) { /* (set first: a second __init__ would leak or mix records) */
        PyErr_SetString(PyExc_TypeError, "a Taker is made once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO(nn)(LLLL)O!OO!O!OOO!O!OOO", kw, &state_at,
                                     &generation_at, &owner_at, &waiter_at, &self->batches_at,
                                     &self->wait_at, &assigned, &ready_state, &stale, &held,
                                     &PyDict_Type, &assigned_o, &ready, &PyList_Type, &gens,
                                     &PyList_Type, &filled, &tickets, &wake, &PyType_Type,
                                     &batch_type, &PyDict_Type, &batch_views, &cache_views,
                                     &release_fn, &to_fn))
        return -1;
    if (!PyType_IsSubtype((PyTypeObject *)batch_type, &BatchCoreType)) {
        PyErr_SetString(PyExc_TypeError, "batch_type: a subclass of BatchCore");
        return -1;
    }
    /* (references taken only once every argument parsed: dealloc drops what is set) */
    self->book_assigned = Py_NewRef(assigned_o);
    self->generations = Py_NewRef(gens);
    self->filled = Py_NewRef(filled);
    self->tickets = Py_NewRef(tickets);
    self->wake = Py_NewRef(wake);
    self->batch_type = (PyTypeObject *)Py_NewRef(batch_type);
    self->batch_views = Py_NewRef(batch_views);
    self->cache_views = Py_NewRef(cache_views);
    self->release_fn = Py_NewRef(release_fn);
    self->to_fn = to_fn == Py_None ? NULL : Py_NewRef(to_fn);
    self->n_slots = PyObject_Length(state_at);
    self->n_workers = PyList_GET_SIZE(self->filled);
    if (self->n_slots < 0) return -1;
    if (self->n_workers < 1 || PyList_GET_SIZE(self->generations) != self->n_slots) {
        PyErr_SetString(PyExc_ValueError, "filled: one count per worker (at least one); "
                                          "generations: one per slot");
        return -1;
    }
    if (word_indices(state_at, self->n_slots, &self->state_at, "state_at") < 0 ||
        word_indices(generation_at, self->n_slots, &self->generation_at, "generation_at") < 0 ||
        word_indices(owner_at, self->n_slots, &self->owner_at, "owner_at") < 0 ||
        word_indices(waiter_at, 1 + self->n_workers, &self->waiter_at, "waiter_at") < 0)
        return -1;
    Py_ssize_t top = 0;
    for (Py_ssize_t i = 0; i < self->n_slots; i++) {
        Py_ssize_t m = self->state_at[i];
        if (self->generation_at[i] > m) m = self->generation_at[i];
        if (self->owner_at[i] > m) m = self->owner_at[i];
        if (m > top) top = m;
    }
    for (Py_ssize_t i = 0; i <= self->n_workers; i++)
        if (self->waiter_at[i] > top) top = self->waiter_at[i];
    if (self->batches_at < 0 || self->wait_at < 0) {
        PyErr_SetString(PyExc_ValueError, "stats_at: a negative word index");
        return -1;
    }
    if (self->batches_at > top) top = self->batches_at;
    if (self->wait_at > top) top = self->wait_at;
    self->n_words = top + 1;
    self->assigned = assigned;
    self->ready = ready_state;
    self->stale = stale;
    self->held = held;
    self->ready_deque = Py_NewRef(ready);
    self->ready_append = PyObject_GetAttrString(ready, "append");
    self->ready_popleft = PyObject_GetAttrString(ready, "popleft");
    if (!self->ready_append || !self->ready_popleft) return -1;
    self->made = 1;
    return 0;
}

/* Hand ``slot`` to its worker: what RingDelivery._assign does for a pool whose workers draw
 * their own rows (a new generation, the book's record, STATE last). 1 if the worker sleeps, or
 * is about to, and needs wake(*owner, slot, *generation); 0 if not; -1 on an error. */
static int hand_out(Taker *self, int64_t *words, Py_ssize_t slot, Py_ssize_t *owner,
                    long long *generation) {
    PyObject *ticket = PyIter_Next(self->tickets);
    if (!ticket) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "tickets ran out");
        return -1;
    }
    *generation = PyLong_AsLongLong(ticket);
    if ((*generation == -1 && PyErr_Occurred()) ||
        PyList_SetItem(self->generations, slot, ticket) < 0) /* (steals the reference) */
        return -1;
    PyObject *key = PyLong_FromSsize_t(slot);
    if (!key) return -1;
    int bad = PyDict_SetItem(self->book_assigned, key, Py_None);
    Py_DECREF(key);
    if (bad < 0) return -1;
    *owner = slot % self->n_workers;
    __atomic_store_n(&words[self->generation_at[slot]], (int64_t)*generation, __ATOMIC_RELAXED);
    __atomic_store_n(&words[self->owner_at[slot]], (int64_t)*owner, __ATOMIC_RELAXED);
    __atomic_store_n(&words[self->state_at[slot]], self->assigned, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return __atomic_load_n(&words[self->waiter_at[1 + *owner]], __ATOMIC_RELAXED) != 0;
}

/* The control words of ``words_o``, checked: a writable buffer of int64 holding every word
 * index this Taker was made with (a released memoryview raises ValueError). */
static int64_t *acquire(Taker *self, PyObject *words_o, Py_buffer *view) {
    if (PyObject_GetBuffer(words_o, view, PyBUF_WRITABLE) < 0) return NULL;
    if (view->len < self->n_words * (Py_ssize_t)sizeof(int64_t) ||
        ((uintptr_t)view->buf % sizeof(int64_t))) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "words: too short, or not aligned to 8 bytes");
        return NULL;
    }
    return view->buf;
}

/* What RingDelivery._collect does for a pool whose workers draw their own rows: the assigned
 * slots whose STATE says READY or STALE, in assignment order, out of ``assigned`` and onto
 * the ready deque, each counted for its worker. */
static int take_up(Taker *self, int64_t *words) {
    PyObject *back[256];
    PyObject **keys = back;
    Py_ssize_t n = PyDict_GET_SIZE(self->book_assigned), count = 0, pos = 0;
    if (n > 256 && !(keys = PyMem_Malloc(n * sizeof(PyObject *)))) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *key, *value;
    int status = 0;
    while (PyDict_Next(self->book_assigned, &pos, &key, &value)) {
        Py_ssize_t slot = PyLong_AsSsize_t(key);
        if (slot < 0 || slot >= self->n_slots) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "a slot out of range");
            status = -1;
            break;
        }
        int64_t state = __atomic_load_n(&words[self->state_at[slot]], __ATOMIC_ACQUIRE);
        if (state == self->ready || state == self->stale) keys[count++] = Py_NewRef(key);
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *slot_o = keys[i];
        if (status == 0) {
            Py_ssize_t slot = PyLong_AsSsize_t(slot_o), w = slot % self->n_workers;
            /* (checked access: the lists are Python's, and could have been shortened) */
            PyObject *r = NULL, *was = PyList_GetItem(self->filled, w), *now = NULL;
            if (!was || PyDict_DelItem(self->book_assigned, slot_o) < 0 ||
                !(r = PyObject_CallOneArg(self->ready_append, slot_o)) ||
                !(now = PyNumber_Add(was, one)) || PyList_SetItem(self->filled, w, now) < 0)
                status = -1;
            Py_XDECREF(r);
        }
        Py_DECREF(slot_o);
    }
    if (keys != back) PyMem_Free(keys);
    return status;
}

/* The learner's batch of ``slot``: what Delivery.hold makes of a plain one (its cached views,
 * the release and to calls, the slot and its generation), with no __init__ to run. */
static PyObject *make_batch(Taker *self, Py_ssize_t slot) {
    PyObject *key = PyLong_FromSsize_t(slot);
    if (!key) return NULL;
    PyObject *views = PyDict_GetItemWithError(self->batch_views, key);
    if (views)
        Py_INCREF(views);
    else if (!PyErr_Occurred())
        views = PyObject_CallOneArg(self->cache_views, key);
    Py_DECREF(key);
    if (!views) return NULL;
    if (!PyTuple_Check(views) || PyTuple_GET_SIZE(views) != 4) {
        Py_DECREF(views);
        PyErr_SetString(PyExc_TypeError, "a slot's views: (fields, indices, lanes, weights)");
        return NULL;
    }
    PyObject *generation_o = PyList_GetItem(self->generations, slot);
    long long generation = generation_o ? PyLong_AsLongLong(generation_o) : -1;
    BatchCore *b = NULL;
    if (!(generation == -1 && PyErr_Occurred()))
        b = (BatchCore *)self->batch_type->tp_alloc(self->batch_type, 0);
    if (b) {
        b->data = Py_NewRef(PyTuple_GET_ITEM(views, 0));
        b->indices = Py_NewRef(PyTuple_GET_ITEM(views, 1));
        b->lanes = Py_NewRef(PyTuple_GET_ITEM(views, 2));
        b->weights = Py_NewRef(PyTuple_GET_ITEM(views, 3));
        b->release_fn = Py_NewRef(self->release_fn);
        b->to_fn = Py_XNewRef(self->to_fn);
        b->slot = slot;
        b->generation = generation;
    }
    Py_DECREF(views);
    return (PyObject *)b;
}

/* take(words, held, t0) -> Batch | None: ``held`` (the learner's batch, or None) released and
 * its slot back to its worker (unless it was released before: a take that raised after the
 * release leaves the delivery's held batch released, and its slot is not handed out twice), the slots workers handed back taken up, and the first ready
 * slot marked HELD, counted in the stats line as a batch delivered after waiting since ``t0``
 * (time.perf_counter_ns: CLOCK_MONOTONIC) and returned as a batch (None if none is ready).
 * ``words``: the staging ring's control words (a writable buffer of int64); a released one
 * raises ValueError, as the Python path does. */
static PyObject *taker_take(Taker *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "take(words, held, t0)");
        return NULL;
    }
    if (!self->made) {
        PyErr_SetString(PyExc_ValueError, "a Taker not made (or cleared)");
        return NULL;
    }
    long long t0 = PyLong_AsLongLong(args[2]);
    if (t0 == -1 && PyErr_Occurred()) return NULL;
    PyObject *held = args[1];
    Py_ssize_t release = -1;
    if (held != Py_None) {
        if (!PyObject_TypeCheck(held, &BatchCoreType)) {
            PyErr_SetString(PyExc_TypeError, "held: a Batch or None");
            return NULL;
        }
        BatchCore *batch = (BatchCore *)held;
        if (batch->slot < 0 || batch->slot >= self->n_slots) {
            PyErr_Format(PyExc_IndexError, "held: slot %zd of %zd", batch->slot, self->n_slots);
            return NULL;
        }
        if (!batch->released) { /* (one let go of already had its slot handed out then) */
            if (invalidate(batch) < 0) return NULL;
            release = batch->slot;
        }
    }
    Py_buffer view;
    int64_t *words = acquire(self, args[0], &view);
    if (!words) return NULL;
    PyObject *result = NULL;
    if (release >= 0) {
        Py_ssize_t owner;
        long long generation;
        int wake = hand_out(self, words, release, &owner, &generation);
        if (wake < 0) goto done;
        if (wake) {
            /* Not holding the words while Python runs: a close() in another thread (the
             * callback's send lets it run) must be able to release them. */
            PyBuffer_Release(&view);
            PyObject *r = PyObject_CallFunction(self->wake, "nnL", owner, release, generation);
            if (!r) return NULL;
            Py_DECREF(r);
            if (!(words = acquire(self, args[0], &view))) return NULL;
        }
    }
    if (take_up(self, words) < 0) goto done;
    Py_ssize_t n_ready = PyObject_Length(self->ready_deque);
    if (n_ready <= 0) {
        if (n_ready == 0) result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *slot_o = PyObject_CallNoArgs(self->ready_popleft);
    if (!slot_o) goto done;
    Py_ssize_t slot = PyLong_AsSsize_t(slot_o);
    Py_DECREF(slot_o);
    if (slot < 0 || slot >= self->n_slots) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "a ready slot out of range");
        goto done;
    }
    __atomic_store_n(&words[self->state_at[slot]], self->held, __ATOMIC_RELAXED);
    if (!(result = make_batch(self, slot))) goto done;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    int64_t waited = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec - t0;
    words[self->batches_at] += 1; /* (only the learner stores them) */
    words[self->wait_at] += waited;
done:
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef taker_methods[] = {
    {"take", (PyCFunction)(void (*)(void))taker_take, METH_FASTCALL,
     "take(words, held, t0): held (unless None or released) released and handed back, "
     "handed-back slots "
     "taken up, the first ready slot HELD, counted and returned as a batch (None if none)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TakerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "workers._take_c.Taker",
    .tp_basicsize = sizeof(Taker),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The learner's common case of SamplerPool.next() for a quick, unordered pool.",
    .tp_traverse = (traverseproc)taker_traverse,
    .tp_clear = (inquiry)taker_clear,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)taker_init,
    .tp_dealloc = (destructor)taker_dealloc,
    .tp_methods = taker_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_take_c",
                                    "The learner's common case of next(), compiled (optional).",
                                    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__take_c(void) {
    if (PyType_Ready(&BatchCoreType) < 0 || PyType_Ready(&TakerType) < 0) return NULL;
    one = PyLong_FromLong(1);
    if (!one) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Taker", (PyObject *)&TakerType) < 0 ||
        PyModule_AddObjectRef(m, "BatchCore", (PyObject *)&BatchCoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
