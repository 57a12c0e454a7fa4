/* IQ4_NL and IQ4_XS, GGUF's non-linear 4-bit types, and MXFP4, read in their file blocks.
 *
 * This file owns the types' dequantizers, portable dot kernels (the reference) and AVX2
 * kernels, decode and prefill; qk_generic.c and qk_avx2.c only list them in their tables.
 *
 * A 4-bit index selects one of 16 fixed int8 values (kv_iq4_values, in [-127, 113]):
 *   IQ4_NL: 32-blocks, value = d * v[q]; against kv_act32 (portable) / kv_act64 (AVX2,
 *           two blocks per step as the Q4_0 kernels take them)
 *   IQ4_XS: 256-blocks, sub-block s (32) value = (d * (scale_s - 32)) * v[q]; kv_act256
 *   MXFP4:  IQ4_NL's shape with the OCP microscaling format's values: an E8M0 exponent byte
 *           e for the scale 2^(e - 128) (kv_e8m0_half) and E2M1 values doubled to integers
 *           (kv_mxfp4_values, in [-12, 12]), value = 2^(e - 128) * v[q] as gguf computes it;
 *           it runs IQ4_NL's kernels (the nl4 functions below, qt a constant)
 * The product per block (or super-block) is an exact int32, sum of v * x (IQ4_XS: weighted by
 * the integer sub-block scales), then one fp32 step: acc = fma(d_w * d_x, (float)isum, acc).
 *
 * AVX2: the index -> value lookup is a byte shuffle of the table; maddubs takes an unsigned
 * operand, so it gets |v| (a second table) and x carries v's sign. No int16 pair saturates:
 * 2 * 127 * 127 < 32768. With KV_IQ4_TILE_MIN_N or more x rows, a tile of weight rows is
 * unpacked once (values, |values|, scales) and every x row runs over it. Both paths do the
 * same fp32 steps in the same order, so a row's output does not depend on n.
 */
#include <stdlib.h>
#include <string.h>

#include "qk.h"

const int8_t kv_iq4_values[16] __attribute__((aligned(16))) = {
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* E2M1 (sign, 2-bit exponent, 1-bit mantissa) index -> twice its value: 0, 0.5, 1, 1.5, 2,
 * 3, 4, 6 and their negatives (index 8, -0, is 0) */
const int8_t kv_mxfp4_values[16] __attribute__((aligned(16))) = {
    0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* the 6-bit scale of IQ4_XS sub-block s, minus 32 */
static inline int xs_scale(const kv_blk_iq4_xs *b, int s) {
    const int lo = (b->scales_l[s / 2] >> (4 * (s % 2))) & 0xF;
    const int hi = (b->scales_h >> (2 * s)) & 3;
    return (lo | hi << 4) - 32;
}

/* ---------------- portable: dequantizers (gguf's rounding: d * v, (d * s) * v) ---------- */

/* IQ4_NL or MXFP4 (qt) blocks: d * v */
static inline void deq_nl4(const int qt, const uint8_t *w, int64_t cols, float *out) {
    const int8_t *v = kv_nl4_values(qt);
    for (int64_t i = 0; i < cols / 32; i++, w += kv_nl4_bytes(qt), out += 32) {
        const float d = kv_nl4_scale(w, qt);
        const uint8_t *q = kv_nl4_qs(w, qt);
        for (int l = 0; l < 16; l++) {
            out[l] = d * (float)v[q[l] & 0xF];
            out[l + 16] = d * (float)v[q[l] >> 4];
        }
    }
}

void kv_deq_iq4_nl_generic(const uint8_t *w, int64_t cols, float *out) {
    deq_nl4(KV_IQ4_NL, w, cols, out);
}

void kv_deq_mxfp4_generic(const uint8_t *w, int64_t cols, float *out) {
    deq_nl4(KV_MXFP4, w, cols, out);
}

void kv_deq_iq4_xs_generic(const uint8_t *w, int64_t cols, float *out) {
    const kv_blk_iq4_xs *b = (const kv_blk_iq4_xs *)w;
    for (int64_t i = 0; i < cols / 256; i++) {
        const float d = kv_h2f_table[b[i].d];
        for (int s = 0; s < 8; s++, out += 32) {
            const float dl = d * (float)xs_scale(b + i, s);
            const uint8_t *q = b[i].qs + 16 * s;
            for (int l = 0; l < 16; l++) {
                out[l] = dl * (float)kv_iq4_values[q[l] & 0xF];
                out[l + 16] = dl * (float)kv_iq4_values[q[l] >> 4];
            }
        }
    }
}

/* ---------------- portable: dot kernels ---------------- */

/* sum over one 32-element run of v[q] * x: 16 bytes of nibbles, 32 activations */
static inline int nl_dot32(const int8_t *v, const uint8_t *q, const int8_t *x) {
    int s = 0;
    for (int l = 0; l < 16; l++) s += v[q[l] & 0xF] * x[l] + v[q[l] >> 4] * x[l + 16];
    return s;
}

static inline void gemv_nl4(const int qt, const uint8_t *w, int64_t row_bytes, int64_t r0,
                            int64_t r1, int64_t cols, const void *xq, int64_t xstride,
                            int64_t n, float *y, int64_t ystride) {
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t j = 0; j < n; j++) {
            const kv_act32 *a = (const kv_act32 *)((const char *)xq + j * xstride);
            const uint8_t *b = w + r * row_bytes;
            float s = 0.0f;
            for (int64_t i = 0; i < cols / 32; i++, b += kv_nl4_bytes(qt))
                s += kv_nl4_scale(b, qt) * a[i].d *
                     (float)nl_dot32(kv_nl4_values(qt), kv_nl4_qs(b, qt), a[i].qs);
            y[j * ystride + r] = s;
        }
    }
}

KV_GEMV_DECL(kv_gemv_iq4_nl_generic) {
    gemv_nl4(KV_IQ4_NL, w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);
}

KV_GEMV_DECL(kv_gemv_mxfp4_generic) {
    gemv_nl4(KV_MXFP4, w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);
}

void kv_gemv_iq4_xs_generic(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                            int64_t cols, const void *xq, int64_t xstride, int64_t n,
                            float *y, int64_t ystride) {
    for (int64_t r = r0; r < r1; r++) {
        const kv_blk_iq4_xs *b = (const kv_blk_iq4_xs *)(w + r * row_bytes);
        for (int64_t j = 0; j < n; j++) {
            const kv_act256 *a = (const kv_act256 *)((const char *)xq + j * xstride);
            float s = 0.0f;
            for (int64_t i = 0; i < cols / 256; i++) {
                int sumi = 0;
                for (int k = 0; k < 8; k++)
                    sumi += xs_scale(b + i, k) *
                            nl_dot32(kv_iq4_values, b[i].qs + 16 * k, a[i].qs + 32 * k);
                s += kv_h2f_table[b[i].d] * a[i].d * (float)sumi;
            }
            y[j * ystride + r] = s;
        }
    }
}

/* ---------------- AVX2 ---------------- */

#ifdef KV_HAVE_AVX2_BUILD
#include "qk_avx2.h"

#define KV_NX 4                /* x rows per pass over a weight row */
#define KV_IQ4_TILE_MIN_N 8    /* fewer x rows: unpack per block, no tile */
#define KV_IQ4_TILE_BYTES 65536


/* the value table of type qt and its magnitudes, in both lanes (shuffle_epi8 looks up per
 * lane) */
KV_INL __m256i table_values(const int qt) {
    return _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)kv_nl4_values(qt)));
}
KV_INL __m256i table_abs(const int qt) {
    return _mm256_abs_epi8(table_values(qt));
}

/* int16 pair sums of v * x, v signed: |v| unsigned into maddubs, v's sign onto x (where v
 * is 0, x becomes 0: the product it stands for) */
KV_INL __m256i mul_pairs(__m256i av, __m256i v, __m256i x) {
    return _mm256_maddubs_epi16(av, _mm256_sign_epi8(x, v));
}

/* ---- IQ4_NL and MXFP4 (qt): blocks 2p and 2p+1 against kv_act64 pair p ----
 * One register holds 16 bytes of each block; its low nibbles are elements 0..15 of both
 * (kv_act64.lo), its high ones 16..31 (.hi); lane k belongs to block 2p+k. */
typedef struct { __m256i lo, hi, alo, ahi; __m256 d; } kv_unl;  /* 160 B */

/* a missing second block (odd block count) gets scale 0; its x half is zero too */
KV_INL void unpack_nl_pair(const int qt, const uint8_t *b, const int pair, kv_unl *u) {
    const uint8_t *b1 = b + kv_nl4_bytes(qt);
    const __m128i q0 = _mm_loadu_si128((const __m128i *)kv_nl4_qs(b, qt));
    const __m128i q1 = pair ? _mm_loadu_si128((const __m128i *)kv_nl4_qs(b1, qt))
                            : _mm_setzero_si128();
    const __m256i q = _mm256_set_m128i(q1, q0), m4 = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(q, m4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    const __m256i tv = table_values(qt), ta = table_abs(qt);
    u->lo = _mm256_shuffle_epi8(tv, lo), u->alo = _mm256_shuffle_epi8(ta, lo);
    u->hi = _mm256_shuffle_epi8(tv, hi), u->ahi = _mm256_shuffle_epi8(ta, hi);
    if (qt == KV_MXFP4) {
        u->d = _mm256_setr_m128(_mm_set1_ps(kv_e8m0_half(b[0])),
                                _mm_set1_ps(pair ? kv_e8m0_half(b1[0]) : 0.0f));
        return;
    }
    uint16_t d0, d1 = 0;
    memcpy(&d0, b, 2);
    if (pair) memcpy(&d1, b1, 2);
    const __m128i dh = _mm_set_epi32(0, 0, 0, (int)(d0 | (uint32_t)d1 << 16));
    u->d = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(dh)),
                                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

/* the fp32 step of one pair against one x row: lane k gets d_w(k) * d_x(k) * isum(k) */
KV_INL __m256 nl_step(const kv_unl *u, const kv_act64 *a, __m256 acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i s32 = _mm256_add_epi32(
        _mm256_madd_epi16(mul_pairs(u->alo, u->lo, load256(a->lo)), ones),
        _mm256_madd_epi16(mul_pairs(u->ahi, u->hi, load256(a->hi)), ones));
    return _mm256_fmadd_ps(_mm256_mul_ps(u->d, _mm256_loadu_ps(a->d)), _mm256_cvtepi32_ps(s32),
                           acc);
}

KV_INL void rows_nl4(const int qt, const uint8_t *w, int64_t cols, const char *xq, int64_t xs,
                     const int nx, float *y, int64_t ys) {
    const int64_t nb = cols / 32, pair_bytes = 2 * kv_nl4_bytes(qt);
    __m256 acc[KV_NX];
    for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t p = 0; 2 * p < nb; p++) {
        kv_unl u;
        unpack_nl_pair(qt, w + p * pair_bytes, 2 * p + 1 < nb, &u);
        for (int j = 0; j < nx; j++) acc[j] = nl_step(&u, (const kv_act64 *)(xq + j * xs) + p, acc[j]);
    }
    for (int j = 0; j < nx; j++) y[j * ys] = hsum_ps(acc[j]);
}

KV_INL int64_t nl_units(int64_t cols) { return (cols / 32 + 1) / 2; }

KV_INL void unpack_nl4_row(const int qt, const uint8_t *w, int64_t cols, kv_unl *u) {
    const int64_t nb = cols / 32, pair_bytes = 2 * kv_nl4_bytes(qt);
    for (int64_t p = 0; 2 * p < nb; p++) unpack_nl_pair(qt, w + p * pair_bytes, 2 * p + 1 < nb, u + p);
}

/* the row functions KV_IQ4_GEMV takes, per type */
KV_INL void rows_nl(const uint8_t *w, int64_t cols, const char *xq, int64_t xs, const int nx,
                    float *y, int64_t ys) {
    rows_nl4(KV_IQ4_NL, w, cols, xq, xs, nx, y, ys);
}
KV_INL void rows_mx(const uint8_t *w, int64_t cols, const char *xq, int64_t xs, const int nx,
                    float *y, int64_t ys) {
    rows_nl4(KV_MXFP4, w, cols, xq, xs, nx, y, ys);
}
KV_INL void unpack_nl_row(const uint8_t *w, int64_t cols, kv_unl *u) {
    unpack_nl4_row(KV_IQ4_NL, w, cols, u);
}
KV_INL void unpack_mx_row(const uint8_t *w, int64_t cols, kv_unl *u) {
    unpack_nl4_row(KV_MXFP4, w, cols, u);
}

/* one unpacked row against nx x rows: rows_nl's steps, read from the tile */
KV_INL void dot_nl(const kv_unl *u, int64_t cols, const char *xq, int64_t xs, const int nx,
                   float *y, int64_t ys) {
    __m256 acc[KV_NX];
    for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t p = 0; p < nl_units(cols); p++)
        for (int j = 0; j < nx; j++) acc[j] = nl_step(u + p, (const kv_act64 *)(xq + j * xs) + p, acc[j]);
    for (int j = 0; j < nx; j++) y[j * ys] = hsum_ps(acc[j]);
}

/* ---- IQ4_XS: super-blocks against kv_act256 ----
 * 32 bytes of qs are sub-blocks 2k (lane 0) and 2k+1 (lane 1), each as low nibbles then
 * high ones; two lane permutes put each sub-block's 32 values in element order, so x is
 * loaded as it is. */
typedef struct { __m256i q[8], aq[8]; __m256i sc; float d; } kv_uxs;

/* the 8 sub-block scales (minus 32) as int16, the same 8 in both lanes */
KV_INL __m256i xs_scales(const kv_blk_iq4_xs *b) {
    uint32_t sl;
    memcpy(&sl, b->scales_l, 4);
    const __m256i lo = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32((int)sl), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
        _mm256_set1_epi32(0xF));
    const __m256i hi = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(b->scales_h), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
        _mm256_set1_epi32(3));
    const __m256i s32 = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)),
                                         _mm256_set1_epi32(32));
    /* packs: [s0..s3 s0..s3 | s4..s7 s4..s7]; qwords 0, 2, 0, 2 -> s0..s7 in both lanes */
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(s32, s32), 0x88);
}

/* int16 element k of a lane, broadcast */
KV_INL __m256i bcast16(__m256i v, int k) {
    return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)((2 * k) | ((2 * k + 1) << 8))));
}

/* sub-blocks 2k, 2k+1 of a super-block: values and magnitudes, elements in order */
KV_INL void xs_pair(const kv_blk_iq4_xs *b, int k, __m256i q[2], __m256i aq[2]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), raw = load256(b->qs + 32 * k);
    const __m256i lo = _mm256_and_si256(raw, m4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    const __m256i n0 = _mm256_permute2x128_si256(lo, hi, 0x20);
    const __m256i n1 = _mm256_permute2x128_si256(lo, hi, 0x31);
    const __m256i tv = table_values(KV_IQ4_NL), ta = table_abs(KV_IQ4_NL);
    q[0] = _mm256_shuffle_epi8(tv, n0), aq[0] = _mm256_shuffle_epi8(ta, n0);
    q[1] = _mm256_shuffle_epi8(tv, n1), aq[1] = _mm256_shuffle_epi8(ta, n1);
}

/* isum + scale * (pair sums of one sub-block) */
KV_INL __m256i xs_acc(__m256i isum, __m256i aq, __m256i q, const int8_t *x, __m256i scale) {
    return _mm256_add_epi32(isum, _mm256_madd_epi16(mul_pairs(aq, q, load256(x)), scale));
}

#define ACT256(j, i) ((const kv_act256 *)(xq + (j) * xs) + (i))

KV_INL void rows_xs(const uint8_t *w, int64_t cols, const char *xq, int64_t xs, const int nx,
                    float *y, int64_t ys) {
    const kv_blk_iq4_xs *b = (const kv_blk_iq4_xs *)w;
    __m256 acc[KV_NX];
    for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < cols / 256; i++) {
        const __m256i sc = xs_scales(b + i);
        __m256i isum[KV_NX];
        for (int j = 0; j < nx; j++) isum[j] = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {
            __m256i q[2], aq[2];
            xs_pair(b + i, k, q, aq);
            const __m256i s0 = bcast16(sc, 2 * k), s1 = bcast16(sc, 2 * k + 1);
            for (int j = 0; j < nx; j++) {
                const int8_t *x = ACT256(j, i)->qs + 64 * k;
                isum[j] = xs_acc(xs_acc(isum[j], aq[0], q[0], x, s0), aq[1], q[1], x + 32, s1);
            }
        }
        const float d = _cvtsh_ss(b[i].d);
        for (int j = 0; j < nx; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * ACT256(j, i)->d),
                                     _mm256_cvtepi32_ps(isum[j]), acc[j]);
    }
    for (int j = 0; j < nx; j++) y[j * ys] = hsum_ps(acc[j]);
}

KV_INL int64_t xs_units(int64_t cols) { return cols / 256; }

KV_INL void unpack_xs_row(const uint8_t *w, int64_t cols, kv_uxs *u) {
    const kv_blk_iq4_xs *b = (const kv_blk_iq4_xs *)w;
    for (int64_t i = 0; i < cols / 256; i++) {
        u[i].sc = xs_scales(b + i);
        for (int k = 0; k < 4; k++) xs_pair(b + i, k, u[i].q + 2 * k, u[i].aq + 2 * k);
        u[i].d = _cvtsh_ss(b[i].d);
    }
}

KV_INL void dot_xs(const kv_uxs *u, int64_t cols, const char *xq, int64_t xs, const int nx,
                   float *y, int64_t ys) {
    __m256 acc[KV_NX];
    for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < cols / 256; i++) {
        __m256i isum[KV_NX];
        for (int j = 0; j < nx; j++) isum[j] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            const __m256i scale = bcast16(u[i].sc, s);
            for (int j = 0; j < nx; j++)
                isum[j] = xs_acc(isum[j], u[i].aq[s], u[i].q[s], ACT256(j, i)->qs + 32 * s, scale);
        }
        for (int j = 0; j < nx; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(u[i].d * ACT256(j, i)->d),
                                     _mm256_cvtepi32_ps(isum[j]), acc[j]);
    }
    for (int j = 0; j < nx; j++) y[j * ys] = hsum_ps(acc[j]);
}

/* ---- drivers ---- */

/* fn(..., nx, ...) with nx a constant in each case, so the loops over x rows unroll */
#define KV_NX_SWITCH(left, fn, ...)                        \
    switch ((left) >= KV_NX ? KV_NX : (left)) {            \
        case 4: fn(__VA_ARGS__, 4, yj, ystride); break;   \
        case 3: fn(__VA_ARGS__, 3, yj, ystride); break;   \
        case 2: fn(__VA_ARGS__, 2, yj, ystride); break;   \
        default: fn(__VA_ARGS__, 1, yj, ystride); break;  \
    }

/* Rows [r0, r1). Few x rows: each weight row is unpacked block by block for every group
 * of KV_NX x rows. Many: tiles of up to 16 rows are unpacked once into a buffer, then every
 * group of x rows runs over the tile while its x blocks stay in L1. */
#define KV_IQ4_GEMV(name, rows_fn, utype, units, unpack_row, dot_fn)                      \
    void name(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t cols,  \
              const void *xq, int64_t xstride, int64_t n, float *y, int64_t ystride) {    \
        const char *x = (const char *)xq;                                                 \
        const int64_t nu = units(cols), ubytes = nu * (int64_t)sizeof(utype);             \
        int64_t tr = KV_IQ4_TILE_BYTES / (ubytes > 0 ? ubytes : 1);                       \
        tr = tr < 1 ? 1 : tr > 16 ? 16 : tr;                                              \
        tr = tr < r1 - r0 ? tr : r1 - r0;                                                 \
        utype *buf = n < KV_IQ4_TILE_MIN_N || nu == 0 || tr < 1                           \
                         ? NULL : (utype *)aligned_alloc(32, (size_t)(tr * ubytes));      \
        if (!buf) {                                                                       \
            for (int64_t r = r0; r < r1; r++)                                             \
                for (int64_t j = 0; j < n; j += KV_NX) {                                  \
                    float *yj = y + j * ystride + r;                                      \
                    KV_NX_SWITCH(n - j, rows_fn, w + r * row_bytes, cols, x + j * xstride, \
                                 xstride)                                                 \
                }                                                                         \
            return;                                                                       \
        }                                                                                 \
        for (int64_t r = r0; r < r1; r += tr) {                                           \
            const int64_t nt = r1 - r < tr ? r1 - r : tr;                                 \
            for (int64_t t = 0; t < nt; t++) unpack_row(w + (r + t) * row_bytes, cols, buf + t * nu); \
            for (int64_t j = 0; j < n; j += KV_NX)                                        \
                for (int64_t t = 0; t < nt; t++) {                                        \
                    float *yj = y + j * ystride + r + t;                                  \
                    KV_NX_SWITCH(n - j, dot_fn, buf + t * nu, cols, x + j * xstride, xstride) \
                }                                                                         \
        }                                                                                 \
        free(buf);                                                                        \
    }

KV_TGT KV_IQ4_GEMV(kv_gemv_iq4_nl_avx2, rows_nl, kv_unl, nl_units, unpack_nl_row, dot_nl)
KV_TGT KV_IQ4_GEMV(kv_gemv_mxfp4_avx2, rows_mx, kv_unl, nl_units, unpack_mx_row, dot_nl)
KV_TGT KV_IQ4_GEMV(kv_gemv_iq4_xs_avx2, rows_xs, kv_uxs, xs_units, unpack_xs_row, dot_xs)

/* ---- dequantizers: one fp32 multiply per element, as the portable ones ---- */

/* 32 int8 -> out[0..31] = d * v */
KV_INL void store32(float *out, __m256i v, __m256 d) {
    const __m128i h[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
    for (int k = 0; k < 2; k++) {
        _mm256_storeu_ps(out + 16 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h[k]))));
        _mm256_storeu_ps(out + 16 * k + 8, _mm256_mul_ps(
            d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(h[k], 8)))));
    }
}

/* 16 bytes of nibbles -> the 32 values of type qt in element order */
KV_INL __m256i values16(const int qt, const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                                         _mm256_set1_epi8(0x0F));
    return _mm256_shuffle_epi8(table_values(qt), nib);
}

KV_INL void deq_nl4_avx2(const int qt, const uint8_t *w, int64_t cols, float *out) {
    for (int64_t i = 0; i < cols / 32; i++, w += kv_nl4_bytes(qt), out += 32)
        store32(out, values16(qt, kv_nl4_qs(w, qt)), _mm256_set1_ps(kv_nl4_scale(w, qt)));
}

KV_TGT void kv_deq_iq4_nl_avx2(const uint8_t *w, int64_t cols, float *out) {
    deq_nl4_avx2(KV_IQ4_NL, w, cols, out);
}

KV_TGT void kv_deq_mxfp4_avx2(const uint8_t *w, int64_t cols, float *out) {
    deq_nl4_avx2(KV_MXFP4, w, cols, out);
}

KV_TGT void kv_deq_iq4_xs_avx2(const uint8_t *w, int64_t cols, float *out) {
    const kv_blk_iq4_xs *b = (const kv_blk_iq4_xs *)w;
    for (int64_t i = 0; i < cols / 256; i++) {
        const float d = _cvtsh_ss(b[i].d);
        for (int s = 0; s < 8; s++, out += 32)
            store32(out, values16(KV_IQ4_NL, b[i].qs + 16 * s),
                    _mm256_set1_ps(d * (float)xs_scale(b + i, s)));
    }
}
#endif /* KV_HAVE_AVX2_BUILD */
