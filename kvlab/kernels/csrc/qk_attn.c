/* Decode attention straight from the paged KV cache (fp32 or fp16): each query row attends
 * to C keys whose slots are listed, without gathering K/V into new tensors first. An fp16
 * cache is widened to fp32 as it is loaded: the same arithmetic on the same values, so a
 * cache holding fp16-representable values gives the fp32 cache's bits.
 *
 *     q    [B, H, D]            one new token per sequence (rows q_stride floats apart)
 *     k, v [num_slots, KVH, D]  the cache; slots [B, C] pick each sequence's keys
 *     out  [B, H, D]            softmax(q k^T * scale) v, per head; head h reads KV head
 *                               h / (H / KVH) (grouped-query attention)
 *
 * Per (sequence, KV head) the H / KVH query heads are scored against each key row while
 * it is in L1, soft-capped when cap > 0 (Gemma 2: s -> cap * tanh(s / cap)), softmaxed,
 * then the value rows are summed with those weights. A head's sink (gpt-oss) is one more
 * logit in its softmax's denominator with no value row: it joins the merge of the chunks. The AVX2 variant differs only in its
 * three inner loops (and FMA rounding).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "qk.h"
#include "qk_pool.h"

typedef struct {
    /* s[h * C + c] = scale * dot(q[h], k row c) for the rep heads of q; v: the value rows
       (the AVX2 set fetches them into cache beside their keys, for mix) */
    void (*scores)(const float *q, int64_t rep, const void *k, const kv_half *ks,
                   const void *v, const int64_t *slots, int64_t C, int64_t stride, int64_t D,
                   float scale, float *s);
    /* s[0..C) -> exp(s - max s); returns the sum, and the max in *m */
    float (*softmax)(float *s, int64_t C, float *m);
    /* out[h] = sum_c s[h * C + c] * v row c for the rep heads */
    void (*mix)(const float *s, int64_t rep, const void *v, const kv_half *vs,
                const int64_t *slots, int64_t C, int64_t stride, int64_t D, float *out);
} attn_ops;

/* one cache element as fp32: ELEM_F32 / ELEM_F16 / ELEM_Q8 name the element type and its
 * widening; q8_0 rows (int8) come with a row of fp16 scales, one per 32 values (sr) */
#define ELEM_F32(p, sr, i) (((const float *)(p))[i])
#define ELEM_F16(p, sr, i) (kv_h2f_table[((const kv_half *)(p))[i]])
#define ELEM_Q8(p, sr, i) ((float)((const int8_t *)(p))[i] * kv_h2f_table[(sr)[(i) >> 5]])
#define SCALE_ROW(base, slot, stride) ((base) ? (base) + (slot) * ((stride) >> 5) : NULL)

#define KV_SCORES_C(name, T, ELEM)                                                          \
    static void name(const float *q, int64_t rep, const void *k, const kv_half *ks,           \
                     const void *v, const int64_t *slots, int64_t C, int64_t stride,          \
                     int64_t D, float scale, float *s) {                                      \
        (void)v;                                                                              \
        for (int64_t c = 0; c < C; c++) {                                                     \
            const T *kr = (const T *)k + slots[c] * stride;                                   \
            const kv_half *sr = SCALE_ROW(ks, slots[c], stride);                              \
            (void)sr;                                                                         \
            for (int64_t h = 0; h < rep; h++) {                                               \
                float acc = 0.0f;                                                             \
                for (int64_t i = 0; i < D; i++) acc += q[h * D + i] * ELEM(kr, sr, i);        \
                s[h * C + c] = acc * scale;                                                   \
            }                                                                                 \
        }                                                                                     \
    }

static float softmax_c(float *s, int64_t C, float *max_out) {
    float m = -INFINITY, sum = 0.0f;
    for (int64_t c = 0; c < C; c++) m = s[c] > m ? s[c] : m;
    for (int64_t c = 0; c < C; c++) sum += s[c] = expf(s[c] - m);
    *max_out = m;
    return sum;
}

#define KV_MIX_C(name, T, ELEM)                                                             \
    static void name(const float *s, int64_t rep, const void *v, const kv_half *vs,           \
                     const int64_t *slots, int64_t C, int64_t stride, int64_t D,              \
                     float *out) {                                                            \
        memset(out, 0, (size_t)(rep * D) * sizeof(float));                                    \
        for (int64_t c = 0; c < C; c++) {                                                     \
            const T *vr = (const T *)v + slots[c] * stride;                                   \
            const kv_half *sr = SCALE_ROW(vs, slots[c], stride);                              \
            (void)sr;                                                                         \
            for (int64_t h = 0; h < rep; h++)                                                 \
                for (int64_t i = 0; i < D; i++)                                               \
                    out[h * D + i] += s[h * C + c] * ELEM(vr, sr, i);                         \
        }                                                                                     \
    }

KV_SCORES_C(scores_c, float, ELEM_F32)
KV_SCORES_C(scores_c16, kv_half, ELEM_F16)
KV_MIX_C(mix_c, float, ELEM_F32)
KV_MIX_C(mix_c16, kv_half, ELEM_F16)
KV_SCORES_C(scores_c8, int8_t, ELEM_Q8)
KV_MIX_C(mix_c8, int8_t, ELEM_Q8)

static const attn_ops ops_generic = {scores_c, softmax_c, mix_c};
static const attn_ops ops_generic16 = {scores_c16, softmax_c, mix_c16};
static const attn_ops ops_generic8 = {scores_c8, softmax_c, mix_c8};

#ifdef KV_HAVE_AVX2_BUILD
#include <immintrin.h>
#include "qk_avx2.h"
#define TGT KV_TGT
#define LOAD8_F32(p, sr, i) _mm256_loadu_ps((p) + (i))
#define LOAD8_F16(p, sr, i) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((p) + (i))))
#define LOAD8_Q8(p, sr, i)                                                                    \
    _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(                     \
                      (const __m128i *)((p) + (i))))),                                        \
                  _mm256_set1_ps(kv_h2f_table[(sr)[(i) >> 5]]))

/* A head's row of the cache is D values at a stride of KVH * D, in pages that can be far
 * apart, so the hardware prefetcher does not see the rows coming: the scores fetch each key
 * row and its value row KV_PREFETCH keys ahead of their use. */
#define KV_PREFETCH 16
KV_INL void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)row + b, _MM_HINT_T0);
}

/* D % 8 == 0 (checked by kv_attend_decode). Up to 4 heads against 2 keys at a time: one
 * accumulator per (head, key) sums over all of D, so each key row is loaded once for every
 * head and the 8 accumulators stay in registers (the head count is a constant in each
 * inlined copy). A pair's sums reduce by hadds: two heads' two keys into 4 lanes at once. */
#define KV_SCORES_AVX2(name, T, LOAD8)                                                      \
    KV_INL void name##_heads(const float *qh, const int nh, const void *k, const kv_half *ks, \
                             const void *v, const int64_t *slots, int64_t C, int64_t stride, \
                             int64_t D, float scale, float *s) {                              \
        const __m128 sc = _mm_set1_ps(scale);                                                 \
        int64_t c = 0;                                                                        \
        for (; c + 2 <= C; c += 2) {                                                          \
            if (c + KV_PREFETCH + 2 <= C)                                                     \
                for (int64_t f = c + KV_PREFETCH; f < c + KV_PREFETCH + 2; f++) {             \
                    prefetch_row((const T *)k + slots[f] * stride, D * (int64_t)sizeof(T));   \
                    prefetch_row((const T *)v + slots[f] * stride, D * (int64_t)sizeof(T));   \
                }                                                                             \
            const T *k0 = (const T *)k + slots[c] * stride;                                   \
            const T *k1 = (const T *)k + slots[c + 1] * stride;                               \
            const kv_half *s0 = SCALE_ROW(ks, slots[c], stride);                              \
            const kv_half *s1 = SCALE_ROW(ks, slots[c + 1], stride);                          \
            (void)s0;                                                                         \
            (void)s1;                                                                         \
            __m256 acc[4][2];                                                                 \
            for (int h = 0; h < nh; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();         \
            for (int64_t i = 0; i < D; i += 8) {                                              \
                const __m256 x0 = LOAD8(k0, s0, i), x1 = LOAD8(k1, s1, i);                    \
                for (int h = 0; h < nh; h++) {                                                \
                    const __m256 qv = _mm256_loadu_ps(qh + h * D + i);                        \
                    acc[h][0] = _mm256_fmadd_ps(qv, x0, acc[h][0]);                           \
                    acc[h][1] = _mm256_fmadd_ps(qv, x1, acc[h][1]);                           \
                }                                                                             \
            }                                                                                 \
            for (int h = 0; h < nh; h += 2) {                                                 \
                const __m256 t0 = _mm256_hadd_ps(acc[h][0], acc[h][1]);                       \
                const __m256 t1 = h + 1 < nh ? _mm256_hadd_ps(acc[h + 1][0], acc[h + 1][1])   \
                                             : _mm256_setzero_ps();                           \
                const __m256 u = _mm256_hadd_ps(t0, t1);                                      \
                __m128 r = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)); \
                r = _mm_mul_ps(r, sc); /* head h: keys c, c+1; head h + 1: keys c, c+1 */     \
                _mm_storel_pi((__m64 *)(s + h * C + c), r);                                   \
                if (h + 1 < nh) _mm_storeh_pi((__m64 *)(s + (h + 1) * C + c), r);             \
            }                                                                                 \
        }                                                                                     \
        if (c < C) { /* an odd last key */                                                    \
            const T *k0 = (const T *)k + slots[c] * stride;                                   \
            const kv_half *s0 = SCALE_ROW(ks, slots[c], stride);                              \
            (void)s0;                                                                         \
            __m256 acc[4];                                                                    \
            for (int h = 0; h < nh; h++) acc[h] = _mm256_setzero_ps();                        \
            for (int64_t i = 0; i < D; i += 8) {                                              \
                const __m256 x0 = LOAD8(k0, s0, i);                                           \
                for (int h = 0; h < nh; h++)                                                  \
                    acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + h * D + i), x0, acc[h]);    \
            }                                                                                 \
            for (int h = 0; h < nh; h++) s[h * C + c] = hsum_ps(acc[h]) * scale;              \
        }                                                                                     \
    }                                                                                         \
    TGT static void name(const float *q, int64_t rep, const void *k, const kv_half *ks,       \
                         const void *v, const int64_t *slots, int64_t C, int64_t stride,      \
                         int64_t D, float scale, float *s) {                                  \
        for (int64_t h0 = 0; h0 < rep; h0 += 4) {                                             \
            const float *qh = q + h0 * D;                                                     \
            float *sh = s + h0 * C;                                                           \
            switch (rep - h0 < 4 ? rep - h0 : 4) {                                            \
                case 1: name##_heads(qh, 1, k, ks, v, slots, C, stride, D, scale, sh); break; \
                case 2: name##_heads(qh, 2, k, ks, v, slots, C, stride, D, scale, sh); break; \
                case 3: name##_heads(qh, 3, k, ks, v, slots, C, stride, D, scale, sh); break; \
                default: name##_heads(qh, 4, k, ks, v, slots, C, stride, D, scale, sh); break; \
            }                                                                                 \
        }                                                                                     \
    }

KV_SCORES_AVX2(scores_avx2, float, LOAD8_F32)
KV_SCORES_AVX2(scores_avx2_16, kv_half, LOAD8_F16)
KV_SCORES_AVX2(scores_avx2_8, int8_t, LOAD8_Q8)

TGT static float softmax_avx2(float *s, int64_t C, float *max_out) {
    float m = -INFINITY, sum = 0.0f;
    for (int64_t c = 0; c < C; c++) m = s[c] > m ? s[c] : m;
    *max_out = m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= C; c += 8) {
        const __m256 e = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + c), mv));
        _mm256_storeu_ps(s + c, e);
        acc = _mm256_add_ps(acc, e);
    }
    for (; c < C; c++) sum += s[c] = expf(s[c] - m);
    return sum + hsum_ps(acc);
}

/* For each 16-float slice of D and up to 4 heads, the weighted sum over all C value rows
 * stays in 8 registers; each value row slice is loaded once per slice pass. The head count
 * and the slice's width (one register for the last slice when D % 16 == 8) are constants
 * in each inlined copy. */
#define KV_MIX_AVX2(name, T, LOAD8)                                                         \
    KV_INL void name##_slice(const float *s, const int nh, const int two, const void *v,      \
                             const kv_half *vs, const int64_t *slots, int64_t C,              \
                             int64_t stride, int64_t D, int64_t i, float *out) {              \
        __m256 acc[4][2];                                                                     \
        for (int h = 0; h < nh; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();             \
        for (int64_t c = 0; c < C; c++) {                                                     \
            const T *vr = (const T *)v + slots[c] * stride;                                   \
            const kv_half *sr = SCALE_ROW(vs, slots[c], stride);                              \
            (void)sr;                                                                         \
            const __m256 v0 = LOAD8(vr, sr, i);                                               \
            const __m256 v1 = two ? LOAD8(vr, sr, i + 8) : _mm256_setzero_ps();               \
            for (int h = 0; h < nh; h++) {                                                    \
                const __m256 p = _mm256_broadcast_ss(s + h * C + c);                          \
                acc[h][0] = _mm256_fmadd_ps(p, v0, acc[h][0]);                                \
                if (two) acc[h][1] = _mm256_fmadd_ps(p, v1, acc[h][1]);                       \
            }                                                                                 \
        }                                                                                     \
        for (int h = 0; h < nh; h++) {                                                        \
            _mm256_storeu_ps(out + h * D + i, acc[h][0]);                                     \
            if (two) _mm256_storeu_ps(out + h * D + i + 8, acc[h][1]);                        \
        }                                                                                     \
    }                                                                                         \
    KV_INL void name##_heads(const float *s, const int nh, const void *v, const kv_half *vs,  \
                             const int64_t *slots, int64_t C, int64_t stride, int64_t D,     \
                             float *out) {                                                    \
        int64_t i = 0;                                                                        \
        for (; i + 16 <= D; i += 16)                                                          \
            name##_slice(s, nh, 1, v, vs, slots, C, stride, D, i, out);                       \
        if (i < D) name##_slice(s, nh, 0, v, vs, slots, C, stride, D, i, out);                \
    }                                                                                         \
    TGT static void name(const float *s, int64_t rep, const void *v, const kv_half *vs,       \
                         const int64_t *slots, int64_t C, int64_t stride, int64_t D,          \
                         float *out) {                                                        \
        for (int64_t h0 = 0; h0 < rep; h0 += 4) {                                             \
            const float *sh = s + h0 * C;                                                     \
            float *oh = out + h0 * D;                                                         \
            switch (rep - h0 < 4 ? rep - h0 : 4) {                                            \
                case 1: name##_heads(sh, 1, v, vs, slots, C, stride, D, oh); break;           \
                case 2: name##_heads(sh, 2, v, vs, slots, C, stride, D, oh); break;           \
                case 3: name##_heads(sh, 3, v, vs, slots, C, stride, D, oh); break;           \
                default: name##_heads(sh, 4, v, vs, slots, C, stride, D, oh); break;          \
            }                                                                                 \
        }                                                                                     \
    }

KV_MIX_AVX2(mix_avx2, float, LOAD8_F32)
KV_MIX_AVX2(mix_avx2_16, kv_half, LOAD8_F16)
KV_MIX_AVX2(mix_avx2_8, int8_t, LOAD8_Q8)

static const attn_ops ops_avx2 = {scores_avx2, softmax_avx2, mix_avx2};
static const attn_ops ops_avx2_16 = {scores_avx2_16, softmax_avx2, mix_avx2_16};
static const attn_ops ops_avx2_8 = {scores_avx2_8, softmax_avx2, mix_avx2_8};
#endif

/* ---------------- driver: key chunks as work items, spread over the kernel threads -------
 *
 * A row's keys split into chunks of KV_ATTN_CHUNK; each (row, KV head, chunk) item scores
 * its keys, exponentiates them against the chunk's own max and sums the value rows with
 * those weights (unnormalized). Then each (row, KV head) merges its chunks in order:
 * out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c. The chunks of a row depend only on
 * its own length, so the result is the same for any batch and any thread count. */

#define KV_ATTN_CHUNK 256

typedef struct {
    const attn_ops *ops;
    const float *q;
    const char *k, *v;  /* the cache, elem bytes per value */
    const kv_half *ks, *vs;  /* q8_0: the scales, [num_slots, KVH, D / 32]; else NULL */
    int64_t elem;
    const int64_t *slots, *lengths;
    int64_t q_stride, C, KVH, D, rep, stride;
    float scale, softcap;  /* softcap 0: none */
    const float *sinks;    /* [H] or NULL */
    int64_t nitems, *item_bg, *item_c0;  /* item -> (row * KVH + head, first key) */
    float *part;     /* per item: rep maxes, rep sums, rep * D unnormalized outputs */
    float *scratch;  /* per thread: rep * KV_ATTN_CHUNK scores */
    _Atomic int64_t next;
} attn_job;

static int64_t part_floats(const attn_job *j) { return j->rep * (2 + j->D); }

static void attn_item(attn_job *j, int64_t i, float *s) {
    const int64_t bg = j->item_bg[i], b = bg / j->KVH, g = bg % j->KVH, c0 = j->item_c0[i];
    const int64_t n = j->lengths ? j->lengths[b] : j->C;
    const int64_t len = n - c0 < KV_ATTN_CHUNK ? n - c0 : KV_ATTN_CHUNK;
    const int64_t *slots = j->slots + b * j->C + c0;
    float *part = j->part + i * part_floats(j);
    const int64_t gs = g * (j->D >> 5);  /* head g's first scale */
    j->ops->scores(j->q + b * j->q_stride + g * j->rep * j->D, j->rep, j->k + g * j->D * j->elem,
                   j->ks ? j->ks + gs : NULL, j->v + g * j->D * j->elem, slots, len, j->stride,
                   j->D, j->scale, s);
    /* a step of its own after the scale, shared by both kernel sets: cap 0 leaves the
       uncapped arithmetic untouched */
    if (j->softcap > 0.0f)
        for (int64_t c = 0; c < j->rep * len; c++) s[c] = kv_softcap(s[c], j->softcap);
    for (int64_t h = 0; h < j->rep; h++)
        part[j->rep + h] = j->ops->softmax(s + h * len, len, &part[h]);
    j->ops->mix(s, j->rep, j->v + g * j->D * j->elem, j->vs ? j->vs + gs : NULL, slots, len,
                j->stride, j->D, part + 2 * j->rep);
}

static void attn_task(void *p, int tid, int nthreads) {
    attn_job *j = p;
    (void)nthreads;
    float *s = j->scratch + (int64_t)tid * j->rep * KV_ATTN_CHUNK;
    for (int64_t i; (i = atomic_fetch_add(&j->next, 1)) < j->nitems;) attn_item(j, i, s);
}

/* items [first, last) hold one (row, KV head g)'s chunks in order: merge them into
 * out[rep, D]; a sink is a chunk of one key whose value is zero */
static void attn_merge(const attn_job *j, int64_t g, int64_t first, int64_t last, float *out) {
    const int64_t rep = j->rep, D = j->D, pf = part_floats(j);
    for (int64_t h = 0; h < rep; h++) {
        const float sink = j->sinks ? j->sinks[g * rep + h] : -INFINITY;
        float m = sink, l = 0.0f;
        for (int64_t i = first; i < last; i++) m = fmaxf(m, j->part[i * pf + h]);
        if (j->sinks) l = expf(sink - m);
        float *o = out + h * D;
        memset(o, 0, (size_t)D * sizeof(float));
        for (int64_t i = first; i < last; i++) {
            const float *part = j->part + i * pf;
            const float w = expf(part[h] - m);
            l += w * part[rep + h];
            const float *po = part + 2 * rep + h * D;
            for (int64_t d = 0; d < D; d++) o[d] += w * po[d];
        }
        const float inv = 1.0f / l;
        for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
}

/* Returns 0, or -1 when out of memory. */
int kv_attend_decode(const float *q, int64_t q_stride, const kv_cache_ref *kv,
                     const int64_t *slots, const int64_t *lengths, int64_t B, int64_t C,
                     int64_t H, int64_t KVH, int64_t D, float scale, float softcap,
                     const float *sinks, float *out, int use_avx2) {
    static const attn_ops *const generic[3] = {&ops_generic, &ops_generic16, &ops_generic8};
    const attn_ops *ops = generic[kv->kind];
#ifdef KV_HAVE_AVX2_BUILD
    static const attn_ops *const avx2[3] = {&ops_avx2, &ops_avx2_16, &ops_avx2_8};
    if (use_avx2 && D % 8 == 0) ops = avx2[kv->kind];
#else
    (void)use_avx2;
#endif
    const int q8 = kv->kind == KV_CACHE_Q8_0;
    attn_job j = {.ops = ops, .q = q, .k = kv->k, .v = kv->v, .ks = q8 ? kv->k_scale : NULL,
                  .vs = q8 ? kv->v_scale : NULL, .elem = kv_cache_elem_bytes(kv->kind),
                  .slots = slots, .lengths = lengths,
                  .q_stride = q_stride, .C = C, .KVH = KVH, .D = D, .rep = H / KVH,
                  .stride = KVH * D, .scale = scale, .softcap = softcap, .sinks = sinks};
    int64_t keys = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = lengths ? lengths[b] : C;
        keys += n;
        j.nitems += KVH * ((n + KV_ATTN_CHUNK - 1) / KV_ATTN_CHUNK);
    }
    /* K and V bytes read; below 128 KiB a worker's wake-up costs more than it saves */
    const int64_t bytes = keys * KVH * D * 2 * j.elem;
    int nt = bytes < 131072 ? 1 : kv_pool_threads();
    if (nt > j.nitems) nt = (int)j.nitems;
    if (nt < 1) nt = 1;
    j.item_bg = malloc((size_t)(2 * j.nitems + B * KVH + 1) * sizeof(int64_t));
    j.part = malloc((size_t)(j.nitems * part_floats(&j)) * sizeof(float));
    j.scratch = malloc((size_t)(nt * j.rep * KV_ATTN_CHUNK) * sizeof(float));
    int rc = 0;
    if (!j.item_bg || !j.part || !j.scratch) {
        rc = -1;
        goto done;
    }
    j.item_c0 = j.item_bg + j.nitems;
    int64_t *first = j.item_c0 + j.nitems, i = 0;  /* first item of each (row, head) */
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = lengths ? lengths[b] : C;
        for (int64_t g = 0; g < KVH; g++) {
            first[b * KVH + g] = i;
            for (int64_t c0 = 0; c0 < n; c0 += KV_ATTN_CHUNK, i++) {
                j.item_bg[i] = b * KVH + g;
                j.item_c0[i] = c0;
            }
        }
    }
    first[B * KVH] = i;
    atomic_store(&j.next, 0);
    if (nt > 1) kv_pool_run(attn_task, &j, nt);
    else attn_task(&j, 0, 1);
    for (int64_t bg = 0; bg < B * KVH; bg++)
        attn_merge(&j, bg % KVH, first[bg], first[bg + 1], out + bg * j.rep * D);
done:
    free(j.item_bg);
    free(j.part);
    free(j.scratch);
    return rc;
}
