/* AVX-512 through SIMDe, for testing only: with -DKV_EMULATE_512 (and -mavx2 -mfma -mf16c)
 * the kernel files build as the module _qk_emu512, whose VNNI and 512-bit kernels run as
 * AVX2 code, so a machine without AVX-512 checks their results bit for bit against the
 * AVX2 kernels (`make emu512`, then the tests' KVLAB_EMULATE_512=1 runs). Slow; never the
 * shipped build.
 *
 * Each AVX-512 intrinsic the kernels call is renamed here to SIMDe's portable version; the
 * AVX2 ones stay native. A new intrinsic in a kernel fails this build ("target specific
 * option mismatch") until it is added below. The few SIMDe 0.7.4 lacks are written here
 * from two 256-bit halves. */
#ifndef KV_QK_EMU512_H
#define KV_QK_EMU512_H

#include <immintrin.h>
#include <simde/x86/avx512.h>

static inline simde__m512i kv_emu_join_i(__m256i lo, __m256i hi) {
    simde__m512i_private r;
    r.m256i[0] = lo;
    r.m256i[1] = hi;
    return simde__m512i_from_private(r);
}

static inline simde__m512i kv_emu_cvtepi8_epi32(__m128i a) {
    return kv_emu_join_i(_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
}

static inline simde__m512i kv_emu_cvtepu8_epi32(__m128i a) {
    return kv_emu_join_i(_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
}

static inline simde__m512i kv_emu_srai_epi32(simde__m512i a, int n) {
    simde__m512i_private p = simde__m512i_to_private(a);
    return kv_emu_join_i(_mm256_srai_epi32(p.m256i[0], n), _mm256_srai_epi32(p.m256i[1], n));
}

static inline simde__m512 kv_emu_join_ps(__m256 lo, __m256 hi) {
    simde__m512_private r;
    r.m256[0] = lo;
    r.m256[1] = hi;
    return simde__m512_from_private(r);
}

static inline simde__m512 kv_emu_cvtepi32_ps(simde__m512i a) {
    simde__m512i_private p = simde__m512i_to_private(a);
    return kv_emu_join_ps(_mm256_cvtepi32_ps(p.m256i[0]), _mm256_cvtepi32_ps(p.m256i[1]));
}

static inline simde__m512 kv_emu_cvtph_ps(__m256i a) {
    return kv_emu_join_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(a)),
                          _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)));
}

#define __m512 simde__m512
#define __m512i simde__m512i
#define _mm512_cvtepi8_epi32 kv_emu_cvtepi8_epi32
#define _mm512_cvtepu8_epi32 kv_emu_cvtepu8_epi32
#define _mm512_srai_epi32 kv_emu_srai_epi32
#define _mm512_cvtepi32_ps kv_emu_cvtepi32_ps
#define _mm512_cvtph_ps kv_emu_cvtph_ps
#undef _mm256_dpbusd_epi32
#define _mm256_dpbusd_epi32 simde_mm256_dpbusd_epi32
#undef _mm256_dpwssd_epi32
#define _mm256_dpwssd_epi32 simde_mm256_dpwssd_epi32
#define _mm512_add_epi16 simde_mm512_add_epi16
#define _mm512_add_epi32 simde_mm512_add_epi32
#define _mm512_and_si512 simde_mm512_and_si512
#define _mm512_broadcast_i32x4 simde_mm512_broadcast_i32x4
#define _mm512_castps512_ps256 simde_mm512_castps512_ps256
#define _mm512_castps_pd simde_mm512_castps_pd
#define _mm512_castsi256_si512 simde_mm512_castsi256_si512
#define _mm512_cvtepi64_epi32 simde_mm512_cvtepi64_epi32
#define _mm512_dpbusd_epi32 simde_mm512_dpbusd_epi32
#define _mm512_dpwssd_epi32 simde_mm512_dpwssd_epi32
#define _mm512_extractf64x4_pd simde_mm512_extractf64x4_pd
#define _mm512_fmadd_ps simde_mm512_fmadd_ps
#define _mm512_fnmadd_ps simde_mm512_fnmadd_ps
#define _mm512_inserti64x4 simde_mm512_inserti64x4
#define _mm512_load_si512 simde_mm512_load_si512
#define _mm512_loadu_ps simde_mm512_loadu_ps
#define _mm512_loadu_si512 simde_mm512_loadu_si512
#define _mm512_mul_ps simde_mm512_mul_ps
#define _mm512_mullo_epi16 simde_mm512_mullo_epi16
#define _mm512_mullo_epi32 simde_mm512_mullo_epi32
#define _mm512_or_si512 simde_mm512_or_si512
#define _mm512_permutex2var_epi32 simde_mm512_permutex2var_epi32
#define _mm512_permutexvar_epi32 simde_mm512_permutexvar_epi32
#define _mm512_set1_epi16 simde_mm512_set1_epi16
#define _mm512_set1_epi32 simde_mm512_set1_epi32
#define _mm512_set1_epi64 simde_mm512_set1_epi64
#define _mm512_set1_epi8 simde_mm512_set1_epi8
#define _mm512_set1_ps simde_mm512_set1_ps
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 simde_mm512_setr_epi32
#define _mm512_setzero_ps simde_mm512_setzero_ps
#define _mm512_setzero_si512 simde_mm512_setzero_si512
#define _mm512_shuffle_epi8 simde_mm512_shuffle_epi8
#define _mm512_slli_epi16 simde_mm512_slli_epi16
#define _mm512_slli_epi32 simde_mm512_slli_epi32
#define _mm512_sllv_epi32 simde_mm512_sllv_epi32
#define _mm512_srli_epi16 simde_mm512_srli_epi16
#define _mm512_srli_epi32 simde_mm512_srli_epi32
#define _mm512_srli_epi64 simde_mm512_srli_epi64
#define _mm512_srlv_epi32 simde_mm512_srlv_epi32
#define _mm512_store_si512 simde_mm512_store_si512
#define _mm512_storeu_ps simde_mm512_storeu_ps
#define _mm512_sub_epi16 simde_mm512_sub_epi16
#define _mm512_sub_epi32 simde_mm512_sub_epi32
#define _mm512_ternarylogic_epi32 simde_mm512_ternarylogic_epi32
#define _mm512_xor_si512 simde_mm512_xor_si512

/* AVX512-VBMI and byte masks (qk_iq_planes.c) */
#define _mm512_add_epi8 simde_mm512_add_epi8
#define _mm512_cvtepi8_epi16 simde_mm512_cvtepi8_epi16
#define _mm512_extracti64x4_epi64 simde_mm512_extracti64x4_epi64
#define _mm512_maddubs_epi16 simde_mm512_maddubs_epi16
#define _mm512_mask_blend_epi8 simde_mm512_mask_blend_epi8
#define _mm512_mask_sub_epi8 simde_mm512_mask_sub_epi8
#define _mm512_movepi8_mask simde_mm512_movepi8_mask
#define _mm512_multishift_epi64_epi8 simde_mm512_multishift_epi64_epi8
#define _mm512_permutex2var_epi8 simde_mm512_permutex2var_epi8
#define _mm512_permutexvar_epi8 simde_mm512_permutexvar_epi8
#define _mm512_test_epi8_mask simde_mm512_test_epi8_mask

#endif
