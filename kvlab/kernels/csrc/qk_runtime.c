/* The kernels' run-time state and the row jobs (declared in qk_runtime.h): the active
 * kernel set, the job lock, the scratch buffer, the weight-byte count, and the scheduler that
 * splits a product, a dequantization or a quantization over the thread pool by rows.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "qk.h"
#include "qk_pool.h"
#include "qk_runtime.h"

static const kv_isa *g_isa = &kv_isa_generic;
static pthread_mutex_t g_job_lock = PTHREAD_MUTEX_INITIALIZER;
static void *g_scratch;
static size_t g_scratch_bytes;
static atomic_llong g_weight_bytes;

void kv_job_lock(void) { pthread_mutex_lock(&g_job_lock); }
void kv_job_unlock(void) { pthread_mutex_unlock(&g_job_lock); }

void kv_count_weight_bytes(int64_t bytes) { atomic_fetch_add(&g_weight_bytes, bytes); }
int64_t kv_weight_bytes_read(void) { return atomic_load(&g_weight_bytes); }

int kv_cpu_has_avx2(void) {
#ifdef KV_HAVE_AVX2_BUILD
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

const kv_isa *kv_best_isa(void) {
#ifdef KV_HAVE_AVX2_BUILD
    if (kv_cpu_has_avx2()) return &kv_isa_avx2;
#endif
    return &kv_isa_generic;
}

const kv_isa *kv_active_isa(void) { return g_isa; }
void kv_set_active_isa(const kv_isa *isa) { g_isa = isa; }

int kv_avx2_active(void) {
#ifdef KV_HAVE_AVX2_BUILD
    return g_isa == &kv_isa_avx2;
#else
    return 0;
#endif
}

/* In a forked child only the forking thread exists: the lock and the pool start afresh. */
static void after_fork_child(void) {
    pthread_mutex_init(&g_job_lock, NULL);
    kv_pool_after_fork_child();
}

void kv_runtime_init(void) {
    kv_init_tables();
    g_isa = kv_best_isa();
    pthread_atfork(NULL, NULL, after_fork_child);
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
 * threads halves the bandwidth on a model's 0.1-1 MB matrices). A thread done with its
 * part takes chunks from the next parts, so a worker that is late, or never scheduled on a
 * busy machine, costs nothing but its own speed-up. A product's part is taken in chunks
 * that halve: half of what is left, then half of the rest, down to a unit of ~16 KiB at the
 * tail, so the threads finish together and most rows go in a few long calls. With one x row
 * (decode) a unit is little work, and a batch-1 sweep of a model's products streams 3-22 %
 * faster in chunks of 64 KiB-1 MiB than in units; with many (prefill) a call's set-up per x
 * row is spread over its rows (IQ4_XSx8's int16 copy of x on AVX2 takes 15 % of a 512-row
 * product done in 16 KiB units). Other jobs (dequantize, quantize) go in units.
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
 * 8192 Q3_K columns where 16 KiB is one group, would take the one-group tile). The lattice
 * types split between 16 rows for several x rows: their prefill decodes 16 rows at once. */
static void run_rows(rows_job *job, int64_t bytes_per_row) {
    const int nt = job->rows * bytes_per_row < 65536 ? 1 : kv_pool_threads();
    const int many = job->fn == gemv_rows && job->n > 1;
    const int64_t align = kv_is_grouped(job->qtype) ? (many ? 16 : 8)
                          : kv_is_lattice(job->qtype) && many ? 16
                                                                : 1;
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
    else if (qtype == KV_MXFP4X8) kv_deq_mxfp4x8_row(w, row_bytes, r, cols, out);
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

int kv_product(const kv_wdesc *w, const float *x, int64_t n, float *y, int64_t ystride) {
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

void kv_dequantize(int qtype, const uint8_t *w, int64_t rows, int64_t cols, int64_t row_bytes,
                   float *out, int parallel) {
    rows_job job = {.fn = deq_rows, .rows = rows, .qtype = qtype, .w = w,
                    .row_bytes = row_bytes, .cols = cols, .out = out};
    if (rows > 0 && parallel) run_rows(&job, row_bytes + cols * 4);
    else if (rows > 0) deq_rows(&job, 0, rows);
}

void kv_dequantize_row(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r, int64_t cols,
                       float *out) {
    deq_row(qtype, w, row_bytes, r, cols, out);
}

void kv_quantize_rows(int qtype, const float *x, int64_t rows, int64_t cols, uint8_t *out) {
    rows_job job = {.fn = quant_rows, .rows = rows, .qtype = qtype, .xq = x, .cols = cols,
                    .row_bytes = cols / kv_block_size(qtype) * kv_type_size(qtype),
                    .out = out};
    if (rows > 0) run_rows(&job, 64 * cols);  /* the K-quant searches are compute-bound */
}
