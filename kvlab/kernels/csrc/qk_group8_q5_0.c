/* Q5_0 in groups of 8 rows ("Q5_0x8", kvlab's own in-memory layout), Q5_0's 22 bytes per
 * 32 values: the same size as the file, where widening Q5_0 to Q8_0x8 would take 34. A
 * decode step reads every weight byte once, so the smaller layout is time saved.
 *
 *   block i of rows 8g..8g+7 (176 B):
 *     d[8]     fp16 scale of row 8g+k
 *     qh[32]   bit t of qh[b]: bit 4 of chunk t's byte b
 *     qs[128]  qs[32u + b]: low nibble chunk 2u's byte b, high nibble chunk 2u+1's byte b
 *   where chunk t's byte b = 4k + e is q(row 8g+k, element 4t+e) + 16, in 0..31
 *
 * The chunks are Q8_0x8's (qk_group8_q8_0.c): one register lane per row, x's 4 bytes
 * broadcast. The weights are unsigned already, so maddubs takes them as they unpack, x keeps
 * its sign, and the 16 the values were offset by comes back as kv_act32.bias / 8 (-16 * sum of
 * x's block, exact). The integer dot of each block is the same as Q8_0x8's of the same
 * values, and so are the float steps after it: the outputs are bit-identical to Q8_0x8's.
 */
#include <math.h>
#include <string.h>

#include "qk.h"

typedef struct { kv_half d[8]; uint8_t qh[32]; uint8_t qs[128]; } kv_blk_q5_0x8;  /* 176 B */

/* ---------------- conversion from Q5_0 blocks ---------------- */

static void q5_values(const kv_blk_q5_0 *b, uint8_t v[32]) {
    uint32_t qh;
    memcpy(&qh, b->qh, 4);
    for (int l = 0; l < 16; l++) {
        v[l] = (uint8_t)((b->qs[l] & 0xF) | ((qh >> l) & 1) << 4);
        v[l + 16] = (uint8_t)((b->qs[l] >> 4) | ((qh >> (l + 16)) & 1) << 4);
    }
}

int kv_to_q5_0x8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst) {
    if (rows % 8 || cols % 32) return -1;
    const int64_t nb = cols / 32;
    kv_blk_q5_0x8 *out = (kv_blk_q5_0x8 *)dst;
    for (int64_t g = 0; g < rows / 8; g++) {
        for (int64_t i = 0; i < nb; i++, out++) {
            memset(out, 0, sizeof *out);
            for (int k = 0; k < 8; k++) {
                const kv_blk_q5_0 *b = (const kv_blk_q5_0 *)src + (8 * g + k) * nb + i;
                uint8_t v[32];
                q5_values(b, v);
                out->d[k] = b->d;
                for (int t = 0; t < 8; t++)
                    for (int e = 0; e < 4; e++) {
                        const int byte = 4 * k + e, x = v[4 * t + e];
                        out->qs[32 * (t / 2) + byte] |= (uint8_t)((x & 0xF) << (4 * (t % 2)));
                        out->qh[byte] |= (uint8_t)((x >> 4) << t);
                    }
            }
        }
    }
    return 0;
}

/* chunk t's byte b of a block: the stored value + 16 (0..31) */
static inline int q5x8_value(const kv_blk_q5_0x8 *b, int t, int byte) {
    return ((b->qs[32 * (t / 2) + byte] >> (4 * (t % 2))) & 0xF) | ((b->qh[byte] >> t) & 1) << 4;
}

void kv_deq_q5_0x8_row(const uint8_t *w, int64_t row_bytes, int64_t r, int64_t cols,
                       float *out) {
    const kv_blk_q5_0x8 *b = (const kv_blk_q5_0x8 *)(w + (r / 8) * 8 * row_bytes);
    const int k = (int)(r % 8);
    for (int64_t i = 0; i < cols / 32; i++, out += 32) {
        const float d = kv_h2f_table[b[i].d[k]];
        for (int t = 0; t < 8; t++)
            for (int e = 0; e < 4; e++)
                out[4 * t + e] = (float)(q5x8_value(&b[i], t, 4 * k + e) - 16) * d;
    }
}

/* ---------------- portable kernel (the reference the AVX2 one matches bit for bit) ------ */

void kv_gemv_q5_0x8_generic(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                            int64_t cols, const void *xq, int64_t xstride, int64_t n,
                            float *y, int64_t ystride) {
    for (int64_t r = r0; r < r1; r += 8) {
        const kv_blk_q5_0x8 *b = (const kv_blk_q5_0x8 *)(w + r * row_bytes);
        for (int64_t j = 0; j < n; j++) {
            const kv_act32 *a = (const kv_act32 *)((const char *)xq + j * xstride);
            for (int k = 0; k < 8; k++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < cols / 32; i++) {
                    int32_t isum = a[i].bias / 8;
                    for (int t = 0; t < 8; t++)
                        for (int e = 0; e < 4; e++)
                            isum += q5x8_value(&b[i], t, 4 * k + e) * a[i].qs[4 * t + e];
                    acc = fmaf(kv_h2f_table[b[i].d[k]] * a[i].d, (float)isum, acc);
                }
                y[j * ystride + r + k] = acc;
            }
        }
    }
}

/* ---------------- AVX2 ---------------- */

#ifdef KV_HAVE_AVX2_BUILD
#include "qk_avx2.h"

/* the 8 chunks of block b, unsigned 0..31; bit t of qh moved to bit 4 by a 16-bit shift
 * (the same shift moves the high byte's bit t to its bit 4: no carry between the bytes) */
KV_INL void q5x8_unpack(const kv_blk_q5_0x8 *b, __m256i w[8]) {
    const __m256i nib = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
    const __m256i h = load256(b->qh);
    for (int u = 0; u < 4; u++) {
        const __m256i q = load256(b->qs + 32 * u);
        w[2 * u] = _mm256_and_si256(q, nib);
        w[2 * u + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), nib);
    }
    w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(h, 4), b4));
    w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(h, 3), b4));
    w[2] = _mm256_or_si256(w[2], _mm256_and_si256(_mm256_slli_epi16(h, 2), b4));
    w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_slli_epi16(h, 1), b4));
    w[4] = _mm256_or_si256(w[4], _mm256_and_si256(h, b4));
    w[5] = _mm256_or_si256(w[5], _mm256_and_si256(_mm256_srli_epi16(h, 1), b4));
    w[6] = _mm256_or_si256(w[6], _mm256_and_si256(_mm256_srli_epi16(h, 2), b4));
    w[7] = _mm256_or_si256(w[7], _mm256_and_si256(_mm256_srli_epi16(h, 3), b4));
}

/* bias / 8 = -16 * (x's block sum) in every lane: bias is a multiple of 128, so the vector
 * shift is the division, with no scalar steps and no move from a general register */
KV_INL __m256i q5x8_offset(const kv_act32 *a) {
    return _mm256_srai_epi32(_mm256_set1_epi32(a->bias), 3);
}

/* a block's integer dot for one x row: 4 chunks' maddubs pairs add in int16 (at most
 * 4 * 2 * 31 * 127 < 32768), then one madd each */
KV_INL __m256i q5x8_dot_avx2(const __m256i w[8], const kv_act32 *a) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s[2];
    for (int h = 0; h < 2; h++) {
        const int t = 4 * h;
        s[h] = _mm256_add_epi16(
            _mm256_add_epi16(_mm256_maddubs_epi16(w[t], bcast4(a->qs + 4 * t)),
                             _mm256_maddubs_epi16(w[t + 1], bcast4(a->qs + 4 * t + 4))),
            _mm256_add_epi16(_mm256_maddubs_epi16(w[t + 2], bcast4(a->qs + 4 * t + 8)),
                             _mm256_maddubs_epi16(w[t + 3], bcast4(a->qs + 4 * t + 12))));
    }
    return _mm256_add_epi32(
        _mm256_add_epi32(_mm256_madd_epi16(s[0], ones), _mm256_madd_epi16(s[1], ones)),
        q5x8_offset(a));
}

#define Q5X8_ACT(j) ((const kv_act32 *)(xq + (j) * xs) + i)

/* the integer dots of a block against x rows 0..nx-1 (block i of each) */
KV_INL void q5x8_dots_avx2(const __m256i w[8], const char *xq, int64_t xs, int64_t i,
                           const int nx, __m256i *c) {
    for (int j = 0; j < nx; j++) c[j] = q5x8_dot_avx2(w, Q5X8_ACT(j));
}

/* AVX512-VNNI: the 8 chunks into vpdpbusd chunk by chunk across the x rows, so neighbouring
 * products are independent: one int32 chain per x row from the offset, two (even and odd
 * chunks) for one or two rows, which would otherwise wait on vpdpbusd's latency (4096 x 640
 * at 512 x rows: 258 GFLOP/s, where row by row with two chains each gives 216). The maddubs
 * path's integer, so its bits. */
#define KV_TGT_V __attribute__((target(KV_ISA_VNNI)))
static inline __attribute__((always_inline)) KV_TGT_V void q5x8_dots_vnni(
    const __m256i w[8], const char *xq, int64_t xs, int64_t i, const int nx, __m256i *c) {
    const int two = nx <= 2;
    __m256i odd[2];
    for (int j = 0; j < nx; j++) c[j] = q5x8_offset(Q5X8_ACT(j));
    for (int j = 0; j < (two ? nx : 0); j++) odd[j] = _mm256_setzero_si256();
    for (int t = 0; t < 8; t++)
        for (int j = 0; j < nx; j++) {
            const __m256i x = bcast4(Q5X8_ACT(j)->qs + 4 * t);
            if (two && t % 2) odd[j] = _mm256_dpbusd_epi32(odd[j], w[t], x);
            else c[j] = _mm256_dpbusd_epi32(c[j], w[t], x);
        }
    for (int j = 0; j < (two ? nx : 0); j++) c[j] = _mm256_add_epi32(c[j], odd[j]);
}

/* one group's blocks against nx x rows, each block unpacked once for all of them; the next
 * blocks' bytes prefetched */
#define KV_Q5X8_TILE(name, tgt, dots)                                                        \
    static inline __attribute__((always_inline)) tgt void name(                            \
        const kv_blk_q5_0x8 *b, int64_t nb, const char *xq, int64_t xs, const int nx,      \
        float *y, int64_t ys) {                                                             \
        __m256 acc[KV_GROUP_NX];                                                            \
        for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();                          \
        for (int64_t i = 0; i < nb; i++) {                                                  \
            const char *next = (const char *)(b + i + 2);                                   \
            for (int c = 0; c < 3; c++) _mm_prefetch(next + 64 * c, _MM_HINT_T0);          \
            __m256i w[8];                                                                   \
            q5x8_unpack(&b[i], w);                                                          \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].d));    \
            __m256i isum[KV_GROUP_NX];                                                      \
            dots(w, xq, xs, i, nx, isum);                                                   \
            for (int j = 0; j < nx; j++)                                                    \
                acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(Q5X8_ACT(j)->d)), \
                                         _mm256_cvtepi32_ps(isum[j]), acc[j]);              \
        }                                                                                   \
        for (int j = 0; j < nx; j++) _mm256_storeu_ps(y + j * ys, acc[j]);                 \
    }

KV_Q5X8_TILE(tile_q5x8, KV_TGT, q5x8_dots_avx2)
KV_Q5X8_TILE(tile_q5x8_vnni, KV_TGT_V, q5x8_dots_vnni)

KV_GROUP_GEMV(gemv_q5x8_avx2, KV_TGT, tile_q5x8, kv_blk_q5_0x8, 32)
KV_GROUP_GEMV(gemv_q5x8_vnni, KV_TGT_V, tile_q5x8_vnni, kv_blk_q5_0x8, 32)

KV_GEMV_DECL(kv_gemv_q5_0x8_avx2) {
    (kv_use_vnni() ? gemv_q5x8_vnni : gemv_q5x8_avx2)(w, row_bytes, r0, r1, cols, xq, xstride,
                                                      n, y, ystride);
}
#endif /* KV_HAVE_AVX2_BUILD */
