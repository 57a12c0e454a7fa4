/* CPython entry points of kvlab.kernels._qk: argument checking and calls into the kernels
 * (qk.h), the run-time jobs (qk_runtime.h), the routed experts (qk_moe.h) and the decode
 * forward (qk_decode.h); nothing below this file calls back into it.
 *
 * Tensors cross the boundary as raw addresses (torch's data_ptr()) plus sizes; the Python
 * side (kvlab/kernels/ops.py) checks dtypes, shapes and contiguity before calling. Every
 * entry point releases the GIL while it computes; the job lock serializes the jobs because
 * they share the thread pool and the activation scratch buffer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

#include "qk.h"
#include "qk_decode.h"
#include "qk_mla.h"
#include "qk_moe.h"
#include "qk_pool.h"
#include "qk_recurrent.h"
#include "qk_runtime.h"

/* ---------------- argument checking ---------------- */

static int get_i64(PyObject *o, int64_t *v) {
    *v = PyLong_AsLongLong(o);
    return !(*v == -1 && PyErr_Occurred());
}

static int get_ptr(PyObject *o, void **p) {
    *p = PyLong_AsVoidPtr(o);
    return !(*p == NULL && PyErr_Occurred());
}

/* qtype, cols and row_bytes must describe whole blocks of a supported type */
static int check_layout(int64_t qtype, int64_t cols, int64_t row_bytes) {
    const int bs = qtype >= 0 && qtype < KV_NTYPES ? kv_block_size((int)qtype) : 0;
    if (bs == 0) {
        PyErr_Format(PyExc_ValueError, "GGML type id %lld is not supported by kvlab kernels",
                     (long long)qtype);
        return 0;
    }
    if (cols <= 0 || cols % bs) {
        PyErr_Format(PyExc_ValueError, "row length %lld is not a positive multiple of the "
                     "block size %d", (long long)cols, bs);
        return 0;
    }
    if (row_bytes != cols / bs * kv_type_size((int)qtype)) {
        PyErr_Format(PyExc_ValueError, "row_bytes %lld does not match %lld elements of type %lld",
                     (long long)row_bytes, (long long)cols, (long long)qtype);
        return 0;
    }
    return 1;
}

#define NARGS(k)                                                                       \
    if (nargs != (k)) {                                                                \
        PyErr_Format(PyExc_TypeError, "expected %d arguments, got %zd", (k), nargs);  \
        return NULL;                                                                   \
    }

/* ---------------- row jobs: products, dequantization, quantization ---------------- */

/* qmatmul(qtype, w, rows, cols, row_bytes, x, n, y): y[n, rows] = x[n, cols] . W^T */
static PyObject *py_qmatmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(8);
    int64_t qtype, rows, cols, row_bytes, n;
    void *w, *x, *y;
    if (!get_i64(args[0], &qtype) || !get_ptr(args[1], &w) || !get_i64(args[2], &rows) ||
        !get_i64(args[3], &cols) || !get_i64(args[4], &row_bytes) || !get_ptr(args[5], &x) ||
        !get_i64(args[6], &n) || !get_ptr(args[7], &y))
        return NULL;
    if (!check_layout(qtype, cols, row_bytes)) return NULL;
    const kv_wdesc wd = {.qt = qtype, .ptr = (int64_t)(intptr_t)w, .rows = rows, .cols = cols,
                         .row_bytes = row_bytes};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    kv_job_lock();
    rc = kv_product(&wd, x, n, y, rows);
    kv_job_unlock();
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* dequantize(qtype, w, rows, cols, row_bytes, out, parallel): out[rows, cols] fp32.
 * parallel=0 keeps it on the calling thread (prefill tiles: between two BLAS calls the
 * kernel's workers should not wake up and compete with torch's). */
static PyObject *py_dequantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(7);
    int64_t qtype, rows, cols, row_bytes, parallel;
    void *w, *out;
    if (!get_i64(args[0], &qtype) || !get_ptr(args[1], &w) || !get_i64(args[2], &rows) ||
        !get_i64(args[3], &cols) || !get_i64(args[4], &row_bytes) || !get_ptr(args[5], &out) ||
        !get_i64(args[6], &parallel))
        return NULL;
    if (!check_layout(qtype, cols, row_bytes)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    kv_job_lock();
    kv_dequantize((int)qtype, w, rows, cols, row_bytes, out, parallel != 0);
    kv_job_unlock();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* dequantize_rows(qtype, w, rows, cols, row_bytes, ids (int64), n, out): out[n, cols] */
static PyObject *py_dequantize_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(8);
    int64_t qtype, rows, cols, row_bytes, n;
    void *w, *ids_p, *out;
    if (!get_i64(args[0], &qtype) || !get_ptr(args[1], &w) || !get_i64(args[2], &rows) ||
        !get_i64(args[3], &cols) || !get_i64(args[4], &row_bytes) || !get_ptr(args[5], &ids_p) ||
        !get_i64(args[6], &n) || !get_ptr(args[7], &out))
        return NULL;
    if (!check_layout(qtype, cols, row_bytes)) return NULL;
    const int64_t *ids = ids_p;
    for (int64_t j = 0; j < n; j++) {
        if (ids[j] < 0 || ids[j] >= rows)
            return PyErr_Format(PyExc_IndexError, "row id %lld is out of range [0, %lld)",
                                (long long)ids[j], (long long)rows);
    }
    Py_BEGIN_ALLOW_THREADS
    for (int64_t j = 0; j < n; j++) kv_dequantize_row((int)qtype, w, row_bytes, ids[j],
                                                      cols, (float *)out + j * cols);
    Py_END_ALLOW_THREADS
    kv_count_weight_bytes(n * row_bytes);
    Py_RETURN_NONE;
}

/* quantize(qtype, x, rows, cols, out): fp32 [rows, cols] -> GGUF blocks; Q8_0 and K-quants */
static PyObject *py_quantize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(5);
    int64_t qtype, rows, cols;
    void *x, *out;
    if (!get_i64(args[0], &qtype) || !get_ptr(args[1], &x) || !get_i64(args[2], &rows) ||
        !get_i64(args[3], &cols) || !get_ptr(args[4], &out))
        return NULL;
    if (qtype != KV_Q8_0 && qtype != KV_Q4_K && qtype != KV_Q5_K && qtype != KV_Q6_K)
        return PyErr_Format(PyExc_ValueError, "no C quantizer for GGML type id %lld",
                            (long long)qtype);
    const int bs = kv_block_size((int)qtype);
    if (!check_layout(qtype, cols, cols / bs * kv_type_size((int)qtype))) return NULL;
    Py_BEGIN_ALLOW_THREADS
    kv_job_lock();
    kv_quantize_rows((int)qtype, x, rows, cols, out);
    kv_job_unlock();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* to_x8(qtype, src, rows, cols, src_row_bytes, dst): GGUF rows -> 8-row groups: Q8_0 / Q4_0
 * -> Q8_0x8 (34 B per 32), Q5_0 -> Q5_0x8 (22 B per 32), Q4_K -> Q4_Kx8 (144 B per 256),
 * Q5_K -> Q5_Kx8 (176 B), Q6_K -> Q6_Kx8 (210 B),
 * Q2_K -> Q2_Kx8 (84 B), Q3_K -> Q3_Kx8 (110 B), IQ4_XS -> IQ4_XSx8 (136 B per 256),
 * IQ4_NL -> IQ4_NLx8 (18 B per 32), MXFP4 -> MXFP4x8 (17 B per 32); rows a multiple of 8 */
static PyObject *py_to_x8(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(6);
    int64_t qtype, rows, cols, src_row_bytes;
    void *src, *dst;
    if (!get_i64(args[0], &qtype) || !get_ptr(args[1], &src) || !get_i64(args[2], &rows) ||
        !get_i64(args[3], &cols) || !get_i64(args[4], &src_row_bytes) || !get_ptr(args[5], &dst))
        return NULL;
    if (qtype != KV_Q8_0 && qtype != KV_Q5_0 && qtype != KV_Q4_0 && qtype != KV_Q4_K &&
        qtype != KV_Q5_K && qtype != KV_Q6_K && qtype != KV_Q2_K && qtype != KV_Q3_K &&
        qtype != KV_IQ4_XS && qtype != KV_IQ4_NL && qtype != KV_MXFP4)
        return PyErr_Format(PyExc_ValueError, "8-row groups are built from Q8_0, Q5_0, Q4_0, "
                            "Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_XS, IQ4_NL or MXFP4 rows, not "
                            "GGML type id %lld",
                            (long long)qtype);
    if (!check_layout(qtype, cols, src_row_bytes)) return NULL;
    if (rows % 8)
        return PyErr_Format(PyExc_ValueError, "8-row groups need a multiple of 8 rows, got %lld",
                            (long long)rows);
    Py_BEGIN_ALLOW_THREADS
    if (qtype == KV_Q4_K) kv_to_q4_kx8(src, rows, cols, dst);
    else if (qtype == KV_Q5_K) kv_to_q5_kx8(src, rows, cols, dst);
    else if (qtype == KV_Q6_K) kv_to_q6_kx8(src, rows, cols, dst);
    else if (qtype == KV_Q2_K) kv_to_q2_kx8(src, rows, cols, dst);
    else if (qtype == KV_Q3_K) kv_to_q3_kx8(src, rows, cols, dst);
    else if (qtype == KV_IQ4_XS) kv_to_iq4_xsx8(src, rows, cols, dst);
    else if (qtype == KV_IQ4_NL) kv_to_iq4_nlx8(src, rows, cols, dst);
    else if (qtype == KV_MXFP4) kv_to_mxfp4x8(src, rows, cols, dst);
    else if (qtype == KV_Q5_0) kv_to_q5_0x8(src, rows, cols, dst);
    else kv_to_q8_0x8((int)qtype, src, rows, cols, src_row_bytes, dst);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---------------- fused fp32 ops (qk_fused.c); contiguous fp32 buffers ---------------- */

static int get_f32(PyObject *o, float *v) {
    const double d = PyFloat_AsDouble(o);
    *v = (float)d;
    return !(d == -1.0 && PyErr_Occurred());
}

/* rms_norm(x, w, out, rows, dim, eps): out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w */
static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(6);
    void *x, *w, *out;
    int64_t rows, dim;
    float eps;
    if (!get_ptr(args[0], &x) || !get_ptr(args[1], &w) || !get_ptr(args[2], &out) ||
        !get_i64(args[3], &rows) || !get_i64(args[4], &dim) || !get_f32(args[5], &eps))
        return NULL;
    kv_rms_norm(x, w, out, rows, dim, eps);
    Py_RETURN_NONE;
}

/* add_rms_norm(res, h, w, rows, dim, eps): res[r] += rms_norm(h[r]) * w, in place */
static PyObject *py_add_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(6);
    void *res, *h, *w;
    int64_t rows, dim;
    float eps;
    if (!get_ptr(args[0], &res) || !get_ptr(args[1], &h) || !get_ptr(args[2], &w) ||
        !get_i64(args[3], &rows) || !get_i64(args[4], &dim) || !get_f32(args[5], &eps))
        return NULL;
    kv_add_rms_norm(res, h, w, rows, dim, eps);
    Py_RETURN_NONE;
}

/* norm_rope(x, tokens, row_stride, heads, dim, w, cos, sin, eps): per head of x, in place,
 * RMSNorm by w (skipped when w is 0) then rotate-half RoPE with cos/sin [tokens, dim] */
static PyObject *py_norm_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(9);
    void *x, *w, *cos, *sin;
    int64_t tokens, row_stride, heads, dim;
    float eps;
    if (!get_ptr(args[0], &x) || !get_i64(args[1], &tokens) || !get_i64(args[2], &row_stride) ||
        !get_i64(args[3], &heads) || !get_i64(args[4], &dim) || !get_ptr(args[5], &w) ||
        !get_ptr(args[6], &cos) || !get_ptr(args[7], &sin) || !get_f32(args[8], &eps))
        return NULL;
    kv_norm_rope(x, tokens, row_stride, heads, dim, w, cos, sin, eps);
    Py_RETURN_NONE;
}

/* gelu_mul / silu_mul(x, out, tokens, inter): out[t] = act(x[t, :inter]) * x[t, inter:] */
static PyObject *gated(void (*fn)(const float *, float *, int64_t, int64_t),
                       PyObject *const *args, Py_ssize_t nargs) {
    NARGS(4);
    void *x, *out;
    int64_t tokens, inter;
    if (!get_ptr(args[0], &x) || !get_ptr(args[1], &out) || !get_i64(args[2], &tokens) ||
        !get_i64(args[3], &inter))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    kv_job_lock();  /* a prefill's rows run on the kernel threads */
    fn(x, out, tokens, inter);
    kv_job_unlock();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_gelu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return gated(kv_gelu_mul, args, nargs);
}

static PyObject *py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return gated(kv_silu_mul, args, nargs);
}

/* 1 if every slot is in [0, num_slots); else 0 with IndexError set */
static int slots_in_range(const int64_t *slots, int64_t n, int64_t num_slots) {
    for (int64_t j = 0; j < n; j++) {
        if (slots[j] < 0 || slots[j] >= num_slots) {
            PyErr_Format(PyExc_IndexError, "slot %lld is out of range [0, %lld)",
                         (long long)slots[j], (long long)num_slots);
            return 0;
        }
    }
    return 1;
}

/* scatter_rows(dst, num_slots, src, src_stride, slots, n, row, f16): dst[slots[j]] = src[j],
 * dst fp32 or (f16) fp16 */
static PyObject *py_scatter_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(8);
    void *dst, *src, *slots_p;
    int64_t num_slots, src_stride, n, row, f16;
    if (!get_ptr(args[0], &dst) || !get_i64(args[1], &num_slots) || !get_ptr(args[2], &src) ||
        !get_i64(args[3], &src_stride) || !get_ptr(args[4], &slots_p) ||
        !get_i64(args[5], &n) || !get_i64(args[6], &row) || !get_i64(args[7], &f16))
        return NULL;
    const int64_t *slots = slots_p;
    if (!slots_in_range(slots, n, num_slots)) return NULL;
    kv_scatter_rows(dst, f16 != 0, src, src_stride, slots, n, row);
    Py_RETURN_NONE;
}

/* scatter_rows_q8(dst, dst_scale, num_slots, src, src_stride, slots, n, row): the paged
 * write into a q8_0 store, row % 32 == 0 */
static PyObject *py_scatter_rows_q8(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(8);
    void *dst, *dst_scale, *src, *slots_p;
    int64_t num_slots, src_stride, n, row;
    if (!get_ptr(args[0], &dst) || !get_ptr(args[1], &dst_scale) ||
        !get_i64(args[2], &num_slots) || !get_ptr(args[3], &src) ||
        !get_i64(args[4], &src_stride) || !get_ptr(args[5], &slots_p) ||
        !get_i64(args[6], &n) || !get_i64(args[7], &row))
        return NULL;
    if (row % 32) return PyErr_Format(PyExc_ValueError, "q8_0 rows of %lld values: not whole "
                                      "blocks of 32", (long long)row);
    const int64_t *slots = slots_p;
    if (!slots_in_range(slots, n, num_slots)) return NULL;
    kv_scatter_rows_q8(dst, dst_scale, src, src_stride, slots, n, row);
    Py_RETURN_NONE;
}

/* an attention call's soft-cap: 0 (none) or a finite cap > 0, checked */
static int get_softcap(PyObject *o, float *cap) {
    if (!get_f32(o, cap)) return 0;
    if (!(*cap >= 0.0f && *cap < INFINITY)) {
        PyErr_Format(PyExc_ValueError, "attention soft-cap %R (valid: 0 for none, or a "
                     "finite cap > 0)", o);
        return 0;
    }
    return 1;
}

/* the cache arguments (k, v, kind, k_scale, v_scale) of the attention calls, checked */
static int get_cache(PyObject *const *args, kv_cache_ref *kv) {
    void *k, *v, *ks, *vs;
    int64_t kind;
    if (!get_ptr(args[0], &k) || !get_ptr(args[1], &v) || !get_i64(args[2], &kind) ||
        !get_ptr(args[3], &ks) || !get_ptr(args[4], &vs))
        return 0;
    if (kind < KV_CACHE_F32 || kind > KV_CACHE_Q8_0 || (kind == KV_CACHE_Q8_0 && !(ks && vs))) {
        PyErr_Format(PyExc_ValueError, "KV cache kind %lld (valid: 0 fp32, 1 fp16, 2 q8_0 "
                     "with scales)", (long long)kind);
        return 0;
    }
    *kv = (kv_cache_ref){.kind = (int)kind, .k = k, .v = v, .k_scale = ks, .v_scale = vs};
    return 1;
}

/* attend_decode(q, q_stride, k, v, kind, k_scale, v_scale, num_slots, slots, B, C, H, KVH, D,
 * scale, out, lengths, softcap, sinks): out[B, H, D] = softmax(q k^T * scale) v over the first
 * lengths[b] of the C cache slots of each row (all C when lengths is 0), the cache fp32,
 * fp16 or q8_0 (kind 0, 1, 2; q8_0 with its scales); softcap > 0 bounds each score by
 * cap * tanh(s / cap) before the softmax; sinks: fp32 [H] logits in each head's softmax
 * denominator, or 0 (qk_attn.c) */
static PyObject *py_attend_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(19);
    void *q, *slots_p, *out, *lengths_p, *sinks;
    int64_t q_stride, num_slots, b, c, h, kvh, d;
    float scale, softcap;
    kv_cache_ref kv;
    if (!get_ptr(args[0], &q) || !get_i64(args[1], &q_stride) || !get_cache(args + 2, &kv) ||
        !get_i64(args[7], &num_slots) || !get_ptr(args[8], &slots_p) ||
        !get_i64(args[9], &b) || !get_i64(args[10], &c) || !get_i64(args[11], &h) ||
        !get_i64(args[12], &kvh) || !get_i64(args[13], &d) || !get_f32(args[14], &scale) ||
        !get_ptr(args[15], &out) || !get_ptr(args[16], &lengths_p) ||
        !get_softcap(args[17], &softcap) || !get_ptr(args[18], &sinks))
        return NULL;
    if (kvh <= 0 || h % kvh)
        return PyErr_Format(PyExc_ValueError, "%lld query heads do not split into %lld KV "
                            "heads", (long long)h, (long long)kvh);
    const int64_t *slots = slots_p, *lengths = lengths_p;
    for (int64_t r = 0; r < b; r++) {
        const int64_t n = lengths ? lengths[r] : c;
        if (n < 1 || n > c)
            return PyErr_Format(PyExc_ValueError, "row %lld attends to %lld of %lld slots",
                                (long long)r, (long long)n, (long long)c);
        if (!slots_in_range(slots + r * c, n, num_slots)) return NULL;
    }
    const int use_avx2 = kv_avx2_active();
    int rc;
    Py_BEGIN_ALLOW_THREADS
    kv_job_lock();  /* the kernel threads serve one call at a time */
    rc = kv_attend_decode(q, q_stride, &kv, slots, lengths, b, c, h, kvh, d, scale, softcap,
                          sinks, out, use_avx2);
    kv_job_unlock();
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* attend_prefill(q, q_stride, k, v, kind, k_scale, v_scale, num_slots, slots, first, start,
 * n, H, KVH, D, window, scale, out, softcap, sinks): out[n, H, D], query i (position
 * start + i) against key positions [first, start + i] held in slots[0 .. start + n - first),
 * the last `window` of them when window > 0; the cache, softcap and sinks as for
 * attend_decode (qk_flash.c) */
static PyObject *py_attend_prefill(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(20);
    void *q, *slots_p, *out, *sinks;
    int64_t q_stride, num_slots, first, start, n, h, kvh, d, window;
    float scale, softcap;
    kv_cache_ref kv;
    if (!get_ptr(args[0], &q) || !get_i64(args[1], &q_stride) || !get_cache(args + 2, &kv) ||
        !get_i64(args[7], &num_slots) || !get_ptr(args[8], &slots_p) ||
        !get_i64(args[9], &first) || !get_i64(args[10], &start) || !get_i64(args[11], &n) ||
        !get_i64(args[12], &h) || !get_i64(args[13], &kvh) || !get_i64(args[14], &d) ||
        !get_i64(args[15], &window) || !get_f32(args[16], &scale) ||
        !get_ptr(args[17], &out) || !get_softcap(args[18], &softcap) ||
        !get_ptr(args[19], &sinks))
        return NULL;
    if (kvh <= 0 || h % kvh)
        return PyErr_Format(PyExc_ValueError, "%lld query heads do not split into %lld KV "
                            "heads", (long long)h, (long long)kvh);
    if (n < 1 || first < 0 || first > start || window < 0)
        return PyErr_Format(PyExc_ValueError, "prefill of %lld tokens from position %lld with "
                            "keys from %lld", (long long)n, (long long)start, (long long)first);
    const int64_t *slots = slots_p;
    if (!slots_in_range(slots, start + n - first, num_slots)) return NULL;
    const int use_avx2 = kv_avx2_active();
    int rc;
    Py_BEGIN_ALLOW_THREADS
    kv_job_lock();
    rc = kv_attend_prefill(q, q_stride, &kv, slots, first, start, n, h, kvh, d, window, scale,
                           softcap, sinks, out, use_avx2);
    kv_job_unlock();
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* the latent-attention arguments shared by mla_decode and mla_prefill: (H, nope, rope,
 * rank, vdim, w_uk, w_uv_t) at args, checked */
static int get_mla(PyObject *const *args, kv_mla_heads *m) {
    void *w_uk, *w_uv_t;
    if (!get_i64(args[0], &m->H) || !get_i64(args[1], &m->nope) || !get_i64(args[2], &m->rope) ||
        !get_i64(args[3], &m->rank) || !get_i64(args[4], &m->vdim) ||
        !get_ptr(args[5], &w_uk) || !get_ptr(args[6], &w_uv_t))
        return 0;
    m->w_uk = w_uk;
    m->w_uv_t = w_uv_t;
    if (m->H < 1 || m->nope < 1 || m->rope < 0 || m->rank < 1 || m->vdim < 1) {
        PyErr_Format(PyExc_ValueError, "latent attention of %lld heads, nope %lld, rope %lld, "
                     "rank %lld, vdim %lld (valid: all positive, rope >= 0)", (long long)m->H,
                     (long long)m->nope, (long long)m->rope, (long long)m->rank,
                     (long long)m->vdim);
        return 0;
    }
    return 1;
}

/* 0 portable, 1 AVX2, 2 AVX-512: the widest the active kernel set and the CPU allow */
static int mla_isa(void) {
#ifdef KV_HAVE_AVX2_BUILD
    if (kv_avx2_active()) return kv_use_vnni() ? 2 : 1;
#endif
    return 0;
}

/* the latent attention on a store of `kind` (fp32 or fp16), the keys checked by the caller */
static PyObject *mla_run(const float *q, int64_t q_stride, const void *k, int64_t kind,
                         const kv_mla_heads *m, const kv_mla_keys *keys, float scale,
                         float *out) {
    if (kind != KV_CACHE_F32 && kind != KV_CACHE_F16)
        return PyErr_Format(PyExc_ValueError, "latent store kind %lld (valid: 0 fp32, 1 fp16)",
                            (long long)kind);
    const kv_cache_ref kv = {.kind = (int)kind, .k = k, .v = k};
    const int isa = mla_isa();
    int rc;
    Py_BEGIN_ALLOW_THREADS
    kv_job_lock();
    rc = kv_mla_attend(q, q_stride, m, &kv, keys, scale, out, isa);
    kv_job_unlock();
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* mla_decode(q, q_stride, k, kind, num_slots, slots, B, C, H, nope, rope, rank, vdim, w_uk,
 * w_uv_t, scale, out, lengths): out[B, H * vdim], latent attention in absorbed form over the
 * first lengths[b] of each row's C slots of the latent store k (fp32 or fp16, kind 0 or 1;
 * all C when lengths is 0) (qk_mla.c) */
static PyObject *py_mla_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(18);
    void *q, *k, *slots_p, *out, *lengths_p;
    int64_t q_stride, kind, num_slots, b, c;
    float scale;
    kv_mla_heads m;
    if (!get_ptr(args[0], &q) || !get_i64(args[1], &q_stride) || !get_ptr(args[2], &k) ||
        !get_i64(args[3], &kind) || !get_i64(args[4], &num_slots) ||
        !get_ptr(args[5], &slots_p) || !get_i64(args[6], &b) || !get_i64(args[7], &c) ||
        !get_mla(args + 8, &m) || !get_f32(args[15], &scale) || !get_ptr(args[16], &out) ||
        !get_ptr(args[17], &lengths_p))
        return NULL;
    const int64_t *slots = slots_p, *lengths = lengths_p;
    for (int64_t r = 0; r < b; r++) {
        const int64_t n = lengths ? lengths[r] : c;
        if (n < 1 || n > c)
            return PyErr_Format(PyExc_ValueError, "row %lld attends to %lld of %lld slots",
                                (long long)r, (long long)n, (long long)c);
        if (!slots_in_range(slots + r * c, n, num_slots)) return NULL;
    }
    const kv_mla_keys keys = {.slots = slots, .lengths = lengths, .B = b, .C = c};
    return mla_run(q, q_stride, k, kind, &m, &keys, scale, out);
}

/* mla_prefill(q, q_stride, k, kind, num_slots, slots, first, start, n, H, nope, rope, rank,
 * vdim, w_uk, w_uv_t, scale, out): out[n, H * vdim], query i (position start + i) against
 * key positions [first, start + i] of the latent store, held in slots[0 .. start + n - first)
 * (qk_mla.c) */
static PyObject *py_mla_prefill(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(18);
    void *q, *k, *slots_p, *out;
    int64_t q_stride, kind, num_slots, first, start, n;
    float scale;
    kv_mla_heads m;
    if (!get_ptr(args[0], &q) || !get_i64(args[1], &q_stride) || !get_ptr(args[2], &k) ||
        !get_i64(args[3], &kind) || !get_i64(args[4], &num_slots) ||
        !get_ptr(args[5], &slots_p) || !get_i64(args[6], &first) ||
        !get_i64(args[7], &start) || !get_i64(args[8], &n) || !get_mla(args + 9, &m) ||
        !get_f32(args[16], &scale) || !get_ptr(args[17], &out))
        return NULL;
    if (n < 1 || first < 0 || first > start)
        return PyErr_Format(PyExc_ValueError, "prefill of %lld tokens from position %lld with "
                            "keys from %lld", (long long)n, (long long)start, (long long)first);
    if (!slots_in_range(slots_p, start + n - first, num_slots)) return NULL;
    const kv_mla_keys keys = {.prefill = 1, .slots = slots_p, .B = n, .first = first,
                              .start = start};
    return mla_run(q, q_stride, k, kind, &m, &keys, scale, out);
}

/* ---------------- a decode step's layers (qk_decode.h), routed experts (qk_moe.h) -------- */

/* decode_layers(plan, layers, fields, x, B, hidden, H, KVH, D, eps, scale, cos_g, sin_g,
 *               cos_l, sin_l, slot_mapping_f, slot_mapping_l, slots_f, C_f, lengths_f,
 *               slots_l, C_l, lengths_l, caches, kv_kind, softcap): x [B, hidden] (the
 *               residual stream) updated in place; new K/V written at slot_mapping_f in
 *               full layers, slot_mapping_l in sliding ones; caches [layers, 4] (K, V, K
 *               scales, V scales), the stores fp32, fp16 or q8_0 (kv_kind 0, 1, 2; scales 0
 *               unless q8_0); softcap on every layer's attention scores as for
 *               attend_decode (0: none); ple, ple_width: the step's per-layer inputs fp32
 *               [B, ple_width] (Gemma 4), 0 for none; states [layers, 2] (a recurrent
 *               layer's conv and recurrent state addresses) and state_slots [B] (each
 *               sequence's row in them), 0 where no layer is recurrent */
static PyObject *py_decode_layers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(30);
    void *plan, *x, *ptr[12], *ple, *states, *state_slots;
    int64_t layers, fields, B, hidden, H, KVH, D, Cf, Cl, kv_kind, ple_width;
    float eps, scale, softcap;
    if (!get_ptr(args[0], &plan) || !get_i64(args[1], &layers) || !get_i64(args[2], &fields) ||
        !get_ptr(args[3], &x) || !get_i64(args[4], &B) || !get_i64(args[5], &hidden) ||
        !get_i64(args[6], &H) || !get_i64(args[7], &KVH) || !get_i64(args[8], &D) ||
        !get_f32(args[9], &eps) || !get_f32(args[10], &scale) || !get_ptr(args[11], &ptr[0]) ||
        !get_ptr(args[12], &ptr[1]) || !get_ptr(args[13], &ptr[2]) ||
        !get_ptr(args[14], &ptr[3]) || !get_ptr(args[15], &ptr[4]) ||
        !get_ptr(args[16], &ptr[10]) || !get_ptr(args[17], &ptr[5]) ||
        !get_i64(args[18], &Cf) || !get_ptr(args[19], &ptr[6]) || !get_ptr(args[20], &ptr[7]) ||
        !get_i64(args[21], &Cl) || !get_ptr(args[22], &ptr[8]) || !get_ptr(args[23], &ptr[9]) ||
        !get_i64(args[24], &kv_kind) || !get_softcap(args[25], &softcap) ||
        !get_ptr(args[26], &ple) || !get_i64(args[27], &ple_width) ||
        !get_ptr(args[28], &states) || !get_ptr(args[29], &state_slots))
        return NULL;
    if (kv_kind < KV_CACHE_F32 || kv_kind > KV_CACHE_Q8_0 || (kv_kind == KV_CACHE_Q8_0 && D % 32))
        return PyErr_Format(PyExc_ValueError, "KV cache kind %lld with head dim %lld (valid: "
                            "0 fp32, 1 fp16, 2 q8_0 with D %% 32 == 0)", (long long)kv_kind,
                            (long long)D);
    if (fields != KV_PLAN_FIELDS)
        return PyErr_Format(PyExc_ValueError, "a layer plan has %lld fields, got %lld",
                            (long long)KV_PLAN_FIELDS, (long long)fields);
    for (int64_t l = 0; l < layers && kv_kind == KV_CACHE_Q8_0; l++) {
        const int64_t d = ((const kv_layer_plan *)plan)[l].head_dim;  /* a layer's own */
        if (d % 32)
            return PyErr_Format(PyExc_ValueError, "q8_0 KV with layer %lld's head dim %lld "
                                "(valid: D %% 32 == 0)", (long long)l, (long long)d);
    }
    if (KVH <= 0 || H % KVH)
        return PyErr_Format(PyExc_ValueError, "%lld query heads do not split into %lld KV "
                            "heads", (long long)H, (long long)KVH);
    for (int64_t l = 0; l < layers; l++) {
        const int64_t mixer = ((const kv_layer_plan *)plan)[l].mixer;
        if (mixer < KV_MIX_ATTENTION || mixer > KV_MIX_NONE)
            return PyErr_Format(PyExc_ValueError, "layer %lld's mixer %lld (valid: %d "
                                "attention, %d short conv, %d gated delta, %d mamba2, %d "
                                "none)", (long long)l, (long long)mixer, KV_MIX_ATTENTION,
                                KV_MIX_SHORT_CONV, KV_MIX_GATED_DELTA, KV_MIX_MAMBA2,
                                KV_MIX_NONE);
        if (mixer && mixer != KV_MIX_NONE && !(states && state_slots))
            return PyErr_Format(PyExc_ValueError, "layer %lld is recurrent but the step has "
                                "no state rows", (long long)l);
    }
    const kv_step step = {.B = B, .hidden = hidden, .H = H, .KVH = KVH, .D = D, .eps = eps,
                          .scale = scale, .softcap = softcap, .cos = {ptr[0], ptr[2]},
                          .sin = {ptr[1], ptr[3]}, .slot_mapping = {ptr[4], ptr[10]},
                          .slots = {ptr[5], ptr[7]}, .lengths = {ptr[6], ptr[8]},
                          .C = {Cf, Cl}, .caches = ptr[9], .kv_kind = (int)kv_kind,
                          .ple = ple, .ple_width = ple_width, .states = states,
                          .state_slots = state_slots};
    const int use_avx2 = kv_avx2_active();
    int rc;
    Py_BEGIN_ALLOW_THREADS
    kv_job_lock();
    rc = kv_decode_layers(plan, layers, x, &step, use_avx2);
    kv_job_unlock();
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* moe_experts(experts, E, x, T, hidden, ids, weights, k, out, gate_up_bias, down_bias, act,
 * alpha, limit): a layer's routed experts on x [T, hidden] into out [T, hidden]; experts
 * int64 [E, 3, 5] (gate|up part 0, part 1 or zeros, down: kv_wdesc each), ids int64 and
 * weights fp32 [T, k]; the biases fp32 [E, 2 * inter] and [E, hidden] or 0 for none, act
 * KV_MOE_SILU, KV_MOE_SWIGLU_CLAMP with its alpha and limit, KV_MOE_GELU or KV_MOE_RELU2
 * (one up product per expert, no gate; qk_moe.c) */
static PyObject *py_moe_experts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(14);
    void *table, *x, *ids, *weights, *out, *gu_bias, *down_bias;
    int64_t E, T, hidden, k, act;
    float alpha, limit;
    if (!get_ptr(args[0], &table) || !get_i64(args[1], &E) || !get_ptr(args[2], &x) ||
        !get_i64(args[3], &T) || !get_i64(args[4], &hidden) || !get_ptr(args[5], &ids) ||
        !get_ptr(args[6], &weights) || !get_i64(args[7], &k) || !get_ptr(args[8], &out) ||
        !get_ptr(args[9], &gu_bias) || !get_ptr(args[10], &down_bias) ||
        !get_i64(args[11], &act) || !get_f32(args[12], &alpha) || !get_f32(args[13], &limit))
        return NULL;
    if (act < KV_MOE_SILU || act > KV_MOE_RELU2)
        return PyErr_Format(PyExc_ValueError, "expert gate %lld (valid: %d silu, %d clamped "
                            "SwiGLU, %d gelu_tanh, %d relu2)", (long long)act, KV_MOE_SILU,
                            KV_MOE_SWIGLU_CLAMP, KV_MOE_GELU, KV_MOE_RELU2);
    const kv_moe_opts opts = {.gate_up_bias = gu_bias, .down_bias = down_bias, .act = (int)act,
                              .alpha = alpha, .limit = limit};
    if (E < 1 || k < 1 || T < 0)
        return PyErr_Format(PyExc_ValueError, "%lld experts, %lld per token, %lld tokens "
                            "(valid: E >= 1, k >= 1, T >= 0)", (long long)E, (long long)k,
                            (long long)T);
    for (int64_t i = 0; i < T * k; i++)
        if (((const int64_t *)ids)[i] < 0 || ((const int64_t *)ids)[i] >= E)
            return PyErr_Format(PyExc_IndexError, "expert id %lld is out of range [0, %lld)",
                                (long long)((const int64_t *)ids)[i], (long long)E);
    if (T == 0) Py_RETURN_NONE;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    kv_job_lock();
    rc = kv_moe_experts_opts(kv_active_isa(), table, E, x, T, hidden, ids, weights, k, &opts,
                             out);
    kv_job_unlock();
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_plan_fields(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLongLong(KV_PLAN_FIELDS);
}

/* decode_profile(on): decode_layers' time split per layer kind on (True) or off */
static PyObject *py_decode_profile(PyObject *self, PyObject *arg) {
    (void)self;
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS  /* the job lock: a decode call may hold it */
    kv_decode_profile_enable(on);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_decode_profile_reset(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    kv_decode_profile_reset();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* decode_profile_read() -> (calls, attention, recurrent, mlp, tail, call): nanoseconds each */
static PyObject *py_decode_profile_read(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    int64_t ns[KV_PROF_KINDS], calls;
    Py_BEGIN_ALLOW_THREADS
    calls = kv_decode_profile_read(ns);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(LLLLLL)", (long long)calls, (long long)ns[KV_PROF_ATTENTION],
                         (long long)ns[KV_PROF_RECURRENT], (long long)ns[KV_PROF_MLP],
                         (long long)ns[KV_PROF_TAIL], (long long)ns[KV_PROF_CALL]);
}

/* argmax_rows(x, rows, cols, out): out[rows] int64, torch.argmax(x, -1) on fp32 rows */
static PyObject *py_argmax_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(4);
    void *x, *out;
    int64_t rows, cols;
    if (!get_ptr(args[0], &x) || !get_i64(args[1], &rows) || !get_i64(args[2], &cols) ||
        !get_ptr(args[3], &out))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    kv_argmax_rows(x, rows, cols, out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* mask_logits_rows(x, rows, cols, mask, words): x[r, c] = -inf where bit c of mask row r is 0 */
static PyObject *py_mask_logits_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(5);
    void *x, *mask;
    int64_t rows, cols, words;
    if (!get_ptr(args[0], &x) || !get_i64(args[1], &rows) || !get_i64(args[2], &cols) ||
        !get_ptr(args[3], &mask) || !get_i64(args[4], &words))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    kv_mask_logits_rows(x, rows, cols, mask, words);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* stream_read(ptr, nbytes) -> xor of its 64-bit words, read by all kernel threads */
static PyObject *py_stream_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(2);
    void *p;
    int64_t nbytes;
    if (!get_ptr(args[0], &p) || !get_i64(args[1], &nbytes)) return NULL;
    uint64_t x;
    Py_BEGIN_ALLOW_THREADS
    kv_job_lock();
    x = kv_stream_read(p, nbytes);
    kv_job_unlock();
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(x);
}

static PyObject *py_weight_bytes_read(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLongLong(kv_weight_bytes_read());
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg) {
    (void)self;
    const long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1) return PyErr_Format(PyExc_ValueError, "thread count must be >= 1, got %ld", n);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    kv_job_lock();
    rc = kv_pool_set_threads((int)n);
    kv_job_unlock();
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_Format(PyExc_OSError, "could not start %ld kernel threads", n);
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(kv_pool_threads());
}

static PyObject *py_set_spin_us(PyObject *self, PyObject *arg) {
    (void)self;
    const long us = PyLong_AsLong(arg);
    if (us == -1 && PyErr_Occurred()) return NULL;
    kv_pool_set_spin_us((int)us);
    Py_RETURN_NONE;
}

static PyObject *py_isa(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(kv_active_isa()->name);
}

/* whether the AVX2 kernel set, where active, decodes the lattice types in value planes
 * (AVX512-VBMI, qk_iq_planes.c) */
static PyObject *py_uses_vbmi(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#ifdef KV_HAVE_AVX2_BUILD
    return PyBool_FromLong(kv_avx2_active() && kv_iq_planes_active());
#else
    Py_RETURN_FALSE;
#endif
}

/* whether the AVX2 kernel set, where active, takes its AVX512-VNNI paths */
static PyObject *py_uses_vnni(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#ifdef KV_HAVE_AVX2_BUILD
    return PyBool_FromLong(kv_avx2_active() && kv_use_vnni());
#else
    Py_RETURN_FALSE;
#endif
}

/* set_isa("auto" | "generic" | "avx2"): tests pin the portable path with this */
static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    const kv_isa *isa = NULL;
    if (!strcmp(name, "auto")) isa = kv_best_isa();
    else if (!strcmp(name, "generic")) isa = &kv_isa_generic;
#ifdef KV_HAVE_AVX2_BUILD
    else if (!strcmp(name, "avx2") && kv_cpu_has_avx2()) isa = &kv_isa_avx2;
#endif
    if (!isa) return PyErr_Format(PyExc_ValueError, "instruction set %R is not available "
                                  "here (valid: 'auto', 'generic'%s)", arg,
                                  kv_cpu_has_avx2() ? ", 'avx2'" : "");
    kv_job_lock();
    kv_set_active_isa(isa);
    kv_job_unlock();
    Py_RETURN_NONE;
}

/* set_grid(qtype, values, bytes): the lattice grid of IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS or
 * IQ3_S (uint8, row after row), as gguf holds it (kvlab/kernels/grids.py) */
static PyObject *py_set_grid(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(3);
    int64_t qtype, bytes;
    void *values;
    if (!get_i64(args[0], &qtype) || !get_ptr(args[1], &values) || !get_i64(args[2], &bytes))
        return NULL;
    if (kv_set_grid((int)qtype, values, bytes))
        return PyErr_Format(PyExc_ValueError, "no grid of %lld bytes for GGML type id %lld",
                            (long long)bytes, (long long)qtype);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"set_grid", (PyCFunction)(void (*)(void))py_set_grid, METH_FASTCALL,
     "set_grid(qtype, values, bytes)"},
    {"qmatmul", (PyCFunction)(void (*)(void))py_qmatmul, METH_FASTCALL,
     "qmatmul(qtype, w, rows, cols, row_bytes, x, n, y)"},
    {"dequantize", (PyCFunction)(void (*)(void))py_dequantize, METH_FASTCALL,
     "dequantize(qtype, w, rows, cols, row_bytes, out, parallel)"},
    {"dequantize_rows", (PyCFunction)(void (*)(void))py_dequantize_rows, METH_FASTCALL,
     "dequantize_rows(qtype, w, rows, cols, row_bytes, ids, n, out)"},
    {"quantize", (PyCFunction)(void (*)(void))py_quantize, METH_FASTCALL,
     "quantize(qtype, x, rows, cols, out)"},
    {"to_x8", (PyCFunction)(void (*)(void))py_to_x8, METH_FASTCALL,
     "to_x8(qtype, src, rows, cols, src_row_bytes, dst): rows in groups of 8 (qk_group8_*.c)"},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL,
     "rms_norm(x, w, out, rows, dim, eps)"},
    {"add_rms_norm", (PyCFunction)(void (*)(void))py_add_rms_norm, METH_FASTCALL,
     "add_rms_norm(res, h, w, rows, dim, eps): res += rms_norm(h) * w"},
    {"norm_rope", (PyCFunction)(void (*)(void))py_norm_rope, METH_FASTCALL,
     "norm_rope(x, tokens, row_stride, heads, dim, w, cos, sin, eps)"},
    {"gelu_mul", (PyCFunction)(void (*)(void))py_gelu_mul, METH_FASTCALL,
     "gelu_mul(x, out, tokens, inter)"},
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL,
     "silu_mul(x, out, tokens, inter)"},
    {"scatter_rows", (PyCFunction)(void (*)(void))py_scatter_rows, METH_FASTCALL,
     "scatter_rows(dst, num_slots, src, src_stride, slots, n, row, f16)"},
    {"scatter_rows_q8", (PyCFunction)(void (*)(void))py_scatter_rows_q8, METH_FASTCALL,
     "scatter_rows_q8(dst, dst_scale, num_slots, src, src_stride, slots, n, row): the q8_0 "
     "paged KV write"},
    {"attend_prefill", (PyCFunction)(void (*)(void))py_attend_prefill, METH_FASTCALL,
     "attend_prefill(q, q_stride, k, v, kind, k_scale, v_scale, num_slots, slots, first, "
     "start, n, H, KVH, D, window, scale, out, softcap, sinks): chunked prefill attention "
     "from the paged cache"},
    {"attend_decode", (PyCFunction)(void (*)(void))py_attend_decode, METH_FASTCALL,
     "attend_decode(q, q_stride, k, v, kind, k_scale, v_scale, num_slots, slots, B, C, H, "
     "KVH, D, scale, out, lengths, softcap, sinks)"},
    {"mla_decode", (PyCFunction)(void (*)(void))py_mla_decode, METH_FASTCALL,
     "mla_decode(q, q_stride, k, kind, num_slots, slots, B, C, H, nope, rope, rank, vdim, "
     "w_uk, w_uv_t, scale, out, lengths): latent attention, absorbed, from the paged cache"},
    {"mla_prefill", (PyCFunction)(void (*)(void))py_mla_prefill, METH_FASTCALL,
     "mla_prefill(q, q_stride, k, kind, num_slots, slots, first, start, n, H, nope, rope, "
     "rank, vdim, w_uk, w_uv_t, scale, out): latent prefill attention, absorbed"},
    {"decode_layers", (PyCFunction)(void (*)(void))py_decode_layers, METH_FASTCALL,
     "decode_layers(plan, layers, fields, x, B, hidden, H, KVH, D, eps, scale, cos_g, sin_g, "
     "cos_l, sin_l, slot_mapping_f, slot_mapping_l, slots_f, C_f, lengths_f, slots_l, C_l, "
     "lengths_l, caches, kv_kind, softcap, ple, ple_width, states, state_slots)"},
    {"moe_experts", (PyCFunction)(void (*)(void))py_moe_experts, METH_FASTCALL,
     "moe_experts(experts, E, x, T, hidden, ids, weights, k, out, gate_up_bias, down_bias, "
     "act, alpha, limit): a layer's routed experts"},
    {"plan_fields", py_plan_fields, METH_NOARGS, "int64 fields of one layer's decode plan"},
    {"decode_profile", py_decode_profile, METH_O,
     "decode_profile(on): time decode_layers' stages per layer kind, or stop"},
    {"decode_profile_reset", py_decode_profile_reset, METH_NOARGS,
     "decode_profile_reset(): the sums and call count to 0"},
    {"decode_profile_read", py_decode_profile_read, METH_NOARGS,
     "decode_profile_read() -> (calls, attention, recurrent, mlp, tail, call) ns"},
    {"mask_logits_rows", (PyCFunction)(void (*)(void))py_mask_logits_rows, METH_FASTCALL,
     "mask_logits_rows(x, rows, cols, mask, words): -inf where a token's bit is 0"},
    {"argmax_rows", (PyCFunction)(void (*)(void))py_argmax_rows, METH_FASTCALL,
     "argmax_rows(x, rows, cols, out): first index of each fp32 row's max (or first NaN)"},
    {"stream_read", (PyCFunction)(void (*)(void))py_stream_read, METH_FASTCALL,
     "stream_read(ptr, nbytes) -> xor of the buffer's 64-bit words (all kernel threads)"},
    {"weight_bytes_read", py_weight_bytes_read, METH_NOARGS,
     "weight_bytes_read() -> bytes of weights the products and row lookups have read"},
    {"set_num_threads", py_set_num_threads, METH_O, "set_num_threads(n)"},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "get_num_threads()"},
    {"set_spin_us", py_set_spin_us, METH_O, "set_spin_us(us): worker spin before sleeping"},
    {"isa", py_isa, METH_NOARGS, "isa() -> name of the active kernel set"},
    {"uses_vnni", py_uses_vnni, METH_NOARGS,
     "uses_vnni() -> the active kernels take their AVX512-VNNI paths"},
    {"uses_vbmi", py_uses_vbmi, METH_NOARGS,
     "uses_vbmi() -> the active kernels decode IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_S in value planes"},
    {"set_isa", py_set_isa, METH_O, "set_isa('auto' | 'generic' | 'avx2')"},
    {NULL, NULL, 0, NULL},
};

#ifdef KV_EMULATE_512  /* the test build's own name, so that both can be installed */
#define KV_MODULE_NAME "_qk_emu512"
#define KV_MODULE_INIT PyInit__qk_emu512
#else
#define KV_MODULE_NAME "_qk"
#define KV_MODULE_INIT PyInit__qk
#endif

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, KV_MODULE_NAME, "kvlab quantized matrix kernels (C)", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC KV_MODULE_INIT(void) {
    kv_runtime_init();
    PyObject *m = PyModule_Create(&module);
    if (m && kv_recurrent_add_methods(m)) Py_CLEAR(m);  /* qk_recurrent_bindings.c */
    return m;
}
