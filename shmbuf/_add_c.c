/* RowPut: Writer.add for one lane in one call: the fast check of every field, then the
 * seqlock stores of slots.claim + slots.write_row. An optional speed-up built by setup.py where
 * a C compiler is at hand: without it, or where put() answers None, the writer's Python path
 * (addcompile.compiled_add) checks, converts, waits for room and stores through slots.
 *
 * What put() takes (else None, and nothing is stored): the same values the Python fast check
 * takes (addcompile.fast_check), so that a value stores the same bytes by either path:
 *   - NumPy arrays of exactly the field's dtype object (a byte-swapped or otherwise different
 *     dtype is not the same object), its shape ([1, *shape] for a one-env vector writer) and
 *     C-contiguous;
 *   - for scalar fields (not one-env): the field's own NumPy scalar type; Python bool where the
 *     field takes it; Python int and float inside the ranges rowcheck.fast_scalars gives,
 *     converted as NumPy converts them (an int into a float field through a double). Python
 *     numbers go only into bool, int, float32 and float64 fields, and ints only up to 64 bits;
 * and only while the room granted by the rate limiter lasts (index < room_until, generation
 * unchanged): the Python path waits for more.
 *
 * Ordering: the stores are slots.write_row's, in its order (claim, odd stamp, the row, the meta
 * word, even stamp, committed), with a compiler barrier between the steps (x86-64 keeps stores
 * in program order: slots.check_platform) and sfences around the non-temporal copies of large
 * rows (_stream_c.c says why). tests/test_add_compiled.py checks that it leaves the same words
 * and bytes as the Python path.
 */
#define PY_SSIZE_T_CLEAN
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <Python.h>
#include <numpy/arrayobject.h>
#include <numpy/arrayscalars.h>
#include <stdint.h>
#include <string.h>

#include "_stream_copy.h"

enum { MAX_FIELDS = 64 };

typedef struct {
    PyArray_Descr *dtype;      /* owned: the field's dtype object (identity is the check) */
    PyTypeObject *scalar_type; /* its NumPy scalar type (dtype->typeobj) */
    char kind;                 /* dtype->kind: 'b', 'i', 'u', 'f', 'c' */
    int itemsize;
    int ndim;
    npy_intp shape[NPY_MAXDIMS];
    Py_ssize_t nbytes;  /* of one row */
    char *dest;         /* slot 0 of the lane's column, or the private pending row */
    Py_ssize_t stride;  /* bytes from one slot to the next: nbytes, or 0 (pending row) */
    int stream;         /* copied with non-temporal stores */
    int numbers;        /* a scalar field (not one-env): its NumPy scalar type is taken, and
                           Python numbers in the ranges below (which addcompile.row_put leaves
                           empty but for bool, int, float32 and float64 fields) */
    int bool_ok, float_any;
    long long int_lo, int_hi;  /* Python ints taken (empty where lo > hi) */
    double float_lo, float_hi; /* Python floats taken (empty where lo > hi) */
} Field;

typedef struct {
    PyObject_HEAD
    Py_buffer words_view;
    int64_t *words; /* NULL until __init__ succeeds */
    Py_ssize_t w_committed, w_reserved, w_lim_gen, stamp0, meta0;
    long long capacity, step_mask;
    int any_stream;
    int one_env; /* a one-env VectorWriter's: put returns the index as an int64 array of one */
    Py_ssize_t nfields;
    Field fields[MAX_FIELDS];
    Py_buffer dest_views[MAX_FIELDS];
} RowPut;

static inline int64_t load_word(const int64_t *w) { return __atomic_load_n(w, __ATOMIC_RELAXED); }
static inline void store_word(int64_t *w, int64_t v) { __atomic_store_n(w, v, __ATOMIC_RELAXED); }
/* Stores before it stay before stores after it: on x86-64 (TSO) a compiler barrier, which
 * the asm makes explicit for the plain stores of memcpy too. */
static inline void store_order(void) {
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __asm__ __volatile__("" ::: "memory");
}

static void release_views(RowPut *self) {
    for (Py_ssize_t k = 0; k < self->nfields; k++) {
        if (self->dest_views[k].obj) PyBuffer_Release(&self->dest_views[k]);
        Py_CLEAR(self->fields[k].dtype);
    }
    self->nfields = 0;
    if (self->words) {
        PyBuffer_Release(&self->words_view);
        self->words = NULL;
    }
}

static void rowput_dealloc(RowPut *self) {
    release_views(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A Python int or float into a scalar field of kind b/i/u/f: its bytes in out. */
static void put_number(const Field *f, int is_float, double d, long long ll, char *out) {
    int itemsize = f->itemsize;
    if (f->kind == 'f') {
        double x = is_float ? d : (double)ll;
        if (itemsize == 4) {
            float y = (float)x;
            memcpy(out, &y, 4);
        } else {
            memcpy(out, &x, 8);
        }
    } else if (f->kind == 'b') {
        out[0] = ll != 0;
    } else {  /* in range (checked), so the low bytes are the value, signed or not */
        memcpy(out, &ll, (size_t)itemsize);
    }
}

/* Whether value v stores into field f as it is; *src then points at its bytes (in v, or in
 * scratch for a converted number). */
static int take(const Field *f, PyObject *v, const char **src, char *scratch) {
    if (PyArray_Check(v)) {
        PyArrayObject *a = (PyArrayObject *)v;
        if (PyArray_DESCR(a) != f->dtype || PyArray_NDIM(a) != f->ndim ||
            !PyArray_IS_C_CONTIGUOUS(a))
            return 0;
        const npy_intp *dims = PyArray_DIMS(a);
        for (int j = 0; j < f->ndim; j++)
            if (dims[j] != f->shape[j]) return 0;
        *src = PyArray_BYTES(a);
        return 1;
    }
    if (!f->numbers) return 0;
    if (Py_TYPE(v) == f->scalar_type) {
        PyArray_ScalarAsCtype(v, scratch);
        *src = scratch;
        return 1;
    }
    if (v == Py_True || v == Py_False) {
        if (!f->bool_ok) return 0;
        put_number(f, 0, 0.0, v == Py_True, scratch);
    } else if (PyFloat_CheckExact(v)) {
        double d = PyFloat_AS_DOUBLE(v);
        if (!f->float_any && !(f->float_lo <= d && d <= f->float_hi)) return 0;  /* nan too */
        put_number(f, 1, d, 0, scratch);
    } else if (PyLong_CheckExact(v)) {
        int overflow;
        long long ll = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (ll == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        if (overflow > 0 && f->kind == 'u' && f->itemsize == 8 && f->int_lo <= f->int_hi) {
            unsigned long long ull = PyLong_AsUnsignedLongLong(v);  /* 2**63 .. 2**64 - 1 */
            if (ull == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                return 0;
            }
            memcpy(scratch, &ull, 8);
            *src = scratch;
            return 1;
        }
        if (overflow || ll < f->int_lo || ll > f->int_hi) return 0;
        put_number(f, 0, 0.0, ll, scratch);
    } else {
        return 0;
    }
    *src = scratch;
    return 1;
}

static int as_ll(PyObject *o, long long *out) {
    *out = PyLong_AsLongLong(o);
    return !(*out == -1 && PyErr_Occurred());
}

/* put(index, room_until, lim_gen, episode_bits, step, *values) -> index (one_env: an int64
 * array of one) or None */
static PyObject *rowput_put(RowPut *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 + self->nfields) {
        PyErr_Format(PyExc_TypeError, "put() takes 5 + %zd arguments (%zd given)",
                     self->nfields, nargs);
        return NULL;
    }
    int64_t *w = self->words;
    if (w == NULL) {
        PyErr_SetString(PyExc_ValueError, "put() on a RowPut whose __init__ failed");
        return NULL;
    }
    long long i, room_until, lim_gen, episode_bits, step;
    if (!as_ll(args[0], &i) || !as_ll(args[1], &room_until) || !as_ll(args[2], &lim_gen) ||
        !as_ll(args[3], &episode_bits) || !as_ll(args[4], &step))
        return NULL;
    if (i < 0 || i >= room_until || load_word(w + self->w_lim_gen) != lim_gen) Py_RETURN_NONE;
    const char *src[MAX_FIELDS];
    union { char bytes[16]; long double align; } scratch[MAX_FIELDS];
    for (Py_ssize_t k = 0; k < self->nfields; k++)
        if (!take(&self->fields[k], args[5 + k], &src[k], scratch[k].bytes)) Py_RETURN_NONE;

    PyObject *result = NULL;  /* made before the first store: a failure here stores nothing */
    if (self->one_env) {
        npy_intp one = 1;
        result = PyArray_SimpleNew(1, &one, NPY_INT64);
        if (result) *(int64_t *)PyArray_DATA((PyArrayObject *)result) = i;
    } else {
        result = PyLong_FromLongLong(i);
    }
    if (result == NULL) return NULL;

    long long s = i % self->capacity;
    if (i >= load_word(w + self->w_reserved)) store_word(w + self->w_reserved, i + 1);  /* claim */
    store_word(w + self->stamp0 + s, 2 * i + 1);
    store_order();
    if (self->any_stream) _mm_sfence();  /* the odd stamp before any streamed byte */
    for (Py_ssize_t k = 0; k < self->nfields; k++) {
        const Field *f = &self->fields[k];
        char *dst = f->dest + s * f->stride;
        if (f->stream)
            stream_copy(dst, src[k], f->nbytes);
        else
            memcpy(dst, src[k], (size_t)f->nbytes);
    }
    if (self->any_stream) _mm_sfence();  /* every streamed byte before the even stamp */
    store_word(w + self->meta0 + s, episode_bits | (step & self->step_mask));
    store_order();
    store_word(w + self->stamp0 + s, 2 * i + 2);
    store_order();
    store_word(w + self->w_committed, i + 1);
    return result;
}

static int word_index(Py_ssize_t at, Py_ssize_t count, const Py_buffer *view, const char *what) {
    if (at < 0 || (at + count) * 8 > view->len) {
        PyErr_Format(PyExc_ValueError, "%s: words %zd..%zd fall outside the segment", what, at,
                     at + count);
        return 0;
    }
    return 1;
}

/* RowPut(words, (w_committed, w_reserved, w_lim_gen, stamp0, meta0, capacity, step_mask),
 *        fields, one_env=False): words is the segment as a writable buffer of int64 words; fields a sequence
 * of (dtype, shape, dest, stride, stream, numbers, bool_ok, float_any, int_lo, int_hi,
 * float_lo, float_hi) per field, dest a writable C-contiguous buffer holding capacity rows
 * (stride = row bytes) or one (stride 0). Built by addcompile.row_put. */
static int rowput_init(RowPut *self, PyObject *args, PyObject *kwds) {
    PyObject *words_o, *fields_o;
    int one_env = 0;
    Py_ssize_t w_committed, w_reserved, w_lim_gen, stamp0, meta0;
    long long capacity, step_mask;
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "RowPut() takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O(nnnnnLL)O|p", &words_o, &w_committed, &w_reserved, &w_lim_gen,
                          &stamp0, &meta0, &capacity, &step_mask, &fields_o, &one_env))
        return -1;
    release_views(self);
    if (capacity <= 0) {
        PyErr_SetString(PyExc_ValueError, "RowPut: capacity must be positive");
        return -1;
    }
    PyObject *seq = PySequence_Fast(fields_o, "RowPut: fields must be a sequence");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > MAX_FIELDS) {
        PyErr_Format(PyExc_ValueError, "RowPut: 1 to %d fields, not %zd", MAX_FIELDS, n);
        goto fail;
    }
    if (PyObject_GetBuffer(words_o, &self->words_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto fail;
    self->words = (int64_t *)self->words_view.buf;
    if (((uintptr_t)self->words & 7) || !word_index(w_committed, 1, &self->words_view, "committed") ||
        !word_index(w_reserved, 1, &self->words_view, "reserved") ||
        !word_index(w_lim_gen, 1, &self->words_view, "limiter generation") ||
        !word_index(stamp0, capacity, &self->words_view, "stamps") ||
        !word_index(meta0, capacity, &self->words_view, "meta"))
        goto fail;
    self->w_committed = w_committed, self->w_reserved = w_reserved, self->w_lim_gen = w_lim_gen;
    self->stamp0 = stamp0, self->meta0 = meta0, self->capacity = capacity;
    self->step_mask = step_mask;
    self->one_env = one_env;
    self->any_stream = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        Field *f = &self->fields[k];
        PyObject *dtype_o, *shape_o, *dest_o;
        memset(f, 0, sizeof(*f));
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "OOOniiiiLLdd", &dtype_o, &shape_o,
                              &dest_o, &f->stride, &f->stream, &f->numbers, &f->bool_ok,
                              &f->float_any, &f->int_lo, &f->int_hi, &f->float_lo, &f->float_hi))
            goto fail;
        if (!PyArray_DescrCheck(dtype_o) || PyDataType_REFCHK((PyArray_Descr *)dtype_o)) {
            PyErr_Format(PyExc_TypeError, "RowPut: field %zd: a NumPy dtype without objects", k);
            goto fail;
        }
        Py_INCREF(dtype_o);
        f->dtype = (PyArray_Descr *)dtype_o;
        self->nfields = k + 1;  /* from here on release_views owns the dtype */
        f->scalar_type = f->dtype->typeobj;
        if (!PyTuple_Check(shape_o) || PyTuple_GET_SIZE(shape_o) > NPY_MAXDIMS) {
            PyErr_Format(PyExc_ValueError, "RowPut: field %zd: a shape of at most %d dimensions",
                         k, NPY_MAXDIMS);
            goto fail;
        }
        f->ndim = (int)PyTuple_GET_SIZE(shape_o);
        for (int j = 0; j < f->ndim; j++) {
            f->shape[j] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape_o, j));
            if (f->shape[j] < 0) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "RowPut: field %zd: a negative extent", k);
                goto fail;
            }
        }
        f->kind = f->dtype->kind;
        f->itemsize = (int)PyDataType_ELSIZE(f->dtype);
        f->nbytes = f->itemsize;
        for (int j = 0; j < f->ndim; j++) f->nbytes *= f->shape[j];
        int plain = strchr("biu", f->kind) != NULL ||
                    (f->kind == 'f' && (f->itemsize == 4 || f->itemsize == 8));
        if (f->numbers && (f->ndim != 0 || f->nbytes > 16)) {
            PyErr_Format(PyExc_ValueError, "RowPut: field %zd takes scalars but is not a scalar "
                         "field of at most 16 bytes", k);
            goto fail;
        }
        if (!plain && (f->bool_ok || f->float_any || f->int_lo <= f->int_hi ||
                       f->float_lo <= f->float_hi)) {
            PyErr_Format(PyExc_ValueError, "RowPut: field %zd: Python numbers go only into "
                         "bool, int, float32 and float64 fields", k);
            goto fail;
        }
        if (PyObject_GetBuffer(dest_o, &self->dest_views[k], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto fail;
        Py_ssize_t rows = f->stride ? capacity : 1;
        if ((f->stride != 0 && f->stride != f->nbytes) || self->dest_views[k].len != rows * f->nbytes) {
            PyErr_Format(PyExc_ValueError, "RowPut: field %zd: a destination of %zd bytes for %zd "
                         "rows of %zd", k, self->dest_views[k].len, rows, f->nbytes);
            goto fail;
        }
        f->dest = (char *)self->dest_views[k].buf;
        self->any_stream |= f->stream;
    }
    Py_DECREF(seq);
    return 0;
fail:
    Py_DECREF(seq);
    release_views(self);
    return -1;
}

static PyMethodDef rowput_methods[] = {
    {"put", (PyCFunction)(void (*)(void))rowput_put, METH_FASTCALL,
     "put(index, room_until, lim_gen, episode_bits, step, *values) -> index (an int64 array "
     "of one for a one-env writer's) or None: check and store one row, or store nothing and "
     "return None."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RowPutType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmbuf._add_c.RowPut",
    .tp_basicsize = sizeof(RowPut),
    .tp_dealloc = (destructor)rowput_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Writer.add's check and seqlock stores for one lane, compiled (see _add_c.c).",
    .tp_methods = rowput_methods,
    .tp_init = (initproc)rowput_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_add_c",
                                    "Writer.add's check and stores for one row, compiled (optional).",
                                    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__add_c(void) {
    import_array();
    if (PyType_Ready(&RowPutType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "MAX_FIELDS", MAX_FIELDS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&RowPutType);
    if (PyModule_AddObject(m, "RowPut", (PyObject *)&RowPutType) < 0) {
        Py_DECREF(&RowPutType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
