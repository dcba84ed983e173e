/* Row stores that stream past the caches: what a writer copies large rows (an Atari frame
 * stack, 28 KB) into a buffer with; and the one fence Python cannot issue (full_fence).
 *
 * An optional speed-up, built by setup.py where a C compiler is at hand: without it (or where
 * a call answers False) the writer stores with NumPy. A row written into a replay buffer is
 * read, if ever, by another process long after, mostly from memory: an ordinary store first
 * reads each cache line it writes (read for ownership) and then evicts something the writer
 * or the samplers were using; a non-temporal store does neither, and copies a 28 KB row in
 * about half the time.
 *
 * Ordering. Non-temporal stores are not ordered with other stores on x86-64, and the seqlock
 * (shmbuf/slots.py) needs the row's bytes to become visible after the slot's odd stamp and
 * before its even one. Each call therefore fences before its first store (the caller's odd
 * stamp goes first) and after its last (the caller's even stamp goes after): a reader that
 * reads the same even stamp before and after its copy cannot have seen a byte of a new row.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "_stream_copy.h"

static const char *plain_format(const char *f) {
    if (!f) return "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    return f;
}

/* store_rows(column, first, values, count) -> bool: copy values (count rows of column's row
 * shape) into rows first .. first + count - 1 of column (a C-contiguous array, rows along its
 * first axis), streaming. False, with nothing stored, where values is not a C-contiguous
 * buffer of the column's exact item format and count rows' bytes: the caller then stores it
 * with NumPy, which converts, broadcasts or explains. IndexError where the rows fall outside. */
static PyObject *store_rows(PyObject *self, PyObject *args) {
    PyObject *column_o, *values_o;
    Py_ssize_t first, count;
    (void)self;
    if (!PyArg_ParseTuple(args, "OnOn", &column_o, &first, &values_o, &count)) return NULL;
    Py_buffer column, values;
    if (PyObject_GetBuffer(column_o, &column,
                           PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(values_o, &values, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();  /* not a contiguous buffer: NumPy's business */
        PyBuffer_Release(&column);
        Py_RETURN_FALSE;
    }
    PyObject *result = Py_False;
    Py_ssize_t rows = column.ndim ? column.shape[0] : 0;
    Py_ssize_t row_bytes = rows ? column.len / rows : 0;
    if (row_bytes > 0 && count > 0 && values.len == count * row_bytes &&
        values.itemsize == column.itemsize &&
        strcmp(plain_format(values.format), plain_format(column.format)) == 0) {
        Py_ssize_t n = count;
        if (first < 0 || first + n > rows) {
            PyErr_Format(PyExc_IndexError, "rows [%zd, %zd) of a column of %zd rows", first,
                         first + n, rows);
            result = NULL;
        } else {
            char *dst = (char *)column.buf + first * row_bytes;
            Py_BEGIN_ALLOW_THREADS
            _mm_sfence();  /* the caller's odd stamps before any byte of the rows */
            stream_copy(dst, values.buf, values.len);
            _mm_sfence();  /* every byte of the rows before the caller's even stamps */
            Py_END_ALLOW_THREADS
            result = Py_True;
        }
    }
    PyBuffer_Release(&column);
    PyBuffer_Release(&values);
    Py_XINCREF(result);
    return result;
}

/* full_fence(): a StoreLoad barrier (mfence on x86-64): every store before the call is
 * visible to other CPUs before any load after it. shmbuf/slots.py's full_fence, for the
 * sleep/wake-up handshakes; without this module it takes an uncontended lock instead, which
 * costs several times as much on a cold core (a learner waking from its train step). */
static PyObject *full_fence(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"store_rows", store_rows, METH_VARARGS, "Copy rows into a column, streaming past caches."},
    {"full_fence", full_fence, METH_NOARGS, "A StoreLoad barrier (mfence)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stream_c",
                                    "Row stores that stream past the caches, and a full fence (optional).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__stream_c(void) { return PyModule_Create(&module); }
