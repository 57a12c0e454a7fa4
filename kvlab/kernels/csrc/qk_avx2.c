/* AVX2 kernels. Per weight block: unpack to bytes once, then for each of up to four
 * activation rows multiply 32 int8 pairs with maddubs (u8 x s8 -> s16 pairs) and madd
 * (-> s32), and fold the scales in with one fp32 FMA per block (K-quants apply their
 * sub-block scales in the integer domain, as the madd multiplier). The 4/5-bit legacy
 * types go two blocks at a time against kv_act64. With many activation rows (prefill)
 * the 4/5/6-bit types unpack a tile of weight rows once and reuse it for every group
 * of x rows, with each row's arithmetic unchanged. Q8_0 with 8+ x rows takes two weight
 * rows per pass; Q8_0 of any size, and the tiles, use AVX512-VNNI's vpdpbusd / vpdpwssd
 * (ymm) where the CPU has it, the tiles then also two rows per pass: the same int32 sums,
 * so the same results. Dequantizers for the prefill tiles are
 * here too.
 *
 * Compiled with the target attribute, not with -mavx2 for the whole file, so one build
 * runs everywhere; qk_runtime.c picks this table only when the CPU has AVX2, FMA and F16C.
 */
#include "qk.h"

#ifdef KV_HAVE_AVX2_BUILD
#include "qk_avx2.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define KV_NXMAX 4

/* the plain-C dequantizers, built for AVX2: used for F32 and BF16 (and the K-quant
 * scale unpacking); the quantized types have hand-written ones below */
#define KV_FN(name) name##_avx2
#define KV_H2F(h) (_cvtsh_ss(h))
#include "qk_dequant.inc"


/* 8 int32 sums of 4 products each: unsigned a (< 128 or a lone 128) times signed b */
KV_INL __m256i dot_u8s8(__m256i a, __m256i b) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}

#define ACT32(j, i) ((const kv_act32 *)(xq + (j) * xs) + (i))
#define ACT256(j, i) ((const kv_act256 *)(xq + (j) * xs) + (i))

/* ---------------- legacy 32-element blocks ---------------- */

/* Q8_0, two weight rows at once: the 2 x nx tile of (weight row, x row) pairs shares each
 * loaded x block between the rows and each weight block between the x rows. Every pair
 * keeps its own accumulator and exactly the arithmetic of rows_q8_0 (d * a->d rounds the
 * same as the product of the two broadcasts), so a row's output does not depend on the
 * tile it was computed in. Built twice: with maddubs + madd, and with AVX512-VNNI's
 * vpdpbusd on ymm registers, which gives the same int32 sums (maddubs cannot saturate
 * here: |w| <= 128, |x| <= 127) in one instruction instead of two. */
#define KV_TGT_VNNI __attribute__((target(KV_ISA_VNNI)))
#define KV_INL_VNNI static inline __attribute__((always_inline)) KV_TGT_VNNI

KV_INL_VNNI __m256i dot_u8s8_vnni(__m256i a, __m256i b) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
}

#define KV_ROWS2_Q8_0(name, INL, DOT)                                                      \
    INL void name(const uint8_t *w, int64_t row_bytes, int64_t cols, const char *xq,       \
                  int64_t xs, const int nx, float *y, int64_t ys) {                        \
        const kv_blk_q8_0 *b0 = (const kv_blk_q8_0 *)w;                                    \
        const kv_blk_q8_0 *b1 = (const kv_blk_q8_0 *)(w + row_bytes);                      \
        __m256 acc0[KV_NXMAX], acc1[KV_NXMAX];                                             \
        for (int j = 0; j < nx; j++) acc0[j] = acc1[j] = _mm256_setzero_ps();              \
        for (int64_t i = 0; i < cols / 32; i++) {                                          \
            /* two interleaved streams defeat the hardware prefetcher: fetch 4 rows on */  \
            _mm_prefetch((const char *)(b0 + i) + 4 * row_bytes, _MM_HINT_T0);             \
            _mm_prefetch((const char *)(b1 + i) + 4 * row_bytes, _MM_HINT_T0);             \
            const __m256i q0 = load256(b0[i].qs), q1 = load256(b1[i].qs);                  \
            const __m256i qa0 = _mm256_sign_epi8(q0, q0), qa1 = _mm256_sign_epi8(q1, q1);  \
            const __m256 d0 = _mm256_set1_ps(_cvtsh_ss(b0[i].d));                          \
            const __m256 d1 = _mm256_set1_ps(_cvtsh_ss(b1[i].d));                          \
            for (int j = 0; j < nx; j++) {                                                 \
                const kv_act32 *a = ACT32(j, i);                                           \
                const __m256i x = load256(a->qs);                                          \
                const __m256 dx = _mm256_broadcast_ss(&a->d);                              \
                const __m256i p0 = DOT(qa0, _mm256_sign_epi8(x, q0));                      \
                const __m256i p1 = DOT(qa1, _mm256_sign_epi8(x, q1));                      \
                acc0[j] = _mm256_fmadd_ps(_mm256_mul_ps(d0, dx), _mm256_cvtepi32_ps(p0), acc0[j]); \
                acc1[j] = _mm256_fmadd_ps(_mm256_mul_ps(d1, dx), _mm256_cvtepi32_ps(p1), acc1[j]); \
            }                                                                              \
        }                                                                                  \
        for (int j = 0; j < nx; j++) y[j * ys] = hsum_ps(acc0[j]), y[j * ys + 1] = hsum_ps(acc1[j]); \
    }

/* Q8_0, one weight row against nx x rows: signed weights, so the sign moves onto x
 * (maddubs wants one operand unsigned). */
#define KV_ROWS_Q8_0(name, INL, DOT)                                                       \
    INL void name(const uint8_t *w, int64_t cols, const char *xq, int64_t xs, const int nx, \
                  float *y, int64_t ys) {                                                  \
        const kv_blk_q8_0 *b = (const kv_blk_q8_0 *)w;                                     \
        __m256 acc[KV_NXMAX];                                                              \
        for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();                         \
        for (int64_t i = 0; i < cols / 32; i++) {                                          \
            const __m256i q = load256(b[i].qs);                                            \
            const __m256i qa = _mm256_sign_epi8(q, q);                                     \
            const float d = _cvtsh_ss(b[i].d);                                             \
            for (int j = 0; j < nx; j++) {                                                 \
                const kv_act32 *a = ACT32(j, i);                                           \
                const __m256i p = DOT(qa, _mm256_sign_epi8(load256(a->qs), q));            \
                acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * a->d), _mm256_cvtepi32_ps(p), acc[j]); \
            }                                                                              \
        }                                                                                  \
        for (int j = 0; j < nx; j++) y[j * ys] = hsum_ps(acc[j]);                          \
    }

KV_ROWS_Q8_0(rows_q8_0, KV_INL, dot_u8s8)
KV_ROWS_Q8_0(rows_q8_0_vnni, KV_INL_VNNI, dot_u8s8_vnni)
KV_ROWS2_Q8_0(rows2_q8_0, KV_INL, dot_u8s8)
KV_ROWS2_Q8_0(rows2_q8_0_vnni, KV_INL_VNNI, dot_u8s8_vnni)

/* ---------------- 4/5-bit legacy types, two blocks per step (kv_act64) ----------------
 *
 * Two blocks' 16-byte nibble arrays load into one register: its low nibbles are elements
 * 0..15 of both blocks, its high nibbles elements 16..31, matching kv_act64's lo/hi. The
 * weights stay unsigned (0..15 or 0..31); the -8/-16 offset (Q4_0/Q5_0) or the min
 * (Q4_1/Q5_1) is applied through the activation sums in a second accumulator. The lane
 * halves of each register belong to the two blocks, so the scales are [d0 x4, d1 x4]. */

typedef struct {
    int size, qs, qh, has_min;  /* block bytes; offsets of qs and qh (0: none); d (m) lead */
    float offset;               /* subtracted from q: 8, 16, or 0 for the types with a min */
} kv_pair_layout;

#define KV_PAIR_Q4_0 ((kv_pair_layout){18, 2, 0, 0, 8.0f})
#define KV_PAIR_Q4_1 ((kv_pair_layout){20, 4, 0, 1, 0.0f})
#define KV_PAIR_Q5_0 ((kv_pair_layout){22, 6, 2, 0, 16.0f})
#define KV_PAIR_Q5_1 ((kv_pair_layout){24, 8, 4, 1, 0.0f})

KV_INL uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The 5th bits of two blocks -> 0x10 in the bytes of `lo` and `hi` whose bit is set. */
KV_INL void add_fifth_bits(uint32_t h0, uint32_t h1, __m256i *lo, __m256i *hi) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_set_epi32(0, 0, (int)h1, (int)h0));
    /* byte i of lo takes bit i of bytes 0-1 of h0 (lane 0) or of h1 (bytes 4-5, lane 1) */
    const __m256i idx_lo = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0404040404040404LL,
                                              0x0505050505050505LL);
    const __m256i idx_hi = _mm256_setr_epi64x(0x0202020202020202LL, 0x0303030303030303LL,
                                              0x0606060606060606LL, 0x0707070707070707LL);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i x10 = _mm256_set1_epi8(0x10);
    const __m256i blo =
        _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(v, idx_lo), bit), bit);
    const __m256i bhi =
        _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(v, idx_hi), bit), bit);
    *lo = _mm256_or_si256(*lo, _mm256_and_si256(blo, x10));
    *hi = _mm256_or_si256(*hi, _mm256_and_si256(bhi, x10));
}

/* fp16 words [a0, b0, a1, b1] (two u32) -> a as [a0 x4, a1 x4], b likewise */
KV_INL void scales_pair(uint32_t w0, uint32_t w1, __m256 *a, __m256 *b) {
    const __m256 f = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_set_epi32(0, 0, (int)w1, (int)w0)));
    *a = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
    *b = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));
}

/* 4/5-bit legacy pair unpacked: nibbles (plus fifth bits) of both blocks, and their scales
 * (d, and m or d again); a missing second block gets zero scales. pair_step and the prefill
 * tiles build it before their loops over x rows. */
typedef struct { __m256i lo, hi; __m256 dw, mw; } kv_upair;

KV_INL void unpack_pair(const uint8_t *b0, const kv_pair_layout L, const int pair, kv_upair *u) {
    const uint8_t *b1 = b0 + L.size;
    const __m128i q0 = _mm_loadu_si128((const __m128i *)(b0 + L.qs));
    const __m256i v = pair ? _mm256_inserti128_si256(
                                 _mm256_castsi128_si256(q0),
                                 _mm_loadu_si128((const __m128i *)(b1 + L.qs)), 1)
                           : _mm256_inserti128_si256(_mm256_setzero_si256(), q0, 0);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (L.qh) add_fifth_bits(load_u32(b0 + L.qh), pair ? load_u32(b1 + L.qh) : 0, &lo, &hi);
    const uint32_t w0 = L.has_min ? load_u32(b0) : (uint32_t)(b0[0] | b0[1] << 8);
    const uint32_t w1 = !pair ? 0 : L.has_min ? load_u32(b1) : (uint32_t)(b1[0] | b1[1] << 8);
    __m256 dw, mw;
    scales_pair(w0, w1, &dw, &mw);
    if (!L.has_min) mw = dw;
    u->lo = lo, u->hi = hi, u->dw = dw, u->mw = mw;
}

/* Blocks b0 and (when `pair`) the next one, against nx activation rows (pair index p). */
KV_INL void pair_step(const uint8_t *b0, const kv_pair_layout L, const int pair,
                      const char *xq, int64_t xs, int64_t p, const int nx,
                      __m256 *acc, __m256 *acc2) {
    kv_upair u;
    unpack_pair(b0, L, pair, &u);
    const __m256i lo = u.lo, hi = u.hi;
    const __m256 dw = u.dw, mw = u.mw;
    for (int j = 0; j < nx; j++) {
        const kv_act64 *a = (const kv_act64 *)(xq + j * xs) + p;
        const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, load256(a->lo)),
                                             _mm256_maddubs_epi16(hi, load256(a->hi)));
        const __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
        acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(a->d)),
                                 _mm256_cvtepi32_ps(s32), acc[j]);
        acc2[j] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(a->s), acc2[j]);
    }
}

KV_INL void rows_pairs(const uint8_t *w, int64_t cols, const char *xq, int64_t xs, const int nx,
                       float *y, int64_t ys, const kv_pair_layout L) {
    __m256 acc[KV_NXMAX], acc2[KV_NXMAX];
    for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps(), acc2[j] = _mm256_setzero_ps();
    const int64_t nb = cols / 32;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) pair_step(w + i * L.size, L, 1, xq, xs, i / 2, nx, acc, acc2);
    if (i < nb) pair_step(w + i * L.size, L, 0, xq, xs, i / 2, nx, acc, acc2);
    /* acc2 = sum of d_w (or m_w) * d_x * sum(q_x): the offset's or the min's share */
    const float k2 = L.has_min ? 1.0f : -L.offset;
    for (int j = 0; j < nx; j++) y[j * ys] = hsum_ps(acc[j]) + k2 * hsum_ps(acc2[j]);
}

#define KV_PAIR_ROWS(name, layout)                                                      \
    KV_INL void name(const uint8_t *w, int64_t cols, const char *xq, int64_t xs,        \
                     const int nx, float *y, int64_t ys) {                              \
        rows_pairs(w, cols, xq, xs, nx, y, ys, layout);                                 \
    }

KV_PAIR_ROWS(rows_q4_0, KV_PAIR_Q4_0)
KV_PAIR_ROWS(rows_q4_1, KV_PAIR_Q4_1)
KV_PAIR_ROWS(rows_q5_0, KV_PAIR_Q5_0)
KV_PAIR_ROWS(rows_q5_1, KV_PAIR_Q5_1)

/* ---------------- K-quants: 256-element super-blocks ---------------- */

/* The 12 packed bytes -> 8 six-bit scales and 8 mins, each as 8 int16 in a 128-bit lane. */
KV_INL void scales_mins_k4(const uint8_t *s, __m128i *sc, __m128i *mn) {
    uint32_t u[3];
    memcpy(u, s, 12);
    const uint32_t sc_lo = u[0] & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (u[2] & 0x0F0F0F0Fu) | ((u[0] >> 2) & 0x30303030u);
    const uint32_t mn_lo = u[1] & 0x3F3F3F3Fu;
    const uint32_t mn_hi = ((u[2] >> 4) & 0x0F0F0F0Fu) | ((u[1] >> 2) & 0x30303030u);
    *sc = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)sc_hi, (int)sc_lo));
    *mn = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)mn_hi, (int)mn_lo));
}

/* int16 element k of a 128-bit lane, broadcast (both lanes hold the same 8 values) */
KV_INL __m256i bcast16(__m256i v, int k) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)((2 * k) | ((2 * k + 1) << 8))));
}

/* group k (0..3) of a Q4_K / Q5_K super-block: the nibbles of its 64 elements as two
 * registers (elements 0..31 and 32..63 of the group), the fifth bits (Q5_K: with_qh) taken
 * from *qh, which shifts on */
KV_INL void k4_group(const uint8_t *qs, int k, __m256i *qh, const int with_qh, __m256i *lo,
                     __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i q = load256(qs + 32 * k);
    *lo = _mm256_and_si256(q, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if (with_qh) {
        *lo = _mm256_or_si256(*lo, _mm256_slli_epi16(_mm256_and_si256(*qh, one), 4));
        *qh = _mm256_srli_epi16(*qh, 1);
        *hi = _mm256_or_si256(*hi, _mm256_slli_epi16(_mm256_and_si256(*qh, one), 4));
        *qh = _mm256_srli_epi16(*qh, 1);
    }
}

/* a super-block's qs, its fifth bits (zero for Q4_K), its 6-bit scales (int16, both lanes)
 * and its mins (int16 pairs, as madd takes them against the 16 bsums) */
KV_INL const uint8_t *k4_head(const uint8_t *blk, const int with_qh, __m256i *qh, __m256i *scv,
                              __m256i *mins) {
    const kv_blk_q4_k *h4 = (const kv_blk_q4_k *)blk;  /* d, dmin, scales: same offsets */
    *qh = with_qh ? load256(((const kv_blk_q5_k *)blk)->qh) : _mm256_setzero_si256();
    __m128i sc8, mn8;
    scales_mins_k4(h4->scales, &sc8, &mn8);
    *scv = _mm256_broadcastsi128_si256(sc8);
    *mins = _mm256_set_m128i(_mm_unpackhi_epi16(mn8, mn8), _mm_unpacklo_epi16(mn8, mn8));
    return with_qh ? ((const kv_blk_q5_k *)blk)->qs : h4->qs;
}

/* Q4_K and Q5_K share everything but the 5th bit: with_qh selects Q5_K. */
KV_INL void rows_k4(const uint8_t *w, int64_t cols, const char *xq, int64_t xs, const int nx,
                    float *y, int64_t ys, const int with_qh) {
    const int64_t bsize = with_qh ? (int64_t)sizeof(kv_blk_q5_k) : (int64_t)sizeof(kv_blk_q4_k);
    __m256 acc[KV_NXMAX];
    for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < cols / 256; i++) {
        const uint8_t *blk = w + i * bsize;
        __m256i qh, scv, mins;
        const uint8_t *qs = k4_head(blk, with_qh, &qh, &scv, &mins);
        __m256i sumi[KV_NXMAX];
        for (int j = 0; j < nx; j++) sumi[j] = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {
            __m256i lo, hi;
            k4_group(qs, k, &qh, with_qh, &lo, &hi);
            const __m256i s_lo = bcast16(scv, 2 * k), s_hi = bcast16(scv, 2 * k + 1);
            for (int j = 0; j < nx; j++) {
                const int8_t *x = ACT256(j, i)->qs + 64 * k;
                const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load256(x)), s_lo);
                const __m256i ph =
                    _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load256(x + 32)), s_hi);
                sumi[j] = _mm256_add_epi32(sumi[j], _mm256_add_epi32(pl, ph));
            }
        }
        const kv_blk_q4_k *h4 = (const kv_blk_q4_k *)blk;
        const float d = _cvtsh_ss(h4->d), dmin = _cvtsh_ss(h4->dmin);
        for (int j = 0; j < nx; j++) {
            const kv_act256 *a = ACT256(j, i);
            const __m256i pm = _mm256_madd_epi16(load256(a->bsums), mins);
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * a->d), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
            acc[j] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * a->d), _mm256_cvtepi32_ps(pm), acc[j]);
        }
    }
    for (int j = 0; j < nx; j++) y[j * ys] = hsum_ps(acc[j]);
}

KV_INL void rows_q4_k(const uint8_t *w, int64_t cols, const char *xq, int64_t xs, const int nx,
                      float *y, int64_t ys) {
    rows_k4(w, cols, xq, xs, nx, y, ys, 0);
}

KV_INL void rows_q5_k(const uint8_t *w, int64_t cols, const char *xq, int64_t xs, const int nx,
                      float *y, int64_t ys) {
    rows_k4(w, cols, xq, xs, nx, y, ys, 1);
}

/* Q6_K: q in [0, 63] with value (q - 32) * d * scale16. The -32 is applied once per
 * super-block through the activation's 16-element sums. */
/* half h (128 elements) of a Q6_K block: four registers of 32 values in [0, 63] (groups
 * 4h..4h+3 of 32), low nibbles from ql, the two high bits from qh */
KV_INL void q6_half(const kv_blk_q6_k *b, int h, __m256i q[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    const __m256i m30 = _mm256_set1_epi8(0x30);
    const __m256i ql0 = load256(b->ql + 64 * h), ql1 = load256(b->ql + 64 * h + 32);
    const __m256i qh = load256(b->qh + 32 * h);
    q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4),
                           _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                           _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                           _mm256_and_si256(qh, m30));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
}

KV_INL void rows_q6_k(const uint8_t *w, int64_t cols, const char *xq, int64_t xs, const int nx,
                      float *y, int64_t ys) {
    const kv_blk_q6_k *b = (const kv_blk_q6_k *)w;
    /* low lane takes int16 0 of each dword, high lane int16 1 */
    const __m256i split = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                           2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    __m256 acc[KV_NXMAX];
    for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < cols / 256; i++) {
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b[i].scales));
        __m256i sumi[KV_NXMAX];
        for (int j = 0; j < nx; j++)  /* start from -32 * sum(scale * bsum) */
            sumi[j] = _mm256_sub_epi32(
                _mm256_setzero_si256(),
                _mm256_slli_epi32(_mm256_madd_epi16(load256(ACT256(j, i)->bsums), sc16), 5));
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q6_half(b + i, h, q);
            for (int s = 0; s < 4; s++) {
                const int g = 4 * h + s;  /* 32-element group: scales 2g (low lane), 2g+1 */
                const __m256i scale = _mm256_shuffle_epi8(
                    _mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(g)), split);
                for (int j = 0; j < nx; j++) {
                    const __m256i x = load256(ACT256(j, i)->qs + 32 * g);
                    sumi[j] = _mm256_add_epi32(
                        sumi[j], _mm256_madd_epi16(_mm256_maddubs_epi16(q[s], x), scale));
                }
            }
        }
        const float d = _cvtsh_ss(b[i].d);
        for (int j = 0; j < nx; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * ACT256(j, i)->d),
                                     _mm256_cvtepi32_ps(sumi[j]), acc[j]);
    }
    for (int j = 0; j < nx; j++) y[j * ys] = hsum_ps(acc[j]);
}

/* ---------------- float weights against fp32 activations ---------------- */

KV_INL __m256 load8_f32(const uint8_t *w, int64_t i) { return _mm256_loadu_ps((const float *)w + i); }

KV_INL __m256 load8_f16(const uint8_t *w, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const kv_half *)w + i)));
}

KV_INL __m256 load8_bf16(const uint8_t *w, int64_t i) {
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

KV_INL float scalar_f32(const uint8_t *w, int64_t i) { return ((const float *)w)[i]; }
KV_INL float scalar_f16(const uint8_t *w, int64_t i) { return _cvtsh_ss(((const kv_half *)w)[i]); }
KV_INL float scalar_bf16(const uint8_t *w, int64_t i) {
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#define KV_FLOAT_KERNEL(name, LOAD8, SCALAR)                                            \
    KV_INL void name(const uint8_t *w, int64_t cols, const char *xq, int64_t xs,        \
                     const int nx, float *y, int64_t ys) {                              \
        __m256 acc[KV_NXMAX];                                                           \
        for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();                      \
        int64_t i = 0;                                                                  \
        for (; i + 8 <= cols; i += 8) {                                                 \
            const __m256 wv = LOAD8(w, i);                                              \
            for (int j = 0; j < nx; j++)                                                \
                acc[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps((const float *)(xq + j * xs) + i), \
                                         acc[j]);                                       \
        }                                                                               \
        for (int j = 0; j < nx; j++) {                                                  \
            float s = hsum_ps(acc[j]);                                                  \
            for (int64_t t = i; t < cols; t++)                                          \
                s += SCALAR(w, t) * ((const float *)(xq + j * xs))[t];                  \
            y[j * ys] = s;                                                              \
        }                                                                               \
    }

KV_FLOAT_KERNEL(rows_f32, load8_f32, scalar_f32)
KV_FLOAT_KERNEL(rows_f16, load8_f16, scalar_f16)
KV_FLOAT_KERNEL(rows_bf16, load8_bf16, scalar_bf16)

/* ---------------- row-range drivers: 4 activation rows per pass over a weight row ------- */

#define KV_GEMV_AVX2(name, rows_fn) KV_GEMV_TGT(name, rows_fn, KV_TGT)
#define KV_GEMV_TGT(name, rows_fn, TGT)                                                  \
    static TGT void name(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,   \
                            int64_t cols, const void *xq, int64_t xstride, int64_t n,      \
                            float *y, int64_t ystride) {                                   \
        const char *x = (const char *)xq;                                                  \
        for (int64_t r = r0; r < r1; r++) {                                                \
            const uint8_t *wr = w + r * row_bytes;                                         \
            int64_t j = 0;                                                                 \
            for (; j + 4 <= n; j += 4)                                                     \
                rows_fn(wr, cols, x + j * xstride, xstride, 4, y + j * ystride + r, ystride); \
            switch (n - j) {                                                               \
                case 3: rows_fn(wr, cols, x + j * xstride, xstride, 3, y + j * ystride + r, \
                                ystride); break;                                           \
                case 2: rows_fn(wr, cols, x + j * xstride, xstride, 2, y + j * ystride + r, \
                                ystride); break;                                           \
                case 1: rows_fn(wr, cols, x + j * xstride, xstride, 1, y + j * ystride + r, \
                                ystride); break;                                           \
                default: break;                                                            \
            }                                                                              \
        }                                                                                  \
    }

KV_GEMV_AVX2(gemv1_q8_0_avx2, rows_q8_0)
KV_GEMV_TGT(gemv1_q8_0_vnni, rows_q8_0_vnni, KV_TGT_VNNI)

/* Q8_0 with two or more x rows: pairs of weight rows (rows2), then the odd one */
#define KV_GEMV2_Q8_0(name, TGT, rows2, gemv1)                                                    \
    static TGT void name(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,      \
                         int64_t cols, const void *xq, int64_t xstride, int64_t n,         \
                         float *y, int64_t ystride) {                                      \
        const char *x = (const char *)xq;                                                  \
        int64_t r = r0;                                                                    \
        for (; n >= 2 && r + 2 <= r1; r += 2) {                                            \
            const uint8_t *wr = w + r * row_bytes;                                         \
            for (int64_t j = 0; j < n; j += 4) {                                           \
                const char *xj = x + j * xstride;                                          \
                float *yj = y + j * ystride + r;                                           \
                switch (n - j >= 4 ? 4 : n - j) {                                          \
                    case 4: rows2(wr, row_bytes, cols, xj, xstride, 4, yj, ystride); break; \
                    case 3: rows2(wr, row_bytes, cols, xj, xstride, 3, yj, ystride); break; \
                    case 2: rows2(wr, row_bytes, cols, xj, xstride, 2, yj, ystride); break; \
                    default: rows2(wr, row_bytes, cols, xj, xstride, 1, yj, ystride); break; \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        gemv1(w, row_bytes, r, r1, cols, xq, xstride, n, y, ystride);                      \
    }

KV_GEMV2_Q8_0(gemv2_q8_0_avx2, KV_TGT, rows2_q8_0, gemv1_q8_0_avx2)
KV_GEMV2_Q8_0(gemv2_q8_0_vnni, KV_TGT_VNNI, rows2_q8_0_vnni, gemv1_q8_0_vnni)

/* Q8_0, VNNI only: a 4 x nx tile (weight rows x x rows; 16 accumulators fit in AVX512VL's
 * 32 ymm registers). vpdpbusd wants one operand unsigned, so x moves up by 128 (x ^ 0x80)
 * and the accumulator starts at -128 * (sum of each lane's 4 weights), computed once per
 * weight block: per lane sum (x + 128) * q - 128 * sum q = sum x * q, exactly the int32
 * that the sign trick of rows_q8_0 gives, with one instruction per pair instead of two.
 * The float steps per pair are those of rows2_q8_0, so the bits are the same. */
KV_INL_VNNI void rows4_q8_0_vnni(const uint8_t *w, int64_t row_bytes, int64_t cols,
                                 const char *xq, int64_t xs, const int nx, float *y,
                                 int64_t ys) {
    const kv_blk_q8_0 *b[4];
    for (int k = 0; k < 4; k++) b[k] = (const kv_blk_q8_0 *)(w + k * row_bytes);
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    __m256 acc[4][KV_NXMAX];
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < nx; j++) acc[k][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < cols / 32; i++) {
        __m256i q[4], neg[4];
        __m256 d[4];
        for (int k = 0; k < 4; k++) {
            /* four interleaved streams defeat the hardware prefetcher: fetch 4 rows on */
            _mm_prefetch((const char *)(b[k] + i) + 4 * row_bytes, _MM_HINT_T0);
            q[k] = load256(b[k][i].qs);
            neg[k] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                      _mm256_dpbusd_epi32(_mm256_setzero_si256(), bias, q[k]));
            d[k] = _mm256_set1_ps(_cvtsh_ss(b[k][i].d));
        }
        for (int j = 0; j < nx; j++) {
            const kv_act32 *a = ACT32(j, i);
            const __m256i xu = _mm256_xor_si256(load256(a->qs), bias);
            const __m256 dx = _mm256_broadcast_ss(&a->d);
            for (int k = 0; k < 4; k++) {
                const __m256i p = _mm256_dpbusd_epi32(neg[k], xu, q[k]);
                acc[k][j] = _mm256_fmadd_ps(_mm256_mul_ps(d[k], dx), _mm256_cvtepi32_ps(p),
                                            acc[k][j]);
            }
        }
    }
    for (int j = 0; j < nx; j++)
        for (int k = 0; k < 4; k++) y[j * ys + k] = hsum_ps(acc[k][j]);
}

/* Q8_0 with 8+ x rows on VNNI: quads of weight rows, then the pair / lone row left over */
static KV_TGT_VNNI void gemv4_q8_0_vnni(const uint8_t *w, int64_t row_bytes, int64_t r0,
                                        int64_t r1, int64_t cols, const void *xq,
                                        int64_t xstride, int64_t n, float *y,
                                        int64_t ystride) {
    const char *x = (const char *)xq;
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        const uint8_t *wr = w + r * row_bytes;
        for (int64_t j = 0; j < n; j += 4) {
            const char *xj = x + j * xstride;
            float *yj = y + j * ystride + r;
            switch (n - j >= 4 ? 4 : n - j) {
                case 4: rows4_q8_0_vnni(wr, row_bytes, cols, xj, xstride, 4, yj, ystride); break;
                case 3: rows4_q8_0_vnni(wr, row_bytes, cols, xj, xstride, 3, yj, ystride); break;
                case 2: rows4_q8_0_vnni(wr, row_bytes, cols, xj, xstride, 2, yj, ystride); break;
                default: rows4_q8_0_vnni(wr, row_bytes, cols, xj, xstride, 1, yj, ystride); break;
            }
        }
    }
    gemv2_q8_0_vnni(w, row_bytes, r, r1, cols, xq, xstride, n, y, ystride);
}

/* AVX512-VNNI with VL and BW on this CPU, unless KVLAB_NO_VNNI=1 forces the maddubs path and
 * the 256-bit prefill attention (tests run both); the answer is the same either way */
int kv_use_vnni(void) {
    static int vnni = -1;  /* racy first call: every thread computes the same answer */
    if (vnni < 0)
#ifdef KV_EMULATE_512
        vnni = !getenv("KVLAB_NO_VNNI");
#else
        vnni = !getenv("KVLAB_NO_VNNI") && __builtin_cpu_supports("avx512vnni") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
#endif
    return vnni;
}

#ifndef KV_Q8_PAIR_MIN_N
#define KV_Q8_PAIR_MIN_N 8
#endif
static KV_TGT void gemv_q8_0(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                             int64_t cols, const void *xq, int64_t xstride, int64_t n,
                             float *y, int64_t ystride) {
    const int vnni = kv_use_vnni();
    const int two = n >= KV_Q8_PAIR_MIN_N;
    /* VNNI, one to seven x rows: pairs of weight rows give two independent FMA chains per x
     * row and share each x load (about 7 % faster than single rows at n = 1; same bits) */
    (vnni ? two ? gemv4_q8_0_vnni : gemv2_q8_0_vnni : two ? gemv2_q8_0_avx2 : gemv1_q8_0_avx2)(
        w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);
}

KV_GEMV_AVX2(gemv_q4_0, rows_q4_0)
KV_GEMV_AVX2(gemv_q5_0, rows_q5_0)
KV_GEMV_AVX2(gemv_q4_1, rows_q4_1)
KV_GEMV_AVX2(gemv_q5_1, rows_q5_1)
KV_GEMV_AVX2(gemv_q4_k, rows_q4_k)
KV_GEMV_AVX2(gemv_q5_k, rows_q5_k)
KV_GEMV_AVX2(gemv_q6_k, rows_q6_k)
KV_GEMV_AVX2(gemv_f32, rows_f32)
KV_GEMV_AVX2(gemv_f16, rows_f16)
KV_GEMV_AVX2(gemv_bf16, rows_bf16)

/* ---------------- prefill: weight rows unpacked once, then run against every x row -------
 *
 * For many activation rows the kernels above would unpack each weight block once per group
 * of four x rows. Here a tile of weight rows is unpacked once into a buffer (the same
 * registers the kernels above build: bytes, scales, mins) and each group of four x rows
 * runs over the tile. Per x row the arithmetic and its order are exactly those of the
 * kernels above, so a row's output does not depend on n or on the other rows. */

#define KV_TILE_MIN_N 8        /* fewer x rows: the per-group kernels above */
#define KV_TILE_BYTES 32768    /* unpacked weights per tile (rows of it, 1 to 16) */

KV_INL void unpack_pairs_row(const uint8_t *w, int64_t cols, kv_upair *u, const kv_pair_layout L) {
    const int64_t nb = cols / 32;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) unpack_pair(w + i * L.size, L, 1, u + i / 2);
    if (i < nb) unpack_pair(w + i * L.size, L, 0, u + i / 2);
}

/* The tiles' dot kernels take nw (1 or 2) unpacked weight rows, un blocks apart, against nx
 * x rows: each loaded x block serves both weight rows. Every (weight row, x row) pair keeps
 * its own accumulators and the one-row arithmetic, so its output does not depend on nw.
 * Each is built twice, differing only in how the int32 sums are formed: maddubs + madd, or
 * AVX512-VNNI's vpdpbusd / vpdpwssd (ymm). No int16 step saturates (weights <= 63, |x| <=
 * 127: a maddubs pair is at most 16002), and int32 adds are exact modulo 2^32 in any order,
 * so both give the same integers. With AVX512VL there are 32 ymm registers for the 2 x 4
 * accumulators. */
KV_INL __m256i pair_sum(__m256i lo, __m256i xlo, __m256i hi, __m256i xhi) {
    const __m256i s16 =
        _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
}
KV_INL_VNNI __m256i pair_sum_vnni(__m256i lo, __m256i xlo, __m256i hi, __m256i xhi) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xlo), hi, xhi);
}
/* acc + the 16-bit-scaled sums of q * x (K-quant sub-block scales) */
KV_INL __m256i scaled_acc(__m256i acc, __m256i q, __m256i x, __m256i scale) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), scale));
}
KV_INL_VNNI __m256i scaled_acc_vnni(__m256i acc, __m256i q, __m256i x, __m256i scale) {
    return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(q, x), scale);
}

#define KV_DOT_PAIRS(name, INL, SUM)                                                       \
    INL void name(const kv_upair *u, int64_t un, int64_t cols, const char *xq, int64_t xs, \
                  const int nx, const int nw, float *y, int64_t ys, const kv_pair_layout L) { \
        __m256 acc[2][KV_NXMAX], acc2[2][KV_NXMAX];                                        \
        for (int k = 0; k < nw; k++)                                                       \
            for (int j = 0; j < nx; j++) acc[k][j] = acc2[k][j] = _mm256_setzero_ps();     \
        const int64_t np = (cols / 32 + 1) / 2;                                            \
        for (int64_t p = 0; p < np; p++) {                                                 \
            for (int j = 0; j < nx; j++) {                                                 \
                const kv_act64 *a = (const kv_act64 *)(xq + j * xs) + p;                   \
                const __m256i xlo = load256(a->lo), xhi = load256(a->hi);                  \
                const __m256 ad = _mm256_loadu_ps(a->d), as = _mm256_loadu_ps(a->s);       \
                for (int k = 0; k < nw; k++) {                                             \
                    const kv_upair *v = u + k * un + p;                                    \
                    const __m256i s32 = SUM(v->lo, xlo, v->hi, xhi);                       \
                    acc[k][j] = _mm256_fmadd_ps(_mm256_mul_ps(v->dw, ad),                  \
                                                _mm256_cvtepi32_ps(s32), acc[k][j]);       \
                    acc2[k][j] = _mm256_fmadd_ps(v->mw, as, acc2[k][j]);                   \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        const float k2 = L.has_min ? 1.0f : -L.offset;                                     \
        for (int j = 0; j < nx; j++)                                                       \
            for (int k = 0; k < nw; k++)                                                   \
                y[j * ys + k] = hsum_ps(acc[k][j]) + k2 * hsum_ps(acc2[k][j]);             \
    }

KV_DOT_PAIRS(dot_pairs, KV_INL, pair_sum)
KV_DOT_PAIRS(dot_pairs_vnni, KV_INL_VNNI, pair_sum_vnni)

/* Q4_K / Q5_K super-block: the eight 32-byte unpacked groups, scales, mins, d, dmin */
typedef struct { __m256i q[8]; __m256i scv, mins; float d, dmin; } kv_uk4;

KV_INL void unpack_k4_row(const uint8_t *w, int64_t cols, kv_uk4 *u, const int with_qh) {
    const int64_t bsize = with_qh ? (int64_t)sizeof(kv_blk_q5_k) : (int64_t)sizeof(kv_blk_q4_k);
    for (int64_t i = 0; i < cols / 256; i++) {
        const uint8_t *blk = w + i * bsize;
        __m256i qh;
        const uint8_t *qs = k4_head(blk, with_qh, &qh, &u[i].scv, &u[i].mins);
        for (int k = 0; k < 4; k++) k4_group(qs, k, &qh, with_qh, &u[i].q[2 * k], &u[i].q[2 * k + 1]);
        const kv_blk_q4_k *h4 = (const kv_blk_q4_k *)blk;
        u[i].d = _cvtsh_ss(h4->d), u[i].dmin = _cvtsh_ss(h4->dmin);
    }
}

#define KV_DOT_K4(name, INL, SACC)                                                         \
    INL void name(const kv_uk4 *u, int64_t un, int64_t cols, const char *xq, int64_t xs,   \
                  const int nx, const int nw, float *y, int64_t ys) {                      \
        __m256 acc[2][KV_NXMAX];                                                           \
        for (int k = 0; k < nw; k++)                                                       \
            for (int j = 0; j < nx; j++) acc[k][j] = _mm256_setzero_ps();                  \
        for (int64_t i = 0; i < cols / 256; i++) {                                         \
            __m256i sumi[2][KV_NXMAX];                                                     \
            for (int k = 0; k < nw; k++)                                                   \
                for (int j = 0; j < nx; j++) sumi[k][j] = _mm256_setzero_si256();          \
            for (int g = 0; g < 4; g++) {                                                  \
                __m256i s_lo[2], s_hi[2];                                                  \
                for (int k = 0; k < nw; k++)                                               \
                    s_lo[k] = bcast16(u[k * un + i].scv, 2 * g),                           \
                    s_hi[k] = bcast16(u[k * un + i].scv, 2 * g + 1);                       \
                for (int j = 0; j < nx; j++) {                                             \
                    const int8_t *x = ACT256(j, i)->qs + 64 * g;                           \
                    const __m256i xl = load256(x), xh = load256(x + 32);                   \
                    for (int k = 0; k < nw; k++) {                                         \
                        const kv_uk4 *v = u + k * un + i;                                  \
                        sumi[k][j] = SACC(sumi[k][j], v->q[2 * g], xl, s_lo[k]);           \
                        sumi[k][j] = SACC(sumi[k][j], v->q[2 * g + 1], xh, s_hi[k]);       \
                    }                                                                      \
                }                                                                          \
            }                                                                              \
            for (int j = 0; j < nx; j++) {                                                 \
                const kv_act256 *a = ACT256(j, i);                                         \
                const __m256i bs = load256(a->bsums);                                      \
                for (int k = 0; k < nw; k++) {                                             \
                    const kv_uk4 *v = u + k * un + i;                                      \
                    const __m256i pm = _mm256_madd_epi16(bs, v->mins);                     \
                    acc[k][j] = _mm256_fmadd_ps(_mm256_set1_ps(v->d * a->d),               \
                                                _mm256_cvtepi32_ps(sumi[k][j]), acc[k][j]); \
                    acc[k][j] = _mm256_fnmadd_ps(_mm256_set1_ps(v->dmin * a->d),           \
                                                 _mm256_cvtepi32_ps(pm), acc[k][j]);       \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        for (int j = 0; j < nx; j++)                                                       \
            for (int k = 0; k < nw; k++) y[j * ys + k] = hsum_ps(acc[k][j]);               \
    }

KV_DOT_K4(dot_k4, KV_INL, scaled_acc)
KV_DOT_K4(dot_k4_vnni, KV_INL_VNNI, scaled_acc_vnni)

/* Q6_K super-block: the eight 32-byte groups (q in [0, 63]), the 16 scales as int16, d */
typedef struct { __m256i q[8]; __m256i sc16; float d; } kv_uq6;

KV_INL void unpack_q6_k_row(const uint8_t *w, int64_t cols, kv_uq6 *u) {
    const kv_blk_q6_k *b = (const kv_blk_q6_k *)w;
    for (int64_t i = 0; i < cols / 256; i++) {
        u[i].sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b[i].scales));
        for (int h = 0; h < 2; h++) q6_half(b + i, h, u[i].q + 4 * h);
        u[i].d = _cvtsh_ss(b[i].d);
    }
}

#define KV_DOT_Q6_K(name, INL, SACC)                                                       \
    INL void name(const kv_uq6 *u, int64_t un, int64_t cols, const char *xq, int64_t xs,   \
                  const int nx, const int nw, float *y, int64_t ys) {                      \
        const __m256i split = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, \
                                               2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3); \
        __m256 acc[2][KV_NXMAX];                                                           \
        for (int k = 0; k < nw; k++)                                                       \
            for (int j = 0; j < nx; j++) acc[k][j] = _mm256_setzero_ps();                  \
        for (int64_t i = 0; i < cols / 256; i++) {                                         \
            __m256i sumi[2][KV_NXMAX];                                                     \
            for (int j = 0; j < nx; j++) {                                                 \
                const __m256i bs = load256(ACT256(j, i)->bsums);                           \
                for (int k = 0; k < nw; k++)                                               \
                    sumi[k][j] = _mm256_sub_epi32(                                         \
                        _mm256_setzero_si256(),                                            \
                        _mm256_slli_epi32(_mm256_madd_epi16(bs, u[k * un + i].sc16), 5));  \
            }                                                                              \
            for (int g = 0; g < 8; g++) {                                                  \
                __m256i scale[2];                                                          \
                for (int k = 0; k < nw; k++)                                               \
                    scale[k] = _mm256_shuffle_epi8(                                        \
                        _mm256_permutevar8x32_epi32(u[k * un + i].sc16, _mm256_set1_epi32(g)), \
                        split);                                                            \
                for (int j = 0; j < nx; j++) {                                             \
                    const __m256i x = load256(ACT256(j, i)->qs + 32 * g);                  \
                    for (int k = 0; k < nw; k++)                                           \
                        sumi[k][j] = SACC(sumi[k][j], u[k * un + i].q[g], x, scale[k]);    \
                }                                                                          \
            }                                                                              \
            for (int j = 0; j < nx; j++)                                                   \
                for (int k = 0; k < nw; k++)                                               \
                    acc[k][j] = _mm256_fmadd_ps(_mm256_set1_ps(u[k * un + i].d * ACT256(j, i)->d), \
                                                _mm256_cvtepi32_ps(sumi[k][j]), acc[k][j]); \
        }                                                                                  \
        for (int j = 0; j < nx; j++)                                                       \
            for (int k = 0; k < nw; k++) y[j * ys + k] = hsum_ps(acc[k][j]);               \
    }

KV_DOT_Q6_K(dot_q6_k, KV_INL, scaled_acc)
KV_DOT_Q6_K(dot_q6_k_vnni, KV_INL_VNNI, scaled_acc_vnni)

/* unpacked blocks per weight row */
KV_INL int64_t upairs_per_row(int64_t cols) { return (cols / 32 + 1) / 2; }
KV_INL int64_t usuper_per_row(int64_t cols) { return cols / 256; }

#define KV_UNPACK_Q4_0(w, cols, u) unpack_pairs_row(w, cols, u, KV_PAIR_Q4_0)
#define KV_UNPACK_Q4_1(w, cols, u) unpack_pairs_row(w, cols, u, KV_PAIR_Q4_1)
#define KV_UNPACK_Q5_0(w, cols, u) unpack_pairs_row(w, cols, u, KV_PAIR_Q5_0)
#define KV_UNPACK_Q5_1(w, cols, u) unpack_pairs_row(w, cols, u, KV_PAIR_Q5_1)
#define KV_UNPACK_Q4_K(w, cols, u) unpack_k4_row(w, cols, u, 0)
#define KV_UNPACK_Q5_K(w, cols, u) unpack_k4_row(w, cols, u, 1)
#define KV_UNPACK_Q6_K(w, cols, u) unpack_q6_k_row(w, cols, u)
/* DOT(suffix) names the dot kernel, with the layout argument for the legacy types */
#define KV_DOT_Q4_0(sfx) dot_pairs##sfx, KV_PAIR_Q4_0
#define KV_DOT_Q4_1(sfx) dot_pairs##sfx, KV_PAIR_Q4_1
#define KV_DOT_Q5_0(sfx) dot_pairs##sfx, KV_PAIR_Q5_0
#define KV_DOT_Q5_1(sfx) dot_pairs##sfx, KV_PAIR_Q5_1
#define KV_DOT_K4X(sfx) dot_k4##sfx
#define KV_DOT_Q6_KX(sfx) dot_q6_k##sfx
#define KV_CALL_PAIRS(fn, L, u, un, c, x, xs, nx, nw, y, ys) fn(u, un, c, x, xs, nx, nw, y, ys, L)
#define KV_CALL_SUPER(fn, u, un, c, x, xs, nx, nw, y, ys) fn(u, un, c, x, xs, nx, nw, y, ys)
#define KV_CALL(CALL, ...) CALL(__VA_ARGS__)

/* one group of up to four x rows against nw (1 or 2) tile rows, nx a constant per case */
#define KV_TILE_GROUP(CALL, u, un, xj, xs, left, nw, yj, ys, ...)                         \
    switch (left >= 4 ? 4 : left) {                                                        \
        case 4: KV_CALL(CALL, __VA_ARGS__, u, un, cols, xj, xs, 4, nw, yj, ys); break;      \
        case 3: KV_CALL(CALL, __VA_ARGS__, u, un, cols, xj, xs, 3, nw, yj, ys); break;      \
        case 2: KV_CALL(CALL, __VA_ARGS__, u, un, cols, xj, xs, 2, nw, yj, ys); break;      \
        default: KV_CALL(CALL, __VA_ARGS__, u, un, cols, xj, xs, 1, nw, yj, ys); break;     \
    }

/* Rows [r0, r1) in tiles: unpack the tile's rows once, then every group of four x rows
 * runs over all of them (the group's x blocks stay in L1 across the tile), NW (1 or 2) tile
 * rows per pass and a last odd one alone. */
#define KV_TILED_AVX2(name, TGT, NW, small, utype, per_row, UNPACK, CALL, ...)            \
    static TGT void name(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,      \
                         int64_t cols, const void *xq, int64_t xstride, int64_t n,         \
                         float *y, int64_t ystride) {                                      \
        const int64_t nu = per_row(cols), ubytes = nu * (int64_t)sizeof(utype);            \
        int64_t tr = ubytes > 0 ? KV_TILE_BYTES / ubytes : 16;                             \
        tr = tr < 1 ? 1 : tr > 16 ? 16 : tr;                                               \
        tr = tr < r1 - r0 ? tr : r1 - r0;                                                  \
        utype *buf = n < KV_TILE_MIN_N || nu == 0 || tr < 1 ? NULL                         \
                     : (utype *)aligned_alloc(32, (size_t)(tr * ubytes));                  \
        if (!buf) {                                                                        \
            small(w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);                 \
            return;                                                                        \
        }                                                                                  \
        const char *x = (const char *)xq;                                                  \
        for (int64_t r = r0; r < r1; r += tr) {                                            \
            const int64_t nt = r1 - r < tr ? r1 - r : tr;                                  \
            for (int64_t t = 0; t < nt; t++) UNPACK(w + (r + t) * row_bytes, cols, buf + t * nu); \
            for (int64_t j = 0; j < n; j += 4) {                                           \
                const char *xj = x + j * xstride;                                          \
                float *yj = y + j * ystride + r;                                           \
                const int64_t left = n - j;                                                \
                int64_t t = 0;                                                             \
                for (; NW == 2 && t + 2 <= nt; t += 2)                                     \
                    KV_TILE_GROUP(CALL, buf + t * nu, nu, xj, xstride, left, 2, yj + t,    \
                                  ystride, __VA_ARGS__)                                    \
                for (; t < nt; t++)                                                        \
                    KV_TILE_GROUP(CALL, buf + t * nu, nu, xj, xstride, left, 1, yj + t,    \
                                  ystride, __VA_ARGS__)                                    \
            }                                                                              \
        }                                                                                  \
        free(buf);                                                                         \
    }

/* each type twice, and a dispatcher that picks one per call: the VNNI build takes two tile
 * rows per pass (AVX512VL's 32 ymm registers hold the 2 x 4 accumulators); the maddubs build
 * takes one, since with 16 registers the 2 x 4 tile spills and runs slower */
#define KV_TILED_BOTH(name, small, utype, per_row, UNPACK, CALL, DOT)                      \
    KV_TILED_AVX2(name##_avx2, KV_TGT, 1, small, utype, per_row, UNPACK, CALL, DOT(/**/))  \
    KV_TILED_AVX2(name##_vnni, KV_TGT_VNNI, 2, small, utype, per_row, UNPACK, CALL, DOT(_vnni)) \
    static KV_TGT void name(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,   \
                            int64_t cols, const void *xq, int64_t xstride, int64_t n,      \
                            float *y, int64_t ystride) {                                   \
        (kv_use_vnni() ? name##_vnni : name##_avx2)(w, row_bytes, r0, r1, cols, xq, xstride, n, \
                                                 y, ystride);                              \
    }

KV_TILED_BOTH(tiled_q4_0, gemv_q4_0, kv_upair, upairs_per_row, KV_UNPACK_Q4_0,
              KV_CALL_PAIRS, KV_DOT_Q4_0)
KV_TILED_BOTH(tiled_q4_1, gemv_q4_1, kv_upair, upairs_per_row, KV_UNPACK_Q4_1,
              KV_CALL_PAIRS, KV_DOT_Q4_1)
KV_TILED_BOTH(tiled_q5_0, gemv_q5_0, kv_upair, upairs_per_row, KV_UNPACK_Q5_0,
              KV_CALL_PAIRS, KV_DOT_Q5_0)
KV_TILED_BOTH(tiled_q5_1, gemv_q5_1, kv_upair, upairs_per_row, KV_UNPACK_Q5_1,
              KV_CALL_PAIRS, KV_DOT_Q5_1)
KV_TILED_BOTH(tiled_q4_k, gemv_q4_k, kv_uk4, usuper_per_row, KV_UNPACK_Q4_K,
              KV_CALL_SUPER, KV_DOT_K4X)
KV_TILED_BOTH(tiled_q5_k, gemv_q5_k, kv_uk4, usuper_per_row, KV_UNPACK_Q5_K,
              KV_CALL_SUPER, KV_DOT_K4X)
KV_TILED_BOTH(tiled_q6_k, gemv_q6_k, kv_uq6, usuper_per_row, KV_UNPACK_Q6_K,
              KV_CALL_SUPER, KV_DOT_Q6_KX)


/* ---------------- AVX2 dequantizers (prefill tiles, dequantize, embedding rows) ----------
 * Same arithmetic as qk_dequant.inc, element by element: one fp32 multiply (and an add or
 * subtract for the min) in the same order, so the results stay bit-identical to gguf. */

enum { KV_NOMIN = 0, KV_ADDMIN = 1, KV_SUBMIN = 2 };

/* 16 int8 in q -> out[0..15] = d * q (+ m or - m) */
KV_INL void store16(float *out, __m128i q, __m256 d, __m256 m, const int mode) {
    for (int h = 0; h < 2; h++, q = _mm_srli_si128(q, 8)) {
        __m256 v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        if (mode == KV_ADDMIN) v = _mm256_add_ps(v, m);
        if (mode == KV_SUBMIN) v = _mm256_sub_ps(v, m);
        _mm256_storeu_ps(out + 8 * h, v);
    }
}

KV_INL void store32(float *out, __m256i q, __m256 d, __m256 m, const int mode) {
    store16(out, _mm256_castsi256_si128(q), d, m, mode);
    store16(out + 16, _mm256_extracti128_si256(q, 1), d, m, mode);
}

/* 16 packed bytes -> 32 nibbles in element order: low nibbles 0..15, high ones 16..31 */
KV_INL __m256i nibbles16(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

/* bit i of the 4 bytes at p -> 0x10 in byte i */
KV_INL __m256i fifth_bits32(const uint8_t *p) {
    const __m256i which = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                             0x0303030303030303LL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)load_u32(p)), which);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(0x10));
}

static KV_TGT void deq_q8_0_v(const uint8_t *w, int64_t cols, float *out) {
    const kv_blk_q8_0 *b = (const kv_blk_q8_0 *)w;
    for (int64_t i = 0; i < cols / 32; i++, out += 32)
        store32(out, load256(b[i].qs), _mm256_set1_ps(_cvtsh_ss(b[i].d)), _mm256_setzero_ps(),
                KV_NOMIN);
}

static KV_TGT void deq_q4_0_v(const uint8_t *w, int64_t cols, float *out) {
    const kv_blk_q4_0 *b = (const kv_blk_q4_0 *)w;
    for (int64_t i = 0; i < cols / 32; i++, out += 32)
        store32(out, _mm256_sub_epi8(nibbles16(b[i].qs), _mm256_set1_epi8(8)),
                _mm256_set1_ps(_cvtsh_ss(b[i].d)), _mm256_setzero_ps(), KV_NOMIN);
}

static KV_TGT void deq_q4_1_v(const uint8_t *w, int64_t cols, float *out) {
    const kv_blk_q4_1 *b = (const kv_blk_q4_1 *)w;
    for (int64_t i = 0; i < cols / 32; i++, out += 32)
        store32(out, nibbles16(b[i].qs), _mm256_set1_ps(_cvtsh_ss(b[i].d)),
                _mm256_set1_ps(_cvtsh_ss(b[i].m)), KV_ADDMIN);
}

static KV_TGT void deq_q5_0_v(const uint8_t *w, int64_t cols, float *out) {
    const kv_blk_q5_0 *b = (const kv_blk_q5_0 *)w;
    for (int64_t i = 0; i < cols / 32; i++, out += 32) {
        const __m256i q = _mm256_or_si256(nibbles16(b[i].qs), fifth_bits32(b[i].qh));
        store32(out, _mm256_sub_epi8(q, _mm256_set1_epi8(16)), _mm256_set1_ps(_cvtsh_ss(b[i].d)),
                _mm256_setzero_ps(), KV_NOMIN);
    }
}

static KV_TGT void deq_q5_1_v(const uint8_t *w, int64_t cols, float *out) {
    const kv_blk_q5_1 *b = (const kv_blk_q5_1 *)w;
    for (int64_t i = 0; i < cols / 32; i++, out += 32)
        store32(out, _mm256_or_si256(nibbles16(b[i].qs), fifth_bits32(b[i].qh)),
                _mm256_set1_ps(_cvtsh_ss(b[i].d)), _mm256_set1_ps(_cvtsh_ss(b[i].m)), KV_ADDMIN);
}

/* Q4_K (with_qh 0) and Q5_K (1): sub-block 2k from the low nibbles, 2k+1 from the high */
KV_INL void deq_k4(const uint8_t *w, int64_t cols, float *out, const int with_qh) {
    const int64_t bsize = with_qh ? (int64_t)sizeof(kv_blk_q5_k) : (int64_t)sizeof(kv_blk_q4_k);
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    for (int64_t i = 0; i < cols / 256; i++) {
        const uint8_t *blk = w + i * bsize;
        const kv_blk_q4_k *h4 = (const kv_blk_q4_k *)blk;
        const uint8_t *qs = with_qh ? ((const kv_blk_q5_k *)blk)->qs : h4->qs;
        __m256i qh = with_qh ? load256(((const kv_blk_q5_k *)blk)->qh) : _mm256_setzero_si256();
        const float d = _cvtsh_ss(h4->d), dmin = _cvtsh_ss(h4->dmin);
        uint8_t sc[8], mn[8];
        kv_scale_min_k4(h4->scales, sc, mn);
        for (int k = 0; k < 4; k++, out += 64) {
            const __m256i q = load256(qs + 32 * k);
            __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if (with_qh) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
                qh = _mm256_srli_epi16(qh, 1);
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
                qh = _mm256_srli_epi16(qh, 1);
            }
            store32(out, lo, _mm256_set1_ps(d * (float)sc[2 * k]),
                    _mm256_set1_ps(dmin * (float)mn[2 * k]), KV_SUBMIN);
            store32(out + 32, hi, _mm256_set1_ps(d * (float)sc[2 * k + 1]),
                    _mm256_set1_ps(dmin * (float)mn[2 * k + 1]), KV_SUBMIN);
        }
    }
}

static KV_TGT void deq_q4_k_v(const uint8_t *w, int64_t cols, float *out) { deq_k4(w, cols, out, 0); }
static KV_TGT void deq_q5_k_v(const uint8_t *w, int64_t cols, float *out) { deq_k4(w, cols, out, 1); }

static KV_TGT void deq_q6_k_v(const uint8_t *w, int64_t cols, float *out) {
    const kv_blk_q6_k *b = (const kv_blk_q6_k *)w;
    const __m256i k32 = _mm256_set1_epi8(32);
    for (int64_t i = 0; i < cols / 256; i++) {
        const float d = _cvtsh_ss(b[i].d);
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q6_half(b + i, h, q);
            for (int s = 0; s < 4; s++, out += 32) {
                const __m256i v = _mm256_sub_epi8(q[s], k32);
                const int8_t *sc = b[i].scales + 8 * h + 2 * s;
                store16(out, _mm256_castsi256_si128(v), _mm256_set1_ps(d * (float)sc[0]),
                        _mm256_setzero_ps(), KV_NOMIN);
                store16(out + 16, _mm256_extracti128_si256(v, 1), _mm256_set1_ps(d * (float)sc[1]),
                        _mm256_setzero_ps(), KV_NOMIN);
            }
        }
    }
}

static KV_TGT void deq_f16_v(const uint8_t *w, int64_t cols, float *out) {
    const kv_half *h = (const kv_half *)w;
    int64_t i = 0;
    for (; i + 8 <= cols; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < cols; i++) out[i] = _cvtsh_ss(h[i]);
}

/* ---------------- activation quantization ---------------- */

/* 32 floats -> 32 int8 (round to nearest) with scale id; returns their sum */
KV_INL int quant32(const float *x, __m256 id, int8_t *out, int *sum_lo16) {
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), id));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), id));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), id));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), id));
    const int lo = hsum_epi32(_mm256_add_epi32(i0, i1));
    const int hi = hsum_epi32(_mm256_add_epi32(i2, i3));
    const __m256i p16a = _mm256_packs_epi32(i0, i1), p16b = _mm256_packs_epi32(i2, i3);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)out, p8);
    if (sum_lo16) *sum_lo16 = lo;
    return lo + hi;
}

/* max |x| over len floats, or NaN if one of them is NaN or infinite: the block's scale
 * then turns the products NaN, as the fp32 product would be */
KV_INL float absmax(const float *x, int64_t len) {
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(3.4028235e38f);
    __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int64_t l = 0; l < len; l += 8) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + l));
        m = _mm256_max_ps(m, a);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));  /* NaN or > FLT_MAX */
    }
    if (_mm256_movemask_ps(bad)) return NAN;
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static KV_TGT void act32_avx2(const float *x, int64_t cols, kv_act32 *out) {
    for (int64_t b = 0; b < cols / 32; b++, x += 32) {
        const float d = absmax(x, 32) / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        const int sum = quant32(x, _mm256_set1_ps(id), out[b].qs, NULL);
        out[b].d = d;
        out[b].s = d * (float)sum;
        out[b].bias = -128 * sum;
    }
}

/* pairs of 32-blocks, see kv_act64; an odd last block pairs with zeros */
static KV_TGT void act64_avx2(const float *x, int64_t cols, kv_act64 *out) {
    const int64_t nb = cols / 32;
    for (int64_t p = 0; p < (nb + 1) / 2; p++) {
        int8_t q[2][32] = {{0}};
        float d[2] = {0.0f, 0.0f}, s[2] = {0.0f, 0.0f};
        for (int k = 0; k < 2 && 2 * p + k < nb; k++) {
            const float *xb = x + (2 * p + k) * 32;
            d[k] = absmax(xb, 32) / 127.0f;
            const float id = d[k] > 0.0f ? 1.0f / d[k] : 0.0f;
            s[k] = d[k] * (float)quant32(xb, _mm256_set1_ps(id), q[k], NULL);
        }
        const __m256i q0 = load256(q[0]), q1 = load256(q[1]);
        _mm256_storeu_si256((__m256i *)out[p].lo, _mm256_permute2x128_si256(q0, q1, 0x20));
        _mm256_storeu_si256((__m256i *)out[p].hi, _mm256_permute2x128_si256(q0, q1, 0x31));
        _mm256_storeu_ps(out[p].d, _mm256_setr_ps(d[0], d[0], d[0], d[0], d[1], d[1], d[1], d[1]));
        _mm256_storeu_ps(out[p].s, _mm256_setr_ps(s[0], 0, 0, 0, s[1], 0, 0, 0));
    }
}

static KV_TGT void act256_avx2(const float *x, int64_t cols, kv_act256 *out) {
    for (int64_t b = 0; b < cols / 256; b++, x += 256) {
        const float d = absmax(x, 256) / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        const __m256 idv = _mm256_set1_ps(id);
        for (int k = 0; k < 8; k++) {
            int lo;
            const int all = quant32(x + 32 * k, idv, out[b].qs + 32 * k, &lo);
            out[b].bsums[2 * k] = (int16_t)lo;
            out[b].bsums[2 * k + 1] = (int16_t)(all - lo);
        }
        out[b].d = d;
    }
}

const kv_isa kv_isa_avx2 = {
    .name = "avx2",
    .gemv = {
        [KV_F32] = gemv_f32, [KV_F16] = gemv_f16, [KV_BF16] = gemv_bf16,
        [KV_Q8_0] = gemv_q8_0, [KV_Q4_0] = tiled_q4_0, [KV_Q4_1] = tiled_q4_1,
        [KV_Q5_0] = tiled_q5_0, [KV_Q5_1] = tiled_q5_1, [KV_Q4_K] = tiled_q4_k,
        [KV_Q5_K] = tiled_q5_k, [KV_Q6_K] = tiled_q6_k, [KV_Q8_0X8] = kv_gemv_q8_0x8_avx2,
        [KV_Q4_KX8] = kv_gemv_q4_kx8_avx2, [KV_Q6_KX8] = kv_gemv_q6_kx8_avx2,
        [KV_Q2_K] = kv_gemv_q2_k_avx2,
        [KV_Q3_K] = kv_gemv_q3_k_avx2,
        [KV_Q2_KX8] = kv_gemv_q2_kx8_avx2,
        [KV_Q3_KX8] = kv_gemv_q3_kx8_avx2,
        [KV_IQ4_NL] = kv_gemv_iq4_nl_avx2,
        [KV_IQ4_XS] = kv_gemv_iq4_xs_avx2,
        [KV_IQ4_XSX8] = kv_gemv_iq4_xsx8_avx2,
        [KV_IQ4_NLX8] = kv_gemv_iq4_nlx8_avx2,
        [KV_Q5_0X8] = kv_gemv_q5_0x8_avx2,
        [KV_Q5_KX8] = kv_gemv_q5_kx8_avx2,
        [KV_MXFP4] = kv_gemv_mxfp4_avx2,
        [KV_MXFP4X8] = kv_gemv_mxfp4x8_avx2,
        [KV_IQ2_XXS] = kv_gemv_iq2_xxs_avx2, [KV_IQ2_XS] = kv_gemv_iq2_xs_avx2,
        [KV_IQ2_S] = kv_gemv_iq2_s_avx2, [KV_IQ3_XXS] = kv_gemv_iq3_xxs_avx2,
        [KV_IQ3_S] = kv_gemv_iq3_s_avx2,
    },
    .deq = {
        [KV_F32] = deq_f32_avx2, [KV_F16] = deq_f16_v, [KV_BF16] = deq_bf16_avx2,
        [KV_Q8_0] = deq_q8_0_v, [KV_Q4_0] = deq_q4_0_v, [KV_Q4_1] = deq_q4_1_v,
        [KV_Q5_0] = deq_q5_0_v, [KV_Q5_1] = deq_q5_1_v, [KV_Q4_K] = deq_q4_k_v,
        [KV_Q5_K] = deq_q5_k_v, [KV_Q6_K] = deq_q6_k_v,
        [KV_Q2_K] = kv_deq_q2_k_avx2,
        [KV_Q3_K] = kv_deq_q3_k_avx2,
        [KV_IQ4_NL] = kv_deq_iq4_nl_avx2,
        [KV_IQ4_XS] = kv_deq_iq4_xs_avx2,
        [KV_MXFP4] = kv_deq_mxfp4_avx2,
        [KV_IQ2_XXS] = kv_deq_iq2_xxs_avx2, [KV_IQ2_XS] = kv_deq_iq2_xs_avx2,
        [KV_IQ2_S] = kv_deq_iq2_s_avx2, [KV_IQ3_XXS] = kv_deq_iq3_xxs_avx2,
        [KV_IQ3_S] = kv_deq_iq3_s_avx2,
    },
    .act_kind = {
        [KV_Q8_0] = KV_ACT_32, [KV_Q8_0X8] = KV_ACT_32, [KV_Q4_KX8] = KV_ACT_256,
        [KV_Q6_KX8] = KV_ACT_256,
        [KV_Q4_0] = KV_ACT_64, [KV_Q4_1] = KV_ACT_64,
        [KV_Q5_0] = KV_ACT_64, [KV_Q5_1] = KV_ACT_64, [KV_Q4_K] = KV_ACT_256,
        [KV_Q5_K] = KV_ACT_256, [KV_Q6_K] = KV_ACT_256,
        [KV_Q2_K] = KV_ACT_256,
        [KV_Q3_K] = KV_ACT_256,
        [KV_Q2_KX8] = KV_ACT_256,
        [KV_Q3_KX8] = KV_ACT_256,
        [KV_IQ4_NL] = KV_ACT_64,
        [KV_IQ4_XS] = KV_ACT_256,
        [KV_IQ4_XSX8] = KV_ACT_256,
        [KV_IQ4_NLX8] = KV_ACT_32,
        [KV_Q5_0X8] = KV_ACT_32,
        [KV_Q5_KX8] = KV_ACT_256,
        [KV_MXFP4] = KV_ACT_64,
        [KV_MXFP4X8] = KV_ACT_32,
        [KV_IQ2_XXS] = KV_ACT_256, [KV_IQ2_XS] = KV_ACT_256, [KV_IQ2_S] = KV_ACT_256,
        [KV_IQ3_XXS] = KV_ACT_256, [KV_IQ3_S] = KV_ACT_256,
    },
    .act32 = act32_avx2,
    .act64 = act64_avx2,
    .act256 = act256_avx2,
};

#endif /* KV_HAVE_AVX2_BUILD */
