/* IQ4_XS, IQ4_NL and MXFP4 in groups of 8 rows ("IQ4_XSx8", "IQ4_NLx8", "MXFP4x8", kvlab's
 * own in-memory layouts; see qk_group8_q8_0.c for the idea): one register lane per weight row, so maddubs
 * against x's 4 bytes broadcast gives 8 rows' partial dots at once, and the sub-block scales
 * and the float steps each serve 8 rows per instruction.
 *
 *   IQ4_XSx8 super-block i of rows 8g..8g+7 (1088 B = 8 x 136, IQ4_XS's own size: a batch-1
 *   decode reads no more bytes than the file's blocks; d and the scales fill the first 64 B):
 *     d[8]           fp16, row 8g+k in slot k
 *     scales_h[2][8] byte j of row k's scales_h (low byte first), [j][k]
 *     scales_l[4][8] byte j of row k's scales_l, [j][k]
 *     qs[8][4][32]   qs[s][t][4k + e] = byte 16s + 4t + e of row k's IQ4_XS qs: its low
 *                    nibble indexes element 4t+e of sub-block s, its high one 16+4t+e
 *   Sub-block s's scale is (nibble s % 2 of scales_l[s / 2] | bits 2s, 2s+1 of scales_h << 4)
 *   - 32. The SIMD tiles unpack a super-block's 64 scales at once (25 vector operations,
 *   xs8_scales_avx2) into kv_xs8_scales, the madd operands they read.
 *   IQ4_NLx8 block i (144 B = 8 x 18, IQ4_NL's own size):
 *     d[8] fp16; qs[4][32]: qs[t][4k + e] = byte 4t + e of row k's block
 *   MXFP4x8 block i (136 B = 8 x 17, MXFP4's own size): e[8], the E8M0 scale bytes, then
 *     qs as IQ4_NLx8's; its kernels are IQ4_NLx8's (the nl4 functions, qt a constant) on
 *     MXFP4's table (kv_mxfp4_values) and scales (kv_e8m0_half)
 *
 * A nibble indexes kv_iq4_values (int8 in [-127, 113]); in registers it becomes a value by a
 * byte shuffle of that table. maddubs takes an unsigned operand: it gets |v| and x carries
 * v's sign (v is never 0), so no int16 pair saturates: 2 * 127 * 127 < 32768.
 * Per row and x row the sum is an exact int32, isum = sum_s sc_s * (sum over s of v * x)
 * (IQ4_NL: one block's sum of v * x), then acc = fma(d * d_x, (float)isum, acc) per
 * (super-)block in order from acc = 0, in the AVX2 and portable kernels alike and for any
 * number of x rows: a row's output does not depend on the batch or the kernel path.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qk.h"

typedef struct {
    kv_half d[8];
    uint8_t scales_h[2][8], scales_l[4][8];
    uint8_t qs[8][4][32];
} kv_blk_iq4_xsx8;
_Static_assert(sizeof(kv_blk_iq4_xsx8) == 8 * sizeof(kv_blk_iq4_xs), "IQ4_XSx8 is IQ4_XS's size");

/* a super-block's scales for its 8 rows as the SIMD tiles read them: sc[s][k] is row k's
 * scale of sub-block s (6-bit scale - 32) in both int16 halves, the operand of a madd against
 * int16 pair sums (and, shifted right by 16, the scale as int32) */
typedef struct { int16_t sc[8][8][2]; } kv_xs8_scales;

/* row k's 8 scales (portable) */
static void xs8_row_scales(const kv_blk_iq4_xsx8 *b, int k, int sc[8]) {
    const int h = b->scales_h[0][k] | b->scales_h[1][k] << 8;
    for (int s = 0; s < 8; s++)
        sc[s] = ((b->scales_l[s / 2][k] >> 4 * (s % 2) & 0xF) | (h >> 2 * s & 3) << 4) - 32;
}

typedef struct {
    kv_half d[8];
    uint8_t qs[4][32];
} kv_blk_iq4_nlx8;  /* 144 B */
typedef struct {
    uint8_t e[8];
    uint8_t qs[4][32];
} kv_blk_mxfp4x8;  /* 136 B */
_Static_assert(sizeof(kv_blk_mxfp4x8) == 8 * sizeof(kv_blk_mxfp4), "MXFP4x8 is MXFP4's size");

/* an IQ4_NLx8 or MXFP4x8 (qt) block: its bytes, and where its qs start */
static inline int64_t nl4x8_bytes(int qt) { return 8 * kv_nl4_bytes(qt); }
static inline const uint8_t (*nl4x8_qs(const uint8_t *blk, int qt))[32] {
    return (const uint8_t (*)[32])(blk + (qt == KV_MXFP4 ? 8 : 16));
}
/* row k's scale as fp32 */
static inline float nl4x8_scale(const uint8_t *blk, int qt, int k) {
    if (qt == KV_MXFP4) return kv_e8m0_half(blk[k]);
    return kv_h2f_table[((const kv_blk_iq4_nlx8 *)blk)->d[k]];
}

/* ---------------- conversion from GGUF blocks ---------------- */

int kv_to_iq4_xsx8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst) {
    if (rows % 8 || cols % 256) return -1;
    const int64_t nb = cols / 256, row_bytes = nb * (int64_t)sizeof(kv_blk_iq4_xs);
    kv_blk_iq4_xsx8 *out = (kv_blk_iq4_xsx8 *)dst;
    for (int64_t g = 0; g < rows / 8; g++) {
        for (int64_t i = 0; i < nb; i++, out++) {
            for (int k = 0; k < 8; k++) {
                const kv_blk_iq4_xs *b = (const kv_blk_iq4_xs *)(src + (8 * g + k) * row_bytes) + i;
                out->d[k] = b->d;
                out->scales_h[0][k] = (uint8_t)(b->scales_h & 0xFF);
                out->scales_h[1][k] = (uint8_t)(b->scales_h >> 8);
                for (int j = 0; j < 4; j++) out->scales_l[j][k] = b->scales_l[j];
                for (int s = 0; s < 8; s++)
                    for (int t = 0; t < 4; t++) memcpy(&out->qs[s][t][4 * k], b->qs + 16 * s + 4 * t, 4);
            }
        }
    }
    return 0;
}

/* the scale bytes (fp16 d or E8M0 e) of row k lead the block, qs follow */
static int to_nl4x8(const int qt, const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst) {
    if (rows % 8 || cols % 32) return -1;
    const int sb = kv_nl4_bytes(qt) - 16;  /* scale bytes per row */
    const int64_t nb = cols / 32, row_bytes = nb * kv_nl4_bytes(qt);
    for (int64_t g = 0; g < rows / 8; g++) {
        for (int64_t i = 0; i < nb; i++, dst += nl4x8_bytes(qt)) {
            uint8_t (*qs)[32] = (uint8_t (*)[32])(dst + 8 * sb);
            for (int k = 0; k < 8; k++) {
                const uint8_t *b = src + (8 * g + k) * row_bytes + i * kv_nl4_bytes(qt);
                memcpy(dst + sb * k, b, (size_t)sb);
                for (int t = 0; t < 4; t++) memcpy(&qs[t][4 * k], kv_nl4_qs(b, qt) + 4 * t, 4);
            }
        }
    }
    return 0;
}

int kv_to_iq4_nlx8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst) {
    return to_nl4x8(KV_IQ4_NL, src, rows, cols, dst);
}

int kv_to_mxfp4x8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst) {
    return to_nl4x8(KV_MXFP4, src, rows, cols, dst);
}

/* ---------------- rows -> fp32, rounded as the file types' dequantizers round ---------- */

void kv_deq_iq4_xsx8_row(const uint8_t *w, int64_t row_bytes, int64_t r, int64_t cols,
                         float *out) {
    const kv_blk_iq4_xsx8 *b = (const kv_blk_iq4_xsx8 *)(w + (r / 8) * 8 * row_bytes);
    const int k = (int)(r % 8);
    for (int64_t i = 0; i < cols / 256; i++) {
        const float d = kv_h2f_table[b[i].d[k]];
        int sc[8];
        xs8_row_scales(b + i, k, sc);
        for (int s = 0; s < 8; s++, out += 32) {
            const float dl = d * (float)sc[s];
            for (int l = 0; l < 16; l++) {
                const uint8_t q = b[i].qs[s][l / 4][4 * k + l % 4];
                out[l] = dl * (float)kv_iq4_values[q & 0xF];
                out[l + 16] = dl * (float)kv_iq4_values[q >> 4];
            }
        }
    }
}

static inline void deq_nl4x8_row(const int qt, const uint8_t *w, int64_t row_bytes, int64_t r,
                                 int64_t cols, float *out) {
    const uint8_t *b = w + (r / 8) * 8 * row_bytes;
    const int8_t *v = kv_nl4_values(qt);
    const int k = (int)(r % 8);
    for (int64_t i = 0; i < cols / 32; i++, b += nl4x8_bytes(qt), out += 32) {
        const float d = nl4x8_scale(b, qt, k);
        for (int l = 0; l < 16; l++) {
            const uint8_t q = nl4x8_qs(b, qt)[l / 4][4 * k + l % 4];
            out[l] = d * (float)v[q & 0xF];
            out[l + 16] = d * (float)v[q >> 4];
        }
    }
}

KV_DEQ_ROW_DECL(kv_deq_iq4_nlx8_row) { deq_nl4x8_row(KV_IQ4_NL, w, row_bytes, r, cols, out); }
KV_DEQ_ROW_DECL(kv_deq_mxfp4x8_row) { deq_nl4x8_row(KV_MXFP4, w, row_bytes, r, cols, out); }

/* ---------------- portable kernels (the reference) ---------------- */

/* sum of v * x over the 32 elements that 4 chunks of lane group k hold */
static int32_t nibble_dot(const int8_t *v, const uint8_t (*qs)[32], int k, const int8_t *x) {
    int32_t dot = 0;
    for (int l = 0; l < 16; l++) {
        const uint8_t q = qs[l / 4][4 * k + l % 4];
        dot += v[q & 0xF] * x[l] + v[q >> 4] * x[l + 16];
    }
    return dot;
}

void kv_gemv_iq4_xsx8_generic(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                              int64_t cols, const void *xq, int64_t xstride, int64_t n,
                              float *y, int64_t ystride) {
    for (int64_t r = r0; r < r1; r += 8) {
        const kv_blk_iq4_xsx8 *b = (const kv_blk_iq4_xsx8 *)(w + r * row_bytes);
        for (int64_t j = 0; j < n; j++) {
            const kv_act256 *a = (const kv_act256 *)((const char *)xq + j * xstride);
            for (int k = 0; k < 8; k++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < cols / 256; i++) {
                    int sc[8];
                    xs8_row_scales(b + i, k, sc);
                    int32_t isum = 0;
                    for (int s = 0; s < 8; s++)
                        isum += sc[s] * nibble_dot(kv_iq4_values, b[i].qs[s], k, a[i].qs + 32 * s);
                    acc = fmaf(kv_h2f_table[b[i].d[k]] * a[i].d, (float)isum, acc);
                }
                y[j * ystride + r + k] = acc;
            }
        }
    }
}

static inline void gemv_nl4x8_generic(const int qt, const uint8_t *w, int64_t row_bytes,
                                      int64_t r0, int64_t r1, int64_t cols, const void *xq,
                                      int64_t xstride, int64_t n, float *y, int64_t ystride) {
    for (int64_t r = r0; r < r1; r += 8) {
        for (int64_t j = 0; j < n; j++) {
            const kv_act32 *a = (const kv_act32 *)((const char *)xq + j * xstride);
            for (int k = 0; k < 8; k++) {
                const uint8_t *b = w + r * row_bytes;
                float acc = 0.0f;
                for (int64_t i = 0; i < cols / 32; i++, b += nl4x8_bytes(qt))
                    acc = fmaf(nl4x8_scale(b, qt, k) * a[i].d,
                               (float)nibble_dot(kv_nl4_values(qt), nl4x8_qs(b, qt), k, a[i].qs),
                               acc);
                y[j * ystride + r + k] = acc;
            }
        }
    }
}

KV_GEMV_DECL(kv_gemv_iq4_nlx8_generic) {
    gemv_nl4x8_generic(KV_IQ4_NL, w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);
}

KV_GEMV_DECL(kv_gemv_mxfp4x8_generic) {
    gemv_nl4x8_generic(KV_MXFP4, w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);
}

/* ---------------- AVX2 ---------------- */

#ifdef KV_HAVE_AVX2_BUILD
#include "qk_avx2.h"

/* one register of nibbles -> the values of its low and high nibbles and their magnitudes */
typedef struct { __m256i lo, alo, hi, ahi; } kv_nib;

KV_INL kv_nib nib_values(const uint8_t *qs, __m256i table) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), raw = _mm256_loadu_si256((const __m256i *)qs);
    kv_nib v;
    v.lo = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, m4));
    v.hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
    v.alo = _mm256_abs_epi8(v.lo), v.ahi = _mm256_abs_epi8(v.hi);
    return v;
}

/* acc + w16 * (int16 pair sums of v * x), x's 4 bytes in every lane */
KV_INL __m256i chunk(__m256i acc, __m256i v, __m256i av, const int8_t *x, __m256i w16) {
    const __m256i p = _mm256_maddubs_epi16(av, _mm256_sign_epi8(bcast4(x), v));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, w16));
}

#define ACT(type, j, i) ((const type *)(xq + (j) * xs) + (i))

/* the 16 values, in every lane */
KV_INL __m256i iq4_table(void) {
    return _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)kv_iq4_values));
}
KV_INL __m256i nl4_table(const int qt) {
    return _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)kv_nl4_values(qt)));
}

/* an IQ4_NLx8 or MXFP4x8 block's 8 row scales as fp32: fp16 d, or E8M0 e as kv_e8m0_half
 * (the fp32 with exponent field e - 1, or for e < 2 the subnormal 2^21 << e) */
KV_INL __m256 nl4x8_scales(const int qt, const uint8_t *blk) {
    if (qt != KV_MXFP4) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)blk));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(
        _mm256_blendv_epi8(normal, small, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

/* super-block b's scales for its 8 rows (kv_xs8_scales). Each 32-bit lane holds 4 rows of
 * one byte: scales_l as [j][rows 0-3] in the low 128 bits and [j][rows 4-7] in the high,
 * whose low nibbles are sub-block 2j and high ones 2j + 1, and beside it the nibble n of
 * scales_h with those sub-blocks' high bits (bits 0-1 for 2j, 2-3 for 2j + 1), which a byte
 * shuffle takes to 16 * bits - 32 for the low nibble to complete by an or. The int8 scales
 * are then sign-extended to int16 and each int16 doubled, within 128-bit lanes. */
KV_INL void xs8_scales_avx2(const kv_blk_iq4_xsx8 *b, kv_xs8_scales *u) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i even = _mm256_broadcastsi128_si256(_mm_setr_epi8(
        -32, -16, 0, 16, -32, -16, 0, 16, -32, -16, 0, 16, -32, -16, 0, 16));
    const __m256i odd = _mm256_broadcastsi128_si256(_mm_setr_epi8(
        -32, -32, -32, -32, -16, -16, -16, -16, 0, 0, 0, 0, 16, 16, 16, 16));
    const __m256i l = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)b->scales_l),
                                                  _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    const __m256i h = _mm256_permutevar8x32_epi32(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)b->scales_h)),
        _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3));
    const __m256i n = _mm256_and_si256(
        _mm256_srlv_epi32(h, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)), m4);
    const __m256i sc8[2] = {  /* lane j of a half: sub-block 2j (even) or 2j + 1 (odd) */
        _mm256_or_si256(_mm256_and_si256(l, m4), _mm256_shuffle_epi8(even, n)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), m4), _mm256_shuffle_epi8(odd, n))};
    for (int o = 0; o < 2; o++) {
        const __m256i sign = _mm256_cmpgt_epi8(_mm256_setzero_si256(), sc8[o]);
        for (int q = 0; q < 2; q++) {  /* int16 of sub-blocks 4q + o, 4q + 2 + o */
            const __m256i w = q ? _mm256_unpackhi_epi8(sc8[o], sign) : _mm256_unpacklo_epi8(sc8[o], sign);
            _mm256_storeu_si256((__m256i *)u->sc[4 * q + o], _mm256_unpacklo_epi16(w, w));
            _mm256_storeu_si256((__m256i *)u->sc[4 * q + 2 + o], _mm256_unpackhi_epi16(w, w));
        }
    }
}

KV_INL __m256i xs8_pairs(const kv_xs8_scales *u, int s) {
    return _mm256_loadu_si256((const __m256i *)u->sc[s]);
}

/* IQ4_XSx8, sub-block s of super-block i: per chunk t both nibbles into nx sums, weighted
 * by the sub-block's scales (int16 in both halves of a lane, so madd applies them) */
KV_INL void xs_sub_avx2(const kv_blk_iq4_xsx8 *b, const kv_xs8_scales *u, int s, __m256i table,
                        const char *xq, int64_t xs, int64_t i, const int nx, __m256i *isum) {
    const __m256i sc = xs8_pairs(u, s);
    for (int t = 0; t < 4; t++) {
        const kv_nib v = nib_values(b->qs[s][t], table);
        for (int j = 0; j < nx; j++) {
            const int8_t *x = ACT(kv_act256, j, i)->qs + 32 * s + 4 * t;
            isum[j] = chunk(chunk(isum[j], v.lo, v.alo, x, sc), v.hi, v.ahi, x + 16, sc);
        }
    }
}

/* IQ4_NLx8 and MXFP4x8 (qt): one group against nx x rows, sums(qt, qs, table, xq, xs, i,
 * nx, isum) setting block i's exact integers per x row; 8 blocks (about 1.1 KB) ahead
 * prefetched */
#define KV_NL4_TILE(name, tgt, table_of, sums)                                               \
    static inline __attribute__((always_inline)) tgt void name(                             \
        const int qt, const uint8_t *b, int64_t nb, const char *xq, int64_t xs, const int nx, \
        float *y, int64_t ys) {                                                              \
        const __auto_type table = table_of(qt);  /* ymm or zmm */                            \
        __m256 acc[KV_GROUP_NX];                                                             \
        for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();                           \
        for (int64_t i = 0; i < nb; i++, b += nl4x8_bytes(qt)) {                             \
            const char *ahead = (const char *)b + 8 * nl4x8_bytes(qt);                       \
            for (int c = 0; c < 3; c++) _mm_prefetch(ahead + 64 * c, _MM_HINT_T0);           \
            __m256i isum[KV_GROUP_NX];                                                       \
            sums(nl4x8_qs(b, qt), table, xq, xs, i, nx, isum);                               \
            const __m256 dw = nl4x8_scales(qt, b);                                           \
            for (int j = 0; j < nx; j++)                                                     \
                acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(ACT(kv_act32, j, i)->d)), \
                                         _mm256_cvtepi32_ps(isum[j]), acc[j]);               \
        }                                                                                    \
        for (int j = 0; j < nx; j++) _mm256_storeu_ps(y + j * ys, acc[j]);                  \
    }

/* AVX2: a block's 4 chunks, both nibbles, through maddubs (|v|, v's sign onto x) */
KV_INL void nl4_sums(const uint8_t (*qs)[32], __m256i table, const char *xq, int64_t xs,
                     int64_t i, const int nx, __m256i *isum) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < nx; j++) isum[j] = _mm256_setzero_si256();
    for (int t = 0; t < 4; t++) {
        const kv_nib v = nib_values(qs[t], table);
        for (int j = 0; j < nx; j++) {
            const int8_t *x = ACT(kv_act32, j, i)->qs + 4 * t;
            isum[j] = chunk(chunk(isum[j], v.lo, v.alo, x, ones), v.hi, v.ahi, x + 16, ones);
        }
    }
}
KV_NL4_TILE(tile_nl4, KV_TGT, nl4_table, nl4_sums)

/* IQ4_XSx8 with AVX512-VNNI: a value v becomes the unsigned byte v + 128 (the table's bytes
 * with the top bit flipped), so vpdpbusd takes it against x with no sign step and no int16
 * pair to saturate; a sub-block's 8 products per row (p, below 32 * 241 * 128) are scaled
 * in int32, and the + 128 is taken back by sc * 128 * (x's two 16-sums). Per super-block
 * isum = sum_s sc_s * (p_s - 128 * bsum_s): the AVX2 kernel's integer, so the same bits. */
#define KV_TGT_V __attribute__((target(KV_ISA_VNNI)))
#define KV_INL_V static inline __attribute__((always_inline)) KV_TGT_V

/* the values + 128, as unsigned bytes */
KV_INL_V __m256i iq4_table_u8(void) {
    return _mm256_xor_si256(iq4_table(), _mm256_set1_epi8((char)0x80));
}

KV_INL_V void xs_sub_vnni(const kv_blk_iq4_xsx8 *b, const kv_xs8_scales *u, int s,
                          __m256i table, const char *xq, int64_t xs, int64_t i, const int nx,
                          __m256i *isum) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i p[KV_GROUP_NX];
    for (int j = 0; j < nx; j++) p[j] = _mm256_setzero_si256();
    for (int t = 0; t < 4; t++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)b->qs[s][t]);
        const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, m4));
        const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
        for (int j = 0; j < nx; j++) {
            const int8_t *x = ACT(kv_act256, j, i)->qs + 32 * s + 4 * t;
            p[j] = _mm256_dpbusd_epi32(p[j], lo, bcast4(x));
            p[j] = _mm256_dpbusd_epi32(p[j], hi, bcast4(x + 16));
        }
    }
    const __m256i sc2 = xs8_pairs(u, s), sc = _mm256_srai_epi32(sc2, 16);
    for (int j = 0; j < nx; j++) {
        const __m256i bias = _mm256_slli_epi32(
            _mm256_madd_epi16(sc2, bcast4(ACT(kv_act256, j, i)->bsums + 2 * s)), 7);
        isum[j] = _mm256_add_epi32(isum[j], _mm256_sub_epi32(_mm256_mullo_epi32(p[j], sc), bias));
    }
}

/* IQ4_XSx8: one group against nx x rows, sub() adding a sub-block's integer sums. Super-block
 * i + 2 (17 lines) is prefetched: without it decode from DRAM waits on every super-block. */
#define KV_XS_TILE(name, tgt, table_of, sub)                                                  \
    static inline __attribute__((always_inline)) tgt void name(                              \
        const kv_blk_iq4_xsx8 *b, int64_t nb, const char *xq, int64_t xs, const int nx,      \
        float *y, int64_t ys) {                                                               \
        const __m256i table = table_of();                                                     \
        __m256 acc[KV_GROUP_NX];                                                              \
        for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();                            \
        for (int64_t i = 0; i < nb; i++) {                                                    \
            const char *ahead = (const char *)(b + i + 2);                                    \
            _mm_prefetch(ahead + 1024, _MM_HINT_T0);                                          \
            __m256i isum[KV_GROUP_NX];                                                        \
            for (int j = 0; j < nx; j++) isum[j] = _mm256_setzero_si256();                    \
            kv_xs8_scales u;                                                                  \
            xs8_scales_avx2(b + i, &u);                                                       \
            for (int s = 0; s < 8; s++) {                                                     \
                _mm_prefetch(ahead + 128 * s, _MM_HINT_T0);                                   \
                _mm_prefetch(ahead + 128 * s + 64, _MM_HINT_T0);                              \
                sub(b + i, &u, s, table, xq, xs, i, nx, isum);                                \
            }                                                                                 \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].d));      \
            for (int j = 0; j < nx; j++)                                                      \
                acc[j] = _mm256_fmadd_ps(                                                     \
                    _mm256_mul_ps(dw, _mm256_set1_ps(ACT(kv_act256, j, i)->d)),               \
                    _mm256_cvtepi32_ps(isum[j]), acc[j]);                                     \
        }                                                                                     \
        for (int j = 0; j < nx; j++) _mm256_storeu_ps(y + j * ys, acc[j]);                   \
    }

KV_XS_TILE(tile_xs, KV_TGT, iq4_table, xs_sub_avx2)
KV_XS_TILE(tile_xs_vnni, KV_TGT_V, iq4_table_u8, xs_sub_vnni)

/* IQ4_XSx8 with AVX512-VNNI, 512 bits (qk_zmm.h), for 2 or more x rows: a value v becomes the unsigned byte v + 128
 * (the table's bytes with the top bit flipped), so vpdpbusd takes it against x with no sign
 * step and no int16 pair to saturate; a sub-block's products per row (p, below
 * 32 * 241 * 128) are scaled in int32, and the + 128 is taken back once per super-block as
 * 128 * sum_s sc_s * (x's two 16-sums of s). isum = sum_s sc_s * p_s - 128 * that: the AVX2
 * kernel's integer, so the same bits. */
#include "qk_zmm.h"

KV_INL_Z void xs_sub_zmm(const kv_blk_iq4_xsx8 *b, const kv_xs8_scales *u, int s,
                         __m512i table, const char *xq, int64_t xs, int64_t i, const int nx,
                         __m512i *isum) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i p[KV_GROUP_NX];
    for (int j = 0; j < nx; j++) p[j] = _mm512_setzero_si512();
    for (int t = 0; t < 4; t += 2) {
        const __m512i raw = zpair_load(b->qs[s][t]);
        const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, m4));
        const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4));
        for (int j = 0; j < nx; j++) {
            const int8_t *x = ACT(kv_act256, j, i)->qs + 32 * s + 4 * t;
            p[j] = zdot(zdot(p[j], lo, x), hi, x + 16);
        }
    }
    const __m256i sc8 = _mm256_srai_epi32(xs8_pairs(u, s), 16);
    const __m512i sc = zpair(sc8, sc8);
    for (int j = 0; j < nx; j++) isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(p[j], sc));
}

/* the values + 128 as unsigned bytes, in every 128-bit lane */
KV_INL_Z __m512i iq4_table_u8_zmm(void) {
    return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)kv_iq4_values)),
                            _mm512_set1_epi8((char)0x80));
}

/* zsub32's weights (qk_zmm.h) from the unpacked scales, which are its int16 pairs already */
KV_INL_Z void xs8_sub32(const kv_xs8_scales *u, __m512i w[4]) {
    for (int q = 0; q < 4; q++) w[q] = zpair(xs8_pairs(u, 2 * q), xs8_pairs(u, 2 * q + 1));
}

KV_INL_Z void tile_xs_zmm(const kv_blk_iq4_xsx8 *b, int64_t nb, const char *xq, int64_t xs,
                          const int nx, float *y, int64_t ys) {
    const __m512i table = iq4_table_u8_zmm();
    __m256 acc[KV_GROUP_NX];
    for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const char *ahead = (const char *)(b + i + 2);
        _mm_prefetch(ahead + 1024, _MM_HINT_T0);
        __m512i isum[KV_GROUP_NX], scw[4];
        for (int j = 0; j < nx; j++) isum[j] = _mm512_setzero_si512();
        kv_xs8_scales u;
        xs8_scales_avx2(b + i, &u);
        for (int s = 0; s < 8; s++) {
            _mm_prefetch(ahead + 128 * s, _MM_HINT_T0);
            _mm_prefetch(ahead + 128 * s + 64, _MM_HINT_T0);
            xs_sub_zmm(b + i, &u, s, table, xq, xs, i, nx, isum);
        }
        xs8_sub32(&u, scw);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].d));
        for (int j = 0; j < nx; j++) {
            const kv_act256 *a = ACT(kv_act256, j, i);
            const __m256i bias = _mm256_slli_epi32(zfold(zpair_sums(scw, a->bsums)), 7);
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a->d)),
                                     _mm256_cvtepi32_ps(_mm256_sub_epi32(zfold(isum[j]), bias)),
                                     acc[j]);
        }
    }
    for (int j = 0; j < nx; j++) _mm256_storeu_ps(y + j * ys, acc[j]);
}

/* IQ4_XSx8, two groups at once (16 rows, lane r = row r; prefill): a chunk t of both groups
 * is one zmm, so a sub-block's vpmulld scales 16 rows where the pair lanes above scale 8,
 * and no lanes are folded. Each x row's sub-block chain starts from -128 * (x's two 16-sums)
 * (one vpdpwssd), so after the 8 products p is the signed dot itself and sc * p the same
 * integer as above: the same bits. */
KV_INL_Z void xs16_sub_zmm(const kv_blk_iq4_xsx8 *A, const kv_blk_iq4_xsx8 *B,
                           const kv_xs8_scales *ua, const kv_xs8_scales *ub, int s,
                           __m512i table, const char *xq, int64_t xs, int64_t i, const int nx,
                           __m512i *isum) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m128 = _mm512_set1_epi32((int)0xFF80FF80);
    __m512i p[KV_GROUP_NX];
    for (int j = 0; j < nx; j++) {
        int32_t b2;
        memcpy(&b2, ACT(kv_act256, j, i)->bsums + 2 * s, 4);
        p[j] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(b2), m128);
    }
    for (int t = 0; t < 4; t++) {
        const __m512i raw = z16_load(A->qs[s][t], B->qs[s][t]);
        const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, m4));
        const __m512i hi =
            _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4));
        for (int j = 0; j < nx; j++) {
            const int8_t *x = ACT(kv_act256, j, i)->qs + 32 * s + 4 * t;
            int32_t x0, x1;
            memcpy(&x0, x, 4);
            memcpy(&x1, x + 16, 4);
            p[j] = _mm512_dpbusd_epi32(p[j], lo, _mm512_set1_epi32(x0));
            p[j] = _mm512_dpbusd_epi32(p[j], hi, _mm512_set1_epi32(x1));
        }
    }
    const __m512i sc = _mm512_srai_epi32(z16_load(ua->sc[s], ub->sc[s]), 16);
    for (int j = 0; j < nx; j++) isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(p[j], sc));
}

KV_INL_Z void xs16_sums(const kv_blk_iq4_xsx8 *A, const kv_blk_iq4_xsx8 *B, int64_t i,
                        const char *xq, int64_t xs, const int nx, __m512i *isum) {
    const __m512i table = iq4_table_u8_zmm();
    kv_xs8_scales ua, ub;
    xs8_scales_avx2(A, &ua);
    xs8_scales_avx2(B, &ub);
    for (int s = 0; s < 8; s++) {
        z16_prefetch(A + 2, B + 2, 128 * s);
        xs16_sub_zmm(A, B, &ua, &ub, s, table, xq, xs, i, nx, isum);
    }
    const char *a2 = (const char *)(A + 2), *b2 = (const char *)(B + 2);
    _mm_prefetch(a2 + 1024, _MM_HINT_T0);
    _mm_prefetch(b2 + 1024, _MM_HINT_T0);
}
KV_ZMM_TILE2(tile2_xs_zmm, kv_blk_iq4_xsx8, xs16_sums)

KV_GROUP_GEMV(gemv_xsx8, KV_TGT, tile_xs, kv_blk_iq4_xsx8, 256)
KV_GROUP_GEMV(gemv_xsx8_vnni, KV_TGT_V, tile_xs_vnni, kv_blk_iq4_xsx8, 256)
KV_GROUP_GEMV2(gemv_xsx8_zmm, KV_TGT_Z, tile_xs_zmm, tile2_xs_zmm, kv_blk_iq4_xsx8, 256)
/* IQ4_NLx8, MXFP4x8 with AVX512-VNNI: the values + 128 as unsigned bytes (as for
 * IQ4_XSx8 above) straight into vpdpbusd, each x row's sum started at kv_act32.bias =
 * -128 * (sum of x's block): the AVX2 kernel's integer, so the same bits */
KV_INL_V __m256i nl4_table_u8(const int qt) {
    return _mm256_xor_si256(nl4_table(qt), _mm256_set1_epi8((char)0x80));
}
KV_INL_V void nl4_sums_vnni(const uint8_t (*qs)[32], __m256i table, const char *xq, int64_t xs,
                            int64_t i, const int nx, __m256i *isum) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < nx; j++) isum[j] = _mm256_set1_epi32(ACT(kv_act32, j, i)->bias);
    for (int t = 0; t < 4; t++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)qs[t]);
        const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, m4));
        const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4));
        for (int j = 0; j < nx; j++) {
            const int8_t *x = ACT(kv_act32, j, i)->qs + 4 * t;
            isum[j] = _mm256_dpbusd_epi32(isum[j], lo, bcast4(x));
            isum[j] = _mm256_dpbusd_epi32(isum[j], hi, bcast4(x + 16));
        }
    }
}
KV_NL4_TILE(tile_nl4_vnni, KV_TGT_V, nl4_table_u8, nl4_sums_vnni)

/* The same at 512 bits (qk_zmm.h), for 2 or more x rows: lanes 2r, 2r + 1 hold row r's
 * chunks t, t + 1, so one vpdpbusd takes 8 bytes of x; the two lanes of a row are folded
 * once per block and the bias added: VNNI's integer, so the same bits. */
KV_INL_Z __m512i nl4_table_u8_zmm(const int qt) {
    return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)kv_nl4_values(qt))),
                            _mm512_set1_epi8((char)0x80));
}
KV_INL_Z void nl4_sums_zmm(const uint8_t (*qs)[32], __m512i table, const char *xq, int64_t xs,
                           int64_t i, const int nx, __m256i *isum) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i p[KV_GROUP_NX];
    for (int j = 0; j < nx; j++) p[j] = _mm512_setzero_si512();
    for (int t = 0; t < 4; t += 2) {
        const __m512i raw = zpair_load(qs[t]);
        const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, m4));
        const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4));
        for (int j = 0; j < nx; j++) {
            const int8_t *x = ACT(kv_act32, j, i)->qs + 4 * t;
            p[j] = zdot(zdot(p[j], lo, x), hi, x + 16);
        }
    }
    for (int j = 0; j < nx; j++)
        isum[j] = _mm256_add_epi32(zfold(p[j]), _mm256_set1_epi32(ACT(kv_act32, j, i)->bias));
}
KV_NL4_TILE(tile_nl4_zmm, KV_TGT_Z, nl4_table_u8_zmm, nl4_sums_zmm)

/* the tiles KV_GROUP_GEMV takes, per type and path */
#define KV_NL4_TYPE_TILE(name, tgt, tile, blk_t, qt)                                         \
    static inline __attribute__((always_inline)) tgt void name(                             \
        const blk_t *b, int64_t nb, const char *xq, int64_t xs, const int nx, float *y,      \
        int64_t ys) {                                                                        \
        tile(qt, (const uint8_t *)b, nb, xq, xs, nx, y, ys);                                 \
    }
KV_NL4_TYPE_TILE(tile_nl, KV_TGT, tile_nl4, kv_blk_iq4_nlx8, KV_IQ4_NL)
KV_NL4_TYPE_TILE(tile_nl_vnni, KV_TGT_V, tile_nl4_vnni, kv_blk_iq4_nlx8, KV_IQ4_NL)
KV_NL4_TYPE_TILE(tile_mx, KV_TGT, tile_nl4, kv_blk_mxfp4x8, KV_MXFP4)
KV_NL4_TYPE_TILE(tile_mx_vnni, KV_TGT_V, tile_nl4_vnni, kv_blk_mxfp4x8, KV_MXFP4)
KV_NL4_TYPE_TILE(tile_nl_zmm, KV_TGT_Z, tile_nl4_zmm, kv_blk_iq4_nlx8, KV_IQ4_NL)
KV_NL4_TYPE_TILE(tile_mx_zmm, KV_TGT_Z, tile_nl4_zmm, kv_blk_mxfp4x8, KV_MXFP4)

KV_GROUP_GEMV(gemv_nlx8, KV_TGT, tile_nl, kv_blk_iq4_nlx8, 32)
KV_GROUP_GEMV(gemv_nlx8_vnni, KV_TGT_V, tile_nl_vnni, kv_blk_iq4_nlx8, 32)
KV_GROUP_GEMV(gemv_mxx8, KV_TGT, tile_mx, kv_blk_mxfp4x8, 32)
KV_GROUP_GEMV(gemv_mxx8_vnni, KV_TGT_V, tile_mx_vnni, kv_blk_mxfp4x8, 32)
KV_GROUP_GEMV(gemv_nlx8_zmm, KV_TGT_Z, tile_nl_zmm, kv_blk_iq4_nlx8, 32)
KV_GROUP_GEMV(gemv_mxx8_zmm, KV_TGT_Z, tile_mx_zmm, kv_blk_mxfp4x8, 32)

/* ---- IQ4_XSx8 prefill on AVX2 without VNNI: int16 panels ----
 * tile_xs spends, per 32 products and x row, a sign, a maddubs, a scale madd and an add, the
 * first three on the two multiply pipes. With many x rows a group's values are worth
 * decoding once into int16 already times their sub-block's scale (|v * sc| <= 127 * 32) and
 * x once into int16: a madd of the two is then the whole product of 16 values, 2 madds and
 * 2 adds per 32 products. The integers are tile_xs's (exact; |isum| < 256 * 127 * 32 * 128
 * < 2^31) and the float steps the same in the same order, so the bits are too.
 *
 * A super-block's panel (4 KB): per sub-block s, chunk t and nibble half h two vectors of
 * int16, part 0 rows 0, 1 | 4, 5 and part 1 rows 2, 3 | 6, 7, each row's 4 values of
 * elements 32s + 16h + 4t ... + 3 side by side, as unpacking the byte values leaves them;
 * x's 4 int16 broadcast to every 64-bit lane meet them, and one hadd joins each row's two
 * halves at the end. Columns go in chunks of XW_SB super-blocks, x rows in blocks of XW_XB:
 * a block's int16 chunk (132 KB) stays in L2 and a group's panels (16 KB) in L1 while the
 * tiles of XW_R x rows pass over them. */
#define XW_SB 4
#define XW_XB 64
#define XW_R 4
#define XW_XS (XW_SB * 256 + 32)  /* int16 per x row of a block; the pad avoids 4 KB aliasing */
#define KV_XW_MIN_N 12            /* fewer x rows go through tile_xs (as fast at 8) */

typedef struct { __m256i v[8][4][2][2]; } xw_panel;  /* [s][t][h][part] */

KV_INL void xw_decode(const kv_blk_iq4_xsx8 *b, __m256i table, xw_panel *p) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    kv_xs8_scales u;
    xs8_scales_avx2(b, &u);
    for (int s = 0; s < 8; s++) {
        const __m256i sc = xs8_pairs(&u, s);  /* lane k: row k's scale twice */
        const __m256i part_sc[2] = {_mm256_unpacklo_epi32(sc, sc), _mm256_unpackhi_epi32(sc, sc)};
        for (int t = 0; t < 4; t++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)b->qs[s][t]);
            const __m256i v[2] = {
                _mm256_shuffle_epi8(table, _mm256_and_si256(raw, m4)),
                _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4))};
            for (int h = 0; h < 2; h++) {
                const __m256i sign = _mm256_cmpgt_epi8(zero, v[h]);
                p->v[s][t][h][0] = _mm256_mullo_epi16(_mm256_unpacklo_epi8(v[h], sign), part_sc[0]);
                p->v[s][t][h][1] = _mm256_mullo_epi16(_mm256_unpackhi_epi8(v[h], sign), part_sc[1]);
            }
        }
    }
}

/* m x rows' super-blocks [i0, i0 + ns) as int16, row j at x16 + j * XW_XS */
KV_INL void xw_widen(const char *xq, int64_t xs, int64_t m, int64_t i0, int64_t ns,
                     int16_t *x16) {
    for (int64_t j = 0; j < m; j++)
        for (int64_t i = 0; i < ns; i++) {
            const int8_t *q = ACT(kv_act256, j, i0 + i)->qs;
            int16_t *o = x16 + j * XW_XS + i * 256;
            for (int e = 0; e < 256; e += 16)
                _mm256_storeu_si256((__m256i *)(o + e),
                                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + e))));
        }
}

/* nx x rows (int16 at x16) against one panel: tile_xs's isum per x row */
KV_INL void xw_sums(const xw_panel *p, const int16_t *x16, const int nx, __m256i *isum) {
    __m256i a[XW_R], c[XW_R];
    for (int j = 0; j < nx; j++) a[j] = c[j] = _mm256_setzero_si256();
    for (int s = 0; s < 8; s++)
        for (int t = 0; t < 4; t++)
            for (int h = 0; h < 2; h++) {
                const __m256i w0 = p->v[s][t][h][0], w1 = p->v[s][t][h][1];
                for (int j = 0; j < nx; j++) {
                    int64_t x4;
                    memcpy(&x4, x16 + j * XW_XS + 32 * s + 16 * h + 4 * t, 8);
                    const __m256i xb = _mm256_set1_epi64x(x4);
                    a[j] = _mm256_add_epi32(a[j], _mm256_madd_epi16(w0, xb));
                    c[j] = _mm256_add_epi32(c[j], _mm256_madd_epi16(w1, xb));
                    __asm__("" : "+x"(a[j]), "+x"(c[j]));  /* keeps gcc from spilling them */
                }
            }
    for (int j = 0; j < nx; j++) isum[j] = _mm256_hadd_epi32(a[j], c[j]);
}

/* nx x rows against a group's ns panels from super-block i0: y's accumulators carried on
 * (or started at 0 where i0 = 0) by tile_xs's fma per super-block */
KV_INL void xw_tile(const xw_panel *p, const kv_blk_iq4_xsx8 *b, int64_t i0, int64_t ns,
                    const int16_t *x16, const char *xq, int64_t xs, const int nx, float *y,
                    int64_t ys) {
    __m256 acc[XW_R];
    for (int j = 0; j < nx; j++) acc[j] = i0 ? _mm256_loadu_ps(y + j * ys) : _mm256_setzero_ps();
    for (int64_t i = 0; i < ns; i++) {
        __m256i isum[XW_R];
        xw_sums(p + i, x16 + i * 256, nx, isum);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i0 + i].d));
        for (int j = 0; j < nx; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(ACT(kv_act256, j, i0 + i)->d)),
                                     _mm256_cvtepi32_ps(isum[j]), acc[j]);
    }
    for (int j = 0; j < nx; j++) _mm256_storeu_ps(y + j * ys, acc[j]);
}

/* this thread's scratch, kept between calls: a group's panels and a block's int16 x */
static _Thread_local void *xw_mem;

static KV_TGT void gemv_xsx8_i16(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                                 int64_t cols, const void *xq, int64_t xstride, int64_t n,
                                 float *y, int64_t ystride) {
    const size_t panel_bytes = XW_SB * sizeof(xw_panel);
    if (!xw_mem && posix_memalign(&xw_mem, 64, panel_bytes + XW_XB * XW_XS * sizeof(int16_t))) {
        xw_mem = NULL;
        gemv_xsx8(w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);
        return;
    }
    xw_panel *panel = xw_mem;
    int16_t *x16 = (int16_t *)((char *)xw_mem + panel_bytes);
    const __m256i table = iq4_table();
    const int64_t nb = cols / 256;
    for (int64_t c = 0; c < n; c += XW_XB) {
        const int64_t m = n - c < XW_XB ? n - c : XW_XB;
        const char *xc = (const char *)xq + c * xstride;
        for (int64_t i0 = 0; i0 < nb; i0 += XW_SB) {
            const int64_t ns = nb - i0 < XW_SB ? nb - i0 : XW_SB;
            xw_widen(xc, xstride, m, i0, ns, x16);
            for (int64_t r = r0; r < r1; r += 8) {
                const kv_blk_iq4_xsx8 *b = (const kv_blk_iq4_xsx8 *)(w + r * row_bytes);
                for (int64_t i = 0; i < ns; i++) xw_decode(b + i0 + i, table, panel + i);
                for (int64_t j = 0; j < m; j += XW_R) {
                    const char *xj = xc + j * xstride;
                    const int16_t *xj16 = x16 + j * XW_XS;
                    float *yj = y + (c + j) * ystride + r;
                    switch (m - j >= XW_R ? XW_R : m - j) {
                        case 4: xw_tile(panel, b, i0, ns, xj16, xj, xstride, 4, yj, ystride); break;
                        case 3: xw_tile(panel, b, i0, ns, xj16, xj, xstride, 3, yj, ystride); break;
                        case 2: xw_tile(panel, b, i0, ns, xj16, xj, xstride, 2, yj, ystride); break;
                        default: xw_tile(panel, b, i0, ns, xj16, xj, xstride, 1, yj, ystride); break;
                    }
                }
            }
        }
    }
}

KV_GEMV_DECL(kv_gemv_iq4_xsx8_avx2) {
    (kv_use_vnni() ? (n >= KV_ZMM_MIN_N ? gemv_xsx8_zmm : gemv_xsx8_vnni)
                   : n >= KV_XW_MIN_N ? gemv_xsx8_i16 : gemv_xsx8)(
        w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);
}

KV_GEMV_DECL(kv_gemv_iq4_nlx8_avx2) {
    (kv_use_vnni() ? (n >= KV_ZMM_MIN_N ? gemv_nlx8_zmm : gemv_nlx8_vnni) : gemv_nlx8)(
        w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);
}

KV_GEMV_DECL(kv_gemv_mxfp4x8_avx2) {
    (kv_use_vnni() ? (n >= KV_ZMM_MIN_N ? gemv_mxx8_zmm : gemv_mxx8_vnni) : gemv_mxx8)(
        w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);
}
#endif /* KV_HAVE_AVX2_BUILD */
