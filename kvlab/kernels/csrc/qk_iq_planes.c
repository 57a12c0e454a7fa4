/* IQ2_XXS, IQ2_XS, IQ3_XXS and IQ3_S decode (fewer than 8 x rows) in value planes, with
 * AVX512-VBMI.
 *
 * These types pick each run of 8 (IQ2) or 4 (IQ3) values as a row of a 256-row grid by an
 * index byte, or of a 512-row one by a byte and a ninth bit (IQ2_XS, IQ3_S; qk_iq2_iq3.c has
 * the formats). The row kernels there load one grid row per index, and those loads and
 * inserts are what a decode step spends its time on. Here 64 indices are looked up at once
 * per value position p (plane p: value p of each grid row): a grid's plane is 256 bytes,
 * which two vpermt2b and a blend on the index's top bit read (512: that twice, and a blend on
 * the ninth bit). IQ2_XS looks up two bytes of 2-bit codes instead of 8 planes (pl_codes).
 *
 * Byte k of plane p is value p of grid row k, so x is reordered once per call to match:
 * xp[p][k] = x[P k + p] (P = values per grid row). A dword lane L of a plane holds grid rows
 * 4L .. 4L + 3, which lie in one sub-block (IQ2: lane L = sub-block L of the pair of
 * super-blocks a register holds; IQ3: lanes 2s, 2s + 1 = sub-block s). So the planes'
 * vpdpbusd (unsigned grid values against x with the values' signs) leave each sub-block's
 * sum in its own lanes, and one vpmulld applies the scales (2 s + 1). IQ2_XS's scales are per
 * 16 values, two grid rows, an int16 lane of maddubs: there vpdpwssd scales each plane's
 * pairs. The sum per super-block is the row kernels' exact integer and the float steps are
 * theirs, in order, so every path gives the same bits.
 *
 * Signs: IQ2_XXS, IQ2_XS and IQ3_XXS give a 7-bit index per 8 values whose parity is the 8th
 * sign, IQ3_S a bit per value; byte k of the sign vector holds grid row k's signs (its 8, or
 * its 4 in the low nibble), and bit p of it negates plane p's x at byte k (a masked subtract:
 * vpdpbusd and maddubs take the weights unsigned).
 */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "qk.h"

#ifdef KV_HAVE_AVX2_BUILD
#include "qk_avx2.h"

#ifdef KV_EMULATE_512
#define KV_ISA_VBMI KV_ISA_ZMM
#else
#define KV_ISA_VBMI KV_ISA_ZMM ",avx512vbmi"
#endif
#define KV_INL_B static inline __attribute__((always_inline, target(KV_ISA_VBMI)))

/* A type's planes (plane p: pl_rows bytes, value p of each grid row), and what the kernels
 * take from qk_iq2_iq3.c, which owns the formats: the super-block's bytes and unit (value =
 * d * unit * scale * grid value) */
typedef struct { uint8_t *planes; int bytes; float unit; int ready; } kv_pl_type;
static uint8_t planes_iq2xxs[8 * 256] __attribute__((aligned(64)));
static uint8_t planes_iq3xxs[4 * 256] __attribute__((aligned(64)));
static uint8_t planes_iq3s[4 * 512] __attribute__((aligned(64)));
static uint8_t codes_iq2xs[2 * 512] __attribute__((aligned(64)));
static kv_pl_type pl_types[4] = {{planes_iq2xxs, 0, 0, 0}, {planes_iq3xxs, 0, 0, 0},
                                 {planes_iq3s, 0, 0, 0}, {codes_iq2xs, 0, 0, 0}};

static inline kv_pl_type *pl_type(int qt) {
    return qt == KV_IQ2_XXS ? &pl_types[0] : qt == KV_IQ3_XXS ? &pl_types[1]
         : qt == KV_IQ3_S ? &pl_types[2] : qt == KV_IQ2_XS ? &pl_types[3] : NULL;
}
static inline int pl_P(int qt) { return qt == KV_IQ3_XXS || qt == KV_IQ3_S ? 4 : 8; }
static inline int pl_rows(int qt) { return qt == KV_IQ3_S || qt == KV_IQ2_XS ? 512 : 256; }
/* IQ2_XS keeps its grid as 2-bit codes of the values 8, 25, 43: a row's 8 codes in two bytes
 * (values 0-3, 4-7), two byte tables where planes would take 8, each lookup costing four
 * vpermt2b and three blends at 512 rows. (IQ2_S's 1024 rows cost twice that: with codes its
 * decode was no faster than its row kernel's, so it keeps that.) */
static inline int pl_codes(int qt) { return qt == KV_IQ2_XS; }
static const uint8_t kv_iq2_levels[4] = {8, 25, 43, 0};

/* a grid's planes (or codes) into dst; 0 where an IQ2_XS value has no code */
static int pl_fill(int qtype, const uint8_t *grid, uint8_t *dst) {
    const int P = pl_P(qtype), rows = pl_rows(qtype);
    for (int r = 0; r < rows; r++) {
        unsigned code = 0;
        for (int p = 0; p < P; p++) {
            const uint8_t v = grid[P * r + p];
            const int c = v == kv_iq2_levels[0] ? 0 : v == kv_iq2_levels[1] ? 1
                        : v == kv_iq2_levels[2] ? 2 : 3;
            if (pl_codes(qtype) && c == 3) return 0;
            code |= (unsigned)c << 2 * p;
            if (!pl_codes(qtype)) dst[p * rows + r] = v;
        }
        if (pl_codes(qtype)) dst[r] = (uint8_t)code, dst[rows + r] = (uint8_t)(code >> 8);
    }
    return 1;
}

void kv_iq_planes_set(int qtype, const uint8_t *grid, int64_t bytes, int block_bytes,
                      float unit) {
    kv_pl_type *t = pl_type(qtype);
    if (!t || bytes != (int64_t)pl_rows(qtype) * pl_P(qtype) || !pl_fill(qtype, grid, t->planes))
        return;
    t->bytes = block_bytes, t->unit = unit, t->ready = 1;
}

static int use_vbmi(void) {
    static int vbmi = -1;  /* racy first call: every thread computes the same answer */
    if (vbmi < 0)
#ifdef KV_EMULATE_512
        vbmi = kv_use_vnni() && !getenv("KVLAB_NO_VBMI");
#else
        vbmi = kv_use_vnni() && !getenv("KVLAB_NO_VBMI") && __builtin_cpu_supports("avx512vbmi");
#endif
    return vbmi;
}

int kv_iq_planes_active(void) {
    int ready = 1;
    for (int k = 0; k < 4; k++) ready &= pl_types[k].ready;
    return use_vbmi() && ready;
}

#define KV_PL_NX 4     /* x rows per pass over a weight row */
#define KV_PL_MAX_N 7  /* the most x rows (from 8 qk_iq2_iq3.c's prefill tiles run) */

/* ---- x in planes: per register of 64 grid rows, P planes of 64 bytes ----
 * IQ2 types: super-blocks 2m, 2m + 1 -> register m (plane p's byte 32h + k = value 8k + p of
 * super-block 2m + h; a missing second super-block's half is 0); IQ3_XXS, IQ3_S: super-block
 * i -> register i (plane p's byte k = value 4k + p). A 64-value chunk of x is R = 64 / P grid
 * rows, put in plane order by one vpermb and copied out plane by plane. */
KV_INL_B void x_planes(const int P, const kv_act256 *a, int64_t nb, int8_t *xp) {
    const __m512i t = P == 8 ? _mm512_setr_epi32(  /* byte 8p + r <- byte 8r + p */
        0x18100800, 0x38302820, 0x19110901, 0x39312921, 0x1A120A02, 0x3A322A22, 0x1B130B03,
        0x3B332B23, 0x1C140C04, 0x3C342C24, 0x1D150D05, 0x3D352D25, 0x1E160E06, 0x3E362E26,
        0x1F170F07, 0x3F372F27)
        : _mm512_setr_epi32(  /* byte 16p + r <- byte 4r + p */
        0x0C080400, 0x1C181410, 0x2C282420, 0x3C383430, 0x0D090501, 0x1D191511, 0x2D292521,
        0x3D393531, 0x0E0A0602, 0x1E1A1612, 0x2E2A2622, 0x3E3A3632, 0x0F0B0703, 0x1F1B1713,
        0x2F2B2723, 0x3F3B3733);
    const int R = 64 / P, spz = P == 8 ? 2 : 1;
    if (nb % spz) memset(xp + 64 * P * (nb / spz), 0, (size_t)(64 * P));
    for (int64_t i = 0; i < nb; i++) {
        int8_t *dst = xp + 64 * P * (i / spz) + 32 * (i % spz);
        for (int q = 0; q < 4; q++) {  /* grid rows R q .. R q + R - 1 */
            int8_t part[64] __attribute__((aligned(64)));
            const __m512i chunk = _mm512_loadu_si512(a[i].qs + 64 * q);
            _mm512_store_si512(part, _mm512_permutexvar_epi8(t, chunk));
            for (int p = 0; p < P; p++) memcpy(dst + 64 * p + R * q, part + R * p, (size_t)R);
        }
    }
}

/* ---- a register of 64 indices: grid values per plane, signs, scales ---- */

/* bytes of 7 sign bits -> with their parity as bit 7 (ksign) */
KV_INL_B __m512i with_parity512(__m512i b7) {
    const __m512i par = _mm512_broadcast_i32x4(_mm_setr_epi8(  /* a nibble's parity, at bit 7 */
        0, -128, -128, 0, -128, 0, 0, -128, -128, 0, 0, -128, 0, -128, -128, 0));
    const __m512i nib = _mm512_and_si512(_mm512_xor_si512(b7, _mm512_srli_epi16(b7, 4)),
                                         _mm512_set1_epi8(15));
    return _mm512_or_si512(b7, _mm512_shuffle_epi8(par, nib));
}

/* the 7-bit fields of each 64-bit lane of v at the bit offsets of ctl's bytes, as ksigns */
KV_INL_B __m512i ksigns512(__m512i v, long long ctl) {
    return with_parity512(_mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(ctl), v),
                                           _mm512_set1_epi8(0x7F)));
}

/* 2 s + 1 for a scale nibble s in each lane */
KV_INL_B __m512i odd_of(__m512i s) {
    return _mm512_or_si512(_mm512_add_epi32(s, s), _mm512_set1_epi32(1));
}
/* the scales of a lane's word whose top 4 bits are the nibble */
KV_INL_B __m512i odd_scales(__m512i aux) { return odd_of(_mm512_srli_epi32(aux, 28)); }

/* a register's 64 grid rows: index bytes (bits 0-7), bit 8 as a mask, the rows' sign bytes,
 * and the scales (int32 per lane; IQ2_XS: int16 per two grid rows) */
typedef struct { __m512i idx, signs, sc; __mmask64 ninth; } kv_pl_regs;

/* IQ2_XXS super-blocks A and B (NULL: none, its lanes 0): byte k of idx and signs = grid row
 * k (B's from 32), lane L of sc = sub-block L's scale (B's from 8) */
KV_INL_B kv_pl_regs regs_iq2(const uint8_t *A, const uint8_t *B) {
    const __m512i qa = _mm512_loadu_si512(A + 2);
    const __m512i qb = B ? _mm512_loadu_si512(B + 2) : _mm512_setzero_si512();
    const __m512i pick = _mm512_setr_epi32(  /* index bytes: bytes 0-3 of each 8 */
        0x03020100, 0x0B0A0908, 0x13121110, 0x1B1A1918, 0x23222120, 0x2B2A2928, 0x33323130,
        0x3B3A3938, 0x43424140, 0x4B4A4948, 0x53525150, 0x5B5A5958, 0x63626160, 0x6B6A6968,
        0x73727170, 0x7B7A7978);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                          29, 31);
    const __m512i aux = _mm512_permutex2var_epi32(qa, odd, qb);  /* lane L: sub-block L's word */
    return (kv_pl_regs){_mm512_permutex2var_epi8(qa, pick, qb),
                        ksigns512(aux, 0x352E2720150E0700ll),  /* fields 0-3 of each word */
                        odd_scales(aux), 0};
}

/* byte pairs (s_2m, s_2m+1) of ks -> low nibble of s_2m, high nibble of s_2m+1, each in
 * its byte's low 4 bits: grid rows 2m and 2m + 1's signs, where one byte holds both */
KV_INL_B __m512i nibble_signs(__m512i ks) {
    return _mm512_or_si512(_mm512_and_si512(ks, _mm512_set1_epi16(0x000F)),
                           _mm512_and_si512(_mm512_srli_epi16(ks, 4), _mm512_set1_epi16(0x0F00)));
}

/* IQ3_XXS super-block A: byte k of idx = grid row k; its signs in the low nibble of byte k
 * (grid rows 2l, 2l + 1 of a sub-block share sign byte l: low nibble, then high); lanes 2s,
 * 2s + 1 of sc = sub-block s's scale */
KV_INL_B kv_pl_regs regs_iq3(const uint8_t *A) {
    const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i aux = _mm512_permutexvar_epi32(
        dup, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(A + 66))));
    const __m512i ks = ksigns512(aux, 0x15150E0E07070000ll);  /* fields 0 0 1 1 2 2 3 3 */
    return (kv_pl_regs){_mm512_loadu_si512(A + 2), nibble_signs(ks), odd_scales(aux), 0};
}

/* IQ3_S super-block A: idx the indices' low bytes, ninth their bit 8 (qh: bit k for grid row
 * k); sign byte m (a bit per value) holds grid rows 2m, 2m + 1; sub-block s's scale nibble s
 * of the word at 106 */
KV_INL_B kv_pl_regs regs_iq3s(const uint8_t *A) {
    const __m512i half = _mm512_setr_epi32(  /* byte k <- byte k / 2 */
        0x01010000, 0x03030202, 0x05050404, 0x07070606, 0x09090808, 0x0B0B0A0A, 0x0D0D0C0C,
        0x0F0F0E0E, 0x11111010, 0x13131212, 0x15151414, 0x17171616, 0x19191818, 0x1B1B1A1A,
        0x1D1D1C1C, 0x1F1F1E1E);
    const __m512i sg = _mm512_permutexvar_epi8(
        half, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(A + 74))));
    uint32_t nib;
    uint64_t ninth;
    memcpy(&nib, A + 106, 4);
    memcpy(&ninth, A + 66, 8);
    const __m512i shift = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24,
                                            28, 28);
    const __m512i s = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)nib), shift),
                                       _mm512_set1_epi32(15));
    return (kv_pl_regs){_mm512_loadu_si512(A + 2), nibble_signs(sg), odd_of(s), ninth};
}

/* 8 scale bytes of A and of B (NULL: 0), a nibble per 16 values -> 2 s + 1 as int16, lane m
 * for grid rows 2m, 2m + 1 */
KV_INL_B __m512i scales16(const uint8_t *A, const uint8_t *B) {
    uint64_t a, b = 0;
    memcpy(&a, A, 8);
    if (B) memcpy(&b, B, 8);
    const __m128i v = _mm_set_epi64x((long long)b, (long long)a), m = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    const __m512i s = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(lo, hi),
                                                            _mm_unpacklo_epi8(lo, hi)));
    return _mm512_or_si512(_mm512_add_epi16(s, s), _mm512_set1_epi16(1));
}

/* IQ2_XS super-blocks A and B (NULL: none): a 16-bit word per grid row, the index in bits
 * 0-8 and the 7 sign bits of a ksign above; the scales at 66 */
KV_INL_B kv_pl_regs regs_iq2xs(const uint8_t *A, const uint8_t *B) {
    const __m512i qa = _mm512_loadu_si512(A + 2);
    const __m512i qb = B ? _mm512_loadu_si512(B + 2) : _mm512_setzero_si512();
    const __m512i even = _mm512_setr_epi32(  /* low bytes of the words */
        0x06040200, 0x0E0C0A08, 0x16141210, 0x1E1C1A18, 0x26242220, 0x2E2C2A28, 0x36343230,
        0x3E3C3A38, 0x46444240, 0x4E4C4A48, 0x56545250, 0x5E5C5A58, 0x66646260, 0x6E6C6A68,
        0x76747270, 0x7E7C7A78);
    const __m512i high = _mm512_permutex2var_epi8(
        qa, _mm512_add_epi8(even, _mm512_set1_epi8(1)), qb);
    const __m512i b7 = _mm512_and_si512(_mm512_srli_epi16(high, 1), _mm512_set1_epi8(0x7F));
    return (kv_pl_regs){_mm512_permutex2var_epi8(qa, even, qb), with_parity512(b7),
                        scales16(A + 66, B ? B + 66 : NULL),
                        _mm512_test_epi8_mask(high, _mm512_set1_epi8(1))};
}

/* plane p of a grid (256 bytes) at 64 indices; top: the indices' bit 7 */
KV_INL_B __m512i plane_at(const uint8_t *plane, __m512i idx, __mmask64 top) {
    const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(plane), idx,
                                                _mm512_load_si512(plane + 64));
    const __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(plane + 128), idx,
                                                _mm512_load_si512(plane + 192));
    return _mm512_mask_blend_epi8(top, lo, hi);
}

/* plane p of a 512-row grid: rows 0-255, then 256-511, picked by the ninth bit */
KV_INL_B __m512i plane512_at(const uint8_t *plane, __m512i idx, __mmask64 top, __mmask64 ninth) {
    return _mm512_mask_blend_epi8(ninth, plane_at(plane, idx, top),
                                  plane_at(plane + 256, idx, top));
}

/* a byte table of `rows` (256 or 512) at a register's indices */
KV_INL_B __m512i table_at(const uint8_t *t, const int rows, const kv_pl_regs *u, __mmask64 top) {
    return rows == 256 ? plane_at(t, u->idx, top) : plane512_at(t, u->idx, top, u->ninth);
}

/* plane p's grid values from the codes of values 0-3 (lo) or 4-7 (hi) */
KV_INL_B __m512i code_plane(__m512i lo, __m512i hi, const int p) {
    int32_t four;  /* kv_iq2_levels in every dword: byte c of a 16-byte lane is level c % 4 */
    memcpy(&four, kv_iq2_levels, 4);
    const __m512i levels = _mm512_set1_epi32(four);
    const __m512i c = p % 4 ? _mm512_srli_epi16(p < 4 ? lo : hi, 2 * (p % 4)) : p < 4 ? lo : hi;
    return _mm512_shuffle_epi8(levels, _mm512_and_si512(c, _mm512_set1_epi8(3)));
}

/* one weight row (nb super-blocks at b) against nx x rows: xp[j] row j's planes, a[j] its
 * blocks; per super-block the row kernels' integer, then acc = fma(d * unit * d_x, isum, acc)
 * in super-block order */
KV_INL_B void row_planes(const int qt, const uint8_t *b, int64_t nb, int8_t *const *xp,
                         const kv_act256 *const *a, const int nx, float *y, int64_t ys) {
    const kv_pl_type *t = pl_type(qt);
    const int iq2 = pl_P(qt) == 8, P = pl_P(qt), spz = iq2 ? 2 : 1, bytes = t->bytes;
    const float unit = t->unit;
    float acc[KV_PL_NX] = {0};
    for (int64_t i = 0; i < nb; i += spz) {
        const uint8_t *A = b + i * bytes, *B = iq2 && i + 1 < nb ? A + bytes : NULL;
        for (int c = 0; c < spz * bytes + 63; c += 64)  /* the stream runs on into the next row */
            _mm_prefetch((const char *)A + KV_IQ_AHEAD + c, _MM_HINT_T0);
        const kv_pl_regs u = qt == KV_IQ2_XXS ? regs_iq2(A, B) : qt == KV_IQ2_XS ? regs_iq2xs(A, B)
                           : qt == KV_IQ3_XXS ? regs_iq3(A) : regs_iq3s(A);
        const __mmask64 top = _mm512_movepi8_mask(u.idx);
        const int64_t off = i / spz * 64 * P;
        __m512i s[KV_PL_NX][2];
        for (int j = 0; j < nx; j++) s[j][0] = s[j][1] = _mm512_setzero_si512();
        const int rows = pl_rows(qt), codes = pl_codes(qt);
        const __m512i lo = codes ? table_at(t->planes, rows, &u, top) : _mm512_setzero_si512();
        const __m512i hi = codes ? table_at(t->planes + rows, rows, &u, top) : lo;
        for (int p = 0; p < P; p++) {
            const __m512i w = codes ? code_plane(lo, hi, p)
                                    : table_at(t->planes + rows * p, rows, &u, top);
            const __mmask64 neg = _mm512_test_epi8_mask(u.signs, _mm512_set1_epi8((char)(1 << p)));
            for (int j = 0; j < nx; j++) {
                const __m512i x = _mm512_loadu_si512(xp[j] + off + 64 * p);
                const __m512i xs = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
                s[j][p & 1] = codes  /* scales per 16 values: int16 lane m, grid rows 2m, 2m+1 */
                    ? _mm512_dpwssd_epi32(s[j][p & 1], _mm512_maddubs_epi16(w, xs), u.sc)
                    : _mm512_dpbusd_epi32(s[j][p & 1], w, xs);
            }
        }
        const float dA = kv_h2f_table[A[0] | A[1] << 8] * unit;
        const float dB = B ? kv_h2f_table[B[0] | B[1] << 8] * unit : 0.0f;
        for (int j = 0; j < nx; j++) {
            const __m512i sum = _mm512_add_epi32(s[j][0], s[j][1]);
            const __m512i v = codes ? sum : _mm512_mullo_epi32(sum, u.sc);  /* lanes: sub-blocks */
            const __m256i va = _mm512_extracti64x4_epi64(v, 0);
            const __m256i vb = _mm512_extracti64x4_epi64(v, 1);
            if (!iq2) {
                acc[j] = fmaf(dA * a[j][i].d, (float)hsum_epi32(_mm256_add_epi32(va, vb)), acc[j]);
                continue;
            }
            acc[j] = fmaf(dA * a[j][i].d, (float)hsum_epi32(va), acc[j]);
            if (B) acc[j] = fmaf(dB * a[j][i + 1].d, (float)hsum_epi32(vb), acc[j]);
        }
    }
    for (int j = 0; j < nx; j++) y[j * ys] = acc[j];
}

/* rows [r0, r1) against n x rows (their planes made once), KV_PL_NX x rows per pass;
 * whether it ran (not without memory for the planes) */
KV_INL_B bool gemv_planes(const int qt, const uint8_t *w, int64_t row_bytes, int64_t r0,
                         int64_t r1, int64_t cols, const void *xq, int64_t xstride, int64_t n,
                         float *y, int64_t ystride) {
    const int64_t nb = cols / 256;
    const int spz = pl_P(qt) == 8 ? 2 : 1;
    const int64_t per = 64 * pl_P(qt) * ((nb + spz - 1) / spz);
    int8_t *buf = nb > 0 ? aligned_alloc(64, (size_t)(n * per)) : NULL;
    if (!buf) return false;
    int8_t *xp[KV_PL_MAX_N];
    const kv_act256 *a[KV_PL_MAX_N];
    for (int64_t j = 0; j < n; j++) {
        a[j] = (const kv_act256 *)((const char *)xq + j * xstride);
        xp[j] = buf + j * per;
        x_planes(pl_P(qt), a[j], nb, xp[j]);
    }
    for (int64_t r = r0; r < r1; r++)
        for (int64_t j = 0; j < n; j += KV_PL_NX) {
            const uint8_t *b = w + r * row_bytes;
            float *yj = y + j * ystride + r;
            switch (n - j >= KV_PL_NX ? KV_PL_NX : n - j) {
                case 4: row_planes(qt, b, nb, xp + j, a + j, 4, yj, ystride); break;
                case 3: row_planes(qt, b, nb, xp + j, a + j, 3, yj, ystride); break;
                case 2: row_planes(qt, b, nb, xp + j, a + j, 2, yj, ystride); break;
                default: row_planes(qt, b, nb, xp + j, a + j, 1, yj, ystride); break;
            }
        }
    free(buf);
    return true;
}

#define KV_PL_GEMV(name, qt)                                                                \
    static __attribute__((target(KV_ISA_VBMI))) bool name(                                  \
        const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t cols,          \
        const void *xq, int64_t xstride, int64_t n, float *y, int64_t ystride) {            \
        return gemv_planes(qt, w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);     \
    }
KV_PL_GEMV(gemv_planes_iq2xxs, KV_IQ2_XXS)
KV_PL_GEMV(gemv_planes_iq3xxs, KV_IQ3_XXS)
KV_PL_GEMV(gemv_planes_iq3s, KV_IQ3_S)
KV_PL_GEMV(gemv_planes_iq2xs, KV_IQ2_XS)

bool kv_gemv_iq_planes(int qt, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                       int64_t cols, const void *xq, int64_t xstride, int64_t n, float *y,
                       int64_t ystride) {
    const kv_pl_type *t = pl_type(qt);
    if (n < 1 || n > KV_PL_MAX_N || !t || !t->ready || !use_vbmi()) return false;
    return (qt == KV_IQ2_XXS ? gemv_planes_iq2xxs : qt == KV_IQ3_XXS ? gemv_planes_iq3xxs
            : qt == KV_IQ3_S ? gemv_planes_iq3s : gemv_planes_iq2xs)(
        w, row_bytes, r0, r1, cols, xq, xstride, n, y, ystride);
}

#endif /* KV_HAVE_AVX2_BUILD */
