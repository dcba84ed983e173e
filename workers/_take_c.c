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
 * sleeps or is about to, and wake(owner, slot, generation) sends it a message. The words are
 * not held (no buffer export) while that Python callback runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>

static PyObject *one; /* the int 1, for the per-worker counts */

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

static void taker_dealloc(Taker *self) {
    PyMem_Free(self->state_at);
    PyMem_Free(self->generation_at);
    PyMem_Free(self->owner_at);
    PyMem_Free(self->waiter_at);
    Py_XDECREF(self->book_assigned);
    Py_XDECREF(self->ready_append);
    Py_XDECREF(self->ready_popleft);
    Py_XDECREF(self->ready_deque);
    Py_XDECREF(self->generations);
    Py_XDECREF(self->filled);
    Py_XDECREF(self->tickets);
    Py_XDECREF(self->wake);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Taker(state_at, generation_at, owner_at, waiter_at, stats_at, states, assigned, ready,
 *       generations, filled, tickets, wake): the word indices of each slot's STATE, GENERATION
 * and OWNER, of each waiting word (the learner's first, then each worker's) and of the stats
 * line's batches and wait words (PoolStats.batch_delivered); states = (ASSIGNED, READY,
 * STALE, HELD); the book's dict of assigned slots and deque of ready ones, the list of
 * generations (one per slot), of per-worker counts, the iterator of generations and the
 * wake-up call. */
static int taker_init(Taker *self, PyObject *args, PyObject *kwds) {
    PyObject *state_at, *generation_at, *owner_at, *waiter_at, *assigned_o, *ready, *gens,
        *filled, *tickets, *wake;
    long long assigned, ready_state, stale, held;
    static char *kw[] = {"state_at", "generation_at", "owner_at", "waiter_at", "stats_at", "states",
                         "assigned", "ready", "generations", "filled", "tickets", "wake", NULL};
    if (self->book_assigned) { /* (set first: a second __init__ would leak or mix records) */
        PyErr_SetString(PyExc_TypeError, "a Taker is made once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO(nn)(LLLL)O!OO!O!OO", kw, &state_at,
                                     &generation_at, &owner_at, &waiter_at, &self->batches_at,
                                     &self->wait_at, &assigned, &ready_state, &stale, &held,
                                     &PyDict_Type, &assigned_o, &ready, &PyList_Type, &gens,
                                     &PyList_Type, &filled, &tickets, &wake))
        return -1;
    /* (references taken only once every argument parsed: dealloc drops what is set) */
    self->book_assigned = Py_NewRef(assigned_o);
    self->generations = Py_NewRef(gens);
    self->filled = Py_NewRef(filled);
    self->tickets = Py_NewRef(tickets);
    self->wake = Py_NewRef(wake);
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
            PyObject *r = NULL, *was = PyList_GET_ITEM(self->filled, w), *now = NULL;
            if (PyDict_DelItem(self->book_assigned, slot_o) < 0 ||
                !(r = PyObject_CallOneArg(self->ready_append, slot_o)) ||
                !(now = PyNumber_Add(was, one)))
                status = -1;
            else
                PyList_SetItem(self->filled, w, now);
            Py_XDECREF(r);
        }
        Py_DECREF(slot_o);
    }
    if (keys != back) PyMem_Free(keys);
    return status;
}

/* take(words, release, t0) -> int | None: ``release`` (the slot of the batch the learner let
 * go, or -1) back to its worker, the slots workers handed back taken up, and the first ready
 * slot marked HELD and returned (None if none is ready), counted in the stats line as a batch
 * delivered after waiting since ``t0`` (time.perf_counter_ns: CLOCK_MONOTONIC). ``words``: the staging ring's control words
 * (a writable buffer of int64); a released one raises ValueError, as the Python path does. */
static PyObject *taker_take(Taker *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "take(words, release, t0)");
        return NULL;
    }
    long long t0 = PyLong_AsLongLong(args[2]);
    if (t0 == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t release = PyLong_AsSsize_t(args[1]);
    if (release == -1 && PyErr_Occurred()) return NULL;
    if (release < -1 || release >= self->n_slots) {
        PyErr_Format(PyExc_IndexError, "release: slot %zd of %zd", release, self->n_slots);
        return NULL;
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
    result = PyObject_CallNoArgs(self->ready_popleft);
    if (!result) goto done;
    Py_ssize_t slot = PyLong_AsSsize_t(result);
    if (slot < 0 || slot >= self->n_slots) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "a ready slot out of range");
        Py_CLEAR(result);
        goto done;
    }
    __atomic_store_n(&words[self->state_at[slot]], self->held, __ATOMIC_RELAXED);
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
     "take(words, release, t0): release (or -1) handed back, handed-back slots taken up, the "
     "first ready slot HELD, counted and returned (None if none)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TakerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "workers._take_c.Taker",
    .tp_basicsize = sizeof(Taker),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The learner's common case of SamplerPool.next() for a quick, unordered pool.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)taker_init,
    .tp_dealloc = (destructor)taker_dealloc,
    .tp_methods = taker_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_take_c",
                                    "The learner's common case of next(), compiled (optional).",
                                    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__take_c(void) {
    if (PyType_Ready(&TakerType) < 0) return NULL;
    one = PyLong_FromLong(1);
    if (!one) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Taker", (PyObject *)&TakerType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
