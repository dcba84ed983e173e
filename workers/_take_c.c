/* The learner's common case of SamplerPool.next(), compiled: LearnerRing.take
 * (workers/learner_ring.py) in one call. Hand the held slot back to its worker, take up the
 * slots workers handed back, hold the next one and make its batch: a learner that wakes cold
 * from a train step pays about a microsecond for each Python frame and object its path
 * reaches, and this path is word loads and stores.
 *
 * An optional speed-up, built by setup.py where a C compiler is at hand; without it (or with
 * SHMBUF_TAKE=python) LearnerRing._take runs, with the same effects
 * (tests/test_take_compiled.py drives both through one script). It works on the learner's own
 * records, LearnerRing.records (an int64 array laid out as learner_ring.py says), and the
 * ring's words; it is given nothing else but each slot's batch template and the wake-up call.
 *
 * Ordering (workers/staging.py): a worker stores a slot's data, then READY in its STATE word;
 * the learner loads STATE with acquire before it hands out views of the data. Handing a slot
 * back stores GENERATION and OWNER, then STATE with release, then a full fence before it reads
 * the worker's waiting word (the waker's half of the handshake): if it is set, the worker
 * sleeps or is about to, and wake(worker) wakes it. The words are not held (no buffer
 * export) while that Python callback runs.
 *
 * BatchCore is what workers.batch.Batch is made on: its fields and _invalidate() in C, so the
 * take can let go of the learner's batch and make the next one with no Python frame. batch.py
 * has the same fields in Python (BatchFields) for where this file was not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

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

/* The records' header fields and the slots' statuses, in the order of workers/learner_ring.py
 * (RECORD_FIELDS, STATUSES): this module exports both, and the learner makes a Taker only
 * where they are its own. */
enum {
    R_N_SLOTS, R_N_WORKERS, R_ORDERED, R_TICKET, R_ASSIGNED, R_READY, R_STALE, R_HELD,
    R_BATCHES_AT, R_WAIT_AT, R_STATE_AT, R_OWNER_AT, R_GENERATION_AT, R_STATUS, R_PLACE,
    R_WAITER_AT, R_FILLED, R_HEADER
};
static const char *const record_fields[R_HEADER] = {
    "n_slots", "n_workers", "ordered", "ticket", "assigned", "ready", "stale", "held",
    "batches_at", "wait_at", "state_at", "owner_at", "generation_at", "status", "place",
    "waiter_at", "filled"};
enum { WITH_LEARNER, OUT, BACK, BACK_STALE, N_STATUSES };
static const char *const statuses[N_STATUSES] = {"with_learner", "out", "back", "back_stale"};

typedef struct {
    PyObject_HEAD
    PyObject *words;     /* the ring's control words: a buffer acquired for each take only */
    Py_buffer records;   /* LearnerRing.records, held for the Taker's life (records.obj set) */
    PyObject *templates; /* list: each slot's batch as the delivery made it once (emptied
                          * when the learner lets go of the ring: the views go with it) */
    PyObject *wake;      /* wake(worker) */
    Py_ssize_t n_slots, n_workers, n_words;
    int ordered, inited;
    int64_t assigned, ready, stale, held; /* STATE values */
    Py_ssize_t batches_at, wait_at;       /* word indices of the stats line's words */
    Py_ssize_t *state_at, *owner_at, *generation_at, *waiter_at; /* own copies, checked */
    int64_t *ticket, *status, *place, *filled;                   /* in the records */
} Taker;

/* (The templates' release calls refer back to the delivery that refers to this Taker: a
 * cycle the collector must see.) */
static int taker_traverse(Taker *self, visitproc visit, void *arg) {
    Py_VISIT(self->words);
    Py_VISIT(self->templates);
    Py_VISIT(self->wake);
    Py_VISIT(self->records.obj);
    return 0;
}

static int taker_clear(Taker *self) {
    Py_CLEAR(self->words);
    Py_CLEAR(self->templates);
    Py_CLEAR(self->wake);
    if (self->records.obj) PyBuffer_Release(&self->records);
    self->ticket = self->status = self->place = self->filled = NULL;
    return 0;
}

static void taker_dealloc(Taker *self) {
    PyObject_GC_UnTrack(self);
    taker_clear(self);
    PyMem_Free(self->state_at);
    PyMem_Free(self->owner_at);
    PyMem_Free(self->generation_at);
    PyMem_Free(self->waiter_at);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Records column ``field`` of ``n`` words: a pointer to it, or NULL (ValueError) if it does
 * not lie within the records after the header. */
static int64_t *column(int64_t *rec, Py_ssize_t total, int field, Py_ssize_t n) {
    int64_t at = rec[field];
    if (at < R_HEADER || at > total || n > total - at) {
        PyErr_Format(PyExc_ValueError, "records: column %s (at %lld, %zd words) outside the "
                     "%zd records", record_fields[field], (long long)at, n, total);
        return NULL;
    }
    return rec + at;
}

/* An own copy of records column ``field`` (word indices): all of them >= 0, the largest kept
 * in ``*top``. */
static Py_ssize_t *word_indices(int64_t *rec, Py_ssize_t total, int field, Py_ssize_t n,
                                Py_ssize_t *top) {
    int64_t *col = column(rec, total, field, n);
    if (!col) return NULL;
    Py_ssize_t *out = PyMem_Calloc(n, sizeof(Py_ssize_t));
    if (!out) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (col[i] < 0 || col[i] >= PY_SSIZE_T_MAX / 8) {
            PyMem_Free(out);
            PyErr_Format(PyExc_ValueError, "records: %s holds a bad word index",
                         record_fields[field]);
            return NULL;
        }
        out[i] = (Py_ssize_t)col[i];
        if (out[i] > *top) *top = out[i];
    }
    return out;
}

/* Taker(words, records, templates, wake): ``words`` the staging ring's int64 control words (a
 * writable buffer; a released one makes take raise ValueError), ``records`` the learner's
 * records (LearnerRing.records: contiguous int64, laid out as workers/learner_ring.py says),
 * ``templates`` a list of each slot's batch (a BatchCore subclass: its views and release and
 * to calls; the learner empties it when it lets go of the ring),
 * ``wake(worker)`` the wake-up of a worker that sleeps. The word indices are copied and
 * checked here; the ticket, statuses, places and counts stay in the records. */
static int taker_init(Taker *self, PyObject *args, PyObject *kwds) {
    PyObject *words, *records, *templates, *wake;
    static char *kw[] = {"words", "records", "templates", "wake", NULL};
    if (self->inited) { /* (a second __init__ would leak or mix records) */
        PyErr_SetString(PyExc_TypeError, "a Taker is made once");
        return -1;
    }
    self->inited = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!O", kw, &words, &records, &PyList_Type,
                                     &templates, &wake))
        return -1;
    if (PyObject_GetBuffer(records, &self->records,
                           PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    const char *fmt = self->records.format ? self->records.format : "B";
    while (*fmt == '<' || *fmt == '=' || *fmt == '@') fmt++;
    if (self->records.itemsize != 8 || (strcmp(fmt, "l") && strcmp(fmt, "q"))) {
        PyErr_SetString(PyExc_TypeError, "records: a contiguous int64 array");
        return -1;
    }
    int64_t *rec = self->records.buf;
    Py_ssize_t total = self->records.len / 8;
    if (total < R_HEADER) {
        PyErr_SetString(PyExc_ValueError, "records: shorter than their header");
        return -1;
    }
    Py_ssize_t n = (Py_ssize_t)rec[R_N_SLOTS], w = (Py_ssize_t)rec[R_N_WORKERS];
    if (rec[R_N_SLOTS] < 1 || rec[R_N_WORKERS] < 1 || rec[R_N_SLOTS] > total ||
        rec[R_N_WORKERS] > total || (rec[R_ORDERED] & ~1)) {
        PyErr_SetString(PyExc_ValueError, "records: bad slot or worker count, or ordered");
        return -1;
    }
    if (PyList_GET_SIZE(templates) != n) {
        PyErr_Format(PyExc_ValueError, "templates: %zd, one per slot (%zd)",
                     PyList_GET_SIZE(templates), n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyObject_TypeCheck(PyList_GET_ITEM(templates, i), &BatchCoreType)) {
            PyErr_SetString(PyExc_TypeError, "templates: each a Batch (a BatchCore)");
            return -1;
        }
    Py_ssize_t top = 0;
    if (!(self->state_at = word_indices(rec, total, R_STATE_AT, n, &top)) ||
        !(self->owner_at = word_indices(rec, total, R_OWNER_AT, n, &top)) ||
        !(self->generation_at = word_indices(rec, total, R_GENERATION_AT, n, &top)) ||
        !(self->waiter_at = word_indices(rec, total, R_WAITER_AT, 1 + w, &top)) ||
        !(self->status = column(rec, total, R_STATUS, n)) ||
        !(self->place = column(rec, total, R_PLACE, n)) ||
        !(self->filled = column(rec, total, R_FILLED, w)))
        return -1;
    if (rec[R_BATCHES_AT] < 0 || rec[R_WAIT_AT] < 0 || rec[R_BATCHES_AT] >= PY_SSIZE_T_MAX / 8 ||
        rec[R_WAIT_AT] >= PY_SSIZE_T_MAX / 8) {
        PyErr_SetString(PyExc_ValueError, "records: a bad stats word index");
        return -1;
    }
    self->batches_at = (Py_ssize_t)rec[R_BATCHES_AT];
    self->wait_at = (Py_ssize_t)rec[R_WAIT_AT];
    if (self->batches_at > top) top = self->batches_at;
    if (self->wait_at > top) top = self->wait_at;
    self->n_words = top + 1;
    self->n_slots = n;
    self->n_workers = w;
    self->ordered = (int)rec[R_ORDERED];
    self->ticket = rec + R_TICKET;
    self->assigned = rec[R_ASSIGNED];
    self->ready = rec[R_READY];
    self->stale = rec[R_STALE];
    self->held = rec[R_HELD];
    self->words = Py_NewRef(words);
    self->templates = Py_NewRef(templates);
    self->wake = Py_NewRef(wake);
    return 0;
}

/* The ring's words, checked: a writable buffer of int64 holding every word index this Taker
 * was made with (a released memoryview raises ValueError). */
static int64_t *acquire(Taker *self, Py_buffer *view) {
    if (PyObject_GetBuffer(self->words, view, PyBUF_WRITABLE) < 0) return NULL;
    if (view->len < self->n_words * (Py_ssize_t)sizeof(int64_t) ||
        ((uintptr_t)view->buf % sizeof(int64_t))) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "words: too short, or not aligned to 8 bytes");
        return NULL;
    }
    return view->buf;
}

/* LearnerRing.hand_out(slot) (requeued, ASSIGNED): a new ticket for its generation and place,
 * OWNER, then STATE stored last with release; then the waker's half of the handshake. The
 * worker to wake (it sleeps or is about to), or -1. */
static Py_ssize_t hand_out(Taker *self, int64_t *words, Py_ssize_t slot) {
    int64_t ticket = (int64_t)((uint64_t)*self->ticket + 1); /* (no signed overflow) */
    *self->ticket = ticket;
    Py_ssize_t worker = slot % self->n_workers;
    self->place[slot] = ticket;
    self->status[slot] = OUT;
    __atomic_store_n(&words[self->generation_at[slot]], ticket, __ATOMIC_RELAXED);
    __atomic_store_n(&words[self->owner_at[slot]], (int64_t)worker, __ATOMIC_RELAXED);
    __atomic_store_n(&words[self->state_at[slot]], self->assigned, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return __atomic_load_n(&words[self->waiter_at[1 + worker]], __ATOMIC_RELAXED) ? worker : -1;
}

/* LearnerRing.take_up: slots out whose STATE (loaded with acquire) says READY or STALE are
 * back, each READY one counted for its worker. */
static void take_up(Taker *self, int64_t *words) {
    for (Py_ssize_t slot = 0; slot < self->n_slots; slot++) {
        if (self->status[slot] != OUT) continue;
        int64_t state = __atomic_load_n(&words[self->state_at[slot]], __ATOMIC_ACQUIRE);
        if (state == self->ready) {
            self->status[slot] = BACK;
            self->filled[slot % self->n_workers] += 1;
        } else if (state == self->stale) {
            self->status[slot] = BACK_STALE;
        }
    }
}

/* LearnerRing.pop: the slot with the smallest place among those back (ordered: among those
 * queued, out or back), HELD if it is back and ready; -1 if none is. */
static Py_ssize_t pop(Taker *self, int64_t *words) {
    Py_ssize_t best = -1;
    for (Py_ssize_t slot = 0; slot < self->n_slots; slot++) {
        int64_t s = self->status[slot];
        if ((s == BACK || (self->ordered && (s == OUT || s == BACK_STALE))) &&
            (best < 0 || self->place[slot] < self->place[best]))
            best = slot;
    }
    if (best < 0 || self->status[best] != BACK) return -1;
    self->status[best] = WITH_LEARNER;
    __atomic_store_n(&words[self->state_at[best]], self->held, __ATOMIC_RELAXED);
    return best;
}

/* The batch of ``slot``: its template's views and calls, the slot and its generation, with no
 * __init__ to run. (The list is the learner's: checked again at every take.) */
static PyObject *make_batch(Taker *self, Py_ssize_t slot, int64_t generation) {
    if (PyList_GET_SIZE(self->templates) != self->n_slots) {
        PyErr_SetString(PyExc_ValueError, "the templates were dropped (the ring was closed)");
        return NULL;
    }
    /* (a reference of our own: the allocation below may run a collection, and its finalizers
     * any Python code) */
    BatchCore *t = (BatchCore *)Py_NewRef(PyList_GET_ITEM(self->templates, slot));
    if (!PyObject_TypeCheck((PyObject *)t, &BatchCoreType) || t->released || !t->data ||
        !t->indices || !t->lanes || !t->weights) {
        Py_DECREF(t);
        PyErr_Format(PyExc_ValueError, "the template of slot %zd is not a live batch", slot);
        return NULL;
    }
    PyTypeObject *type = Py_TYPE(t);
    BatchCore *b = (BatchCore *)type->tp_alloc(type, 0);
    if (!b || t->released || !t->data || !t->indices || !t->lanes || !t->weights) {
        Py_XDECREF(b);
        Py_DECREF(t);
        if (b) PyErr_Format(PyExc_ValueError, "the template of slot %zd was let go of", slot);
        return NULL;
    }
    b->data = Py_NewRef(t->data);
    b->indices = Py_NewRef(t->indices);
    b->lanes = Py_NewRef(t->lanes);
    b->weights = Py_NewRef(t->weights);
    b->release_fn = Py_XNewRef(t->release_fn);
    b->to_fn = Py_XNewRef(t->to_fn);
    b->slot = slot;
    b->generation = generation;
    Py_DECREF(t);
    return (PyObject *)b;
}

/* take(held, t0) -> Batch | None: LearnerRing._take in one call. ``held`` (the learner's
 * batch, or None) let go of and its slot handed back (unless it was let go of before: a take
 * that raised after the release leaves the delivery's held batch released, and its slot is
 * not handed out twice), the slots workers handed back taken up, and the next slot HELD,
 * counted in the stats line as a batch delivered after waiting since ``t0``
 * (time.perf_counter_ns: CLOCK_MONOTONIC) and returned as a batch (None if none is ready). */
static PyObject *taker_take(Taker *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "take(held, t0)");
        return NULL;
    }
    if (!self->records.obj || !self->words) {
        PyErr_SetString(PyExc_ValueError, "a Taker not made (or cleared)");
        return NULL;
    }
    long long t0 = PyLong_AsLongLong(args[1]);
    if (t0 == -1 && PyErr_Occurred()) return NULL;
    PyObject *held = args[0];
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
    int64_t *words = acquire(self, &view);
    if (!words) return NULL;
    if (release >= 0) {
        Py_ssize_t worker = hand_out(self, words, release);
        if (worker >= 0) {
            /* Not holding the words while Python runs: a close() in another thread (the
             * wake-up lets it run) must be able to release them. */
            PyBuffer_Release(&view);
            PyObject *r = PyObject_CallFunction(self->wake, "n", worker);
            if (!r) return NULL;
            Py_DECREF(r);
            if (!(words = acquire(self, &view))) return NULL;
        }
    }
    take_up(self, words);
    Py_ssize_t slot = pop(self, words);
    PyObject *result = NULL;
    if (slot < 0) {
        result = Py_NewRef(Py_None);
    } else if ((result = make_batch(self, slot, words[self->generation_at[slot]]))) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        words[self->batches_at] += 1; /* (only the learner stores them) */
        words[self->wait_at] += (int64_t)now.tv_sec * 1000000000 + now.tv_nsec - t0;
    }
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef taker_methods[] = {
    {"take", (PyCFunction)(void (*)(void))taker_take, METH_FASTCALL,
     "take(held, t0): held (unless None or released) let go of and its slot handed back, "
     "handed-back slots taken up, the next slot HELD, counted and returned as a batch "
     "(None if none is ready)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TakerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "workers._take_c.Taker",
    .tp_basicsize = sizeof(Taker),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "LearnerRing.take, compiled: the common case of SamplerPool.next().",
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

/* A tuple of ``n`` str. */
static PyObject *names(const char *const *items, Py_ssize_t n) {
    PyObject *out = PyTuple_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyUnicode_FromString(items[i]);
        if (!s) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, s);
    }
    return out;
}

static int add_names(PyObject *m, const char *name, const char *const *items, Py_ssize_t n) {
    PyObject *t = names(items, n);
    if (!t) return -1;
    int status = PyModule_AddObjectRef(m, name, t);
    Py_DECREF(t);
    return status;
}

PyMODINIT_FUNC PyInit__take_c(void) {
    if (PyType_Ready(&BatchCoreType) < 0 || PyType_Ready(&TakerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Taker", (PyObject *)&TakerType) < 0 ||
        PyModule_AddObjectRef(m, "BatchCore", (PyObject *)&BatchCoreType) < 0 ||
        add_names(m, "RECORD_FIELDS", record_fields, R_HEADER) < 0 ||
        add_names(m, "STATUSES", statuses, N_STATUSES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
