/* fp32 -> GGUF block quantizers (load-time only, portable C), and kv_act_row: one row into
 * the 8-bit activation blocks of the active kernels.
 *
 * Q8_0 follows the reference rounding exactly (d = amax/127 in fp32, round half away from
 * zero), so its bytes equal gguf.quants.quantize. The K-quants have no single reference:
 * each 32 (Q4_K/Q5_K) or 16 (Q6_K) wide group gets the (scale, min) pair that a small
 * grid search plus a least-squares refit finds, then the group scales are themselves
 * quantized against the super-block's fp16 scales and the elements re-rounded with them.
 */
#include <math.h>
#include <string.h>

#include "qk.h"

static inline float h16(float f) { return kv_h2f_table[kv_f2h(f)]; }

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

void kv_quantize_q8_0(const float *x, int64_t n, uint8_t *out) {
    kv_blk_q8_0 *b = (kv_blk_q8_0 *)out;
    for (int64_t i = 0; i < n / 32; i++, x += 32) {
        float amax = 0.0f;
        for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(x[l]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int l = 0; l < 32; l++) b[i].qs[l] = (int8_t)roundf(x[l] * id);
        b[i].d = kv_f2h(d);
    }
}

/* Least-squares fit x ~ s*q + c over one group with q fixed; c <= 0 (it is -min).
 * Returns the squared error, or INFINITY when the fit is degenerate. */
static float refit(const float *x, const int *q, int len, float *s, float *c) {
    float sq = 0, sqq = 0, sx = 0, sqx = 0;
    for (int l = 0; l < len; l++) {
        sq += (float)q[l];
        sqq += (float)q[l] * (float)q[l];
        sx += x[l];
        sqx += (float)q[l] * x[l];
    }
    const float det = (float)len * sqq - sq * sq;
    if (det <= 0.0f) return INFINITY;
    *s = ((float)len * sqx - sq * sx) / det;
    *c = (sx - *s * sq) / (float)len;
    if (*c > 0.0f) {  /* a positive offset is not representable: refit through zero */
        *c = 0.0f;
        *s = sqq > 0.0f ? sqx / sqq : 0.0f;
    }
    if (*s < 0.0f) return INFINITY;
    float err = 0.0f;
    for (int l = 0; l < len; l++) {
        const float e = *s * (float)q[l] + *c - x[l];
        err += e * e;
    }
    return err;
}

/* Best (scale >= 0, min >= 0) for x ~ scale*q - min, q in [0, nmax]. */
static void fit_scale_min(const float *x, int len, int nmax, float *scale, float *min) {
    float lo = 0.0f, hi = x[0];
    for (int l = 0; l < len; l++) {
        lo = fminf(lo, x[l]);
        hi = fmaxf(hi, x[l]);
    }
    *scale = (hi - lo) / (float)nmax;
    *min = -lo;
    if (!(hi > lo)) {
        *scale = 0.0f;
        return;
    }
    float best = INFINITY;
    int q[32];
    for (int k = -1; k <= 6; k++) {
        const float iscale = ((float)nmax + 0.2f * (float)k) / (hi - lo);
        for (int l = 0; l < len; l++) q[l] = clampi((int)lrintf((x[l] - lo) * iscale), 0, nmax);
        float s = 0.0f, c = 0.0f;
        const float err = refit(x, q, len, &s, &c);
        if (err < best) {
            best = err;
            *scale = s;
            *min = -c;
        }
    }
}

/* 6-bit group scales/mins -> the 12-byte K-quant packing (inverse of kv_scale_min_k4). */
static void pack_scale_min_k4(const int sc[8], const int mn[8], uint8_t *s) {
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
        s[j + 4] = (uint8_t)(mn[j] | ((mn[j + 4] >> 4) << 6));
        s[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
    }
}

/* Shared by Q4_K (nmax 15) and Q5_K (nmax 31): fills d, dmin, scales and q[256]. */
static void quantize_k_asym(const float *x, int nmax, kv_half *d_out, kv_half *dmin_out,
                            uint8_t scales[12], int q[256]) {
    float s[8], m[8], smax = 0.0f, mmax = 0.0f;
    for (int j = 0; j < 8; j++) {
        fit_scale_min(x + 32 * j, 32, nmax, &s[j], &m[j]);
        smax = fmaxf(smax, s[j]);
        mmax = fmaxf(mmax, m[j]);
    }
    *d_out = kv_f2h(smax / 63.0f);
    *dmin_out = kv_f2h(mmax / 63.0f);
    const float d = kv_h2f_table[*d_out], dmin = kv_h2f_table[*dmin_out];
    int sc[8], mn[8];
    for (int j = 0; j < 8; j++) {
        sc[j] = d > 0.0f ? clampi((int)lrintf(s[j] / d), 0, 63) : 0;
        mn[j] = dmin > 0.0f ? clampi((int)lrintf(m[j] / dmin), 0, 63) : 0;
        const float se = d * (float)sc[j], me = dmin * (float)mn[j];
        const float ise = se > 0.0f ? 1.0f / se : 0.0f;
        for (int l = 32 * j; l < 32 * j + 32; l++)
            q[l] = clampi((int)lrintf((x[l] + me) * ise), 0, nmax);
    }
    pack_scale_min_k4(sc, mn, scales);
}

void kv_quantize_q4_k(const float *x, int64_t n, uint8_t *out) {
    kv_blk_q4_k *b = (kv_blk_q4_k *)out;
    int q[256];
    for (int64_t i = 0; i < n / 256; i++, x += 256) {
        quantize_k_asym(x, 15, &b[i].d, &b[i].dmin, b[i].scales, q);
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                b[i].qs[32 * j + l] = (uint8_t)(q[64 * j + l] | (q[64 * j + 32 + l] << 4));
    }
}

void kv_quantize_q5_k(const float *x, int64_t n, uint8_t *out) {
    kv_blk_q5_k *b = (kv_blk_q5_k *)out;
    int q[256];
    for (int64_t i = 0; i < n / 256; i++, x += 256) {
        quantize_k_asym(x, 31, &b[i].d, &b[i].dmin, b[i].scales, q);
        memset(b[i].qh, 0, sizeof b[i].qh);
        for (int j = 0; j < 4; j++) {
            for (int l = 0; l < 32; l++) {
                const int lo = q[64 * j + l], hi = q[64 * j + 32 + l];
                b[i].qs[32 * j + l] = (uint8_t)((lo & 0xF) | ((hi & 0xF) << 4));
                b[i].qh[l] |= (uint8_t)(((lo >> 4) << (2 * j)) | ((hi >> 4) << (2 * j + 1)));
            }
        }
    }
}

/* Best signed scale for x ~ s*q, q in [-32, 31] over one 16-wide group. */
static float fit_scale_sym6(const float *x) {
    float vmax = 0.0f;
    for (int l = 0; l < 16; l++)
        if (fabsf(x[l]) > fabsf(vmax)) vmax = x[l];
    if (vmax == 0.0f) return 0.0f;
    float best = INFINITY, best_s = vmax / -32.0f;
    for (int k = -4; k <= 8; k++) {
        const float id = (-32.0f + 0.25f * (float)k) / vmax;
        float sqq = 0.0f, sqx = 0.0f;
        int q[16];
        for (int l = 0; l < 16; l++) {
            q[l] = clampi((int)lrintf(x[l] * id), -32, 31);
            sqq += (float)(q[l] * q[l]);
            sqx += (float)q[l] * x[l];
        }
        if (sqq <= 0.0f) continue;
        const float s = sqx / sqq;
        float err = 0.0f;
        for (int l = 0; l < 16; l++) err += (s * (float)q[l] - x[l]) * (s * (float)q[l] - x[l]);
        if (err < best) {
            best = err;
            best_s = s;
        }
    }
    return best_s;
}

void kv_quantize_q6_k(const float *x, int64_t n, uint8_t *out) {
    kv_blk_q6_k *b = (kv_blk_q6_k *)out;
    for (int64_t i = 0; i < n / 256; i++, x += 256) {
        float s[16], amax = 0.0f;
        for (int g = 0; g < 16; g++) {
            s[g] = fit_scale_sym6(x + 16 * g);
            amax = fmaxf(amax, fabsf(s[g]));
        }
        b[i].d = kv_f2h(amax / 127.0f);
        const float d = kv_h2f_table[b[i].d];
        int q[256];
        for (int g = 0; g < 16; g++) {
            const int sc = d > 0.0f ? clampi((int)lrintf(s[g] / d), -127, 127) : 0;
            b[i].scales[g] = (int8_t)sc;
            const float se = d * (float)sc, ise = se != 0.0f ? 1.0f / se : 0.0f;
            for (int l = 16 * g; l < 16 * g + 16; l++)
                q[l] = clampi((int)lrintf(x[l] * ise), -32, 31) + 32;
        }
        memset(b[i].qh, 0, sizeof b[i].qh);
        for (int h = 0; h < 2; h++) {
            const int *qq = q + 128 * h;
            for (int l = 0; l < 32; l++) {
                b[i].ql[64 * h + l] = (uint8_t)((qq[l] & 0xF) | ((qq[l + 64] & 0xF) << 4));
                b[i].ql[64 * h + l + 32] =
                    (uint8_t)((qq[l + 32] & 0xF) | ((qq[l + 96] & 0xF) << 4));
                b[i].qh[32 * h + l] = (uint8_t)((qq[l] >> 4) | ((qq[l + 32] >> 4) << 2) |
                                                ((qq[l + 64] >> 4) << 4) |
                                                ((qq[l + 96] >> 4) << 6));
            }
        }
    }
}

/* One fp32 row -> the 8-bit activation blocks a product kernel takes (a copy for fp32) */
void kv_act_row(const kv_isa *isa, int kind, const float *x, int64_t cols, void *out) {
    if (kind == KV_ACT_32) isa->act32(x, cols, out);
    else if (kind == KV_ACT_64) isa->act64(x, cols, out);
    else if (kind == KV_ACT_256) isa->act256(x, cols, out);
    else memcpy(out, x, (size_t)cols * sizeof(float));
}
