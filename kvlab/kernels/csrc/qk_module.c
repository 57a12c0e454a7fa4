/* CPython entry points of kvlab.kernels._qk.
 *
 * Tensors cross the boundary as raw addresses (torch's data_ptr()) plus sizes; the Python
 * side (kvlab/kernels/ops.py) checks dtypes, shapes and contiguity before calling. Every
 * entry point releases the GIL while it computes; one lock serializes the jobs because
 * they share the thread pool and the activation scratch buffer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "qk.h"

static const kv_isa *g_isa = &kv_isa_generic;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static void *g_scratch;
static size_t g_scratch_bytes;
static atomic_llong g_weight_bytes;

void kv_count_weight_bytes(int64_t bytes) { atomic_fetch_add(&g_weight_bytes, bytes); }

static int cpu_has_avx2(void) {
#ifdef KV_HAVE_AVX2_BUILD
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

static const kv_isa *best_isa(void) {
#ifdef KV_HAVE_AVX2_BUILD
    if (cpu_has_avx2()) return &kv_isa_avx2;
#endif
    return &kv_isa_generic;
}

void *kv_scratch(size_t bytes) {
    if (bytes > g_scratch_bytes) {
        free(g_scratch);
        g_scratch_bytes = 0;
        if (posix_memalign(&g_scratch, 64, bytes)) return g_scratch = NULL;
        g_scratch_bytes = bytes;
    }
    return g_scratch;
}

/* ---------------- parallel jobs over row ranges ----------------
 *
 * Each thread owns one contiguous part of the rows and walks it front to back, so the
 * hardware prefetchers see one long stream per thread (interleaving small chunks between
 * threads halved the bandwidth on the model's 0.1-1 MB matrices). A thread done with its
 * part takes chunks from the next parts, so a worker that is late, or never scheduled on a
 * busy machine, costs nothing but its own speed-up. A product's part is taken in chunks
 * that halve: half of what is left, then half of the rest, down to a unit of ~16 KiB at the
 * tail, so the threads finish together and most rows go in a few long calls. With one x row
 * (decode) a unit is little work, and a batch-1 sweep of a model's products streamed 3-22 %
 * faster in chunks of 64 KiB-1 MiB than in units; with many (prefill) a call's set-up per x
 * row is spread over its rows (IQ4_XSx8's int16 copy of x on AVX2 took 15 % of a 512-row
 * product in 16 KiB units). Other jobs (dequantize, quantize) go in units.
 *
 *     rows: |---- part 0 (caller) ---->|---- part 1 (worker 1) ---->|
 *            1/2      1/4   1/8 .. u u   1/2 ...  <- thieves take chunks from here too
 */

#define KV_MAX_PARTS 64

typedef struct {
    _Alignas(64) atomic_llong next;  /* the next chunk to take; own cache line */
    int64_t start, end;
} kv_part;

typedef struct rows_job rows_job;
typedef void (*rows_fn)(const rows_job *job, int64_t r0, int64_t r1);
struct rows_job {
    rows_fn fn;
    int64_t rows, unit, align;
    int qtype, nparts, halving;
    const uint8_t *w;
    int64_t row_bytes, cols;
    const void *xq;   /* gemv: activations; quantize: fp32 input */
    int64_t xstride, n;
    int64_t ystride;  /* gemv: floats between output rows (0: rows) */
    void *out;
    kv_part parts[KV_MAX_PARTS];
};

/* chunk c of a part: its c-th unit, or (halving) half of the rows left, a multiple of
 * `align` and at least a unit; the last chunk is what is left; 0 rows past the part's end */
static int64_t chunk_rows(const kv_part *part, int64_t c, const rows_job *job, int64_t *r0) {
    const int64_t unit = job->unit;
    if (!job->halving) {
        if (c >= (part->end - part->start + unit - 1) / unit) return 0;
        *r0 = part->start + c * unit;
        return part->end - *r0 < unit ? part->end - *r0 : unit;
    }
    int64_t r = part->start, size = 0;
    for (int64_t i = 0; i <= c && r < part->end; i++) {
        r += size;
        const int64_t left = part->end - r, half = left / 2 / job->align * job->align;
        size = half > unit ? half : unit < left ? unit : left;
    }
    *r0 = r;
    return r < part->end ? size : 0;
}

static void rows_task(void *p, int tid, int nthreads) {
    rows_job *job = p;
    (void)nthreads;
    for (int k = 0; k < job->nparts; k++) {
        kv_part *part = &job->parts[(tid + k) % job->nparts];
        for (;;) {
            int64_t r0;
            const int64_t n = chunk_rows(part, atomic_fetch_add(&part->next, 1), job, &r0);
            if (n <= 0) break;
            job->fn(job, r0, r0 + n);
        }
    }
}

static void gemv_rows(const rows_job *job, int64_t r0, int64_t r1) {
    g_isa->gemv[job->qtype](job->w, job->row_bytes, r0, r1, job->cols, job->xq, job->xstride,
                            job->n, (float *)job->out,
                            job->ystride ? job->ystride : job->rows);
}

/* One part per thread (a single one below 64 KiB of work: waking a worker costs more).
 * The 8-row group types split only between groups, and between pairs of groups for a
 * product with several x rows, whose tiles take two groups at once (a lone group, as at
 * 8192 Q3_K columns where 16 KiB is one group, would take the one-group tile). */
static void run_rows(rows_job *job, int64_t bytes_per_row) {
    const int nt = job->rows * bytes_per_row < 65536 ? 1 : kv_pool_threads();
    const int64_t align = job->qtype < KV_Q8_0X8 ? 1 : job->fn == gemv_rows && job->n > 1 ? 16 : 8;
    const int64_t groups = job->rows / align;
    job->nparts = nt < KV_MAX_PARTS ? nt : KV_MAX_PARTS;
    job->unit = (16384 / (bytes_per_row > 0 ? bytes_per_row : 1) / align + 1) * align;
    job->align = align;
    job->halving = job->fn == gemv_rows;
    for (int k = 0; k < job->nparts; k++) {
        atomic_store(&job->parts[k].next, 0);
        job->parts[k].start = groups * k / job->nparts * align;
        job->parts[k].end =
            k + 1 < job->nparts ? groups * (k + 1) / job->nparts * align : job->rows;
    }
    kv_pool_run(rows_task, job, nt);
}

/* row r of a matrix -> fp32 (grouped rows are spread over their group's blocks) */
static void deq_row(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r, int64_t cols,
                    float *out) {
    if (qtype == KV_Q8_0X8) kv_deq_q8_0x8_row(w, row_bytes, r, cols, out);
    else if (qtype == KV_Q4_KX8) kv_deq_q4_kx8_row(w, row_bytes, r, cols, out);
    else if (qtype == KV_Q6_KX8) kv_deq_q6_kx8_row(w, row_bytes, r, cols, out);
    else if (qtype == KV_Q2_KX8) kv_deq_q2_kx8_row(w, row_bytes, r, cols, out);
    else if (qtype == KV_Q3_KX8) kv_deq_q3_kx8_row(w, row_bytes, r, cols, out);
    else if (qtype == KV_IQ4_XSX8) kv_deq_iq4_xsx8_row(w, row_bytes, r, cols, out);
    else if (qtype == KV_IQ4_NLX8) kv_deq_iq4_nlx8_row(w, row_bytes, r, cols, out);
    else if (qtype == KV_Q5_0X8) kv_deq_q5_0x8_row(w, row_bytes, r, cols, out);
    else if (qtype == KV_Q5_KX8) kv_deq_q5_kx8_row(w, row_bytes, r, cols, out);
    else g_isa->deq[qtype](w + r * row_bytes, cols, out);
}

static void deq_rows(const rows_job *job, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
        deq_row(job->qtype, job->w, job->row_bytes, r, job->cols,
                (float *)job->out + r * job->cols);
}

static void quant_rows(const rows_job *job, int64_t r0, int64_t r1) {
    const float *x = (const float *)job->xq + r0 * job->cols;
    uint8_t *out = (uint8_t *)job->out + r0 * job->row_bytes;
    const int64_t n = (r1 - r0) * job->cols;
    switch (job->qtype) {
        case KV_Q8_0: kv_quantize_q8_0(x, n, out); break;
        case KV_Q4_K: kv_quantize_q4_k(x, n, out); break;
        case KV_Q5_K: kv_quantize_q5_k(x, n, out); break;
        case KV_Q6_K: kv_quantize_q6_k(x, n, out); break;
        default: break;
    }
}

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

/* ---------------- entry points ---------------- */

/* x rows -> the activation blocks the active kernel for qtype takes (fp32 x as is) */
static int quantize_activations(int qtype, const float *x, int64_t n, int64_t cols,
                                const void **xq, int64_t *xstride) {
    const int kind = g_isa->act_kind[qtype];
    *xstride = kv_act_row_bytes(kind, cols);
    if (kind == KV_ACT_FLOAT) {
        *xq = x;
        return 0;
    }
    char *buf = kv_scratch((size_t)(*xstride * n));
    if (!buf) return -1;
    for (int64_t j = 0; j < n; j++) kv_act_row(g_isa, kind, x + j * cols, cols, buf + j * *xstride);
    *xq = buf;
    return 0;
}

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
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&g_lock);
    rows_job job = {.fn = gemv_rows, .rows = rows, .qtype = (int)qtype, .w = w,
                    .row_bytes = row_bytes, .cols = cols, .n = n, .out = y};
    rc = quantize_activations((int)qtype, x, n, cols, &job.xq, &job.xstride);
    if (rc == 0 && rows > 0 && n > 0) {
        run_rows(&job, row_bytes);
        kv_count_weight_bytes(rows * row_bytes);
    }
    pthread_mutex_unlock(&g_lock);
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
    pthread_mutex_lock(&g_lock);
    rows_job job = {.fn = deq_rows, .rows = rows, .qtype = (int)qtype, .w = w,
                    .row_bytes = row_bytes, .cols = cols, .out = out};
    if (rows > 0 && parallel) run_rows(&job, row_bytes + cols * 4);
    else if (rows > 0) deq_rows(&job, 0, rows);
    pthread_mutex_unlock(&g_lock);
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
    for (int64_t j = 0; j < n; j++) deq_row((int)qtype, w, row_bytes, ids[j], cols,
                                            (float *)out + j * cols);
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
    pthread_mutex_lock(&g_lock);
    rows_job job = {.fn = quant_rows, .rows = rows, .qtype = (int)qtype, .xq = x, .cols = cols,
                    .row_bytes = cols / bs * kv_type_size((int)qtype), .out = out};
    if (rows > 0) run_rows(&job, 64 * cols);  /* the K-quant searches are compute-bound */
    pthread_mutex_unlock(&g_lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* to_x8(qtype, src, rows, cols, src_row_bytes, dst): GGUF rows -> 8-row groups: Q8_0 / Q4_0
 * -> Q8_0x8 (34 B per 32), Q5_0 -> Q5_0x8 (22 B per 32), Q4_K -> Q4_Kx8 (144 B per 256),
 * Q5_K -> Q5_Kx8 (176 B), Q6_K -> Q6_Kx8 (210 B),
 * Q2_K -> Q2_Kx8 (84 B), Q3_K -> Q3_Kx8 (110 B), IQ4_XS -> IQ4_XSx8 (136 B per 256),
 * IQ4_NL -> IQ4_NLx8 (18 B per 32); rows a multiple of 8 */
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
        qtype != KV_IQ4_XS && qtype != KV_IQ4_NL)
        return PyErr_Format(PyExc_ValueError, "8-row groups are built from Q8_0, Q5_0, Q4_0, "
                            "Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_XS or IQ4_NL rows, not GGML type "
                            "id %lld",
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
    pthread_mutex_lock(&g_lock);  /* a prefill's rows run on the kernel threads */
    fn(x, out, tokens, inter);
    pthread_mutex_unlock(&g_lock);
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

static int avx2_chosen(void) {
#ifdef KV_HAVE_AVX2_BUILD
    return g_isa == &kv_isa_avx2;
#else
    return 0;
#endif
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
 * scale, out, lengths, softcap): out[B, H, D] = softmax(q k^T * scale) v over the first
 * lengths[b] of the C cache slots of each row (all C when lengths is 0), the cache fp32,
 * fp16 or q8_0 (kind 0, 1, 2; q8_0 with its scales); softcap > 0 bounds each score by
 * cap * tanh(s / cap) before the softmax (qk_attn.c) */
static PyObject *py_attend_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(18);
    void *q, *slots_p, *out, *lengths_p;
    int64_t q_stride, num_slots, b, c, h, kvh, d;
    float scale, softcap;
    kv_cache_ref kv;
    if (!get_ptr(args[0], &q) || !get_i64(args[1], &q_stride) || !get_cache(args + 2, &kv) ||
        !get_i64(args[7], &num_slots) || !get_ptr(args[8], &slots_p) ||
        !get_i64(args[9], &b) || !get_i64(args[10], &c) || !get_i64(args[11], &h) ||
        !get_i64(args[12], &kvh) || !get_i64(args[13], &d) || !get_f32(args[14], &scale) ||
        !get_ptr(args[15], &out) || !get_ptr(args[16], &lengths_p) ||
        !get_softcap(args[17], &softcap))
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
    const int use_avx2 = avx2_chosen();
    int rc;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&g_lock);  /* the kernel threads serve one call at a time */
    rc = kv_attend_decode(q, q_stride, &kv, slots, lengths, b, c, h, kvh, d, scale, softcap,
                          out, use_avx2);
    pthread_mutex_unlock(&g_lock);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* attend_prefill(q, q_stride, k, v, kind, k_scale, v_scale, num_slots, slots, first, start,
 * n, H, KVH, D, window, scale, out, softcap): out[n, H, D], query i (position start + i)
 * against key positions [first, start + i] held in slots[0 .. start + n - first), the last
 * `window` of them when window > 0; the cache and softcap as for attend_decode
 * (qk_flash.c) */
static PyObject *py_attend_prefill(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(19);
    void *q, *slots_p, *out;
    int64_t q_stride, num_slots, first, start, n, h, kvh, d, window;
    float scale, softcap;
    kv_cache_ref kv;
    if (!get_ptr(args[0], &q) || !get_i64(args[1], &q_stride) || !get_cache(args + 2, &kv) ||
        !get_i64(args[7], &num_slots) || !get_ptr(args[8], &slots_p) ||
        !get_i64(args[9], &first) || !get_i64(args[10], &start) || !get_i64(args[11], &n) ||
        !get_i64(args[12], &h) || !get_i64(args[13], &kvh) || !get_i64(args[14], &d) ||
        !get_i64(args[15], &window) || !get_f32(args[16], &scale) ||
        !get_ptr(args[17], &out) || !get_softcap(args[18], &softcap))
        return NULL;
    if (kvh <= 0 || h % kvh)
        return PyErr_Format(PyExc_ValueError, "%lld query heads do not split into %lld KV "
                            "heads", (long long)h, (long long)kvh);
    if (n < 1 || first < 0 || first > start || window < 0)
        return PyErr_Format(PyExc_ValueError, "prefill of %lld tokens from position %lld with "
                            "keys from %lld", (long long)n, (long long)start, (long long)first);
    const int64_t *slots = slots_p;
    if (!slots_in_range(slots, start + n - first, num_slots)) return NULL;
    const int use_avx2 = avx2_chosen();
    int rc;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&g_lock);
    rc = kv_attend_prefill(q, q_stride, &kv, slots, first, start, n, h, kvh, d, window, scale,
                           softcap, out, use_avx2);
    pthread_mutex_unlock(&g_lock);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* ---------------- a decode step's layers in one call ----------------
 *
 * The same C functions, in the same order, on the same layouts as the decode path of the
 * dense models (kvlab/models/gemma3.py, llama.py and the files built on it) when every
 * product has a C kernel, so the results are bit-identical; what goes away is the Python
 * between them (a dozen calls a layer). What differs between the families is data in the
 * plan: norms that are absent (0), a QKV bias, the gated activation, a router and experts
 * in place of the dense MLP (routed in C: the router product, softmax and top-k in fp32,
 * the same choices as the per-op path's torch ops up to fp32 rounding); a shared expert
 * (Qwen2-MoE) beside the routed ones is then the layer's gate_up and down, its output
 * scaled by sigmoid(shexp_gate . h) and added to theirs. The plan is int64
 * [layers, KV_PLAN_FIELDS], built once by the model (kvlab/models/decode_c.py). */

enum { KV_GATE_GELU_TANH = 0, KV_GATE_SILU = 1 };

typedef struct {
    int64_t attn_norm, n_qkv;
    kv_wdesc qkv[3];
    int64_t qkv_bias;                  /* fp32 [q | k | v] added after the product, or 0 */
    int64_t q_norm, k_norm;            /* per-head RMSNorm before RoPE, or 0 (RoPE only) */
    kv_wdesc o;
    int64_t post_attn_norm, mlp_norm;  /* post norms: x += norm(h); 0: x += h */
    int64_t n_gate_up;
    kv_wdesc gate_up[2];
    int64_t gate;                      /* KV_GATE_*: act(gate) * up */
    kv_wdesc down;
    int64_t post_mlp_norm, sliding;
    int64_t qk_norm_whole;             /* q_norm, k_norm over all heads at once (OLMoE) */
    int64_t router;                    /* mixture of experts: fp32 [E, hidden]; 0: dense */
    int64_t n_experts, top_k, norm_topk;
    int64_t experts;                   /* int64 [E, 3, 5]: kv_moe_experts' table */
    int64_t shexp_gate;                /* fp32 [hidden]: the shared expert's gate; 0: none */
} kv_layer_plan;

#define KV_PLAN_FIELDS ((int64_t)(sizeof(kv_layer_plan) / sizeof(int64_t)))

typedef struct {
    int64_t B, hidden, H, KVH, D;
    float eps, scale, softcap;              /* softcap: on the attention scores, 0 none */
    const float *cos[2], *sin[2];           /* [B, D]: global (0) and local (1) RoPE */
    const int64_t *slot_mapping[2];         /* [B]: full (0) and sliding (1) layers' pools */
    const int64_t *slots[2], *lengths[2];   /* [B, C]: full (0) and sliding (1) keys */
    int64_t C[2];
    const int64_t *caches;                  /* [layers, 4]: K, V stores, K, V scales */
    int kv_kind;                            /* KV_CACHE_*: fp32, fp16 or q8_0 (scaled) */
} kv_step;

/* y[:, 0:w->rows] (rows ystride floats apart) = x @ W^T, as py_qmatmul computes it */
static int product(const kv_wdesc *w, const float *x, int64_t n, float *y, int64_t ystride) {
    rows_job job = {.fn = gemv_rows, .rows = w->rows, .qtype = (int)w->qt,
                    .w = (const uint8_t *)(intptr_t)w->ptr, .row_bytes = w->row_bytes,
                    .cols = w->cols, .n = n, .out = y, .ystride = ystride};
    if (quantize_activations((int)w->qt, x, n, w->cols, &job.xq, &job.xstride)) return -1;
    if (w->rows > 0 && n > 0) {
        run_rows(&job, w->row_bytes);
        kv_count_weight_bytes(w->rows * w->row_bytes);
    }
    return 0;
}

/* several weights sharing x, their outputs side by side in rows of `width` floats */
static int products(const kv_wdesc *ws, int64_t count, const float *x, int64_t n, float *y,
                    int64_t width) {
    for (int64_t p = 0, off = 0; p < count; off += ws[p].rows, p++)
        if (product(&ws[p], x, n, y + off, width)) return -1;
    return 0;
}

typedef struct {
    float *h, *qkv, *att, *o, *gu, *g;
    float *shared;            /* [B, hidden]: the shared expert's output */
    float *logits, *route_w;  /* [B, E], [B, k]: router scores, the chosen experts' weights */
    int64_t *route_ids;       /* [B, k] */
} kv_bufs;

/* the residual add after attention or the MLP: with the block's output norm or without */
static void residual(float *x, const float *h, int64_t norm, const kv_step *s) {
    if (norm) {
        kv_add_rms_norm(x, h, (const float *)(intptr_t)norm, s->B, s->hidden, s->eps);
        return;
    }
    for (int64_t i = 0; i < s->B * s->hidden; i++) x[i] += h[i];
}

static void add_bias(float *y, const float *bias, int64_t rows, int64_t width) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < width; i++) y[r * width + i] += bias[i];
}

/* OLMoE: one RMSNorm over each row's whole q (H * D) and whole k, before RoPE */
static void norm_whole_qk(const kv_layer_plan *L, const kv_step *s, float *qkv, int64_t width) {
    const int64_t q = s->H * s->D, k = s->KVH * s->D;
    for (int64_t r = 0; r < s->B; r++) {
        float *row = qkv + r * width;
        kv_rms_norm(row, (const float *)(intptr_t)L->q_norm, row, 1, q, s->eps);
        kv_rms_norm(row + q, (const float *)(intptr_t)L->k_norm, row + q, 1, k, s->eps);
    }
}

static int attention_half(const kv_layer_plan *L, const int64_t *kv, const kv_step *s,
                          float *x, kv_bufs *b, int use_avx2) {
    const int64_t B = s->B, D = s->D, H = s->H, KVH = s->KVH, width = (H + 2 * KVH) * D;
    const int w = L->sliding != 0;
    kv_rms_norm(x, (const float *)(intptr_t)L->attn_norm, b->h, B, s->hidden, s->eps);
    if (products(L->qkv, L->n_qkv, b->h, B, b->qkv, width)) return -1;
    if (L->qkv_bias) add_bias(b->qkv, (const float *)(intptr_t)L->qkv_bias, B, width);
    if (L->qk_norm_whole) norm_whole_qk(L, s, b->qkv, width);
    const int64_t q_norm = L->qk_norm_whole ? 0 : L->q_norm;
    const int64_t k_norm = L->qk_norm_whole ? 0 : L->k_norm;
    kv_norm_rope(b->qkv, B, width, H, D, (const float *)(intptr_t)q_norm, s->cos[w],
                 s->sin[w], s->eps);
    kv_norm_rope(b->qkv + H * D, B, width, KVH, D, (const float *)(intptr_t)k_norm,
                 s->cos[w], s->sin[w], s->eps);
    void *kc = (void *)(intptr_t)kv[0], *vc = (void *)(intptr_t)kv[1];
    kv_half *ks = (kv_half *)(intptr_t)kv[2], *vs = (kv_half *)(intptr_t)kv[3];
    const float *knew = b->qkv + H * D, *vnew = b->qkv + (H + KVH) * D;
    if (s->kv_kind == KV_CACHE_Q8_0) {
        kv_scatter_rows_q8(kc, ks, knew, width, s->slot_mapping[w], B, KVH * D);
        kv_scatter_rows_q8(vc, vs, vnew, width, s->slot_mapping[w], B, KVH * D);
    } else {
        const int f16 = s->kv_kind == KV_CACHE_F16;
        kv_scatter_rows(kc, f16, knew, width, s->slot_mapping[w], B, KVH * D);
        kv_scatter_rows(vc, f16, vnew, width, s->slot_mapping[w], B, KVH * D);
    }
    const kv_cache_ref ref = {.kind = s->kv_kind, .k = kc, .v = vc, .k_scale = ks,
                              .v_scale = vs};
    if (kv_attend_decode(b->qkv, width, &ref, s->slots[w], s->lengths[w], B,
                         s->C[w], H, KVH, D, s->scale, s->softcap, b->att, use_avx2))
        return -1;
    if (product(&L->o, b->att, B, b->o, s->hidden)) return -1;
    residual(x, b->o, L->post_attn_norm, s);
    return 0;
}

/* gate_up -> act(gate) * up -> down on b->h into y [B, hidden]: the dense MLP, or the
 * shared expert of an MoE layer */
static int gated_mlp(const kv_layer_plan *L, const kv_step *s, kv_bufs *b, float *y) {
    int64_t gu_rows = 0;
    for (int64_t p = 0; p < L->n_gate_up; p++) gu_rows += L->gate_up[p].rows;
    if (products(L->gate_up, L->n_gate_up, b->h, s->B, b->gu, gu_rows)) return -1;
    if (L->gate == KV_GATE_SILU)
        kv_silu_mul(b->gu, b->g, s->B, gu_rows / 2);
    else
        kv_gelu_mul(b->gu, b->g, s->B, gu_rows / 2);
    return product(&L->down, b->g, s->B, y, s->hidden);
}

/* o += sigmoid(shexp_gate . h) * shared expert(h), row by row: the product, then the add,
 * as the per-op path's torch ops (kvlab/models/moe.py: moe_mlp) */
static int shared_expert(const kv_layer_plan *L, const kv_step *s, kv_bufs *b) {
    const kv_wdesc gate = {.qt = KV_F32, .ptr = L->shexp_gate, .rows = 1, .cols = s->hidden,
                           .row_bytes = s->hidden * (int64_t)sizeof(float)};
    if (gated_mlp(L, s, b, b->shared)) return -1;
    if (product(&gate, b->h, s->B, b->logits, 1)) return -1;  /* the router's are used */
    for (int64_t r = 0; r < s->B; r++) {
        const float g = 1.0f / (1.0f + expf(-b->logits[r]));
        float *o = b->o + r * s->hidden;
        const float *sh = b->shared + r * s->hidden;
        for (int64_t i = 0; i < s->hidden; i++) o[i] += g * sh[i];
    }
    return 0;
}

/* the router's scores, each row's top k, then the chosen experts (qk_moe.c) and the shared
 * expert where the layer has one */
static int moe_half(const kv_layer_plan *L, const kv_step *s, float *x, kv_bufs *b) {
    const int64_t E = L->n_experts, k = L->top_k;
    const kv_wdesc router = {.qt = KV_F32, .ptr = L->router, .rows = E, .cols = s->hidden,
                             .row_bytes = s->hidden * (int64_t)sizeof(float)};
    kv_rms_norm(x, (const float *)(intptr_t)L->mlp_norm, b->h, s->B, s->hidden, s->eps);
    if (product(&router, b->h, s->B, b->logits, E)) return -1;
    for (int64_t r = 0; r < s->B; r++)
        kv_moe_route(b->logits + r * E, E, k, (int)L->norm_topk, b->route_ids + r * k,
                     b->route_w + r * k);
    if (kv_moe_experts(g_isa, (const kv_wdesc *)(intptr_t)L->experts, E, b->h, s->B,
                       s->hidden, b->route_ids, b->route_w, k, b->o))
        return -1;
    if (L->shexp_gate && shared_expert(L, s, b)) return -1;
    residual(x, b->o, L->post_mlp_norm, s);
    return 0;
}

static int mlp_half(const kv_layer_plan *L, const kv_step *s, float *x, kv_bufs *b) {
    if (L->router) return moe_half(L, s, x, b);
    kv_rms_norm(x, (const float *)(intptr_t)L->mlp_norm, b->h, s->B, s->hidden, s->eps);
    if (gated_mlp(L, s, b, b->o)) return -1;
    residual(x, b->o, L->post_mlp_norm, s);
    return 0;
}

static int decode_layers(const kv_layer_plan *plan, int64_t layers, float *x, const kv_step *s,
                         int use_avx2) {
    int64_t gu = 0, qkv = (s->H + 2 * s->KVH) * s->D, E = 0, k = 0;
    for (int64_t l = 0; l < layers; l++) {
        int64_t rows = 0;
        for (int64_t p = 0; p < plan[l].n_gate_up; p++) rows += plan[l].gate_up[p].rows;
        gu = rows > gu ? rows : gu;
        E = plan[l].n_experts > E ? plan[l].n_experts : E;
        k = plan[l].top_k > k ? plan[l].top_k : k;
    }
    const int64_t B = s->B;
    float *mem = malloc((size_t)(B * (3 * s->hidden + qkv + s->H * s->D + gu + gu / 2 + E +
                                      3 * k)) * sizeof(float));
    if (!mem) return -1;
    kv_bufs b = {.h = mem};
    b.qkv = b.h + B * s->hidden;
    b.att = b.qkv + B * qkv;
    b.o = b.att + B * s->H * s->D;
    b.gu = b.o + B * s->hidden;
    b.g = b.gu + B * gu;
    b.shared = b.g + B * (gu / 2);
    b.logits = b.shared + B * s->hidden;
    b.route_w = b.logits + B * E;
    b.route_ids = (int64_t *)(b.route_w + B * k);  /* 2k floats per row: 8-byte aligned */
    int rc = 0;
    for (int64_t l = 0; l < layers && !rc; l++)
        rc = attention_half(&plan[l], s->caches + 4 * l, s, x, &b, use_avx2) ||
             mlp_half(&plan[l], s, x, &b);
    free(mem);
    return rc ? -1 : 0;
}

/* decode_layers(plan, layers, fields, x, B, hidden, H, KVH, D, eps, scale, cos_g, sin_g,
 *               cos_l, sin_l, slot_mapping_f, slot_mapping_l, slots_f, C_f, lengths_f,
 *               slots_l, C_l, lengths_l, caches, kv_kind, softcap): x [B, hidden] (the
 *               residual stream) updated in place; new K/V written at slot_mapping_f in
 *               full layers, slot_mapping_l in sliding ones; caches [layers, 4] (K, V, K
 *               scales, V scales), the stores fp32, fp16 or q8_0 (kv_kind 0, 1, 2; scales 0
 *               unless q8_0); softcap on every layer's attention scores as for
 *               attend_decode (0: none) */
static PyObject *py_decode_layers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(26);
    void *plan, *x, *ptr[12];
    int64_t layers, fields, B, hidden, H, KVH, D, Cf, Cl, kv_kind;
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
        !get_i64(args[24], &kv_kind) || !get_softcap(args[25], &softcap))
        return NULL;
    if (kv_kind < KV_CACHE_F32 || kv_kind > KV_CACHE_Q8_0 || (kv_kind == KV_CACHE_Q8_0 && D % 32))
        return PyErr_Format(PyExc_ValueError, "KV cache kind %lld with head dim %lld (valid: "
                            "0 fp32, 1 fp16, 2 q8_0 with D %% 32 == 0)", (long long)kv_kind,
                            (long long)D);
    if (fields != KV_PLAN_FIELDS)
        return PyErr_Format(PyExc_ValueError, "a layer plan has %lld fields, got %lld",
                            (long long)KV_PLAN_FIELDS, (long long)fields);
    if (KVH <= 0 || H % KVH)
        return PyErr_Format(PyExc_ValueError, "%lld query heads do not split into %lld KV "
                            "heads", (long long)H, (long long)KVH);
    const kv_step step = {.B = B, .hidden = hidden, .H = H, .KVH = KVH, .D = D, .eps = eps,
                          .scale = scale, .softcap = softcap, .cos = {ptr[0], ptr[2]},
                          .sin = {ptr[1], ptr[3]}, .slot_mapping = {ptr[4], ptr[10]},
                          .slots = {ptr[5], ptr[7]}, .lengths = {ptr[6], ptr[8]},
                          .C = {Cf, Cl}, .caches = ptr[9], .kv_kind = (int)kv_kind};
    const int use_avx2 = avx2_chosen();
    int rc;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&g_lock);
    rc = decode_layers(plan, layers, x, &step, use_avx2);
    pthread_mutex_unlock(&g_lock);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* moe_experts(experts, E, x, T, hidden, ids, weights, k, out): a layer's routed experts on
 * x [T, hidden] into out [T, hidden]; experts int64 [E, 3, 5] (gate|up part 0, part 1 or
 * zeros, down: kv_wdesc each), ids int64 and weights fp32 [T, k] (qk_moe.c) */
static PyObject *py_moe_experts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    NARGS(9);
    void *table, *x, *ids, *weights, *out;
    int64_t E, T, hidden, k;
    if (!get_ptr(args[0], &table) || !get_i64(args[1], &E) || !get_ptr(args[2], &x) ||
        !get_i64(args[3], &T) || !get_i64(args[4], &hidden) || !get_ptr(args[5], &ids) ||
        !get_ptr(args[6], &weights) || !get_i64(args[7], &k) || !get_ptr(args[8], &out))
        return NULL;
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
    pthread_mutex_lock(&g_lock);
    rc = kv_moe_experts(g_isa, table, E, x, T, hidden, ids, weights, k, out);
    pthread_mutex_unlock(&g_lock);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_plan_fields(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLongLong(KV_PLAN_FIELDS);
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
    pthread_mutex_lock(&g_lock);
    x = kv_stream_read(p, nbytes);
    pthread_mutex_unlock(&g_lock);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(x);
}

static PyObject *py_weight_bytes_read(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLongLong(atomic_load(&g_weight_bytes));
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg) {
    (void)self;
    const long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1) return PyErr_Format(PyExc_ValueError, "thread count must be >= 1, got %ld", n);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&g_lock);
    rc = kv_pool_set_threads((int)n);
    pthread_mutex_unlock(&g_lock);
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
    return PyUnicode_FromString(g_isa->name);
}

/* set_isa("auto" | "generic" | "avx2"): tests pin the portable path with this */
static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    const kv_isa *isa = NULL;
    if (!strcmp(name, "auto")) isa = best_isa();
    else if (!strcmp(name, "generic")) isa = &kv_isa_generic;
#ifdef KV_HAVE_AVX2_BUILD
    else if (!strcmp(name, "avx2") && cpu_has_avx2()) isa = &kv_isa_avx2;
#endif
    if (!isa) return PyErr_Format(PyExc_ValueError, "instruction set %R is not available "
                                  "here (valid: 'auto', 'generic'%s)", arg,
                                  cpu_has_avx2() ? ", 'avx2'" : "");
    pthread_mutex_lock(&g_lock);
    g_isa = isa;
    pthread_mutex_unlock(&g_lock);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"qmatmul", (PyCFunction)(void (*)(void))py_qmatmul, METH_FASTCALL,
     "qmatmul(qtype, w, rows, cols, row_bytes, x, n, y)"},
    {"dequantize", (PyCFunction)(void (*)(void))py_dequantize, METH_FASTCALL,
     "dequantize(qtype, w, rows, cols, row_bytes, out, parallel)"},
    {"dequantize_rows", (PyCFunction)(void (*)(void))py_dequantize_rows, METH_FASTCALL,
     "dequantize_rows(qtype, w, rows, cols, row_bytes, ids, n, out)"},
    {"quantize", (PyCFunction)(void (*)(void))py_quantize, METH_FASTCALL,
     "quantize(qtype, x, rows, cols, out)"},
    {"to_x8", (PyCFunction)(void (*)(void))py_to_x8, METH_FASTCALL,
     "to_x8(qtype, src, rows, cols, src_row_bytes, dst): rows in groups of 8 (qk_x8*.c)"},
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
     "start, n, H, KVH, D, window, scale, out, softcap): chunked prefill attention from the "
     "paged cache"},
    {"attend_decode", (PyCFunction)(void (*)(void))py_attend_decode, METH_FASTCALL,
     "attend_decode(q, q_stride, k, v, kind, k_scale, v_scale, num_slots, slots, B, C, H, "
     "KVH, D, scale, out, lengths, softcap)"},
    {"decode_layers", (PyCFunction)(void (*)(void))py_decode_layers, METH_FASTCALL,
     "decode_layers(plan, layers, fields, x, B, hidden, H, KVH, D, eps, scale, cos_g, sin_g, "
     "cos_l, sin_l, slot_mapping_f, slot_mapping_l, slots_f, C_f, lengths_f, slots_l, C_l, "
     "lengths_l, caches, kv_kind, softcap)"},
    {"moe_experts", (PyCFunction)(void (*)(void))py_moe_experts, METH_FASTCALL,
     "moe_experts(experts, E, x, T, hidden, ids, weights, k, out): a layer's routed experts"},
    {"plan_fields", py_plan_fields, METH_NOARGS, "int64 fields of one layer's decode plan"},
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

static void after_fork_child(void) {
    pthread_mutex_init(&g_lock, NULL);
    kv_pool_after_fork_child();
}

PyMODINIT_FUNC KV_MODULE_INIT(void) {
    kv_init_tables();
    g_isa = best_isa();
    pthread_atfork(NULL, NULL, after_fork_child);
    return PyModule_Create(&module);
}
