/* Portable C kernels: block dot products against 8-bit activations, dequantizers,
 * activation quantizers, and the type table. Used where AVX2 is missing, and as the
 * reference the AVX2 kernels are tested against.
 */
#include <float.h>
#include <math.h>
#include <string.h>

#include "qk.h"

float kv_h2f_table[65536];

static float h2f_soft(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    float f;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24 */
        f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

void kv_init_tables(void) {
    for (uint32_t h = 0; h < 65536; h++) kv_h2f_table[h] = h2f_soft((uint16_t)h);
}

/* fp32 -> fp16, round to nearest even (as numpy's astype(float16)). */
uint16_t kv_f2h(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return sign | 0x7E00;          /* NaN */
    if (ax >= 0x477FF000u) return sign | 0x7C00;         /* rounds to >= 65520: inf */
    if (ax < 0x38800000u) {                              /* below 2^-14: subnormal half */
        float af, magic = 0.5f;                          /* ulp(0.5f) == 2^-24 */
        memcpy(&af, &ax, 4);
        af += magic;
        uint32_t b;
        memcpy(&b, &af, 4);
        return sign | (uint16_t)(b - 0x3F000000u);
    }
    const uint32_t r = ax - (112u << 23) + 0xFFF + ((ax >> 13) & 1);
    return sign | (uint16_t)(r >> 13);
}

int kv_block_size(int qtype) {
    switch (qtype) {
        case KV_F32: case KV_F16: case KV_BF16: return 1;
        case KV_Q8_0: case KV_Q4_0: case KV_Q4_1: case KV_Q5_0: case KV_Q5_1: case KV_Q8_0X8:
            return 32;
        case KV_Q4_K: case KV_Q5_K: case KV_Q6_K: case KV_Q4_KX8: case KV_Q6_KX8: return 256;
        case KV_Q2_K: return 256;
        case KV_Q3_K: return 256;
        case KV_Q2_KX8: return 256;
        case KV_Q3_KX8: return 256;
        case KV_IQ4_NL: case KV_IQ4_NLX8: return 32;
        case KV_IQ4_XS: case KV_IQ4_XSX8: return 256;
        case KV_Q5_0X8: return 32;
        case KV_Q5_KX8: return 256;
        case KV_MXFP4: case KV_MXFP4X8: return 32;
        case KV_IQ2_XXS: case KV_IQ2_XS: case KV_IQ2_S: case KV_IQ3_XXS: case KV_IQ3_S:
            return 256;
        default: return 0;
    }
}

int kv_type_size(int qtype) {
    switch (qtype) {
        case KV_F32: return 4;
        case KV_F16: case KV_BF16: return 2;
        case KV_Q8_0: case KV_Q8_0X8: return 34;
        case KV_Q4_0: return 18;
        case KV_Q4_1: return 20;
        case KV_Q5_0: case KV_Q5_0X8: return 22;
        case KV_Q5_1: return 24;
        case KV_Q4_K: return 144;
        case KV_Q4_KX8: return 144;
        case KV_Q6_KX8: return 210;
        case KV_Q5_K: return 176;
        case KV_Q5_KX8: return 176;
        case KV_Q6_K: return 210;
        case KV_Q2_K: return 84;
        case KV_Q3_K: return 110;
        case KV_Q2_KX8: return 84;
        case KV_Q3_KX8: return 110;
        case KV_IQ4_NL: case KV_IQ4_NLX8: return 18;
        case KV_IQ4_XS: return 136;
        case KV_IQ4_XSX8: return 136;
        case KV_MXFP4: case KV_MXFP4X8: return 17;
        case KV_IQ2_XXS: return 66;
        case KV_IQ2_XS: return 74;
        case KV_IQ2_S: return 82;
        case KV_IQ3_XXS: return 98;
        case KV_IQ3_S: return 110;
        default: return 0;
    }
}

#define KV_FN(name) name##_generic
#define KV_TGT
#define KV_H2F(h) (kv_h2f_table[(h)])
#include "qk_dequant.inc"

/* ---------------- activation quantization ---------------- */

/* max |x| over len floats, or NaN if one of them is NaN or infinite (see qk_avx2.c) */
static float absmax(const float *x, int len) {
    float amax = 0.0f;
    int bad = 0;
    for (int l = 0; l < len; l++) {
        amax = fmaxf(amax, fabsf(x[l]));
        bad |= !(fabsf(x[l]) <= FLT_MAX);
    }
    return bad ? NAN : amax;
}

static void act32_generic(const float *x, int64_t cols, kv_act32 *out) {
    for (int64_t b = 0; b < cols / 32; b++, x += 32) {
        const float d = absmax(x, 32) / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int l = 0; l < 32; l++) {
            const int q = (int)lrintf(x[l] * id);
            out[b].qs[l] = (int8_t)q;
            sum += q;
        }
        out[b].d = d;
        out[b].s = d * (float)sum;
        out[b].bias = -128 * sum;
    }
}

static void act256_generic(const float *x, int64_t cols, kv_act256 *out) {
    for (int64_t b = 0; b < cols / 256; b++, x += 256) {
        const float d = absmax(x, 256) / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int g = 0; g < 16; g++) {
            int sum = 0;
            for (int l = 16 * g; l < 16 * g + 16; l++) {
                const int q = (int)lrintf(x[l] * id);
                out[b].qs[l] = (int8_t)q;
                sum += q;
            }
            out[b].bsums[g] = (int16_t)sum;
        }
        out[b].d = d;
    }
}

/* ---------------- one row . one activation row ---------------- */

static float dot_f32(const uint8_t *w, int64_t cols, const void *xv) {
    const float *a = (const float *)w, *x = (const float *)xv;
    float s = 0.0f;
    for (int64_t i = 0; i < cols; i++) s += a[i] * x[i];
    return s;
}

static float dot_f16(const uint8_t *w, int64_t cols, const void *xv) {
    const kv_half *a = (const kv_half *)w;
    const float *x = (const float *)xv;
    float s = 0.0f;
    for (int64_t i = 0; i < cols; i++) s += kv_h2f_table[a[i]] * x[i];
    return s;
}

static float dot_bf16(const uint8_t *w, int64_t cols, const void *xv) {
    const uint16_t *a = (const uint16_t *)w;
    const float *x = (const float *)xv;
    float s = 0.0f;
    for (int64_t i = 0; i < cols; i++) {
        const uint32_t bits = (uint32_t)a[i] << 16;
        float f;
        memcpy(&f, &bits, 4);
        s += f * x[i];
    }
    return s;
}

static float dot_q8_0(const uint8_t *w, int64_t cols, const void *xv) {
    const kv_blk_q8_0 *b = (const kv_blk_q8_0 *)w;
    const kv_act32 *a = (const kv_act32 *)xv;
    float s = 0.0f;
    for (int64_t i = 0; i < cols / 32; i++) {
        int sumi = 0;
        for (int l = 0; l < 32; l++) sumi += b[i].qs[l] * a[i].qs[l];
        s += kv_h2f_table[b[i].d] * a[i].d * (float)sumi;
    }
    return s;
}

static float dot_q4_0(const uint8_t *w, int64_t cols, const void *xv) {
    const kv_blk_q4_0 *b = (const kv_blk_q4_0 *)w;
    const kv_act32 *a = (const kv_act32 *)xv;
    float s = 0.0f;
    for (int64_t i = 0; i < cols / 32; i++) {
        int sumi = 0;
        for (int l = 0; l < 16; l++) {
            sumi += ((b[i].qs[l] & 0xF) - 8) * a[i].qs[l];
            sumi += ((b[i].qs[l] >> 4) - 8) * a[i].qs[l + 16];
        }
        s += kv_h2f_table[b[i].d] * a[i].d * (float)sumi;
    }
    return s;
}

static float dot_q4_1(const uint8_t *w, int64_t cols, const void *xv) {
    const kv_blk_q4_1 *b = (const kv_blk_q4_1 *)w;
    const kv_act32 *a = (const kv_act32 *)xv;
    float s = 0.0f;
    for (int64_t i = 0; i < cols / 32; i++) {
        int sumi = 0;
        for (int l = 0; l < 16; l++) {
            sumi += (b[i].qs[l] & 0xF) * a[i].qs[l] + (b[i].qs[l] >> 4) * a[i].qs[l + 16];
        }
        s += kv_h2f_table[b[i].d] * a[i].d * (float)sumi + kv_h2f_table[b[i].m] * a[i].s;
    }
    return s;
}

static float dot_q5_0(const uint8_t *w, int64_t cols, const void *xv) {
    const kv_blk_q5_0 *b = (const kv_blk_q5_0 *)w;
    const kv_act32 *a = (const kv_act32 *)xv;
    float s = 0.0f;
    for (int64_t i = 0; i < cols / 32; i++) {
        uint32_t qh;
        memcpy(&qh, b[i].qh, 4);
        int sumi = 0;
        for (int l = 0; l < 16; l++) {
            const int lo = (b[i].qs[l] & 0xF) | (int)(((qh >> l) & 1) << 4);
            const int hi = (b[i].qs[l] >> 4) | (int)(((qh >> (l + 16)) & 1) << 4);
            sumi += (lo - 16) * a[i].qs[l] + (hi - 16) * a[i].qs[l + 16];
        }
        s += kv_h2f_table[b[i].d] * a[i].d * (float)sumi;
    }
    return s;
}

static float dot_q5_1(const uint8_t *w, int64_t cols, const void *xv) {
    const kv_blk_q5_1 *b = (const kv_blk_q5_1 *)w;
    const kv_act32 *a = (const kv_act32 *)xv;
    float s = 0.0f;
    for (int64_t i = 0; i < cols / 32; i++) {
        uint32_t qh;
        memcpy(&qh, b[i].qh, 4);
        int sumi = 0;
        for (int l = 0; l < 16; l++) {
            const int lo = (b[i].qs[l] & 0xF) | (int)(((qh >> l) & 1) << 4);
            const int hi = (b[i].qs[l] >> 4) | (int)(((qh >> (l + 16)) & 1) << 4);
            sumi += lo * a[i].qs[l] + hi * a[i].qs[l + 16];
        }
        s += kv_h2f_table[b[i].d] * a[i].d * (float)sumi + kv_h2f_table[b[i].m] * a[i].s;
    }
    return s;
}

/* sum over sub-blocks of min * (sum of the activation's 32 values there) */
static int k4_min_dot(const uint8_t mn[8], const int16_t bsums[16]) {
    int s = 0;
    for (int j = 0; j < 8; j++) s += mn[j] * (bsums[2 * j] + bsums[2 * j + 1]);
    return s;
}

static float dot_q4_k(const uint8_t *w, int64_t cols, const void *xv) {
    const kv_blk_q4_k *b = (const kv_blk_q4_k *)w;
    const kv_act256 *a = (const kv_act256 *)xv;
    float s = 0.0f;
    for (int64_t i = 0; i < cols / 256; i++) {
        uint8_t sc[8], mn[8];
        kv_scale_min_k4(b[i].scales, sc, mn);
        int sumi = 0;
        for (int j = 0; j < 4; j++) {
            const uint8_t *q = b[i].qs + 32 * j;
            const int8_t *x = a[i].qs + 64 * j;
            int lo = 0, hi = 0;
            for (int l = 0; l < 32; l++) {
                lo += (q[l] & 0xF) * x[l];
                hi += (q[l] >> 4) * x[l + 32];
            }
            sumi += sc[2 * j] * lo + sc[2 * j + 1] * hi;
        }
        const int summ = k4_min_dot(mn, a[i].bsums);
        s += a[i].d * (kv_h2f_table[b[i].d] * (float)sumi
                       - kv_h2f_table[b[i].dmin] * (float)summ);
    }
    return s;
}

static float dot_q5_k(const uint8_t *w, int64_t cols, const void *xv) {
    const kv_blk_q5_k *b = (const kv_blk_q5_k *)w;
    const kv_act256 *a = (const kv_act256 *)xv;
    float s = 0.0f;
    for (int64_t i = 0; i < cols / 256; i++) {
        uint8_t sc[8], mn[8];
        kv_scale_min_k4(b[i].scales, sc, mn);
        int sumi = 0;
        for (int j = 0; j < 4; j++) {
            const uint8_t *q = b[i].qs + 32 * j;
            const int8_t *x = a[i].qs + 64 * j;
            int lo = 0, hi = 0;
            for (int l = 0; l < 32; l++) {
                lo += ((q[l] & 0xF) | (((b[i].qh[l] >> (2 * j)) & 1) << 4)) * x[l];
                hi += ((q[l] >> 4) | (((b[i].qh[l] >> (2 * j + 1)) & 1) << 4)) * x[l + 32];
            }
            sumi += sc[2 * j] * lo + sc[2 * j + 1] * hi;
        }
        const int summ = k4_min_dot(mn, a[i].bsums);
        s += a[i].d * (kv_h2f_table[b[i].d] * (float)sumi
                       - kv_h2f_table[b[i].dmin] * (float)summ);
    }
    return s;
}

static float dot_q6_k(const uint8_t *w, int64_t cols, const void *xv) {
    const kv_blk_q6_k *b = (const kv_blk_q6_k *)w;
    const kv_act256 *a = (const kv_act256 *)xv;
    float s = 0.0f;
    for (int64_t i = 0; i < cols / 256; i++) {
        int g16[16] = {0};  /* per 16-group sums of q*x, q in [-32, 31] */
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b[i].ql + 64 * h, *qh = b[i].qh + 32 * h;
            const int8_t *x = a[i].qs + 128 * h;
            int *g = g16 + 8 * h;
            for (int l = 0; l < 32; l++) {
                const int k = l / 16;
                g[k] += (((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32) * x[l];
                g[k + 2] += (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32) * x[l + 32];
                g[k + 4] += (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32) * x[l + 64];
                g[k + 6] += (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32) * x[l + 96];
            }
        }
        int sumi = 0;
        for (int k = 0; k < 16; k++) sumi += b[i].scales[k] * g16[k];
        s += kv_h2f_table[b[i].d] * a[i].d * (float)sumi;
    }
    return s;
}

/* ---------------- row-range drivers ---------------- */

#define KV_GEMV_GENERIC(name, dot)                                                         \
    static void name(const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,          \
                     int64_t cols, const void *xq, int64_t xstride, int64_t n, float *y,   \
                     int64_t ystride) {                                                    \
        for (int64_t r = r0; r < r1; r++)                                                  \
            for (int64_t j = 0; j < n; j++)                                                \
                y[j * ystride + r] =                                                       \
                    dot(w + r * row_bytes, cols, (const char *)xq + j * xstride);          \
    }

KV_GEMV_GENERIC(gemv_f32, dot_f32)
KV_GEMV_GENERIC(gemv_f16, dot_f16)
KV_GEMV_GENERIC(gemv_bf16, dot_bf16)
KV_GEMV_GENERIC(gemv_q8_0, dot_q8_0)
KV_GEMV_GENERIC(gemv_q4_0, dot_q4_0)
KV_GEMV_GENERIC(gemv_q4_1, dot_q4_1)
KV_GEMV_GENERIC(gemv_q5_0, dot_q5_0)
KV_GEMV_GENERIC(gemv_q5_1, dot_q5_1)
KV_GEMV_GENERIC(gemv_q4_k, dot_q4_k)
KV_GEMV_GENERIC(gemv_q5_k, dot_q5_k)
KV_GEMV_GENERIC(gemv_q6_k, dot_q6_k)


const kv_isa kv_isa_generic = {
    .name = "generic",
    .gemv = {
        [KV_F32] = gemv_f32, [KV_F16] = gemv_f16, [KV_BF16] = gemv_bf16,
        [KV_Q8_0] = gemv_q8_0, [KV_Q4_0] = gemv_q4_0, [KV_Q4_1] = gemv_q4_1,
        [KV_Q5_0] = gemv_q5_0, [KV_Q5_1] = gemv_q5_1, [KV_Q4_K] = gemv_q4_k,
        [KV_Q5_K] = gemv_q5_k, [KV_Q6_K] = gemv_q6_k, [KV_Q8_0X8] = kv_gemv_q8_0x8_generic,
        [KV_Q4_KX8] = kv_gemv_q4_kx8_generic, [KV_Q6_KX8] = kv_gemv_q6_kx8_generic,
        [KV_Q2_K] = kv_gemv_q2_k_generic,
        [KV_Q3_K] = kv_gemv_q3_k_generic,
        [KV_Q2_KX8] = kv_gemv_q2_kx8_generic,
        [KV_Q3_KX8] = kv_gemv_q3_kx8_generic,
        [KV_IQ4_NL] = kv_gemv_iq4_nl_generic,
        [KV_IQ4_XS] = kv_gemv_iq4_xs_generic,
        [KV_IQ4_XSX8] = kv_gemv_iq4_xsx8_generic,
        [KV_IQ4_NLX8] = kv_gemv_iq4_nlx8_generic,
        [KV_Q5_0X8] = kv_gemv_q5_0x8_generic,
        [KV_Q5_KX8] = kv_gemv_q5_kx8_generic,
        [KV_MXFP4] = kv_gemv_mxfp4_generic,
        [KV_MXFP4X8] = kv_gemv_mxfp4x8_generic,
        [KV_IQ2_XXS] = kv_gemv_iq2_xxs_generic, [KV_IQ2_XS] = kv_gemv_iq2_xs_generic,
        [KV_IQ2_S] = kv_gemv_iq2_s_generic, [KV_IQ3_XXS] = kv_gemv_iq3_xxs_generic,
        [KV_IQ3_S] = kv_gemv_iq3_s_generic,
    },
    .deq = {
        KV_DEQ_TABLE,
        [KV_Q2_K] = kv_deq_q2_k_generic,
        [KV_Q3_K] = kv_deq_q3_k_generic,
        [KV_IQ4_NL] = kv_deq_iq4_nl_generic,
        [KV_IQ4_XS] = kv_deq_iq4_xs_generic,
        [KV_MXFP4] = kv_deq_mxfp4_generic,
        [KV_IQ2_XXS] = kv_deq_iq2_xxs_generic, [KV_IQ2_XS] = kv_deq_iq2_xs_generic,
        [KV_IQ2_S] = kv_deq_iq2_s_generic, [KV_IQ3_XXS] = kv_deq_iq3_xxs_generic,
        [KV_IQ3_S] = kv_deq_iq3_s_generic,
    },
    .act_kind = {
        [KV_Q8_0] = KV_ACT_32, [KV_Q8_0X8] = KV_ACT_32, [KV_Q4_KX8] = KV_ACT_256,
        [KV_Q6_KX8] = KV_ACT_256,
        [KV_Q4_0] = KV_ACT_32, [KV_Q4_1] = KV_ACT_32,
        [KV_Q5_0] = KV_ACT_32, [KV_Q5_1] = KV_ACT_32, [KV_Q4_K] = KV_ACT_256,
        [KV_Q5_K] = KV_ACT_256, [KV_Q6_K] = KV_ACT_256,
        [KV_Q2_K] = KV_ACT_256,
        [KV_Q3_K] = KV_ACT_256,
        [KV_Q2_KX8] = KV_ACT_256,
        [KV_Q3_KX8] = KV_ACT_256,
        [KV_IQ4_NL] = KV_ACT_32,
        [KV_IQ4_XS] = KV_ACT_256,
        [KV_IQ4_XSX8] = KV_ACT_256,
        [KV_IQ4_NLX8] = KV_ACT_32,
        [KV_Q5_0X8] = KV_ACT_32,
        [KV_Q5_KX8] = KV_ACT_256,
        [KV_MXFP4] = KV_ACT_32,
        [KV_MXFP4X8] = KV_ACT_32,
        [KV_IQ2_XXS] = KV_ACT_256, [KV_IQ2_XS] = KV_ACT_256, [KV_IQ2_S] = KV_ACT_256,
        [KV_IQ3_XXS] = KV_ACT_256, [KV_IQ3_S] = KV_ACT_256,
    },
    .act32 = act32_generic,
    .act256 = act256_generic,
};
