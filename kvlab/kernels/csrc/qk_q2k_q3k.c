/* Q2_K and Q3_K, read in their GGUF block layout: the row dequantizers, the portable dot
 * kernels against kv_act256, and the AVX2 kernels (decode rows and prefill tiles).
 *
 * Both types split a 256-element super-block into 16 sub-blocks of 16 elements, which is
 * the grain of kv_act256's bsums, so each sub-block's min (Q2_K) or the -4 offset of the
 * 3-bit values (Q3_K) is one integer product per sub-block with the activation's sum.
 *
 * Element e of a super-block: 2-bit field (qs[32 * (e / 128) + e % 32] >> 2 * (e / 32 % 4)) & 3,
 * sub-block e / 16; Q3_K's third bit is bit e / 32 of hmask[e % 32], and a clear bit means
 * the value is 4 lower.
 */
#include <stdlib.h>
#include <string.h>

#include "qk.h"

_Static_assert(sizeof(kv_blk_q2_k) == 84, "Q2_K blocks are 84 bytes");
_Static_assert(sizeof(kv_blk_q3_k) == 110, "Q3_K blocks are 110 bytes");

/* the 2-bit field of element l (0..15) of sub-block k */
#define K23_QS(qs, k, l) (((qs)[32 * ((k) / 8) + 16 * ((k) % 2) + (l)] >> (2 * ((k) % 8 / 2))) & 3)

/* ---------------- dequantizers: the arithmetic order of gguf.quants ---------------- */

static inline __attribute__((always_inline)) void deq_q2_k_body(const uint8_t *w, int64_t cols,
                                                                float *out) {
    const kv_blk_q2_k *b = (const kv_blk_q2_k *)w;
    for (int64_t i = 0; i < cols / 256; i++) {
        const float d = kv_h2f_table[b[i].d], dmin = kv_h2f_table[b[i].dmin];
        for (int k = 0; k < 16; k++, out += 16) {
            const float dl = d * (float)(b[i].scales[k] & 0xF);
            const float ml = dmin * (float)(b[i].scales[k] >> 4);
            for (int l = 0; l < 16; l++) out[l] = dl * (float)K23_QS(b[i].qs, k, l) - ml;
        }
    }
}

static inline __attribute__((always_inline)) void deq_q3_k_body(const uint8_t *w, int64_t cols,
                                                                float *out) {
    const kv_blk_q3_k *b = (const kv_blk_q3_k *)w;
    for (int64_t i = 0; i < cols / 256; i++) {
        const float d = kv_h2f_table[b[i].d];
        int8_t sc[16];
        kv_q3_k_scales(b[i].scales, sc);
        for (int k = 0; k < 16; k++, out += 16) {
            const float dl = d * (float)sc[k];
            const uint8_t *hm = b[i].hmask + 16 * (k % 2);
            for (int l = 0; l < 16; l++) {
                const int q = K23_QS(b[i].qs, k, l) - ((hm[l] >> (k / 2) & 1) ? 0 : 4);
                out[l] = dl * (float)q;
            }
        }
    }
}

void kv_deq_q2_k_generic(const uint8_t *w, int64_t cols, float *out) { deq_q2_k_body(w, cols, out); }
void kv_deq_q3_k_generic(const uint8_t *w, int64_t cols, float *out) { deq_q3_k_body(w, cols, out); }

/* ---------------- portable dot kernels ---------------- */

static float dot_q2_k(const uint8_t *w, int64_t cols, const kv_act256 *a) {
    const kv_blk_q2_k *b = (const kv_blk_q2_k *)w;
    float s = 0.0f;
    for (int64_t i = 0; i < cols / 256; i++) {
        int sumi = 0, summ = 0;
        for (int k = 0; k < 16; k++) {
            const int8_t *x = a[i].qs + 16 * k;
            int p = 0;
            for (int l = 0; l < 16; l++) p += K23_QS(b[i].qs, k, l) * x[l];
            sumi += (b[i].scales[k] & 0xF) * p;
            summ += (b[i].scales[k] >> 4) * a[i].bsums[k];
        }
        s += a[i].d * (kv_h2f_table[b[i].d] * (float)sumi
                       - kv_h2f_table[b[i].dmin] * (float)summ);
    }
    return s;
}

static float dot_q3_k(const uint8_t *w, int64_t cols, const kv_act256 *a) {
    const kv_blk_q3_k *b = (const kv_blk_q3_k *)w;
    float s = 0.0f;
    for (int64_t i = 0; i < cols / 256; i++) {
        int8_t sc[16];
        kv_q3_k_scales(b[i].scales, sc);
        int sumi = 0;
        for (int k = 0; k < 16; k++) {
            const int8_t *x = a[i].qs + 16 * k;
            const uint8_t *hm = b[i].hmask + 16 * (k % 2);
            int p = 0;
            for (int l = 0; l < 16; l++)
                p += (K23_QS(b[i].qs, k, l) - ((hm[l] >> (k / 2) & 1) ? 0 : 4)) * x[l];
            sumi += sc[k] * p;
        }
        s += kv_h2f_table[b[i].d] * a[i].d * (float)sumi;
    }
    return s;
}

#define K23_GEMV_GENERIC(name, dot)                                                        \
    KV_GEMV_DECL(name) {                                                                   \
        for (int64_t r = r0; r < r1; r++)                                                  \
            for (int64_t j = 0; j < n; j++)                                                \
                y[j * ystride + r] = dot(w + r * row_bytes, cols,                          \
                                         (const kv_act256 *)((const char *)xq + j * xstride)); \
    }

K23_GEMV_GENERIC(kv_gemv_q2_k_generic, dot_q2_k)
K23_GEMV_GENERIC(kv_gemv_q3_k_generic, dot_q3_k)

/* ---------------- AVX2 ---------------- */
#ifdef KV_HAVE_AVX2_BUILD
#include "qk_avx2.h"

#define K23_NXMAX 4          /* x rows per pass over a weight row */
#define K23_TILE_MIN_N 8     /* fewer x rows: the weight blocks are unpacked per pass */
#define K23_TILE_BYTES 32768 /* unpacked weights per tile (1 to 16 rows of it) */

/* the plain-C dequantizers again, vectorized by the compiler for AVX2: same operations */
void KV_TGT kv_deq_q2_k_avx2(const uint8_t *w, int64_t cols, float *out) { deq_q2_k_body(w, cols, out); }
void KV_TGT kv_deq_q3_k_avx2(const uint8_t *w, int64_t cols, float *out) { deq_q3_k_body(w, cols, out); }

/* A super-block unpacked: 8 groups of 32 unsigned values (Q2_K 0..3, Q3_K 0..7 = q + 4), in
 * each register's low lane sub-block 2g and in its high lane 2g+1; the 16 sub-block scales as
 * int16, the even ones in the low lane and the odd ones in the high lane, so one in-lane
 * shuffle gives a group's pair; `aux` in sub-block order: Q2_K's mins, Q3_K's scales (for the
 * -4 offset). The decode kernels build one in registers, the prefill tiles keep rows of them. */
typedef struct { __m256i q[8]; __m256i sc, aux; float d, dmin; } kv_uk23;


/* 16 bytes -> int16, even-indexed bytes into the low lane, odd ones into the high lane */
KV_INL __m256i even_odd_epi16(__m128i v, const int is_signed) {
    const __m128i eo = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m128i s = _mm_shuffle_epi8(v, eo);
    return is_signed ? _mm256_cvtepi8_epi16(s) : _mm256_cvtepu8_epi16(s);
}

KV_INL void unpack_q2_k(const kv_blk_q2_k *b, kv_uk23 *u) {
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i v = load256(b->qs + 32 * h);
        u->q[4 * h] = _mm256_and_si256(v, m3);
        u->q[4 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 2), m3);
        u->q[4 * h + 2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m3);
        u->q[4 * h + 3] = _mm256_and_si256(_mm256_srli_epi16(v, 6), m3);
    }
    const __m128i raw = _mm_loadu_si128((const __m128i *)b->scales), m4 = _mm_set1_epi8(0xF);
    u->sc = even_odd_epi16(_mm_and_si128(raw, m4), 0);
    u->aux = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
    u->d = _cvtsh_ss(b->d), u->dmin = _cvtsh_ss(b->dmin);
}

/* bit g of every byte of hm -> 4 (16-bit shifts: the bit lands inside its own byte) */
KV_INL __m256i hbit_to_4(__m256i hm, const int g) {
    const __m256i v = g < 2 ? _mm256_slli_epi16(hm, 2 - g) : _mm256_srli_epi16(hm, g - 2);
    return _mm256_and_si256(v, _mm256_set1_epi8(4));
}

KV_INL void unpack_q3_k(const kv_blk_q3_k *b, kv_uk23 *u) {
    const __m256i m3 = _mm256_set1_epi8(3), hm = load256(b->hmask);
    for (int h = 0; h < 2; h++) {
        const __m256i v = load256(b->qs + 32 * h);
        for (int s = 0; s < 4; s++) {
            const int g = 4 * h + s;
            const __m256i ql = _mm256_and_si256(_mm256_srli_epi16(v, 2 * s), m3);
            u->q[g] = _mm256_or_si256(ql, hbit_to_4(hm, g));
        }
    }
    /* the same packing as k3_scales, four scales per 32-bit word */
    uint32_t a[3];
    memcpy(a, b->scales, 12);
    const uint32_t lo4 = 0x0F0F0F0Fu, hi2 = 0x03030303u;
    const uint32_t w0 = (a[0] & lo4) | (a[2] & hi2) << 4;
    const uint32_t w1 = (a[1] & lo4) | (a[2] >> 2 & hi2) << 4;
    const uint32_t w2 = (a[0] >> 4 & lo4) | (a[2] >> 4 & hi2) << 4;
    const uint32_t w3 = (a[1] >> 4 & lo4) | (a[2] >> 6 & hi2) << 4;
    const __m128i s8 = _mm_sub_epi8(_mm_setr_epi32((int)w0, (int)w1, (int)w2, (int)w3),
                                    _mm_set1_epi8(32));
    u->sc = even_odd_epi16(s8, 1);
    u->aux = _mm256_cvtepi8_epi16(s8);
    u->d = _cvtsh_ss(b->d), u->dmin = 0.0f;
}

#define K23_ACT(xq, xs, j, i) ((const kv_act256 *)((xq) + (j) * (xs)) + (i))

/* Super-block i of one weight row (unpacked in u) against nx x rows, into acc. Both the
 * decode rows and the prefill tiles run exactly this, so a row's bits do not depend on n. */
KV_INL void dot_k23(const kv_uk23 *u, const char *xq, int64_t xs, int64_t i, const int nx,
                    __m256 *acc, const int q3) {
    __m256i sumi[K23_NXMAX];
    for (int j = 0; j < nx; j++) {  /* Q3_K starts from -4 * sum(scale * bsum) */
        const __m256i bs = load256(K23_ACT(xq, xs, j, i)->bsums);
        sumi[j] = q3 ? _mm256_sub_epi32(_mm256_setzero_si256(),
                                        _mm256_slli_epi32(_mm256_madd_epi16(bs, u->aux), 2))
                     : _mm256_setzero_si256();
    }
    for (int g = 0; g < 8; g++) {
        const __m256i scale = _mm256_shuffle_epi8(
            u->sc, _mm256_set1_epi16((short)((2 * g) | ((2 * g + 1) << 8))));
        for (int j = 0; j < nx; j++) {
            const __m256i x = load256(K23_ACT(xq, xs, j, i)->qs + 32 * g);
            sumi[j] = _mm256_add_epi32(
                sumi[j], _mm256_madd_epi16(_mm256_maddubs_epi16(u->q[g], x), scale));
        }
    }
    for (int j = 0; j < nx; j++) {
        const kv_act256 *a = K23_ACT(xq, xs, j, i);
        acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(u->d * a->d), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
        if (!q3) {
            const __m256i pm = _mm256_madd_epi16(load256(a->bsums), u->aux);
            acc[j] = _mm256_fnmadd_ps(_mm256_set1_ps(u->dmin * a->d), _mm256_cvtepi32_ps(pm),
                                      acc[j]);
        }
    }
}

KV_INL void unpack_k23(const uint8_t *w, int64_t i, kv_uk23 *u, const int q3) {
    if (q3) unpack_q3_k((const kv_blk_q3_k *)w + i, u);
    else unpack_q2_k((const kv_blk_q2_k *)w + i, u);
}

/* one weight row against nx x rows, unpacking each super-block on the way */
KV_INL void rows_k23(const uint8_t *w, int64_t cols, const char *xq, int64_t xs, const int nx,
                     float *y, int64_t ys, const int q3) {
    __m256 acc[K23_NXMAX];
    for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < cols / 256; i++) {
        kv_uk23 u;
        unpack_k23(w, i, &u, q3);
        dot_k23(&u, xq, xs, i, nx, acc, q3);
    }
    for (int j = 0; j < nx; j++) y[j * ys] = hsum_ps(acc[j]);
}

/* one unpacked weight row (a tile row) against nx x rows */
KV_INL void tile_row_k23(const kv_uk23 *u, int64_t cols, const char *xq, int64_t xs,
                         const int nx, float *y, int64_t ys, const int q3) {
    __m256 acc[K23_NXMAX];
    for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < cols / 256; i++) dot_k23(u + i, xq, xs, i, nx, acc, q3);
    for (int j = 0; j < nx; j++) y[j * ys] = hsum_ps(acc[j]);
}

/* x rows [j, n) in passes of up to four, nx a constant in each call so the loops unroll */
#define K23_PASSES(call, n)                                                                \
    for (int64_t j = 0; j < (n); j += K23_NXMAX) {                                         \
        switch ((n) - j >= K23_NXMAX ? K23_NXMAX : (n) - j) {                              \
            case 4: call(4); break;                                                        \
            case 3: call(3); break;                                                        \
            case 2: call(2); break;                                                        \
            default: call(1); break;                                                       \
        }                                                                                  \
    }

/* Decode (n < K23_TILE_MIN_N): each weight row read once per pass of four x rows. Prefill:
 * a tile of weight rows is unpacked once, then every pass of x rows runs over the whole
 * tile while its x blocks stay in L1. */
KV_INL void gemv_k23(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t cols,
                     const void *xq, int64_t xstride, int64_t n, float *y, int64_t ystride,
                     const int q3) {
    const char *x = (const char *)xq;
    const int64_t nb = cols / 256, ubytes = nb * (int64_t)sizeof(kv_uk23);
    int64_t tr = ubytes > 0 ? K23_TILE_BYTES / ubytes : 1;
    tr = tr < 1 ? 1 : tr > 16 ? 16 : tr;
    tr = tr < r1 - r0 ? tr : r1 - r0;
    kv_uk23 *buf = n < K23_TILE_MIN_N || nb == 0 || tr < 1
                       ? NULL : (kv_uk23 *)aligned_alloc(32, (size_t)(tr * ubytes));
    if (!buf) {
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *wr = w + r * row_bytes;
#define K23_ROWS(nx) rows_k23(wr, cols, x + j * xstride, xstride, nx, y + j * ystride + r, ystride, q3)
            K23_PASSES(K23_ROWS, n)
#undef K23_ROWS
        }
        return;
    }
    for (int64_t r = r0; r < r1; r += tr) {
        const int64_t nt = r1 - r < tr ? r1 - r : tr;
        for (int64_t t = 0; t < nt; t++)
            for (int64_t i = 0; i < nb; i++) unpack_k23(w + (r + t) * row_bytes, i, buf + t * nb + i, q3);
        for (int64_t j = 0; j < n; j += K23_NXMAX) {
            const int64_t left = n - j;
            for (int64_t t = 0; t < nt; t++) {
                const kv_uk23 *u = buf + t * nb;
                float *yt = y + j * ystride + r + t;
                const char *xj = x + j * xstride;
                switch (left >= K23_NXMAX ? K23_NXMAX : left) {
                    case 4: tile_row_k23(u, cols, xj, xstride, 4, yt, ystride, q3); break;
                    case 3: tile_row_k23(u, cols, xj, xstride, 3, yt, ystride, q3); break;
                    case 2: tile_row_k23(u, cols, xj, xstride, 2, yt, ystride, q3); break;
                    default: tile_row_k23(u, cols, xj, xstride, 1, yt, ystride, q3); break;
                }
            }
        }
    }
    free(buf);
}

KV_TGT KV_GEMV_DECL(kv_gemv_q2_k_avx2) {
    gemv_k23(w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride, 0);
}

KV_TGT KV_GEMV_DECL(kv_gemv_q3_k_avx2) {
    gemv_k23(w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride, 1);
}

#endif /* KV_HAVE_AVX2_BUILD */
