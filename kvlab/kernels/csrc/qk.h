/* kvlab quantized kernels: GGUF block layouts, 8-bit activation blocks, kernel tables.
 *
 * Weights stay in their GGUF block format. A product y = x W^T first quantizes each row
 * of x to 8-bit blocks (kv_act32 for the 32-wide "legacy" types, kv_act256 for K-quants),
 * then every weight row is read once and dotted against all rows of x with integer math.
 *
 * The C files, named by what they hold, in layers that call only into the layers below:
 *
 *   qk_bindings.c             the Python module kvlab.kernels._qk: argument checks
 *   qk_decode.c/.h            a decode step's layers in one call, from a layer plan
 *   qk_moe.c/.h               a layer's routed experts
 *   qk_runtime.c/.h           active kernel set, job lock, scratch, products as row jobs
 *   the kernels, declared in this header:
 *     qk_generic.c, qk_avx2.c the kernel tables (kv_isa): portable and AVX2 kernels on the
 *                             GGUF row layout of the legacy types and Q4_K, Q5_K, Q6_K
 *     qk_<types>.c            GGUF row layout of types with their own file: qk_q2k_q3k.c
 *                             (Q2_K, Q3_K), qk_iq4.c (IQ4_NL, IQ4_XS, MXFP4: MXFP4
 *                             runs IQ4_NL's kernels on its own table and scales),
 *                             qk_iq2_iq3.c (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S),
 *                             qk_iq_planes.c (their AVX512-VBMI decode: IQ2_XXS, IQ2_XS,
 *                             IQ3_XXS, IQ3_S)
 *     qk_group8_<types>.c     kvlab's 8-row group layouts (<TYPE>x8: 8 weight rows
 *                             interleaved, one register lane per row): conversion from GGUF
 *                             rows, row dequantizers, portable, AVX2 and AVX-512 kernels.
 *                             qk_group8_q8_0.c (Q8_0x8), qk_group8_q5_0.c (Q5_0x8),
 *                             qk_group8_q4k_q6k.c (Q4_Kx8, Q6_Kx8), qk_group8_q5k.c (Q5_Kx8),
 *                             qk_group8_q2k_q3k.c (Q2_Kx8, Q3_Kx8), qk_group8_iq4.c
 *                             (IQ4_XSx8, IQ4_NLx8, MXFP4x8)
 *     qk_quant.c              fp32 -> GGUF blocks, fp32 -> activation blocks
 *     qk_fused.c              fp32 decode ops (norms, RoPE, gated activations, KV writes)
 *     qk_attn.c, qk_flash.c   decode and prefill attention over the paged KV cache
 *   qk_pool.c/.h              the thread pool
 *
 * Helpers included by the kernel files: qk_dequant.inc (plain-C row dequantizers),
 * qk_avx2.h, qk_zmm.h (AVX2 and 512-bit helpers), qk_emu512.h (the SIMDe test build).
 */
#ifndef KVLAB_QK_H
#define KVLAB_QK_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Target sets of the AVX512-VNNI kernels (256-bit VNNI) and of the 512-bit ones. The test
 * build with -DKV_EMULATE_512 runs both as AVX2 code through SIMDe (qk_emu512.h). */
#ifdef KV_EMULATE_512
#include "qk_emu512.h"
#define KV_ISA_VNNI "avx2,fma,f16c"
#define KV_ISA_ZMM "avx2,fma,f16c"
#else
#define KV_ISA_VNNI "avx2,fma,f16c,avx512vl,avx512vnni"
#define KV_ISA_ZMM "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"
#endif

/* GGML type ids, as in gguf.GGMLQuantizationType */
enum {
    KV_F32 = 0, KV_F16 = 1, KV_Q4_0 = 2, KV_Q4_1 = 3, KV_Q5_0 = 6, KV_Q5_1 = 7,
    KV_Q8_0 = 8, KV_Q4_K = 12, KV_Q5_K = 13, KV_Q6_K = 14, KV_BF16 = 30,
    KV_Q2_K = 10,
    KV_Q3_K = 11,
    KV_IQ2_XXS = 16, KV_IQ2_XS = 17, KV_IQ3_XXS = 18, KV_IQ3_S = 21, KV_IQ2_S = 22,
    KV_IQ4_NL = 20,
    KV_IQ4_XS = 23,
    /* kvlab's own: rows interleaved in groups of 8 (qk_group8_<types>.c) */
    KV_Q8_0X8 = 31,    /* Q8_0 (and Q4_0) rows, Q8_0's size (qk_group8_q8_0.c) */
    KV_Q4_KX8 = 32,    /* Q4_K rows (qk_group8_q4k_q6k.c) */
    KV_Q6_KX8 = 33,    /* Q6_K rows (qk_group8_q4k_q6k.c) */
    KV_Q2_KX8 = 34,    /* Q2_K rows (qk_group8_q2k_q3k.c) */
    KV_Q3_KX8 = 35,    /* Q3_K rows (qk_group8_q2k_q3k.c) */
    KV_IQ4_XSX8 = 36,  /* IQ4_XS rows (qk_group8_iq4.c) */
    KV_IQ4_NLX8 = 37,  /* IQ4_NL rows (qk_group8_iq4.c) */
    KV_Q5_0X8 = 38,    /* Q5_0 rows, Q5_0's size (qk_group8_q5_0.c) */
    KV_MXFP4 = 39,     /* GGML's id, among kvlab's own group ids */
    KV_Q5_KX8 = 40,    /* Q5_K rows (qk_group8_q5k.c) */
    KV_MXFP4X8 = 41,   /* MXFP4 rows (qk_group8_iq4.c) */
    KV_NTYPES = 42
};
/* whether type id qt is one of kvlab's 8-row group layouts */
static inline int kv_is_grouped(int64_t qt) { return qt >= KV_Q8_0X8 && qt != KV_MXFP4; }
/* the lattice ("i-quant") types with grids: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S */
static inline int kv_is_lattice(int64_t qt) {
    return qt == KV_IQ2_XXS || qt == KV_IQ2_XS || qt == KV_IQ2_S || qt == KV_IQ3_XXS
        || qt == KV_IQ3_S;
}

typedef uint16_t kv_half;

/* ---- GGUF weight blocks (layouts fixed by the file format) ---- */
typedef struct { kv_half d; int8_t qs[32]; } kv_blk_q8_0;                      /* 34 B */
typedef struct { kv_half d; uint8_t qs[16]; } kv_blk_q4_0;                     /* 18 B */
typedef struct { kv_half d, m; uint8_t qs[16]; } kv_blk_q4_1;                  /* 20 B */
typedef struct { kv_half d; uint8_t qh[4]; uint8_t qs[16]; } kv_blk_q5_0;      /* 22 B */
typedef struct { kv_half d, m; uint8_t qh[4]; uint8_t qs[16]; } kv_blk_q5_1;   /* 24 B */
/* K-quants: 256-element super-blocks. Q4_K/Q5_K: 8 sub-blocks of 32 with 6-bit scale and
 * min packed in `scales`; value = d*sc*q - dmin*m. Q6_K: 16 groups of 16, int8 scales. */
typedef struct { kv_half d, dmin; uint8_t scales[12]; uint8_t qs[128]; } kv_blk_q4_k;   /* 144 */
/* a K-quant group's sub-block scales and mins, one byte each, [sub-block s][row k]: how the
 * 8-row tiles read them (Q4_Kx8 and Q5_Kx8 keep them packed and unpack them per super-block,
 * kv_k8_row_scales and k8_unpack_scales) */
typedef struct { uint8_t sc[8][8], m[8][8]; } kv_k8_scales;
typedef struct {
    kv_half d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128];
} kv_blk_q5_k;                                                                          /* 176 */
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; kv_half d; } kv_blk_q6_k;
/* IQ4_NL / IQ4_XS: 4-bit indices into kv_iq4_values (qk_iq4.c), nibbles as in Q4_0 (low:
 * elements 0..15 of a 32, high: 16..31). IQ4_XS: 8 sub-blocks of 32, sub-block s scaled by
 * d * (6-bit scale - 32), its low 4 bits nibble s of scales_l, its high 2 bits 2s of scales_h. */
/* Q2_K / Q3_K: 16 sub-blocks of 16 (qk_q2k_q3k.c). Q2_K: scale (low nibble) and min (high) per
 * sub-block, value = d*sc*q - dmin*m; Q3_K: 6-bit scales packed in 12 bytes (kv_q3_k_scales),
 * a third bit per value in hmask. */
typedef struct { uint8_t scales[16]; uint8_t qs[64]; kv_half d, dmin; } kv_blk_q2_k;    /* 84 */
typedef struct { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; kv_half d; } kv_blk_q3_k;
typedef struct { kv_half d; uint8_t qs[16]; } kv_blk_iq4_nl;                    /* 18 B */
typedef struct {
    kv_half d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128];
} kv_blk_iq4_xs;                                                                        /* 136 */

/* MXFP4 (qk_iq4.c): 32 E2M1 values as IQ4_NL's nibbles, one E8M0 exponent e per block;
 * value = 2^(e - 128) * kv_mxfp4_values[q] (the E2M1 values doubled, as gguf stores them) */
typedef struct { uint8_t e; uint8_t qs[16]; } kv_blk_mxfp4;                     /* 17 B */

/* Q3_K's 16 six-bit scales (low 4 bits in bytes 0..7, high 2 bits in bytes 8..11), minus 32 */
static inline void kv_q3_k_scales(const uint8_t s[12], int8_t out[16]) {
    for (int k = 0; k < 16; k++) {
        const int lo = (s[k % 8] >> (4 * (k / 8))) & 0xF;
        const int hi = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
        out[k] = (int8_t)((lo | hi << 4) - 32);
    }
}

/* ---- 8-bit activation blocks (kvlab's own, never stored) ---- */
/* x ~ d*qs, s = d*sum(qs), bias = -128*sum(qs) (the start of a dot against Q8_0x8) */
typedef struct { float d; float s; int32_t bias; int8_t qs[32]; } kv_act32;
typedef struct { float d; int16_t bsums[16]; int8_t qs[256]; } kv_act256; /* bsums: per 16 */
/* Two 32-blocks (2p, 2p+1) arranged as the AVX2 kernels unpack two 4/5-bit weight blocks:
 * low nibbles of both blocks in one register, high nibbles in another. */
typedef struct {
    int8_t lo[32];  /* elements 0..15 of block 2p, then elements 0..15 of block 2p+1 */
    int8_t hi[32];  /* elements 16..31 of the same blocks */
    float d[8];     /* scale of block 2p four times, then of block 2p+1 */
    float s[8];     /* d*sum(q) of block 2p, 0, 0, 0, then of block 2p+1, 0, 0, 0 */
} kv_act64;

enum { KV_ACT_FLOAT = 0, KV_ACT_32 = 1, KV_ACT_256 = 2, KV_ACT_64 = 3 };

/* Bytes of one row of `cols` activations in blocks of `kind` (KV_ACT_FLOAT: fp32 as is) */
static inline int64_t kv_act_row_bytes(int kind, int64_t cols) {
    switch (kind) {
        case KV_ACT_32: return cols / 32 * (int64_t)sizeof(kv_act32);
        case KV_ACT_64: return (cols / 32 + 1) / 2 * (int64_t)sizeof(kv_act64);
        case KV_ACT_256: return cols / 256 * (int64_t)sizeof(kv_act256);
        default: return cols * (int64_t)sizeof(float);
    }
}

/* Rows [r0, r1) of W (row_bytes apart) times n activation rows (xstride bytes apart):
 * y[j*ystride + r] = dot(W[r], x[j]). */
typedef void (*kv_gemv_fn)(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                           int64_t cols, const void *xq, int64_t xstride, int64_t n,
                           float *y, int64_t ystride);
/* One row of `cols` elements -> fp32. */
typedef void (*kv_deq_fn)(const uint8_t *w, int64_t cols, float *out);

typedef struct {
    const char *name;
    kv_gemv_fn gemv[KV_NTYPES];
    kv_deq_fn deq[KV_NTYPES];
    uint8_t act_kind[KV_NTYPES];  /* the activation blocks gemv[t] takes (KV_ACT_*) */
    void (*act32)(const float *x, int64_t cols, kv_act32 *out);
    void (*act64)(const float *x, int64_t cols, kv_act64 *out);  /* ceil(blocks/2) pairs */
    void (*act256)(const float *x, int64_t cols, kv_act256 *out);
} kv_isa;

extern const kv_isa kv_isa_generic;
/* one fp32 row -> its activation blocks of `kind` (a copy for KV_ACT_FLOAT) */
void kv_act_row(const kv_isa *isa, int kind, const float *x, int64_t cols, void *out);

/* What a product takes of a weight: GGML (or grouped) type id, address, rows, cols and
 * bytes per row, as QuantizedWeight.kernel_args */
typedef struct {
    int64_t qt, ptr, rows, cols, row_bytes;
} kv_wdesc;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(KV_NO_AVX2)  /* -DKV_NO_AVX2: portable only */
#define KV_HAVE_AVX2_BUILD 1
extern const kv_isa kv_isa_avx2;
#endif

/* ---- 8-row groups, one register lane per row: Q8_0x8 (qk_group8_q8_0.c; from Q8_0, Q5_0,
 * Q4_0, Q8_0's size), Q4_Kx8 (qk_group8_q4k_q6k.c; Q4_K's 144 B per row and super-block),
 * Q6_Kx8 (qk_group8_q4k_q6k.c; Q6_K's 210 B, the 6-bit values regrouped). Conversions return
 * -1 if rows % 8 (or, for Q8_0x8, the source type) does not fit. ---- */
int kv_to_q8_0x8(int qtype, const uint8_t *src, int64_t rows, int64_t cols,
                 int64_t src_row_bytes, uint8_t *dst);
int kv_to_q4_kx8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst);
int kv_to_q6_kx8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst);
int kv_to_q2_kx8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst);
int kv_to_q3_kx8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst);
/* row r of a grouped matrix (row_bytes per row on average) -> fp32 */
#define KV_DEQ_ROW_DECL(name) \
    void name(const uint8_t *w, int64_t row_bytes, int64_t r, int64_t cols, float *out)
KV_DEQ_ROW_DECL(kv_deq_q8_0x8_row);
KV_DEQ_ROW_DECL(kv_deq_q4_kx8_row);
KV_DEQ_ROW_DECL(kv_deq_q6_kx8_row);
KV_DEQ_ROW_DECL(kv_deq_q2_kx8_row);
KV_DEQ_ROW_DECL(kv_deq_q3_kx8_row);
/* a kv_gemv_fn */
#define KV_GEMV_DECL(name)                                                                \
    void name(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t cols,  \
              const void *xq, int64_t xstride, int64_t n, float *y, int64_t ystride)
KV_GEMV_DECL(kv_gemv_q8_0x8_generic);
KV_GEMV_DECL(kv_gemv_q4_kx8_generic);
KV_GEMV_DECL(kv_gemv_q6_kx8_generic);
KV_GEMV_DECL(kv_gemv_q2_kx8_generic);
KV_GEMV_DECL(kv_gemv_q3_kx8_generic);
/* IQ4_NL, IQ4_XS (qk_iq4.c): portable dequantizers and dot kernels, then the AVX2 ones */
void kv_deq_iq4_nl_generic(const uint8_t *w, int64_t cols, float *out);
void kv_deq_iq4_xs_generic(const uint8_t *w, int64_t cols, float *out);
KV_GEMV_DECL(kv_gemv_iq4_nl_generic);
KV_GEMV_DECL(kv_gemv_iq4_xs_generic);
/* IQ4_XSx8 (IQ4_XS's 136 B per row and super-block) and IQ4_NLx8 (IQ4_NL's 18 B),
 * qk_group8_iq4.c; kv_iq4_values: the 16 values a 4-bit index selects */
extern const int8_t kv_iq4_values[16];
int kv_to_iq4_xsx8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst);
int kv_to_iq4_nlx8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst);
KV_DEQ_ROW_DECL(kv_deq_iq4_xsx8_row);
KV_DEQ_ROW_DECL(kv_deq_iq4_nlx8_row);
KV_GEMV_DECL(kv_gemv_iq4_xsx8_generic);
KV_GEMV_DECL(kv_gemv_iq4_nlx8_generic);
/* MXFP4 (qk_iq4.c) and MXFP4x8 (qk_group8_iq4.c, MXFP4's 17 B per 32): IQ4_NL's and
 * IQ4_NLx8's kernels on MXFP4's table and scales */
extern const int8_t kv_mxfp4_values[16];
void kv_deq_mxfp4_generic(const uint8_t *w, int64_t cols, float *out);
KV_GEMV_DECL(kv_gemv_mxfp4_generic);
int kv_to_mxfp4x8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst);
KV_DEQ_ROW_DECL(kv_deq_mxfp4x8_row);
KV_GEMV_DECL(kv_gemv_mxfp4x8_generic);
/* Q5_0x8 (qk_group8_q5_0.c): Q5_0's 22 B per 32, outputs bit-identical to Q8_0x8's */
int kv_to_q5_0x8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst);
KV_DEQ_ROW_DECL(kv_deq_q5_0x8_row);
KV_GEMV_DECL(kv_gemv_q5_0x8_generic);
/* Q5_Kx8 (qk_group8_q5k.c): Q4_Kx8's fields and Q5_K's fifth bits, Q5_K's 176 B per row and
 * super-block */
int kv_to_q5_kx8(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst);
KV_DEQ_ROW_DECL(kv_deq_q5_kx8_row);
KV_GEMV_DECL(kv_gemv_q5_kx8_generic);
#ifdef KV_HAVE_AVX2_BUILD
KV_GEMV_DECL(kv_gemv_q5_0x8_avx2);
KV_GEMV_DECL(kv_gemv_q5_kx8_avx2);
KV_GEMV_DECL(kv_gemv_iq4_xsx8_avx2);
KV_GEMV_DECL(kv_gemv_iq4_nlx8_avx2);
KV_GEMV_DECL(kv_gemv_mxfp4x8_avx2);
void kv_deq_mxfp4_avx2(const uint8_t *w, int64_t cols, float *out);
KV_GEMV_DECL(kv_gemv_mxfp4_avx2);
void kv_deq_iq4_nl_avx2(const uint8_t *w, int64_t cols, float *out);
void kv_deq_iq4_xs_avx2(const uint8_t *w, int64_t cols, float *out);
KV_GEMV_DECL(kv_gemv_iq4_nl_avx2);
KV_GEMV_DECL(kv_gemv_iq4_xs_avx2);
KV_GEMV_DECL(kv_gemv_q8_0x8_avx2);
KV_GEMV_DECL(kv_gemv_q4_kx8_avx2);
KV_GEMV_DECL(kv_gemv_q6_kx8_avx2);
KV_GEMV_DECL(kv_gemv_q2_kx8_avx2);
KV_GEMV_DECL(kv_gemv_q3_kx8_avx2);
int kv_use_vnni(void);  /* AVX512-VNNI + VL present and not switched off (KVLAB_NO_VNNI) */
#endif

#define KV_GROUP_NX 8  /* x rows per tile: 8 accumulators + 8 weight registers fit in 32 */
/* x rows [j, j + KV_GROUP_NX) of n through tile(b, ...) with a constant nx */
#define KV_GROUP_TILES(tile, b, nb, x, xstride, n, y, ystride)                             \
    for (int64_t j = 0; j < n; j += KV_GROUP_NX) {                                         \
        const char *xj = x + j * xstride;                                                  \
        float *yj = y + j * ystride;                                                       \
        switch (n - j >= KV_GROUP_NX ? KV_GROUP_NX : n - j) {                              \
            case 8: tile(b, nb, xj, xstride, 8, yj, ystride); break;                       \
            case 7: tile(b, nb, xj, xstride, 7, yj, ystride); break;                       \
            case 6: tile(b, nb, xj, xstride, 6, yj, ystride); break;                       \
            case 5: tile(b, nb, xj, xstride, 5, yj, ystride); break;                       \
            case 4: tile(b, nb, xj, xstride, 4, yj, ystride); break;                       \
            case 3: tile(b, nb, xj, xstride, 3, yj, ystride); break;                       \
            case 2: tile(b, nb, xj, xstride, 2, yj, ystride); break;                       \
            default: tile(b, nb, xj, xstride, 1, yj, ystride); break;                      \
        }                                                                                  \
    }

/* The driver of an 8-row-group kernel: groups [r0, r1) of W (8 rows each, the group's
 * blocks of `blk_t` contiguous), x rows in tiles of up to KV_GROUP_NX through tile(b, blocks,
 * x, xs, nx, y, ys) with nx a constant for each case, so the tile's loops over x rows unroll.
 * Many x rows (prefill) go in chunks of about KV_GROUP_XBYTES, each chunk against every
 * group, when all of x is more than KV_GROUP_XWHOLE: a chunk then stays in L2 while the
 * groups stream past, where without chunks every group would read all of x again from L3
 * (at 2048 columns, 512 rows of x are 1.2 MB, more than a Zen 4 core's 1 MiB L2). Chunks
 * make a tall matrix's weights stream in once per chunk, which costs less: on an AMD EPYC
 * (Zen 4), 2 threads, 512 x rows at 16384 x 2048, chunking x from 512 KiB on gives Q4_K 518,
 * IQ4_XS 517, Q2_K 489 and Q3_K 419 GFLOP/s where chunking it only from 2 MiB on gives 492,
 * 502, 467 and 388 (medians of 20 interleaved calls), and 2048- to 3072-row matrices are no
 * slower. A smaller x is read whole. */
#define KV_GROUP_XBYTES (256 * 1024)
#define KV_GROUP_XWHOLE (512 * 1024)
/* x rows per chunk: all n up to `whole` bytes of x, else about `bytes` of them, a multiple of
 * `mult` (at least one) */
#define KV_X_CHUNK(xstride, n, whole, bytes, mult)                                         \
    ((n) * (xstride) <= (whole) ? (n)                                                      \
     : (mult) * (((bytes) / (xstride)) / (mult) > 1 ? ((bytes) / (xstride)) / (mult) : 1))
#define KV_GROUP_CHUNK(xstride, n)                                                         \
    KV_X_CHUNK(xstride, n, KV_GROUP_XWHOLE, KV_GROUP_XBYTES, KV_GROUP_NX)
/* the driver; with pairs (a constant 1) two groups per tile where there are two and several
 * x rows (prefill): tile2(b, ...) computes groups b and b + nb (16 rows, y and y + 8) */
#define KV_GROUP_DRIVER(name, TGT, tile, tile2, pairs, blk_t, block_elems)                \
    static TGT void name(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,      \
                         int64_t cols, const void *xq, int64_t xstride, int64_t n,         \
                         float *y, int64_t ystride) {                                      \
        const int64_t nb = cols / (block_elems), step = KV_GROUP_CHUNK(xstride, n);        \
        for (int64_t c = 0; c < n; c += step) {                                            \
            const char *x = (const char *)xq + c * xstride;                                \
            const int64_t m = n - c < step ? n - c : step;                                 \
            float *yc = y + c * ystride;                                                   \
            for (int64_t r = r0; r < r1;) {                                                \
                const blk_t *b = (const blk_t *)(w + r * row_bytes);                       \
                if ((pairs) && n > 1 && r1 - r >= 16) {                                    \
                    KV_GROUP_TILES(tile2, b, nb, x, xstride, m, yc + r, ystride);          \
                    r += 16;                                                               \
                } else {                                                                   \
                    KV_GROUP_TILES(tile, b, nb, x, xstride, m, yc + r, ystride);           \
                    r += 8;                                                                \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    }
#define KV_GROUP_GEMV(name, TGT, tile, blk_t, block_elems)                                 \
    KV_GROUP_DRIVER(name, TGT, tile, tile, 0, blk_t, block_elems)
#define KV_GROUP_GEMV2(name, TGT, tile, tile2, blk_t, block_elems)                         \
    KV_GROUP_DRIVER(name, TGT, tile, tile2, 1, blk_t, block_elems)

/* The portable kernel of a K-quant group layout with scales and mins (Q4_Kx8, Q5_Kx8): per
 * row k and x row, row_sums(block, k, x block, &isum, &msum) gives a super-block's exact
 * integers, then acc = fma(d * d_x, isum, acc), acc = fma(-(dmin * d_x), msum, acc). */
#define KV_KX8_GENERIC(name, blk_t, row_sums)                                              \
    void name(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t cols,   \
              const void *xq, int64_t xstride, int64_t n, float *y, int64_t ystride) {     \
        for (int64_t r = r0; r < r1; r += 8) {                                             \
            const blk_t *b = (const blk_t *)(w + r * row_bytes);                           \
            for (int64_t j = 0; j < n; j++) {                                              \
                const kv_act256 *a = (const kv_act256 *)((const char *)xq + j * xstride);  \
                for (int k = 0; k < 8; k++) {                                              \
                    float acc = 0.0f;                                                      \
                    for (int64_t i = 0; i < cols / 256; i++) {                             \
                        int32_t isum, msum;                                                \
                        row_sums(b + i, k, a + i, &isum, &msum);                           \
                        acc = fmaf(kv_h2f_table[b[i].d[k]] * a[i].d, (float)isum, acc);    \
                        acc = fmaf(-(kv_h2f_table[b[i].dmin[k]] * a[i].d), (float)msum, acc); \
                    }                                                                      \
                    y[j * ystride + r + k] = acc;                                          \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    }

/* ---- IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S in their file layout (qk_iq2_iq3.c); their
 * grids, from gguf, set once by kv_set_grid (bytes: the type's grid size, else -1) ---- */
int kv_set_grid(int qtype, const uint8_t *values, int64_t bytes);
#define KV_IQ_DECLS(t)                                                                     \
    KV_GEMV_DECL(kv_gemv_##t##_generic);                                                   \
    void kv_deq_##t##_generic(const uint8_t *w, int64_t cols, float *out);
KV_IQ_DECLS(iq2_xxs) KV_IQ_DECLS(iq2_xs) KV_IQ_DECLS(iq2_s) KV_IQ_DECLS(iq3_xxs)
KV_IQ_DECLS(iq3_s)
#ifdef KV_HAVE_AVX2_BUILD
#define KV_IQ_DECLS_AVX2(t)                                                                \
    KV_GEMV_DECL(kv_gemv_##t##_avx2);                                                      \
    void kv_deq_##t##_avx2(const uint8_t *w, int64_t cols, float *out);
KV_IQ_DECLS_AVX2(iq2_xxs) KV_IQ_DECLS_AVX2(iq2_xs) KV_IQ_DECLS_AVX2(iq2_s)
KV_IQ_DECLS_AVX2(iq3_xxs) KV_IQ_DECLS_AVX2(iq3_s)
/* IQ2_XXS, IQ2_XS, IQ3_XXS and IQ3_S with AVX512-VBMI, in value planes (qk_iq_planes.c): the
 * planes made from a grid, with the type's super-block bytes and unit (kv_set_grid passes them
 * on); the product for 1 to 7 x rows, which says whether it ran (not for another type, without
 * AVX512-VBMI or without memory); whether the planes serve all four types here */
void kv_iq_planes_set(int qtype, const uint8_t *grid, int64_t bytes, int block_bytes,
                      float unit);
bool kv_gemv_iq_planes(int qt, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                       int64_t cols, const void *xq, int64_t xstride, int64_t n, float *y,
                       int64_t ystride);
int kv_iq_planes_active(void);
/* weight bytes the IQ decode kernels prefetch ahead of the super-block they read (on into
 * the next row): the hardware's stream prefetch alone left them short of memory's pace */
#define KV_IQ_AHEAD 1024
#endif

/* ---- Q2_K and Q3_K in their file layout (qk_q2k_q3k.c) ---- */
KV_GEMV_DECL(kv_gemv_q2_k_generic);
KV_GEMV_DECL(kv_gemv_q3_k_generic);
void kv_deq_q2_k_generic(const uint8_t *w, int64_t cols, float *out);
void kv_deq_q3_k_generic(const uint8_t *w, int64_t cols, float *out);
#ifdef KV_HAVE_AVX2_BUILD
KV_GEMV_DECL(kv_gemv_q2_k_avx2);
KV_GEMV_DECL(kv_gemv_q3_k_avx2);
void kv_deq_q2_k_avx2(const uint8_t *w, int64_t cols, float *out);
void kv_deq_q3_k_avx2(const uint8_t *w, int64_t cols, float *out);
#endif

/* ---- helpers shared by the C files ---- */
extern float kv_h2f_table[65536];
void kv_init_tables(void);
uint16_t kv_f2h(float f);

/* E8M0 byte e -> 2^(e - 128), gguf's e8m0_to_fp32_half (e < 2: the fp32 subnormals) */
static inline float kv_e8m0_half(uint8_t e) {
    union { uint32_t u; float f; } v = {e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23};
    return v.f;
}
/* IQ4_NL and MXFP4 blocks share their kernels: 16 bytes of nibbles indexing 16 int8 values,
 * after a per-block scale (fp16 d, or an E8M0 byte); qt one of the two, a constant */
static inline int kv_nl4_bytes(int qt) { return qt == KV_MXFP4 ? 17 : 18; }
static inline const uint8_t *kv_nl4_qs(const uint8_t *blk, int qt) {
    return blk + (qt == KV_MXFP4 ? 1 : 2);
}
static inline float kv_nl4_scale(const uint8_t *blk, int qt) {
    return qt == KV_MXFP4 ? kv_e8m0_half(blk[0]) : kv_h2f_table[blk[0] | blk[1] << 8];
}
static inline const int8_t *kv_nl4_values(int qt) {
    return qt == KV_MXFP4 ? kv_mxfp4_values : kv_iq4_values;
}

int kv_block_size(int qtype);    /* elements per block, 0 if unsupported */
int kv_type_size(int qtype);     /* bytes per block */

/* Quantizers (generic C): rows x cols fp32 -> GGUF blocks, row after row. */
void kv_quantize_q8_0(const float *x, int64_t n, uint8_t *out);
void kv_quantize_q4_k(const float *x, int64_t n, uint8_t *out);
void kv_quantize_q5_k(const float *x, int64_t n, uint8_t *out);
void kv_quantize_q6_k(const float *x, int64_t n, uint8_t *out);

/* Fused fp32 decode ops (qk_fused.c), single-threaded; see the Python wrappers in fused.py. */
void kv_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t dim,
                 float eps);
void kv_add_rms_norm(float *res, const float *h, const float *w, int64_t rows, int64_t dim,
                     float eps);
void kv_norm_rope(float *x, int64_t tokens, int64_t row_stride, int64_t heads, int64_t dim,
                  const float *w, const float *cos, const float *sin, float eps);
/* out[r] = the first index of row r's largest value, or of its first NaN */
void kv_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out);
void kv_mask_logits_rows(float *x, int64_t rows, int64_t cols, const int32_t *mask,
                         int64_t words);
void kv_gelu_mul(const float *x, float *out, int64_t tokens, int64_t inter);
void kv_silu_mul(const float *x, float *out, int64_t tokens, int64_t inter);
/* gpt-oss's clamped SwiGLU on gate | up rows: (clamp(up, -limit, limit) + 1) * g *
 * sigmoid(alpha * g), g = min(gate, limit) */
void kv_swiglu_clamp_mul(const float *x, float *out, int64_t tokens, int64_t inter,
                         float alpha, float limit);
/* dst[slots[j]] = src row j: the paged KV write, into fp32 or (kv_f16) fp16 rows rounded
 * to nearest even, as torch's .to(torch.float16) */
void kv_scatter_rows(void *dst, int kv_f16, const float *src, int64_t src_stride,
                     const int64_t *slots, int64_t n, int64_t row);
/* the same write into a q8_0 store: each 32 values of a row as int8 and one fp16 scale
 * (amax / 127), rounded as kvlab.models.kv_store.quantize_q8 rounds; row % 32 == 0 */
void kv_scatter_rows_q8(int8_t *dst, kv_half *dst_scale, const float *src, int64_t src_stride,
                        const int64_t *slots, int64_t n, int64_t row);
/* One layer's paged KV stores as the C attention reads them: [num_slots, KVH, D] values in
 * fp32, fp16 or int8 (q8_0: one fp16 scale per 32 values of a head, [num_slots, KVH, D/32]) */
enum { KV_CACHE_F32 = 0, KV_CACHE_F16 = 1, KV_CACHE_Q8_0 = 2 };
typedef struct {
    int kind;
    const void *k, *v;
    const kv_half *k_scale, *v_scale;  /* q8_0 only */
} kv_cache_ref;
static inline int64_t kv_cache_elem_bytes(int kind) {
    return kind == KV_CACHE_F32 ? 4 : kind == KV_CACHE_F16 ? 2 : 1;
}
/* Gemma 2's soft-cap on a scaled attention score, bounding it to (-cap, cap); the
 * attention kernels apply it to each score before the softmax when cap > 0 (0: no cap) */
static inline float kv_softcap(float s, float cap) { return cap * tanhf(s / cap); }
/* Decode attention over a paged KV cache (qk_attn.c): row b attends to the first lengths[b]
 * of its C slots (all C when lengths is NULL), scores soft-capped when softcap > 0; sinks
 * (gpt-oss, NULL for none): one logit [H] per head that joins the softmax's denominator
 * and carries no value; 0, or -1 out of memory. */
int kv_attend_decode(const float *q, int64_t q_stride, const kv_cache_ref *kv,
                     const int64_t *slots, const int64_t *lengths, int64_t B, int64_t C,
                     int64_t H, int64_t KVH, int64_t D, float scale, float softcap,
                     const float *sinks, float *out, int use_avx2);
/* Prefill attention over the same caches (qk_flash.c): query token i of n, at position
 * start + i, sees key positions [first, start + i] (the last `window` of them when window
 * > 0); slots[c] holds position first + c; scores soft-capped and sinks as for decode;
 * out [n, H, D]. 0, or -1 out of memory. */
int kv_attend_prefill(const float *q, int64_t q_stride, const kv_cache_ref *kv,
                      const int64_t *slots, int64_t first, int64_t start, int64_t n, int64_t H,
                      int64_t KVH, int64_t D, int64_t window, float scale, float softcap,
                      const float *sinks, float *out, int use_avx2);

#endif
