/* The recurrent layers' kernels of hybrid models (qk_recurrent.h): LFM2's and Mamba-2's short
 * causal convolution, Qwen3.5's gated delta rule, Mamba-2's selective scan (SSD) and their
 * gated RMS norms, on fp32 states kept per sequence slot. Hand-written because torch runs
 * these as hundreds of small ops per sequence and head (a Python loop over tokens or chunks),
 * where here one call covers a whole batch of sequences, threaded over (sequence, head).
 *
 * Prefill runs in the chunked form (transformers' torch_chunk_gated_delta_rule and
 * mamba2_chunk_scan): within a chunk of KV_RC_CHUNK tokens everything is matrix products,
 * and the state is read and written once per chunk instead of once per token. A chunk of
 * one token (decode) is the one-step recurrence, two passes over the state. What the heads of
 * a group share within a chunk (SSD's C B^T, the delta rule's k k^T and q k^T per key head)
 * is computed once, in a pre-pass over (chunk, group), before the (sequence, head) items.
 *
 * The arithmetic is a few vector primitives (rc_ops: c += a b products, dot, axpy, scale,
 * elementwise multiply-add, the SiLU gate, an SSM state row's step), one table per
 * instruction set: portable C, AVX2 (4 rows x 16 columns of c in registers) and AVX-512
 * (4 x 32; its SiLU gate is the AVX2 one). The algorithms are written once above them, so
 * every path computes the same steps and differs only in rounding. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "qk.h"
#include "qk_pool.h"
#include "qk_recurrent.h"

typedef struct {
    /* c[M, N] (rows ldc apart) += a[M, K] (rows lda apart) . b[K, N] (rows ldb apart) */
    void (*gemm)(float *c, int64_t ldc, const float *a, int64_t lda, const float *b,
                 int64_t ldb, int64_t M, int64_t K, int64_t N);
    float (*dot)(const float *a, const float *b, int64_t n);
    void (*axpy)(float *y, float a, const float *x, int64_t n);         /* y += a x */
    void (*scale)(float *y, float a, int64_t n);                        /* y *= a */
    void (*madd)(float *y, const float *a, const float *b, int64_t n);  /* y += a * b */
    /* y = a * silu(z) (a NULL: 1), elementwise; y may be a or z */
    void (*swish)(float *y, const float *a, const float *z, int64_t n);
    /* s = decay s + a b, then returns s . c: an SSM state row's one-token step */
    float (*scan_row)(float *s, float decay, float a, const float *b, const float *c, int64_t n);
} rc_ops;

/* ---- portable C ---- */

static void gemm_c(float *c, int64_t ldc, const float *a, int64_t lda, const float *b,
                   int64_t ldb, int64_t M, int64_t K, int64_t N) {
    for (int64_t i = 0; i < M; i++) {
        float *cr = c + i * ldc;
        for (int64_t k = 0; k < K; k++) {
            const float s = a[i * lda + k];
            const float *br = b + k * ldb;
            for (int64_t n = 0; n < N; n++) cr[n] += s * br[n];
        }
    }
}

static float dot_c(const float *a, const float *b, int64_t n) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int r = 0; r < 4; r++) s[r] += a[i + r] * b[i + r];
    for (; i < n; i++) s[0] += a[i] * b[i];
    return (s[0] + s[1]) + (s[2] + s[3]);
}

static void axpy_c(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

static void scale_c(float *y, float a, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] *= a;
}

static void madd_c(float *y, const float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a[i] * b[i];
}

static void swish_c(float *y, const float *a, const float *z, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float v = z[i] / (1.0f + expf(-z[i]));
        y[i] = a ? a[i] * v : v;
    }
}

static float scan_row_c(float *s, float decay, float a, const float *b, const float *c,
                        int64_t n) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        s[i] = s[i] * decay + a * b[i];
        acc += s[i] * c[i];
    }
    return acc;
}

static const rc_ops ops_c = {gemm_c, dot_c, axpy_c, scale_c, madd_c, swish_c, scan_row_c};

/* ---- AVX2 and AVX-512 ---- */
#ifdef KV_HAVE_AVX2_BUILD
#include "qk_avx2.h"
#include "qk_zmm.h"

/* R rows x V vectors of W floats of c held in registers over the whole K loop; each b
 * vector is loaded once for the R rows */
#define RC_TILE(name, INL, VEC, W, LOAD, STORE, SET1, FMA, R, V)                            \
    INL void name(float *c, int64_t ldc, const float *a, int64_t lda, const float *b,       \
                  int64_t ldb, int64_t K) {                                                 \
        VEC acc[R][V];                                                                      \
        for (int r = 0; r < R; r++)                                                         \
            for (int v = 0; v < V; v++) acc[r][v] = LOAD(c + r * ldc + v * W);              \
        for (int64_t k = 0; k < K; k++) {                                                   \
            VEC bv[V];                                                                      \
            for (int v = 0; v < V; v++) bv[v] = LOAD(b + k * ldb + v * W);                  \
            for (int r = 0; r < R; r++) {                                                   \
                const VEC s = SET1(a[r * lda + k]);                                         \
                for (int v = 0; v < V; v++) acc[r][v] = FMA(s, bv[v], acc[r][v]);           \
            }                                                                               \
        }                                                                                   \
        for (int r = 0; r < R; r++)                                                         \
            for (int v = 0; v < V; v++) STORE(c + r * ldc + v * W, acc[r][v]);              \
    }

/* columns [n, n + cols) of c, rows 4 at a time then one at a time */
#define RC_COLUMNS(T4, T1, cols)                                                            \
    for (; n + (cols) <= N; n += (cols)) {                                                  \
        int64_t i = 0;                                                                      \
        for (; i + 4 <= M; i += 4) T4(c + i * ldc + n, ldc, a + i * lda, lda, b + n, ldb, K); \
        for (; i < M; i++) T1(c + i * ldc + n, ldc, a + i * lda, lda, b + n, ldb, K);       \
    }

/* the product over columns COLS at a time, then HALF at a time, the rest by TAIL's */
#define RC_GEMM(sfx, TGT, T4, T1, COLS, T4H, T1H, HALF, TAIL)                                \
    TGT static void gemm_##sfx(float *c, int64_t ldc, const float *a, int64_t lda,          \
                               const float *b, int64_t ldb, int64_t M, int64_t K, int64_t N) { \
        int64_t n = 0;                                                                      \
        RC_COLUMNS(T4, T1, COLS)                                                            \
        RC_COLUMNS(T4H, T1H, HALF)                                                          \
        if (n < N) gemm_##TAIL(c + n, ldc, a, lda, b + n, ldb, M, K, N - n);                \
    }

/* dot, axpy, scale, madd and scan_row W floats at a time, the rest of n by TAIL's */
#define RC_VEC_OPS(sfx, TGT, VEC, W, LOAD, STORE, SET1, FMA, MUL, HSUM, TAIL, SWISH)         \
    TGT static float dot_##sfx(const float *a, const float *b, int64_t n) {                 \
        VEC s0 = SET1(0.0f), s1 = SET1(0.0f);                                               \
        int64_t i = 0;                                                                      \
        for (; i + 2 * W <= n; i += 2 * W) {                                                \
            s0 = FMA(LOAD(a + i), LOAD(b + i), s0);                                         \
            s1 = FMA(LOAD(a + i + W), LOAD(b + i + W), s1);                                 \
        }                                                                                   \
        return HSUM(FMA(s1, SET1(1.0f), s0)) + dot_##TAIL(a + i, b + i, n - i);             \
    }                                                                                       \
    TGT static void axpy_##sfx(float *y, float a, const float *x, int64_t n) {              \
        const VEC av = SET1(a);                                                             \
        int64_t i = 0;                                                                      \
        for (; i + W <= n; i += W) STORE(y + i, FMA(av, LOAD(x + i), LOAD(y + i)));         \
        axpy_##TAIL(y + i, a, x + i, n - i);                                                \
    }                                                                                       \
    TGT static void scale_##sfx(float *y, float a, int64_t n) {                             \
        const VEC av = SET1(a);                                                             \
        int64_t i = 0;                                                                      \
        for (; i + W <= n; i += W) STORE(y + i, MUL(av, LOAD(y + i)));                      \
        scale_##TAIL(y + i, a, n - i);                                                      \
    }                                                                                       \
    TGT static void madd_##sfx(float *y, const float *a, const float *b, int64_t n) {       \
        int64_t i = 0;                                                                      \
        for (; i + W <= n; i += W) STORE(y + i, FMA(LOAD(a + i), LOAD(b + i), LOAD(y + i))); \
        madd_##TAIL(y + i, a + i, b + i, n - i);                                            \
    }                                                                                       \
    TGT static float scan_row_##sfx(float *s, float decay, float a, const float *b,         \
                                    const float *c, int64_t n) {                            \
        const VEC dv = SET1(decay), av = SET1(a);                                           \
        VEC acc = SET1(0.0f);                                                               \
        int64_t i = 0;                                                                      \
        for (; i + W <= n; i += W) {                                                        \
            const VEC v = FMA(av, LOAD(b + i), MUL(dv, LOAD(s + i)));                       \
            STORE(s + i, v);                                                                \
            acc = FMA(v, LOAD(c + i), acc);                                                 \
        }                                                                                   \
        return HSUM(acc) + scan_row_##TAIL(s + i, decay, a, b + i, c + i, n - i);           \
    }                                                                                       \
    static const rc_ops ops_##sfx = {gemm_##sfx, dot_##sfx, axpy_##sfx, scale_##sfx,        \
                                     madd_##sfx, SWISH, scan_row_##sfx};

#define RC_TILES_AVX2(name, R, V)                                                           \
    RC_TILE(name, KV_INL, __m256, 8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps,     \
            _mm256_fmadd_ps, R, V)
RC_TILES_AVX2(tile4x16_avx2, 4, 2)
RC_TILES_AVX2(tile1x16_avx2, 1, 2)
RC_TILES_AVX2(tile4x8_avx2, 4, 1)
RC_TILES_AVX2(tile1x8_avx2, 1, 1)
RC_GEMM(avx2, KV_TGT, tile4x16_avx2, tile1x16_avx2, 16, tile4x8_avx2, tile1x8_avx2, 8, c)

/* e^x, x clamped to [-88, 88], by Cephes' expf steps: x = n ln2 + r, e^r by its degree-6
 * polynomial, times 2^n built in the exponent bits (to a float ulp or two) */
KV_INL __m256 exp_avx2(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    static const float poly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
    __m256 p = _mm256_set1_ps(poly[0]);
    for (int k = 1; k < 6; k++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(poly[k]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static KV_TGT void swish_avx2(float *y, const float *a, const float *z, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 zv = _mm256_loadu_ps(z + i);
        __m256 v = _mm256_div_ps(zv, _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), zv))));
        if (a) v = _mm256_mul_ps(v, _mm256_loadu_ps(a + i));
        _mm256_storeu_ps(y + i, v);
    }
    swish_c(y + i, a ? a + i : NULL, z + i, n - i);
}

RC_VEC_OPS(avx2, KV_TGT, __m256, 8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps,
           _mm256_fmadd_ps, _mm256_mul_ps, hsum_ps, c, swish_avx2)

KV_INL_Z float hsum_zmm(__m512 v) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return hsum_ps(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
}

#define RC_TILES_ZMM(name, R, V)                                                            \
    RC_TILE(name, KV_INL_Z, __m512, 16, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps,  \
            _mm512_fmadd_ps, R, V)
RC_TILES_ZMM(tile4x32_zmm, 4, 2)
RC_TILES_ZMM(tile1x32_zmm, 1, 2)
RC_TILES_ZMM(tile4x16_zmm, 4, 1)
RC_TILES_ZMM(tile1x16_zmm, 1, 1)
RC_GEMM(zmm, KV_TGT_Z, tile4x32_zmm, tile1x32_zmm, 32, tile4x16_zmm, tile1x16_zmm, 16, avx2)
RC_VEC_OPS(zmm, KV_TGT_Z, __m512, 16, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps,
           _mm512_fmadd_ps, _mm512_mul_ps, hsum_zmm, avx2, swish_avx2)
#endif

static const rc_ops *rc_pick(int isa) {
#ifdef KV_HAVE_AVX2_BUILD
    if (isa >= 2) return &ops_zmm;
    if (isa == 1) return &ops_avx2;
#else
    (void)isa;
#endif
    return &ops_c;
}

/* ---- jobs: items handed to the pool's threads from a shared counter, each thread with its
 * own scratch ---- */

typedef struct rc_job {
    void (*item)(const struct rc_job *j, int64_t item, float *scratch);
    const rc_ops *ops;
    int64_t items, scratch_floats;
    _Atomic int64_t next;
    const int64_t *slots, *lens, *starts;  /* per sequence; starts[s] = its first token */
} rc_job;

static void rc_task(void *p, int tid, int nthreads) {
    rc_job *j = p;
    (void)tid, (void)nthreads;
    float *scratch = malloc((size_t)(j->scratch_floats + 1) * sizeof(float));
    if (!scratch) return;  /* the other threads take the items; rc_run reports if none did */
    for (int64_t i; (i = atomic_fetch_add(&j->next, 1)) < j->items;) j->item(j, i, scratch);
    free(scratch);
}

/* all items of j over the pool; 0, or -1 when no thread had memory for its scratch */
static int rc_run(rc_job *j, int64_t S) {
    int64_t *starts = malloc((size_t)(S + 1) * sizeof(int64_t));
    if (!starts) return -1;
    starts[0] = 0;
    for (int64_t s = 0; s < S; s++) starts[s + 1] = starts[s] + j->lens[s];
    j->starts = starts;
    atomic_store(&j->next, 0);
    int nt = kv_pool_threads();
    if (nt > j->items) nt = (int)j->items;
    if (nt > 1) kv_pool_run(rc_task, j, nt);
    else rc_task(j, 0, 1);
    free(starts);
    return atomic_load(&j->next) >= j->items ? 0 : -1;
}

static inline int64_t rc_min(int64_t a, int64_t b) { return a < b ? a : b; }

/* L tokens from t of head h (reading key head or group kh) against its state S */
typedef void (*rc_chunk_fn)(const rc_job *j, int64_t t, int64_t L, int64_t h, int64_t kh,
                            float *S, float *scratch);

/* a sequence's n tokens from t0 in chunks of KV_RC_CHUNK; a chunk of one token (a decode
 * step) by the one-step recurrence */
static void rc_chunks(const rc_job *j, int64_t t0, int64_t n, int64_t h, int64_t kh, float *S,
                      float *scratch, rc_chunk_fn step, rc_chunk_fn chunk) {
    for (int64_t c = 0; c < n; c += KV_RC_CHUNK) {
        const int64_t L = rc_min(KV_RC_CHUNK, n - c);
        (L == 1 ? step : chunk)(j, t0 + c, L, h, kh, S, scratch);
    }
}

static void zero_rows(float *y, int64_t ld, int64_t rows, int64_t cols) {
    for (int64_t i = 0; i < rows; i++) memset(y + i * ld, 0, (size_t)cols * sizeof(float));
}

/* dst[c, r] = src[r, c] * (f ? f[r] : 1) for r < rows, c < cols (src rows ld apart) */
static void transpose(float *dst, const float *src, int64_t ld, int64_t rows, int64_t cols,
                      const float *f) {
    for (int64_t r = 0; r < rows; r++) {
        const float fr = f ? f[r] : 1.0f;
        for (int64_t c = 0; c < cols; c++) dst[c * rows + r] = src[r * ld + c] * fr;
    }
}

/* The chunks of more than one token in a call (first token, length), for a pre-pass that
 * computes what the heads of a group (or key head) share once per chunk: its results for the
 * chunk from token t, group gi, lie at rc_shared(cl, t, L, gi), `width` x L floats each */
typedef struct {
    int64_t n, groups, width, *t, *len;
    float *buf;  /* [T, groups, width * KV_RC_CHUNK]: a chunk's rows hold its groups' results */
} rc_chunk_list;

static float *rc_shared(const rc_chunk_list *cl, int64_t t, int64_t L, int64_t gi) {
    return cl->buf + (t * cl->groups + gi * L) * cl->width * KV_RC_CHUNK;
}

/* 0, or -1 when out of memory (then freed) */
static int rc_chunk_list_init(rc_chunk_list *cl, const int64_t *lens, int64_t S, int64_t groups,
                              int64_t width) {
    const int64_t CH = KV_RC_CHUNK;
    int64_t T = 0, n = 0;
    for (int64_t s = 0; s < S; s++) {
        T += lens[s];
        n += lens[s] > 1 ? (lens[s] + CH - 1) / CH : 0;
    }
    *cl = (rc_chunk_list){.n = n, .groups = groups, .width = width,
                          .t = malloc((size_t)(2 * n + 1) * sizeof(int64_t)),
                          .buf = malloc((size_t)(T * groups * width * CH + 1) * sizeof(float))};
    if (!cl->t || !cl->buf) {
        free(cl->t);
        free(cl->buf);
        return -1;
    }
    cl->len = cl->t + n;
    for (int64_t s = 0, t0 = 0, c = 0; s < S; t0 += lens[s++])
        for (int64_t o = 0; lens[s] > 1 && o < lens[s]; o += CH, c++) {
            cl->t[c] = t0 + o;
            cl->len[c] = rc_min(CH, lens[s] - o);
        }
    return 0;
}

/* j's items after the pre-pass `pre` over (chunk, group) items on the same job, with
 * pre_scratch floats per thread; frees cl */
static int rc_run_shared(rc_job *j, int64_t S, rc_chunk_list *cl,
                         void (*pre)(const rc_job *, int64_t, float *), int64_t pre_scratch) {
    void (*item)(const rc_job *, int64_t, float *) = j->item;
    const int64_t items = j->items, scratch = j->scratch_floats;
    j->item = pre;
    j->items = cl->n * cl->groups;
    j->scratch_floats = pre_scratch;
    int rc = cl->n ? rc_run(j, S) : 0;
    j->item = item;
    j->items = items;
    j->scratch_floats = scratch;
    if (!rc) rc = rc_run(j, S);
    free(cl->t);
    free(cl->buf);
    return rc;
}

/* ---- short convolution ---- */

#define CONV_BLOCK 256  /* channels per item */

typedef struct {
    rc_job base;
    const float *x, *wt, *bias;  /* wt: the weight transposed, [K, C] */
    float *states, *out;
    int64_t C, K, blocks;
    int silu;
} conv_job;

/* row i of a sequence's K-1 state rows followed by its tokens */
static const float *conv_row(const conv_job *j, const float *state, int64_t t0, int64_t i) {
    return i < j->K - 1 ? state + i * j->C : j->x + (t0 + i - (j->K - 1)) * j->C;
}

static void conv_item(const rc_job *base, int64_t item, float *scratch) {
    const conv_job *j = (const conv_job *)base;
    (void)scratch;
    const int64_t s = item / j->blocks, c0 = item % j->blocks * CONV_BLOCK;
    const int64_t cw = rc_min(CONV_BLOCK, j->C - c0), n = base->lens[s], t0 = base->starts[s];
    float *state = j->states + base->slots[s] * (j->K - 1) * j->C;
    for (int64_t t = 0; t < n; t++) {
        float *y = j->out + (t0 + t) * j->C + c0;
        if (j->bias) memcpy(y, j->bias + c0, (size_t)cw * sizeof(float));
        else memset(y, 0, (size_t)cw * sizeof(float));
        for (int64_t k = 0; k < j->K; k++)
            base->ops->madd(y, j->wt + k * j->C + c0, conv_row(j, state, t0, t + k) + c0, cw);
        if (j->silu) base->ops->swish(y, NULL, y, cw);
    }
    /* the last K-1 inputs; row r reads row n + r >= r, so ascending r reads before it writes */
    for (int64_t r = 0; r < j->K - 1; r++)
        memmove(state + r * j->C + c0, conv_row(j, state, t0, n + r) + c0, (size_t)cw * sizeof(float));
}

int kv_short_conv(const float *x, const float *w, const float *bias, float *states,
                  const int64_t *slots, const int64_t *lens, int64_t S, int64_t C, int64_t K,
                  int silu, float *out, int isa) {
    float *wt = malloc((size_t)(K * C + 1) * sizeof(float));
    if (!wt) return -1;
    transpose(wt, w, K, C, K, NULL);
    conv_job j = {.base = {.item = conv_item, .ops = rc_pick(isa), .slots = slots, .lens = lens},
                  .x = x, .wt = wt, .bias = bias, .states = states, .out = out, .C = C, .K = K,
                  .blocks = (C + CONV_BLOCK - 1) / CONV_BLOCK, .silu = silu};
    j.base.items = S * j.blocks;
    const int rc = rc_run(&j.base, S);
    free(wt);
    return rc;
}

/* ---- gated delta rule ---- */

typedef struct {
    rc_job base;
    const float *q, *k, *v, *g, *beta;
    float *states, *out;
    int64_t Hk, Hv, Dk, Dv;
    float scale;
    rc_chunk_list cl;  /* each chunk's k k^T and q k^T [L, L] per key head, shared by its
                        * value heads */
} gdr_job;

/* the pre-pass: k k^T then q k^T of chunk item / Hk for key head item % Hk */
static void gdr_gram_item(const rc_job *base, int64_t item, float *kt) {
    const gdr_job *j = (const gdr_job *)base;
    const int64_t c = item / j->Hk, kh = item % j->Hk, t = j->cl.t[c], L = j->cl.len[c];
    const int64_t ld = j->Hk * j->Dk;
    const float *q0 = j->q + (t * j->Hk + kh) * j->Dk, *k0 = j->k + (t * j->Hk + kh) * j->Dk;
    float *kk = rc_shared(&j->cl, t, L, kh);
    transpose(kt, k0, ld, L, j->Dk, NULL);
    memset(kk, 0, (size_t)(2 * L * L) * sizeof(float));
    base->ops->gemm(kk, L, k0, ld, kt, L, L, j->Dk, L);
    base->ops->gemm(kk + L * L, L, q0, ld, kt, L, L, j->Dk, L);
}

/* one token of value head h (key head kh): S = exp(g) S; delta = beta (v - k^T S);
 * S += k delta^T; out = scale q^T S */
static void gdr_step(const rc_job *base, int64_t t, int64_t L, int64_t h, int64_t kh, float *S,
                     float *mem) {
    const gdr_job *j = (const gdr_job *)base;
    const rc_ops *o = base->ops;
    (void)L;
    const int64_t Dk = j->Dk, Dv = j->Dv;
    const float *q = j->q + (t * j->Hk + kh) * Dk, *k = j->k + (t * j->Hk + kh) * Dk;
    const float *v = j->v + (t * j->Hv + h) * Dv;
    float *y = j->out + (t * j->Hv + h) * Dv;
    const float decay = expf(j->g[t * j->Hv + h]), b = j->beta[t * j->Hv + h];
    memset(mem, 0, (size_t)Dv * sizeof(float));
    for (int64_t d = 0; d < Dk; d++) {
        o->scale(S + d * Dv, decay, Dv);
        o->axpy(mem, k[d], S + d * Dv, Dv);
    }
    for (int64_t i = 0; i < Dv; i++) mem[i] = (v[i] - mem[i]) * b;
    memset(y, 0, (size_t)Dv * sizeof(float));
    for (int64_t d = 0; d < Dk; d++) {
        o->axpy(S + d * Dv, k[d], mem, Dv);
        o->axpy(y, q[d] * j->scale, S + d * Dv, Dv);
    }
}

/* the chunk's intra-chunk matrices from cum (the cumulated log decay):
 *   A[i, j] = beta_i k_i.k_j exp(cum_i - cum_j), j < i   (the UT system's strict lower part)
 *   P[i, j] = scale q_i.k_j exp(cum_i - cum_j),  j <= i  (the causal in-chunk attention) */
static void gdr_chunk_matrices(const gdr_job *j, int64_t t, int64_t L, int64_t kh,
                               const float *beta, const float *cum, float *A, float *P) {
    const float *kk = rc_shared(&j->cl, t, L, kh), *qk = kk + L * L;
    for (int64_t r = 0; r < L; r++)
        for (int64_t c = 0; c < L; c++) {
            const float e = c <= r ? expf(cum[r] - cum[c]) : 0.0f;
            A[r * L + c] = c < r ? kk[r * L + c] * beta[r] * e : 0.0f;
            P[r * L + c] = qk[r * L + c] * j->scale * e;
        }
}

/* L tokens from t of value head h, in the chunked form (transformers'
 * torch_chunk_gated_delta_rule): solve (I + A) U = beta v and (I + A) W = -beta k exp(cum)
 * by forward substitution; then v_new = U + W S, out = scale q exp(cum) S + P v_new and
 * S = exp(cum_L) S + (k exp(cum_L - cum))^T v_new */
static void gdr_chunk(const rc_job *base, int64_t t, int64_t L, int64_t h, int64_t kh, float *S,
                      float *scratch) {
    const gdr_job *j = (const gdr_job *)base;
    const rc_ops *o = base->ops;
    const int64_t Dk = j->Dk, Dv = j->Dv, ldk = j->Hk * Dk, ldv = j->Hv * Dv, CH = KV_RC_CHUNK;
    const float *q0 = j->q + (t * j->Hk + kh) * Dk, *k0 = j->k + (t * j->Hk + kh) * Dk;
    const float *v0 = j->v + (t * j->Hv + h) * Dv;
    float *y0 = j->out + (t * j->Hv + h) * Dv;
    float *cum = scratch, *beta = cum + CH, *ecum = beta + CH, *kt = ecum + CH;
    float *A = kt + Dk * CH, *P = A + CH * CH, *U = P + CH * CH, *W = U + CH * Dv;
    float *Q = W + CH * Dk;
    float acc = 0.0f;
    for (int64_t i = 0; i < L; i++) {
        acc += j->g[(t + i) * j->Hv + h];
        cum[i] = acc;
        ecum[i] = expf(acc);
        beta[i] = j->beta[(t + i) * j->Hv + h];
    }
    gdr_chunk_matrices(j, t, L, kh, beta, cum, A, P);
    for (int64_t i = 0; i < L; i++) {
        for (int64_t c = 0; c < Dv; c++) U[i * Dv + c] = beta[i] * v0[i * ldv + c];
        for (int64_t c = 0; c < Dk; c++) {
            W[i * Dk + c] = -beta[i] * ecum[i] * k0[i * ldk + c];
            Q[i * Dk + c] = q0[i * ldk + c] * j->scale * ecum[i];
        }
        for (int64_t c = 0; c < i; c++) {
            o->axpy(U + i * Dv, -A[i * L + c], U + c * Dv, Dv);
            o->axpy(W + i * Dk, -A[i * L + c], W + c * Dk, Dk);
        }
    }
    o->gemm(U, Dv, W, Dk, S, Dv, L, Dk, Dv);  /* U is v_new from here */
    zero_rows(y0, ldv, L, Dv);
    o->gemm(y0, ldv, Q, Dk, S, Dv, L, Dk, Dv);
    o->gemm(y0, ldv, P, L, U, Dv, L, L, Dv);
    for (int64_t i = 0; i < L; i++) ecum[i] = expf(cum[L - 1] - cum[i]);
    transpose(kt, k0, ldk, L, Dk, ecum);
    o->scale(S, expf(cum[L - 1]), Dk * Dv);
    o->gemm(S, Dv, kt, L, U, Dv, Dk, L, Dv);
}

static void gdr_item(const rc_job *base, int64_t item, float *scratch) {
    const gdr_job *j = (const gdr_job *)base;
    const int64_t s = item / j->Hv, h = item % j->Hv, kh = h / (j->Hv / j->Hk);
    float *S = j->states + (base->slots[s] * j->Hv + h) * j->Dk * j->Dv;
    rc_chunks(base, base->starts[s], base->lens[s], h, kh, S, scratch, gdr_step, gdr_chunk);
}

int kv_gated_delta_rule(const float *q, const float *k, const float *v, const float *g,
                        const float *beta, float *states, const int64_t *slots,
                        const int64_t *lens, int64_t S, int64_t Hk, int64_t Hv, int64_t Dk,
                        int64_t Dv, float scale, float *out, int isa) {
    const int64_t CH = KV_RC_CHUNK;
    gdr_job j = {.base = {.item = gdr_item, .ops = rc_pick(isa), .items = S * Hv,
                          .scratch_floats = 3 * CH + 2 * Dk * CH + 2 * CH * CH + CH * Dv + CH * Dk,
                          .slots = slots, .lens = lens},
                 .q = q, .k = k, .v = v, .g = g, .beta = beta, .states = states, .out = out,
                 .Hk = Hk, .Hv = Hv, .Dk = Dk, .Dv = Dv, .scale = scale};
    if (rc_chunk_list_init(&j.cl, lens, S, Hk, 2)) return -1;
    return rc_run_shared(&j.base, S, &j.cl, gdr_gram_item, Dk * CH);
}

/* ---- Mamba-2 selective scan (SSD) ---- */

typedef struct {
    rc_job base;
    const float *x, *dt, *A, *B, *C, *D;
    float *states, *out;
    int64_t H, P, G, N;
    rc_chunk_list cl;  /* each chunk's C B^T [L, L] per group, shared by the group's heads */
} ssd_job;

/* the pre-pass: C B^T of chunk item / G for group item % G */
static void ssd_cb_item(const rc_job *base, int64_t item, float *bt) {
    const ssd_job *j = (const ssd_job *)base;
    const int64_t c = item / j->G, gi = item % j->G, t = j->cl.t[c], L = j->cl.len[c];
    const int64_t ldb = j->G * j->N;
    float *cb = rc_shared(&j->cl, t, L, gi);
    transpose(bt, j->B + (t * j->G + gi) * j->N, ldb, L, j->N, NULL);
    memset(cb, 0, (size_t)(L * L) * sizeof(float));
    base->ops->gemm(cb, L, j->C + (t * j->G + gi) * j->N, ldb, bt, L, L, j->N, L);
}

/* one token of head h (group gi): S = exp(dt A) S + dt x B^T; out = S C */
static void ssd_step(const rc_job *base, int64_t t, int64_t L, int64_t h, int64_t gi, float *S,
                     float *scratch) {
    const ssd_job *j = (const ssd_job *)base;
    const rc_ops *o = base->ops;
    (void)L, (void)scratch;
    const int64_t P = j->P, N = j->N;
    const float *x = j->x + (t * j->H + h) * P;
    const float *B = j->B + (t * j->G + gi) * N, *C = j->C + (t * j->G + gi) * N;
    float *y = j->out + (t * j->H + h) * P;
    const float dt = j->dt[t * j->H + h], dA = expf(dt * j->A[h]);
    for (int64_t p = 0; p < P; p++) y[p] = o->scan_row(S + p * N, dA, dt * x[p], B, C, N);
}

/* L tokens from t of head h in the chunked form (transformers' mamba2_chunk_scan), with cum
 * the cumulated dt A: out = M x + exp(cum) C S^T with M[i, j] = C_i.B_j exp(cum_i - cum_j)
 * dt_j for j <= i; then S = exp(cum_L) S + (x dt exp(cum_L - cum))^T B */
static void ssd_chunk(const rc_job *base, int64_t t, int64_t L, int64_t h, int64_t gi, float *S,
                      float *scratch) {
    const ssd_job *j = (const ssd_job *)base;
    const rc_ops *o = base->ops;
    const int64_t P = j->P, N = j->N, ldx = j->H * P, ldb = j->G * N, CH = KV_RC_CHUNK;
    const float *x0 = j->x + (t * j->H + h) * P;
    const float *B0 = j->B + (t * j->G + gi) * N, *C0 = j->C + (t * j->G + gi) * N;
    float *y0 = j->out + (t * j->H + h) * P;
    const float *cb = rc_shared(&j->cl, t, L, gi);
    float *cum = scratch, *dt = cum + CH, *e = dt + CH, *M = e + CH;
    float *cs = M + CH * CH, *st = cs + CH * N, *xt = st + N * P;
    float acc = 0.0f;
    for (int64_t i = 0; i < L; i++) {
        dt[i] = j->dt[(t + i) * j->H + h];
        acc += dt[i] * j->A[h];
        cum[i] = acc;
    }
    for (int64_t r = 0; r < L; r++)
        for (int64_t c = 0; c < L; c++)
            M[r * L + c] = c <= r ? cb[r * L + c] * expf(cum[r] - cum[c]) * dt[c] : 0.0f;
    zero_rows(y0, ldx, L, P);
    o->gemm(y0, ldx, M, L, x0, ldx, L, L, P);
    for (int64_t i = 0; i < L; i++) e[i] = expf(cum[i]);
    for (int64_t i = 0; i < L; i++)
        for (int64_t c = 0; c < N; c++) cs[i * N + c] = C0[i * ldb + c] * e[i];
    transpose(st, S, N, P, N, NULL);
    o->gemm(y0, ldx, cs, N, st, P, L, N, P);
    for (int64_t i = 0; i < L; i++) e[i] = dt[i] * expf(cum[L - 1] - cum[i]);
    transpose(xt, x0, ldx, L, P, e);
    o->scale(S, expf(cum[L - 1]), P * N);
    o->gemm(S, N, xt, L, B0, ldb, P, L, N);
}

static void ssd_item(const rc_job *base, int64_t item, float *scratch) {
    const ssd_job *j = (const ssd_job *)base;
    const int64_t s = item / j->H, h = item % j->H, gi = h / (j->H / j->G);
    float *S = j->states + (base->slots[s] * j->H + h) * j->P * j->N;
    const int64_t n = base->lens[s], t0 = base->starts[s];
    rc_chunks(base, t0, n, h, gi, S, scratch, ssd_step, ssd_chunk);
    if (j->D)
        for (int64_t t = t0; t < t0 + n; t++)
            base->ops->axpy(j->out + (t * j->H + h) * j->P, j->D[h], j->x + (t * j->H + h) * j->P, j->P);
}

int kv_ssd_scan(const float *x, const float *dt, const float *A, const float *B, const float *C,
                const float *D, float *states, const int64_t *slots, const int64_t *lens,
                int64_t S, int64_t H, int64_t P, int64_t G, int64_t N, float *out, int isa) {
    const int64_t CH = KV_RC_CHUNK;
    ssd_job j = {.base = {.item = ssd_item, .ops = rc_pick(isa), .items = S * H,
                          .scratch_floats = 3 * CH + CH * CH + CH * N + N * P + P * CH,
                          .slots = slots, .lens = lens},
                 .x = x, .dt = dt, .A = A, .B = B, .C = C, .D = D, .states = states, .out = out,
                 .H = H, .P = P, .G = G, .N = N};
    if (rc_chunk_list_init(&j.cl, lens, S, G, 1)) return -1;
    return rc_run_shared(&j.base, S, &j.cl, ssd_cb_item, N * CH);
}

/* ---- gated RMS norm ---- */

#define NORM_ROWS 16  /* rows per item */

typedef struct {
    rc_job base;
    const float *x, *z, *w;
    float *out;
    int64_t rows, D, group;
    float eps;
    int before;
} norm_job;

/* one group: norm(x) w silu(z) (before), else norm(x silu(z)) w */
static void norm_group(const norm_job *j, const float *x, const float *z, const float *w,
                       float *y) {
    const rc_ops *o = j->base.ops;
    const int64_t n = j->group;
    const float *h = x;
    if (!j->before) {
        o->swish(y, x, z, n);
        h = y;
    }
    const float r = 1.0f / sqrtf(o->dot(h, h, n) / (float)n + j->eps);
    for (int64_t c = 0; c < n; c++) y[c] = h[c] * r * w[c];
    if (j->before) o->swish(y, y, z, n);
}

static void norm_item(const rc_job *base, int64_t item, float *scratch) {
    const norm_job *j = (const norm_job *)base;
    (void)scratch;
    for (int64_t r = item * NORM_ROWS; r < rc_min(j->rows, (item + 1) * NORM_ROWS); r++)
        for (int64_t g0 = 0; g0 < j->D; g0 += j->group)
            norm_group(j, j->x + r * j->D + g0, j->z + r * j->D + g0, j->w + g0, j->out + r * j->D + g0);
}

int kv_gated_rms_norm(const float *x, const float *z, const float *w, float *out,
                      int64_t rows, int64_t D, int64_t group, float eps, int norm_before_gate,
                      int isa) {
    norm_job j = {.base = {.item = norm_item, .ops = rc_pick(isa),
                           .items = (rows + NORM_ROWS - 1) / NORM_ROWS, .lens = NULL},
                  .x = x, .z = z, .w = w, .out = out, .rows = rows, .D = D, .group = group,
                  .eps = eps, .before = norm_before_gate};
    return rc_run(&j.base, 0);
}
