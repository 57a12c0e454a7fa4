/* Q8_0 in groups of 8 rows ("Q8_0x8", kvlab's own in-memory layout, never in a file).
 *
 * For batched decode the plain Q8_0 kernels are compute-bound: every (weight row, x row)
 * pair turns each block's 8 int32 lanes into floats and scales them, three float steps per
 * 32 products. Here 8 weight rows share one register: for each block of a group of 8 rows,
 * chunk t (of 8) holds bytes 4t..4t+3 of every row, row k in lane k, so vpdpbusd against
 * x's 4 bytes broadcast gives each row's partial dot in its own lane. After the 8 chunks a
 * lane holds a whole block's int32 dot, and one convert + multiply + FMA serves 8 rows.
 *
 *   block i of rows 8g..8g+7 (272 B, as 8 Q8_0 blocks):
 *     d[8]      fp16 scale of row 8g+k
 *     qs[256]   qs[32t + 4k + e] = q(row 8g+k, element 4t+e) + 128   (stored unsigned)
 *
 * vpdpbusd wants one operand unsigned, so the weights are stored + 128 and the sum starts
 * at kv_act32.bias = -128 * (sum of x's block), exact in int32. Per output row the float
 * steps are: acc = fma(d_w * d_x, (float)isum, acc) over the blocks in order, from 0, the
 * same in the VNNI, AVX2 and portable kernels and for any number of x rows: a row's output
 * does not depend on the batch. Q8_0, Q5_0 and Q4_0 rows convert to it exactly.
 */
#include <math.h>
#include <string.h>

#include "qk.h"

typedef struct { kv_half d[8]; uint8_t qs[256]; } kv_blk_q8_0x8;  /* 272 B */

/* ---------------- conversion from GGUF blocks ---------------- */

/* block i of one GGUF row -> its 32 int8 values and fp16 scale (exact for these types) */
static void unpack_block(int qtype, const uint8_t *row, int64_t i, int8_t q[32], kv_half *d) {
    if (qtype == KV_Q8_0) {
        const kv_blk_q8_0 *b = (const kv_blk_q8_0 *)row + i;
        memcpy(q, b->qs, 32);
        *d = b->d;
    } else if (qtype == KV_Q5_0) {
        const kv_blk_q5_0 *b = (const kv_blk_q5_0 *)row + i;
        uint32_t qh;
        memcpy(&qh, b->qh, 4);
        for (int l = 0; l < 16; l++) {
            q[l] = (int8_t)(((b->qs[l] & 0xF) | ((qh >> l) & 1) << 4) - 16);
            q[l + 16] = (int8_t)(((b->qs[l] >> 4) | ((qh >> (l + 16)) & 1) << 4) - 16);
        }
        *d = b->d;
    } else {  /* KV_Q4_0 */
        const kv_blk_q4_0 *b = (const kv_blk_q4_0 *)row + i;
        for (int l = 0; l < 16; l++) {
            q[l] = (int8_t)((b->qs[l] & 0xF) - 8);
            q[l + 16] = (int8_t)((b->qs[l] >> 4) - 8);
        }
        *d = b->d;
    }
}

int kv_to_q8_0x8(int qtype, const uint8_t *src, int64_t rows, int64_t cols,
                 int64_t src_row_bytes, uint8_t *dst) {
    if ((qtype != KV_Q8_0 && qtype != KV_Q5_0 && qtype != KV_Q4_0) || rows % 8 || cols % 32)
        return -1;
    const int64_t nb = cols / 32;
    kv_blk_q8_0x8 *out = (kv_blk_q8_0x8 *)dst;
    for (int64_t g = 0; g < rows / 8; g++) {
        for (int64_t i = 0; i < nb; i++, out++) {
            for (int k = 0; k < 8; k++) {
                int8_t q[32];
                unpack_block(qtype, src + (8 * g + k) * src_row_bytes, i, q, &out->d[k]);
                for (int t = 0; t < 8; t++)
                    for (int e = 0; e < 4; e++)
                        out->qs[32 * t + 4 * k + e] = (uint8_t)(q[4 * t + e] + 128);
            }
        }
    }
    return 0;
}

/* row r of a Q8_0x8 matrix (row_bytes per row, as Q8_0) -> fp32, as deq_q8_0 rounds */
void kv_deq_q8_0x8_row(const uint8_t *w, int64_t row_bytes, int64_t r, int64_t cols,
                       float *out) {
    const kv_blk_q8_0x8 *b = (const kv_blk_q8_0x8 *)(w + (r / 8) * 8 * row_bytes);
    const int k = (int)(r % 8);
    for (int64_t i = 0; i < cols / 32; i++, out += 32) {
        const float d = kv_h2f_table[b[i].d[k]];
        for (int t = 0; t < 8; t++)
            for (int e = 0; e < 4; e++)
                out[4 * t + e] = (float)(b[i].qs[32 * t + 4 * k + e] - 128) * d;
    }
}

/* ---------------- portable kernel (the reference the SIMD ones match bit for bit) ------ */

void kv_gemv_q8_0x8_generic(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                            int64_t cols, const void *xq, int64_t xstride, int64_t n,
                            float *y, int64_t ystride) {
    for (int64_t r = r0; r < r1; r += 8) {
        const kv_blk_q8_0x8 *b = (const kv_blk_q8_0x8 *)(w + r * row_bytes);
        for (int64_t j = 0; j < n; j++) {
            const kv_act32 *a = (const kv_act32 *)((const char *)xq + j * xstride);
            for (int k = 0; k < 8; k++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < cols / 32; i++) {
                    int32_t isum = a[i].bias;
                    for (int t = 0; t < 8; t++)
                        for (int e = 0; e < 4; e++)
                            isum += b[i].qs[32 * t + 4 * k + e] * a[i].qs[4 * t + e];
                    acc = fmaf(kv_h2f_table[b[i].d[k]] * a[i].d, (float)isum, acc);
                }
                y[j * ystride + r + k] = acc;
            }
        }
    }
}

/* ---------------- AVX2 (maddubs) and AVX512-VNNI (vpdpbusd) kernels ---------------- */

#ifdef KV_HAVE_AVX2_BUILD
#include <immintrin.h>

#define KV_TGT_A __attribute__((target("avx2,fma,f16c")))
#define KV_TGT_V __attribute__((target(KV_ISA_VNNI)))

static inline __attribute__((always_inline)) KV_TGT_A __m256i bcast4(const int8_t *p) {
    /* 4 bytes into every lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* one group's blocks against nx x rows; DOTS sets isum[j] for x row j, then the float steps */
#define KV_X8_ACT(j) ((const kv_act32 *)(xq + (j) * xs) + i)
#define KV_X8_TILE(name, TGT, SETUP, DOTS)                                                  \
    static inline __attribute__((always_inline)) TGT void name(                           \
        const kv_blk_q8_0x8 *b, int64_t nb, const char *xq, int64_t xs, const int nx,     \
        float *y, int64_t ys) {                                                           \
        __m256 acc[KV_GROUP_NX];                                                             \
        for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();                        \
        for (int64_t i = 0; i < nb; i++) {                                                \
            __m256i w[8], isum[KV_GROUP_NX];                                              \
            SETUP                                                                         \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].d));  \
            DOTS                                                                          \
            for (int j = 0; j < nx; j++)                                                  \
                acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(KV_X8_ACT(j)->d)), \
                                         _mm256_cvtepi32_ps(isum[j]), acc[j]);            \
        }                                                                                 \
        for (int j = 0; j < nx; j++) _mm256_storeu_ps(y + j * ys, acc[j]);                \
    }

/* VNNI: unsigned weights straight into vpdpbusd, chunk by chunk across the x rows so that
 * neighbouring products are independent: one chain per x row from its bias, two (even and
 * odd chunks) for one or two rows (as Q5_0x8's, qk_group8_q5_0.c) */
#define KV_X8_SETUP_V \
    for (int t = 0; t < 8; t++) w[t] = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * t));
#define KV_X8_DOTS_V                                                                       \
    {                                                                                     \
        const int two = nx <= 2;                                                          \
        __m256i odd[2];                                                                   \
        for (int j = 0; j < nx; j++) isum[j] = _mm256_set1_epi32(KV_X8_ACT(j)->bias);     \
        for (int j = 0; j < (two ? nx : 0); j++) odd[j] = _mm256_setzero_si256();         \
        for (int t = 0; t < 8; t++)                                                       \
            for (int j = 0; j < nx; j++) {                                                \
                const __m256i x = bcast4(KV_X8_ACT(j)->qs + 4 * t);                       \
                if (two && t % 2) odd[j] = _mm256_dpbusd_epi32(odd[j], w[t], x);          \
                else isum[j] = _mm256_dpbusd_epi32(isum[j], w[t], x);                     \
            }                                                                             \
        for (int j = 0; j < (two ? nx : 0); j++) isum[j] = _mm256_add_epi32(isum[j], odd[j]); \
    }
KV_X8_TILE(tile_x8_vnni, KV_TGT_V, KV_X8_SETUP_V, KV_X8_DOTS_V)

/* AVX2: back to signed weights; |w| (<= 128) as maddubs' unsigned operand, w's sign moved
 * onto x; no pair of products reaches int16's limit (2 * 128 * 127 < 32768) */
#define KV_X8_SETUP_A                                                                      \
    __m256i ws[8];                                                                        \
    for (int t = 0; t < 8; t++) {                                                         \
        ws[t] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * t)), \
                                 _mm256_set1_epi8((char)0x80));                           \
        w[t] = _mm256_sign_epi8(ws[t], ws[t]);                                            \
    }
#define KV_X8_DOTS_A                                                                       \
    for (int j = 0; j < nx; j++) {                                                        \
        const kv_act32 *a = KV_X8_ACT(j);                                                 \
        __m256i p0 = _mm256_setzero_si256(), p1 = p0;                                     \
        for (int t = 0; t < 8; t += 2) {                                                  \
            p0 = _mm256_add_epi32(p0, _mm256_madd_epi16(_mm256_maddubs_epi16(              \
                w[t], _mm256_sign_epi8(bcast4(a->qs + 4 * t), ws[t])), _mm256_set1_epi16(1))); \
            p1 = _mm256_add_epi32(p1, _mm256_madd_epi16(_mm256_maddubs_epi16(              \
                w[t + 1], _mm256_sign_epi8(bcast4(a->qs + 4 * t + 4), ws[t + 1])),         \
                _mm256_set1_epi16(1)));                                                   \
        }                                                                                 \
        isum[j] = _mm256_add_epi32(p0, p1);                                               \
    }
KV_X8_TILE(tile_x8_avx2, KV_TGT_A, KV_X8_SETUP_A, KV_X8_DOTS_A)

KV_GROUP_GEMV(gemv_x8_vnni, KV_TGT_V, tile_x8_vnni, kv_blk_q8_0x8, 32)
KV_GROUP_GEMV(gemv_x8_avx2, KV_TGT_A, tile_x8_avx2, kv_blk_q8_0x8, 32)

void kv_gemv_q8_0x8_avx2(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                         int64_t cols, const void *xq, int64_t xstride, int64_t n, float *y,
                         int64_t ystride) {
    (kv_use_vnni() ? gemv_x8_vnni : gemv_x8_avx2)(w, row_bytes, r0, r1, cols, xq, xstride,
                                                  n, y, ystride);
}
#endif /* KV_HAVE_AVX2_BUILD */
