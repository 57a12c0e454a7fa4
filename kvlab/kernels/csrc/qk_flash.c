/* Prefill attention straight from the paged KV cache (fp32, fp16 or q8_0), FlashAttention's
 * scheme:
 * the scores of a chunk's queries against their keys are never held whole; keys come in
 * tiles of 16, each query row keeps a running max, a running sum and an unnormalized output
 * that every tile rescales (online softmax). Written here because torch's SDPA needs the
 * keys gathered out of the pages first, takes a causal mask only aligned top-left (a chunk
 * after a cached prefix is aligned bottom-right) and cannot skip what a sliding window
 * hides; here a sliding-window layer touches only the tiles inside its window, O(T x W).
 *
 *     q     [n, H, D]            the chunk's queries, token i at position start + i
 *                                (token rows q_stride floats apart)
 *     k, v  [num_slots, KVH, D]  the cache; slots[c] holds key position first + c, for
 *                                c in [0, C) with first + C == start + n
 *     out   [n, H, D]            query i sees key positions p with p <= start + i and, for a
 *                                window W > 0, start + i - p < W
 *
 * With a soft-cap (Gemma 2, cap > 0) each scaled score becomes cap * tanh(s / cap) before
 * the tile's max and exp, the same scalar step in both tile kernels; cap 0 skips it. A
 * head's sink (gpt-oss) is one more logit in the softmax's denominator with no value: it
 * joins the running max and sum once, after the last tile, the same step for every kernel.
 *
 * Tiles sit at absolute key positions [16 t, 16 t + 16), and every query row's arithmetic
 * depends only on its own scores, so a row's result is the same bits however the prompt
 * was chunked and whatever else shares the call. Keys are first transposed per tile into
 * fp32 [D][16] (one pass over the chunk's keys), so the score kernel broadcasts one query
 * value against 16 keys per FMA pair; values are read in place from their slots. A tile call
 * takes 8 query rows: with AVX-512 in one pass (8 FMA chains of zmm), else as two 4-row halves.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "qk.h"
#include "qk_pool.h"

#define FA_BK 16    /* keys per tile */
#define FA_ROWS 64  /* query rows (token, head) per work item */
#define FA_R 8      /* query rows per tile call */

typedef struct fa_job fa_job;
/* One tile for FA_R query rows: scores, online-softmax update, o += p v. A padding row has
 * lo > hi (it sees no key) and its o points at scratch nobody reads. */
typedef void (*fa_tile_fn)(const fa_job *j, int64_t g, int64_t t, const float *const qr[FA_R],
                           const int64_t lo[FA_R], const int64_t hi[FA_R],
                           float *const o[FA_R], float *m, float *l);

struct fa_job {
    fa_tile_fn tile;
    const float *q;
    const char *k, *v;
    const kv_half *ks, *vs;  /* q8_0's scales, one per 32 values */
    int64_t elem;            /* bytes per cache value: 4, 2 or 1 */
    int kind;                /* KV_CACHE_* */
    const int64_t *slots;
    int64_t q_stride, first, C, start, n, KVH, D, rep, window, stride;
    float scale, softcap;  /* softcap 0: none */
    const float *sinks;    /* [H] or NULL */
    int64_t t0, ntiles, qt, nblocks;  /* tiles t0.., tokens per item, items per KV head */
    float *kt;          /* [KVH][ntiles][D][FA_BK] keys as fp32 */
    int64_t *vslot;     /* [ntiles * FA_BK] slot of each tile lane; a lane with no key
                           (outside [first, start + n)) reads slots[0]: finite, and masked */
    float *scratch;     /* per thread: see fa_scratch_floats */
    float *out;
    _Atomic int64_t next;
};

static int64_t fa_rows(const fa_job *j) { return j->qt * j->rep; }
static int64_t fa_scratch_floats(const fa_job *j) { return fa_rows(j) * (j->D + 2) + j->D; }

/* value d of head g in the row of `slot` in store `base` (scales `sc` for q8_0), as fp32 */
static inline float fa_elem(const fa_job *j, const char *base, const kv_half *sc, int64_t slot,
                            int64_t g, int64_t d) {
    const int64_t at = slot * j->stride + g * j->D + d;
    if (j->kind == KV_CACHE_F32) return ((const float *)base)[at];
    if (j->kind == KV_CACHE_F16) return kv_h2f_table[((const kv_half *)base)[at]];
    return (float)((const int8_t *)base)[at] * kv_h2f_table[sc[at >> 5]];
}

/* first and last key positions query token i sees */
static int64_t fa_lo(const fa_job *j, int64_t i) {
    const int64_t p = j->start + i;
    if (j->window > 0 && p - j->window + 1 > j->first) return p - j->window + 1;
    return j->first;
}

static int64_t fa_hi(const fa_job *j, int64_t i) { return j->start + i; }

/* FA_R rows through a 4-row tile, a half whose rows all see nothing skipped */
#define FA_HALVES(name, tile4)                                                               \
    static void name(const fa_job *j, int64_t g, int64_t t, const float *const qr[FA_R],    \
                     const int64_t lo[FA_R], const int64_t hi[FA_R], float *const o[FA_R],  \
                     float *m, float *l) {                                                   \
        for (int h = 0; h < FA_R; h += 4) {                                                  \
            int live = 0;                                                                    \
            for (int r = h; r < h + 4; r++) live |= lo[r] <= hi[r];                          \
            if (live) tile4(j, g, t, qr + h, lo + h, hi + h, o + h, m + h, l + h);          \
        }                                                                                    \
    }

/* ---- generic C tile ---- */
static void fa_tile4_c(const fa_job *j, int64_t g, int64_t t, const float *const qr[4],
                       const int64_t lo[4], const int64_t hi[4], float *const o[4], float *m,
                       float *l) {
    const int64_t D = j->D;
    const float *kt = j->kt + (g * j->ntiles + t - j->t0) * D * FA_BK;
    const int64_t *lane = j->vslot + (t - j->t0) * FA_BK;  /* each key's slot */
    for (int r = 0; r < 4; r++) {
        float s[FA_BK], mx = -INFINITY;
        for (int c = 0; c < FA_BK; c++) {
            const int64_t pos = t * FA_BK + c;
            float acc = 0.0f;
            for (int64_t d = 0; d < D; d++) acc += qr[r][d] * kt[d * FA_BK + c];
            float sc = acc * j->scale;
            if (j->softcap > 0.0f) sc = kv_softcap(sc, j->softcap);
            s[c] = pos >= lo[r] && pos <= hi[r] ? sc : -INFINITY;
            mx = s[c] > mx ? s[c] : mx;
        }
        if (mx == -INFINITY) continue;
        if (mx > m[r]) {
            const float alpha = expf(m[r] - mx);
            for (int64_t d = 0; d < D; d++) o[r][d] *= alpha;
            l[r] *= alpha;
            m[r] = mx;
        }
        for (int c = 0; c < FA_BK; c++) {
            if (s[c] == -INFINITY) continue;
            const float p = expf(s[c] - m[r]);
            l[r] += p;
            for (int64_t d = 0; d < D; d++) o[r][d] += p * fa_elem(j, j->v, j->vs, lane[c], g, d);
        }
    }
}

FA_HALVES(fa_tile_c, fa_tile4_c)

#ifdef KV_HAVE_AVX2_BUILD
#include "qk_avx2.h"

/* s[r][0..16) = q_r . k_c for the tile's 16 keys: 4 rows x 16 keys in 8 registers, named
 * rather than an array so that they stay in registers through the loop */
KV_INL void fa_scores_avx2(const float *kt, int64_t D, const float *const qr[4], __m256 s[4][2]) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0,
           d1 = a0;
    const float *q0 = qr[0], *q1 = qr[1], *q2 = qr[2], *q3 = qr[3];
    for (int64_t d = 0; d < D; d++, kt += FA_BK) {
        const __m256 k0 = _mm256_loadu_ps(kt), k1 = _mm256_loadu_ps(kt + 8);
        __m256 x = _mm256_broadcast_ss(q0 + d);
        a0 = _mm256_fmadd_ps(x, k0, a0);
        a1 = _mm256_fmadd_ps(x, k1, a1);
        x = _mm256_broadcast_ss(q1 + d);
        b0 = _mm256_fmadd_ps(x, k0, b0);
        b1 = _mm256_fmadd_ps(x, k1, b1);
        x = _mm256_broadcast_ss(q2 + d);
        c0 = _mm256_fmadd_ps(x, k0, c0);
        c1 = _mm256_fmadd_ps(x, k1, c1);
        x = _mm256_broadcast_ss(q3 + d);
        d0 = _mm256_fmadd_ps(x, k0, d0);
        d1 = _mm256_fmadd_ps(x, k1, d1);
    }
    s[0][0] = a0, s[0][1] = a1, s[1][0] = b0, s[1][1] = b1;
    s[2][0] = c0, s[2][1] = c1, s[3][0] = d0, s[3][1] = d1;
}

KV_INL float fa_hmax(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

/* the soft-cap on 8 scaled scores, lane by lane with the portable tile's scalar tanhf, so
 * both tile kernels cap to the same bits */
KV_INL __m256 fa_softcap8(__m256 x, float cap) {
    float v[8];
    _mm256_storeu_ps(v, x);
    for (int i = 0; i < 8; i++) v[i] = kv_softcap(v[i], cap);
    return _mm256_loadu_ps(v);
}

/* masked, scaled (and soft-capped) scores -> p (0 where masked), updating m, l and
 * rescaling o; 0 if the row sees none of the tile's keys */
KV_INL int fa_softmax_avx2(const fa_job *j, int64_t t, int64_t lo, int64_t hi, __m256 s[2],
                           float *o, float *m, float *l, float *p) {
    const __m256i pos0 = _mm256_add_epi32(_mm256_set1_epi32((int)(t * FA_BK)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i lo1 = _mm256_set1_epi32((int)lo - 1), hi1 = _mm256_set1_epi32((int)hi + 1);
    __m256 vis[2];
    for (int h = 0; h < 2; h++) {
        const __m256i pos = _mm256_add_epi32(pos0, _mm256_set1_epi32(8 * h));
        vis[h] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(pos, lo1),
                                                      _mm256_cmpgt_epi32(hi1, pos)));
        __m256 x = _mm256_mul_ps(s[h], _mm256_set1_ps(j->scale));
        if (j->softcap > 0.0f) x = fa_softcap8(x, j->softcap);
        s[h] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, vis[h]);
    }
    const float mx = fa_hmax(_mm256_max_ps(s[0], s[1]));
    if (mx == -INFINITY) return 0;
    if (mx > *m) {
        const __m256 alpha = _mm256_set1_ps(expf(*m - mx));
        for (int64_t d = 0; d < j->D; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), alpha));
        *l *= _mm256_cvtss_f32(alpha);
        *m = mx;
    }
    const __m256 mv = _mm256_set1_ps(*m);
    const __m256 p0 = _mm256_and_ps(exp8_nonpos(_mm256_sub_ps(s[0], mv)), vis[0]);
    const __m256 p1 = _mm256_and_ps(exp8_nonpos(_mm256_sub_ps(s[1], mv)), vis[1]);
    *l += hsum_ps(_mm256_add_ps(p0, p1));
    _mm256_storeu_ps(p, p0);
    _mm256_storeu_ps(p + 8, p1);
    return 1;
}

/* where the tile's 16 values rows of head g start (vr) and their q8_0 scales (sr) */
static inline void fa_value_rows(const fa_job *j, int64_t g, const int64_t *lane,
                                 const char *vr[FA_BK], const kv_half *sr[FA_BK]) {
    for (int c = 0; c < FA_BK; c++) {
        const int64_t at = lane[c] * j->stride + g * j->D;
        vr[c] = j->v + at * j->elem;
        sr[c] = j->vs ? j->vs + (at >> 5) : NULL;
    }
}

/* o_r += sum_c p[r][c] v_c, 16 floats of D at a time for the 4 rows; LOAD16(c, d, v0, v1)
 * widens the 16 values of lane c's row from d */
#define FA_MIX_AVX2(name, LOAD16)                                                           \
    KV_INL void name(const fa_job *j, int64_t g, const int64_t *lane, const float p[4][FA_BK],\
                     float *const o[4]) {                                                    \
        const char *vr[FA_BK];                                                               \
        const kv_half *sr[FA_BK];                                                            \
        fa_value_rows(j, g, lane, vr, sr);                                                   \
        for (int64_t d = 0; d < j->D; d += 16) {                                             \
            __m256 acc[4][2];                                                                \
            for (int r = 0; r < 4; r++) {                                                    \
                acc[r][0] = _mm256_loadu_ps(o[r] + d);                                       \
                acc[r][1] = _mm256_loadu_ps(o[r] + d + 8);                                   \
            }                                                                                \
            for (int c = 0; c < FA_BK; c++) {                                                \
                __m256 v0, v1;                                                               \
                LOAD16(c, d, v0, v1);                                                        \
                for (int r = 0; r < 4; r++) {                                                \
                    const __m256 b = _mm256_broadcast_ss(&p[r][c]);                          \
                    acc[r][0] = _mm256_fmadd_ps(b, v0, acc[r][0]);                           \
                    acc[r][1] = _mm256_fmadd_ps(b, v1, acc[r][1]);                           \
                }                                                                            \
            }                                                                                \
            for (int r = 0; r < 4; r++) {                                                    \
                _mm256_storeu_ps(o[r] + d, acc[r][0]);                                       \
                _mm256_storeu_ps(o[r] + d + 8, acc[r][1]);                                   \
            }                                                                                \
        }                                                                                    \
    }

#define FA_LOAD16_F32(c, d, v0, v1)                                                         \
    (v0 = _mm256_loadu_ps((const float *)vr[c] + (d)),                                       \
     v1 = _mm256_loadu_ps((const float *)vr[c] + (d) + 8))
#define FA_LOAD16_F16(c, d, v0, v1)                                                         \
    (v0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const kv_half *)vr[c] + (d)))), \
     v1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const kv_half *)vr[c] + (d) + 8))))
/* 16 int8 values share one scale: D % 32 == 0 and d % 16 == 0 */
#define FA_LOAD16_Q8(c, d, v0, v1)                                                          \
    do {                                                                                     \
        const __m128i q = _mm_loadu_si128((const __m128i *)((const int8_t *)vr[c] + (d)));   \
        const __m256 sc = _mm256_set1_ps(kv_h2f_table[sr[c][(d) >> 5]]);                     \
        v0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), sc);                 \
        v1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), sc); \
    } while (0)

FA_MIX_AVX2(fa_mix_f32, FA_LOAD16_F32)
FA_MIX_AVX2(fa_mix_f16, FA_LOAD16_F16)
FA_MIX_AVX2(fa_mix_q8, FA_LOAD16_Q8)

KV_INL void fa_tile4_avx2(const fa_job *j, int64_t g, int64_t t, const float *const qr[4],
                          const int64_t lo[4], const int64_t hi[4], float *const o[4], float *m,
                          float *l) {
    const float *kt = j->kt + (g * j->ntiles + t - j->t0) * j->D * FA_BK;
    __m256 s[4][2];
    float p[4][FA_BK];
    fa_scores_avx2(kt, j->D, qr, s);
    int any = 0;
    for (int r = 0; r < 4; r++) {
        if (fa_softmax_avx2(j, t, lo[r], hi[r], s[r], o[r], &m[r], &l[r], p[r])) any = 1;
        else memset(p[r], 0, sizeof p[r]);  /* p = 0: the row's o is left as it is */
    }
    if (!any) return;
    const int64_t *lane = j->vslot + (t - j->t0) * FA_BK;
    if (j->kind == KV_CACHE_F32) fa_mix_f32(j, g, lane, p, o);
    else if (j->kind == KV_CACHE_F16) fa_mix_f16(j, g, lane, p, o);
    else fa_mix_q8(j, g, lane, p, o);
}

KV_TGT FA_HALVES(fa_tile_avx2, fa_tile4_avx2)

/* ---- AVX-512: all FA_R = 8 rows in one pass ----
 * The 4-row AVX2 tile keeps 8 accumulators in flight, one FMA chain each, which is as many
 * as two FMA pipes of latency 4 need and no more: measured, the score and mix loops stall on
 * them. Here a row's 16 scores are one zmm and a row's 16 output floats at a time one zmm,
 * so 8 rows are 8 independent chains of zmm FMAs, each K or V load shared by 8 rows rather
 * than 4. Every lane does the AVX2 tile's arithmetic in the same order (scores summed over d,
 * outputs over the tile's keys, one FMA a step) and the softmax is the AVX2 one on each half,
 * so the results are the same bits. */
#include "qk_zmm.h"

#define FA_FMA8(acc, x, w)                                                                  \
    for (int r = 0; r < FA_R; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r]), w, acc[r])

KV_INL_Z void fa_scores_zmm(const float *kt, int64_t D, const float *const qr[FA_R],
                            __m512 s[FA_R]) {
    __m512 acc[FA_R];
    for (int r = 0; r < FA_R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++, kt += FA_BK) {
        const __m512 k = _mm512_loadu_ps(kt);
        float x[FA_R];
        for (int r = 0; r < FA_R; r++) x[r] = qr[r][d];
        FA_FMA8(acc, x, k);
    }
    for (int r = 0; r < FA_R; r++) s[r] = acc[r];
}

/* o_r += sum_c p[r][c] v_c, 16 floats of D at a time for the 8 rows; LOAD(c, d) gives the
 * 16 values of lane c's row from d as the AVX2 loads do */
#define FA_MIX_ZMM(name, LOAD)                                                              \
    KV_INL_Z void name(const fa_job *j, int64_t g, const int64_t *lane,                     \
                       const float p[FA_R][FA_BK], float *const o[FA_R]) {                  \
        const char *vr[FA_BK];                                                              \
        const kv_half *sr[FA_BK];                                                           \
        fa_value_rows(j, g, lane, vr, sr);                                                  \
        for (int64_t d = 0; d < j->D; d += 16) {                                            \
            __m512 acc[FA_R];                                                               \
            for (int r = 0; r < FA_R; r++) acc[r] = _mm512_loadu_ps(o[r] + d);              \
            for (int c = 0; c < FA_BK; c++) {                                               \
                const __m512 v = LOAD(c, d);                                                \
                float x[FA_R];                                                              \
                for (int r = 0; r < FA_R; r++) x[r] = p[r][c];                              \
                FA_FMA8(acc, x, v);                                                         \
            }                                                                               \
            for (int r = 0; r < FA_R; r++) _mm512_storeu_ps(o[r] + d, acc[r]);              \
        }                                                                                   \
    }

#define FA_LOADZ_F32(c, d) _mm512_loadu_ps((const float *)vr[c] + (d))
#define FA_LOADZ_F16(c, d) \
    _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const kv_half *)vr[c] + (d))))
/* the AVX2 load's steps: int8 -> int32 -> float, times the 32 values' scale */
#define FA_LOADZ_Q8(c, d)                                                                   \
    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                                  \
                      _mm_loadu_si128((const __m128i *)((const int8_t *)vr[c] + (d))))),     \
                  _mm512_set1_ps(kv_h2f_table[sr[c][(d) >> 5]]))

FA_MIX_ZMM(fa_mixz_f32, FA_LOADZ_F32)
FA_MIX_ZMM(fa_mixz_f16, FA_LOADZ_F16)
FA_MIX_ZMM(fa_mixz_q8, FA_LOADZ_Q8)

KV_TGT_Z static void fa_tile_zmm(const fa_job *j, int64_t g, int64_t t,
                                 const float *const qr[FA_R], const int64_t lo[FA_R],
                                 const int64_t hi[FA_R], float *const o[FA_R], float *m,
                                 float *l) {
    const float *kt = j->kt + (g * j->ntiles + t - j->t0) * j->D * FA_BK;
    __m512 s[FA_R];
    float p[FA_R][FA_BK];
    fa_scores_zmm(kt, j->D, qr, s);
    int any = 0;
    for (int r = 0; r < FA_R; r++) {
        __m256 h[2] = {_mm512_castps512_ps256(s[r]),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s[r]), 1))};
        if (fa_softmax_avx2(j, t, lo[r], hi[r], h, o[r], &m[r], &l[r], p[r])) any = 1;
        else memset(p[r], 0, sizeof p[r]);
    }
    if (!any) return;
    const int64_t *lane = j->vslot + (t - j->t0) * FA_BK;
    if (j->kind == KV_CACHE_F32) fa_mixz_f32(j, g, lane, p, o);
    else if (j->kind == KV_CACHE_F16) fa_mixz_f16(j, g, lane, p, o);
    else fa_mixz_q8(j, g, lane, p, o);
}
#endif

/* ---- phase 1: keys of each (KV head, tile) transposed into kt ---- */
static void fa_transpose_task(void *p, int tid, int nthreads) {
    fa_job *j = p;
    (void)tid, (void)nthreads;
    const int64_t D = j->D;
    for (int64_t i; (i = atomic_fetch_add(&j->next, 1)) < j->KVH * j->ntiles;) {
        const int64_t g = i / j->ntiles, t = j->t0 + i % j->ntiles;
        float *kt = j->kt + i * D * FA_BK;
        for (int c = 0; c < FA_BK; c++) {
            const int64_t slot = j->vslot[(t - j->t0) * FA_BK + c];
            for (int64_t d = 0; d < D; d++) kt[d * FA_BK + c] = fa_elem(j, j->k, j->ks, slot, g, d);
        }
    }
}

/* ---- phase 2: one item = one KV head's rep query heads for qt tokens ---- */
static void fa_item(fa_job *j, int64_t item, float *scr) {
    const int64_t g = item / j->nblocks, b = j->nblocks - 1 - item % j->nblocks;  /* long first */
    const int64_t i0 = b * j->qt, i1 = i0 + j->qt < j->n ? i0 + j->qt : j->n;
    const int64_t rep = j->rep, D = j->D, R = (i1 - i0) * rep;
    float *O = scr, *m = O + fa_rows(j) * D, *l = m + fa_rows(j), *dummy = l + fa_rows(j);
    memset(O, 0, (size_t)(R * D) * sizeof(float));
    for (int64_t r = 0; r < R; r++) m[r] = -INFINITY, l[r] = 0.0f;
    const float *qrow = j->q + i0 * j->q_stride + g * rep * D;
    for (int64_t t = fa_lo(j, i0) / FA_BK; t <= fa_hi(j, i1 - 1) / FA_BK; t++) {
        for (int64_t r0 = 0; r0 < R; r0 += FA_R) {
            const int64_t last = r0 + FA_R - 1 < R ? r0 + FA_R - 1 : R - 1;
            const int64_t ia = i0 + r0 / rep, ib = i0 + last / rep;
            if (t * FA_BK > fa_hi(j, ib) || t * FA_BK + FA_BK - 1 < fa_lo(j, ia)) continue;
            const float *qr[FA_R];
            int64_t lo[FA_R], hi[FA_R];
            float *o[FA_R], mm[FA_R], ll[FA_R];
            for (int k = 0; k < FA_R; k++) {
                const int64_t r = r0 + k < R ? r0 + k : -1, i = i0 + (r < 0 ? 0 : r) / rep;
                qr[k] = r < 0 ? qrow : qrow + (i - i0) * j->q_stride + (r % rep) * D;
                lo[k] = r < 0 ? 1 : fa_lo(j, i);  /* a padding row sees nothing */
                hi[k] = r < 0 ? 0 : fa_hi(j, i);
                o[k] = r < 0 ? dummy : O + r * D;
                mm[k] = r < 0 ? -INFINITY : m[r];
                ll[k] = r < 0 ? 0.0f : l[r];
            }
            j->tile(j, g, t, qr, lo, hi, o, mm, ll);
            for (int k = 0; k < FA_R && r0 + k < R; k++) m[r0 + k] = mm[k], l[r0 + k] = ll[k];
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = i0 + r / rep, h = g * rep + r % rep;
        float *dst = j->out + (i * j->KVH * rep + h) * D;
        if (j->sinks) {  /* rescale o and l to the max over the keys and the sink */
            const float mx = fmaxf(m[r], j->sinks[h]), alpha = expf(m[r] - mx);
            for (int64_t d = 0; d < D; d++) O[r * D + d] *= alpha;
            l[r] = l[r] * alpha + expf(j->sinks[h] - mx);
        }
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; d++) dst[d] = O[r * D + d] * inv;
    }
}

static void fa_task(void *p, int tid, int nthreads) {
    fa_job *j = p;
    (void)nthreads;
    float *scr = j->scratch + tid * fa_scratch_floats(j);
    for (int64_t i; (i = atomic_fetch_add(&j->next, 1)) < j->KVH * j->nblocks;) fa_item(j, i, scr);
}

static void fa_run(fa_job *j, kv_task_fn fn, int64_t items, int nt) {
    atomic_store(&j->next, 0);
    if (nt > items) nt = (int)items;
    if (nt > 1) kv_pool_run(fn, j, nt);
    else fn(j, 0, 1);
}

/* Returns 0, or -1 when out of memory. */
int kv_attend_prefill(const float *q, int64_t q_stride, const kv_cache_ref *kv,
                      const int64_t *slots, int64_t first, int64_t start, int64_t n, int64_t H,
                      int64_t KVH, int64_t D, int64_t window, float scale, float softcap,
                      const float *sinks, float *out, int use_avx2) {
    const int q8 = kv->kind == KV_CACHE_Q8_0;
    fa_job j = {.tile = fa_tile_c, .q = q, .k = kv->k, .v = kv->v, .kind = kv->kind,
                .ks = q8 ? kv->k_scale : NULL, .vs = q8 ? kv->v_scale : NULL,
                .elem = kv_cache_elem_bytes(kv->kind), .slots = slots, .q_stride = q_stride, .first = first,
                .C = start + n - first, .start = start, .n = n, .KVH = KVH, .D = D,
                .rep = H / KVH, .window = window, .stride = KVH * D, .scale = scale,
                .softcap = softcap, .sinks = sinks, .out = out};
#ifdef KV_HAVE_AVX2_BUILD
    if (use_avx2 && D % 16 == 0) j.tile = kv_use_vnni() ? fa_tile_zmm : fa_tile_avx2;
#else
    (void)use_avx2;
#endif
    j.qt = j.rep >= FA_ROWS ? 1 : FA_ROWS / j.rep;
    j.nblocks = (n + j.qt - 1) / j.qt;
    j.t0 = first / FA_BK;
    j.ntiles = (start + n - 1) / FA_BK - j.t0 + 1;
    /* below ~1 MFLOP of scores a worker's wake-up costs more than it saves */
    const int nt = n * j.C * H * D < (1 << 20) || kv_pool_threads() < 1 ? 1 : kv_pool_threads();
    j.kt = malloc((size_t)(KVH * j.ntiles * D * FA_BK) * sizeof(float));
    j.vslot = malloc((size_t)(j.ntiles * FA_BK) * sizeof(int64_t));
    j.scratch = malloc((size_t)(nt * fa_scratch_floats(&j)) * sizeof(float));
    int rc = 0;
    if (!j.kt || !j.vslot || !j.scratch) {
        rc = -1;
        goto done;
    }
    for (int64_t c = 0; c < j.ntiles * FA_BK; c++) {
        const int64_t pos = j.t0 * FA_BK + c;
        j.vslot[c] = slots[pos >= first && pos < start + n ? pos - first : 0];
    }
    fa_run(&j, fa_transpose_task, KVH * j.ntiles, nt);
    fa_run(&j, fa_task, KVH * j.nblocks, nt);
done:
    free(j.kt);
    free(j.vslot);
    free(j.scratch);
    return rc;
}
