/* Small fp32 ops of the decode step, fused so that each costs one call instead of several
 * torch kernels: RMSNorm (optionally added into a residual), rotate-half RoPE (optionally
 * after a per-head RMSNorm), and GeGLU. Single-threaded: a decode step's rows are short.
 *
 * Rounding follows torch's composite ops step by step (x * rsqrt(mean(x^2) + eps), then
 * * w; x * cos + rotated * sin), so with -ffp-contract=off the results match torch's
 * exactly except for the order of the sum of squares, which runs in double here.
 */
#include <math.h>
#include <stdatomic.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "qk.h"
#include "qk_pool.h"
#ifdef KV_HAVE_AVX2_BUILD
#include <immintrin.h>
#endif

/* 1 / sqrt(mean(x^2) + eps), the mean in double and then rounded to fp32 as torch's */
static float rms_scale(const float *x, int64_t dim, float eps) {
    double acc[4] = {0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 4 <= dim; i += 4)
        for (int k = 0; k < 4; k++) acc[k] += (double)x[i + k] * x[i + k];
    for (; i < dim; i++) acc[0] += (double)x[i] * x[i];
    const float mean = (float)((acc[0] + acc[1] + acc[2] + acc[3]) / (double)dim);
    return 1.0f / sqrtf(mean + eps);
}

void kv_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t dim,
                 float eps) {
    for (int64_t r = 0; r < rows; r++, x += dim, out += dim) {
        const float s = rms_scale(x, dim, eps);
        for (int64_t i = 0; i < dim; i++) out[i] = (x[i] * s) * w[i];
    }
}

void kv_add_rms_norm(float *res, const float *h, const float *w, int64_t rows, int64_t dim,
                     float eps) {
    for (int64_t r = 0; r < rows; r++, res += dim, h += dim) {
        const float s = rms_scale(h, dim, eps);
        for (int64_t i = 0; i < dim; i++) res[i] += (h[i] * s) * w[i];
    }
}

/* One head in place: x[i] * cos[i] + rotated[i] * sin[i], rotated = (-x[half:], x[:half]) */
static void rope_head(float *x, const float *cos, const float *sin, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

void kv_norm_rope(float *x, int64_t tokens, int64_t row_stride, int64_t heads, int64_t dim,
                  const float *w, const float *cos, const float *sin, float eps) {
    for (int64_t t = 0; t < tokens; t++) {
        float *row = x + t * row_stride;
        for (int64_t h = 0; h < heads; h++) {
            float *head = row + h * dim;
            if (w) kv_rms_norm(head, w, head, 1, dim, eps);
            rope_head(head, cos + t * dim, sin + t * dim, dim);
        }
    }
}

/* fp32 -> fp16 of n values, rounded to nearest even (kv_f2h one at a time; with F16C eight
 * at a time, the same halves but for a NaN's payload bits, kept by F16C, set by kv_f2h) */
static void to_half(kv_half *d, const float *s, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] = kv_f2h(s[i]);
}
#ifdef KV_HAVE_AVX2_BUILD
static __attribute__((target("avx,f16c"))) void to_half8(kv_half *d, const float *s, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
    to_half(d + i, s + i, n - i);
}
#endif

/* dst[slots[j]] = src row j (row values, rows src_stride floats apart): the paged KV write */
void kv_scatter_rows(void *dst, int kv_f16, const float *src, int64_t src_stride,
                     const int64_t *slots, int64_t n, int64_t row) {
    void (*half)(kv_half *, const float *, int64_t) = to_half;
#ifdef KV_HAVE_AVX2_BUILD
    if (__builtin_cpu_supports("f16c")) half = to_half8;
#endif
    for (int64_t j = 0; j < n; j++) {
        const float *s = src + j * src_stride;
        if (!kv_f16) memcpy((float *)dst + slots[j] * row, s, (size_t)row * sizeof(float));
        else half((kv_half *)dst + slots[j] * row, s, row);
    }
}

void kv_scatter_rows_q8(int8_t *dst, kv_half *dst_scale, const float *src, int64_t src_stride,
                        const int64_t *slots, int64_t n, int64_t row) {
    for (int64_t j = 0; j < n; j++) {
        int8_t *d = dst + slots[j] * row;
        kv_half *ds = dst_scale + slots[j] * (row / 32);
        for (int64_t b = 0; b < row / 32; b++) {
            const float *x = src + j * src_stride + b * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
            const kv_half h = kv_f2h(amax / 127.0f);
            const float scale = kv_h2f_table[h], inv = scale > 0.0f ? 1.0f / scale : 0.0f;
            ds[b] = h;
            for (int i = 0; i < 32; i++) {
                float q = nearbyintf(x[i] * inv);  /* ties to even, as torch.round */
                q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
                d[b * 32 + i] = (int8_t)q;
            }
        }
    }
}

/* GeGLU's gelu_tanh(g) * up: 0.5 * g * (1 + tanh(u)) is computed as g * sigmoid(2u), the
 * same value without tanh's cancellation near -1, with e^x from 2^n * e^r, |r| <= ln2 / 2,
 * and a degree-7 Taylor polynomial (error ~5e-9, below fp32's ulp). The clamp of x to
 * [-87, 87] keeps 2^n a normal float. SSE2 does four at a time with the same operations
 * (left to itself, the compiler speculates the clamped case and hits denormals). */
#define GELU_K0 0.7978845608028654f /* sqrt(2 / pi), as torch */
#define GELU_K1 0.044715f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693145751953125f
#define EXP_LN2_LO 1.428606765330187e-06f
#define EXP_SHIFT 12582912.0f /* 1.5 * 2^23: adding it rounds to an integer */
static const float exp_poly[8] = {1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f,
                                  1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};

/* e^x for x clamped to [-87, 87] */
static float exp_clamped_1(float x) {
    x = x < -87.0f ? -87.0f : (x > 87.0f ? 87.0f : x);
    const float n = (x * EXP_LOG2E + EXP_SHIFT) - EXP_SHIFT;
    const float r = (x - n * EXP_LN2_HI) - n * EXP_LN2_LO;
    float p = exp_poly[0];
    for (int k = 1; k < 8; k++) p = p * r + exp_poly[k];
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static float gelu_mul_1(float g, float up) {
    const float u = GELU_K0 * (g + GELU_K1 * (g * g * g));
    return (g / (1.0f + exp_clamped_1(-2.0f * u))) * up;
}

/* SwiGLU's silu(g) * up = g * sigmoid(g) * up, with the same e^x */
static float silu_mul_1(float g, float up) { return (g / (1.0f + exp_clamped_1(-g))) * up; }

#ifdef __SSE2__
static __m128 exp_clamped_4(__m128 x) {
    x = _mm_min_ps(_mm_max_ps(x, _mm_set1_ps(-87.0f)), _mm_set1_ps(87.0f));
    const __m128 shift = _mm_set1_ps(EXP_SHIFT);
    const __m128 n = _mm_sub_ps(_mm_add_ps(_mm_mul_ps(x, _mm_set1_ps(EXP_LOG2E)), shift), shift);
    const __m128 r = _mm_sub_ps(_mm_sub_ps(x, _mm_mul_ps(n, _mm_set1_ps(EXP_LN2_HI))),
                                _mm_mul_ps(n, _mm_set1_ps(EXP_LN2_LO)));
    __m128 p = _mm_set1_ps(exp_poly[0]);
    for (int k = 1; k < 8; k++) p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(exp_poly[k]));
    const __m128 scale = _mm_castsi128_ps(
        _mm_slli_epi32(_mm_add_epi32(_mm_cvtps_epi32(n), _mm_set1_epi32(127)), 23));
    return _mm_mul_ps(p, scale);
}

static __m128 gelu_mul_4(__m128 g, __m128 up) {
    const __m128 u = _mm_mul_ps(_mm_set1_ps(GELU_K0), _mm_add_ps(
        g, _mm_mul_ps(_mm_set1_ps(GELU_K1), _mm_mul_ps(_mm_mul_ps(g, g), g))));
    const __m128 e = exp_clamped_4(_mm_mul_ps(_mm_set1_ps(-2.0f), u));
    return _mm_mul_ps(_mm_div_ps(g, _mm_add_ps(_mm_set1_ps(1.0f), e)), up);
}

static __m128 silu_mul_4(__m128 g, __m128 up) {
    const __m128 e = exp_clamped_4(_mm_sub_ps(_mm_setzero_ps(), g));
    return _mm_mul_ps(_mm_div_ps(g, _mm_add_ps(_mm_set1_ps(1.0f), e)), up);
}
#endif

#ifdef KV_HAVE_AVX2_BUILD
/* The same steps eight at a time (AVX2 without FMA, so nothing is contracted: each lane does
 * the SSE2 and scalar operations, to the bit). A prefill's activations are millions of
 * exponentials and a division each; twice the width halves their time. */
#define KV_TGT8 __attribute__((target("avx2")))
static inline __attribute__((always_inline)) KV_TGT8 __m256 exp_clamped_8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(87.0f));
    const __m256 shift = _mm256_set1_ps(EXP_SHIFT);
    const __m256 n = _mm256_sub_ps(
        _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), shift), shift);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_HI))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_LO)));
    __m256 p = _mm256_set1_ps(exp_poly[0]);
    for (int k = 1; k < 8; k++) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(exp_poly[k]));
    const __m256 scale = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(p, scale);
}

static inline __attribute__((always_inline)) KV_TGT8 __m256 gelu_mul_8(__m256 g, __m256 up) {
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(GELU_K0), _mm256_add_ps(
        g, _mm256_mul_ps(_mm256_set1_ps(GELU_K1), _mm256_mul_ps(_mm256_mul_ps(g, g), g))));
    const __m256 e = exp_clamped_8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), u));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), up);
}

static inline __attribute__((always_inline)) KV_TGT8 __m256 silu_mul_8(__m256 g, __m256 up) {
    const __m256 e = exp_clamped_8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), up);
}
#define KV_GATED_AVX2(f8)                                                                  \
    for (; i + 8 <= inter; i += 8)                                                         \
        _mm256_storeu_ps(out + i, f8(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + inter + i)));
#else
#define KV_TGT8
#define KV_GATED_AVX2(f8)
#endif

/* out[t, i] = act(x[t, i]) * x[t, inter + i]: x is [tokens, 2 * inter] (gate | up); act is
 * gelu_tanh (GeGLU) or silu (SwiGLU) */
#ifdef __SSE2__
#define KV_GATED_SSE(f4)                                                                   \
    for (; i + 4 <= inter; i += 4)                                                         \
        _mm_storeu_ps(out + i, f4(_mm_loadu_ps(x + i), _mm_loadu_ps(x + inter + i)));
#else
#define KV_GATED_SSE(f4)
#endif
#define KV_GATED(name, TGT, WIDE, f4, f1)                                                  \
    static TGT void name(const float *x, float *out, int64_t tokens, int64_t inter,        \
                         const float *p) {                                                 \
        (void)p;                                                                           \
        for (int64_t t = 0; t < tokens; t++, x += 2 * inter, out += inter) {               \
            int64_t i = 0;                                                                 \
            WIDE                                                                           \
            KV_GATED_SSE(f4)                                                               \
            for (; i < inter; i++) out[i] = f1(x[i], x[inter + i]);                        \
        }                                                                                  \
    }
KV_GATED(gelu_rows, , , gelu_mul_4, gelu_mul_1)
KV_GATED(silu_rows, , , silu_mul_4, silu_mul_1)
KV_GATED(gelu_rows8, KV_TGT8, KV_GATED_AVX2(gelu_mul_8), gelu_mul_4, gelu_mul_1)
KV_GATED(silu_rows8, KV_TGT8, KV_GATED_AVX2(silu_mul_8), silu_mul_4, silu_mul_1)

/* gpt-oss's clamped SwiGLU, p = {alpha, limit}: gate = min(gate, limit), up clamped to
 * [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate); the sigmoid from the same
 * e^x as silu (a NaN passes the clamps, as torch.clamp lets it) */
static float swiglu_clamp_1(float g, float up, float alpha, float limit) {
    g = g > limit ? limit : g;
    up = up > limit ? limit : (up < -limit ? -limit : up);
    return (up + 1.0f) * (g / (1.0f + exp_clamped_1(-(g * alpha))));
}

#ifdef __SSE2__
static __m128 swiglu_clamp_4(__m128 g, __m128 up, float alpha, float limit) {
    const __m128 lim = _mm_set1_ps(limit);
    g = _mm_min_ps(g, lim);  /* min(g, lim) returns lim only when g > lim: a NaN g stays */
    up = _mm_max_ps(_mm_min_ps(up, lim), _mm_sub_ps(_mm_setzero_ps(), lim));
    const __m128 e = exp_clamped_4(_mm_sub_ps(_mm_setzero_ps(), _mm_mul_ps(g, _mm_set1_ps(alpha))));
    return _mm_mul_ps(_mm_add_ps(up, _mm_set1_ps(1.0f)),
                      _mm_div_ps(g, _mm_add_ps(_mm_set1_ps(1.0f), e)));
}
#define KV_CLAMP_SSE                                                                       \
    for (; i + 4 <= inter; i += 4)                                                         \
        _mm_storeu_ps(out + i, swiglu_clamp_4(_mm_loadu_ps(x + i), _mm_loadu_ps(x + inter + i), \
                                              p[0], p[1]));
#else
#define KV_CLAMP_SSE
#endif

#ifdef KV_HAVE_AVX2_BUILD
static inline __attribute__((always_inline)) KV_TGT8 __m256 swiglu_clamp_8(
    __m256 g, __m256 up, float alpha, float limit) {
    const __m256 lim = _mm256_set1_ps(limit);
    g = _mm256_min_ps(g, lim);
    up = _mm256_max_ps(_mm256_min_ps(up, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim));
    const __m256 e = exp_clamped_8(
        _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(g, _mm256_set1_ps(alpha))));
    return _mm256_mul_ps(_mm256_add_ps(up, _mm256_set1_ps(1.0f)),
                         _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
}
#define KV_CLAMP_AVX2                                                                      \
    for (; i + 8 <= inter; i += 8)                                                         \
        _mm256_storeu_ps(out + i, swiglu_clamp_8(_mm256_loadu_ps(x + i),                   \
                                                 _mm256_loadu_ps(x + inter + i), p[0], p[1]));
#else
#define KV_CLAMP_AVX2
#endif

#define KV_CLAMPED(name, TGT, WIDE)                                                        \
    static TGT void name(const float *x, float *out, int64_t tokens, int64_t inter,        \
                         const float *p) {                                                 \
        for (int64_t t = 0; t < tokens; t++, x += 2 * inter, out += inter) {               \
            int64_t i = 0;                                                                 \
            WIDE                                                                           \
            KV_CLAMP_SSE                                                                   \
            for (; i < inter; i++) out[i] = swiglu_clamp_1(x[i], x[inter + i], p[0], p[1]); \
        }                                                                                  \
    }
KV_CLAMPED(swiglu_clamp_rows, , )
KV_CLAMPED(swiglu_clamp_rows8, KV_TGT8, KV_CLAMP_AVX2)

/* the eight-wide rows where the CPU has AVX2 (the same bits either way) */
static int gated_avx2(void) {
#ifdef KV_HAVE_AVX2_BUILD
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

/* A prefill's gated product is a few million exponentials: its tokens are handed out to
 * the kernel threads in chunks, taken from a shared counter (the pool's rule: a worker may
 * join late or not at all, so no thread owns a fixed share). Each element is computed
 * alone, so the split changes no bits. */
typedef void (*gated_fn)(const float *x, float *out, int64_t tokens, int64_t inter,
                         const float *p);
typedef struct {
    gated_fn fn;
    const float *p;
    const float *x;
    float *out;
    int64_t tokens, inter, chunk;
    _Atomic int64_t next;
} gated_job;

static void gated_task(void *p, int tid, int nthreads) {
    gated_job *j = p;
    (void)tid, (void)nthreads;
    for (int64_t t0; (t0 = atomic_fetch_add(&j->next, j->chunk)) < j->tokens;) {
        const int64_t n = j->tokens - t0 < j->chunk ? j->tokens - t0 : j->chunk;
        j->fn(j->x + t0 * 2 * j->inter, j->out + t0 * j->inter, n, j->inter, j->p);
    }
}

static void gated(gated_fn fn, const float *x, float *out, int64_t tokens, int64_t inter,
                  const float *p) {
    const int nt = tokens < 2 || tokens * inter < 65536 ? 1 : kv_pool_threads();
    if (nt <= 1) {
        fn(x, out, tokens, inter, p);
        return;
    }
    gated_job j = {.fn = fn, .p = p, .x = x, .out = out, .tokens = tokens, .inter = inter,
                   .chunk = (tokens + 4 * nt - 1) / (4 * nt)};
    atomic_store(&j.next, 0);
    kv_pool_run(gated_task, &j, nt);
}

void kv_gelu_mul(const float *x, float *out, int64_t tokens, int64_t inter) {
    gated(gated_avx2() ? gelu_rows8 : gelu_rows, x, out, tokens, inter, NULL);
}

void kv_silu_mul(const float *x, float *out, int64_t tokens, int64_t inter) {
    gated(gated_avx2() ? silu_rows8 : silu_rows, x, out, tokens, inter, NULL);
}

void kv_swiglu_clamp_mul(const float *x, float *out, int64_t tokens, int64_t inter,
                         float alpha, float limit) {
    const float p[2] = {alpha, limit};
    gated(gated_avx2() ? swiglu_clamp_rows8 : swiglu_clamp_rows, x, out, tokens, inter, p);
}

/* ---- greedy argmax: the first index of a row's largest value, or of its first NaN (as
 * torch.argmax) -- a max pass and a find pass, both 4 floats at a time ---- */
static int64_t first_nan(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (p[i] != p[i]) return i;
    return -1;
}

static int64_t argmax_row(const float *p, int64_t n) {
    float m = -INFINITY;
    int64_t i = 0;
    int nan = 0;
#ifdef __SSE2__
    __m128 m0 = _mm_set1_ps(-INFINITY), m1 = m0, bad = _mm_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m128 a = _mm_loadu_ps(p + i), b = _mm_loadu_ps(p + i + 4);
        bad = _mm_or_ps(bad, _mm_or_ps(_mm_cmpunord_ps(a, a), _mm_cmpunord_ps(b, b)));
        m0 = _mm_max_ps(m0, a);
        m1 = _mm_max_ps(m1, b);
    }
    float lanes[4];
    _mm_storeu_ps(lanes, _mm_max_ps(m0, m1));
    for (int k = 0; k < 4; k++) m = lanes[k] > m ? lanes[k] : m;
    nan = _mm_movemask_ps(bad) != 0;
#endif
    for (; i < n; i++) {
        nan |= p[i] != p[i];
        m = p[i] > m ? p[i] : m;
    }
    if (nan) return first_nan(p, n);
    i = 0;
#ifdef __SSE2__
    const __m128 mv = _mm_set1_ps(m);
    for (; i + 4 <= n; i += 4) {
        const int hit = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(p + i), mv));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; i < n; i++)
        if (p[i] == m) return i;
    return 0;  /* n == 0 */
}

void kv_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * cols, cols);
}

/* ---- token bitmask: bit j of word w allows token 32w + j; every other logit of the row
 * becomes -inf. Whole words are the common cases (all allowed: skip; none: fill); a mixed
 * word goes a byte at a time through a table of 8 lane masks, a select the compiler turns
 * into vector and / andnot / or ---- */

static uint32_t g_byte_lanes[256][8];  /* bit k of the byte -> lane k all ones */

__attribute__((constructor)) static void init_byte_lanes(void) {
    for (int b = 0; b < 256; b++)
        for (int k = 0; k < 8; k++) g_byte_lanes[b][k] = ((b >> k) & 1) ? 0xFFFFFFFFu : 0u;
}

static void mask_mixed_word(float *p, uint32_t bits) {
    const uint32_t ninf = 0xFF800000u;  /* -inf */
    uint32_t *q = (uint32_t *)p;
    for (int byte = 0; byte < 4; byte++, bits >>= 8, q += 8) {
        const uint32_t *lane = g_byte_lanes[bits & 0xFF];
        for (int k = 0; k < 8; k++) q[k] = (q[k] & lane[k]) | (ninf & ~lane[k]);
    }
}

void kv_mask_logits_rows(float *x, int64_t rows, int64_t cols, const int32_t *mask,
                         int64_t words) {
    const float ninf = -__builtin_inff();
    int64_t full = cols / 32 < words ? cols / 32 : words;  /* words that cover 32 columns */
    for (int64_t r = 0; r < rows; r++) {
        float *row = x + r * cols;
        const uint32_t *m = (const uint32_t *)mask + r * words;
        for (int64_t w = 0; w < full; w++) {
            uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu) continue;
            if (bits == 0) {
                for (int j = 0; j < 32; j++) row[32 * w + j] = ninf;
            } else {
                mask_mixed_word(row + 32 * w, bits);
            }
        }
        for (int64_t c = 32 * full; c < cols; c++)  /* a partial last word, or beyond the mask */
            if (c / 32 >= words || !((m[c / 32] >> (c % 32)) & 1u)) row[c] = ninf;
    }
}
