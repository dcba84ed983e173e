/* A lane's store, compiled (shmbuf/store.py says what a store is): the lane's cursor, put (one
 * row), put_many (rows) and AddMethod, the add of a writer class that takes a row's fields as
 * keywords and stores the usual rows in that one call. An optional speed-up built by setup.py
 * against NumPy's headers where a C compiler is at hand; without it store.NumpyLaneStore runs the
 * same protocol through shmbuf/slots.py and stores the same bytes (tests/test_add_compiled.py).
 *
 * Values. append, put and put_many take what RowChecker let through: the value rule lives
 * there, not here. A value that is an array of the field's dtype is copied as its bytes lie,
 * whatever its strides: contiguous, with one memcpy (non-temporal stores for rows of 4 KB or
 * more: _stream_c.c says why); otherwise (transposed, reversed, Fortran-ordered, broadcast with
 * stride 0) by NumPy's copy for 4 KB or more, item by item in C order below that. Any other
 * value is converted by NumPy first (np.asarray(value, dtype)), before the first store, so a
 * failure stores nothing. AddMethod stores with no Python only what needs
 * no check: arrays of the field's dtype and shape ([1, *shape] for a one-env vector writer), the
 * field's own NumPy scalars, and Python bool, int and float in the ranges rowcheck.fast_scalars
 * gives (converted as NumPy converts them; only into bool, int, float32 and float64 fields). For
 * anything else, and once the room granted by the rate limiter is used up, it calls the writer's
 * Python add, which checks, waits and calls put.
 *
 * Ordering: store_row and put_many store in slots.py's order (claim, odd stamps, the rows, the
 * meta words, even stamps, committed), with a compiler barrier between the steps (x86-64 keeps
 * stores in program order: slots.check_platform) and sfences around non-temporal copies.
 */
#define PY_SSIZE_T_CLEAN
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <Python.h>
#include <structmember.h>
#include <numpy/arrayobject.h>
#include <numpy/arrayscalars.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_stream_copy.h"

enum { MAX_FIELDS = 64 };                  /* fields are told apart by a 64-bit mask */
static const Py_ssize_t NOGIL_BYTES = 1 << 16; /* put_many lets other threads run past this */
enum { NUMPY_COPY_BYTES = 4096 };              /* non-contiguous blocks NumPy copies */

typedef struct {
    PyArray_Descr *dtype;      /* owned: the field's dtype */
    PyTypeObject *scalar_type; /* its NumPy scalar type (dtype->typeobj) */
    char kind;                 /* 'b', 'i', 'u', 'f', 'c' */
    int itemsize;
    int ndim;
    npy_intp shape[NPY_MAXDIMS];
    Py_ssize_t nbytes;  /* of one row */
    char *dest;         /* slot 0 of the lane's column, or the private pending row */
    int stream;         /* large rows: copied with non-temporal stores */
    int numbers;        /* a scalar field: its NumPy scalar type is taken, and Python numbers in
                           the ranges below (left empty by store.py but for bool, int, float32
                           and float64 fields) */
    int bool_ok, float_any;
    long long int_lo, int_hi;  /* Python ints taken (empty where lo > hi) */
    double float_lo, float_hi; /* Python floats taken (empty where lo > hi) */
} Field;

/* Where a value's bytes are: at ptr, contiguous (strides NULL) or with these byte strides, one
 * per dimension of the row (append, put) or of the rows (put_many). */
typedef struct {
    const char *ptr;
    const npy_intp *strides;
} Src;

typedef struct {
    PyObject_HEAD
    Py_buffer words_view;
    int64_t *words; /* NULL until __init__ succeeds, and after release() */
    Py_ssize_t w_committed, w_reserved, w_lim_gen, stamp0, meta0;
    long long capacity, step_mask;
    int any_stream;
    Py_ssize_t nfields;  /* fields given to put */
    Py_ssize_t ncolumns; /* of them stored in slots; one more: the pending next_obs row */
    PyObject *names;     /* tuple of the fields' names, interned */
    /* The cursor: the next index, the step in the episode, episode << STEP_BITS, and the room
     * the rate limiter granted (index bound, limiter generation). */
    long long next, step, episode_bits, room_until, lim_gen;
    Field fields[MAX_FIELDS];
    Py_buffer dest_views[MAX_FIELDS];
} LaneStore;

static PyTypeObject LaneStoreType;
static PyObject *str_store; /* "_store": where AddMethod finds a writer's store */

static inline int64_t load_word(const int64_t *w) { return __atomic_load_n(w, __ATOMIC_RELAXED); }
static inline void store_word(int64_t *w, int64_t v) { __atomic_store_n(w, v, __ATOMIC_RELAXED); }
/* Stores before it stay before stores after it: on x86-64 (TSO) a compiler barrier, which
 * the asm makes explicit for the plain stores of memcpy too. */
static inline void store_order(void) {
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __asm__ __volatile__("" ::: "memory");
}

/* ---------------------------------------------------------------------------------------- */
/* Copies                                                                                    */
/* ---------------------------------------------------------------------------------------- */

/* n items of T, step bytes apart (a constant step lets the compiler vectorize it). */
#define COPY_ITEMS(T)                                                                    \
    do {                                                                                 \
        T *restrict d = (T *)dst;                                                        \
        if (step == -(npy_intp)sizeof(T)) {                                              \
            const T *restrict s = (const T *)src;                                        \
            for (npy_intp i = 0; i < n; i++) memcpy(&d[i], s - i, sizeof(T));           \
        } else {                                                                         \
            for (npy_intp i = 0; i < n; i++) memcpy(&d[i], src + i * step, sizeof(T));  \
        }                                                                                \
    } while (0)

/* n items of itemsize bytes, step bytes apart (0: one item repeated), into dst back to back. */
static void copy_items(char *restrict dst, const char *restrict src, npy_intp n, npy_intp step,
                       int itemsize) {
    if (step == 0 && itemsize == 1) {
        memset(dst, src[0], (size_t)n);
        return;
    }
    switch (itemsize) {
    case 1: COPY_ITEMS(uint8_t); break;
    case 2: COPY_ITEMS(uint16_t); break;
    case 4: COPY_ITEMS(uint32_t); break;
    case 8: COPY_ITEMS(uint64_t); break;
    default:
        for (npy_intp i = 0; i < n; i++)
            memcpy(dst + (npy_intp)itemsize * i, src + i * step, (size_t)itemsize);
    }
}

/* The ndim-dimensional array at src (shape, byte strides: any, negative and 0 included) into
 * dst in C order. Dimensions of one item and dimensions that continue each other are merged
 * first, so a row that is contiguous but for its first axis is one run per row. */
static void strided_copy(char *dst, const char *src, int ndim, const npy_intp *shape,
                         const npy_intp *strides, int itemsize) {
    npy_intp dims[NPY_MAXDIMS + 1], steps[NPY_MAXDIMS + 1], at[NPY_MAXDIMS + 1];
    int nd = 0;
    for (int j = 0; j < ndim; j++) {
        if (shape[j] == 0) return;
        if (shape[j] == 1) continue;
        if (nd > 0 && steps[nd - 1] == shape[j] * strides[j]) { /* continues the previous one */
            dims[nd - 1] *= shape[j];
            steps[nd - 1] = strides[j];
            continue;
        }
        dims[nd] = shape[j], steps[nd] = strides[j], at[nd] = 0;
        nd++;
    }
    if (nd == 0) {
        memcpy(dst, src, (size_t)itemsize);
        return;
    }
    const int last = nd - 1;
    const npy_intp n = dims[last], step = steps[last];
    const size_t run = (size_t)n * (size_t)itemsize;
    for (;;) {
        if (step == itemsize)
            memcpy(dst, src, run);
        else
            copy_items(dst, src, n, step, itemsize);
        dst += run;
        int j = last - 1;
        for (; j >= 0; j--) { /* the next row: an odometer over the outer dimensions */
            src += steps[j];
            if (++at[j] < dims[j]) break;
            src -= steps[j] * dims[j];
            at[j] = 0;
        }
        if (j < 0) return;
    }
}

/* count rows of field f (count = 1: one row) from src into dst. */
static void copy_rows(const Field *f, char *dst, const Src *src, npy_intp count, int lead) {
    if (src->strides == NULL) {
        if (f->stream)
            stream_copy(dst, src->ptr, f->nbytes * count);
        else
            memcpy(dst, src->ptr, (size_t)(f->nbytes * count));
        return;
    }
    if (!lead) {
        strided_copy(dst, src->ptr, f->ndim, f->shape, src->strides, f->itemsize);
        return;
    }
    npy_intp shape[NPY_MAXDIMS + 1];
    shape[0] = count;
    memcpy(shape + 1, f->shape, sizeof(npy_intp) * (size_t)f->ndim);
    strided_copy(dst, src->ptr, f->ndim + 1, shape, src->strides, f->itemsize);
}

/* NumPy's copy of count rows of field f from src (lead: src's strides start with the rows'
 * axis) into dst, where the rows are not contiguous and hold NUMPY_COPY_BYTES or more: its
 * loops are vectorized for every layout (a byte-reversed or Fortran-ordered frame in half the
 * time of the item loop above). views[0], views[1]: the destination's and the source's array,
 * made before the first store (NULL, NULL: copy_rows copies these rows). 0 with an exception. */
static int numpy_copy_views(const Field *f, char *dst, const Src *src, npy_intp count, int lead,
                            PyObject **views) {
    views[0] = views[1] = NULL;
    if (src->strides == NULL || f->nbytes * count < NUMPY_COPY_BYTES) return 1;
    npy_intp dims[NPY_MAXDIMS + 1];
    dims[0] = count;
    memcpy(dims + lead, f->shape, sizeof(npy_intp) * (size_t)f->ndim);
    for (int v = 0; v < 2; v++) {
        Py_INCREF(f->dtype);
        views[v] = v == 0 ? PyArray_NewFromDescr(&PyArray_Type, f->dtype, f->ndim + lead, dims,
                                                 NULL, dst, NPY_ARRAY_WRITEABLE, NULL)
                          : PyArray_NewFromDescr(&PyArray_Type, f->dtype, f->ndim + lead, dims,
                                                 (npy_intp *)src->strides, (void *)src->ptr, 0,
                                                 NULL);
        if (views[v] == NULL) {
            Py_CLEAR(views[0]);
            return 0;
        }
        PyArray_UpdateFlags((PyArrayObject *)views[v], NPY_ARRAY_UPDATE_ALL);
    }
    return 1;
}

/* count rows into dst: by NumPy where numpy_copy_views made views, else copy_rows. 0 with an
 * exception where NumPy's copy failed (it allocates nothing for these arrays but may, in
 * principle, run out of memory). */
static int copy_block(const Field *f, char *dst, const Src *src, npy_intp count, int lead,
                      PyObject *const *views) {
    if (views[0] == NULL) {
        copy_rows(f, dst, src, count, lead);
        return 1;
    }
    return PyArray_CopyInto((PyArrayObject *)views[0], (PyArrayObject *)views[1]) == 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Values                                                                                    */
/* ---------------------------------------------------------------------------------------- */

/* A Python int or float into a scalar field of kind b/i/u/f: its bytes in out. */
static void put_number(const Field *f, int is_float, double d, long long ll, char *out) {
    if (f->kind == 'f') {
        double x = is_float ? d : (double)ll;
        if (f->itemsize == 4) {
            float y = (float)x;
            memcpy(out, &y, 4);
        } else {
            memcpy(out, &x, 8);
        }
    } else if (f->kind == 'b') {
        out[0] = ll != 0;
    } else { /* in range (checked), so the low bytes are the value, signed or not */
        memcpy(out, &ll, (size_t)f->itemsize);
    }
}

static int same_dtype(PyArray_Descr *d, PyArray_Descr *want) {
    return d == want || PyArray_EquivTypes(d, want);
}

/* Whether v stores into field f as it is, as one row (lead = 1: an array [1, *shape], a one-env
 * vector writer's row); *src then says where its bytes are (in v, or in scratch for a number,
 * which only a field with `numbers` takes). */
static int take(const Field *f, PyObject *v, int lead, Src *src, char *scratch) {
    if (PyArray_Check(v)) {
        PyArrayObject *a = (PyArrayObject *)v;
        if (PyArray_NDIM(a) != f->ndim + lead || !same_dtype(PyArray_DESCR(a), f->dtype))
            return 0;
        const npy_intp *dims = PyArray_DIMS(a);
        if (lead && dims[0] != 1) return 0;
        for (int j = 0; j < f->ndim; j++)
            if (dims[lead + j] != f->shape[j]) return 0;
        src->ptr = PyArray_BYTES(a);
        src->strides = PyArray_IS_C_CONTIGUOUS(a) ? NULL : PyArray_STRIDES(a) + lead;
        return 1;
    }
    if (lead || !f->numbers) return 0;
    src->ptr = scratch;
    src->strides = NULL;
    if (Py_TYPE(v) == f->scalar_type) {
        PyArray_ScalarAsCtype(v, scratch);
        return 1;
    }
    if (v == Py_True || v == Py_False) {
        if (!f->bool_ok) return 0;
        put_number(f, 0, 0.0, v == Py_True, scratch);
    } else if (PyFloat_CheckExact(v)) {
        double d = PyFloat_AS_DOUBLE(v);
        if (!f->float_any && !(f->float_lo <= d && d <= f->float_hi)) return 0; /* nan too */
        put_number(f, 1, d, 0, scratch);
    } else if (PyLong_CheckExact(v)) {
        int overflow;
        long long ll = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (ll == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        if (overflow > 0 && f->kind == 'u' && f->itemsize == 8 && f->int_lo <= f->int_hi) {
            unsigned long long ull = PyLong_AsUnsignedLongLong(v); /* 2**63 .. 2**64 - 1 */
            if (ull == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                return 0;
            }
            memcpy(scratch, &ull, 8);
            return 1;
        }
        if (overflow || ll < f->int_lo || ll > f->int_hi) return 0;
        put_number(f, 0, 0.0, ll, scratch);
    } else {
        return 0;
    }
    return 1;
}

/* v as an array of field f's dtype (NumPy converts it, as np.asarray(v, dtype)); a new
 * reference, or NULL with an exception. */
static PyArrayObject *as_field_array(const Field *f, PyObject *v) {
    Py_INCREF(f->dtype);
    return (PyArrayObject *)PyArray_FromAny(v, f->dtype, 0, 0, NPY_ARRAY_FORCECAST, NULL);
}

/* ValueError: field k's value `a` is not one row (lead = 0) or rows (lead = 1) of it. */
static void shape_error(const LaneStore *st, Py_ssize_t k, PyArrayObject *a, int lead,
                        const char *op) {
    const Field *f = &st->fields[k];
    PyObject *want = PyTuple_New(f->ndim + lead);
    PyObject *got = PyObject_GetAttrString((PyObject *)a, "shape");
    if (want && got) {
        if (lead) PyTuple_SET_ITEM(want, 0, PyUnicode_FromString("n"));
        for (int j = 0; j < f->ndim; j++)
            PyTuple_SET_ITEM(want, lead + j, PyLong_FromSsize_t(f->shape[j]));
        PyErr_Format(PyExc_ValueError, "%s(): field %R: a value of shape %R for %s of shape %R",
                     op, PyTuple_GET_ITEM(st->names, k), got, lead ? "rows" : "a row", want);
    }
    Py_XDECREF(want);
    Py_XDECREF(got);
}

/* Field k's value v as one row: taken as it is, or converted (*held: the converted array, to
 * release after the stores). 0 with an exception where it is not one row of the field. */
static int stage_row(const LaneStore *st, Py_ssize_t k, PyObject *v, Src *src, char *scratch,
                     PyObject **held) {
    const Field *f = &st->fields[k];
    if (take(f, v, 0, src, scratch)) return 1;
    PyArrayObject *a = as_field_array(f, v);
    if (a == NULL) return 0;
    *held = (PyObject *)a;
    if (take(f, (PyObject *)a, 0, src, scratch)) return 1;
    shape_error(st, k, a, 0, "put");
    return 0;
}

/* Field k's value v as rows [n, *shape] (n < 0: take n from it): as for stage_row. */
static int stage_rows(const LaneStore *st, Py_ssize_t k, PyObject *v, npy_intp *n, Src *src,
                      PyObject **held) {
    const Field *f = &st->fields[k];
    PyArrayObject *a;
    if (PyArray_Check(v) && same_dtype(PyArray_DESCR((PyArrayObject *)v), f->dtype)) {
        a = (PyArrayObject *)v;
        Py_INCREF(a); /* held while the rows are copied, with the GIL let go */
    } else if ((a = as_field_array(f, v)) == NULL) {
        return 0;
    }
    *held = (PyObject *)a;
    int ok = PyArray_NDIM(a) == f->ndim + 1 && (*n < 0 || PyArray_DIMS(a)[0] == *n);
    for (int j = 0; ok && j < f->ndim; j++) ok = PyArray_DIMS(a)[j + 1] == f->shape[j];
    if (!ok) {
        shape_error(st, k, a, 1, "put_many");
        return 0;
    }
    *n = PyArray_DIMS(a)[0];
    src->ptr = PyArray_BYTES(a);
    src->strides = PyArray_IS_C_CONTIGUOUS(a) ? NULL : PyArray_STRIDES(a);
    return 1;
}

/* ---------------------------------------------------------------------------------------- */
/* The protocol                                                                              */
/* ---------------------------------------------------------------------------------------- */

/* One row at index i: claim, odd stamp, each column's bytes, the meta word, even stamp,
 * committed; then the pending row, where nvalues includes it (slots.write_row). 0 on success;
 * -1 with an exception where NumPy's views could not be made (nothing stored) or its copy
 * failed (the slot then stays odd, claimed and unpublished, as a dead writer leaves it, and
 * the next row at i rewrites it). */
static int store_row(LaneStore *st, long long i, long long meta, const Src *src,
                     Py_ssize_t nvalues) {
    int64_t *w = st->words;
    const long long s = i % st->capacity;
    PyObject *views[MAX_FIELDS][2];
    Py_ssize_t k, nviews = 0;
    int ok = 1;
    for (; nviews < st->ncolumns && ok; nviews++) {
        const Field *f = &st->fields[nviews];
        ok = numpy_copy_views(f, f->dest + s * f->nbytes, &src[nviews], 1, 0, views[nviews]);
    }
    if (!ok) goto done;
    if (i >= load_word(w + st->w_reserved)) store_word(w + st->w_reserved, i + 1); /* claim */
    store_word(w + st->stamp0 + s, 2 * i + 1);
    store_order();
    if (st->any_stream) _mm_sfence(); /* the odd stamp before any streamed byte */
    for (k = 0; k < st->ncolumns && ok; k++) {
        const Field *f = &st->fields[k];
        ok = copy_block(f, f->dest + s * f->nbytes, &src[k], 1, 0, views[k]);
    }
    if (st->any_stream) _mm_sfence(); /* every streamed byte before the even stamp */
    if (!ok) goto done;
    store_word(w + st->meta0 + s, meta);
    store_order();
    store_word(w + st->stamp0 + s, 2 * i + 2);
    store_order();
    store_word(w + st->w_committed, i + 1);
    if (nvalues > st->ncolumns) copy_rows(&st->fields[st->ncolumns], st->fields[st->ncolumns].dest,
                                          &src[st->ncolumns], 1, 0);
done:
    for (k = 0; k < nviews; k++) {
        Py_XDECREF(views[k][0]);
        Py_XDECREF(views[k][1]);
    }
    return ok ? 0 : -1;
}

/* Whether the room the rate limiter granted is left for the row at the cursor. */
static int room_left(const LaneStore *st) {
    return st->next >= 0 && st->next < st->room_until &&
           load_word(st->words + st->w_lim_gen) == st->lim_gen;
}

/* The row at the cursor (room_left): stored, the cursor advanced; its index (-1 with an
 * exception: store_row's). */
static long long append_row(LaneStore *st, const Src *src, Py_ssize_t nvalues) {
    long long i = st->next;
    if (store_row(st, i, st->episode_bits | (st->step & st->step_mask), src, nvalues) < 0)
        return -1;
    st->next = i + 1;
    st->step += 1;
    return i;
}

static int as_ll(PyObject *o, long long *out) {
    *out = PyLong_AsLongLong(o);
    return !(*out == -1 && PyErr_Occurred());
}

static int check_open(const LaneStore *st) {
    if (st->words != NULL) return 1;
    PyErr_SetString(PyExc_ValueError, "a released (or never made) lane store");
    return 0;
}

/* The values of a put or put_many: one per field, or one per stored column (no pending row). */
static PyObject *values_of(const LaneStore *st, PyObject *values, const char *op) {
    PyObject *seq = PySequence_Fast(values, "values must be a sequence");
    if (seq && PySequence_Fast_GET_SIZE(seq) != st->nfields &&
        PySequence_Fast_GET_SIZE(seq) != st->ncolumns) {
        PyErr_Format(PyExc_ValueError, "%s(): %zd values for %zd fields", op,
                     PySequence_Fast_GET_SIZE(seq), st->nfields);
        Py_CLEAR(seq);
    }
    return seq;
}

/* One row of checked values: at index i with meta word meta, or (i < 0) at the cursor if
 * room_left. The index stored at, -1 where no room was left, or -2 with an exception. */
static long long put_values(LaneStore *st, long long i, long long meta, PyObject *values,
                            const char *op) {
    PyObject *seq = values_of(st, values, op);
    if (seq == NULL) return -2;
    if (i < 0 && !room_left(st)) {
        Py_DECREF(seq);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Src src[MAX_FIELDS];
    union { char bytes[16]; long double align; } scratch[MAX_FIELDS];
    PyObject *held[MAX_FIELDS] = {NULL};
    int ok = 1;
    for (Py_ssize_t k = 0; ok && k < n; k++)
        ok = stage_row(st, k, PySequence_Fast_GET_ITEM(seq, k), &src[k], scratch[k].bytes,
                       &held[k]);
    if (ok && i < 0)
        ok = (i = append_row(st, src, n)) >= 0;
    else if (ok)
        ok = store_row(st, i, meta, src, n) == 0;
    for (Py_ssize_t k = 0; k < n; k++) Py_XDECREF(held[k]);
    Py_DECREF(seq);
    return ok ? i : -2;
}

/* append(values): one row of checked values at the cursor, if room is left (store.py). */
static PyObject *store_append(LaneStore *st, PyObject *values) {
    if (!check_open(st)) return NULL;
    long long i = put_values(st, -1, 0, values, "append");
    if (i == -2) return NULL;
    if (i == -1) Py_RETURN_NONE;
    return PyLong_FromLongLong(i);
}

/* put(index, meta, values): one row of checked values at index (store.py). */
static PyObject *store_put(LaneStore *st, PyObject *const *args, Py_ssize_t nargs) {
    long long i, meta;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "put() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!check_open(st) || !as_ll(args[0], &i) || !as_ll(args[1], &meta)) return NULL;
    if (i < 0) {
        PyErr_Format(PyExc_ValueError, "put(): index %lld < 0", i);
        return NULL;
    }
    if (put_values(st, i, meta, args[2], "put") == -2) return NULL;
    Py_RETURN_NONE;
}

/* put_many(first, meta, arrays): rows first .. first + n - 1 (arrays [n, *shape]), keeping the
 * last `capacity` of them, as slots' ring steps store them; row j's meta word is meta's with
 * (step + j) in its step bits, one ring segment at a time (as extend's NumPy store has it). */
static PyObject *store_put_many(LaneStore *st, PyObject *const *args, Py_ssize_t nargs) {
    long long first, meta;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "put_many() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!check_open(st) || !as_ll(args[0], &first) || !as_ll(args[1], &meta)) return NULL;
    if (first < 0) {
        PyErr_Format(PyExc_ValueError, "put_many(): first index %lld < 0", first);
        return NULL;
    }
    PyObject *seq = values_of(st, args[2], "put_many");
    if (seq == NULL) return NULL;
    Py_ssize_t nvalues = PySequence_Fast_GET_SIZE(seq);
    Src src[MAX_FIELDS];
    PyObject *held[MAX_FIELDS] = {NULL};
    npy_intp n = -1;
    int ok = 1;
    for (Py_ssize_t k = 0; ok && k < nvalues; k++)
        ok = stage_rows(st, k, PySequence_Fast_GET_ITEM(seq, k), &n, &src[k], &held[k]);
    if (ok && n > 0) {
        const long long C = st->capacity, mask = st->step_mask;
        const long long keep = n < C ? n : C, skip = n - keep, lo = first + skip;
        const long long end = first + n, a0 = lo % C;
        const long long len0 = keep < C - a0 ? keep : C - a0; /* two ring segments at most */
        const long long seg_len[2] = {len0, keep - len0}, seg_slot[2] = {a0, 0};
        Py_ssize_t row_bytes = 0;
        int contiguous = 1; /* (strides are read from the arrays: the GIL stays held) */
        for (Py_ssize_t k = 0; k < st->ncolumns; k++) {
            row_bytes += st->fields[k].nbytes;
            contiguous &= src[k].strides == NULL;
        }
        Src part[MAX_FIELDS][2]; /* each field's rows of each segment, and NumPy's views */
        PyObject *views[MAX_FIELDS][2][2];
        Py_ssize_t nviews = 0;
        for (; nviews < st->ncolumns && ok; nviews++) {
            const Field *f = &st->fields[nviews];
            long long off = 0;
            for (int g = 0; g < 2; g++) {
                const npy_intp r = (npy_intp)(skip + off); /* the segment's first given row */
                part[nviews][g] = src[nviews];
                part[nviews][g].ptr += r * (src[nviews].strides ? src[nviews].strides[0]
                                                                : f->nbytes);
                views[nviews][g][0] = views[nviews][g][1] = NULL;
                if (ok && seg_len[g] > 0)
                    ok = numpy_copy_views(f, f->dest + seg_slot[g] * f->nbytes,
                                          &part[nviews][g], seg_len[g], 1, views[nviews][g]);
                off += seg_len[g];
            }
        }
        int64_t *w = st->words;
        if (ok) {
            if (end > load_word(w + st->w_reserved)) store_word(w + st->w_reserved, end);
            for (long long j = 0; j < keep; j++) /* (the line above: the claim) */
                store_word(w + st->stamp0 + (a0 + j) % C, 2 * (lo + j) + 1);
            store_order();
        }
        PyThreadState *save =
            ok && contiguous && keep * row_bytes >= NOGIL_BYTES ? PyEval_SaveThread() : NULL;
        if (ok && st->any_stream) _mm_sfence(); /* the odd stamps before any streamed byte */
        for (Py_ssize_t k = 0; k < st->ncolumns && ok; k++)
            for (int g = 0; g < 2 && seg_len[g] > 0 && ok; g++)
                ok = copy_block(&st->fields[k], st->fields[k].dest + seg_slot[g] *
                                st->fields[k].nbytes, &part[k][g], seg_len[g], 1, views[k][g]);
        if (st->any_stream) _mm_sfence(); /* every streamed byte before the even stamps */
        if (save) PyEval_RestoreThread(save);
        for (Py_ssize_t k = 0; k < nviews; k++)
            for (int g = 0; g < 2; g++) {
                Py_XDECREF(views[k][g][0]);
                Py_XDECREF(views[k][g][1]);
            }
        if (!ok) goto out; /* nothing stored, or the claimed slots stay odd, unpublished */
        long long off = 0;
        for (int g = 0; g < 2 && seg_len[g] > 0; g++) {
            const long long k0 = (meta & ~mask) | (((meta & mask) + skip + off) & mask);
            for (long long j = 0; j < seg_len[g]; j++)
                store_word(w + st->meta0 + seg_slot[g] + j, k0 + j);
            off += seg_len[g];
        }
        store_order();
        for (long long j = 0; j < keep; j++)
            store_word(w + st->stamp0 + (a0 + j) % C, 2 * (lo + j) + 2);
        store_order();
        store_word(w + st->w_committed, end);
        if (nvalues > st->ncolumns) { /* the pending row: the last next_obs */
            const Field *f = &st->fields[st->ncolumns];
            Src last = src[st->ncolumns];
            last.ptr += (n - 1) * (last.strides ? last.strides[0] : f->nbytes);
            if (last.strides) last.strides += 1;
            copy_rows(f, f->dest, &last, 1, 0);
        }
    }
out:
    for (Py_ssize_t k = 0; k < nvalues; k++) Py_XDECREF(held[k]);
    Py_DECREF(seq);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------- */
/* LaneStore: construction, release                                                          */
/* ---------------------------------------------------------------------------------------- */

static void release_views(LaneStore *self) {
    for (Py_ssize_t k = 0; k < MAX_FIELDS; k++)
        if (self->dest_views[k].obj) PyBuffer_Release(&self->dest_views[k]);
    if (self->words) {
        PyBuffer_Release(&self->words_view);
        self->words = NULL;
    }
}

static void clear_fields(LaneStore *self) {
    release_views(self);
    for (Py_ssize_t k = 0; k < self->nfields; k++) Py_CLEAR(self->fields[k].dtype);
    self->nfields = self->ncolumns = 0;
    Py_CLEAR(self->names);
}

static void store_dealloc(LaneStore *self) {
    clear_fields(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *store_release(LaneStore *self, PyObject *unused) {
    (void)unused;
    release_views(self);
    Py_RETURN_NONE;
}

static int word_index(Py_ssize_t at, Py_ssize_t count, const Py_buffer *view, const char *what) {
    if (at < 0 || (at + count) * 8 > view->len) {
        PyErr_Format(PyExc_ValueError, "LaneStore: %s: words %zd..%zd fall outside the segment",
                     what, at, at + count);
        return 0;
    }
    return 1;
}

/* Field k from its tuple (dtype, shape, dest, stream, numbers, bool_ok, float_any, int_lo,
 * int_hi, float_lo, float_hi): dest a writable C-contiguous buffer of `rows` rows. */
static int init_field(LaneStore *self, Py_ssize_t k, PyObject *spec, long long rows) {
    Field *f = &self->fields[k];
    PyObject *dtype_o, *shape_o, *dest_o;
    memset(f, 0, sizeof(*f));
    if (!PyArg_ParseTuple(spec, "OOOiiiiLLdd", &dtype_o, &shape_o, &dest_o, &f->stream,
                          &f->numbers, &f->bool_ok, &f->float_any, &f->int_lo, &f->int_hi,
                          &f->float_lo, &f->float_hi))
        return 0;
    if (!PyArray_DescrCheck(dtype_o) || PyDataType_REFCHK((PyArray_Descr *)dtype_o) ||
        !strchr("biufc", ((PyArray_Descr *)dtype_o)->kind)) {
        PyErr_Format(PyExc_TypeError, "LaneStore: field %zd: a bool, integer, float or complex "
                     "dtype", k);
        return 0;
    }
    Py_INCREF(dtype_o);
    f->dtype = (PyArray_Descr *)dtype_o;
    self->nfields = k + 1; /* from here on clear_fields owns the dtype */
    f->scalar_type = f->dtype->typeobj;
    if (!PyTuple_Check(shape_o) || PyTuple_GET_SIZE(shape_o) > NPY_MAXDIMS) {
        PyErr_Format(PyExc_ValueError, "LaneStore: field %zd: a shape of at most %d dimensions",
                     k, NPY_MAXDIMS);
        return 0;
    }
    f->ndim = (int)PyTuple_GET_SIZE(shape_o);
    f->kind = f->dtype->kind;
    f->itemsize = (int)PyDataType_ELSIZE(f->dtype);
    f->nbytes = f->itemsize;
    for (int j = 0; j < f->ndim; j++) {
        f->shape[j] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape_o, j));
        if (f->shape[j] < 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "LaneStore: field %zd: a negative extent", k);
            return 0;
        }
        f->nbytes *= f->shape[j];
    }
    int plain = strchr("biu", f->kind) != NULL ||
                (f->kind == 'f' && (f->itemsize == 4 || f->itemsize == 8));
    if (f->numbers && (f->ndim != 0 || f->nbytes > 16 || !PyDataType_ISNOTSWAPPED(f->dtype))) {
        PyErr_Format(PyExc_ValueError, "LaneStore: field %zd takes scalars but is not a scalar "
                     "field of at most 16 bytes in native byte order", k);
        return 0;
    }
    if (!plain && (f->bool_ok || f->float_any || f->int_lo <= f->int_hi ||
                   f->float_lo <= f->float_hi)) {
        PyErr_Format(PyExc_ValueError, "LaneStore: field %zd: Python numbers go only into "
                     "bool, int, float32 and float64 fields", k);
        return 0;
    }
    Py_buffer *view = &self->dest_views[k];
    if (PyObject_GetBuffer(dest_o, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return 0;
    if (view->len != rows * f->nbytes) {
        PyErr_Format(PyExc_ValueError, "LaneStore: field %zd: a destination of %zd bytes for "
                     "%lld rows of %zd", k, view->len, rows, f->nbytes);
        return 0;
    }
    f->dest = (char *)view->buf;
    self->any_stream |= f->stream;
    return 1;
}

/* LaneStore(words, (w_committed, w_reserved, w_lim_gen, stamp0, meta0, capacity, step_mask),
 *           names, columns, pending=None): words is the segment as a writable buffer of int64
 * words; columns one init_field tuple per stored field (capacity rows each), pending one for
 * the private row that keeps a derived buffer's last next_obs (one row), or None; names one per
 * column and pending row. Built by store.lane_store. */
static int store_init(LaneStore *self, PyObject *args, PyObject *kwds) {
    PyObject *words_o, *names_o, *columns_o, *pending_o = Py_None;
    Py_ssize_t w_committed, w_reserved, w_lim_gen, stamp0, meta0;
    long long capacity, step_mask;
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "LaneStore() takes no keyword arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O(nnnnnLL)O!O|O", &words_o, &w_committed, &w_reserved,
                          &w_lim_gen, &stamp0, &meta0, &capacity, &step_mask, &PyTuple_Type,
                          &names_o, &columns_o, &pending_o))
        return -1;
    clear_fields(self);
    self->any_stream = 0;
    self->next = self->step = self->episode_bits = self->room_until = 0;
    self->lim_gen = -1;
    if (capacity <= 0) {
        PyErr_SetString(PyExc_ValueError, "LaneStore: capacity must be positive");
        return -1;
    }
    PyObject *seq = PySequence_Fast(columns_o, "LaneStore: columns must be a sequence");
    if (!seq) return -1;
    Py_ssize_t ncolumns = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t n = ncolumns + (pending_o != Py_None);
    if (ncolumns < 1 || n > MAX_FIELDS || PyTuple_GET_SIZE(names_o) != n) {
        PyErr_Format(PyExc_ValueError, "LaneStore: 1 to %d fields, one name each (%zd fields, "
                     "%zd names)", MAX_FIELDS, n, PyTuple_GET_SIZE(names_o));
        goto fail;
    }
    self->names = PyTuple_New(n);
    if (!self->names) goto fail;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *name = PyTuple_GET_ITEM(names_o, k);
        if (!PyUnicode_CheckExact(name)) {
            PyErr_SetString(PyExc_TypeError, "LaneStore: names must be str");
            goto fail;
        }
        Py_INCREF(name);
        PyUnicode_InternInPlace(&name); /* as keyword names usually are: compared by identity */
        PyTuple_SET_ITEM(self->names, k, name);
    }
    if (PyObject_GetBuffer(words_o, &self->words_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto fail;
    self->words = (int64_t *)self->words_view.buf;
    if (((uintptr_t)self->words & 7) ||
        !word_index(w_committed, 1, &self->words_view, "committed") ||
        !word_index(w_reserved, 1, &self->words_view, "reserved") ||
        !word_index(w_lim_gen, 1, &self->words_view, "limiter generation") ||
        !word_index(stamp0, capacity, &self->words_view, "stamps") ||
        !word_index(meta0, capacity, &self->words_view, "meta"))
        goto fail;
    self->w_committed = w_committed, self->w_reserved = w_reserved, self->w_lim_gen = w_lim_gen;
    self->stamp0 = stamp0, self->meta0 = meta0, self->capacity = capacity;
    self->step_mask = step_mask;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *spec = k < ncolumns ? PySequence_Fast_GET_ITEM(seq, k) : pending_o;
        if (!init_field(self, k, spec, k < ncolumns ? capacity : 1)) goto fail;
    }
    self->ncolumns = ncolumns;
    if (n > ncolumns) self->fields[ncolumns].stream = 0; /* private memory, read again soon */
    Py_DECREF(seq);
    return 0;
fail:
    Py_DECREF(seq);
    clear_fields(self);
    return -1;
}

static PyObject *store_compiled(PyObject *self, void *closure) {
    (void)self, (void)closure;
    Py_RETURN_TRUE;
}

static PyMethodDef store_methods[] = {
    {"append", (PyCFunction)store_append, METH_O,
     "append(values) -> index or None: store one row of checked values at the cursor and "
     "advance it, if room is left; else store nothing."},
    {"put", (PyCFunction)(void (*)(void))store_put, METH_FASTCALL,
     "put(index, meta, values): store one row of checked values at logical index `index`."},
    {"put_many", (PyCFunction)(void (*)(void))store_put_many, METH_FASTCALL,
     "put_many(first, meta, arrays): store rows first .. first + n - 1."},
    {"release", (PyCFunction)store_release, METH_NOARGS,
     "Let go of the segment's memory (idempotent); put and put_many raise from then on."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef store_members[] = {
    {"next", T_LONGLONG, offsetof(LaneStore, next), 0, "the lane's next logical index"},
    {"step", T_LONGLONG, offsetof(LaneStore, step), 0, "steps in the current episode"},
    {"episode_bits", T_LONGLONG, offsetof(LaneStore, episode_bits), 0, "episode << STEP_BITS"},
    {"room_until", T_LONGLONG, offsetof(LaneStore, room_until), 0,
     "indices below it have room under the rate limiter ..."},
    {"lim_gen", T_LONGLONG, offsetof(LaneStore, lim_gen), 0, "... while its generation is this"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef store_getset[] = {
    {"compiled", store_compiled, NULL, "True: this store is compiled (_add_c.c).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject LaneStoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmbuf._add_c.LaneStore",
    .tp_basicsize = sizeof(LaneStore),
    .tp_dealloc = (destructor)store_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A lane's store, compiled: its cursor, put and put_many (see _add_c.c, store.py).",
    .tp_methods = store_methods,
    .tp_members = store_members,
    .tp_getset = store_getset,
    .tp_init = (initproc)store_init,
    .tp_new = PyType_GenericNew,
};

/* ---------------------------------------------------------------------------------------- */
/* AddMethod: a writer class's add                                                           */
/* ---------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback; /* the writer's Python add: (self, /, **fields) */
    PyObject *dict;     /* __signature__, __doc__, __name__, ... (store.add_method sets them) */
    int one_env;        /* a one-env vector writer's: rows [1, *shape], index as an array */
} AddMethod;

/* The field that keyword `name` names (its position in the call first), or -1. */
static Py_ssize_t field_of(PyObject *names, PyObject *name, Py_ssize_t guess) {
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    if (guess < n && PyTuple_GET_ITEM(names, guess) == name) return guess;
    for (Py_ssize_t k = 0; k < n; k++)
        if (PyTuple_GET_ITEM(names, k) == name) return k;
    for (Py_ssize_t k = 0; k < n; k++)
        if (PyUnicode_Compare(PyTuple_GET_ITEM(names, k), name) == 0) return k;
    return -1;
}

/* The row of `writer._store` stored at its cursor, if every field is given once and stores as
 * it is and room is left: the index it got (one_env: an int64 array of one). Else NULL, with
 * *done = 0 and nothing stored, or with *done = 1 and an exception (nothing stored either). */
static PyObject *add_row(const AddMethod *m, PyObject *writer, PyObject *const *values,
                         PyObject *kwnames, int *done) {
    *done = 0;
    PyObject *so = PyObject_GetAttr(writer, str_store);
    if (so == NULL) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *result = NULL;
    LaneStore *st = (LaneStore *)so;
    Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
    if (Py_TYPE(so) != &LaneStoreType || st->words == NULL || nkw != st->nfields) goto out;
    if (!room_left(st)) goto out;
    Src src[MAX_FIELDS];
    union { char bytes[16]; long double align; } scratch[MAX_FIELDS];
    uint64_t seen = 0;
    for (Py_ssize_t j = 0; j < nkw; j++) {
        Py_ssize_t k = field_of(st->names, PyTuple_GET_ITEM(kwnames, j), j);
        if (k < 0 || (seen >> k & 1) ||
            !take(&st->fields[k], values[j], m->one_env, &src[k], scratch[k].bytes))
            goto out;
        seen |= (uint64_t)1 << k;
    }
    *done = 1; /* the result is made before the first store: a failure here stores nothing */
    if (m->one_env) {
        npy_intp one = 1;
        result = PyArray_SimpleNew(1, &one, NPY_INT64);
        if (result) *(int64_t *)PyArray_DATA((PyArrayObject *)result) = st->next;
    } else {
        result = PyLong_FromLongLong(st->next);
    }
    if (result != NULL && append_row(st, src, st->nfields) < 0) Py_CLEAR(result);
out:
    Py_DECREF(so);
    return result;
}

static PyObject *add_vectorcall(AddMethod *m, PyObject *const *args, size_t nargsf,
                                PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) == 1 && kwnames != NULL) {
        int done;
        PyObject *r = add_row(m, args[0], args + 1, kwnames, &done);
        if (r != NULL || done) return r;
    }
    return PyObject_Vectorcall(m->fallback, args, nargsf, kwnames);
}

static PyObject *add_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *fallback;
    int one_env = 0;
    static char *kwlist[] = {"fallback", "one_env", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|p", kwlist, &fallback, &one_env)) return NULL;
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "AddMethod: fallback must be callable");
        return NULL;
    }
    AddMethod *m = (AddMethod *)type->tp_alloc(type, 0);
    if (m == NULL) return NULL;
    Py_INCREF(fallback);
    m->fallback = fallback;
    m->one_env = one_env;
    m->vectorcall = (vectorcallfunc)add_vectorcall;
    return (PyObject *)m;
}

static PyObject *add_get(PyObject *self, PyObject *obj, PyObject *type) {
    (void)type;
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static int add_traverse(AddMethod *m, visitproc visit, void *arg) {
    Py_VISIT(m->fallback);
    Py_VISIT(m->dict);
    return 0;
}

static int add_clear(AddMethod *m) {
    Py_CLEAR(m->fallback);
    Py_CLEAR(m->dict);
    return 0;
}

static void add_dealloc(AddMethod *m) {
    PyObject_GC_UnTrack(m);
    add_clear(m);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyGetSetDef add_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject AddMethodType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmbuf._add_c.AddMethod",
    .tp_basicsize = sizeof(AddMethod),
    .tp_dealloc = (destructor)add_dealloc,
    .tp_vectorcall_offset = offsetof(AddMethod, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "AddMethod(fallback, one_env=False): a writer class's add. It stores a row given "
              "as keywords into the writer's _store (a LaneStore) where every value stores as it "
              "is and room is left; it calls fallback(writer, **fields) otherwise.",
    .tp_traverse = (traverseproc)add_traverse,
    .tp_clear = (inquiry)add_clear,
    .tp_getset = add_getset,
    .tp_descr_get = add_get,
    .tp_dictoffset = offsetof(AddMethod, dict),
    .tp_new = add_new,
};

/* ---------------------------------------------------------------------------------------- */
/* One row in each of several lanes                                                          */
/* ---------------------------------------------------------------------------------------- */

/* put_lanes(stores, index, meta, values): row e of every value ([n, *shape], one per stored
 * column; values past those are not stored) at index[e] of stores[e]'s lane, with meta word
 * meta[e]: each row by store_row, lane after lane, as put() stores one (a vector writer's step
 * of every env: store.py CompiledLanesStore). The stores are of one spec. A failed copy leaves
 * that lane's slot as store_row says, and the lanes after it untouched. */
static PyObject *put_lanes(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "put_lanes() takes 4 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *stores = PySequence_Fast(args[0], "stores must be a sequence");
    if (stores == NULL) return NULL;
    PyArrayObject *index = NULL, *meta = NULL;
    PyObject *seq = NULL, *result = NULL, *held[MAX_FIELDS] = {NULL};
    Src src[MAX_FIELDS];
    Py_ssize_t nv = 0, n = PySequence_Fast_GET_SIZE(stores);
    LaneStore *st0 = NULL;
    for (Py_ssize_t e = 0; e < n; e++) {
        PyObject *st = PySequence_Fast_GET_ITEM(stores, e);
        if (!PyObject_TypeCheck(st, &LaneStoreType)) {
            PyErr_SetString(PyExc_TypeError, "put_lanes(): stores must be LaneStores");
            goto done;
        }
        if (!check_open((LaneStore *)st)) goto done;
        if (st0 == NULL) st0 = (LaneStore *)st;
        if (((LaneStore *)st)->ncolumns != st0->ncolumns) {
            PyErr_SetString(PyExc_ValueError, "put_lanes(): stores of different specs");
            goto done;
        }
    }
    index = (PyArrayObject *)PyArray_FROMANY(args[1], NPY_INT64, 1, 1, NPY_ARRAY_CARRAY_RO);
    meta = (PyArrayObject *)PyArray_FROMANY(args[2], NPY_INT64, 1, 1, NPY_ARRAY_CARRAY_RO);
    if (index == NULL || meta == NULL) goto done;
    if (PyArray_DIMS(index)[0] != n || PyArray_DIMS(meta)[0] != n) {
        PyErr_Format(PyExc_ValueError, "put_lanes(): %zd stores, %zd indices, %zd meta words", n,
                     (Py_ssize_t)PyArray_DIMS(index)[0], (Py_ssize_t)PyArray_DIMS(meta)[0]);
        goto done;
    }
    if (n == 0) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    const int64_t *at = (const int64_t *)PyArray_DATA(index);
    const int64_t *words = (const int64_t *)PyArray_DATA(meta);
    for (Py_ssize_t e = 0; e < n; e++) {
        if (at[e] < 0) {
            PyErr_Format(PyExc_ValueError, "put_lanes(): index %lld < 0", (long long)at[e]);
            goto done;
        }
    }
    if ((seq = values_of(st0, args[3], "put_lanes")) == NULL) goto done;
    nv = st0->ncolumns; /* (a pending next_obs value, if given, is not stored) */
    for (Py_ssize_t k = 0; k < nv; k++) {
        npy_intp rows = n;
        if (!stage_rows(st0, k, PySequence_Fast_GET_ITEM(seq, k), &rows, &src[k], &held[k]))
            goto done;
    }
    for (Py_ssize_t e = 0; e < n; e++) {
        Src row[MAX_FIELDS];
        for (Py_ssize_t k = 0; k < nv; k++) {
            const npy_intp *strides = src[k].strides;
            row[k].ptr = src[k].ptr + e * (strides ? strides[0] : st0->fields[k].nbytes);
            row[k].strides = strides ? strides + 1 : NULL;
        }
        LaneStore *st = (LaneStore *)PySequence_Fast_GET_ITEM(stores, e);
        if (store_row(st, (long long)at[e], (long long)words[e], row, nv) < 0) goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t k = 0; k < nv; k++) Py_XDECREF(held[k]);
    Py_XDECREF(seq);
    Py_XDECREF(index);
    Py_XDECREF(meta);
    Py_DECREF(stores);
    return result;
}

static PyMethodDef module_methods[] = {
    {"put_lanes", (PyCFunction)(void (*)(void))put_lanes, METH_FASTCALL,
     "put_lanes(stores, index, meta, values): one row in each store's lane (store.py)."},
    {NULL, NULL, 0, NULL},
};

/* ---------------------------------------------------------------------------------------- */

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_add_c",
                                    "A lane's store and a writer's add, compiled (optional).",
                                    -1, module_methods, NULL, NULL, NULL, NULL};

static int add_type(PyObject *m, PyTypeObject *type, const char *name) {
    if (PyType_Ready(type) < 0) return -1;
    Py_INCREF(type);
    if (PyModule_AddObject(m, name, (PyObject *)type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

PyMODINIT_FUNC PyInit__add_c(void) {
    import_array();
    str_store = PyUnicode_InternFromString("_store");
    if (!str_store) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "MAX_FIELDS", MAX_FIELDS) < 0 ||
        add_type(m, &LaneStoreType, "LaneStore") < 0 ||
        add_type(m, &AddMethodType, "AddMethod") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
