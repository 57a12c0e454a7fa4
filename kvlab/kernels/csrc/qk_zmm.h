/* 512-bit helpers for the AVX512-VNNI kernels of the 8-row groups (included after qk_avx2.h
 * inside `#ifdef KV_HAVE_AVX2_BUILD`).
 *
 * A group keeps one 32-bit lane per weight row, 8 rows to a 256-bit register. At 512 bits
 * lanes 2r and 2r + 1 hold row r's chunks t and t + 1 (4 bytes each), so one vpdpbusd
 * against x's 8 bytes 4t..4t+7 broadcast as a qword does what two 256-bit ones do: half the
 * multiplies, broadcasts and scale steps per product. The two lanes of a row are summed once
 * per super-block (zfold). Every sum is the same exact integer as the 256-bit kernels', so the
 * bits are the same. On an AMD EPYC (Zen 4), one thread, Q4_Kx8 at 256 x rows, the 512-bit
 * tiles give 266 GFLOP/s where the 256-bit ones give 227. */
#ifndef KVLAB_QK_ZMM_H
#define KVLAB_QK_ZMM_H

#define KV_TGT_Z __attribute__((target(KV_ISA_ZMM)))
#define KV_INL_Z static inline __attribute__((always_inline)) KV_TGT_Z
/* x rows from which the 512-bit tiles are used: at batch 1 a chunk pair's permute is not
 * shared by other x rows, and the 256-bit VNNI tiles are faster (Q4_Kx8 143 against 125
 * GFLOP/s, Q2_Kx8 135 against 119), at 4 rows slower (158 against 207, 223 against 230) */
#define KV_ZMM_MIN_N 2

/* two chunks of 8 rows -> lanes 2r, 2r + 1 = row r's lane of a, of b */
KV_INL_Z __m512i zpair(__m256i a, __m256i b) {
    const __m512i idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    return _mm512_permutex2var_epi32(_mm512_castsi256_si512(a), idx, _mm512_castsi256_si512(b));
}

/* two chunks adjacent in memory (64 bytes), paired as zpair pairs them */
KV_INL_Z __m512i zpair_load(const void *p) {
    const __m512i idx = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    return _mm512_permutexvar_epi32(idx, _mm512_loadu_si512(p));
}

/* c + w . (x's 8 bytes at p: bytes 0-3 against the even lanes, 4-7 against the odd) */
KV_INL_Z __m512i zdot(__m512i c, __m512i w, const int8_t *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return _mm512_dpbusd_epi32(c, w, _mm512_set1_epi64(v));
}

/* a row's 8 scale bytes -> lanes 2r and 2r + 1 = byte r as int32 */
KV_INL_Z __m512i zdup_u8(const uint8_t *p) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return zpair(v, v);
}

/* Two groups at once (16 rows, lane r = row r): 32 bytes of group a's block, then b's */
KV_INL_Z __m512i z16_load(const void *a, const void *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* the fp16 row scales of two groups' blocks as 16 floats */
KV_INL_Z __m512 z16_scales(const kv_half *a, const kv_half *b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
        _mm_loadu_si128((const __m128i *)b), 1));
}

/* The tile of two groups at once (b and b + nb: 16 rows, lane r = row r; y and y + 8) against
 * nx x rows: sums(A, B, i, xq, xs, nx, isum) adds super-block i's exact integers per x row,
 * then acc = fma(d * d_x, isum, acc) as the 8-row tiles do, so the same bits. */
#define KV_ZMM_TILE2(name, blk_t, sums)                                                     \
    KV_INL_Z void name(const blk_t *b, int64_t nb, const char *xq, int64_t xs, const int nx, \
                       float *y, int64_t ys) {                                              \
        const blk_t *B = b + nb;                                                            \
        __m512 acc[KV_GROUP_NX];                                                            \
        for (int j = 0; j < nx; j++) acc[j] = _mm512_setzero_ps();                          \
        for (int64_t i = 0; i < nb; i++) {                                                  \
            __m512i isum[KV_GROUP_NX];                                                      \
            for (int j = 0; j < nx; j++) isum[j] = _mm512_setzero_si512();                  \
            sums(b + i, B + i, i, xq, xs, nx, isum);                                        \
            const __m512 dw = z16_scales(b[i].d, B[i].d);                                   \
            for (int j = 0; j < nx; j++) {                                                  \
                const __m512 dx = _mm512_set1_ps(((const kv_act256 *)(xq + j * xs) + i)->d); \
                acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(isum[j]), \
                                         acc[j]);                                           \
            }                                                                               \
        }                                                                                   \
        for (int j = 0; j < nx; j++) _mm512_storeu_ps(y + j * ys, acc[j]);                 \
    }

/* super-block `ahead` of both groups (A and B rows) prefetched, bytes [off, off + 128) */
KV_INL_Z void z16_prefetch(const void *a, const void *b, int64_t off) {
    for (int k = 0; k < 2; k++) {
        const char *p = (const char *)(k ? b : a) + off;
        _mm_prefetch(p, _MM_HINT_T0);
        _mm_prefetch(p + 64, _MM_HINT_T0);
    }
}

/* lanes 2r and 2r + 1 summed -> lane r of 8 */
KV_INL_Z __m256i zfold(__m512i v) {
    return _mm512_cvtepi64_epi32(_mm512_add_epi32(v, _mm512_srli_epi64(v, 32)));
}

/* each row's lane duplicated: lanes 2r and 2r + 1 = lane r of v */
KV_INL_Z __m512i zdup(__m256i v) {
    const __m512i idx = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    return _mm512_permutexvar_epi32(idx, _mm512_castsi256_si512(v));
}

/* Two sub-blocks' partial dots (each lane below 2^15 in magnitude) times their scales:
 * acc + lo * (sc_lo) + hi * (sc_hi) per lane, with sc the int16 pairs (sc_lo, sc_hi). One
 * vpdpwssd for two sub-blocks where vpmulld would take two. */
KV_INL_Z __m512i zscale2(__m512i acc, __m512i lo, __m512i hi, __m512i sc) {
    const __m512i v = _mm512_ternarylogic_epi32(lo, _mm512_set1_epi32(0xFFFF),
                                                _mm512_slli_epi32(hi, 16), 0xEA); /* a&b | c */
    return _mm512_dpwssd_epi32(acc, v, sc);
}

/* ymm int16 pairs (a_r, b_r) per row lane -> zmm lanes 2r and 2r + 1 = that pair */
KV_INL_Z __m256i pack16(__m256i a, __m256i b) {
    return _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(b, 16));
}
KV_INL_Z __m512i zpairs16(__m256i a, __m256i b) { return zdup(pack16(a, b)); }

/* For sums of a per-row weight v_s times x's 16-sums: w[q] lane 2r is an int16 pair for
 * x's bsums 4q, 4q + 1 and lane 2r + 1 one for bsums 4q + 2, 4q + 3 (row r). */
KV_INL_Z __m512i zpair_sums(const __m512i w[4], const int16_t *bsums) {
    __m512i s = _mm512_setzero_si512();
    for (int q = 0; q < 4; q++) {
        int64_t b;
        memcpy(&b, bsums + 4 * q, 8);
        s = _mm512_dpwssd_epi32(s, w[q], _mm512_set1_epi64(b));
    }
    return s;
}

/* w for 32-element sub-blocks (v[s][r] unsigned, s = 0..7, each against both its 16-sums) */
KV_INL_Z void zsub32(const uint8_t (*v)[8], __m512i w[4]) {
    for (int q = 0; q < 4; q++) {
        __m256i h[2];
        for (int k = 0; k < 2; k++) {
            const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)v[2 * q + k]));
            h[k] = pack16(x, x);
        }
        w[q] = zpair(h[0], h[1]);
    }
}

/* The tile of a K-quant group with scales and mins (Q4_Kx8, Q5_Kx8: both keep the 12 packed
 * bytes as scales[12][8]) against nx x rows: a super-block's scales and mins are unpacked
 * into kv_k8_scales u, sub(b, u, p, x, xs, nx, isum) adds sub-blocks 2p and 2p + 1's scaled
 * products (lane pairs); per super-block acc = fma(d * d_x, isum, acc),
 * acc = fma(-(dmin * d_x), msum, acc) as the 256-bit kernels do, msum from the mins as int16
 * pairs. */
#define KV_ZMM_KMIN_TILE(name, blk_t, sub)                                                  \
    KV_INL_Z void name(const blk_t *b, int64_t nb, const char *xq, int64_t xs, const int nx,  \
                       float *y, int64_t ys) {                                              \
        __m256 acc[KV_GROUP_NX];                                                            \
        for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();                          \
        for (int64_t i = 0; i < nb; i++) {                                                  \
            __m512i isum[KV_GROUP_NX], mw[4];                                               \
            for (int j = 0; j < nx; j++) isum[j] = _mm512_setzero_si512();                  \
            const char *xi = xq + i * (int64_t)sizeof(kv_act256);                           \
            kv_k8_scales uk;                                                                \
            const kv_k8_scales *u = k8_unpack_scales(b[i].scales, &uk);                     \
            for (int p = 0; p < 4; p++) sub(b + i, u, p, xi, xs, nx, isum);                \
            zsub32(u->m, mw);                                                               \
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].d));    \
            const __m256 mwf = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].dmin)); \
            for (int j = 0; j < nx; j++) {                                                  \
                const kv_act256 *a = (const kv_act256 *)(xi + j * xs);                      \
                const __m256 dx = _mm256_set1_ps(a->d);                                     \
                acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx),                             \
                                         _mm256_cvtepi32_ps(zfold(isum[j])), acc[j]);       \
                acc[j] = _mm256_fnmadd_ps(_mm256_mul_ps(mwf, dx),                           \
                                          _mm256_cvtepi32_ps(zfold(zpair_sums(mw, a->bsums))), \
                                          acc[j]);                                          \
            }                                                                               \
        }                                                                                   \
        for (int j = 0; j < nx; j++) _mm256_storeu_ps(y + j * ys, acc[j]);                 \
    }

/* ---- byte rows: prefill with many x rows ----
 * A type whose values (with their scales, where they fit) make bytes is turned, one pair of
 * groups (16 rows) at a time, into 64 chunks of bytes per super-block (lane r = row r, chunk
 * k = values 4k..4k+3), plus what its tile needs per super-block (scales, mins): `per`
 * vectors in all. That is done once per pass over up to KV_BYTES_XBYTES of x (at 512 x rows
 * about 1/80 of the multiplies), and every x row's tile then reads ready bytes. */
#define KV_BYTES_MIN_N 32
#define KV_BYTES_XBYTES (1024 * 1024)
typedef struct { const __m512i *w; const void *b; } kv_bytes;  /* a pair's bytes, its blocks */

/* x rows a pass takes: about KV_BYTES_XBYTES of them, a multiple of KV_GROUP_NX */
static inline int64_t kv_bytes_pass_rows(int64_t xstride) {
    const int64_t rows = KV_BYTES_XBYTES / xstride / KV_GROUP_NX;
    return rows > 0 ? rows * KV_GROUP_NX : KV_GROUP_NX;
}

/* int32 lanes (small) -> the value in both int16 halves */
KV_INL_Z __m512i zdup16(__m512i s32) {
    return _mm512_or_si512(_mm512_and_si512(s32, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(s32, 16));
}

/* The driver: x in passes; per pass each pair of groups made into bytes by convert(A, B,
 * out) and run against the pass's x rows by tile(&kv_bytes, ...); a lone last group (or no
 * memory for the bytes) takes the one-group tile tile1 */
#define KV_BYTES_GEMV(name, blk_t, per, convert, tile, tile1)                                \
    static KV_TGT_Z void name(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,    \
                              int64_t cols, const void *xq, int64_t xstride, int64_t n,      \
                              float *y, int64_t ystride) {                                   \
        const int64_t nb = cols / 256, step = kv_bytes_pass_rows(xstride);                   \
        __m512i *buf = aligned_alloc(64, (size_t)nb * (per) * sizeof(__m512i));              \
        for (int64_t c = 0; c < n; c += step) {                                              \
            const char *x = (const char *)xq + c * xstride;                                  \
            const int64_t m = n - c < step ? n - c : step;                                   \
            float *yc = y + c * ystride;                                                     \
            for (int64_t r = r0; r < r1;) {                                                  \
                const blk_t *b = (const blk_t *)(w + r * row_bytes);                         \
                if (buf && r1 - r >= 16) {                                                   \
                    for (int64_t i = 0; i < nb; i++) convert(b + i, b + nb + i, buf + (per) * i); \
                    const kv_bytes k = {buf, b};                                             \
                    KV_GROUP_TILES(tile, &k, nb, x, xstride, m, yc + r, ystride);            \
                    r += 16;                                                                 \
                } else {                                                                     \
                    KV_GROUP_TILES(tile1, b, nb, x, xstride, m, yc + r, ystride);            \
                    r += 8;                                                                  \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        free(buf);                                                                           \
    }

#endif
