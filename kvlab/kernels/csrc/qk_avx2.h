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

#endif
