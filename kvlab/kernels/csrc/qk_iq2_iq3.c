/* IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S, GGUF's lattice ("i-quant") types, read in their
 * file blocks: dequantizers (gguf's rounding), portable and AVX2 dot kernels.
 *
 * Each 256-element super-block has an fp16 d; its values come 8 (IQ2) or 4 (IQ3) at a time
 * as rows of a fixed grid of small positive integers, picked by an index, each value's sign
 * by a bit. The grids are the result of a search, not a formula: kvlab reads them from the
 * gguf package at import (kvlab/kernels/grids.py -> kv_set_grid), so there is one copy of
 * them, the reference's. A 7-bit sign index stands for 8 signs of even parity: the 8th
 * sign bit is the parity of the 7 (ksign below).
 *
 *   type     bytes  grid        index bits   scales            value
 *   IQ2_XXS  66     256 x 8     8            4 bit per 32      d * (0.5 + s) / 4 * g
 *   IQ2_XS   74     512 x 8     9            4 bit per 16      d * (0.5 + s) / 4 * g
 *   IQ2_S    82     1024 x 8    8 + 2 (qh)   4 bit per 16      d * (0.5 + s) / 4 * g
 *   IQ3_XXS  98     256 x 4     8            4 bit per 32      d * (0.5 + s) / 2 * g
 *   IQ3_S    110    512 x 4     8 + 1 (qh)   4 bit per 32      d * (1 + 2 s) * g
 *
 * Every type is decoded the same way: a super-block -> kv_iq_sb, its 256 signed grid values
 * as int8 (|g| <= 62) and an integer scale per 16 elements (2s + 1, the per-32 types' twice),
 * with value = d * unit * scale * q, unit = 1/8, 1/4 or 1 (a power of two: the dequantizer's
 * float steps are gguf's, (d * (0.5 + s)) * 0.25 etc., and come out the same). A product is
 * then exact integers against kv_act256, isum = sum_g scale_g * (sum of q * x over group g)
 * (below 16 * 31 * 16 * 62 * 127 < 2^31), and acc += (d * unit * d_x) * isum per super-block,
 * the same for any number of x rows. The AVX2 kernels decode with vector lookups and run the
 * sums through maddubs (|q| unsigned, q's sign onto x; a pair is below 2 * 62 * 127 < 2^15).
 */
#include <string.h>

#include "qk.h"

/* ---------------- grids (from gguf, kv_set_grid) and signs ---------------- */

static uint8_t grid_iq2xxs[256][8], grid_iq2xs[512][8], grid_iq2s[1024][8];
static uint8_t grid_iq3xxs[256][4], grid_iq3s[512][4];

int kv_set_grid(int qtype, const uint8_t *values, int64_t bytes) {
    void *dst = qtype == KV_IQ2_XXS ? (void *)grid_iq2xxs : qtype == KV_IQ2_XS ? (void *)grid_iq2xs
              : qtype == KV_IQ2_S ? (void *)grid_iq2s : qtype == KV_IQ3_XXS ? (void *)grid_iq3xxs
              : qtype == KV_IQ3_S ? (void *)grid_iq3s : NULL;
    const int64_t size = qtype == KV_IQ2_XXS ? 2048 : qtype == KV_IQ2_XS ? 4096
                       : qtype == KV_IQ2_S ? 8192 : qtype == KV_IQ3_XXS ? 1024 : 2048;
    if (!dst || bytes != size) return -1;
    memcpy(dst, values, (size_t)bytes);
    return 0;
}

/* 7 sign bits and their parity as the 8th: an even number of minus signs */
static inline uint8_t ksign(uint32_t i) {
    return (uint8_t)(i | (uint32_t)__builtin_parity(i) << 7);
}

typedef struct {
    int8_t q[256];   /* signed grid values */
    int16_t sc[16];  /* integer scale of elements 16g .. 16g + 15 */
    float d;         /* fp16 d as fp32 */
} kv_iq_sb;

static inline float half_at(const uint8_t *b) {
    uint16_t h;
    memcpy(&h, b, 2);
    return kv_h2f_table[h];
}

static inline uint32_t u32_at(const uint8_t *b) {
    uint32_t v;
    memcpy(&v, b, 4);
    return v;
}

/* n grid values with signs: bit j of `signs` negates value j */
static inline void put_signed(int8_t *q, const uint8_t *g, int n, uint32_t signs) {
    for (int j = 0; j < n; j++) q[j] = (int8_t)((signs >> j & 1) ? -g[j] : g[j]);
}

/* ---------------- portable decoders: super-block -> kv_iq_sb ---------------- */

static void dec_iq2_xxs(const uint8_t *b, kv_iq_sb *u) {
    u->d = half_at(b);
    for (int s = 0; s < 8; s++) {
        const uint8_t *p = b + 2 + 8 * s;  /* 4 grid indices, then signs and scale */
        const uint32_t aux = u32_at(p + 4);
        for (int l = 0; l < 4; l++)
            put_signed(u->q + 32 * s + 8 * l, grid_iq2xxs[p[l]], 8, ksign(aux >> 7 * l & 127));
        u->sc[2 * s] = u->sc[2 * s + 1] = (int16_t)(2 * (aux >> 28) + 1);
    }
}

static void dec_iq2_xs(const uint8_t *b, kv_iq_sb *u) {
    u->d = half_at(b);
    for (int k = 0; k < 32; k++) {  /* qs: 9-bit index, 7 sign bits */
        uint16_t v;
        memcpy(&v, b + 2 + 2 * k, 2);
        put_signed(u->q + 8 * k, grid_iq2xs[v & 511], 8, ksign(v >> 9));
    }
    for (int g = 0; g < 16; g++) u->sc[g] = (int16_t)(2 * (b[66 + g / 2] >> 4 * (g % 2) & 15) + 1);
}

static void dec_iq2_s(const uint8_t *b, kv_iq_sb *u) {
    const uint8_t *qs = b + 2, *signs = b + 34, *qh = b + 66, *scales = b + 74;
    u->d = half_at(b);
    for (int k = 0; k < 32; k++) {
        const int idx = qs[k] | (qh[k / 4] >> 2 * (k % 4) & 3) << 8;
        put_signed(u->q + 8 * k, grid_iq2s[idx], 8, signs[k]);
    }
    for (int g = 0; g < 16; g++) u->sc[g] = (int16_t)(2 * (scales[g / 2] >> 4 * (g % 2) & 15) + 1);
}

static void dec_iq3_xxs(const uint8_t *b, kv_iq_sb *u) {
    const uint8_t *qs = b + 2, *sas = b + 66;
    u->d = half_at(b);
    for (int s = 0; s < 8; s++) {
        const uint32_t aux = u32_at(sas + 4 * s);
        for (int l = 0; l < 4; l++) {
            const uint32_t sg = ksign(aux >> 7 * l & 127);
            int8_t *q = u->q + 32 * s + 8 * l;
            put_signed(q, grid_iq3xxs[qs[8 * s + 2 * l]], 4, sg);
            put_signed(q + 4, grid_iq3xxs[qs[8 * s + 2 * l + 1]], 4, sg >> 4);
        }
        u->sc[2 * s] = u->sc[2 * s + 1] = (int16_t)(2 * (aux >> 28) + 1);
    }
}

static void dec_iq3_s(const uint8_t *b, kv_iq_sb *u) {
    const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *scales = b + 106;
    u->d = half_at(b);
    for (int k = 0; k < 64; k++) {  /* 4 values each */
        const int idx = qs[k] | (qh[k / 8] >> (k % 8) & 1) << 8;
        put_signed(u->q + 4 * k, grid_iq3s[idx], 4, signs[k / 2] >> 4 * (k % 2));
    }
    for (int s = 0; s < 8; s++)
        u->sc[2 * s] = u->sc[2 * s + 1] = (int16_t)(2 * (scales[s / 2] >> 4 * (s % 2) & 15) + 1);
}

/* the type's super-block bytes, decoder and unit (value = d * unit * sc * q) */
typedef struct { int bytes; void (*dec)(const uint8_t *, kv_iq_sb *); float unit; } kv_iq_type;

static inline kv_iq_type iq_type(int qt) {
    switch (qt) {
        case KV_IQ2_XXS: return (kv_iq_type){66, dec_iq2_xxs, 0.125f};
        case KV_IQ2_XS: return (kv_iq_type){74, dec_iq2_xs, 0.125f};
        case KV_IQ2_S: return (kv_iq_type){82, dec_iq2_s, 0.125f};
        case KV_IQ3_XXS: return (kv_iq_type){98, dec_iq3_xxs, 0.25f};
        default: return (kv_iq_type){110, dec_iq3_s, 1.0f};
    }
}

/* ---------------- dequantizers ---------------- */

/* gguf's sub-block scale: (d * (0.5 + s)) * 0.25 (IQ2), * 0.5 (IQ3_XXS), d * (1 + 2 s) (IQ3_S);
 * from sc = 2 s + 1 */
static inline float db_of(int qt, float d, int sc) {
    const int s = (sc - 1) / 2;
    if (qt == KV_IQ3_S) return d * (float)sc;
    return d * (0.5f + (float)s) * (qt == KV_IQ3_XXS ? 0.5f : 0.25f);
}

static inline void deq_iq(const int qt, const uint8_t *w, int64_t cols, float *out) {
    const kv_iq_type t = iq_type(qt);
    kv_iq_sb u;
    for (int64_t i = 0; i < cols / 256; i++, w += t.bytes, out += 256) {
        t.dec(w, &u);
        for (int g = 0; g < 16; g++) {
            const float db = db_of(qt, u.d, u.sc[g]);
            for (int e = 16 * g; e < 16 * g + 16; e++) out[e] = db * (float)u.q[e];
        }
    }
}

#define KV_IQ_DEQ(name, qt) \
    void name(const uint8_t *w, int64_t cols, float *out) { deq_iq(qt, w, cols, out); }
KV_IQ_DEQ(kv_deq_iq2_xxs_generic, KV_IQ2_XXS)
KV_IQ_DEQ(kv_deq_iq2_xs_generic, KV_IQ2_XS)
KV_IQ_DEQ(kv_deq_iq2_s_generic, KV_IQ2_S)
KV_IQ_DEQ(kv_deq_iq3_xxs_generic, KV_IQ3_XXS)
KV_IQ_DEQ(kv_deq_iq3_s_generic, KV_IQ3_S)

/* ---------------- portable dot kernels ---------------- */

static inline int32_t sb_dot(const kv_iq_sb *u, const int8_t *x) {
    int32_t isum = 0;
    for (int g = 0; g < 16; g++) {
        int32_t s = 0;
        for (int e = 16 * g; e < 16 * g + 16; e++) s += u->q[e] * x[e];
        isum += u->sc[g] * s;
    }
    return isum;
}

static inline void gemv_iq(const int qt, const uint8_t *w, int64_t row_bytes, int64_t r0,
                           int64_t r1, int64_t cols, const void *xq, int64_t xstride, int64_t n,
                           float *y, int64_t ystride) {
    const kv_iq_type t = iq_type(qt);
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t j = 0; j < n; j++) {
            const kv_act256 *a = (const kv_act256 *)((const char *)xq + j * xstride);
            const uint8_t *b = w + r * row_bytes;
            float acc = 0.0f;
            for (int64_t i = 0; i < cols / 256; i++, b += t.bytes) {
                kv_iq_sb u;
                t.dec(b, &u);
                acc = fmaf(u.d * t.unit * a[i].d, (float)sb_dot(&u, a[i].qs), acc);
            }
            y[j * ystride + r] = acc;
        }
    }
}

#define KV_IQ_GEMV(name, qt) \
    KV_GEMV_DECL(name) { gemv_iq(qt, w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride); }
KV_IQ_GEMV(kv_gemv_iq2_xxs_generic, KV_IQ2_XXS)
KV_IQ_GEMV(kv_gemv_iq2_xs_generic, KV_IQ2_XS)
KV_IQ_GEMV(kv_gemv_iq2_s_generic, KV_IQ2_S)
KV_IQ_GEMV(kv_gemv_iq3_xxs_generic, KV_IQ3_XXS)
KV_IQ_GEMV(kv_gemv_iq3_s_generic, KV_IQ3_S)

/* ---------------- AVX2 ---------------- */

#ifdef KV_HAVE_AVX2_BUILD
#include "qk_avx2.h"

/* 32 grid values with their signs: g the grid bytes in element order, s4 four sign bytes
 * (byte k for elements 8k .. 8k + 7, bit j of it for element 8k + j) */
KV_INL __m256i apply_signs(__m256i g, uint32_t s4) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bits = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
    const __m256i s = _mm256_shuffle_epi8(_mm256_set1_epi32((int)s4), spread);
    const __m256i neg = _mm256_cmpeq_epi8(_mm256_and_si256(s, bits), bits);
    return _mm256_sub_epi8(_mm256_xor_si256(g, neg), neg);
}

KV_INL uint64_t u64_of(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* 4 rows of an 8-wide grid, 8 rows of a 4-wide one */
KV_INL __m256i rows8(const uint8_t (*grid)[8], const int idx[4]) {
    return _mm256_setr_epi64x((int64_t)u64_of(grid[idx[0]]), (int64_t)u64_of(grid[idx[1]]),
                              (int64_t)u64_of(grid[idx[2]]), (int64_t)u64_of(grid[idx[3]]));
}
KV_INL __m256i rows4(const uint8_t (*grid)[4], const int idx[8]) {
    return _mm256_setr_epi32((int)u32_at(grid[idx[0]]), (int)u32_at(grid[idx[1]]),
                             (int)u32_at(grid[idx[2]]), (int)u32_at(grid[idx[3]]),
                             (int)u32_at(grid[idx[4]]), (int)u32_at(grid[idx[5]]),
                             (int)u32_at(grid[idx[6]]), (int)u32_at(grid[idx[7]]));
}

KV_INL uint32_t ksign4(uint32_t aux) {
    return ksign(aux & 127) | (uint32_t)ksign(aux >> 7 & 127) << 8 |
           (uint32_t)ksign(aux >> 14 & 127) << 16 | (uint32_t)ksign(aux >> 21 & 127) << 24;
}

/* sub-block s (32 values) of a super-block as signed int8, per type */
KV_INL __m256i sub_iq2_xxs(const uint8_t *b, int s) {
    const uint8_t *p = b + 2 + 8 * s;
    const int idx[4] = {p[0], p[1], p[2], p[3]};
    return apply_signs(rows8(grid_iq2xxs, idx), ksign4(u32_at(p + 4)));
}
KV_INL __m256i sub_iq2_xs(const uint8_t *b, int s) {
    uint16_t v[4];
    memcpy(v, b + 2 + 8 * s, 8);
    const int idx[4] = {v[0] & 511, v[1] & 511, v[2] & 511, v[3] & 511};
    const uint32_t s4 = ksign(v[0] >> 9) | (uint32_t)ksign(v[1] >> 9) << 8 |
                        (uint32_t)ksign(v[2] >> 9) << 16 | (uint32_t)ksign(v[3] >> 9) << 24;
    return apply_signs(rows8(grid_iq2xs, idx), s4);
}
KV_INL __m256i sub_iq2_s(const uint8_t *b, int s) {
    const uint8_t *qs = b + 2 + 4 * s, qh = b[66 + s];
    const int idx[4] = {qs[0] | (qh & 3) << 8, qs[1] | (qh >> 2 & 3) << 8,
                        qs[2] | (qh >> 4 & 3) << 8, qs[3] | (qh >> 6 & 3) << 8};
    return apply_signs(rows8(grid_iq2s, idx), u32_at(b + 34 + 4 * s));
}
KV_INL __m256i sub_iq3_xxs(const uint8_t *b, int s) {
    const uint8_t *qs = b + 2 + 8 * s;
    const int idx[8] = {qs[0], qs[1], qs[2], qs[3], qs[4], qs[5], qs[6], qs[7]};
    return apply_signs(rows4(grid_iq3xxs, idx), ksign4(u32_at(b + 66 + 4 * s)));
}
KV_INL __m256i sub_iq3_s(const uint8_t *b, int s) {
    const uint8_t *qs = b + 2 + 8 * s, qh = b[66 + s];
    int idx[8];
    for (int k = 0; k < 8; k++) idx[k] = qs[k] | (qh >> k & 1) << 8;
    return apply_signs(rows4(grid_iq3s, idx), u32_at(b + 74 + 4 * s));
}

/* a super-block decoded: values by vector lookups, scales as the portable decoder has them */
#define KV_IQ_DECODE_AVX2(name, sub, scales)                                               \
    KV_INL void name(const uint8_t *b, kv_iq_sb *u) {                                      \
        for (int s = 0; s < 8; s++) _mm256_storeu_si256((__m256i *)(u->q + 32 * s), sub(b, s)); \
        scales                                                                             \
        u->d = half_at(b);                                                                 \
    }
#define KV_IQ_SC32(at)                                                                     \
    for (int s = 0; s < 8; s++) u->sc[2 * s] = u->sc[2 * s + 1] = (int16_t)(2 * (at) + 1);
#define KV_IQ_SC16(off)                                                                    \
    for (int g = 0; g < 16; g++) u->sc[g] = (int16_t)(2 * (b[(off) + g / 2] >> 4 * (g % 2) & 15) + 1);
KV_IQ_DECODE_AVX2(dec_iq2_xxs_avx2, sub_iq2_xxs, KV_IQ_SC32(u32_at(b + 6 + 8 * s) >> 28))
KV_IQ_DECODE_AVX2(dec_iq2_xs_avx2, sub_iq2_xs, KV_IQ_SC16(66))
KV_IQ_DECODE_AVX2(dec_iq2_s_avx2, sub_iq2_s, KV_IQ_SC16(74))
KV_IQ_DECODE_AVX2(dec_iq3_xxs_avx2, sub_iq3_xxs, KV_IQ_SC32(u32_at(b + 66 + 4 * s) >> 28))
KV_IQ_DECODE_AVX2(dec_iq3_s_avx2, sub_iq3_s, KV_IQ_SC32(b[106 + s / 2] >> 4 * (s % 2) & 15))

KV_INL void dec_avx2(const int qt, const uint8_t *b, kv_iq_sb *u) {
    switch (qt) {
        case KV_IQ2_XXS: dec_iq2_xxs_avx2(b, u); break;
        case KV_IQ2_XS: dec_iq2_xs_avx2(b, u); break;
        case KV_IQ2_S: dec_iq2_s_avx2(b, u); break;
        case KV_IQ3_XXS: dec_iq3_xxs_avx2(b, u); break;
        default: dec_iq3_s_avx2(b, u); break;
    }
}

/* sb_dot's integer: per 32 values maddubs (|q|, x with q's sign), then the two groups'
 * scales by madd */
KV_INL int32_t sb_dot_avx2(const kv_iq_sb *u, const int8_t *x) {
    __m256i acc = _mm256_setzero_si256();
    for (int s = 0; s < 8; s++) {
        const __m256i q = load256(u->q + 32 * s);
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(load256(x + 32 * s), q));
        const __m256i sc = _mm256_setr_m128i(_mm_set1_epi16(u->sc[2 * s]), _mm_set1_epi16(u->sc[2 * s + 1]));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc));
    }
    return hsum_epi32(acc);
}

#define KV_IQ_NX 8  /* x rows per decoded super-block */

/* each weight row's super-blocks decoded once per KV_IQ_NX x rows; the float steps are the
 * portable kernel's, so the same bits */
KV_INL void gemv_iq_avx2(const int qt, const uint8_t *w, int64_t row_bytes, int64_t r0,
                         int64_t r1, int64_t cols, const void *xq, int64_t xstride, int64_t n,
                         float *y, int64_t ystride) {
    const kv_iq_type t = iq_type(qt);
    for (int64_t r = r0; r < r1; r++)
        for (int64_t j0 = 0; j0 < n; j0 += KV_IQ_NX) {
            const int64_t m = n - j0 < KV_IQ_NX ? n - j0 : KV_IQ_NX;
            float acc[KV_IQ_NX] = {0};
            const uint8_t *b = w + r * row_bytes;
            for (int64_t i = 0; i < cols / 256; i++, b += t.bytes) {
                kv_iq_sb u;
                dec_avx2(qt, b, &u);
                for (int64_t j = 0; j < m; j++) {
                    const kv_act256 *a = (const kv_act256 *)((const char *)xq + (j0 + j) * xstride) + i;
                    acc[j] = fmaf(u.d * t.unit * a->d, (float)sb_dot_avx2(&u, a->qs), acc[j]);
                }
            }
            for (int64_t j = 0; j < m; j++) y[(j0 + j) * ystride + r] = acc[j];
        }
}

KV_INL void deq_iq_avx2(const int qt, const uint8_t *w, int64_t cols, float *out) {
    const kv_iq_type t = iq_type(qt);
    kv_iq_sb u;
    for (int64_t i = 0; i < cols / 256; i++, w += t.bytes, out += 256) {
        dec_avx2(qt, w, &u);
        for (int g = 0; g < 16; g++) {
            const __m256 db = _mm256_set1_ps(db_of(qt, u.d, u.sc[g]));
            for (int h = 0; h < 2; h++) {
                const __m128i q8 = _mm_loadl_epi64((const __m128i *)(u.q + 16 * g + 8 * h));
                _mm256_storeu_ps(out + 16 * g + 8 * h,
                                 _mm256_mul_ps(db, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8))));
            }
        }
    }
}

#define KV_IQ_AVX2(gemv, deq, qt)                                                          \
    KV_TGT KV_GEMV_DECL(gemv) {                                                            \
        gemv_iq_avx2(qt, w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);          \
    }                                                                                      \
    KV_TGT void deq(const uint8_t *w, int64_t cols, float *out) { deq_iq_avx2(qt, w, cols, out); }
KV_IQ_AVX2(kv_gemv_iq2_xxs_avx2, kv_deq_iq2_xxs_avx2, KV_IQ2_XXS)
KV_IQ_AVX2(kv_gemv_iq2_xs_avx2, kv_deq_iq2_xs_avx2, KV_IQ2_XS)
KV_IQ_AVX2(kv_gemv_iq2_s_avx2, kv_deq_iq2_s_avx2, KV_IQ2_S)
KV_IQ_AVX2(kv_gemv_iq3_xxs_avx2, kv_deq_iq3_xxs_avx2, KV_IQ3_XXS)
KV_IQ_AVX2(kv_gemv_iq3_s_avx2, kv_deq_iq3_s_avx2, KV_IQ3_S)
#endif /* KV_HAVE_AVX2_BUILD */
