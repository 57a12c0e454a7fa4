/* K-quants in groups of 8 rows ("Q4_Kx8", "Q6_Kx8", kvlab's own in-memory layouts; see
 * qk_group8_q8_0.c for the idea): one register lane per weight row, so vpdpbusd against x's
 * 4 bytes broadcast gives 8 rows' partial dots at once, and the integer sub-block scales and
 * the float steps each serve 8 rows per instruction.
 *
 *   Q4_Kx8 super-block i of rows 8g..8g+7 (1152 B = 8 x 144, Q4_K's own size: a batch-1
 *   decode reads no more bytes than the file's blocks):
 *     d[8], dmin[8]     fp16, row 8g+k in slot k
 *     scales[12][8]     byte j of row k's 12 packed bytes of 6-bit scales and mins, [j][k]
 *     qs[4][8][32]      qs[p][t][4k + e] = byte 32p + 4t + e of row k's Q4_K qs: its low
 *                       nibble is element 4t+e of sub-block 2p, its high one of sub-block 2p+1
 *   The SIMD tiles unpack a super-block's scales and mins for all 8 rows at once (11 vector
 *   operations, k8_scales_avx2) into kv_k8_scales, the layout they read.
 *   per row and x row (x in kv_act256 blocks), as exact integers:
 *     isum = sum_s sc_s * (sum over sub-block s of q * x),  msum = sum_s m_s * (x's sum over s)
 *   then acc = fma(d * d_x, isum, acc), acc = fma(-(dmin * d_x), msum, acc) per super-block.
 *
 *   Q6_Kx8 super-block (1680 B = 8 x 210, Q6_K's own size: a batch-1 decode reads no more
 *   bytes than the file's blocks):
 *     d[8] fp16; sc[16][8] int8 scale of 16-element group g for row k;
 *     q (0..63) of row k, element 16g + 4c + e, lane l = 4k + e, split in 4 + 2 bits:
 *     ql[16][2][32]     ql[g][c & 1][l]: low nibble of chunk c (c < 2) in bits 0-3, of
 *                       chunk c + 2 in bits 4-7
 *     qh[16][32]        qh[g][l]: the top two bits of chunk c in bits 2c, 2c + 1
 *   isum = sum_g sc_g * (sum over g of q * x) - 32 * sum_g sc_g * (x's sum over g), then
 *   acc = fma(d * d_x, isum, acc).
 *
 * Every kernel below (VNNI, AVX2, portable) does exactly these steps, from acc = 0, for any
 * number of x rows: a row's output does not depend on the batch or the kernel path.
 */
#include <math.h>
#include <string.h>

#include "qk.h"

#define KV_FN(name) name##_group8
#define KV_TGT
#define KV_H2F(h) (kv_h2f_table[h])
#include "qk_dequant.inc"

typedef struct {
    kv_half d[8], dmin[8];
    uint8_t scales[12][8];
    uint8_t qs[4][8][32];
} kv_blk_q4_kx8;
_Static_assert(sizeof(kv_blk_q4_kx8) == 8 * sizeof(kv_blk_q4_k), "Q4_Kx8 is Q4_K's size");

/* row k's scales and mins (portable) */
static void k8_row_scales(const kv_blk_q4_kx8 *b, int k, uint8_t sc[8], uint8_t mn[8]) {
    kv_k8_row_scales(b->scales, k, sc, mn);
}

int kv_to_q4_kx8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst) {
    if (rows % 8 || cols % 256) return -1;
    const int64_t nb = cols / 256, row_bytes = nb * (int64_t)sizeof(kv_blk_q4_k);
    kv_blk_q4_kx8 *out = (kv_blk_q4_kx8 *)dst;
    for (int64_t g = 0; g < rows / 8; g++) {
        for (int64_t i = 0; i < nb; i++, out++) {
            for (int k = 0; k < 8; k++) {
                const kv_blk_q4_k *b = (const kv_blk_q4_k *)(src + (8 * g + k) * row_bytes) + i;
                out->d[k] = b->d, out->dmin[k] = b->dmin;
                for (int j = 0; j < 12; j++) out->scales[j][k] = b->scales[j];
                for (int p = 0; p < 4; p++)
                    for (int t = 0; t < 8; t++) memcpy(&out->qs[p][t][4 * k], b->qs + 32 * p + 4 * t, 4);
            }
        }
    }
    return 0;
}

/* row r -> fp32, rounded as deq_q4_k rounds */
void kv_deq_q4_kx8_row(const uint8_t *w, int64_t row_bytes, int64_t r, int64_t cols,
                       float *out) {
    const kv_blk_q4_kx8 *b = (const kv_blk_q4_kx8 *)(w + (r / 8) * 8 * row_bytes);
    const int k = (int)(r % 8);
    for (int64_t i = 0; i < cols / 256; i++) {
        const float d = kv_h2f_table[b[i].d[k]], dmin = kv_h2f_table[b[i].dmin[k]];
        uint8_t sc[8], mn[8];
        k8_row_scales(b + i, k, sc, mn);
        for (int p = 0; p < 4; p++, out += 64) {
            const float d1 = d * (float)sc[2 * p], m1 = dmin * (float)mn[2 * p];
            const float d2 = d * (float)sc[2 * p + 1], m2 = dmin * (float)mn[2 * p + 1];
            for (int l = 0; l < 32; l++) {
                const uint8_t q = b[i].qs[p][l / 4][4 * k + l % 4];
                out[l] = d1 * (float)(q & 0xF) - m1;
                out[l + 32] = d2 * (float)(q >> 4) - m2;
            }
        }
    }
}

/* ---------------- portable kernel (the reference) ---------------- */

static void row_sums(const kv_blk_q4_kx8 *b, int k, const kv_act256 *a, int32_t *isum,
                     int32_t *msum) {
    uint8_t sc[8], mn[8];
    k8_row_scales(b, k, sc, mn);
    *isum = *msum = 0;
    for (int p = 0; p < 4; p++) {
        int32_t lo = 0, hi = 0;
        for (int l = 0; l < 32; l++) {
            const uint8_t q = b->qs[p][l / 4][4 * k + l % 4];
            lo += (q & 0xF) * a->qs[64 * p + l];
            hi += (q >> 4) * a->qs[64 * p + 32 + l];
        }
        *isum += sc[2 * p] * lo + sc[2 * p + 1] * hi;
    }
    for (int s = 0; s < 8; s++) *msum += mn[s] * (a->bsums[2 * s] + a->bsums[2 * s + 1]);
}

KV_KX8_GENERIC(kv_gemv_q4_kx8_generic, kv_blk_q4_kx8, row_sums)

/* ---------------- Q6_Kx8: layout, conversion, portable kernel ---------------- */

typedef struct {
    kv_half d[8];
    int8_t sc[16][8];
    uint8_t ql[16][2][32];
    uint8_t qh[16][32];
} kv_blk_q6_kx8;  /* 1680 B */

/* q (0..63) of chunk c, lane l of group g */
static int q6x8_value(const kv_blk_q6_kx8 *b, int g, int c, int l) {
    const int lo = (b->ql[g][c & 1][l] >> (4 * (c >> 1))) & 0xF;
    return lo | ((b->qh[g][l] >> (2 * c)) & 3) << 4;
}

/* element e (0..255) of a Q6_K block as 0..63 (the file stores q - 32 scaled) */
static int q6_value(const kv_blk_q6_k *b, int e) {
    const int h = e / 128, s = (e % 128) / 32, l = e % 32;
    const uint8_t lo = b->ql[64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1)) & 0xF;
    return lo | ((b->qh[32 * h + l] >> (2 * s)) & 3) << 4;
}

int kv_to_q6_kx8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst) {
    if (rows % 8 || cols % 256) return -1;
    const int64_t nb = cols / 256, row_bytes = nb * (int64_t)sizeof(kv_blk_q6_k);
    kv_blk_q6_kx8 *out = (kv_blk_q6_kx8 *)dst;
    memset(dst, 0, (size_t)(rows / 8 * nb) * sizeof(kv_blk_q6_kx8));  /* bits are or-ed in */
    for (int64_t g = 0; g < rows / 8; g++) {
        for (int64_t i = 0; i < nb; i++, out++) {
            for (int k = 0; k < 8; k++) {
                const kv_blk_q6_k *b = (const kv_blk_q6_k *)(src + (8 * g + k) * row_bytes) + i;
                out->d[k] = b->d;
                for (int s = 0; s < 16; s++) out->sc[s][k] = b->scales[s];
                for (int e = 0; e < 256; e++) {
                    const int g = e / 16, c = (e % 16) / 4, l = 4 * k + e % 4, q = q6_value(b, e);
                    out->ql[g][c & 1][l] |= (uint8_t)((q & 0xF) << (4 * (c >> 1)));
                    out->qh[g][l] |= (uint8_t)((q >> 4) << (2 * c));
                }
            }
        }
    }
    return 0;
}

/* row r -> fp32, rounded as deq_q6_k rounds */
void kv_deq_q6_kx8_row(const uint8_t *w, int64_t row_bytes, int64_t r, int64_t cols,
                       float *out) {
    const kv_blk_q6_kx8 *b = (const kv_blk_q6_kx8 *)(w + (r / 8) * 8 * row_bytes);
    const int k = (int)(r % 8);
    for (int64_t i = 0; i < cols / 256; i++, out += 256) {
        const float d = kv_h2f_table[b[i].d[k]];
        for (int e = 0; e < 256; e++) {
            const float dl = d * (float)b[i].sc[e / 16][k];
            out[e] = dl * (float)(q6x8_value(b + i, e / 16, (e % 16) / 4, 4 * k + e % 4) - 32);
        }
    }
}

static int32_t q6_row_sum(const kv_blk_q6_kx8 *b, int k, const kv_act256 *a) {
    int32_t isum = 0, corr = 0;
    for (int g = 0; g < 16; g++) {
        int32_t dot = 0;
        for (int e = 0; e < 16; e++) dot += q6x8_value(b, g, e / 4, 4 * k + e % 4) * a->qs[16 * g + e];
        isum += b->sc[g][k] * dot;
        corr += b->sc[g][k] * a->bsums[g];
    }
    return isum - 32 * corr;
}

void kv_gemv_q6_kx8_generic(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                            int64_t cols, const void *xq, int64_t xstride, int64_t n,
                            float *y, int64_t ystride) {
    for (int64_t r = r0; r < r1; r += 8) {
        const kv_blk_q6_kx8 *b = (const kv_blk_q6_kx8 *)(w + r * row_bytes);
        for (int64_t j = 0; j < n; j++) {
            const kv_act256 *a = (const kv_act256 *)((const char *)xq + j * xstride);
            for (int k = 0; k < 8; k++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < cols / 256; i++)
                    acc = fmaf(kv_h2f_table[b[i].d[k]] * a[i].d, (float)q6_row_sum(b + i, k, a + i),
                               acc);
                y[j * ystride + r + k] = acc;
            }
        }
    }
}

/* ---------------- AVX2 (maddubs) and AVX512-VNNI (vpdpbusd) kernels ---------------- */

#ifdef KV_HAVE_AVX2_BUILD
#undef KV_TGT
#include "qk_avx2.h"

#define KV_TGT_A KV_TGT
#define KV_TGT_V __attribute__((target(KV_ISA_VNNI)))

static inline __attribute__((always_inline)) KV_TGT_V __m256i k8_dot_v(__m256i acc, __m256i q,
                                                                        __m256i x) {
    return _mm256_dpbusd_epi32(acc, q, x);
}

/* super-block b's scales and mins for its 8 rows */
static inline __attribute__((always_inline)) KV_TGT_A const kv_k8_scales *k8_scales_avx2(
    const kv_blk_q4_kx8 *b, kv_k8_scales *u) {
    return k8_unpack_scales(b->scales, u);
}

/* sc_2p * (sub-block 2p's sum of q * x) + sc_2p+1 * (sub-block 2p+1's), 8 rows in lanes.
 * VNNI: vpdpbusd chains, then the int32 products. (The AVX2 tiles below sum a sub-block's
 * eight maddubs as int16, each at most 2 * 15 * 127, eight of them 30480 < 2^15, then apply
 * the scale as an int16 pair in one madd: the same integers.) */
#define KV_K8_SUB_VNNI(lo, hi, x, s0, s1, out)                                             \
    do {                                                                                  \
        __m256i l = _mm256_setzero_si256(), h = _mm256_setzero_si256();                   \
        for (int t = 0; t < 8; t++) {                                                     \
            l = k8_dot_v(l, lo[t], bcast4(x + 4 * t));                                 \
            h = k8_dot_v(h, hi[t], bcast4(x + 32 + 4 * t));                            \
        }                                                                                 \
        out = _mm256_add_epi32(_mm256_mullo_epi32(l, s0), _mm256_mullo_epi32(h, s1));     \
    } while (0)
/* one group's super-blocks against nx x rows */
#define KV_K8_TILE(name, TGT, SUB)                                                          \
    static inline __attribute__((always_inline)) TGT void name(                           \
        const kv_blk_q4_kx8 *b, int64_t nb, const char *xq, int64_t xs, const int nx,     \
        float *y, int64_t ys) {                                                           \
        __m256 acc[KV_GROUP_NX];                                                             \
        for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();                        \
        const __m256i m4 = _mm256_set1_epi8(0x0F);                                        \
        for (int64_t i = 0; i < nb; i++) {                                                \
            __m256i isum[KV_GROUP_NX];                                                       \
            for (int j = 0; j < nx; j++) isum[j] = _mm256_setzero_si256();                \
            kv_k8_scales u;                                                               \
            k8_scales_avx2(b + i, &u);                                                    \
            for (int p = 0; p < 4; p++) {                                                 \
                __m256i lo[8], hi[8];                                                     \
                for (int t = 0; t < 8; t++) {                                             \
                    const __m256i v = _mm256_loadu_si256((const __m256i *)b[i].qs[p][t]); \
                    lo[t] = _mm256_and_si256(v, m4);                                      \
                    hi[t] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);                \
                }                                                                         \
                const __m256i s0 = _mm256_cvtepu8_epi32(                                  \
                    _mm_loadl_epi64((const __m128i *)u.sc[2 * p]));                       \
                const __m256i s1 = _mm256_cvtepu8_epi32(                                  \
                    _mm_loadl_epi64((const __m128i *)u.sc[2 * p + 1]));                   \
                for (int j = 0; j < nx; j++) {                                            \
                    const int8_t *x = ((const kv_act256 *)(xq + j * xs) + i)->qs + 64 * p; \
                    __m256i sub;                                                          \
                    SUB(lo, hi, x, s0, s1, sub);                                          \
                    isum[j] = _mm256_add_epi32(isum[j], sub);                             \
                }                                                                         \
            }                                                                             \
            __m256i mdup[4][2];  /* (m_s, m_s) as int16 pairs, sub-blocks 2p and 2p+1 */  \
            for (int p = 0; p < 4; p++)                                                   \
                for (int h = 0; h < 2; h++) {                                             \
                    const __m256i m = _mm256_cvtepu8_epi32(                               \
                        _mm_loadl_epi64((const __m128i *)u.m[2 * p + h]));                \
                    mdup[p][h] = _mm256_or_si256(m, _mm256_slli_epi32(m, 16));            \
                }                                                                         \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].d));  \
            const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].dmin)); \
            for (int j = 0; j < nx; j++) {                                                \
                const kv_act256 *a = (const kv_act256 *)(xq + j * xs) + i;                \
                __m256i msum = _mm256_setzero_si256();                                    \
                for (int p = 0; p < 4; p++)                                               \
                    for (int h = 0; h < 2; h++) /* m_s * (bsums[2s] + bsums[2s + 1]) */   \
                        msum = _mm256_add_epi32(msum, _mm256_madd_epi16(                  \
                            mdup[p][h], bcast4(a->bsums + 4 * p + 2 * h)));            \
                const __m256 dx = _mm256_set1_ps(a->d);                                   \
                acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx),                           \
                                         _mm256_cvtepi32_ps(isum[j]), acc[j]);            \
                acc[j] = _mm256_fnmadd_ps(_mm256_mul_ps(mw, dx),                          \
                                          _mm256_cvtepi32_ps(msum), acc[j]);              \
            }                                                                             \
        }                                                                                 \
        for (int j = 0; j < nx; j++) _mm256_storeu_ps(y + j * ys, acc[j]);                \
    }

KV_K8_TILE(tile_k8_vnni, KV_TGT_V, KV_K8_SUB_VNNI)

#define KV_K8_AHEAD 2  /* super-blocks a batch-1 product prefetches ahead */
#define KV_K8_LINES ((int)(sizeof(kv_blk_q4_kx8) + 63) / 64)
/* AVX2 has 16 vector registers, so the VNNI tile's 16 unpacked weight registers would be
 * spilled and reloaded for every x row. Here the loop over x rows is inside the loop over
 * chunks: a chunk is unpacked into 2 registers and used by up to 4 x rows at once, whose
 * int16 sums (2 per row) stay in registers. The integers are the same, so are the bits. */
static inline __attribute__((always_inline)) KV_TGT_A void k8_rows_avx2(
    const kv_blk_q4_kx8 *b, const kv_k8_scales *u, const char *xq, int64_t xs, const int nx,
    __m256i *isum, const char *ahead) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int8_t *x0 = ((const kv_act256 *)xq)->qs, *x1 = x0 + xs, *x2 = x1 + xs, *x3 = x2 + xs;
    for (int p = 0; p < 4; p++) {
        __m256i l0 = _mm256_setzero_si256(), l1 = l0, l2 = l0, l3 = l0;
        __m256i h0 = l0, h1 = l0, h2 = l0, h3 = l0;
        if (ahead) /* a quarter of the lines here, the rest after the loop: no test per chunk */
            for (int c = 0; c < KV_K8_LINES / 4; c++)
                _mm_prefetch(ahead + 64 * (KV_K8_LINES / 4 * p + c), _MM_HINT_T0);
#define KV_K8_ROW(lj, hj, xj)                                                                 \
    lj = _mm256_add_epi16(lj, _mm256_maddubs_epi16(lo, bcast4(xj + 64 * p + 4 * t)));      \
    hj = _mm256_add_epi16(hj, _mm256_maddubs_epi16(hi, bcast4(xj + 64 * p + 32 + 4 * t)))
        for (int t = 0; t < 8; t++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)b->qs[p][t]);
            const __m256i lo = _mm256_and_si256(v, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            KV_K8_ROW(l0, h0, x0);
            if (nx > 1) { KV_K8_ROW(l1, h1, x1); }
            if (nx > 2) { KV_K8_ROW(l2, h2, x2); }
            if (nx > 3) { KV_K8_ROW(l3, h3, x3); }
            __asm__("" : "+x"(l0), "+x"(l1), "+x"(l2), "+x"(l3), "+x"(h0), "+x"(h1), "+x"(h2), "+x"(h3));
        }
#undef KV_K8_ROW
        const __m256i s0d = pairs_u8(u->sc[2 * p]), s1d = pairs_u8(u->sc[2 * p + 1]);
        const __m256i ls[4] = {l0, l1, l2, l3}, hs[4] = {h0, h1, h2, h3};
        for (int j = 0; j < nx; j++)
            isum[j] = _mm256_add_epi32(isum[j], _mm256_add_epi32(_mm256_madd_epi16(ls[j], s0d),
                                                                 _mm256_madd_epi16(hs[j], s1d)));
    }
    if (ahead)
        for (int c = KV_K8_LINES / 4 * 4; c < KV_K8_LINES; c++)
            _mm_prefetch(ahead + 64 * c, _MM_HINT_T0);
}

/* the float steps of super-block i for nx x rows: acc += d * d_x * isum - dmin * d_x * msum */
static inline __attribute__((always_inline)) KV_TGT_A void k8_finish_avx2(
    const kv_blk_q4_kx8 *b, const kv_k8_scales *u, const char *xq, int64_t xs, const int nx,
    const __m256i *isum, __m256 *acc) {
    __m256i mdup[4][2];  /* (m_s, m_s) as int16 pairs, sub-blocks 2p and 2p+1 */
    for (int p = 0; p < 4; p++)
        for (int h = 0; h < 2; h++) mdup[p][h] = pairs_u8(u->m[2 * p + h]);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b->d));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b->dmin));
    for (int j = 0; j < nx; j++) {
        const kv_act256 *a = (const kv_act256 *)(xq + j * xs);
        __m256i msum = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++)
            for (int h = 0; h < 2; h++) /* m_s * (bsums[2s] + bsums[2s + 1]) */
                msum = _mm256_add_epi32(msum, _mm256_madd_epi16(
                    mdup[p][h], bcast4(a->bsums + 4 * p + 2 * h)));
        const __m256 dx = _mm256_set1_ps(a->d);
        acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum[j]), acc[j]);
        acc[j] = _mm256_fnmadd_ps(_mm256_mul_ps(mw, dx), _mm256_cvtepi32_ps(msum), acc[j]);
    }
}

static inline __attribute__((always_inline)) KV_TGT_A void tile_k8_avx2(
    const kv_blk_q4_kx8 *b, int64_t nb, const char *xq, int64_t xs, const int nx, float *y,
    int64_t ys) {
    __m256 acc[KV_GROUP_NX];
    for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        __m256i isum[KV_GROUP_NX];
        for (int j = 0; j < nx; j++) isum[j] = _mm256_setzero_si256();
        const char *xi = xq + i * (int64_t)sizeof(kv_act256);
        kv_k8_scales u;
        k8_scales_avx2(b + i, &u);
        for (int j0 = 0; j0 < nx; j0 += 4)
            k8_rows_avx2(b + i, &u, xi + j0 * xs, xs, nx - j0 < 4 ? nx - j0 : 4, isum + j0,
                         j0 ? NULL : (const char *)(b + i + KV_K8_AHEAD));
        k8_finish_avx2(b + i, &u, xi, xs, nx, isum, acc);
    }
    for (int j = 0; j < nx; j++) _mm256_storeu_ps(y + j * ys, acc[j]);
}

/* Q4_Kx8 at 512 bits (qk_zmm.h), for 2 or more x rows: sub-block s's chunk pairs against x's
 * 8-byte pieces, scaled once per sub-block; the mins' sums as int16 pairs in vpdpwssd */
#include "qk_zmm.h"

/* sub-blocks 2p and 2p + 1 (the low and high nibbles of the same bytes): a lane's partial
 * over its 4 chunks of a sub-block is below 16 * 15 * 127 < 2^15, so the two sub-blocks'
 * partials are scaled by one vpdpwssd (zscale2) */
KV_INL_Z void k8_pair_zmm(const kv_blk_q4_kx8 *b, const kv_k8_scales *u, const int p,
                          const char *xq, int64_t xs, const int nx, __m512i *isum) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const int8_t *x = ((const kv_act256 *)xq)->qs + 64 * p;
    __m512i c0[KV_GROUP_NX], c1[KV_GROUP_NX];
    for (int j = 0; j < nx; j++) c0[j] = c1[j] = _mm512_setzero_si512();
    for (int t = 0; t < 8; t += 2) {
        const __m512i v = zpair_load(b->qs[p][t]);
        const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        for (int j = 0; j < nx; j++) {
            c0[j] = zdot(c0[j], lo, x + j * xs + 4 * t);
            c1[j] = zdot(c1[j], hi, x + j * xs + 32 + 4 * t);
        }
    }
    const __m512i sc = zpairs16(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)u->sc[2 * p])),
                                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)u->sc[2 * p + 1])));
    for (int j = 0; j < nx; j++) isum[j] = zscale2(isum[j], c0[j], c1[j], sc);
}

KV_ZMM_KMIN_TILE(tile_k8_zmm, kv_blk_q4_kx8, k8_pair_zmm)

/* Two groups (16 weight rows) at once for prefill: each broadcast of x's 4 bytes feeds two
 * maddubs, one per group, which halves the broadcasts per product. Sub-block s of both
 * groups against up to 4 x rows; low (h = 0) or high nibbles (h = 1). */
static inline __attribute__((always_inline)) KV_TGT_A void k8_pair_sub_avx2(
    const kv_blk_q4_kx8 *A, const kv_blk_q4_kx8 *B, const kv_k8_scales *ua,
    const kv_k8_scales *ub, int p, int h, const char *xq, int64_t xs, const int nx,
    __m256i *ia, __m256i *ib) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int8_t *x0 = ((const kv_act256 *)xq)->qs + 64 * p + 32 * h;
    const int8_t *x1 = x0 + xs, *x2 = x1 + xs, *x3 = x2 + xs;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    __m256i b0 = a0, b1 = a0, b2 = a0, b3 = a0;
#define KV_K8_PAIR_ROW(aj, bj, xj)                                                              \
    do {                                                                                        \
        const __m256i bx = bcast4(xj + 4 * t);                                               \
        aj = _mm256_add_epi16(aj, _mm256_maddubs_epi16(wa, bx));                                \
        bj = _mm256_add_epi16(bj, _mm256_maddubs_epi16(wb, bx));                                \
    } while (0)
    for (int t = 0; t < 8; t++) {
        __m256i wa = _mm256_loadu_si256((const __m256i *)A->qs[p][t]);
        __m256i wb = _mm256_loadu_si256((const __m256i *)B->qs[p][t]);
        if (h) wa = _mm256_srli_epi16(wa, 4), wb = _mm256_srli_epi16(wb, 4);
        wa = _mm256_and_si256(wa, m4), wb = _mm256_and_si256(wb, m4);
        KV_K8_PAIR_ROW(a0, b0, x0);
        if (nx > 1) KV_K8_PAIR_ROW(a1, b1, x1);
        if (nx > 2) KV_K8_PAIR_ROW(a2, b2, x2);
        if (nx > 3) KV_K8_PAIR_ROW(a3, b3, x3);
        /* keep each chain in its register: unasked, GCC re-associates the eight adds into
         * a tree whose partial sums spill to the stack */
        __asm__("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(b0), "+x"(b1), "+x"(b2), "+x"(b3));
    }
#undef KV_K8_PAIR_ROW
    const __m256i sad = pairs_u8(ua->sc[2 * p + h]), sbd = pairs_u8(ub->sc[2 * p + h]);
    const __m256i as[4] = {a0, a1, a2, a3}, bs[4] = {b0, b1, b2, b3};
    for (int j = 0; j < nx; j++) {
        ia[j] = _mm256_add_epi32(ia[j], _mm256_madd_epi16(as[j], sad));
        ib[j] = _mm256_add_epi32(ib[j], _mm256_madd_epi16(bs[j], sbd));
    }
}

/* groups A (rows r..r+7, out y) and B = A + nb (rows r+8..r+15, out y + 8) */
static inline __attribute__((always_inline)) KV_TGT_A void tile2_k8_avx2(
    const kv_blk_q4_kx8 *A, int64_t nb, const char *xq, int64_t xs, const int nx, float *y,
    int64_t ys) {
    const kv_blk_q4_kx8 *B = A + nb;
    __m256 acca[KV_GROUP_NX], accb[KV_GROUP_NX];
    for (int j = 0; j < nx; j++) acca[j] = accb[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        __m256i ia[KV_GROUP_NX], ib[KV_GROUP_NX];
        for (int j = 0; j < nx; j++) ia[j] = ib[j] = _mm256_setzero_si256();
        const char *xi = xq + i * (int64_t)sizeof(kv_act256);
        kv_k8_scales ua, ub;
        k8_scales_avx2(A + i, &ua);
        k8_scales_avx2(B + i, &ub);
        for (int j0 = 0; j0 < nx; j0 += 4)
            for (int s = 0; s < 8; s++)
                k8_pair_sub_avx2(A + i, B + i, &ua, &ub, s / 2, s % 2, xi + j0 * xs, xs,
                                 nx - j0 < 4 ? nx - j0 : 4, ia + j0, ib + j0);
        k8_finish_avx2(A + i, &ua, xi, xs, nx, ia, acca);
        k8_finish_avx2(B + i, &ub, xi, xs, nx, ib, accb);
    }
    for (int j = 0; j < nx; j++) {
        _mm256_storeu_ps(y + j * ys, acca[j]);
        _mm256_storeu_ps(y + j * ys + 8, accb[j]);
    }
}

/* a Q6_Kx8 group's 4 chunks as bytes 0..63: nibble | two bits shifted to bits 4-5 (the
 * 16-bit shifts move bits across bytes only where the masks drop them) */
static inline __attribute__((always_inline)) KV_TGT_A void q6x8_unpack(
    const uint8_t *ql0, const uint8_t *ql1, const uint8_t *qh, __m256i q[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql0);
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)ql1);
    const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4),
                           _mm256_and_si256(_mm256_slli_epi16(h, 4), m2));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                           _mm256_and_si256(_mm256_slli_epi16(h, 2), m2));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                           _mm256_and_si256(h, m2));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(h, 2), m2));
}

/* isum[j] += sc_g * (group g's sum of q * x) for x rows j < nx (x16(j): row j's 16 bytes of
 * group g), 8 weight rows in lanes. VNNI: a vpdpbusd chain per x row, chunk by chunk across
 * the rows so that neighbouring products are independent, then the int32 product. AVX2:
 * maddubs pairs summed as int16 (each at most 2 * 63 * 127, two of them 32004 < 2^15), then
 * madd against the scale as an int16 pair: the same integer. */
#define Q6_X16(j) (((const kv_act256 *)(xq + (j) * xs) + i)->qs + 16 * g)
static inline __attribute__((always_inline)) KV_TGT_V void q6_sub_vnni(
    const __m256i q[4], const char *xq, int64_t xs, int64_t i, int g, const int nx,
    __m256i sc, __m256i sc16, __m256i *isum) {
    (void)sc16;
    __m256i p[KV_GROUP_NX];
    for (int j = 0; j < nx; j++) p[j] = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < nx; j++) p[j] = k8_dot_v(p[j], q[c], bcast4(Q6_X16(j) + 4 * c));
    for (int j = 0; j < nx; j++) isum[j] = _mm256_add_epi32(isum[j], _mm256_mullo_epi32(p[j], sc));
}
static inline __attribute__((always_inline)) KV_TGT_A void q6_sub_avx2(
    const __m256i q[4], const char *xq, int64_t xs, int64_t i, int g, const int nx,
    __m256i sc, __m256i sc16, __m256i *isum) {
    (void)sc;
    for (int j = 0; j < nx; j++) {
        const int8_t *x = Q6_X16(j);
        const __m256i l = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], bcast4(x)),
                                           _mm256_maddubs_epi16(q[1], bcast4(x + 4)));
        const __m256i h = _mm256_add_epi16(_mm256_maddubs_epi16(q[2], bcast4(x + 8)),
                                           _mm256_maddubs_epi16(q[3], bcast4(x + 12)));
        isum[j] = _mm256_add_epi32(
            isum[j], _mm256_add_epi32(_mm256_madd_epi16(l, sc16), _mm256_madd_epi16(h, sc16)));
    }
}

/* Q6_Kx8: per 16-element group, 4 chunks into one chain, times the group's int8 scales;
 * the -32 offset as 32 * sum_g sc_g * (x's group sum), from int16 pairs (sc_g, sc_g+1) */
#define KV_Q6_TILE(name, TGT, SUB)                                                          \
    static inline __attribute__((always_inline)) TGT void name(                           \
        const kv_blk_q6_kx8 *b, int64_t nb, const char *xq, int64_t xs, const int nx,     \
        float *y, int64_t ys) {                                                           \
        __m256 acc[KV_GROUP_NX];                                                             \
        for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();                        \
        for (int64_t i = 0; i < nb; i++) {                                                \
            __m256i isum[KV_GROUP_NX];                                                       \
            for (int j = 0; j < nx; j++) isum[j] = _mm256_setzero_si256();                \
            for (int g = 0; g < 16; g++) {                                                \
                __m256i q[4];                                                             \
                q6x8_unpack(b[i].ql[g][0], b[i].ql[g][1], b[i].qh[g], q);                 \
                _mm_prefetch((const char *)(b + i + 2) + 128 * g, _MM_HINT_T0);           \
                _mm_prefetch((const char *)(b + i + 2) + 128 * g + 64, _MM_HINT_T0);      \
                const __m256i sc = _mm256_cvtepi8_epi32(                                  \
                    _mm_loadl_epi64((const __m128i *)b[i].sc[g]));                        \
                const __m256i sc16 = pairs_i8(b[i].sc[g]);                             \
                SUB(q, xq, xs, i, g, nx, sc, sc16, isum);                                 \
            }                                                                             \
            __m256i scp[8];  /* (sc_2h, sc_2h+1) as int16 pairs */                         \
            for (int h = 0; h < 8; h++) scp[h] = pairs2_i8(b[i].sc[2 * h]);           \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].d));  \
            for (int j = 0; j < nx; j++) {                                                \
                const kv_act256 *a = (const kv_act256 *)(xq + j * xs) + i;                \
                __m256i corr = _mm256_setzero_si256();                                    \
                for (int h = 0; h < 8; h++)                                               \
                    corr = _mm256_add_epi32(corr, _mm256_madd_epi16(                      \
                        scp[h], bcast4(a->bsums + 2 * h)));                            \
                const __m256i total = _mm256_sub_epi32(isum[j], _mm256_slli_epi32(corr, 5)); \
                acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a->d)),          \
                                         _mm256_cvtepi32_ps(total), acc[j]);              \
            }                                                                             \
        }                                                                                 \
        for (int j = 0; j < nx; j++) _mm256_storeu_ps(y + j * ys, acc[j]);                \
    }

KV_Q6_TILE(tile_q6_vnni, KV_TGT_V, q6_sub_vnni)
KV_Q6_TILE(tile_q6_avx2, KV_TGT_A, q6_sub_avx2)
/* Q6_Kx8, two groups at once in zmm (16 rows, lane r = row r; prefill): a 16-value group's
 * vpmulld scales 16 rows. Each x row's chain starts from -32 * (x's 16-sum of the group), one
 * vpdpwssd, so p is the signed dot and sc * p the integer of the tiles above: the same bits. */
KV_INL_Z void q6x16_sums(const kv_blk_q6_kx8 *A, const kv_blk_q6_kx8 *B, int64_t i,
                        const char *xq, int64_t xs, const int nx, __m512i *isum) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x30);
    const __m512i m32 = _mm512_set1_epi32(0x0000FFE0); /* int16 pair (-32, 0) */
    for (int g = 0; g < 16; g++) {
        z16_prefetch(A + 2, B + 2, 128 * g);
        const __m512i l0 = z16_load(A->ql[g][0], B->ql[g][0]);
        const __m512i l1 = z16_load(A->ql[g][1], B->ql[g][1]);
        const __m512i h = z16_load(A->qh[g], B->qh[g]);
        const __m512i l0h = _mm512_srli_epi16(l0, 4), l1h = _mm512_srli_epi16(l1, 4);
        const __m512i q[4] = {  /* q6x8_unpack's bytes: nibble | two bits at 4-5 */
            _mm512_ternarylogic_epi32(l0, m4, _mm512_and_si512(_mm512_slli_epi16(h, 4), m2), 0xEA),
            _mm512_ternarylogic_epi32(l1, m4, _mm512_and_si512(_mm512_slli_epi16(h, 2), m2), 0xEA),
            _mm512_ternarylogic_epi32(l0h, m4, _mm512_and_si512(h, m2), 0xEA),
            _mm512_ternarylogic_epi32(l1h, m4, _mm512_and_si512(_mm512_srli_epi16(h, 2), m2),
                                      0xEA)};
        const __m512i sc = _mm512_cvtepi8_epi32(
            _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)A->sc[g]),
                               _mm_loadl_epi64((const __m128i *)B->sc[g])));
        for (int j = 0; j < nx; j++) {
            const kv_act256 *a = (const kv_act256 *)(xq + j * xs) + i;
            __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_set1_epi16(a->bsums[g]),
                                            m32);
            for (int c = 0; c < 4; c++) {
                int32_t x4;
                memcpy(&x4, a->qs + 16 * g + 4 * c, 4);
                p = _mm512_dpbusd_epi32(p, q[c], _mm512_set1_epi32(x4));
            }
            isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(p, sc));
        }
    }
}
KV_ZMM_TILE2(tile2_q6_zmm, kv_blk_q6_kx8, q6x16_sums)

KV_GROUP_GEMV(gemv_q6_vnni, KV_TGT_V, tile_q6_vnni, kv_blk_q6_kx8, 256)
KV_GROUP_GEMV2(gemv_q6_zmm, KV_TGT_Z, tile_q6_vnni, tile2_q6_zmm, kv_blk_q6_kx8, 256)
KV_GROUP_GEMV(gemv_q6_avx2, KV_TGT_A, tile_q6_avx2, kv_blk_q6_kx8, 256)

void kv_gemv_q6_kx8_avx2(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                         int64_t cols, const void *xq, int64_t xstride, int64_t n, float *y,
                         int64_t ystride) {
    (!kv_use_vnni() ? gemv_q6_avx2 : n >= KV_ZMM_MIN_N ? gemv_q6_zmm : gemv_q6_vnni)(
        w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);
}

KV_GROUP_GEMV(gemv_k8_vnni, KV_TGT_V, tile_k8_vnni, kv_blk_q4_kx8, 256)
KV_GROUP_GEMV(gemv_k8_zmm, KV_TGT_Z, tile_k8_zmm, kv_blk_q4_kx8, 256)
KV_GROUP_GEMV2(gemv_k8_avx2, KV_TGT_A, tile_k8_avx2, tile2_k8_avx2, kv_blk_q4_kx8, 256)

void kv_gemv_q4_kx8_avx2(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                         int64_t cols, const void *xq, int64_t xstride, int64_t n, float *y,
                         int64_t ystride) {
    (!kv_use_vnni() ? gemv_k8_avx2 : n >= KV_ZMM_MIN_N ? gemv_k8_zmm : gemv_k8_vnni)(
        w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);
}
#endif /* KV_HAVE_AVX2_BUILD */
