/* Multi-head latent attention on the latent cache, absorbed (declared in qk_mla.h).
 *
 * Three passes over the step's T x H (token, head) rows:
 *
 *   absorb   qa[t, h] = [q_nope[t, h] W_UK_h | q_rope[t, h]]         (rank + rope values)
 *   attend   a[t, h]  = sum_j softmax_j(scale * qa[t, h] . row_j) row_j over the cache rows
 *   expand   out[t, h] = a[t, h][:rank] W_UV_h^T                      (vdim values)
 *
 * The middle pass is the paged attention of qk_attn.c (decode) or qk_flash.c (prefill)
 * with one KV head of width rank + rope read as keys and as values: every head shares each
 * cache row, which is read once per step for all of them, and the heads' keys and values are
 * never expanded. Absorb and expand are the same operation, y = sum_i a_i W[i, :] over the
 * rows of a head's fp32 matrix, split over the thread pool by (token, head) rows; its inner
 * loop is portable C, AVX2 (8 floats a step) or AVX-512 (16).
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "qk.h"
#include "qk_mla.h"
#include "qk_pool.h"

/* y[0, width) = sum_{i < n} a[i] * w[i * stride + 0 .. width) */
typedef void (*combine_fn)(const float *a, int64_t n, const float *w, int64_t stride,
                           int64_t width, float *y);

static void combine_c(const float *a, int64_t n, const float *w, int64_t stride, int64_t width,
                      float *y) {
    for (int64_t c = 0; c < width; c++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < n; i++) acc += a[i] * w[i * stride + c];
        y[c] = acc;
    }
}

#ifdef KV_HAVE_AVX2_BUILD
#include <immintrin.h>
#include "qk_avx2.h"
#include "qk_zmm.h"

/* Four vectors of columns at a time down all n rows (the accumulators stay in registers),
 * then one vector, then the columns left to TAIL (AVX-512: the AVX2 function, whose 8-wide
 * steps and scalar tail then match AVX2's own). Each column is one FMA chain over the rows
 * in every path, so AVX2 and AVX-512 give the same bits. */
#define MLA_COMBINE(name, TGT, VEC, LANES, LOAD, STORE, SET1, FMA, ZERO, TAIL)               \
    TGT static void name(const float *a, int64_t n, const float *w, int64_t stride,           \
                         int64_t width, float *y) {                                           \
        int64_t c = 0;                                                                        \
        for (; c + 4 * LANES <= width; c += 4 * LANES) {                                      \
            VEC acc0 = ZERO(), acc1 = ZERO(), acc2 = ZERO(), acc3 = ZERO();                   \
            for (int64_t i = 0; i < n; i++) {                                                 \
                const VEC x = SET1(a[i]);                                                     \
                const float *r = w + i * stride + c;                                          \
                acc0 = FMA(x, LOAD(r), acc0);                                                 \
                acc1 = FMA(x, LOAD(r + LANES), acc1);                                         \
                acc2 = FMA(x, LOAD(r + 2 * LANES), acc2);                                     \
                acc3 = FMA(x, LOAD(r + 3 * LANES), acc3);                                     \
            }                                                                                 \
            STORE(y + c, acc0);                                                               \
            STORE(y + c + LANES, acc1);                                                       \
            STORE(y + c + 2 * LANES, acc2);                                                   \
            STORE(y + c + 3 * LANES, acc3);                                                   \
        }                                                                                     \
        for (; c + LANES <= width; c += LANES) {                                              \
            VEC acc = ZERO();                                                                 \
            for (int64_t i = 0; i < n; i++)                                                   \
                acc = FMA(SET1(a[i]), LOAD(w + i * stride + c), acc);                        \
            STORE(y + c, acc);                                                                \
        }                                                                                     \
        if (c < width) TAIL(a, n, w + c, stride, width - c, y + c);                           \
    }

MLA_COMBINE(combine_avx2, KV_TGT, __m256, 8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps,
            _mm256_fmadd_ps, _mm256_setzero_ps, combine_c)
MLA_COMBINE(combine_zmm, KV_TGT_Z, __m512, 16, _mm512_loadu_ps, _mm512_storeu_ps,
            _mm512_set1_ps, _mm512_fmadd_ps, _mm512_setzero_ps, combine_avx2)
#endif

static combine_fn pick_combine(int isa) {
#ifdef KV_HAVE_AVX2_BUILD
    if (isa >= 2 && kv_use_vnni()) return combine_zmm;
    if (isa >= 1) return combine_avx2;
#else
    (void)isa;
#endif
    return combine_c;
}

/* One pass over rows t * H + h: y row t * H + h (y_stride floats) from that row's first n
 * values in x (token t's row at x + t * x_tok + h * x_head) and head h's matrix [n, width].
 * Work items go head by head (item i: head i / T, token i % T), so a batch's tokens take
 * their head's matrix while it is still in cache. */
typedef struct {
    combine_fn combine;
    const float *x, *w;
    int64_t x_tok, x_head, n, width, w_head, H, rows;
    float *y;
    int64_t y_stride;
    _Atomic int64_t next;  /* the next row to take: a worker that comes late takes none */
} mla_pass;

static void pass_task(void *p, int tid, int nthreads) {
    mla_pass *j = p;
    (void)tid;
    (void)nthreads;
    const int64_t T = j->rows / j->H;
    for (int64_t i; (i = atomic_fetch_add(&j->next, 1)) < j->rows;) {
        const int64_t h = i / T, t = i % T;
        j->combine(j->x + t * j->x_tok + h * j->x_head, j->n, j->w + h * j->w_head, j->width,
                   j->width, j->y + (t * j->H + h) * j->y_stride);
    }
}

static void run_pass(mla_pass *j) {
    /* below 256 KiB of weights a worker's wake-up costs more than it saves */
    const int64_t bytes = j->rows * j->n * j->width * (int64_t)sizeof(float);
    int nt = bytes < 262144 ? 1 : kv_pool_threads();
    if (nt > j->rows) nt = (int)j->rows;
    atomic_store(&j->next, 0);
    if (nt > 1) kv_pool_run(pass_task, j, nt);
    else pass_task(j, 0, 1);
}

/* qa [T, H, rank + rope]: q_nope through W_UK, then q_rope copied beside it */
static void absorb(const float *q, int64_t q_stride, const kv_mla_heads *m, int64_t T,
                   float *qa, combine_fn combine) {
    const int64_t W = m->rank + m->rope, D = m->nope + m->rope;
    mla_pass j = {.combine = combine, .x = q, .w = m->w_uk, .x_tok = q_stride, .x_head = D,
                  .n = m->nope, .width = m->rank, .w_head = m->nope * m->rank, .H = m->H,
                  .rows = T * m->H, .y = qa, .y_stride = W};
    run_pass(&j);
    for (int64_t r = 0; r < T * m->H; r++)
        memcpy(qa + r * W + m->rank, q + (r / m->H) * q_stride + (r % m->H) * D + m->nope,
               (size_t)m->rope * sizeof(float));
}

/* out [T, H * vdim] from each head's attention row (its first rank values: the latent's) */
static void expand(const float *att, const kv_mla_heads *m, int64_t T, float *out,
                   combine_fn combine) {
    const int64_t W = m->rank + m->rope;
    mla_pass j = {.combine = combine, .x = att, .w = m->w_uv_t, .x_tok = m->H * W, .x_head = W,
                  .n = m->rank, .width = m->vdim, .w_head = m->rank * m->vdim, .H = m->H,
                  .rows = T * m->H, .y = out, .y_stride = m->vdim};
    run_pass(&j);
}

int kv_mla_attend(const float *q, int64_t q_stride, const kv_mla_heads *m,
                  const kv_cache_ref *kv, const kv_mla_keys *keys, float scale, float *out,
                  int isa) {
    const int64_t W = m->rank + m->rope, T = keys->B;
    const combine_fn combine = pick_combine(isa);
    float *qa = malloc((size_t)(2 * T * m->H * W) * sizeof(float));  /* qa, then att */
    if (!qa) return -1;
    float *att = qa + T * m->H * W;
    absorb(q, q_stride, m, T, qa, combine);
    const int rc = keys->prefill
        ? kv_attend_prefill(qa, m->H * W, kv, keys->slots, keys->first, keys->start, T, m->H,
                            1, W, 0, scale, 0.0f, NULL, att, isa >= 1)
        : kv_attend_decode(qa, m->H * W, kv, keys->slots, keys->lengths, T, keys->C, m->H, 1,
                           W, scale, 0.0f, NULL, att, isa >= 1);
    if (!rc) expand(att, m, T, out, combine);
    free(qa);
    return rc;
}
