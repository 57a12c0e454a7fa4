/* Q5_K in groups of 8 rows ("Q5_Kx8", kvlab's own in-memory layout; see qk_group8_q8_0.c for
 * the idea and qk_group8_q4k_q6k.c for Q4_Kx8, whose fields it keeps): one register lane per
 * weight row, x's 4 bytes broadcast, the sub-block scales and the float steps serving 8 rows
 * at once.
 *
 *   super-block i of rows 8g..8g+7 (1408 B = 8 x 176, Q5_K's own size: a batch-1 decode
 *   reads no more bytes than the file's blocks):
 *     d[8], dmin[8]     fp16, row 8g+k in slot k
 *     scales[12][8]     byte j of row k's 12 packed bytes of 6-bit scales and mins, [j][k],
 *                       as Q4_Kx8 keeps them; the SIMD tiles unpack them for 8 rows at once
 *     q5[4][8][32]      byte 4k + e of q5[p][t]: the value (0..31) of element 4t + e of
 *                       sub-block 2p of row k in bits 0-4, bits 2-4 of sub-block 2p + 1's in
 *                       bits 5-7
 *     w5[4][2][32]      bits 2(t % 4), 2(t % 4) + 1 of byte 4k + e of w5[p][t / 4]: bits 0-1 of
 *                       element 4t + e of sub-block 2p + 1
 *   so chunk t of an even sub-block is one and, of an odd one two shifts (one when t % 4 is
 *   0), two ands and an or (the file's nibbles and bit planes take a shift more for each).
 *   Per row and x row (x in kv_act256 blocks), as exact integers:
 *     isum = sum_s sc_s * (sum over sub-block s of q * x),  msum = sum_s m_s * (x's sum over s)
 *   then acc = fma(d * d_x, isum, acc), acc = fma(-(dmin * d_x), msum, acc) per super-block.
 *
 * Both kernels below (AVX2, portable) do exactly these steps, from acc = 0, for any number
 * of x rows: a row's output does not depend on the batch or the kernel path.
 */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "qk.h"

#define KV_FN(name) name##_group8
#define KV_TGT
#define KV_H2F(h) (kv_h2f_table[h])
#include "qk_dequant.inc"
#undef KV_TGT

typedef struct {
    kv_half d[8], dmin[8];
    uint8_t scales[12][8];
    uint8_t q5[4][8][32];
    uint8_t w5[4][2][32];
} kv_blk_q5_kx8;
_Static_assert(sizeof(kv_blk_q5_kx8) == 8 * sizeof(kv_blk_q5_k), "Q5_Kx8 is Q5_K's size");

int kv_to_q5_kx8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst) {
    if (rows % 8 || cols % 256) return -1;
    const int64_t nb = cols / 256, row_bytes = nb * (int64_t)sizeof(kv_blk_q5_k);
    kv_blk_q5_kx8 *out = (kv_blk_q5_kx8 *)dst;
    memset(dst, 0, (size_t)(rows / 8 * nb) * sizeof *out);  /* bits are or-ed in */
    for (int64_t g = 0; g < rows / 8; g++) {
        for (int64_t i = 0; i < nb; i++, out++) {
            for (int k = 0; k < 8; k++) {
                const kv_blk_q5_k *b = (const kv_blk_q5_k *)(src + (8 * g + k) * row_bytes) + i;
                out->d[k] = b->d, out->dmin[k] = b->dmin;
                for (int j = 0; j < 12; j++) out->scales[j][k] = b->scales[j];
                for (int s = 0; s < 8; s++)
                    for (int l = 0; l < 32; l++) {
                        const int q = (b->qs[32 * (s / 2) + l] >> (4 * (s % 2)) & 0xF) |
                                      (b->qh[l] >> s & 1) << 4;
                        const int byte = 4 * k + l % 4;
                        if (s % 2 == 0) {
                            out->q5[s / 2][l / 4][byte] |= (uint8_t)q;
                        } else {
                            out->q5[s / 2][l / 4][byte] |= (uint8_t)(q >> 2 << 5);
                            out->w5[s / 2][l / 16][byte] |= (uint8_t)((q & 3) << (2 * (l / 4 % 4)));
                        }
                    }
            }
        }
    }
    return 0;
}

/* element l (0..31) of sub-block s of row k, 0..31 */
static inline int q5kx8_value(const kv_blk_q5_kx8 *b, int s, int l, int k) {
    const int byte = 4 * k + l % 4, v = b->q5[s / 2][l / 4][byte];
    if (s % 2 == 0) return v & 31;
    return (v >> 5) << 2 | (b->w5[s / 2][l / 16][byte] >> (2 * (l / 4 % 4)) & 3);
}

/* row r -> fp32, rounded as deq_q5_k rounds */
void kv_deq_q5_kx8_row(const uint8_t *w, int64_t row_bytes, int64_t r, int64_t cols,
                       float *out) {
    const kv_blk_q5_kx8 *b = (const kv_blk_q5_kx8 *)(w + (r / 8) * 8 * row_bytes);
    const int k = (int)(r % 8);
    for (int64_t i = 0; i < cols / 256; i++) {
        const float d = kv_h2f_table[b[i].d[k]], dmin = kv_h2f_table[b[i].dmin[k]];
        uint8_t sc[8], mn[8];
        kv_k8_row_scales(b[i].scales, k, sc, mn);
        for (int s = 0; s < 8; s++, out += 32) {
            const float dl = d * (float)sc[s], ml = dmin * (float)mn[s];
            for (int l = 0; l < 32; l++) out[l] = dl * (float)q5kx8_value(b + i, s, l, k) - ml;
        }
    }
}

/* ---------------- portable kernel (the reference) ---------------- */

static void row_sums(const kv_blk_q5_kx8 *b, int k, const kv_act256 *a, int32_t *isum,
                     int32_t *msum) {
    uint8_t sc[8], mn[8];
    kv_k8_row_scales(b->scales, k, sc, mn);
    *isum = *msum = 0;
    for (int s = 0; s < 8; s++) {
        int32_t dot = 0;
        for (int l = 0; l < 32; l++) dot += q5kx8_value(b, s, l, k) * a->qs[32 * s + l];
        *isum += sc[s] * dot;
        *msum += mn[s] * (a->bsums[2 * s] + a->bsums[2 * s + 1]);
    }
}

KV_KX8_GENERIC(kv_gemv_q5_kx8_generic, kv_blk_q5_kx8, row_sums)

/* ---------------- AVX2 (maddubs) ----------------
 * A maddubs of 4 values 0..31 against x's int8 (-127..127) is at most 2 * 31 * 127 = 7874
 * per int16 pair, so 4 of them (31496 < 2^15) add as int16: a sub-block's 8 chunks go in
 * two halves of 4, each times the scale as an int16 pair in one madd, both into int32.
 * The integers are those of the portable kernel, so are the bits. With AVX512-VNNI a
 * sub-block's 8 chunks go into vpdpbusd as int32 and are scaled once: the same integers. */

#ifdef KV_HAVE_AVX2_BUILD
#include "qk_avx2.h"

/* chunk t of sub-block s, 8 rows, values 0..31 (16-bit shifts: the masks drop what crosses
 * a byte) */
KV_INL __m256i k5_chunk(const kv_blk_q5_kx8 *b, const int s, const int t) {
    const __m256i v = load256(b->q5[s / 2][t]);
    if (s % 2 == 0) return _mm256_and_si256(v, _mm256_set1_epi8(31));
    const int sh = 2 * (t % 4);
    const __m256i w = load256(b->w5[s / 2][t / 4]);
    return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 3), _mm256_set1_epi8(0x1C)),
                           _mm256_and_si256(sh ? _mm256_srli_epi16(w, sh) : w, _mm256_set1_epi8(3)));
}

/* the float steps of super-block i for nx x rows: acc += d * d_x * isum - dmin * d_x * msum */
KV_INL void k5_finish_avx2(const kv_blk_q5_kx8 *b, const kv_k8_scales *u, const char *xq,
                           int64_t xs, const int nx, const __m256i *isum, __m256 *acc) {
    __m256i mdup[8];  /* (m_s, m_s) as int16 pairs */
    for (int s = 0; s < 8; s++) mdup[s] = pairs_u8(u->m[s]);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b->d));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b->dmin));
    for (int j = 0; j < nx; j++) {
        const kv_act256 *a = (const kv_act256 *)(xq + j * xs);
        __m256i msum = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) /* m_s * (bsums[2s] + bsums[2s + 1]) */
            msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mdup[s], bcast4(a->bsums + 2 * s)));
        const __m256 dx = _mm256_set1_ps(a->d);
        acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum[j]), acc[j]);
        acc[j] = _mm256_fnmadd_ps(_mm256_mul_ps(mw, dx), _mm256_cvtepi32_ps(msum), acc[j]);
    }
}

/* half u of sub-block s of one group against up to 8 x rows: each unpacked chunk feeds
 * every row's chain, so the unpacking is shared by 8 maddubs */
KV_INL void k5_sub8_avx2(const kv_blk_q5_kx8 *b, const uint8_t sc8[8], const int s, const int u,
                         const char *xq, int64_t xs, const int nx, __m256i *isum) {
    const int8_t *x = ((const kv_act256 *)xq)->qs + 32 * s;
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0,
            c7 = c0;
#define KV_K5_ROW8(j, cj) \
    if (nx > j) cj = _mm256_add_epi16(cj, _mm256_maddubs_epi16(w, bcast4(x + j * xs + 4 * t)))
    for (int t = 4 * u; t < 4 * u + 4; t++) {
        const __m256i w = k5_chunk(b, s, t);
        KV_K5_ROW8(0, c0); KV_K5_ROW8(1, c1); KV_K5_ROW8(2, c2); KV_K5_ROW8(3, c3);
        KV_K5_ROW8(4, c4); KV_K5_ROW8(5, c5); KV_K5_ROW8(6, c6); KV_K5_ROW8(7, c7);
        __asm__("" : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3), "+x"(c4), "+x"(c5), "+x"(c6), "+x"(c7));
    }
#undef KV_K5_ROW8
    const __m256i sc = pairs_u8(sc8);
    const __m256i cs[8] = {c0, c1, c2, c3, c4, c5, c6, c7};
    for (int j = 0; j < nx; j++) isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(cs[j], sc));
}

/* super-block b's integer sums for nx x rows, by maddubs */
KV_INL void k5_block_avx2(const kv_blk_q5_kx8 *b, const kv_k8_scales *u, const char *xi,
                          int64_t xs, const int nx, __m256i *isum) {
#pragma GCC unroll 16
    for (int h = 0; h < 16; h++) k5_sub8_avx2(b, u->sc[h / 2], h / 2, h % 2, xi, xs, nx, isum);
}

#define KV_TGT_V __attribute__((target(KV_ISA_VNNI)))
#define KV_INL_V static inline __attribute__((always_inline)) KV_TGT_V

/* sub-block s of one group against up to 8 x rows, int32 chains: no halves */
KV_INL_V void k5_sub8_vnni(const kv_blk_q5_kx8 *b, const uint8_t sc8[8], const int s,
                           const char *xq, int64_t xs, const int nx, __m256i *isum) {
    const int8_t *x = ((const kv_act256 *)xq)->qs + 32 * s;
    __m256i c[KV_GROUP_NX];
    for (int j = 0; j < nx; j++) c[j] = _mm256_setzero_si256();
    for (int t = 0; t < 8; t++) {
        const __m256i w = k5_chunk(b, s, t);
        for (int j = 0; j < nx; j++) c[j] = _mm256_dpbusd_epi32(c[j], w, bcast4(x + j * xs + 4 * t));
    }
    const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc8));
    for (int j = 0; j < nx; j++) isum[j] = _mm256_add_epi32(isum[j], _mm256_mullo_epi32(c[j], sc));
}

/* the same sums by vpdpbusd */
KV_INL_V void k5_block_vnni(const kv_blk_q5_kx8 *b, const kv_k8_scales *u, const char *xi,
                            int64_t xs, const int nx, __m256i *isum) {
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) k5_sub8_vnni(b, u->sc[s], s, xi, xs, nx, isum);
}

/* One group against nx x rows. For Q5_K one group and 8 x rows per chunk beat Q4_Kx8's two
 * groups of 4 rows (at 512 x rows, 2048 x 8192: about 110 against 90 GFLOP/s in one thread):
 * the fifth bit's shift, and, or cost more than the broadcasts a pair would share. No
 * software prefetch: a group's super-blocks are one sequential stream, and prefetching
 * super-block i + 2 or i + 6 slows a batch-1 decode from DRAM (10.5 and 11.2 GB/s against
 * 13.0 without, at 8192 x 8192 on an AMD EPYC), the hardware prefetcher being ahead already.
 * block() adds one super-block's integer sums. */
#define KV_K5_TILE(name, tgt, block)                                                          \
    static inline __attribute__((always_inline)) tgt void name(                              \
        const kv_blk_q5_kx8 *b, int64_t nb, const char *xq, int64_t xs, const int nx,        \
        float *y, int64_t ys) {                                                               \
        __m256 acc[KV_GROUP_NX];                                                              \
        for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();                            \
        for (int64_t i = 0; i < nb; i++) {                                                    \
            __m256i isum[KV_GROUP_NX];                                                        \
            for (int j = 0; j < nx; j++) isum[j] = _mm256_setzero_si256();                    \
            const char *xi = xq + i * (int64_t)sizeof(kv_act256);                             \
            kv_k8_scales u;                                                                   \
            k8_unpack_scales(b[i].scales, &u);                                                \
            block(b + i, &u, xi, xs, nx, isum);                                               \
            k5_finish_avx2(b + i, &u, xi, xs, nx, isum, acc);                                 \
        }                                                                                     \
        for (int j = 0; j < nx; j++) _mm256_storeu_ps(y + j * ys, acc[j]);                   \
    }

KV_K5_TILE(tile_k5_avx2, KV_TGT, k5_block_avx2)
KV_K5_TILE(tile_k5_vnni, KV_TGT_V, k5_block_vnni)

/* Q5_Kx8 at 512 bits (qk_zmm.h), for 2 or more x rows: sub-block s's chunk pairs against x's
 * 8-byte pieces, scaled once per sub-block; the mins' sums as int16 pairs */
#include "qk_zmm.h"

KV_INL_Z void k5_sub_zmm(const kv_blk_q5_kx8 *b, const uint8_t sc8[8], const int s,
                         const char *xq, int64_t xs, const int nx, __m512i *isum) {
    const int8_t *x = ((const kv_act256 *)xq)->qs + 32 * s;
    __m512i c[KV_GROUP_NX];
    for (int j = 0; j < nx; j++) c[j] = _mm512_setzero_si512();
    for (int t = 0; t < 8; t += 2) { /* k5_chunk for chunks t and t + 1 at once */
        const __m512i v = zpair_load(b->q5[s / 2][t]);
        __m512i w;
        if (s % 2 == 0) {
            w = _mm512_and_si512(v, _mm512_set1_epi8(31));
        } else {
            const int sh = 2 * (t % 4);
            const __m512i lo2 = _mm512_srlv_epi32(zdup(load256(b->w5[s / 2][t / 4])),
                                                  _mm512_set1_epi64((int64_t)(sh + 2) << 32 | sh));
            w = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 3),
                                                           _mm512_set1_epi8(0x1C)),
                                          lo2, _mm512_set1_epi8(3), 0xF8); /* a | b&c */
        }
        for (int j = 0; j < nx; j++) c[j] = zdot(c[j], w, x + j * xs + 4 * t);
    }
    const __m512i sc = zdup_u8(sc8);
    for (int j = 0; j < nx; j++) isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(c[j], sc));
}

/* sub-blocks 2p and 2p + 1 (each lane's partial may pass 2^15: scaled in int32) */
KV_INL_Z void k5_pair_zmm(const kv_blk_q5_kx8 *b, const kv_k8_scales *u, const int p,
                          const char *xq, int64_t xs, const int nx, __m512i *isum) {
    k5_sub_zmm(b, u->sc[2 * p], 2 * p, xq, xs, nx, isum);
    k5_sub_zmm(b, u->sc[2 * p + 1], 2 * p + 1, xq, xs, nx, isum);
}

KV_ZMM_KMIN_TILE(tile_k5_zmm, kv_blk_q5_kx8, k5_pair_zmm)

KV_GROUP_GEMV(gemv_k5_avx2, KV_TGT, tile_k5_avx2, kv_blk_q5_kx8, 256)
KV_GROUP_GEMV(gemv_k5_vnni, KV_TGT_V, tile_k5_vnni, kv_blk_q5_kx8, 256)
KV_GROUP_GEMV(gemv_k5_zmm, KV_TGT_Z, tile_k5_zmm, kv_blk_q5_kx8, 256)

KV_GEMV_DECL(kv_gemv_q5_kx8_avx2) {
    (!kv_use_vnni() ? gemv_k5_avx2 : n >= KV_ZMM_MIN_N ? gemv_k5_zmm : gemv_k5_vnni)(
        w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);
}
#endif /* KV_HAVE_AVX2_BUILD */
