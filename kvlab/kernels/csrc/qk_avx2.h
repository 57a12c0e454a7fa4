/* The small AVX2 helpers the kernel files share (included inside their
 * `#ifdef KV_HAVE_AVX2_BUILD`): the target attribute, horizontal sums, unaligned loads, and
 * 4 bytes broadcast to every lane. */
#ifndef KVLAB_QK_AVX2_H
#define KVLAB_QK_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define KV_TGT __attribute__((target("avx2,fma,f16c")))
#define KV_INL static inline __attribute__((always_inline)) KV_TGT

KV_INL float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

KV_INL int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

KV_INL __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 4 bytes into every 32-bit lane */
KV_INL __m256i bcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* 8 bytes, one per weight row -> lane k = (c_k, c_k) as int16, the scale operand of a madd
 * against int16 pair sums: one byte shuffle of the 8 bytes broadcast. Unsigned bytes go to
 * the low byte of each int16 (the high one zeroed), signed ones to the high byte, and a
 * shift by 8 then extends the sign. */
KV_INL __m256i pairs_u8(const void *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return _mm256_shuffle_epi8(_mm256_set1_epi64x(v), _mm256_setr_epi8(
        0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1,
        4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7, -1));
}

KV_INL __m256i pairs_i8(const void *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return _mm256_srai_epi16(_mm256_shuffle_epi8(_mm256_set1_epi64x(v), _mm256_setr_epi8(
        -1, 0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3,
        -1, 4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7)), 8);
}

/* 16 signed bytes a[8], b[8] -> lane k = (a_k, b_k) as int16 */
KV_INL __m256i pairs2_i8(const void *p) {
    return _mm256_srai_epi16(_mm256_shuffle_epi8(
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p)), _mm256_setr_epi8(
            -1, 0, -1, 8, -1, 1, -1, 9, -1, 2, -1, 10, -1, 3, -1, 11,
            -1, 4, -1, 12, -1, 5, -1, 13, -1, 6, -1, 14, -1, 7, -1, 15)), 8);
}

/* e^x for x <= 0: 2^n * e^r, |r| <= ln2 / 2, degree-7 Taylor (error ~5e-9); x is clamped
 * at -87 so that 2^n stays a normal float (e^-87 is far below any softmax weight kept). */
KV_INL __m256 exp8_nonpos(__m256 x) {
    static const float poly[8] = {1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f,
                                  1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(poly[0]);
    for (int k = 1; k < 8; k++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(poly[k]));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* an 8-row K-quant group's scales and mins (12 packed bytes per row stored [byte j][row k])
 * into kv_k8_scales, as kv_scale_min_k4 gives them: with A, B, C the packed bytes 0-3, 4-7
 * and 8-11 (32 B each), sub-blocks 0-3 take A & 63 and B & 63, sub-blocks 4-7 the low (scale)
 * or high (min) nibble of C with bits 6-7 of A or B as bits 4-5 (16-bit shifts: the masks drop
 * what crosses a byte). 3 loads and 11 operations for the 8 rows. */
KV_INL const kv_k8_scales *k8_unpack_scales(const uint8_t (*packed)[8], kv_k8_scales *u) {
    const __m256i m63 = _mm256_set1_epi8(63), m4 = _mm256_set1_epi8(0x0F);
    const __m256i hi2 = _mm256_set1_epi8(0x30);
    const __m256i A = load256(packed[0]), B = load256(packed[4]), C = load256(packed[8]);
    _mm256_storeu_si256((__m256i *)u->sc[0], _mm256_and_si256(A, m63));
    _mm256_storeu_si256((__m256i *)u->m[0], _mm256_and_si256(B, m63));
    _mm256_storeu_si256((__m256i *)u->sc[4],
                        _mm256_or_si256(_mm256_and_si256(C, m4),
                                        _mm256_and_si256(_mm256_srli_epi16(A, 2), hi2)));
    _mm256_storeu_si256((__m256i *)u->m[4],
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(C, 4), m4),
                                        _mm256_and_si256(_mm256_srli_epi16(B, 2), hi2)));
    return u;
}

#endif
