/* CPython entry points of the recurrent-layer kernels (qk_recurrent.h), added to
 * kvlab.kernels._qk by kv_recurrent_add_methods. Tensors cross as raw addresses plus sizes;
 * kvlab/kernels/recurrent.py checks dtypes and shapes before calling, the slots and lens are
 * checked here (a loop in C, where torch's reductions would cost more than a decode step's
 * kernel). Each call releases the GIL and holds the job lock (the thread pool serves one job
 * at a time). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdarg.h>
#include <stdlib.h>

#include "qk.h"
#include "qk_recurrent.h"
#include "qk_runtime.h"

/* the arguments by spec: 'p' an address (void **), 'i' an int64_t *, 'f' a float * */
static int rc_args(PyObject *const *args, Py_ssize_t nargs, const char *spec, ...) {
    const Py_ssize_t want = (Py_ssize_t)strlen(spec);
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return 0;
    }
    va_list ap;
    va_start(ap, spec);
    for (Py_ssize_t a = 0; a < want; a++) {
        if (spec[a] == 'p') *va_arg(ap, void **) = PyLong_AsVoidPtr(args[a]);
        else if (spec[a] == 'i') *va_arg(ap, int64_t *) = PyLong_AsLongLong(args[a]);
        else *va_arg(ap, float *) = (float)PyFloat_AsDouble(args[a]);
        if (PyErr_Occurred()) break;
    }
    va_end(ap);
    return !PyErr_Occurred();
}

static int rc_positive(const char *names, int n, ...) {
    va_list ap;
    va_start(ap, n);
    int ok = 1;
    for (int a = 0; a < n; a++) ok &= va_arg(ap, int64_t) > 0;
    va_end(ap);
    if (!ok) PyErr_Format(PyExc_ValueError, "%s must all be positive", names);
    return ok;
}

/* each sequence's slot in [0, num_slots) and used once, its token count >= 0, T in all */
static int rc_segments(const int64_t *slots, const int64_t *lens, int64_t S, int64_t T,
                       int64_t num_slots) {
    char *used = calloc((size_t)num_slots + 1, 1);
    if (!used) return PyErr_NoMemory(), 0;
    int64_t total = 0, s = 0;
    for (; s < S && lens[s] >= 0 && slots[s] >= 0 && slots[s] < num_slots && !used[slots[s]]; s++) {
        used[slots[s]] = 1;
        total += lens[s];
    }
    free(used);
    if (s < S && lens[s] < 0)
        PyErr_Format(PyExc_ValueError, "lens must be >= 0, got %lld for sequence %lld",
                     (long long)lens[s], (long long)s);
    else if (s < S && (slots[s] < 0 || slots[s] >= num_slots))
        PyErr_Format(PyExc_ValueError, "slots must lie in [0, %lld), got %lld for sequence %lld",
                     (long long)num_slots, (long long)slots[s], (long long)s);
    else if (s < S)
        PyErr_Format(PyExc_ValueError, "slots must be distinct, got %lld twice",
                     (long long)slots[s]);
    else if (total != T)
        PyErr_Format(PyExc_ValueError, "lens sum to %lld but there are %lld tokens",
                     (long long)total, (long long)T);
    return !PyErr_Occurred();
}

/* 0 portable, 1 AVX2, 2 AVX-512: the widest the active kernel set and the CPU allow */
static int rc_isa(void) {
#ifdef KV_HAVE_AVX2_BUILD
    if (kv_avx2_active()) return kv_use_vnni() ? 2 : 1;
#endif
    return 0;
}

#define RC_CALL(rc, call)        \
    Py_BEGIN_ALLOW_THREADS       \
    kv_job_lock();               \
    rc = (call);                 \
    kv_job_unlock();             \
    Py_END_ALLOW_THREADS         \
    if (rc) return PyErr_NoMemory(); \
    Py_RETURN_NONE;

/* short_conv(x, w, bias | 0, states, slots, lens, out, S, T, num_slots, C, K, silu) */
static PyObject *py_short_conv(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *x, *w, *bias, *states, *slots, *lens, *out;
    int64_t S, T, num_slots, C, K, silu;
    if (!rc_args(args, nargs, "pppppppiiiiii", &x, &w, &bias, &states, &slots, &lens, &out, &S,
                 &T, &num_slots, &C, &K, &silu))
        return NULL;
    if (!rc_positive("C, K", 2, C, K) || !rc_segments(slots, lens, S, T, num_slots)) return NULL;
    int rc;
    RC_CALL(rc, kv_short_conv(x, w, bias, states, slots, lens, S, C, K, (int)silu, out, rc_isa()))
}

/* gated_delta_rule(q, k, v, g, beta, states, slots, lens, out, S, T, num_slots, Hk, Hv, Dk,
 * Dv, scale) */
static PyObject *py_gated_delta_rule(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *q, *k, *v, *g, *beta, *states, *slots, *lens, *out;
    int64_t S, T, num_slots, Hk, Hv, Dk, Dv;
    float scale;
    if (!rc_args(args, nargs, "pppppppppiiiiiiif", &q, &k, &v, &g, &beta, &states, &slots,
                 &lens, &out, &S, &T, &num_slots, &Hk, &Hv, &Dk, &Dv, &scale))
        return NULL;
    if (!rc_positive("Hk, Hv, Dk, Dv", 4, Hk, Hv, Dk, Dv) ||
        !rc_segments(slots, lens, S, T, num_slots))
        return NULL;
    if (Hv % Hk)
        return PyErr_Format(PyExc_ValueError, "value heads (%lld) must be a multiple of key "
                            "heads (%lld)", (long long)Hv, (long long)Hk);
    int rc;
    RC_CALL(rc, kv_gated_delta_rule(q, k, v, g, beta, states, slots, lens, S, Hk, Hv, Dk, Dv,
                                    scale, out, rc_isa()))
}

/* ssd_scan(x, dt, A, B, C, D | 0, states, slots, lens, out, S, T, num_slots, H, P, G, N) */
static PyObject *py_ssd_scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *x, *dt, *A, *B, *C, *D, *states, *slots, *lens, *out;
    int64_t S, T, num_slots, H, P, G, N;
    if (!rc_args(args, nargs, "ppppppppppiiiiiii", &x, &dt, &A, &B, &C, &D, &states, &slots,
                 &lens, &out, &S, &T, &num_slots, &H, &P, &G, &N))
        return NULL;
    if (!rc_positive("H, P, G, N", 4, H, P, G, N) || !rc_segments(slots, lens, S, T, num_slots))
        return NULL;
    if (H % G)
        return PyErr_Format(PyExc_ValueError, "heads (%lld) must be a multiple of groups "
                            "(%lld)", (long long)H, (long long)G);
    int rc;
    RC_CALL(rc, kv_ssd_scan(x, dt, A, B, C, D, states, slots, lens, S, H, P, G, N, out,
                            rc_isa()))
}

/* gated_rms_norm(x, z, w, out, rows, D, group, eps, norm_before_gate) */
static PyObject *py_gated_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    void *x, *z, *w, *out;
    int64_t rows, D, group, before;
    float eps;
    if (!rc_args(args, nargs, "ppppiiifi", &x, &z, &w, &out, &rows, &D, &group, &eps, &before))
        return NULL;
    if (!rc_positive("rows, D, group", 3, rows, D, group)) return NULL;
    if (D % group)
        return PyErr_Format(PyExc_ValueError, "group %lld does not divide D %lld",
                            (long long)group, (long long)D);
    int rc;
    RC_CALL(rc, kv_gated_rms_norm(x, z, w, out, rows, D, group, eps, (int)before, rc_isa()))
}

static PyMethodDef rc_methods[] = {
    {"short_conv", (PyCFunction)(void (*)(void))py_short_conv, METH_FASTCALL,
     "short_conv(x, w, bias, states, slots, lens, out, S, T, num_slots, C, K, silu)"},
    {"gated_delta_rule", (PyCFunction)(void (*)(void))py_gated_delta_rule, METH_FASTCALL,
     "gated_delta_rule(q, k, v, g, beta, states, slots, lens, out, S, T, num_slots, Hk, Hv, "
     "Dk, Dv, scale)"},
    {"ssd_scan", (PyCFunction)(void (*)(void))py_ssd_scan, METH_FASTCALL,
     "ssd_scan(x, dt, A, B, C, D, states, slots, lens, out, S, T, num_slots, H, P, G, N)"},
    {"gated_rms_norm", (PyCFunction)(void (*)(void))py_gated_rms_norm, METH_FASTCALL,
     "gated_rms_norm(x, z, w, out, rows, D, group, eps, norm_before_gate)"},
    {NULL, NULL, 0, NULL},
};

int kv_recurrent_add_methods(PyObject *module) {
    return PyModule_AddFunctions(module, rc_methods);
}
