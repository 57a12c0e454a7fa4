/* Q2_K and Q3_K in groups of 8 rows ("Q2_Kx8", "Q3_Kx8", kvlab's own in-memory layouts; see
 * qk_group8_q4k_q6k.c for the idea): one register lane per weight row, so one maddubs against
 * 4 bytes of x broadcast serves 8 rows, and the sub-block scales arrive in the lanes ready for
 * vpmaddwd with one in-lane shuffle per sub-block for all 8 rows (the file layout needs one
 * per 32 weights of a row).
 *
 *   Q2_Kx8 super-block of rows 8g..8g+7 (672 B = 8 x 84, Q2_K's own size):
 *     d[8], dmin[8]   fp16, row 8g+k in slot k
 *     sc[16][8]       the file's byte for sub-block s of row k: scale low nibble, min high
 *     qs[16][32]      qs[s][4k + e], bits 2c, 2c+1: element 4c + e of sub-block s of row k
 *   Q3_Kx8 super-block (880 B = 8 x 110, Q3_K's own size):
 *     d[8]; scales[12][8] byte j of row k's 12 packed bytes of 6-bit scales, [j][k] (the
 *     SIMD tiles unpack them for 8 rows at once, q3_unpack_scales, into kv_q3_scales:
 *     int8 scale - 32, [sub-block s][row k]);
 *     q3[8][3][32]    the values q = low | third << 2 (0..7: the file's value + 4) of sub-block
 *                     pair t, three bits each, byte 4k + e of each vector for row k: with v_c
 *                     the value of element 4(c % 4) + e of sub-block 2t + c / 4 (chunk c, 0..7),
 *                     q3[t][0] = v0 | v1 << 3 | (v6 & 3) << 6,
 *                     q3[t][1] = v2 | v3 << 3 | (v7 & 3) << 6,
 *                     q3[t][2] = v4 | v5 << 3 | (v6 >> 2) << 6 | (v7 >> 2) << 7,
 *                     so the 8 chunks come out in 19 operations (the file's split into 2 + 1
 *                     bits needs 37)
 *   per row and x row (x in kv_act256 blocks), as exact integers:
 *     isum = sum_s sc_s * (sum over sub-block s of q * x)
 *     Q2_Kx8: msum = sum_s m_s * bsum_s; acc = fma(d * d_x, isum, acc),
 *             acc = fma(-(dmin * d_x), msum, acc)
 *     Q3_Kx8: isum -= 4 * sum_s sc_s * bsum_s; acc = fma(d * d_x, isum, acc)
 *
 * The AVX2 and portable kernels do exactly these steps, from acc = 0, for any number of x
 * rows: a row's output does not depend on the batch or the kernel path.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qk.h"

typedef struct {
    kv_half d[8], dmin[8];
    uint8_t sc[16][8];
    uint8_t qs[16][32];
} kv_blk_q2_kx8;
typedef struct {
    kv_half d[8];
    uint8_t scales[12][8];
    uint8_t q3[8][3][32];
} kv_blk_q3_kx8;
typedef struct { int8_t sc[16][8]; } kv_q3_scales;  /* scale - 32, [sub-block s][row k] */
_Static_assert(sizeof(kv_blk_q2_kx8) == 8 * sizeof(kv_blk_q2_k), "Q2_Kx8 is Q2_K's size");
_Static_assert(sizeof(kv_blk_q3_kx8) == 8 * sizeof(kv_blk_q3_k), "Q3_Kx8 is Q3_K's size");

/* row k's 16 scales (minus 32), portable */
static void q3_row_scales(const kv_blk_q3_kx8 *b, int k, int8_t sc[16]) {
    uint8_t packed[12];
    for (int j = 0; j < 12; j++) packed[j] = b->scales[j][k];
    kv_q3_k_scales(packed, sc);
}

/* element e (0..255) of a file block: its two low bits; Q3_K's third bit */
static int k23_low(const uint8_t *qs, int e) { return qs[32 * (e / 128) + e % 32] >> (2 * (e / 32 % 4)) & 3; }
static int k3_high(const uint8_t *hmask, int e) { return hmask[e % 32] >> (e / 32) & 1; }

/* element e of row k of a group: byte 4k + e % 4 of sub-block e / 16, field e % 16 / 4 */
static int x8_low(const uint8_t qs[16][32], int k, int e) {
    return qs[e / 16][4 * k + e % 4] >> (2 * (e % 16 / 4)) & 3;
}
/* Q3_Kx8: sub-block pair e / 32, its chunk c (0..7) and lane byte l of element e of row k */
#define Q3X8_PLACE(e, k) const int c = 4 * (e / 16 % 2) + e % 16 / 4, l = 4 * (k) + e % 4
static int x8_q3(const kv_blk_q3_kx8 *b, int k, int e) {
    Q3X8_PLACE(e, k);
    const uint8_t(*v)[32] = b->q3[e / 32];
    if (c < 6) return v[c / 2][l] >> (3 * (c % 2)) & 7;
    return (v[c - 6][l] >> 6) | (v[2][l] >> c & 1) << 2;
}
static void put_q3(kv_blk_q3_kx8 *b, int k, int e, int q) {
    Q3X8_PLACE(e, k);
    uint8_t(*v)[32] = b->q3[e / 32];
    if (c < 6) {
        v[c / 2][l] |= (uint8_t)(q << (3 * (c % 2)));
    } else {
        v[c - 6][l] |= (uint8_t)((q & 3) << 6);
        v[2][l] |= (uint8_t)((q >> 2) << c);
    }
}

static void put_low(uint8_t qs[16][32], int k, int e, int q) {
    qs[e / 16][4 * k + e % 4] |= (uint8_t)(q << (2 * (e % 16 / 4)));
}

int kv_to_q2_kx8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst) {
    if (rows % 8 || cols % 256) return -1;
    const int64_t nb = cols / 256, row_bytes = nb * (int64_t)sizeof(kv_blk_q2_k);
    kv_blk_q2_kx8 *out = (kv_blk_q2_kx8 *)dst;
    memset(dst, 0, (size_t)(rows / 8 * nb) * sizeof *out);  /* bits are or-ed in */
    for (int64_t g = 0; g < rows / 8; g++) {
        for (int64_t i = 0; i < nb; i++, out++) {
            for (int k = 0; k < 8; k++) {
                const kv_blk_q2_k *b = (const kv_blk_q2_k *)(src + (8 * g + k) * row_bytes) + i;
                out->d[k] = b->d, out->dmin[k] = b->dmin;
                for (int s = 0; s < 16; s++) out->sc[s][k] = b->scales[s];
                for (int e = 0; e < 256; e++) put_low(out->qs, k, e, k23_low(b->qs, e));
            }
        }
    }
    return 0;
}

int kv_to_q3_kx8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst) {
    if (rows % 8 || cols % 256) return -1;
    const int64_t nb = cols / 256, row_bytes = nb * (int64_t)sizeof(kv_blk_q3_k);
    kv_blk_q3_kx8 *out = (kv_blk_q3_kx8 *)dst;
    memset(dst, 0, (size_t)(rows / 8 * nb) * sizeof *out);
    for (int64_t g = 0; g < rows / 8; g++) {
        for (int64_t i = 0; i < nb; i++, out++) {
            for (int k = 0; k < 8; k++) {
                const kv_blk_q3_k *b = (const kv_blk_q3_k *)(src + (8 * g + k) * row_bytes) + i;
                out->d[k] = b->d;
                for (int j = 0; j < 12; j++) out->scales[j][k] = b->scales[j];
                for (int e = 0; e < 256; e++)
                    put_q3(out, k, e, k23_low(b->qs, e) | k3_high(b->hmask, e) << 2);
            }
        }
    }
    return 0;
}

/* row r -> fp32, rounded as the file types' dequantizers round */
void kv_deq_q2_kx8_row(const uint8_t *w, int64_t row_bytes, int64_t r, int64_t cols,
                       float *out) {
    const kv_blk_q2_kx8 *b = (const kv_blk_q2_kx8 *)(w + (r / 8) * 8 * row_bytes);
    const int k = (int)(r % 8);
    for (int64_t i = 0; i < cols / 256; i++) {
        const float d = kv_h2f_table[b[i].d[k]], dmin = kv_h2f_table[b[i].dmin[k]];
        for (int s = 0; s < 16; s++, out += 16) {
            const float dl = d * (float)(b[i].sc[s][k] & 0xF);
            const float ml = dmin * (float)(b[i].sc[s][k] >> 4);
            for (int l = 0; l < 16; l++) out[l] = dl * (float)x8_low(b[i].qs, k, 16 * s + l) - ml;
        }
    }
}

void kv_deq_q3_kx8_row(const uint8_t *w, int64_t row_bytes, int64_t r, int64_t cols,
                       float *out) {
    const kv_blk_q3_kx8 *b = (const kv_blk_q3_kx8 *)(w + (r / 8) * 8 * row_bytes);
    const int k = (int)(r % 8);
    for (int64_t i = 0; i < cols / 256; i++) {
        const float d = kv_h2f_table[b[i].d[k]];
        int8_t sc[16];
        q3_row_scales(b + i, k, sc);
        for (int s = 0; s < 16; s++, out += 16) {
            const float dl = d * (float)sc[s];
            for (int l = 0; l < 16; l++) out[l] = dl * (float)(x8_q3(b + i, k, 16 * s + l) - 4);
        }
    }
}

/* ---------------- portable kernels (the reference) ---------------- */

static float q2x8_row(const kv_blk_q2_kx8 *b, int64_t nb, int k, const kv_act256 *a) {
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int32_t isum = 0, msum = 0;
        for (int s = 0; s < 16; s++) {
            int32_t dot = 0;
            for (int l = 0; l < 16; l++) dot += x8_low(b[i].qs, k, 16 * s + l) * a[i].qs[16 * s + l];
            isum += (b[i].sc[s][k] & 0xF) * dot;
            msum += (b[i].sc[s][k] >> 4) * a[i].bsums[s];
        }
        acc = fmaf(kv_h2f_table[b[i].d[k]] * a[i].d, (float)isum, acc);
        acc = fmaf(-(kv_h2f_table[b[i].dmin[k]] * a[i].d), (float)msum, acc);
    }
    return acc;
}

static float q3x8_row(const kv_blk_q3_kx8 *b, int64_t nb, int k, const kv_act256 *a) {
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        int32_t isum = 0, corr = 0;
        int8_t sc[16];
        q3_row_scales(b + i, k, sc);
        for (int s = 0; s < 16; s++) {
            int32_t dot = 0;
            for (int l = 0; l < 16; l++) dot += x8_q3(b + i, k, 16 * s + l) * a[i].qs[16 * s + l];
            isum += sc[s] * dot;
            corr += sc[s] * a[i].bsums[s];
        }
        acc = fmaf(kv_h2f_table[b[i].d[k]] * a[i].d, (float)(isum - 4 * corr), acc);
    }
    return acc;
}

#define K23X8_GENERIC(name, blk_t, row_fn)                                                 \
    KV_GEMV_DECL(name) {                                                                   \
        for (int64_t r = r0; r < r1; r += 8) {                                             \
            const blk_t *b = (const blk_t *)(w + r * row_bytes);                           \
            for (int64_t j = 0; j < n; j++) {                                              \
                const kv_act256 *a = (const kv_act256 *)((const char *)xq + j * xstride);  \
                for (int k = 0; k < 8; k++) y[j * ystride + r + k] = row_fn(b, cols / 256, k, a); \
            }                                                                              \
        }                                                                                  \
    }

K23X8_GENERIC(kv_gemv_q2_kx8_generic, kv_blk_q2_kx8, q2x8_row)
K23X8_GENERIC(kv_gemv_q3_kx8_generic, kv_blk_q3_kx8, q3x8_row)

/* ---------------- AVX2 ---------------- */

#ifdef KV_HAVE_AVX2_BUILD
#include "qk_avx2.h"

/* in-lane byte shuffle pattern: dword k of the register takes bytes (b0 + k, b1 + k, b2 + k,
 * b3 + k) of the 16 scale bytes of a sub-block pair; a negative b gives a zero byte. A
 * constant expression, so the compiler keeps it in a register or loads it as one. */
#define K23_B(b, k) ((b) < 0 ? 0x80u : (unsigned)((b) + (k)))
#define K23_DW(b0, b1, b2, b3, k) \
    (int)(K23_B(b0, k) | K23_B(b1, k) << 8 | K23_B(b2, k) << 16 | K23_B(b3, k) << 24)
#define lane_pattern(b0, b1, b2, b3)                                                       \
    _mm256_setr_epi32(K23_DW(b0, b1, b2, b3, 0), K23_DW(b0, b1, b2, b3, 1),               \
                      K23_DW(b0, b1, b2, b3, 2), K23_DW(b0, b1, b2, b3, 3),               \
                      K23_DW(b0, b1, b2, b3, 4), K23_DW(b0, b1, b2, b3, 5),               \
                      K23_DW(b0, b1, b2, b3, 6), K23_DW(b0, b1, b2, b3, 7))

/* the four chunks of a sub-block (4 values per row lane each): its two low bits */
KV_INL void low_bits(const uint8_t *qs, __m256i q[4]) {
    const __m256i m3 = _mm256_set1_epi8(3), v = _mm256_loadu_si256((const __m256i *)qs);
    q[0] = _mm256_and_si256(v, m3);
    q[1] = _mm256_and_si256(_mm256_srli_epi16(v, 2), m3);
    q[2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m3);
    q[3] = _mm256_and_si256(_mm256_srli_epi16(v, 6), m3);
}

/* sub-block pair t's 8 chunks of 8 rows (chunk c of sub-block 2t + h into q[4h + c]),
 * values 0..7, from its three vectors (16-bit shifts: the masks drop what crosses a byte) */
KV_INL void q3_chunks(const uint8_t v[3][32], __m256i q[8]) {
    const __m256i m7 = _mm256_set1_epi8(7), m3 = _mm256_set1_epi8(3), b4 = _mm256_set1_epi8(4);
    const __m256i a = load256(v[0]), b = load256(v[1]), c = load256(v[2]);
    q[0] = _mm256_and_si256(a, m7);
    q[1] = _mm256_and_si256(_mm256_srli_epi16(a, 3), m7);
    q[2] = _mm256_and_si256(b, m7);
    q[3] = _mm256_and_si256(_mm256_srli_epi16(b, 3), m7);
    q[4] = _mm256_and_si256(c, m7);
    q[5] = _mm256_and_si256(_mm256_srli_epi16(c, 3), m7);
    q[6] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 6), m3),
                           _mm256_and_si256(_mm256_srli_epi16(c, 4), b4));
    q[7] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 6), m3),
                           _mm256_and_si256(_mm256_srli_epi16(c, 5), b4));
}

#define K23X8_ACT(xq, xs, j, i) ((const kv_act256 *)((xq) + (j) * (xs)) + (i))

/* super-block b's 16 scales of its 8 rows, as kv_q3_k_scales gives them: with L0, L1, H the
 * packed bytes 0-3, 4-7 and 8-11 ([j][k], 32 B each, 4 sub-blocks x 8 rows in the order
 * kv_q3_scales wants them), sub-blocks 0-3 and 4-7 take the low nibbles of L0 and L1, 8-11 and
 * 12-15 their high ones, with bits 0-1, 2-3, 4-5, 6-7 of H as bits 4-5 (16-bit shifts: the
 * masks drop what crosses a byte); 3 loads and 19 operations for the 8 rows */
KV_INL const kv_q3_scales *q3_unpack_scales(const kv_blk_q3_kx8 *b, kv_q3_scales *u) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30);
    const __m256i m32 = _mm256_set1_epi8(32);
    const __m256i L0 = load256(b->scales[0]), L1 = load256(b->scales[4]), H = load256(b->scales[8]);
    const __m256i lo[4] = {L0, L1, _mm256_srli_epi16(L0, 4), _mm256_srli_epi16(L1, 4)};
    const __m256i hi[4] = {_mm256_slli_epi16(H, 4), _mm256_slli_epi16(H, 2), H,
                           _mm256_srli_epi16(H, 2)};
    for (int q = 0; q < 4; q++)
        _mm256_storeu_si256((__m256i *)u->sc[4 * q],
                            _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(lo[q], m4),
                                                            _mm256_and_si256(hi[q], hi2)), m32));
    return u;
}

/* isum[j] += scale . (sum over sub-block s of q * x_j), for nx x rows, by maddubs: the int16
 * sums of four chunks stay below 4 * 2 * 7 * 128; scale is an int16 pair per row */
KV_INL void sub_dot_avx2(const __m256i q[4], const char *xq, int64_t xs, int64_t i, int s,
                         __m256i scale, const int nx, __m256i *isum) {
    for (int j = 0; j < nx; j++) {
        const int8_t *x = K23X8_ACT(xq, xs, j, i)->qs + 16 * s;
        __m256i p = _mm256_maddubs_epi16(q[0], bcast4(x));
        for (int c = 1; c < 4; c++) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(q[c], bcast4(x + 4 * c)));
        isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(p, scale));
    }
}

/* sum_t pair_t . (x_j's 16-sums 2t, 2t+1): the mins (Q2_K) or scales (Q3_K) of each
 * sub-block pair as int16 pairs */
KV_INL __m256i pair_sums(const __m256i pairs[8], const kv_act256 *a) {
    __m256i sum = _mm256_madd_epi16(pairs[0], bcast4(a->bsums));
    for (int t = 1; t < 8; t++) sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs[t], bcast4(a->bsums + 2 * t)));
    return sum;
}

/* The scale of sub-block 2t + h of 8 rows as each path's dot takes it. Q2_K's is the low
 * nibble of its byte: here (byte, byte) & 0xF as an int16 pair, picked from the pair's 16
 * bytes scw. Q3_K's int8 goes into the high byte of each int16 (sc * 256, sign kept with no
 * extension step); a super-block's sums stay below 16 * 16 * 7 * 128 * 32 * 256 < 2^31 and
 * are shifted back exactly by q3_isum_avx2. */
KV_INL __m256i q2_scale_avx2(__m256i scw, const uint8_t *sc, const int h) {
    (void)sc;
    const __m256i pat = h ? lane_pattern(8, -1, 8, -1) : lane_pattern(0, -1, 0, -1);
    return _mm256_and_si256(_mm256_shuffle_epi8(scw, pat), _mm256_set1_epi16(0xF));
}

KV_INL __m256i q3_scale_avx2(__m256i scw, const int8_t *sc, const int h) {
    (void)sc;
    return _mm256_shuffle_epi8(scw, h ? lane_pattern(-1, 8, -1, 8) : lane_pattern(-1, 0, -1, 0));
}

KV_INL __m256i q3_isum_avx2(__m256i isum) { return _mm256_srai_epi32(isum, 8); }

/* sub-block pair t's 16 scale bytes in both lanes, with super-block `ahead` (two on)
 * prefetched: the hardware prefetcher alone leaves DRAM idle */
KV_INL __m256i k23_scw(const void *ahead, const void *sc, const int t) {
    _mm_prefetch((const char *)ahead + 128 * t, _MM_HINT_T0);
    _mm_prefetch((const char *)ahead + 128 * t + 64, _MM_HINT_T0);
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)sc));
}

/* Q2_Kx8, one group against nx x rows: a min pair (m_2t, m_2t+1) is the high nibbles of the
 * sub-block pair's bytes; scale_of and dot are the path's */
#define KV_Q2X8_TILE(name, tgt, scale_of, dot)                                                  \
    static inline __attribute__((always_inline)) tgt void name(                                \
        const kv_blk_q2_kx8 *b, int64_t nb, const char *xq, int64_t xs, const int nx,          \
        float *y, int64_t ys) {                                                                 \
        const __m256i pat_m = lane_pattern(0, -1, 8, -1);                                       \
        __m256 acc[KV_GROUP_NX];                                                                \
        for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();                              \
        for (int64_t i = 0; i < nb; i++) {                                                      \
            __m256i isum[KV_GROUP_NX], mins[8];                                                 \
            for (int j = 0; j < nx; j++) isum[j] = _mm256_setzero_si256();                      \
            for (int t = 0; t < 8; t++) {                                                       \
                const __m256i scw = k23_scw(b + i + 2, b[i].sc[2 * t], t);                      \
                mins[t] = _mm256_srli_epi16(_mm256_shuffle_epi8(scw, pat_m), 4);                \
                for (int h = 0; h < 2; h++) {                                                   \
                    __m256i q[4];                                                               \
                    low_bits(b[i].qs[2 * t + h], q);                                            \
                    dot(q, xq, xs, i, 2 * t + h, scale_of(scw, b[i].sc[2 * t + h], h), nx,      \
                        isum);                                                                  \
                }                                                                               \
            }                                                                                   \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].d));        \
            const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].dmin));     \
            for (int j = 0; j < nx; j++) {                                                      \
                const kv_act256 *a = K23X8_ACT(xq, xs, j, i);                                   \
                const __m256 dx = _mm256_set1_ps(a->d);                                         \
                acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum[j]),    \
                                         acc[j]);                                               \
                acc[j] = _mm256_fnmadd_ps(_mm256_mul_ps(mw, dx),                                \
                                          _mm256_cvtepi32_ps(pair_sums(mins, a)), acc[j]);      \
            }                                                                                   \
        }                                                                                       \
        for (int j = 0; j < nx; j++) _mm256_storeu_ps(y + j * ys, acc[j]);                     \
    }

/* Q3_Kx8, one group against nx x rows: the values' -4 is taken back once per super-block as
 * 4 * the scale pairs (sign-extended to int16) times x's 16-sums; norm() undoes the path's
 * scaling of isum */
#define KV_Q3X8_TILE(name, tgt, scale_of, dot, norm)                                            \
    static inline __attribute__((always_inline)) tgt void name(                                \
        const kv_blk_q3_kx8 *b, int64_t nb, const char *xq, int64_t xs, const int nx,          \
        float *y, int64_t ys) {                                                                 \
        const __m256i pat_pair = lane_pattern(-1, 0, -1, 8);                                    \
        __m256 acc[KV_GROUP_NX];                                                                \
        for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();                              \
        for (int64_t i = 0; i < nb; i++) {                                                      \
            __m256i isum[KV_GROUP_NX], pairs[8];                                                \
            for (int j = 0; j < nx; j++) isum[j] = _mm256_setzero_si256();                      \
            kv_q3_scales u;                                                                     \
            q3_unpack_scales(b + i, &u);                                                        \
            for (int t = 0; t < 8; t++) {                                                       \
                const __m256i scw = k23_scw(b + i + 2, u.sc[2 * t], t);                         \
                pairs[t] = _mm256_srai_epi16(_mm256_shuffle_epi8(scw, pat_pair), 8);            \
                __m256i q[8];                                                                   \
                q3_chunks(b[i].q3[t], q);                                                       \
                for (int h = 0; h < 2; h++)                                                     \
                    dot(q + 4 * h, xq, xs, i, 2 * t + h, scale_of(scw, u.sc[2 * t + h], h), nx, \
                        isum);                                                                  \
            }                                                                                   \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].d));        \
            for (int j = 0; j < nx; j++) {                                                      \
                const kv_act256 *a = K23X8_ACT(xq, xs, j, i);                                   \
                const __m256i total =                                                           \
                    _mm256_sub_epi32(norm(isum[j]), _mm256_slli_epi32(pair_sums(pairs, a), 2)); \
                acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a->d)),               \
                                         _mm256_cvtepi32_ps(total), acc[j]);                    \
            }                                                                                   \
        }                                                                                       \
        for (int j = 0; j < nx; j++) _mm256_storeu_ps(y + j * ys, acc[j]);                     \
    }

KV_Q2X8_TILE(tile_q2x8, KV_TGT, q2_scale_avx2, sub_dot_avx2)
KV_Q3X8_TILE(tile_q3x8, KV_TGT, q3_scale_avx2, sub_dot_avx2, q3_isum_avx2)

/* ---------------- AVX512-VNNI ----------------
 * The values (Q2_K 0..3, Q3_K 0..7) go into vpdpbusd unsigned against x, so a sub-block's
 * four chunks sum in int32 with no int16 step; that sum is scaled in int32 by the row's
 * sub-block scale. The integers per super-block are the AVX2 kernels' (isum, msum; Q3_K's
 * isum - 4 * corr), so are the bits. */
#define KV_TGT_V __attribute__((target(KV_ISA_VNNI)))
#define KV_INL_V static inline __attribute__((always_inline)) KV_TGT_V

/* isum[j] += sc * (sum over sub-block s of q * x_j), for nx x rows; sc is int32 per row */
KV_INL_V void sub_dot_vnni(const __m256i q[4], const char *xq, int64_t xs, int64_t i, int s,
                           __m256i sc, const int nx, __m256i *isum) {
    for (int j = 0; j < nx; j++) {
        const int8_t *x = K23X8_ACT(xq, xs, j, i)->qs + 16 * s;
        __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q[0], bcast4(x));
        for (int c = 1; c < 4; c++) p = _mm256_dpbusd_epi32(p, q[c], bcast4(x + 4 * c));
        isum[j] = _mm256_add_epi32(isum[j], _mm256_mullo_epi32(p, sc));
    }
}

KV_INL_V __m256i q2_scale_vnni(__m256i scw, const uint8_t *sc, const int h) {
    (void)scw, (void)h;
    return _mm256_and_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)),
                            _mm256_set1_epi32(0xF));
}

KV_INL_V __m256i q3_scale_vnni(__m256i scw, const int8_t *sc, const int h) {
    (void)scw, (void)h;
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc));
}

KV_INL_V __m256i q3_isum_vnni(__m256i isum) { return isum; }

KV_Q2X8_TILE(tile_q2x8_vnni, KV_TGT_V, q2_scale_vnni, sub_dot_vnni)
KV_Q3X8_TILE(tile_q3x8_vnni, KV_TGT_V, q3_scale_vnni, sub_dot_vnni, q3_isum_vnni)

/* ---------------- AVX512-VNNI, 512 bits (qk_zmm.h), for 2 or more x rows ----------------
 * The values (Q2_K 0..3, Q3_K 0..7) go into vpdpbusd unsigned against x, two chunks per row
 * in a lane pair. Q2_K's chunks are scaled before the products (q2_prescale). For Q3_K a
 * lane's partial over a 16-element sub-block (two chunks, below 8 * 7 * 127) fits int16, so
 * two sub-blocks' partials go as one int16 pair into vpdpwssd against their scales: one
 * multiply for two sub-blocks. The mins (Q2_K) and the -4 (Q3_K)
 * go the same way against x's 16-sums. The integers per super-block are the AVX2 kernels'
 * (isum, msum; Q3_K's isum - 4 * corr), so are the bits. */
#include "qk_zmm.h"

/* lanes (even, odd) = (e, o) */
#define K23_ALT(e, o) _mm512_set1_epi64((int64_t)((uint64_t)(o) << 32 | (uint32_t)(e)))

/* sub-block s of 8 rows as chunk pairs (0, 1) and (2, 3): the two low bits */
KV_INL_Z void zlow_bits(const uint8_t *qs, __m512i w[2]) {
    const __m512i v = zdup(load256(qs)), m3 = _mm512_set1_epi8(3);
    w[0] = _mm512_and_si512(_mm512_srlv_epi32(v, K23_ALT(0, 2)), m3);
    w[1] = _mm512_and_si512(_mm512_srlv_epi32(v, K23_ALT(4, 6)), m3);
}

/* Q3_K: sub-block pair t's chunk pairs (0, 1), (2, 3) into w0 and (4, 5), (6, 7) into w1, as
 * q3_chunks takes them apart (32-bit shifts: the masks drop what crosses a byte) */
KV_INL_Z void q3_zchunks(const uint8_t v[3][32], __m512i w0[2], __m512i w1[2]) {
    const __m256i a = load256(v[0]), b = load256(v[1]), c = load256(v[2]);
    const __m512i m7 = _mm512_set1_epi8(7), sh = K23_ALT(0, 3), cz = zdup(c);
    w0[0] = _mm512_and_si512(_mm512_srlv_epi32(zdup(a), sh), m7);
    w0[1] = _mm512_and_si512(_mm512_srlv_epi32(zdup(b), sh), m7);
    w1[0] = _mm512_and_si512(_mm512_srlv_epi32(cz, sh), m7);
    w1[1] = _mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi32(zpair(a, b), 6), _mm512_set1_epi8(3)),
        _mm512_and_si512(_mm512_srlv_epi32(cz, K23_ALT(4, 5)), _mm512_set1_epi8(4)));
}

/* isum[j] += sc . (sub-block pair t's partials) for nx x rows: w0, w1 the chunk pairs of
 * sub-blocks 2t and 2t + 1, sc their scales as int16 pairs */
KV_INL_Z void k23_pair_zmm(const __m512i w0[2], const __m512i w1[2], __m512i sc, const char *xq,
                           int64_t xs, int64_t i, int t, const int nx, __m512i *isum) {
    for (int j = 0; j < nx; j++) {
        const int8_t *x = K23X8_ACT(xq, xs, j, i)->qs + 32 * t;
        const __m512i lo = zdot(zdot(_mm512_setzero_si512(), w0[0], x), w0[1], x + 8);
        const __m512i hi = zdot(zdot(_mm512_setzero_si512(), w1[0], x + 16), w1[1], x + 24);
        isum[j] = zscale2(isum[j], lo, hi, sc);
    }
}

/* sub-block pair t: super-block `ahead` (two on) prefetched, the chunk pairs of sub-blocks
 * 2t and 2t + 1 into w0 and w1; returns the pair's 16 scale bytes in both lanes */
KV_INL_Z __m256i k23_pair_bits(const void *ahead, const void *sc, const uint8_t qs[16][32],
                               const int t, __m512i w0[2], __m512i w1[2]) {
    zlow_bits(qs[2 * t], w0);
    zlow_bits(qs[2 * t + 1], w1);
    return k23_scw(ahead, sc, t);
}

/* Q2_K: a value times its 4-bit scale is at most 3 * 15 = 45, so the chunks are scaled before
 * the products (the bytes of each int16 times the scale: no carry between them) and a row's
 * whole super-block goes into one int32 chain: no per-sub-block scaling per x row */
KV_INL_Z void q2_prescale(const uint8_t *sc, __m512i w[2]) {
    const __m256i s = _mm256_and_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)),
                                       _mm256_set1_epi32(0xF));
    const __m512i s16 = zdup(_mm256_or_si256(s, _mm256_slli_epi32(s, 16)));
    w[0] = _mm512_mullo_epi16(w[0], s16);
    w[1] = _mm512_mullo_epi16(w[1], s16);
}

KV_INL_Z void tile_q2x8_zmm(const kv_blk_q2_kx8 *b, int64_t nb, const char *xq, int64_t xs,
                            const int nx, float *y, int64_t ys) {
    const __m256i pat_m = lane_pattern(0, -1, 8, -1);
    __m256 acc[KV_GROUP_NX];
    for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        __m512i isum[KV_GROUP_NX], mw[4];
        __m256i mins[8];
        for (int j = 0; j < nx; j++) isum[j] = _mm512_setzero_si512();
        for (int t = 0; t < 8; t++) {
            __m512i w0[2], w1[2];
            const __m256i scw = k23_pair_bits(b + i + 2, b[i].sc[2 * t], b[i].qs, t, w0, w1);
            mins[t] = _mm256_srli_epi16(_mm256_shuffle_epi8(scw, pat_m), 4);
            q2_prescale(b[i].sc[2 * t], w0);
            q2_prescale(b[i].sc[2 * t + 1], w1);
            for (int j = 0; j < nx; j++) {
                const int8_t *x = K23X8_ACT(xq, xs, j, i)->qs + 32 * t;
                isum[j] = zdot(zdot(zdot(zdot(isum[j], w0[0], x), w0[1], x + 8), w1[0], x + 16),
                               w1[1], x + 24);
            }
        }
        for (int q = 0; q < 4; q++) mw[q] = zpair(mins[2 * q], mins[2 * q + 1]);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].d));
        const __m256 mwf = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].dmin));
        for (int j = 0; j < nx; j++) {
            const kv_act256 *a = K23X8_ACT(xq, xs, j, i);
            const __m256 dx = _mm256_set1_ps(a->d);
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(zfold(isum[j])), acc[j]);
            acc[j] = _mm256_fnmadd_ps(_mm256_mul_ps(mwf, dx),
                                      _mm256_cvtepi32_ps(zfold(zpair_sums(mw, a->bsums))), acc[j]);
        }
    }
    for (int j = 0; j < nx; j++) _mm256_storeu_ps(y + j * ys, acc[j]);
}

KV_INL_Z void tile_q3x8_zmm(const kv_blk_q3_kx8 *b, int64_t nb, const char *xq, int64_t xs,
                            const int nx, float *y, int64_t ys) {
    const __m256i pat_pair = lane_pattern(-1, 0, -1, 8);
    __m256 acc[KV_GROUP_NX];
    for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        __m512i isum[KV_GROUP_NX], cw[4];
        __m256i pairs[8];
        for (int j = 0; j < nx; j++) isum[j] = _mm512_setzero_si512();
        kv_q3_scales u;
        q3_unpack_scales(b + i, &u);
        for (int t = 0; t < 8; t++) {
            __m512i w0[2], w1[2];
            const __m256i scw = k23_scw(b + i + 2, u.sc[2 * t], t);
            q3_zchunks(b[i].q3[t], w0, w1);
            pairs[t] = _mm256_srai_epi16(_mm256_shuffle_epi8(scw, pat_pair), 8);
            const __m512i sc = zdup(pairs[t]);
            k23_pair_zmm(w0, w1, sc, xq, xs, i, t, nx, isum);
        }
        for (int q = 0; q < 4; q++) cw[q] = zpair(pairs[2 * q], pairs[2 * q + 1]);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].d));
        for (int j = 0; j < nx; j++) {
            const kv_act256 *a = K23X8_ACT(xq, xs, j, i);
            const __m256i total = _mm256_sub_epi32(
                zfold(isum[j]), _mm256_slli_epi32(zfold(zpair_sums(cw, a->bsums)), 2));
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a->d)),
                                     _mm256_cvtepi32_ps(total), acc[j]);
        }
    }
    for (int j = 0; j < nx; j++) _mm256_storeu_ps(y + j * ys, acc[j]);
}

/* Q3_Kx8, two groups at once (16 rows, lane r = row r; prefill): a chunk of both groups is
 * one zmm, so a sub-block pair's scales (one vpdpwssd) serve 16 rows and no lanes are folded.
 * The -4 goes into each x row's sum per pair as (-4 sc_2t, -4 sc_2t+1) . (x's 16-sums), the
 * scales times -4 taken once for all x rows. The integer is the one above: the same bits. */
/* sub-block pair t of both groups: chunk c of sub-block 2t + h into q[h][c], the scales as
 * int16 pairs per row (sc) and times -4 (scm4) */
KV_INL_Z void q3x16_pair(const kv_blk_q3_kx8 *A, const kv_blk_q3_kx8 *B, const kv_q3_scales u[2],
                         int t, __m512i q[2][4], __m512i *sc, __m512i *scm4) {
    const __m512i m7 = _mm512_set1_epi8(7), m3 = _mm512_set1_epi8(3), b4 = _mm512_set1_epi8(4);
    const __m512i a = z16_load(A->q3[t][0], B->q3[t][0]), b = z16_load(A->q3[t][1], B->q3[t][1]);
    const __m512i c = z16_load(A->q3[t][2], B->q3[t][2]);  /* as q3_chunks, 16 rows */
    q[0][0] = _mm512_and_si512(a, m7);
    q[0][1] = _mm512_and_si512(_mm512_srli_epi16(a, 3), m7);
    q[0][2] = _mm512_and_si512(b, m7);
    q[0][3] = _mm512_and_si512(_mm512_srli_epi16(b, 3), m7);
    q[1][0] = _mm512_and_si512(c, m7);
    q[1][1] = _mm512_and_si512(_mm512_srli_epi16(c, 3), m7);
    q[1][2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 6), m3),
                              _mm512_and_si512(_mm512_srli_epi16(c, 4), b4));
    q[1][3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 6), m3),
                              _mm512_and_si512(_mm512_srli_epi16(c, 5), b4));
    __m256i half[2];
    for (int g = 0; g < 2; g++) {
        const int8_t(*s8)[8] = u[g].sc;
        half[g] = pack16(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)s8[2 * t])),
                         _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)s8[2 * t + 1])));
    }
    *sc = _mm512_inserti64x4(_mm512_castsi256_si512(half[0]), half[1], 1);
    *scm4 = _mm512_mullo_epi16(*sc, _mm512_set1_epi16(-4));
}

KV_INL_Z void q3x16_sums(const kv_blk_q3_kx8 *A, const kv_blk_q3_kx8 *B, int64_t i,
                        const char *xq, int64_t xs, const int nx, __m512i *isum) {
    kv_q3_scales u[2];
    q3_unpack_scales(A, u), q3_unpack_scales(B, u + 1);
    for (int t = 0; t < 8; t++) {
        z16_prefetch(A + 2, B + 2, 128 * t);
        __m512i q[2][4], sc, scm4;
        q3x16_pair(A, B, u, t, q, &sc, &scm4);
        for (int j = 0; j < nx; j++) {
            const kv_act256 *a = K23X8_ACT(xq, xs, j, i);
            __m512i lo = _mm512_setzero_si512(), hi = lo;
            for (int c = 0; c < 4; c++) {
                int32_t x0, x1;
                memcpy(&x0, a->qs + 32 * t + 4 * c, 4);
                memcpy(&x1, a->qs + 32 * t + 16 + 4 * c, 4);
                lo = _mm512_dpbusd_epi32(lo, q[0][c], _mm512_set1_epi32(x0));
                hi = _mm512_dpbusd_epi32(hi, q[1][c], _mm512_set1_epi32(x1));
            }
            int32_t b2;
            memcpy(&b2, a->bsums + 2 * t, 4);
            isum[j] = _mm512_dpwssd_epi32(zscale2(isum[j], lo, hi, sc), scm4,
                                          _mm512_set1_epi32(b2));
        }
    }
}
KV_ZMM_TILE2(tile2_q3x8_zmm, kv_blk_q3_kx8, q3x16_sums)

/* ---- prefill through byte rows (many x rows) ----
 * A Q2_K value times its scale (0..3 x 0..15) is a byte, and so is 128 - v s for Q3_K's value
 * v = q - 4 (-4..3) times its signed scale (-32..31): v s lies in -124..128. So for many x
 * rows each pair of groups (16 rows) is first turned into such bytes, 64 chunks per
 * super-block (lane r = row r, chunk k = values 4k..4k+3), and a row's super-block is then
 * one chain of 64 vpdpbusd per x row, nothing scaled per sub-block. The sums are the integers
 * of the tiles above (Q3_K: sum(v s x) = 128 sum(x) - sum(byte x)), so the bits are the same.
 * The driver is qk_zmm.h's KV_BYTES_GEMV. On an AMD EPYC (Zen 4), 2 threads, 512 x rows,
 * Q3_K runs at 658 GFLOP/s at 2048 x 8192 and 701 at 16384 x 2048 this way, where the tiles
 * above give 434 and 501 (medians of interleaved calls). */

/* per byte c - q * s (q a byte, s and c per int16 half, every result 0..255) */
KV_INL_Z __m512i bytes_msub(__m512i q, __m512i s16, __m512i c16) {
    const __m512i lo = _mm512_and_si512(q, _mm512_set1_epi16(0xFF)), hi = _mm512_srli_epi16(q, 8);
    const __m512i pl = _mm512_sub_epi16(c16, _mm512_mullo_epi16(lo, s16));
    const __m512i ph = _mm512_sub_epi16(c16, _mm512_mullo_epi16(hi, s16));
    return _mm512_or_si512(pl, _mm512_slli_epi16(ph, 8));
}

/* a sub-block's 16 scale bytes (8 of group A, 8 of B) as int32 lanes */
KV_INL_Z __m512i sc16(const uint8_t *a, const uint8_t *b) {
    const __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
    return _mm512_cvtepu8_epi32(v);
}

KV_INL_Z void q2_bytes_block(const kv_blk_q2_kx8 *A, const kv_blk_q2_kx8 *B, __m512i *out) {
    const __m512i m3 = _mm512_set1_epi8(3), mf = _mm512_set1_epi32(0xF);
    __m512i m[16];
    for (int s = 0; s < 16; s++) {
        const __m512i v = z16_load(A->qs[s], B->qs[s]), sc = sc16(A->sc[s], B->sc[s]);
        const __m512i s16 = zdup16(_mm512_and_si512(sc, mf));
        m[s] = _mm512_srli_epi32(sc, 4);
        for (int c = 0; c < 4; c++)  /* q * s <= 45: no carry between the bytes of an int16 */
            _mm512_store_si512(out + 4 * s + c,
                               _mm512_mullo_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 2 * c), m3), s16));
    }
    for (int q = 0; q < 8; q++)
        _mm512_store_si512(out + 64 + q, _mm512_or_si512(m[2 * q], _mm512_slli_epi32(m[2 * q + 1], 16)));
}

KV_INL_Z void q3_bytes_block(const kv_blk_q3_kx8 *A, const kv_blk_q3_kx8 *B, __m512i *out) {
    kv_q3_scales u[2];
    q3_unpack_scales(A, u), q3_unpack_scales(B, u + 1);
    for (int t = 0; t < 8; t++) {
        __m512i q[2][4], sc, scm4;
        q3x16_pair(A, B, u, t, q, &sc, &scm4);
        for (int h = 0; h < 2; h++) {
            const __m512i s = zdup16(h ? _mm512_srai_epi32(sc, 16)
                                      : _mm512_srai_epi32(_mm512_slli_epi32(sc, 16), 16));
            const __m512i c = _mm512_add_epi16(_mm512_set1_epi16(128), _mm512_slli_epi16(s, 2));
            for (int k = 0; k < 4; k++)
                _mm512_store_si512(out + 8 * t + 4 * h + k, bytes_msub(q[h][k], s, c));
        }
    }
}

/* isum[j] = sum over super-block i of byte * x_j, for nx x rows */
KV_INL_Z void bytes_sums(const __m512i *w, const char *xq, int64_t xs, int64_t i, const int nx,
                         __m512i *isum) {
    for (int j = 0; j < nx; j++) isum[j] = _mm512_setzero_si512();
    for (int k = 0; k < 64; k++) {
        const __m512i wk = _mm512_load_si512(w + k);
        for (int j = 0; j < nx; j++) {
            int32_t v;
            memcpy(&v, K23X8_ACT(xq, xs, j, i)->qs + 4 * k, 4);
            isum[j] = _mm512_dpbusd_epi32(isum[j], wk, _mm512_set1_epi32(v));
        }
    }
}

/* sum of x's 256 values, from its 16-sums */
KV_INL_Z int32_t act_sum(const kv_act256 *a) {
    const __m256i s = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a->bsums), _mm256_set1_epi16(1));
    const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    const __m128i q = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1)));
}

KV_INL_Z void tile_q2_bytes(const kv_bytes *k, int64_t nb, const char *xq, int64_t xs,
                            const int nx, float *y, int64_t ys) {
    const kv_blk_q2_kx8 *A = k->b, *B = A + nb;
    __m512 acc[KV_GROUP_NX];
    for (int j = 0; j < nx; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const __m512i *w = k->w + 72 * i;
        __m512i isum[KV_GROUP_NX];
        bytes_sums(w, xq, xs, i, nx, isum);
        const __m512 dw = z16_scales(A[i].d, B[i].d), mw = z16_scales(A[i].dmin, B[i].dmin);
        for (int j = 0; j < nx; j++) {
            const kv_act256 *a = K23X8_ACT(xq, xs, j, i);
            __m512i msum = _mm512_setzero_si512();  /* sum_s m_s * bsum_s, 16 rows */
            for (int q = 0; q < 8; q++) {
                int32_t b2;
                memcpy(&b2, a->bsums + 2 * q, 4);
                msum = _mm512_dpwssd_epi32(msum, w[64 + q], _mm512_set1_epi32(b2));
            }
            const __m512 dx = _mm512_set1_ps(a->d);
            acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(isum[j]), acc[j]);
            acc[j] = _mm512_fnmadd_ps(_mm512_mul_ps(mw, dx), _mm512_cvtepi32_ps(msum), acc[j]);
        }
    }
    for (int j = 0; j < nx; j++) _mm512_storeu_ps(y + j * ys, acc[j]);
}

KV_INL_Z void tile_q3_bytes(const kv_bytes *k, int64_t nb, const char *xq, int64_t xs,
                            const int nx, float *y, int64_t ys) {
    const kv_blk_q3_kx8 *A = k->b, *B = A + nb;
    __m512 acc[KV_GROUP_NX];
    for (int j = 0; j < nx; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        __m512i isum[KV_GROUP_NX];
        bytes_sums(k->w + 64 * i, xq, xs, i, nx, isum);
        const __m512 dw = z16_scales(A[i].d, B[i].d);
        for (int j = 0; j < nx; j++) {
            const kv_act256 *a = K23X8_ACT(xq, xs, j, i);
            const __m512i total = _mm512_sub_epi32(_mm512_set1_epi32(128 * act_sum(a)), isum[j]);
            acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a->d)),
                                     _mm512_cvtepi32_ps(total), acc[j]);
        }
    }
    for (int j = 0; j < nx; j++) _mm512_storeu_ps(y + j * ys, acc[j]);
}

KV_BYTES_GEMV(gemv_q2x8_bytes, kv_blk_q2_kx8, 72, q2_bytes_block, tile_q2_bytes, tile_q2x8_zmm)
KV_BYTES_GEMV(gemv_q3x8_bytes, kv_blk_q3_kx8, 64, q3_bytes_block, tile_q3_bytes, tile_q3x8_zmm)

KV_GROUP_GEMV(gemv_q2x8_avx2, KV_TGT, tile_q2x8, kv_blk_q2_kx8, 256)
KV_GROUP_GEMV(gemv_q3x8_avx2, KV_TGT, tile_q3x8, kv_blk_q3_kx8, 256)
KV_GROUP_GEMV(gemv_q2x8_vnni, KV_TGT_V, tile_q2x8_vnni, kv_blk_q2_kx8, 256)
KV_GROUP_GEMV(gemv_q2x8_zmm, KV_TGT_Z, tile_q2x8_zmm, kv_blk_q2_kx8, 256)
KV_GROUP_GEMV(gemv_q3x8_vnni, KV_TGT_V, tile_q3x8_vnni, kv_blk_q3_kx8, 256)
KV_GROUP_GEMV2(gemv_q3x8_zmm, KV_TGT_Z, tile_q3x8_zmm, tile2_q3x8_zmm, kv_blk_q3_kx8, 256)

void kv_gemv_q2_kx8_avx2(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                         int64_t cols, const void *xq, int64_t xstride, int64_t n, float *y,
                         int64_t ystride) {
    (!kv_use_vnni()          ? gemv_q2x8_avx2
     : n >= KV_BYTES_MIN_N ? gemv_q2x8_bytes
     : n >= KV_ZMM_MIN_N   ? gemv_q2x8_zmm
                           : gemv_q2x8_vnni)(
        w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);
}

void kv_gemv_q3_kx8_avx2(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                         int64_t cols, const void *xq, int64_t xstride, int64_t n, float *y,
                         int64_t ystride) {
    (!kv_use_vnni()          ? gemv_q3x8_avx2
     : n >= KV_BYTES_MIN_N ? gemv_q3x8_bytes
     : n >= KV_ZMM_MIN_N   ? gemv_q3x8_zmm
                           : gemv_q3x8_vnni)(
        w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);
}
#endif /* KV_HAVE_AVX2_BUILD */
