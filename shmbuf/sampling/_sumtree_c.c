/* The sum tree's walks (sumtree.sample's descent, update, fill and fix_top), compiled.
 *
 * An optional speed-up of shmbuf/sampling/sumtree.py, built when a C compiler is at hand
 * (setup.py marks the extension optional) and used by it when importable; the NumPy code stays
 * the reference and the fallback. Same layout (one lane's tree per row of a [lanes, width]
 * float64 array, leaves first, FANOUT children per node, the root last), same arithmetic:
 * a parent is the halving sum of its children (c[i] + c[i + 8], then + 4, + 2, + 1), so trees
 * updated here are bit-identical to trees updated by NumPy, and a descent takes the child whose
 * prefix-sum interval holds what is left of the draw.
 *
 * Arrays arrive through the buffer protocol (no NumPy headers at build time): C-contiguous,
 * float64 ('d') or int64 ('l'/'q'). Every index is checked before a store.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define FANOUT 16
#define FANOUT_BITS 4
#define MAX_LEVELS 32
/* How many draws ahead a pass over the batch fetches the block it will need: enough to hide
 * a miss to memory, few enough that the fetches in flight stay within what the core tracks
 * (fetching a whole level ahead at once was slower on a 10M-row tree: most were dropped). */
#ifndef AHEAD
#define AHEAD 16
#endif

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, char kind,
                      const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    int ok = view->itemsize == 8 &&
             (kind == 'd' ? strcmp(f, "d") == 0 : (strcmp(f, "l") == 0 || strcmp(f, "q") == 0));
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous %s array", name,
                     kind == 'd' ? "float64" : "int64");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The geometry: per level (leaves first, the root last) its column offset and the largest node
 * a descent may pass down into it (see sumtree._last_nodes; the root's entry is unused). */
typedef struct {
    Py_ssize_t levels;
    int64_t offset[MAX_LEVELS];
    int64_t last[MAX_LEVELS];
} geometry;

static int parse_geometry(PyObject *obj, Py_ssize_t width, geometry *g) {
    Py_buffer view;
    if (width <= 0) {
        PyErr_SetString(PyExc_ValueError, "width must be positive");
        return -1;
    }
    if (get_buffer(obj, &view, 0, 'q', "geometry") < 0) return -1;
    Py_ssize_t n = view.len / 16;
    const int64_t *rows = (const int64_t *)view.buf;
    int bad = n < 2 || n > MAX_LEVELS || view.len != n * 16 || rows[0] != 0 ||
              rows[2 * (n - 1)] != width - 1;
    for (Py_ssize_t l = 0; !bad && l < n; l++) {
        g->offset[l] = rows[2 * l];
        g->last[l] = rows[2 * l + 1];
    }
    /* What every walk relies on to stay inside the row: each level below the root a whole
     * number of blocks, room in the level above for a parent per block (the top level one
     * block, under the root), and the nodes a descent may reach with their blocks inside the
     * level below. */
    for (Py_ssize_t l = 0; !bad && l + 1 < n; l++) {
        int64_t size = g->offset[l + 1] - g->offset[l];
        int64_t above = l + 2 < n ? g->offset[l + 2] - g->offset[l + 1] : 1;
        int64_t below_blocks = l ? (g->offset[l] - g->offset[l - 1]) / FANOUT : size;
        bad = size < FANOUT || size % FANOUT || above < size / FANOUT ||
              (l + 2 == n && size != FANOUT) || g->last[l] < 0 || g->last[l] >= size ||
              g->last[l] >= below_blocks;
    }
    g->levels = n;
    PyBuffer_Release(&view);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "geometry does not describe a sum tree of this width");
        return -1;
    }
    return 0;
}

/* Release the views a call took (those it got to before an error, too). */
static void release(Py_buffer *const views[], int n) {
    for (int i = 0; i < n; i++)
        if (views[i]->obj) PyBuffer_Release(views[i]);
}

static inline double halving_sum(const double *c) {
    double a[8], b[4];
    for (int i = 0; i < 8; i++) a[i] = c[i] + c[i + 8];
    for (int i = 0; i < 4; i++) b[i] = a[i] + a[i + 4];
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline double positive_or_inf(double v) { return v > 0 ? v : INFINITY; }

/* The smallest of a block (pairwise: no chain of 15 compares); with positive, of its positive
 * values (inf for none), which is what the min tree holds above a block of sum-tree leaves. */
static inline double smallest(const double *c, int positive) {
    double a[8], b[4];
    for (int i = 0; i < 8; i++) {
        double x = c[i], y = c[i + 8];
        if (positive) x = positive_or_inf(x), y = positive_or_inf(y);
        a[i] = y < x ? y : x;
    }
    for (int i = 0; i < 4; i++) b[i] = a[i + 4] < a[i] ? a[i + 4] : a[i];
    double d0 = b[2] < b[0] ? b[2] : b[0], d1 = b[3] < b[1] ? b[3] : b[1];
    return d1 < d0 ? d1 : d0;
}

/* The child of a block of FANOUT children whose interval holds *x (what is left of a draw
 * within their parent), and *x less the children before it: the first child whose inclusive
 * prefix sum is above *x, found by halving (sums of 8, 4, 2 and 1 children, built in parallel)
 * rather than by a chain of 15 dependent additions. */
static inline int pick_child(const double *c, double *x) {
    double p2[8], p4[4], p8;
    for (int i = 0; i < 8; i++) p2[i] = c[2 * i] + c[2 * i + 1];
    for (int i = 0; i < 4; i++) p4[i] = p2[2 * i] + p2[2 * i + 1];
    p8 = p4[0] + p4[1];
    double v = *x;
    int k = 0, go;
    go = v >= p8;
    v -= go * p8;
    k |= go << 3;
    go = v >= p4[k >> 2];
    v -= go * p4[k >> 2];
    k |= go << 2;
    go = v >= p2[k >> 1];
    v -= go * p2[k >> 1];
    k |= go << 1;
    go = v >= c[k];
    v -= go * c[k];
    k |= go;
    *x = v;
    return k;
}

/* A parent at level + 1 recomputed from its block of children at level (row-relative). Above
 * the leaves, the min is taken over the sum tree's leaves (the min tree's leaves are their
 * positive values, as NumPy's update takes it too): the min tree's leaves are only written,
 * which saves the batch a cache miss per leaf on a large tree. */
static inline void recompute(double *s, double *m, const geometry *g, Py_ssize_t level,
                             int64_t parent) {
    int64_t first = g->offset[level] + (parent << FANOUT_BITS);
    s[g->offset[level + 1] + parent] = halving_sum(s + first);
    m[g->offset[level + 1] + parent] = level ? smallest(m + first, 0) : smallest(s + first, 1);
}

/* Ask for the cache lines of a block of FANOUT doubles (three when a lane's row does not start
 * on a line). */
static inline void fetch_block(const double *c) {
    __builtin_prefetch(c);
    __builtin_prefetch(c + FANOUT / 2);
    __builtin_prefetch(c + FANOUT - 1);
}

/* update(sums, mins, geometry, lanes, leaves, values): set each value (>= 0) at its leaf of its
 * lane and recompute its ancestors from their children, in order: where a (lane, leaf) repeats
 * the last value wins. lanes may be None (one lane). */
static PyObject *update(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *sums_o, *mins_o, *geom_o, *lanes_o, *leaves_o, *values_o;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "OOnOOOO", &sums_o, &mins_o, &width, &geom_o, &lanes_o,
                          &leaves_o, &values_o))
        return NULL;
    geometry g;
    if (parse_geometry(geom_o, width, &g) < 0) return NULL;
    Py_buffer sums = {0}, mins = {0}, lanes = {0}, leaves = {0}, values = {0};
    PyObject *result = NULL;
    if (get_buffer(sums_o, &sums, 1, 'd', "sums") < 0) goto done;
    if (get_buffer(mins_o, &mins, 1, 'd', "mins") < 0) goto done;
    if (get_buffer(leaves_o, &leaves, 0, 'q', "leaves") < 0) goto done;
    if (get_buffer(values_o, &values, 0, 'd', "values") < 0) goto done;
    if (lanes_o != Py_None && get_buffer(lanes_o, &lanes, 0, 'q', "lanes") < 0) goto done;
    Py_ssize_t n = leaves.len / 8, rows = sums.len / 8 / width;
    if (sums.len != rows * width * 8 || mins.len != sums.len || values.len != leaves.len ||
        (lanes.buf && lanes.len != leaves.len)) {
        PyErr_SetString(PyExc_ValueError, "update: arrays of mismatched sizes");
        goto done;
    }
    const int64_t *lane = lanes.buf, *leaf = leaves.buf;
    const double *value = values.buf;
    double *s = sums.buf, *m = mins.buf;
    int64_t leaf_count = g.offset[1];
    for (Py_ssize_t i = 0; i < n; i++) {  /* every index is checked before any store */
        int64_t l = lane ? lane[i] : 0;
        if (leaf[i] < 0 || leaf[i] >= leaf_count || l < 0 || l >= rows) {
            PyErr_Format(PyExc_IndexError, "update: leaf %lld of lane %lld is not in the tree",
                         (long long)leaf[i], (long long)l);
            goto done;
        }
    }
    int64_t *node = PyMem_Malloc(n > 0 ? n * sizeof(int64_t) : 1);
    if (!node) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    /* Level by level over the batch: every leaf, in order, then each level's touched parents
     * from their children, which are final by then (a parent touched twice is recomputed
     * twice, to the same value). Each pass fetches the block it will need AHEAD draws later,
     * so that the cache misses of a large tree overlap. */
    for (Py_ssize_t i = 0; i < n + AHEAD; i++) {
        if (i < n) {
            int64_t base = (lane ? lane[i] : 0) * (int64_t)width;
            fetch_block(s + base + (leaf[i] & ~(int64_t)(FANOUT - 1)));
            __builtin_prefetch(m + base + leaf[i], 1);  /* (only written: see recompute) */
        }
        Py_ssize_t j = i - AHEAD;
        if (j >= 0) {
            int64_t at = (lane ? lane[j] : 0) * (int64_t)width + leaf[j];
            s[at] = value[j];
            m[at] = positive_or_inf(value[j]);
            node[j] = leaf[j];  /* from here: the node's index within its level */
        }
    }
    for (Py_ssize_t level = 0; level + 1 < g.levels; level++) {
        for (Py_ssize_t i = 0; i < n + AHEAD; i++) {
            if (i < n && level) {
                int64_t first = (lane ? lane[i] : 0) * (int64_t)width + g.offset[level] +
                                ((node[i] >> FANOUT_BITS) << FANOUT_BITS);
                fetch_block(s + first);
                fetch_block(m + first);
            }
            Py_ssize_t j = i - AHEAD;
            if (j >= 0) {
                double *row = s + (lane ? lane[j] : 0) * (int64_t)width;
                double *mrow = m + (lane ? lane[j] : 0) * (int64_t)width;
                node[j] >>= FANOUT_BITS;
                recompute(row, mrow, &g, level, node[j]);
            }
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(node);
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release((Py_buffer *const[]){&sums, &mins, &lanes, &leaves, &values}, 5);
    return result;
}

/* sample(sums, width, geometry, u, lanes_out, leaves_out) -> drawn mass: for each u in [0, 1),
 * the lane and leaf whose prefix-sum interval holds u * (the sum of every lane's root), lanes in
 * proportion to their roots. Raises ValueError if that sum is not positive. The tree may be
 * updated by another process during the walk: every node passed down is clamped to the level,
 * so a torn read can only yield a leaf that the caller finds worthless and draws again. */
static PyObject *sample(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *sums_o, *geom_o, *u_o, *lanes_o, *leaves_o;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "OnOOOO", &sums_o, &width, &geom_o, &u_o, &lanes_o, &leaves_o))
        return NULL;
    geometry g;
    if (parse_geometry(geom_o, width, &g) < 0) return NULL;
    Py_buffer sums = {0}, u = {0}, lanes = {0}, leaves = {0};
    PyObject *result = NULL;
    if (get_buffer(sums_o, &sums, 0, 'd', "sums") < 0) goto done;
    if (get_buffer(u_o, &u, 0, 'd', "u") < 0) goto done;
    if (get_buffer(lanes_o, &lanes, 1, 'q', "lanes_out") < 0) goto done;
    if (get_buffer(leaves_o, &leaves, 1, 'q', "leaves_out") < 0) goto done;
    Py_ssize_t n = u.len / 8, rows = sums.len / 8 / width;
    if (rows < 1 || sums.len != rows * width * 8 || lanes.len != u.len || leaves.len != u.len) {
        PyErr_SetString(PyExc_ValueError, "sample: arrays of mismatched sizes");
        goto done;
    }
    const double *s = sums.buf, *draw = u.buf;
    int64_t *lane_out = lanes.buf, *leaf_out = leaves.buf;
    double drawn = 0.0;
    for (Py_ssize_t r = 0; r < rows; r++) drawn += s[r * width + width - 1];
    if (!(drawn > 0)) {
        PyErr_SetString(PyExc_ValueError, "every priority is zero");
        goto done;
    }
    double below_drawn = nextafter(drawn, 0.0);
    double *left = PyMem_Malloc(n > 0 ? n * sizeof(double) : 1);
    if (!left) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {  /* the lane, by the roots in order */
        double x = draw[i] * drawn;
        if (x >= drawn) x = below_drawn;
        Py_ssize_t r = 0;
        for (; r + 1 < rows; r++) {
            double root = s[r * width + width - 1];
            if (x < root) break;
            x -= root;
        }
        lane_out[i] = r;
        leaf_out[i] = 0;  /* the node reached so far, within its level: the root */
        left[i] = x;  /* what is left of the draw within that node */
    }
    /* Level by level over the batch, each pass fetching the block it will need AHEAD draws
     * later, so that the cache misses of a large tree overlap. */
    for (Py_ssize_t level = g.levels - 2; level >= 0; level--) {
        const double *blocks = s + g.offset[level];
        for (Py_ssize_t i = 0; i < n + AHEAD; i++) {
            if (i < n) fetch_block(blocks + lane_out[i] * width + (leaf_out[i] << FANOUT_BITS));
            Py_ssize_t j = i - AHEAD;
            if (j >= 0) {
                const double *c = blocks + lane_out[j] * width + (leaf_out[j] << FANOUT_BITS);
                int64_t node = (leaf_out[j] << FANOUT_BITS) + pick_child(c, left + j);
                leaf_out[j] = node > g.last[level] ? g.last[level] : node;
            }
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(left);
    result = PyFloat_FromDouble(drawn);
done:
    release((Py_buffer *const[]){&sums, &u, &lanes, &leaves}, 4);
    return result;
}

/* fill(sums, mins, width, geometry, lane, start, values): set leaves [start, start + n) of lane
 * and recompute every ancestor of the run, level by level up to the root (sumtree.fill). */
static PyObject *fill(PyObject *self, PyObject *args) {
    PyObject *sums_o, *mins_o, *geom_o, *values_o;
    Py_ssize_t width, lane, start;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOnOnnO", &sums_o, &mins_o, &width, &geom_o, &lane, &start,
                          &values_o))
        return NULL;
    geometry g;
    if (parse_geometry(geom_o, width, &g) < 0) return NULL;
    Py_buffer sums = {0}, mins = {0}, values = {0};
    PyObject *result = NULL;
    if (get_buffer(sums_o, &sums, 1, 'd', "sums") < 0) goto done;
    if (get_buffer(mins_o, &mins, 1, 'd', "mins") < 0) goto done;
    if (get_buffer(values_o, &values, 0, 'd', "values") < 0) goto done;
    Py_ssize_t n = values.len / 8, rows = sums.len / 8 / width;
    if (sums.len != rows * width * 8 || mins.len != sums.len) {
        PyErr_SetString(PyExc_ValueError, "fill: arrays of mismatched sizes");
        goto done;
    }
    if (lane < 0 || lane >= rows || start < 0 || start + n > g.offset[1]) {
        PyErr_Format(PyExc_IndexError, "fill: leaves [%zd, %zd) of lane %zd are not in the tree",
                     start, start + n, lane);
        goto done;
    }
    if (n > 0) {
        double *row = (double *)sums.buf + lane * width, *mrow = (double *)mins.buf + lane * width;
        const double *value = values.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            row[start + i] = value[i];
            mrow[start + i] = positive_or_inf(value[i]);
        }
        int64_t lo = start, hi = start + n;  /* the run's nodes in the level below, [lo, hi) */
        for (Py_ssize_t level = 0; level + 1 < g.levels; level++) {
            lo >>= FANOUT_BITS;
            hi = ((hi - 1) >> FANOUT_BITS) + 1;
            for (int64_t parent = lo; parent < hi; parent++) recompute(row, mrow, &g, level, parent);
        }
        Py_END_ALLOW_THREADS
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release((Py_buffer *const[]){&sums, &mins, &values}, 3);
    return result;
}

/* rebuild_above(sums, mins, width, geometry, first): recompute every parent above level first
 * of every lane from its children (the padding parents, which have none, are left alone). */
static PyObject *rebuild_above(PyObject *self, PyObject *args) {
    PyObject *sums_o, *mins_o, *geom_o;
    Py_ssize_t width, first;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOnOn", &sums_o, &mins_o, &width, &geom_o, &first)) return NULL;
    geometry g;
    if (parse_geometry(geom_o, width, &g) < 0) return NULL;
    Py_buffer sums = {0}, mins = {0};
    PyObject *result = NULL;
    if (get_buffer(sums_o, &sums, 1, 'd', "sums") < 0) goto done;
    if (get_buffer(mins_o, &mins, 1, 'd', "mins") < 0) goto done;
    Py_ssize_t rows = sums.len / 8 / width;
    if (sums.len != rows * width * 8 || mins.len != sums.len || first < 0 ||
        first + 1 >= g.levels) {
        PyErr_SetString(PyExc_ValueError, "rebuild_above: bad sizes or level");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++) {
        double *row = (double *)sums.buf + r * width, *mrow = (double *)mins.buf + r * width;
        for (Py_ssize_t level = first; level + 1 < g.levels; level++) {
            int64_t parents = (g.offset[level + 1] - g.offset[level]) >> FANOUT_BITS;
            for (int64_t parent = 0; parent < parents; parent++)
                recompute(row, mrow, &g, level, parent);
        }
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    release((Py_buffer *const[]){&sums, &mins}, 2);
    return result;
}

static PyMethodDef methods[] = {
    {"update", update, METH_VARARGS, "Set leaves and recompute their ancestors (sumtree.update)."},
    {"sample", sample, METH_VARARGS, "Descend draws u in [0, 1) to lanes and leaves."},
    {"fill", fill, METH_VARARGS, "Set a run of leaves and recompute its ancestors (sumtree.fill)."},
    {"rebuild_above", rebuild_above, METH_VARARGS, "Recompute every parent above a level."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sumtree_c",
                                    "The sum tree's per-batch walks, compiled (optional).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__sumtree_c(void) { return PyModule_Create(&module); }
