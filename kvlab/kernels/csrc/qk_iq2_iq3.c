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
 * the same for any number of x rows. The AVX2 kernels decode with one load per grid row (8
 * values of an IQ2 grid, 4 of an IQ3 one). For one to four x rows (decode) a super-block's
 * signs, scales and wide grid indices are made once in a few vector steps, and the float
 * steps of 8 super-blocks follow one joint reduction of their sums; tiles and the
 * dequantizer take sign bytes from a table or spread them in registers. The sums run
 * through maddubs (the unsigned grid values against x with their signs; a pair is below
 * 2 * 62 * 127 < 2^15) and the scales through madd, or with AVX512-VNNI through vpdpwssd;
 * from 8 x rows a tile of decoded weight rows serves every x row. The same integers and
 * float steps, so every path gives the same bits.
 */
#include <stdlib.h>
#include <string.h>

#include "qk.h"

/* ---------------- grids (from gguf, kv_set_grid) and signs ---------------- */

static uint8_t grid_iq2xxs[256][8], grid_iq2xs[512][8], grid_iq2s[1024][8];
static uint8_t grid_iq3xxs[256][4], grid_iq3s[512][4];

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
    for (int s = 0; s < 8; s++)
        for (int k = 0; k < 8; k++) {  /* 4 values each */
            const int idx = qs[8 * s + k] | (qh[s] >> k & 1) << 8;
            const uint32_t sg = (uint32_t)signs[4 * s + k / 2] >> 4 * (k % 2);
            put_signed(u->q + 32 * s + 4 * k, grid_iq3s[idx], 4, sg);
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

int kv_set_grid(int qtype, const uint8_t *values, int64_t bytes) {
    void *dst = qtype == KV_IQ2_XXS ? (void *)grid_iq2xxs : qtype == KV_IQ2_XS ? (void *)grid_iq2xs
              : qtype == KV_IQ2_S ? (void *)grid_iq2s : qtype == KV_IQ3_XXS ? (void *)grid_iq3xxs
              : qtype == KV_IQ3_S ? (void *)grid_iq3s : NULL;
    const int64_t size = qtype == KV_IQ2_XXS ? 2048 : qtype == KV_IQ2_XS ? 4096
                       : qtype == KV_IQ2_S ? 8192 : qtype == KV_IQ3_XXS ? 1024 : 2048;
    if (!dst || bytes != size) return -1;
    memcpy(dst, values, (size_t)bytes);
#ifdef KV_HAVE_AVX2_BUILD
    kv_iq_planes_set(qtype, values, bytes, iq_type(qtype).bytes, iq_type(qtype).unit);
#endif
    return 0;
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

/* Signs as bytes, made by the preprocessor from their definition: byte j of KV_SM(b) is
 * -1 (0xFF) where bit j of b is set, else +1, the operand of _mm256_sign_epi8 that puts the
 * signs onto x (the grid values stay unsigned for maddubs); ksign_mask[k] is
 * KV_SM(ksign(k)) for a 7-bit sign index k. */
#define KV_SM(b)                                                                           \
    ((((b) & 1 ? 0xFFull : 0) | ((b) & 2 ? 0xFF00ull : 0) | ((b) & 4 ? 0xFF0000ull : 0) |   \
      ((b) & 8 ? 0xFF000000ull : 0) | ((b) & 16 ? 0xFF00000000ull : 0) |                   \
      ((b) & 32 ? 0xFF0000000000ull : 0) | ((b) & 64 ? 0xFF000000000000ull : 0) |          \
      ((b) & 128 ? 0xFF00000000000000ull : 0)) | 0x0101010101010101ull)
#define KV_PAR7(k) (((k) ^ (k) >> 1 ^ (k) >> 2 ^ (k) >> 3 ^ (k) >> 4 ^ (k) >> 5 ^ (k) >> 6) & 1)
#define KV_KSM(k) KV_SM((k) | KV_PAR7(k) << 7)
#define KV_X2(f, n) f(n), f((n) + 1)
#define KV_X4(f, n) KV_X2(f, n), KV_X2(f, (n) + 2)
#define KV_X8(f, n) KV_X4(f, n), KV_X4(f, (n) + 4)
#define KV_X16(f, n) KV_X8(f, n), KV_X8(f, (n) + 8)
#define KV_X32(f, n) KV_X16(f, n), KV_X16(f, (n) + 16)
#define KV_X64(f, n) KV_X32(f, n), KV_X32(f, (n) + 32)
#define KV_X128(f, n) KV_X64(f, n), KV_X64(f, (n) + 64)
static const uint64_t ksign_mask[128] = {KV_X128(KV_KSM, 0)};

KV_INL uint64_t u64_of(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

KV_INL __m256i masks4(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    return _mm256_setr_epi64x((int64_t)a, (int64_t)b, (int64_t)c, (int64_t)d);
}
/* four sign bytes -> +-1 bytes in registers: byte j of s4 spread over bytes 8j .. 8j + 7,
 * each tested against its own bit */
KV_INL __m256i bytes_masks(uint32_t s4) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)s4),
        _mm256_setr_epi64x(0, 0x0101010101010101ll, 0x0202020202020202ll, 0x0303030303030303ll));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ull);
    const __m256i m = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_or_si256(m, _mm256_set1_epi8(1));
}
KV_INL __m256i ksign_masks(uint32_t aux) {  /* four 7-bit sign indices */
    return masks4(ksign_mask[aux & 127], ksign_mask[aux >> 7 & 127], ksign_mask[aux >> 14 & 127],
                  ksign_mask[aux >> 21 & 127]);
}

/* 4 rows of an 8-wide grid, 8 rows of a 4-wide one */
KV_INL __m256i rows8(const uint8_t (*grid)[8], int i0, int i1, int i2, int i3) {
    return masks4(u64_of(grid[i0]), u64_of(grid[i1]), u64_of(grid[i2]), u64_of(grid[i3]));
}
KV_INL __m256i rows4(const uint8_t (*grid)[4], const int idx[8]) {
    return _mm256_setr_epi32((int)u32_at(grid[idx[0]]), (int)u32_at(grid[idx[1]]),
                             (int)u32_at(grid[idx[2]]), (int)u32_at(grid[idx[3]]),
                             (int)u32_at(grid[idx[4]]), (int)u32_at(grid[idx[5]]),
                             (int)u32_at(grid[idx[6]]), (int)u32_at(grid[idx[7]]));
}

/* sub-block s (32 values) of a super-block: its unsigned grid values g and their signs as
 * +-1 bytes, per type (the scales: sb_scales below) */
typedef struct { __m256i g, sg; } kv_iq_sub;

KV_INL kv_iq_sub sub_iq2_xxs(const uint8_t *b, int s) {
    const uint8_t *p = b + 2 + 8 * s;
    return (kv_iq_sub){rows8(grid_iq2xxs, p[0], p[1], p[2], p[3]), ksign_masks(u32_at(p + 4))};
}
KV_INL kv_iq_sub sub_iq2_xs(const uint8_t *b, int s) {
    uint16_t v[4];
    memcpy(v, b + 2 + 8 * s, 8);
    const __m256i g = rows8(grid_iq2xs, v[0] & 511, v[1] & 511, v[2] & 511, v[3] & 511);
    const __m256i m = masks4(ksign_mask[v[0] >> 9], ksign_mask[v[1] >> 9], ksign_mask[v[2] >> 9],
                             ksign_mask[v[3] >> 9]);
    return (kv_iq_sub){g, m};
}
KV_INL kv_iq_sub sub_iq2_s(const uint8_t *b, int s) {
    const uint8_t *qs = b + 2 + 4 * s, qh = b[66 + s];
    const __m256i g = rows8(grid_iq2s, qs[0] + (qh << 8 & 768), qs[1] + (qh << 6 & 768),
                            qs[2] + (qh << 4 & 768), qs[3] + (qh << 2 & 768));
    return (kv_iq_sub){g, bytes_masks(u32_at(b + 34 + 4 * s))};
}
KV_INL kv_iq_sub sub_iq3_xxs(const uint8_t *b, int s) {
    const uint8_t *qs = b + 2 + 8 * s;
    const int idx[8] = {qs[0], qs[1], qs[2], qs[3], qs[4], qs[5], qs[6], qs[7]};
    return (kv_iq_sub){rows4(grid_iq3xxs, idx), ksign_masks(u32_at(b + 66 + 4 * s))};
}
KV_INL kv_iq_sub sub_iq3_s(const uint8_t *b, int s) {
    const uint8_t *qs = b + 2 + 8 * s, qh = b[66 + s];
    int idx[8];  /* qs[k] plus bit k of qh as 256 */
    for (int k = 0; k < 8; k++) idx[k] = qs[k] + (qh << (8 - k) & 256);
    return (kv_iq_sub){rows4(grid_iq3s, idx), bytes_masks(u32_at(b + 74 + 4 * s))};
}

KV_INL kv_iq_sub sub_of(const int qt, const uint8_t *b, int s) {
    switch (qt) {
        case KV_IQ2_XXS: return sub_iq2_xxs(b, s);
        case KV_IQ2_XS: return sub_iq2_xs(b, s);
        case KV_IQ2_S: return sub_iq2_s(b, s);
        case KV_IQ3_XXS: return sub_iq3_xxs(b, s);
        default: return sub_iq3_s(b, s);
    }
}

/* a super-block's 16 integer scales (2s + 1) as int16, per 16 elements (the per-32 types'
 * twice), made in registers once per super-block */
KV_INL __m256i odd16(__m128i bytes) {  /* 16 scale nibbles s as bytes -> 2 s + 1 as int16 */
    const __m256i v = _mm256_cvtepu8_epi16(bytes);
    return _mm256_or_si256(_mm256_add_epi16(v, v), _mm256_set1_epi16(1));
}
KV_INL __m128i nibbles(__m128i v) {  /* bytes -> low nibble, high nibble, in order */
    const __m128i m = _mm_set1_epi8(15);
    return _mm_unpacklo_epi8(_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m));
}
KV_INL __m256i odd32(__m256i s32) {  /* 8 scale nibbles s as int32 -> 2 s + 1, two int16 each */
    const __m256i twice = _mm256_or_si256(s32, _mm256_slli_epi32(s32, 16));
    return _mm256_or_si256(_mm256_add_epi16(twice, twice), _mm256_set1_epi16(1));
}
KV_INL __m256i sb_scales(const int qt, const uint8_t *b) {
    switch (qt) {
        case KV_IQ2_XXS: {  /* the top 4 bits of the odd 32-bit words of qs */
            const __m256i lo = _mm256_srli_epi32(load256(b + 2), 28);
            const __m256i hi = _mm256_srli_epi32(load256(b + 34), 28);
            const __m256i odd = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
            return odd32(_mm256_blend_epi32(_mm256_permutevar8x32_epi32(lo, odd),
                                            _mm256_permutevar8x32_epi32(hi, odd), 0xF0));
        }
        case KV_IQ2_XS: return odd16(nibbles(_mm_loadl_epi64((const __m128i *)(b + 66))));
        case KV_IQ2_S: return odd16(nibbles(_mm_loadl_epi64((const __m128i *)(b + 74))));
        case KV_IQ3_XXS: return odd32(_mm256_srli_epi32(load256(b + 66), 28));
        default: {  /* IQ3_S: 8 nibbles at 106, one per 32 */
            const __m128i s8 = nibbles(_mm_cvtsi32_si128((int)u32_at(b + 106)));
            return odd16(_mm_unpacklo_epi8(s8, s8));
        }
    }
}
/* sub-block s's scales for maddubs' 16 pair sums: sc[2s] in the low 8, sc[2s + 1] above */
KV_INL __m256i scales_of(__m256i sc16, int s) {
    const __m256i split = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                           2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    return _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(s)), split);
}

/* ---------------- decode: a super-block's signs, scales and grid indices made once ------
 *
 * For one to four x rows each weight is read once, so decoding is the product's cost, and
 * on the CPUs measured the vector ports are what it runs out of (a lane-crossing permute
 * costs several). So per super-block, in a few vector steps and with one lane-crossing
 * permute: the 32 sign bytes (the 7-bit ones with their parity bit), laid out so that one
 * byte shuffle spreads a sub-block's four over its 32 values; the per-16 scales as int16
 * laid out the same way (one byte shuffle a sub-block), the per-32 ones as int16 pairs on
 * the stack, a sub-block's taken by a broadcast load; the grid indices that are not plain
 * bytes of the block as uint16. Per sub-block what is left: one load per grid row (8 bytes
 * of IQ2, 4 of IQ3), four vector steps for the signs, and the products. */
typedef struct {
    __m256i sgn;       /* sign bytes: sub-block s's groups 0, 1 at bytes 2 pos(s), 2 pos(s) + 1
                        * of the low lane, its groups 2, 3 at the same bytes of the high lane */
    __m256i sc16;      /* per-16 scales (IQ2_XS, IQ2_S) as int16: sub-block s's groups 0, 1
                        * at element s of the low and the high lane */
    int32_t sc[8];     /* per-32 scales: sub-block s's in both int16 halves, at sign_pos(s) */
    uint16_t idx[64];  /* grid row per 8 (IQ2_XS, IQ2_S) or 4 (IQ3_S: sub-block s's eight
                        * at 8 idx3_pos(s)) values */
} kv_iq_dec;

/* where sub-block s's sign bytes sit: IQ2_XXS's and IQ2_XS's vector steps join two loads
 * with in-lane shuffles, leaving the sub-blocks in the order 0 1 4 5 2 3 6 7; IQ3_XXS and
 * the S types load theirs in block order */
KV_INL int sign_pos(const int qt, int s) {
    return qt == KV_IQ2_XXS || qt == KV_IQ2_XS ? (s & 1) | (s & 2) << 1 | (s & 4) >> 1 : s;
}
/* where IQ3_S's sub-block s's indices sit: the in-lane byte unpacks that join a qs byte and
 * its high bit leave each four sub-blocks in the order 0 2 1 3 */
KV_INL int idx3_pos(int s) { return (s & 4) | (s & 1) << 1 | (s & 2) >> 1; }
/* 8 per-32 scales as int32, sub-block s's at sign_pos(s) -> kv_iq_dec.sc, in place */
KV_INL void scales32_to(int32_t *sc, __m256i s32) {
    _mm256_storeu_si256((__m256i *)sc, odd32(s32));
}

/* dword p of r (a sub-block's four sign bytes, or its two int16 scales): its low two bytes
 * to bytes 2p, 2p + 1 of the low lane, its high two to the same bytes of the high lane */
KV_INL __m256i signs_by_half(__m256i r) {
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    return _mm256_permute4x64_epi64(_mm256_shuffle_epi8(r, pick), 0xD8);
}
/* bytes of 7 sign bits -> 8, the 8th their parity (ksign) */
KV_INL __m256i with_parity(__m256i b7) {
    const __m256i par = _mm256_setr_epi8(0, -128, -128, 0, -128, 0, 0, -128, -128, 0, 0, -128,
                                         0, -128, -128, 0, 0, -128, -128, 0, -128, 0, 0, -128,
                                         -128, 0, 0, -128, 0, -128, -128, 0);
    const __m256i nib = _mm256_and_si256(_mm256_xor_si256(b7, _mm256_srli_epi16(b7, 4)),
                                         _mm256_set1_epi8(15));
    return _mm256_or_si256(b7, _mm256_shuffle_epi8(par, nib));
}
/* 32-bit words of four 7-bit sign indices (bits 0 .. 27) -> one sign byte each */
KV_INL __m256i ksigns_of(__m256i a) {
    const __m256i m = _mm256_set1_epi32(0x7F);
    const __m256i b01 = _mm256_or_si256(_mm256_and_si256(a, m),
                                        _mm256_and_si256(_mm256_slli_epi32(a, 1),
                                                         _mm256_slli_epi32(m, 8)));
    const __m256i b23 = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(a, 2),
                                                         _mm256_slli_epi32(m, 16)),
                                        _mm256_and_si256(_mm256_slli_epi32(a, 3),
                                                         _mm256_slli_epi32(m, 24)));
    return with_parity(_mm256_or_si256(b01, b23));
}
/* 16 uint16 grid indices: bytes lo, plus the high bits of (hi_rep bytes * mul) & top */
KV_INL __m256i index16(__m128i lo, __m128i hi_rep, __m256i mul, int top) {
    const __m256i h = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(hi_rep), mul);
    return _mm256_or_si256(_mm256_cvtepu8_epi16(lo), _mm256_and_si256(h, _mm256_set1_epi16(top)));
}
/* n x 16 grid indices -> idx: 16 qs bytes each, chunk c's high bits from the qh bytes
 * rep + step c */
KV_INL void indices_to(uint16_t *idx, const uint8_t *qs, __m128i qh, __m128i rep, int step,
                       __m256i mul, int top, int n) {
    for (int c = 0; c < n; c++)
        _mm256_storeu_si256(
            (__m256i *)(idx + 16 * c),
            index16(_mm_loadu_si128((const __m128i *)(qs + 16 * c)),
                    _mm_shuffle_epi8(qh, _mm_add_epi8(rep, _mm_set1_epi8((char)(step * c)))),
                    mul, top));
}

KV_INL void dec_prep(const int qt, const uint8_t *b, kv_iq_dec *u) {
    switch (qt) {
        case KV_IQ2_XXS: {  /* sign and scale words: the odd 32-bit words of qs */
            const __m256i a = _mm256_castps_si256(
                _mm256_shuffle_ps(_mm256_castsi256_ps(load256(b + 2)),
                                  _mm256_castsi256_ps(load256(b + 34)), 0xDD));
            scales32_to(u->sc, _mm256_srli_epi32(a, 28));
            u->sgn = signs_by_half(ksigns_of(a));
            break;
        }
        case KV_IQ2_XS: {  /* qs: 9-bit index, 7 sign bits */
            const __m256i lo = load256(b + 2), hi = load256(b + 34);
            const __m256i m = _mm256_set1_epi16(511);
            _mm256_storeu_si256((__m256i *)u->idx, _mm256_and_si256(lo, m));
            _mm256_storeu_si256((__m256i *)(u->idx + 16), _mm256_and_si256(hi, m));
            u->sgn = signs_by_half(with_parity(
                _mm256_packus_epi16(_mm256_srli_epi16(lo, 9), _mm256_srli_epi16(hi, 9))));
            u->sc16 = signs_by_half(sb_scales(qt, b));  /* even groups low, odd high */
            break;
        }
        case KV_IQ2_S: {  /* index: qs byte, 2 bits of qh (a byte per 4 groups) above */
            const __m128i qh = _mm_loadl_epi64((const __m128i *)(b + 66));
            const __m128i rep = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
            const __m256i mul = _mm256_setr_epi16(256, 64, 16, 4, 256, 64, 16, 4,
                                                  256, 64, 16, 4, 256, 64, 16, 4);
            indices_to(u->idx, b + 2, qh, rep, 4, mul, 0x300, 2);
            u->sgn = signs_by_half(load256(b + 34));
            u->sc16 = signs_by_half(sb_scales(qt, b));  /* even groups low, odd high */
            break;
        }
        case KV_IQ3_XXS: {
            const __m256i a = load256(b + 66);
            scales32_to(u->sc, _mm256_srli_epi32(a, 28));
            u->sgn = signs_by_half(ksigns_of(a));
            break;
        }
        default: {  /* IQ3_S: index: qs byte, 1 bit of qh (a byte per sub-block) above */
            const __m256i qh = _mm256_set1_epi64x((long long)u64_of(b + 66));
            const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
            for (int c = 0; c < 2; c++) {  /* sub-blocks 4c .. 4c + 3: a high bit as 0 or 1 */
                const __m256i rep = _mm256_add_epi8(
                    _mm256_setr_epi64x(0, 0x0101010101010101ll, 0x0202020202020202ll,
                                       0x0303030303030303ll), _mm256_set1_epi8((char)(4 * c)));
                const __m256i hb = _mm256_min_epu8(
                    _mm256_and_si256(_mm256_shuffle_epi8(qh, rep), bit), _mm256_set1_epi8(1));
                const __m256i qs = load256(b + 2 + 32 * c);
                _mm256_storeu_si256((__m256i *)(u->idx + 32 * c), _mm256_unpacklo_epi8(qs, hb));
                _mm256_storeu_si256((__m256i *)(u->idx + 32 * c + 16),
                                    _mm256_unpackhi_epi8(qs, hb));
            }
            u->sgn = signs_by_half(load256(b + 74));
            const __m128i s8 = nibbles(_mm_cvtsi32_si128((int)u32_at(b + 106)));
            scales32_to(u->sc, _mm256_cvtepu8_epi32(s8));
            break;
        }
    }
}

/* grid rows: four of 8 bytes, eight of 4, one load each */
KV_INL __m256i grid8(const uint8_t (*grid)[8], unsigned i0, unsigned i1, unsigned i2,
                     unsigned i3) {
    const __m128d lo = _mm_loadh_pd(_mm_load_sd((const double *)grid[i0]), (const double *)grid[i1]);
    const __m128d hi = _mm_loadh_pd(_mm_load_sd((const double *)grid[i2]), (const double *)grid[i3]);
    return _mm256_castpd_si256(_mm256_insertf128_pd(_mm256_castpd128_pd256(lo), hi, 1));
}
KV_INL __m128i grid4x4(const uint8_t (*grid)[4], unsigned i0, unsigned i1, unsigned i2,
                      unsigned i3) {
    __m128i v = _mm_cvtsi32_si128((int)u32_at(grid[i0]));
    v = _mm_insert_epi32(v, (int)u32_at(grid[i1]), 1);
    v = _mm_insert_epi32(v, (int)u32_at(grid[i2]), 2);
    return _mm_insert_epi32(v, (int)u32_at(grid[i3]), 3);
}
#define KV_GRID4(grid, i)                                                                    \
    _mm256_inserti128_si256(_mm256_castsi128_si256(grid4x4(grid, (i)[0], (i)[1], (i)[2], (i)[3])), \
                            grid4x4(grid, (i)[4], (i)[5], (i)[6], (i)[7]), 1)

/* sub-block s's unsigned grid values */
KV_INL __m256i dec_grid(const int qt, const uint8_t *b, const kv_iq_dec *u, int s) {
    switch (qt) {
        case KV_IQ2_XXS: {
            const uint32_t v = u32_at(b + 2 + 8 * s);  /* one load for the four indices */
            return grid8(grid_iq2xxs, v & 255, v >> 8 & 255, v >> 16 & 255, v >> 24);
        }
        case KV_IQ2_XS: {
            const uint64_t v = u64_of((const uint8_t *)(u->idx + 4 * s));
            return grid8(grid_iq2xs, v & 0xFFFF, v >> 16 & 0xFFFF, v >> 32 & 0xFFFF, v >> 48);
        }
        case KV_IQ2_S: {
            const uint64_t v = u64_of((const uint8_t *)(u->idx + 4 * s));
            return grid8(grid_iq2s, v & 0xFFFF, v >> 16 & 0xFFFF, v >> 32 & 0xFFFF, v >> 48);
        }
        case KV_IQ3_XXS: {  /* one load for the eight indices: loads are what it runs short of */
            const uint64_t v = u64_of(b + 2 + 8 * s);
            const unsigned i[8] = {v & 255, v >> 8 & 255, v >> 16 & 255, v >> 24 & 255,
                                   v >> 32 & 255, v >> 40 & 255, v >> 48 & 255, v >> 56};
            return KV_GRID4(grid_iq3xxs, i);
        }
        default: {
            const uint16_t *q = u->idx + 8 * idx3_pos(s);
            const uint64_t v = u64_of((const uint8_t *)q);
            const uint64_t w = u64_of((const uint8_t *)(q + 4));
            const unsigned i[8] = {v & 0xFFFF, v >> 16 & 0xFFFF, v >> 32 & 0xFFFF, v >> 48,
                                   w & 0xFFFF, w >> 16 & 0xFFFF, w >> 32 & 0xFFFF, w >> 48};
            return KV_GRID4(grid_iq3s, i);
        }
    }
}

/* x with sub-block s's signs: each 8 values' sign byte spread over them (byte 2 pos(s) of
 * each lane over its low 8 bytes, 2 pos(s) + 1 over its high 8), each byte's own bit
 * taken, and moved to the top by an add (bit j of 1 << j plus 128 - (1 << j), or 1 for
 * j = 7), so sign_epi8 negates where it is set (the byte is never 0) */
KV_INL __m256i dec_signs(__m256i sgn, int p) {
    const __m256i spread = _mm256_add_epi8(
        _mm256_setr_epi64x(0, 0x0101010101010101ll, 0, 0x0101010101010101ll),
        _mm256_set1_epi8((char)(2 * p)));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ull);
    const __m256i top = _mm256_set1_epi64x((int64_t)0x01406070787C7E7Full);
    return _mm256_add_epi8(_mm256_and_si256(_mm256_shuffle_epi8(sgn, spread), bit), top);
}
/* sub-block s's scales for maddubs' pair sums: group 2s in the low lane, 2s + 1 above */
KV_INL __m256i dec_scales(const int qt, const kv_iq_dec *u, int s) {
    if (qt == KV_IQ2_XXS || qt == KV_IQ3_XXS || qt == KV_IQ3_S)
        return _mm256_set1_epi32(u->sc[sign_pos(qt, s)]);
    return _mm256_shuffle_epi8(u->sc16, _mm256_set1_epi16((short)(2 * s | (2 * s + 1) << 8)));
}

#define KV_IQ_NX 4  /* x rows per pass over a weight row */

/* The float steps of up to 8 super-blocks, in order (the portable kernel's), after their 8
 * integer sums are reduced together: v[k] the vector sum of super-block k, dw[k] its
 * d * unit, a[k] its x block. */
KV_INL void sb_floats(__m256i *v, int m, const float *dw, const kv_act256 *a, float *acc) {
    for (int k = m; k < 8; k++) v[k] = _mm256_setzero_si256();
    const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]),
                                         _mm256_hadd_epi32(v[2], v[3]));
    const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]),
                                         _mm256_hadd_epi32(v[6], v[7]));
    int32_t s[8];
    _mm_storeu_si128((__m128i *)s, _mm_add_epi32(_mm256_castsi256_si128(h0),
                                                 _mm256_extracti128_si256(h0, 1)));
    _mm_storeu_si128((__m128i *)(s + 4), _mm_add_epi32(_mm256_castsi256_si128(h1),
                                                       _mm256_extracti128_si256(h1, 1)));
    float r = *acc;
    for (int k = 0; k < m; k++) r = fmaf(dw[k] * a[k].d, (float)s[k], r);
    *acc = r;
}

/* nx x rows against one weight row: per sub-block, decoded in registers, maddubs (g, x
 * with the values' signs) then the two groups' scales, STEP(isum, pairs, scales): madd and add, or
 * with AVX512-VNNI the one vpdpwssd that does both (the same exact integer); per super-block
 * the portable kernel's integer and float step, so the same bits on every path */
#define KV_IQ_ROW(name, tgt, STEP)                                                           \
    static inline __attribute__((always_inline)) tgt void name(                             \
        const int qt, const uint8_t *b, int64_t nb, const char *xq, int64_t xs, const int nx, \
        float *y, int64_t ys) {                                                              \
        const kv_iq_type t = iq_type(qt);                                                    \
        float acc[KV_IQ_NX] = {0}, dw[8];                                                    \
        __m256i keep[KV_IQ_NX][8];                                                           \
        kv_iq_dec dec[2];                                                                    \
        if (nb > 0) dec_prep(qt, b, &dec[0]);                                                \
        for (int64_t i = 0; i < nb; i++, b += t.bytes) {                                     \
            __m256i isum[KV_IQ_NX];                                                          \
            for (int j = 0; j < nx; j++) isum[j] = _mm256_setzero_si256();                   \
            const kv_iq_dec *u = &dec[i & 1];                                                \
            if (i + 1 < nb) dec_prep(qt, b + t.bytes, &dec[(i + 1) & 1]);                    \
            _mm_prefetch((const char *)b + KV_IQ_AHEAD, _MM_HINT_T0);                        \
            _mm_prefetch((const char *)b + KV_IQ_AHEAD + 64, _MM_HINT_T0);                   \
            _Pragma("GCC unroll 8") for (int s = 0; s < 8; s++) {                            \
                const __m256i g = dec_grid(qt, b, u, s);                                     \
                const __m256i sg = dec_signs(u->sgn, sign_pos(qt, s));                       \
                const __m256i sc = dec_scales(qt, u, s);                                     \
                for (int j = 0; j < nx; j++) {                                               \
                    const kv_act256 *a = (const kv_act256 *)(xq + j * xs) + i;               \
                    const __m256i x = load256(a->qs + 32 * s);                               \
                    const __m256i xs_ = _mm256_sign_epi8(x, sg);                             \
                    isum[j] = STEP(isum[j], _mm256_maddubs_epi16(g, xs_), sc);               \
                }                                                                            \
            }                                                                                \
            const int k = (int)(i & 7);                                                      \
            dw[k] = half_at(b) * t.unit;                                                     \
            for (int j = 0; j < nx; j++) keep[j][k] = isum[j];                               \
            if (k == 7 || i + 1 == nb)                                                       \
                for (int j = 0; j < nx; j++)                                                 \
                    sb_floats(keep[j], k + 1, dw, (const kv_act256 *)(xq + j * xs) + i - k,  \
                              &acc[j]);                                                      \
        }                                                                                    \
        for (int j = 0; j < nx; j++) y[j * ys] = acc[j];                                     \
    }
#define KV_IQ_MADD_ADD(acc, p, sc) _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc))
#define KV_TGT_V __attribute__((target(KV_ISA_VNNI)))
KV_IQ_ROW(row_iq_avx2, KV_TGT, KV_IQ_MADD_ADD)
KV_IQ_ROW(row_iq_vnni, KV_TGT_V, _mm256_dpwssd_epi32)

/* rows [r0, r1) against x rows in groups of KV_IQ_NX (a constant nx for each call) */
#define KV_IQ_DRIVER(name, tgt, row)                                                         \
    static inline __attribute__((always_inline)) tgt void name(                             \
        const int qt, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,          \
        int64_t cols, const void *xq, int64_t xstride, int64_t n, float *y, int64_t ystride) { \
        for (int64_t r = r0; r < r1; r++)                                                    \
            for (int64_t j = 0; j < n; j += KV_IQ_NX) {                                      \
                const uint8_t *b = w + r * row_bytes;                                        \
                float *yj = y + j * ystride + r;                                             \
                const char *xj = (const char *)xq + j * xstride;                             \
                switch (n - j >= KV_IQ_NX ? KV_IQ_NX : n - j) {                              \
                    case 4: row(qt, b, cols / 256, xj, xstride, 4, yj, ystride); break;      \
                    case 3: row(qt, b, cols / 256, xj, xstride, 3, yj, ystride); break;      \
                    case 2: row(qt, b, cols / 256, xj, xstride, 2, yj, ystride); break;      \
                    default: row(qt, b, cols / 256, xj, xstride, 1, yj, ystride); break;     \
                }                                                                            \
            }                                                                                \
    }
KV_IQ_DRIVER(gemv_iq_avx2, KV_TGT, row_iq_avx2)
KV_IQ_DRIVER(gemv_iq_vnni, KV_TGT_V, row_iq_vnni)

/* ---------------- prefill: weight rows decoded once, then run against every x row -------
 *
 * For many x rows the row kernels above would decode each sub-block once per four x rows.
 * Here a tile of weight rows is decoded once into a buffer and every group of four x rows
 * runs over it. A decoded sub-block holds its signed grid values plus 64 (2 .. 126, the
 * unsigned bytes maddubs takes; a pair against x stays below 2 * 126 * 127 < 2^15), and the
 * 64 comes off through the x rows' per-16 sums, as Q6_K's offset does:
 * isum = sum_g sc_g * (sum (q + 64) x - 64 * bsum_g), the row kernels' integer exactly. The
 * float step per super-block is theirs too (four x rows' fmaf in one vector), so a row's
 * output does not depend on n. */
typedef struct {  /* one super-block */
    __m256i q[8];     /* values + 64 */
    __m256i sc[8];    /* sub-block s's scales as scales_of makes them, ready for one madd */
    __m256i sc64;     /* the 16 per-16 scales * 64, for the x block sums */
    float d;
} kv_iq_unp;

/* a sub-block's signed values + 64: the unsigned bytes maddubs and vpdpbusd take */
KV_INL __m256i plus64(kv_iq_sub v) {
    return _mm256_add_epi8(_mm256_sign_epi8(v.g, v.sg), _mm256_set1_epi8(64));
}

KV_INL void unpack_iq_row(const int qt, const uint8_t *b, int64_t nb, kv_iq_unp *u) {
    const kv_iq_type t = iq_type(qt);
    for (int64_t i = 0; i < nb; i++, b += t.bytes) {
        const __m256i sc16 = sb_scales(qt, b);
        for (int s = 0; s < 8; s++) {
            u[i].q[s] = plus64(sub_of(qt, b, s));
            u[i].sc[s] = scales_of(sc16, s);
        }
        u[i].sc64 = _mm256_slli_epi16(sc16, 6);  /* below 2^11: the scales are below 32 */
        u[i].d = half_at(b) * t.unit;
    }
}

/* one decoded weight row's nb super-blocks against nx (1 to KV_IQ_TILE_NX) x rows; STEP as in
 * KV_IQ_ROW. Eight x rows per pass share each decoded sub-block's values and scales, and a
 * super-block's 8 sums are reduced together (4 x rows per reduction). With
 * `more` the sums go on from y (the earlier super-blocks' float sums, so the same steps in
 * the same order), else from 0. */
#define KV_IQ_TILE_NX 8
#define KV_IQ_TILE_DOT(name, tgt, STEP)                                                      \
    static inline __attribute__((always_inline)) tgt void name(                             \
        const kv_iq_unp *u, int64_t nb, const char *xq, int64_t xs, const int nx, float *y, \
        int64_t ys, const int more) {                                                        \
        float out[KV_IQ_TILE_NX] = {0};                                                      \
        for (int j = 0; more && j < nx; j++) out[j] = y[j * ys];                             \
        __m128 acc[2] = {_mm_loadu_ps(out), _mm_loadu_ps(out + 4)};                          \
        for (int64_t i = 0; i < nb; i++) {                                                   \
            const kv_act256 *a[KV_IQ_TILE_NX];                                               \
            __m256i sumi[KV_IQ_TILE_NX];                                                     \
            float dx[KV_IQ_TILE_NX] = {0};                                                   \
            for (int j = 0; j < KV_IQ_TILE_NX; j++) sumi[j] = _mm256_setzero_si256();        \
            for (int j = 0; j < nx; j++) {                                                   \
                a[j] = (const kv_act256 *)(xq + j * xs) + i;                                 \
                dx[j] = a[j]->d;                                                             \
                sumi[j] = _mm256_sub_epi32(sumi[j],                                          \
                                           _mm256_madd_epi16(load256(a[j]->bsums), u[i].sc64)); \
            }                                                                                \
            for (int s = 0; s < 8; s++) {                                                    \
                const __m256i q = u[i].q[s], sc = u[i].sc[s];                                \
                for (int j = 0; j < nx; j++) {                                               \
                    const __m256i x = load256(a[j]->qs + 32 * s);                            \
                    sumi[j] = STEP(sumi[j], _mm256_maddubs_epi16(q, x), sc);                 \
                }                                                                            \
            }                                                                                \
            for (int h = 0; h < 2 && 4 * h < nx; h++) {                                      \
                const __m256i *v = sumi + 4 * h;                                             \
                const __m256i s8 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]),          \
                                                     _mm256_hadd_epi32(v[2], v[3]));         \
                const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8),                 \
                                                 _mm256_extracti128_si256(s8, 1));           \
                acc[h] = _mm_fmadd_ps(_mm_mul_ps(_mm_set1_ps(u[i].d), _mm_loadu_ps(dx + 4 * h)), \
                                      _mm_cvtepi32_ps(s4), acc[h]);                          \
            }                                                                                \
        }                                                                                    \
        _mm_storeu_ps(out, acc[0]);                                                          \
        _mm_storeu_ps(out + 4, acc[1]);                                                      \
        for (int j = 0; j < nx; j++) y[j * ys] = out[j];                                     \
    }
KV_IQ_TILE_DOT(tile_dot_avx2, KV_TGT, KV_IQ_MADD_ADD)
KV_IQ_TILE_DOT(tile_dot_vnni, KV_TGT_V, _mm256_dpwssd_epi32)

#define KV_IQ_TILE_MIN_N 8      /* fewer x rows: the row kernels */
#define KV_IQ_TILE_BYTES 131072 /* decoded weights per tile (rows of it, 1 to 16), in L2 */

/* dot(...) with its nx (1 to KV_IQ_TILE_NX) a constant, so its loops over x rows unroll */
#define KV_IQ_TILE_CASE(dot, u, nb, xj, xs, nx, yj, ys, more)                                \
    switch (nx) {                                                                            \
        case 8: dot(u, nb, xj, xs, 8, yj, ys, more); break;                                  \
        case 7: dot(u, nb, xj, xs, 7, yj, ys, more); break;                                  \
        case 6: dot(u, nb, xj, xs, 6, yj, ys, more); break;                                  \
        case 5: dot(u, nb, xj, xs, 5, yj, ys, more); break;                                  \
        case 4: dot(u, nb, xj, xs, 4, yj, ys, more); break;                                  \
        case 3: dot(u, nb, xj, xs, 3, yj, ys, more); break;                                  \
        case 2: dot(u, nb, xj, xs, 2, yj, ys, more); break;                                  \
        default: dot(u, nb, xj, xs, 1, yj, ys, more); break;                                 \
    }
/* x rows per chunk: about 1 MB of x (all of it up to 1 MB), a multiple of KV_IQ_TILE_NX; each
 * chunk decodes every weight row again, and qk.h's 256 KiB chunks hold only 24 rows of an
 * 8192-column x, too few to carry that decode */
#define KV_IQ_TILE_CHUNK(xstride, n) KV_X_CHUNK(xstride, n, 1 << 20, 1 << 20, KV_IQ_TILE_NX)
#define KV_IQ_TILE_KB 8  /* super-blocks per dot: 8 x rows' 8 blocks (18.7 KB) stay in L1 */

/* rows [r0, r1) in tiles: decode the tile's rows once, then each group of eight x rows runs
 * over all of them, KV_IQ_TILE_KB super-blocks at a time (the group's x blocks stay in L1
 * across the tile). x goes in chunks of KV_IQ_TILE_CHUNK, each against every tile, so that a
 * chunk stays in cache while the tiles pass: with all of x per tile, a wide matrix's x (4.8 MB
 * at 512 rows of 8192 columns) came again from L3 for every few rows. NULL-buffer
 * fallback: the row kernels */
#define KV_IQ_TILED(name, tgt, dot, rows)                                                    \
    static inline __attribute__((always_inline)) tgt void name(                             \
        const int qt, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,          \
        int64_t cols, const void *xq, int64_t xstride, int64_t n, float *y, int64_t ystride) { \
        const int64_t nb = cols / 256, ubytes = nb * (int64_t)sizeof(kv_iq_unp);             \
        int64_t tr = ubytes > 0 ? KV_IQ_TILE_BYTES / ubytes : 16;                            \
        tr = tr < 1 ? 1 : tr > 16 ? 16 : tr;                                                 \
        tr = tr < r1 - r0 ? tr : r1 - r0;                                                    \
        kv_iq_unp *buf = nb == 0 || tr < 1 ? NULL                                            \
                         : (kv_iq_unp *)aligned_alloc(32, (size_t)(tr * ubytes));            \
        if (!buf) {                                                                          \
            rows(qt, w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);                \
            return;                                                                          \
        }                                                                                    \
        const int64_t step = KV_IQ_TILE_CHUNK(xstride, n);                                   \
        for (int64_t c = 0; c < n; c += step) {                                              \
            const int64_t m = n - c < step ? n - c : step;                                   \
            for (int64_t r = r0; r < r1; r += tr) {                                          \
                const int64_t nt = r1 - r < tr ? r1 - r : tr;                                \
                for (int64_t t = 0; t < nt; t++)                                             \
                    unpack_iq_row(qt, w + (r + t) * row_bytes, nb, buf + t * nb);            \
                for (int64_t k = 0; k < nb; k += KV_IQ_TILE_KB)                              \
                    for (int64_t j = c; j < c + m; j += KV_IQ_TILE_NX) {                     \
                        const char *xj = (const char *)xq + j * xstride                      \
                                         + k * (int64_t)sizeof(kv_act256);                   \
                        float *yj = y + j * ystride + r;                                     \
                        const int nx = c + m - j >= KV_IQ_TILE_NX ? KV_IQ_TILE_NX            \
                                                                  : (int)(c + m - j);        \
                        const int64_t kn = nb - k < KV_IQ_TILE_KB ? nb - k : KV_IQ_TILE_KB;  \
                        for (int64_t t = 0; t < nt; t++)                                     \
                            KV_IQ_TILE_CASE(dot, buf + t * nb + k, kn, xj, xstride, nx,      \
                                            yj + t, ystride, k > 0);                         \
                    }                                                                        \
            }                                                                                \
        }                                                                                    \
        free(buf);                                                                           \
    }
KV_IQ_TILED(tiled_iq_avx2, KV_TGT, tile_dot_avx2, gemv_iq_avx2)
KV_IQ_TILED(tiled_iq_vnni, KV_TGT_V, tile_dot_vnni, gemv_iq_vnni)

/* ---------------- prefill on AVX512-VNNI: 16 weight rows as bytes ----------------
 *
 * The tiles above multiply one weight row per instruction. With AVX512-VNNI and from
 * KV_BYTES_MIN_N x rows on, 16 rows at a time are decoded once per pass over x into
 * qk_zmm.h's byte rows (lane r = row r; chunk 4g + c = values 16g + 4c .. 16g + 4c + 3, each
 * + 64 as in the tiles above), with the rows' scales of each 16-value group as int32 lanes
 * and their d * unit. Every x row then runs, per group, a chain of 4 vpdpbusd from -64 * (x's
 * group sum) and one vpmulld by the 16 rows' scales: 16 rows per instruction, and the exact
 * integer of the row kernels, so the same bits. A row range's last rows short of 16 take
 * the tiles above. */
#include "qk_zmm.h"

#define KV_IQB_PER 81  /* zmm per super-block of 16 rows: 64 of bytes, 16 of scales, 1 of d */

/* rows v[0..7] of 8 dwords -> v[t] = dword t of each row, row k in lane k */
KV_INL_Z void t8x8_epi32(__m256i v[8]) {
    __m256i a[8], b[8];
    for (int k = 0; k < 8; k += 2) {
        a[k] = _mm256_unpacklo_epi32(v[k], v[k + 1]);
        a[k + 1] = _mm256_unpackhi_epi32(v[k], v[k + 1]);
    }
    for (int k = 0; k < 8; k += 4)
        for (int h = 0; h < 2; h++) {
            b[k + 2 * h] = _mm256_unpacklo_epi64(a[k + h], a[k + 2 + h]);
            b[k + 2 * h + 1] = _mm256_unpackhi_epi64(a[k + h], a[k + 2 + h]);
        }
    /* b[k + m] (k = 0, 4) holds rows k..k+3 of dwords m (low lane) and m + 4 (high) */
    for (int m = 0; m < 4; m++) {
        v[m] = _mm256_permute2x128_si256(b[m], b[4 + m], 0x20);
        v[m + 4] = _mm256_permute2x128_si256(b[m], b[4 + m], 0x31);
    }
}

/* super-block i of the 16 rows from w -> out[KV_IQB_PER] */
KV_INL_Z void iq_bytes_block(const int qt, const uint8_t *w, int64_t row_bytes, int64_t i,
                             __m512i *out) {
    const kv_iq_type t = iq_type(qt);
    const uint8_t *b0 = w + i * t.bytes;
    for (int s = 0; s < 8; s++) {
        __m256i q[2][8];
        for (int r = 0; r < 16; r++) {
            q[r / 8][r % 8] = plus64(sub_of(qt, b0 + r * row_bytes, s));
        }
        t8x8_epi32(q[0]), t8x8_epi32(q[1]);
        for (int k = 0; k < 8; k++)  /* dword k of sub-block s: group 2s + k / 4, chunk k % 4 */
            _mm512_store_si512(out + 8 * s + k,
                               _mm512_inserti64x4(_mm512_castsi256_si512(q[0][k]), q[1][k], 1));
    }
    int32_t *sc = (int32_t *)(out + 64);
    float *d = (float *)(out + 80);
    for (int r = 0; r < 16; r++) {
        const uint8_t *b = b0 + r * row_bytes;
        int16_t s16[16];
        _mm256_storeu_si256((__m256i *)s16, sb_scales(qt, b));
        for (int g = 0; g < 16; g++) sc[16 * g + r] = s16[g];
        d[r] = half_at(b) * t.unit;
    }
}

/* the 16 rows' bytes (w, KV_IQB_PER per super-block) against nx x rows; `span` groups of 16
 * share a chain and a vpmulld: 2 where the type's scales are per 32 (the pair's scales are
 * equal), else 1 */
KV_INL_Z void tile_iq_bytes(const __m512i *w, int64_t nb, const char *xq, int64_t xs,
                            const int nx, float *y, int64_t ys, const int span) {
    __m512 acc[KV_GROUP_NX];
    for (int j = 0; j < nx; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++, w += KV_IQB_PER) {
        __m512i isum[KV_GROUP_NX];
        for (int j = 0; j < nx; j++) isum[j] = _mm512_setzero_si512();
        for (int g = 0; g < 16; g += span) {
            __m512i q[8];
            for (int c = 0; c < 4 * span; c++) q[c] = _mm512_load_si512(w + 4 * g + c);
            const __m512i sc = _mm512_load_si512(w + 64 + g);
            for (int j = 0; j < nx; j++) {
                const kv_act256 *a = (const kv_act256 *)(xq + j * xs) + i;
                const int bsum = span == 2 ? a->bsums[g] + a->bsums[g + 1] : a->bsums[g];
                __m512i p = _mm512_set1_epi32(-64 * bsum);
                for (int c = 0; c < 4 * span; c++) {
                    int32_t x4;
                    memcpy(&x4, a->qs + 16 * g + 4 * c, 4);
                    p = _mm512_dpbusd_epi32(p, q[c], _mm512_set1_epi32(x4));
                }
                isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(p, sc));
            }
        }
        const __m512 dw = _mm512_loadu_ps((const float *)(w + 80));
        for (int j = 0; j < nx; j++) {
            const __m512 dx = _mm512_set1_ps(((const kv_act256 *)(xq + j * xs) + i)->d);
            acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(isum[j]), acc[j]);
        }
    }
    for (int j = 0; j < nx; j++) _mm512_storeu_ps(y + j * ys, acc[j]);
}
KV_INL_Z void tile_iq_bytes16(const __m512i *w, int64_t nb, const char *xq, int64_t xs,
                              const int nx, float *y, int64_t ys) {
    tile_iq_bytes(w, nb, xq, xs, nx, y, ys, 1);
}
KV_INL_Z void tile_iq_bytes32(const __m512i *w, int64_t nb, const char *xq, int64_t xs,
                              const int nx, float *y, int64_t ys) {
    tile_iq_bytes(w, nb, xq, xs, nx, y, ys, 2);
}

/* rows [r0, r1): x in passes of about KV_BYTES_XBYTES, each pass against every 16 rows made
 * bytes; the rows short of 16 (or all, without memory for the bytes) through the tiles */
KV_INL_Z void bytes_iq(const int qt, const uint8_t *w, int64_t row_bytes, int64_t r0,
                       int64_t r1, int64_t cols, const void *xq, int64_t xstride, int64_t n,
                       float *y, int64_t ystride) {
    const int64_t nb = cols / 256, step = kv_bytes_pass_rows(xstride);
    const int64_t r16 = r0 + (r1 - r0) / 16 * 16;
    __m512i *buf = r16 > r0 && nb > 0
                       ? aligned_alloc(64, (size_t)nb * KV_IQB_PER * sizeof(__m512i)) : NULL;
    const int64_t tiled = buf ? r16 : r0;
    for (int64_t c = 0; buf && c < n; c += step) {
        const char *x = (const char *)xq + c * xstride;
        const int64_t m = n - c < step ? n - c : step;
        for (int64_t r = r0; r < r16; r += 16) {
            for (int64_t i = 0; i < nb; i++)
                iq_bytes_block(qt, w + r * row_bytes, row_bytes, i, buf + KV_IQB_PER * i);
            float *yr = y + c * ystride + r;
            if (qt == KV_IQ2_XS || qt == KV_IQ2_S) {
                KV_GROUP_TILES(tile_iq_bytes16, buf, nb, x, xstride, m, yr, ystride);
            } else {
                KV_GROUP_TILES(tile_iq_bytes32, buf, nb, x, xstride, m, yr, ystride);
            }
        }
    }
    free(buf);
    if (tiled < r1) tiled_iq_vnni(qt, w, row_bytes, tiled, r1, cols, xq, xstride, n, y, ystride);
}

KV_INL void deq_iq_avx2(const int qt, const uint8_t *w, int64_t cols, float *out) {
    const kv_iq_type t = iq_type(qt);
    for (int64_t i = 0; i < cols / 256; i++, w += t.bytes) {
        const float d = half_at(w);
        int16_t sc[16];
        _mm256_storeu_si256((__m256i *)sc, sb_scales(qt, w));
        for (int s = 0; s < 8; s++, out += 32) {
            const kv_iq_sub u = sub_of(qt, w, s);
            int8_t q[32];
            _mm256_storeu_si256((__m256i *)q, _mm256_sign_epi8(u.g, u.sg));
            for (int h = 0; h < 4; h++) {
                const __m256 db = _mm256_set1_ps(db_of(qt, d, sc[2 * s + h / 2]));
                const __m128i q8 = _mm_loadl_epi64((const __m128i *)(q + 8 * h));
                _mm256_storeu_ps(out + 8 * h,
                                 _mm256_mul_ps(db, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8))));
            }
        }
    }
}

/* per type: the VNNI kernel, and the AVX2 entry that takes it where AVX512-VNNI runs */
#define KV_IQ_AVX2(gemv, vnni, deq, qt)                                                    \
    static KV_TGT_Z KV_GEMV_DECL(vnni##_bytes) {                                           \
        bytes_iq(qt, w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);              \
    }                                                                                      \
    static KV_TGT_V KV_GEMV_DECL(vnni) {                                                   \
        if (n >= KV_BYTES_MIN_N)                                                           \
            vnni##_bytes(w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);          \
        else if (n >= KV_IQ_TILE_MIN_N)                                                    \
            tiled_iq_vnni(qt, w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);     \
        else if (!kv_gemv_iq_planes(qt, w, row_bytes, r0, r1, cols, xq, xstride, n, y,     \
                                    ystride))                                              \
            gemv_iq_vnni(qt, w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);      \
    }                                                                                      \
    KV_TGT KV_GEMV_DECL(gemv) {                                                            \
        if (kv_use_vnni()) vnni(w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);   \
        else if (n >= KV_IQ_TILE_MIN_N)                                                    \
            tiled_iq_avx2(qt, w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);     \
        else gemv_iq_avx2(qt, w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);     \
    }                                                                                      \
    KV_TGT void deq(const uint8_t *w, int64_t cols, float *out) { deq_iq_avx2(qt, w, cols, out); }
KV_IQ_AVX2(kv_gemv_iq2_xxs_avx2, gemv_iq2_xxs_vnni, kv_deq_iq2_xxs_avx2, KV_IQ2_XXS)
KV_IQ_AVX2(kv_gemv_iq2_xs_avx2, gemv_iq2_xs_vnni, kv_deq_iq2_xs_avx2, KV_IQ2_XS)
KV_IQ_AVX2(kv_gemv_iq2_s_avx2, gemv_iq2_s_vnni, kv_deq_iq2_s_avx2, KV_IQ2_S)
KV_IQ_AVX2(kv_gemv_iq3_xxs_avx2, gemv_iq3_xxs_vnni, kv_deq_iq3_xxs_avx2, KV_IQ3_XXS)
KV_IQ_AVX2(kv_gemv_iq3_s_avx2, gemv_iq3_s_vnni, kv_deq_iq3_s_avx2, KV_IQ3_S)
#endif /* KV_HAVE_AVX2_BUILD */
