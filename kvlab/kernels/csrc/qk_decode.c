/* A decode step's layers in one call (declared in qk_decode.h).
 *
 * The same C functions, in the same order, on the same layouts as the decode path of the
 * dense models (kvlab/models/gemma3.py, llama.py and the files built on it) when every
 * product has a C kernel, so the results are bit-identical; what goes away is the Python
 * between them (a dozen calls a layer). What differs between the families is data in the
 * plan: norms that are absent (0), a QKV bias, the gated activation, a router and experts
 * in place of the dense MLP (routed in C: the router product, softmax and top-k in fp32,
 * the same choices as the per-op path's torch ops up to fp32 rounding); a shared expert
 * (Qwen2-MoE) beside the routed ones is then the layer's gate_up and down, its output
 * scaled by sigmoid(shexp_gate . h) and added to theirs (GLM-4.5's: added ungated). The
 * router scores as the family does (KV_ROUTE_*: softmax over all experts; gpt-oss's top k
 * of the biased logits, softmax over those; GLM-4.5's sigmoid with its correction bias and
 * grouped top k), and gpt-oss's o bias, expert biases and clamped SwiGLU are plan fields.
 * Gemma 4's are too: a layer's own head size and KV heads, a layer attending over an
 * earlier layer's store (writing none), values from the keys and their norm, the per-layer
 * input after the MLP (its rows computed once per step by the model) and the output scale,
 * and its experts beside the dense MLP (GeGLU, own input and output norms, expert scales).
 * DeepSeek-V2/V3's multi-head latent attention takes the place of qkv where the plan says so
 * (mla): its products, norms and rotary part here, the absorbed attention over the latent
 * store in qk_mla.c, the same calls as the per-op path (kvlab/models/deepseek2.py).
 * The hybrid families' recurrent layers (LFM2's short convolution, Qwen3.5's Gated DeltaNet,
 * Mamba-2 of Granite 4 hybrid and Nemotron-H) call qk_recurrent.c's steps on each
 * sequence's state rows; Nemotron-H's MLP layers mix nothing and its mixer layers have no
 * MLP; its MLPs and experts are relu(up)^2 without a gate.
 * The plan is int64 [layers, KV_PLAN_FIELDS], built once by the model
 * (kvlab/models/decode_c.py).
 * An opt-in profile (kv_decode_profile_*) times each layer's stages on the calling thread,
 * around the stage functions and not inside the kernels, so that a step's time splits by
 * layer kind; off, a call tests one flag (no clock read, no branch per layer).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "qk.h"
#include "qk_decode.h"
#include "qk_mla.h"
#include "qk_moe.h"
#include "qk_recurrent.h"
#include "qk_runtime.h"

/* several weights sharing x, their outputs side by side in rows of `width` floats */
static int products(const kv_wdesc *ws, int64_t count, const float *x, int64_t n, float *y,
                    int64_t width) {
    for (int64_t p = 0, off = 0; p < count; off += ws[p].rows, p++)
        if (kv_product(&ws[p], x, n, y + off, width)) return -1;
    return 0;
}

typedef struct {
    float *h, *qkv, *att, *o, *gu, *g;
    float *shared;            /* [B, hidden]: the shared expert's output */
    float *moe_in;            /* [B, hidden]: x through the router's or the experts' norm */
    float *logits, *route_w;  /* [B, E], [B, k]: router scores, the chosen experts' weights */
    int64_t *route_ids;       /* [B, k] */
    int64_t *ones;            /* [B]: one token per sequence, the recurrent steps' lens */
} kv_bufs;

/* a float the plan holds as its fp32 bits */
static float plan_f32(int64_t v) {
    const int32_t bits = (int32_t)v;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* the residual add after attention or the MLP: with the block's output norm or without;
 * Granite's x += scale * h in one rounding, as torch's add_(h, alpha=scale) */
static void residual(const kv_layer_plan *L, float *x, const float *h, int64_t norm,
                     const kv_step *s) {
    if (norm) {
        kv_add_rms_norm(x, h, (const float *)(intptr_t)norm, s->B, s->hidden, s->eps);
        return;
    }
    if (L->residual_scale) {
        const float scale = plan_f32(L->residual_scale);
        for (int64_t i = 0; i < s->B * s->hidden; i++) x[i] = fmaf(h[i], scale, x[i]);
        return;
    }
    for (int64_t i = 0; i < s->B * s->hidden; i++) x[i] += h[i];
}

static void add_bias(float *y, const float *bias, int64_t rows, int64_t width) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < width; i++) y[r * width + i] += bias[i];
}

/* OLMoE: one RMSNorm over each row's whole q (H * D) and whole k, before RoPE */
static void norm_whole_qk(const kv_layer_plan *L, const kv_step *s, float *qkv, int64_t width) {
    const int64_t q = s->H * s->D, k = s->KVH * s->D;
    for (int64_t r = 0; r < s->B; r++) {
        float *row = qkv + r * width;
        kv_rms_norm(row, (const float *)(intptr_t)L->q_norm, row, 1, q, s->eps);
        kv_rms_norm(row + q, (const float *)(intptr_t)L->k_norm, row + q, 1, k, s->eps);
    }
}

/* h = rms_norm(x) * norm, or x as it is where the layer has no norm before its products
 * (OLMo 2 norms their outputs instead: post_attn_norm, post_mlp_norm) */
static void pre_norm(const float *x, int64_t norm, float *h, const kv_step *s) {
    if (norm)
        kv_rms_norm(x, (const float *)(intptr_t)norm, h, s->B, s->hidden, s->eps);
    else
        memcpy(h, x, (size_t)(s->B * s->hidden) * sizeof(float));
}

/* the layer's head size and KV heads: its own (Gemma 4's full layers) or the step's */
static int64_t layer_dim(const kv_layer_plan *L, const kv_step *s) {
    return L->head_dim ? L->head_dim : s->D;
}

static int64_t layer_kv_heads(const kv_layer_plan *L, const kv_step *s) {
    return L->kv_heads ? L->kv_heads : s->KVH;
}

/* the new keys and values: v = k where the layer has no v product, v's per-head norm, k's
 * norm and RoPE (q's is done by the caller) */
static void new_keys_values(const kv_layer_plan *L, const kv_step *s, float *qkv,
                            int64_t width, int64_t KVH, int64_t D) {
    const int64_t B = s->B, H = s->H, w = L->sliding != 0;
    float *k = qkv + H * D, *v = k + KVH * D;
    for (int64_t r = 0; r < B && L->values_from_keys; r++)
        memcpy(v + r * width, k + r * width, (size_t)(KVH * D) * sizeof(float));
    for (int64_t r = 0; r < B && L->v_norm; r++)
        kv_rms_norm(v + r * width, (const float *)(intptr_t)L->v_norm, v + r * width, KVH, D,
                    s->eps);
    const int64_t k_norm = L->qk_norm_whole ? 0 : L->k_norm;
    kv_norm_rope(k, B, width, KVH, D, (const float *)(intptr_t)k_norm, s->cos[w], s->sin[w],
                 s->eps);
}

static void write_keys_values(const int64_t *kv, const kv_step *s, const float *qkv,
                              int64_t width, int64_t H, int64_t KVH, int64_t D, int w) {
    void *kc = (void *)(intptr_t)kv[0], *vc = (void *)(intptr_t)kv[1];
    kv_half *ks = (kv_half *)(intptr_t)kv[2], *vs = (kv_half *)(intptr_t)kv[3];
    const float *knew = qkv + H * D, *vnew = qkv + (H + KVH) * D;
    if (s->kv_kind == KV_CACHE_Q8_0) {
        kv_scatter_rows_q8(kc, ks, knew, width, s->slot_mapping[w], s->B, KVH * D);
        kv_scatter_rows_q8(vc, vs, vnew, width, s->slot_mapping[w], s->B, KVH * D);
    } else {
        const int f16 = s->kv_kind == KV_CACHE_F16;
        kv_scatter_rows(kc, f16, knew, width, s->slot_mapping[w], s->B, KVH * D);
        kv_scatter_rows(vc, f16, vnew, width, s->slot_mapping[w], s->B, KVH * D);
    }
}

static int attention_half(const kv_layer_plan *L, const int64_t *kv, const kv_step *s,
                          float *x, kv_bufs *b, int use_avx2) {
    const int64_t B = s->B, D = layer_dim(L, s), H = s->H, KVH = layer_kv_heads(L, s);
    const int64_t width = (H + 2 * KVH) * D;
    const int w = L->sliding != 0;
    pre_norm(x, L->attn_norm, b->h, s);
    if (products(L->qkv, L->n_qkv, b->h, B, b->qkv, width)) return -1;
    if (L->qkv_bias) add_bias(b->qkv, (const float *)(intptr_t)L->qkv_bias, B, width);
    if (L->qk_norm_whole) norm_whole_qk(L, s, b->qkv, width);
    const int64_t q_norm = L->qk_norm_whole ? 0 : L->q_norm;
    kv_norm_rope(b->qkv, B, width, H, D, (const float *)(intptr_t)q_norm, s->cos[w],
                 s->sin[w], s->eps);
    if (!L->kv_shared) {
        new_keys_values(L, s, b->qkv, width, KVH, D);
        write_keys_values(kv, s, b->qkv, width, H, KVH, D, w);
    }
    void *kc = (void *)(intptr_t)kv[0], *vc = (void *)(intptr_t)kv[1];
    kv_half *ks = (kv_half *)(intptr_t)kv[2], *vs = (kv_half *)(intptr_t)kv[3];
    const kv_cache_ref ref = {.kind = s->kv_kind, .k = kc, .v = vc, .k_scale = ks,
                              .v_scale = vs};
    if (kv_attend_decode(b->qkv, width, &ref, s->slots[w], s->lengths[w], B,
                         s->C[w], H, KVH, D, s->scale, s->softcap,
                         (const float *)(intptr_t)L->sinks, b->att, use_avx2))
        return -1;
    if (kv_product(&L->o, b->att, B, b->o, s->hidden)) return -1;
    if (L->o_bias) add_bias(b->o, (const float *)(intptr_t)L->o_bias, B, s->hidden);
    residual(L, x, b->o, L->post_attn_norm, s);
    return 0;
}

/* latent attention's products before the attention: q [B, H * D] (its rope part rotated)
 * and kv [B, rank + rope] (the latent normed, the key part rotated), as the per-op path
 * (kvlab/models/deepseek2.py) */
static int mla_inputs(const kv_layer_plan *L, const kv_step *s, const float *h, float *qa,
                      float *q, float *kv) {
    const int64_t B = s->B, H = s->H, D = s->D, rope = L->rope, W = L->rank + rope;
    if (L->q_a.ptr) {
        if (kv_product(&L->q_a, h, B, qa, L->q_a.rows)) return -1;
        kv_rms_norm(qa, (const float *)(intptr_t)L->q_a_norm, qa, B, L->q_a.rows, s->eps);
        if (kv_product(&L->q_b, qa, B, q, H * D)) return -1;
    } else if (kv_product(&L->q_b, h, B, q, H * D)) {
        return -1;
    }
    if (kv_product(&L->kv_a, h, B, kv, W)) return -1;
    for (int64_t r = 0; r < B; r++)
        kv_rms_norm(kv + r * W, (const float *)(intptr_t)L->kv_a_norm, kv + r * W, 1, L->rank,
                    s->eps);
    for (int64_t hd = 0; hd < H; hd++)
        kv_norm_rope(q + hd * D + D - rope, B, H * D, 1, rope, NULL, s->cos[0], s->sin[0],
                     s->eps);
    kv_norm_rope(kv + L->rank, B, W, 1, rope, NULL, s->cos[0], s->sin[0], s->eps);
    return 0;
}

/* multi-head latent attention: the new latent rows into the store, then the absorbed
 * attention over it (qk_mla.c) and o */
static int mla_half(const kv_layer_plan *L, const int64_t *kv, const kv_step *s, float *x,
                    kv_bufs *b, int use_avx2) {
    const int64_t B = s->B, H = s->H, D = s->D, W = L->rank + L->rope;
    const int64_t qa_rows = L->q_a.ptr ? L->q_a.rows : 0;
    float *qa = malloc((size_t)(B * (qa_rows + H * D + W + H * L->vdim)) * sizeof(float));
    if (!qa) return -1;
    float *q = qa + B * qa_rows, *lat = q + B * H * D, *att = lat + B * W;
    pre_norm(x, L->attn_norm, b->h, s);
    int rc = mla_inputs(L, s, b->h, qa, q, lat);
    if (!rc) {
        void *store = (void *)(intptr_t)kv[0];
        kv_scatter_rows(store, s->kv_kind == KV_CACHE_F16, lat, W, s->slot_mapping[0], B, W);
        const kv_cache_ref ref = {.kind = s->kv_kind, .k = store, .v = store};
        const kv_mla_heads m = {.w_uk = (const float *)(intptr_t)L->w_uk,
                                .w_uv_t = (const float *)(intptr_t)L->w_uv_t, .H = H,
                                .nope = D - L->rope, .rope = L->rope, .rank = L->rank,
                                .vdim = L->vdim};
        const kv_mla_keys keys = {.slots = s->slots[0], .lengths = s->lengths[0], .B = B,
                                  .C = s->C[0]};
        const int isa = use_avx2 ? (kv_use_vnni() ? 2 : 1) : 0;
        rc = kv_mla_attend(q, H * D, &m, &ref, &keys, s->scale, att, isa) ||
             kv_product(&L->o, att, B, b->o, s->hidden);
    }
    free(qa);
    if (rc) return -1;
    residual(L, x, b->o, L->post_attn_norm, s);
    return 0;
}

/* LFM2's short convolution in attention's place, as the per-op path (kvlab/models/lfm2.py):
 * rc_in's [b | c | u], b * u through the conv (qk_recurrent.c, its one-token form) on the
 * sequence's state row, times c, then rc_out; the conv's output takes h's place (C is the
 * hidden size, checked by the plan) */
static int conv_half(const kv_layer_plan *L, const int64_t *st, const kv_step *s, float *x,
                     kv_bufs *b, int use_avx2) {
    const int64_t B = s->B, C = L->rc_out.cols, W = 3 * C;
    pre_norm(x, L->attn_norm, b->h, s);
    if (kv_product(&L->rc_in[0], b->h, B, b->qkv, W)) return -1;
    for (int64_t r = 0; r < B; r++)
        for (int64_t i = 0; i < C; i++)
            b->att[r * C + i] = b->qkv[r * W + i] * b->qkv[r * W + 2 * C + i];
    const int isa = use_avx2 ? (kv_use_vnni() ? 2 : 1) : 0;
    if (kv_short_conv(b->att, (const float *)(intptr_t)L->conv, NULL, (float *)(intptr_t)st[0],
                      s->state_slots, b->ones, B, C, L->conv_k, 0, b->h, isa))
        return -1;
    for (int64_t r = 0; r < B; r++)
        for (int64_t i = 0; i < C; i++) b->h[r * C + i] = b->qkv[r * W + C + i] * b->h[r * C + i];
    if (kv_product(&L->rc_out, b->h, B, b->o, s->hidden)) return -1;
    residual(L, x, b->o, L->post_attn_norm, s);
    return 0;
}

/* q and k of each row L2-normed per key head in place (x / sqrt(sum x^2 + 1e-6)), then
 * each into q2, k2 [B, n, k_dim]: n = v_heads, value head j's copy of key head j % k_heads
 * where v_tiled, else n = k_heads as they are */
static void delta_qk(const kv_layer_plan *L, int64_t B, int64_t C, float *conv, float *q2,
                     float *k2) {
    const int64_t Hk = L->k_heads, Dk = L->k_dim, Hv = L->v_heads;
    for (int64_t r = 0; r < B; r++)
        for (int64_t h = 0; h < 2 * Hk; h++) {
            float *v = conv + r * C + h * Dk, sum = 0.0f;
            for (int64_t i = 0; i < Dk; i++) sum += v[i] * v[i];
            const float inv = 1.0f / sqrtf(sum + 1e-6f);
            for (int64_t i = 0; i < Dk; i++) v[i] *= inv;
        }
    const int64_t n = L->v_tiled ? Hv : Hk;  /* the heads the delta rule reads */
    for (int64_t r = 0; r < B; r++)
        for (int64_t j = 0; j < n; j++) {
            const float *q = conv + r * C + (j % Hk) * Dk;
            memcpy(q2 + (r * n + j) * Dk, q, (size_t)Dk * sizeof(float));
            memcpy(k2 + (r * n + j) * Dk, q + Hk * Dk, (size_t)Dk * sizeof(float));
        }
}

/* Qwen3.5's Gated DeltaNet in attention's place, as the per-op path (kvlab/models/
 * qwen3_5.py): the conv, the delta rule and the gated norm are qk_recurrent.c's */
static int delta_half(const kv_layer_plan *L, const int64_t *st, const kv_step *s, float *x,
                      kv_bufs *b, int use_avx2) {
    const int64_t B = s->B, Hk = L->k_heads, Hv = L->v_heads, Dk = L->k_dim, Dv = L->v_dim;
    const int64_t C = 2 * Hk * Dk + Hv * Dv, V = Hv * Dv, W = C + V + 2 * Hv;
    float *in = malloc((size_t)(B * (W + 2 * C + 2 * Hv * Dk + 2 * Hv + 3 * V)) * sizeof(float));
    if (!in) return -1;
    float *cin = in + B * W, *cout = cin + B * C, *q = cout + B * C, *k = q + B * Hv * Dk;
    float *g = k + B * Hv * Dk, *beta = g + B * Hv, *v = beta + B * Hv, *z = v + B * V;
    float *o = z + B * V;
    const int isa = use_avx2 ? (kv_use_vnni() ? 2 : 1) : 0;
    const float *ssm_a = (const float *)(intptr_t)L->ssm_a;
    const float *dt_bias = (const float *)(intptr_t)L->dt_bias;
    pre_norm(x, L->attn_norm, b->h, s);
    int rc = products(L->rc_in, L->n_rc_in, b->h, B, in, W);
    for (int64_t r = 0; r < B && !rc; r++) {
        const float *row = in + r * W;
        memcpy(cin + r * C, row, (size_t)C * sizeof(float));
        memcpy(z + r * V, row + C, (size_t)V * sizeof(float));
        for (int64_t h = 0; h < Hv; h++) {
            const float a = row[C + V + Hv + h] + dt_bias[h];
            g[r * Hv + h] = ssm_a[h] * (a > 20.0f ? a : log1pf(expf(a)));
            beta[r * Hv + h] = 1.0f / (1.0f + expf(-row[C + V + h]));
        }
    }
    rc = rc || kv_short_conv(cin, (const float *)(intptr_t)L->conv, NULL,
                             (float *)(intptr_t)st[0], s->state_slots, b->ones, B, C,
                             L->conv_k, 1, cout, isa);
    if (!rc) {
        delta_qk(L, B, C, cout, q, k);
        for (int64_t r = 0; r < B; r++)
            memcpy(v + r * V, cout + r * C + 2 * Hk * Dk, (size_t)V * sizeof(float));
        rc = kv_gated_delta_rule(q, k, v, g, beta, (float *)(intptr_t)st[1], s->state_slots,
                                 b->ones, B, L->v_tiled ? Hv : Hk, Hv, Dk, Dv,
                                 (float)pow((double)Dk, -0.5), o, isa) ||
             kv_gated_rms_norm(o, z, (const float *)(intptr_t)L->rc_norm, v, B * Hv, Dv, Dv,
                               s->eps, 1, isa) ||
             kv_product(&L->rc_out, v, B, b->o, s->hidden);
    }
    free(in);
    if (rc) return -1;
    residual(L, x, b->o, L->post_attn_norm, s);
    return 0;
}

/* z | xBC | dt of each row apart: z into z [B, d_inner], xBC into xbc [B, C], dt as
 * softplus(dt + dt_bias) clamped, as the per-op path (kvlab/models/mamba2_layer.py) */
static void mamba2_inputs(const kv_layer_plan *L, int64_t B, const float *in, float *z,
                          float *xbc, float *dt) {
    const int64_t H = L->v_heads, DI = H * L->v_dim, C = DI + 2 * L->k_heads * L->k_dim;
    const int64_t W = DI + C + H;
    const float *dt_bias = (const float *)(intptr_t)L->dt_bias;
    const float lo = plan_f32(L->dt_min), hi = plan_f32(L->dt_max);
    for (int64_t r = 0; r < B; r++) {
        const float *row = in + r * W;
        memcpy(z + r * DI, row, (size_t)DI * sizeof(float));
        memcpy(xbc + r * C, row + DI, (size_t)C * sizeof(float));
        for (int64_t h = 0; h < H; h++) {
            const float a = row[DI + C + h] + dt_bias[h];
            const float sp = a > 20.0f ? a : log1pf(expf(a));
            dt[r * H + h] = fminf(fmaxf(sp, lo), hi);
        }
    }
}

/* the conv's output rows [B, C] split into x [B, d_inner], B and C [B, G * N] */
static void mamba2_split(int64_t B, int64_t DI, int64_t GN, const float *conv, float *xs,
                         float *bs, float *cs) {
    const int64_t C = DI + 2 * GN;
    for (int64_t r = 0; r < B; r++) {
        memcpy(xs + r * DI, conv + r * C, (size_t)DI * sizeof(float));
        memcpy(bs + r * GN, conv + r * C + DI, (size_t)GN * sizeof(float));
        memcpy(cs + r * GN, conv + r * C + DI + GN, (size_t)GN * sizeof(float));
    }
}

/* Mamba-2 in attention's place (Granite 4 hybrid, Nemotron-H), as the per-op path: the
 * conv, the SSD step and the gated norm are qk_recurrent.c's */
static int mamba2_half(const kv_layer_plan *L, const int64_t *st, const kv_step *s, float *x,
                       kv_bufs *b, int use_avx2) {
    const int64_t B = s->B, H = L->v_heads, P = L->v_dim, G = L->k_heads, N = L->k_dim;
    const int64_t DI = H * P, GN = G * N, C = DI + 2 * GN, W = DI + C + H;
    float *in = malloc((size_t)(B * (W + 3 * C + H + 3 * DI)) * sizeof(float));
    if (!in) return -1;
    float *xbc = in + B * W, *conv = xbc + B * C, *xs = conv + B * C, *bs = xs + B * DI;
    float *cs = bs + B * GN, *dt = cs + B * GN, *z = dt + B * H, *y = z + B * DI;
    float *normed = y + B * DI;
    const int isa = use_avx2 ? (kv_use_vnni() ? 2 : 1) : 0;
    pre_norm(x, L->attn_norm, b->h, s);
    int rc = kv_product(&L->rc_in[0], b->h, B, in, W);
    if (!rc) {
        if (L->rc_in_bias) add_bias(in, (const float *)(intptr_t)L->rc_in_bias, B, W);
        mamba2_inputs(L, B, in, z, xbc, dt);
        rc = kv_short_conv(xbc, (const float *)(intptr_t)L->conv,
                           (const float *)(intptr_t)L->conv_bias, (float *)(intptr_t)st[0],
                           s->state_slots, b->ones, B, C, L->conv_k, 1, conv, isa);
    }
    if (!rc) {
        mamba2_split(B, DI, GN, conv, xs, bs, cs);
        rc = kv_ssd_scan(xs, dt, (const float *)(intptr_t)L->ssm_a, bs, cs,
                         (const float *)(intptr_t)L->ssm_d, (float *)(intptr_t)st[1],
                         s->state_slots, b->ones, B, H, P, G, N, y, isa) ||
             kv_gated_rms_norm(y, z, (const float *)(intptr_t)L->rc_norm, normed, B, DI,
                               DI / G, s->eps, 0, isa) ||
             kv_product(&L->rc_out, normed, B, b->o, s->hidden);
    }
    free(in);
    if (rc) return -1;
    if (L->rc_out_bias) add_bias(b->o, (const float *)(intptr_t)L->rc_out_bias, B, s->hidden);
    residual(L, x, b->o, L->post_attn_norm, s);
    return 0;
}

/* a head's RMSNorm over all its dims, then RoPE on the first `rotary` of them, each row */
static void norm_partial_rope(float *x, int64_t B, int64_t stride, int64_t heads,
                              int64_t head_stride, int64_t D, int64_t rotary, int64_t norm,
                              const kv_step *s) {
    for (int64_t h = 0; h < heads; h++) {
        float *head = x + h * head_stride;
        for (int64_t r = 0; r < B && norm; r++)
            kv_rms_norm(head + r * stride, (const float *)(intptr_t)norm, head + r * stride, 1,
                        D, s->eps);
        kv_norm_rope(head, B, stride, 1, rotary, NULL, s->cos[0], s->sin[0], s->eps);
    }
}

/* Qwen3.5's gated attention: q | gate per head, k, v from the products; QK-norm and partial
 * RoPE; q, k, v side by side for the C attention; out * sigmoid(gate), then o */
static int gated_attention_half(const kv_layer_plan *L, const int64_t *kv, const kv_step *s,
                                float *x, kv_bufs *b, int use_avx2) {
    const int64_t B = s->B, D = s->D, H = s->H, KVH = s->KVH, rotary = L->rotary;
    const int64_t width = (2 * H + 2 * KVH) * D, packed = (H + 2 * KVH) * D;
    float *qkv = malloc((size_t)(B * (packed + H * D)) * sizeof(float));
    if (!qkv) return -1;
    float *att = qkv + B * packed;
    pre_norm(x, L->attn_norm, b->h, s);
    int rc = products(L->qkv, L->n_qkv, b->h, B, b->qkv, width);
    if (!rc) {
        norm_partial_rope(b->qkv, B, width, H, 2 * D, D, rotary, L->q_norm, s);
        norm_partial_rope(b->qkv + 2 * H * D, B, width, KVH, D, D, rotary, L->k_norm, s);
        for (int64_t r = 0; r < B; r++) {
            for (int64_t h = 0; h < H; h++)
                memcpy(qkv + r * packed + h * D, b->qkv + r * width + h * 2 * D,
                       (size_t)D * sizeof(float));
            memcpy(qkv + r * packed + H * D, b->qkv + r * width + 2 * H * D,
                   (size_t)(2 * KVH * D) * sizeof(float));
        }
        write_keys_values(kv, s, qkv, packed, H, KVH, D, 0);
        void *kc = (void *)(intptr_t)kv[0], *vc = (void *)(intptr_t)kv[1];
        kv_half *ks = (kv_half *)(intptr_t)kv[2], *vs = (kv_half *)(intptr_t)kv[3];
        const kv_cache_ref ref = {.kind = s->kv_kind, .k = kc, .v = vc, .k_scale = ks,
                                  .v_scale = vs};
        rc = kv_attend_decode(qkv, packed, &ref, s->slots[0], s->lengths[0], B, s->C[0], H, KVH,
                              D, s->scale, s->softcap, NULL, att, use_avx2);
    }
    for (int64_t r = 0; r < B && !rc; r++)
        for (int64_t h = 0; h < H; h++) {
            const float *gate = b->qkv + r * width + h * 2 * D + D;
            float *out = att + (r * H + h) * D;
            for (int64_t i = 0; i < D; i++) out[i] *= 1.0f / (1.0f + expf(-gate[i]));
        }
    rc = rc || kv_product(&L->o, att, B, b->o, s->hidden);
    free(qkv);
    if (rc) return -1;
    residual(L, x, b->o, L->post_attn_norm, s);
    return 0;
}

/* the layer's token mixer: attention, latent attention, a recurrent step or none */
static int mixer_half(const kv_layer_plan *L, int64_t l, const kv_step *s, float *x,
                      kv_bufs *b, int use_avx2) {
    if (L->mixer == KV_MIX_SHORT_CONV) return conv_half(L, s->states + 2 * l, s, x, b, use_avx2);
    if (L->mixer == KV_MIX_GATED_DELTA)
        return delta_half(L, s->states + 2 * l, s, x, b, use_avx2);
    if (L->mixer == KV_MIX_MAMBA2) return mamba2_half(L, s->states + 2 * l, s, x, b, use_avx2);
    if (L->mixer == KV_MIX_NONE) return 0;
    if (L->q_gate) return gated_attention_half(L, s->caches + 4 * l, s, x, b, use_avx2);
    if (L->mla) return mla_half(L, s->caches + 4 * l, s, x, b, use_avx2);
    return attention_half(L, s->caches + 4 * l, s, x, b, use_avx2);
}

/* gate_up -> act(gate) * up -> down on b->h into y [B, hidden]: the dense MLP, or the
 * shared expert of an MoE layer; down(relu(up)^2) where gate_up is up alone (KV_GATE_RELU2) */
static int gated_mlp(const kv_layer_plan *L, const kv_step *s, kv_bufs *b, float *y) {
    int64_t gu_rows = 0;
    for (int64_t p = 0; p < L->n_gate_up; p++) gu_rows += L->gate_up[p].rows;
    if (products(L->gate_up, L->n_gate_up, b->h, s->B, b->gu, gu_rows)) return -1;
    if (L->gate == KV_GATE_RELU2) {
        /* a dense layer's biases (Nemotron-H's mlp_bias) are its one row of these fields */
        const float *up_bias = L->router ? NULL : (const float *)(intptr_t)L->gate_up_bias;
        const float *down_bias = L->router ? NULL : (const float *)(intptr_t)L->down_bias;
        if (up_bias) add_bias(b->gu, up_bias, s->B, gu_rows);
        kv_relu2(b->gu, b->gu, s->B * gu_rows);
        if (kv_product(&L->down, b->gu, s->B, y, s->hidden)) return -1;
        if (down_bias) add_bias(y, down_bias, s->B, s->hidden);
        return 0;
    }
    if (L->gate == KV_GATE_SILU)
        kv_silu_mul(b->gu, b->g, s->B, gu_rows / 2);
    else
        kv_gelu_mul(b->gu, b->g, s->B, gu_rows / 2);
    return kv_product(&L->down, b->g, s->B, y, s->hidden);
}

/* x through a norm of its own into `own`, or the mlp_norm'ed h where the norm is 0 */
static const float *norm_input(const float *x, int64_t norm, const kv_step *s, kv_bufs *b,
                               float *own) {
    if (!norm) return b->h;
    kv_rms_norm(x, (const float *)(intptr_t)norm, own, s->B, s->hidden, s->eps);
    return own;
}

static void norm_output(float *y, int64_t norm, const kv_step *s) {
    if (norm) kv_rms_norm(y, (const float *)(intptr_t)norm, y, s->B, s->hidden, s->eps);
}

/* o += sigmoid(shexp_gate . h) * shared expert(h), row by row: the product, then the add,
 * as the per-op path's torch ops (kvlab/models/moe.py: moe_mlp); without the gate (GLM-4.5)
 * o += shared expert(h) */
static int shared_expert(const kv_layer_plan *L, const kv_step *s, kv_bufs *b) {
    const kv_wdesc gate = {.qt = KV_F32, .ptr = L->shexp_gate, .rows = 1, .cols = s->hidden,
                           .row_bytes = s->hidden * (int64_t)sizeof(float)};
    if (gated_mlp(L, s, b, b->shared)) return -1;
    norm_output(b->shared, L->shexp_out_norm, s);
    if (L->shexp_ungated) {
        for (int64_t i = 0; i < s->B * s->hidden; i++) b->o[i] += b->shared[i];
        return 0;
    }
    if (kv_product(&gate, b->h, s->B, b->logits, 1)) return -1;  /* the router's are used */
    for (int64_t r = 0; r < s->B; r++) {
        const float g = 1.0f / (1.0f + expf(-b->logits[r]));
        float *o = b->o + r * s->hidden;
        const float *sh = b->shared + r * s->hidden;
        for (int64_t i = 0; i < s->hidden; i++) o[i] += g * sh[i];
    }
    return 0;
}

/* each row's k experts and their weights from the router's logits, by the layer's scoring */
static void route(const kv_layer_plan *L, const kv_step *s, kv_bufs *b) {
    const int64_t E = L->n_experts, k = L->top_k;
    const float *bias = (const float *)(intptr_t)L->router_bias;
    for (int64_t r = 0; r < s->B; r++) {
        float *logits = b->logits + r * E, *w = b->route_w + r * k;
        int64_t *ids = b->route_ids + r * k;
        if (L->scoring == KV_ROUTE_SIGMOID) {
            kv_moe_route_sigmoid(logits, bias, E, k, L->groups, L->top_groups,
                                 (int)L->norm_topk, plan_f32(L->routed_scale), ids, w);
            continue;
        }
        if (bias)
            for (int64_t e = 0; e < E; e++) logits[e] += bias[e];
        if (L->scoring == KV_ROUTE_TOPK_SOFTMAX)
            kv_moe_route_topk_softmax(logits, E, k, ids, w);
        else
            kv_moe_route(logits, E, k, L->groups, L->top_groups, (int)L->norm_topk, ids, w);
        const float scale = plan_f32(L->routed_scale);  /* DeepSeek-V2 scales them */
        if (L->scoring == KV_ROUTE_SOFTMAX && scale != 1.0f)
            for (int64_t j = 0; j < k; j++) w[j] *= scale;
    }
}

/* the chosen experts on `in` into b->o [B, hidden]: in the layer's latent where it has one
 * (latent_in before them, latent_out after), as the per-op path (kvlab/models/nemotron_h.py) */
static int routed_experts(const kv_layer_plan *L, const kv_step *s, kv_bufs *b,
                          const float *in, const kv_moe_opts *opts) {
    const kv_wdesc *experts = (const kv_wdesc *)(intptr_t)L->experts;
    if (!L->latent_in.ptr)
        return kv_moe_experts_opts(kv_active_isa(), experts, L->n_experts, in, s->B, s->hidden,
                                   b->route_ids, b->route_w, L->top_k, opts, b->o);
    const int64_t B = s->B, width = L->latent_in.rows;
    float *lat = malloc((size_t)(2 * B * width) * sizeof(float));
    if (!lat) return -1;
    int rc = kv_product(&L->latent_in, in, B, lat, width) ||
             kv_moe_experts_opts(kv_active_isa(), experts, L->n_experts, lat, B, width,
                                 b->route_ids, b->route_w, L->top_k, opts, lat + B * width) ||
             kv_product(&L->latent_out, lat + B * width, B, b->o, s->hidden);
    free(lat);
    return rc ? -1 : 0;
}

/* the router's scores, each row's top k, then the chosen experts (qk_moe.c) and the shared
 * expert (Gemma 4: the dense MLP) where the layer has one */
static int moe_half(const kv_layer_plan *L, const kv_step *s, float *x, kv_bufs *b) {
    const int64_t E = L->n_experts, k = L->top_k;
    const kv_wdesc router = {.qt = KV_F32, .ptr = L->router, .rows = E, .cols = s->hidden,
                             .row_bytes = s->hidden * (int64_t)sizeof(float)};
    pre_norm(x, L->mlp_norm, b->h, s);
    const float *in = norm_input(x, L->router_norm, s, b, b->moe_in);
    if (kv_product(&router, in, s->B, b->logits, E)) return -1;
    route(L, s, b);
    const float *scale = (const float *)(intptr_t)L->expert_scale;
    for (int64_t j = 0; scale && j < s->B * k; j++) b->route_w[j] *= scale[b->route_ids[j]];
    const int act = L->expert_relu2 ? KV_MOE_RELU2
                    : L->expert_gelu ? KV_MOE_GELU
                    : L->expert_clamp ? KV_MOE_SWIGLU_CLAMP : KV_MOE_SILU;
    const kv_moe_opts opts = {.gate_up_bias = (const float *)(intptr_t)L->gate_up_bias,
                              .down_bias = (const float *)(intptr_t)L->down_bias,
                              .act = act, .alpha = plan_f32(L->clamp_alpha),
                              .limit = plan_f32(L->clamp_limit)};
    in = norm_input(x, L->experts_norm, s, b, b->moe_in);
    if (routed_experts(L, s, b, in, &opts)) return -1;
    norm_output(b->o, L->experts_out_norm, s);
    if ((L->shexp_gate || L->shexp_ungated) && shared_expert(L, s, b)) return -1;
    residual(L, x, b->o, L->post_mlp_norm, s);
    return 0;
}

/* the layer's MLP: routed experts, a dense MLP, or none (n_gate_up 0: Nemotron-H's mixer
 * layers, whose MLPs are layers of their own) */
static int mlp_half(const kv_layer_plan *L, const kv_step *s, float *x, kv_bufs *b) {
    if (L->router) return moe_half(L, s, x, b);
    if (!L->n_gate_up) return 0;
    pre_norm(x, L->mlp_norm, b->h, s);
    if (gated_mlp(L, s, b, b->o)) return -1;
    residual(L, x, b->o, L->post_mlp_norm, s);
    return 0;
}

/* Gemma 4 after the MLP: the per-layer input (gelu_tanh(ple_gate(x)) times the layer's
 * slice of the step's row, gate | slice side by side as kv_gelu_mul takes them, then
 * ple_out and the normed add), then the layer's output scale */
static int layer_tail(const kv_layer_plan *L, const kv_step *s, float *x, kv_bufs *b) {
    const int64_t B = s->B, dim = L->ple_gate.rows;
    if (L->ple_gate.ptr) {
        if (kv_product(&L->ple_gate, x, B, b->gu, 2 * dim)) return -1;
        for (int64_t r = 0; r < B; r++)
            memcpy(b->gu + r * 2 * dim + dim, s->ple + r * s->ple_width + L->ple_col,
                   (size_t)dim * sizeof(float));
        kv_gelu_mul(b->gu, b->g, B, dim);
        if (kv_product(&L->ple_out, b->g, B, b->o, s->hidden)) return -1;
        residual(L, x, b->o, L->ple_post_norm, s);
    }
    if (L->layer_scalar) {
        const float scalar = *(const float *)(intptr_t)L->layer_scalar;
        for (int64_t i = 0; i < B * s->hidden; i++) x[i] *= scalar;
    }
    return 0;
}

/* the profile's sums: touched only under the job lock (by the calls and by enable, reset
 * and read), so plain integers */
static struct {
    int on;
    int64_t calls;
    int64_t ns[KV_PROF_KINDS];
} profile;

static int64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

void kv_decode_profile_enable(int on) {
    kv_job_lock();
    profile.on = on != 0;
    kv_job_unlock();
}

void kv_decode_profile_reset(void) {
    kv_job_lock();
    profile.calls = 0;
    memset(profile.ns, 0, sizeof profile.ns);
    kv_job_unlock();
}

int64_t kv_decode_profile_read(int64_t ns[KV_PROF_KINDS]) {
    kv_job_lock();
    memcpy(ns, profile.ns, sizeof profile.ns);
    const int64_t calls = profile.calls;
    kv_job_unlock();
    return calls;
}

/* the time since `since` added to `kind`; returns now, the next stage's start */
static int64_t lap(int kind, int64_t since) {
    const int64_t now = monotonic_ns();
    profile.ns[kind] += now - since;
    return now;
}

static int mixer_kind(const kv_layer_plan *L) {
    if (L->mixer == KV_MIX_NONE) return KV_PROF_TAIL;  /* nothing mixed: a few branches */
    return L->mixer == KV_MIX_ATTENTION ? KV_PROF_ATTENTION : KV_PROF_RECURRENT;
}

static int run_layers(const kv_layer_plan *plan, int64_t layers, const kv_step *s, float *x,
                      kv_bufs *b, int use_avx2) {
    int rc = 0;
    for (int64_t l = 0; l < layers && !rc; l++)
        rc = mixer_half(&plan[l], l, s, x, b, use_avx2) || mlp_half(&plan[l], s, x, b) ||
             layer_tail(&plan[l], s, x, b);
    return rc;
}

/* run_layers with each stage's wall time added to its kind */
static int run_layers_timed(const kv_layer_plan *plan, int64_t layers, const kv_step *s,
                            float *x, kv_bufs *b, int use_avx2) {
    int rc = 0;
    int64_t t = monotonic_ns();
    for (int64_t l = 0; l < layers && !rc; l++) {
        const kv_layer_plan *L = &plan[l];
        rc = mixer_half(L, l, s, x, b, use_avx2);
        t = lap(mixer_kind(L), t);
        rc = rc || mlp_half(L, s, x, b);
        t = lap(KV_PROF_MLP, t);
        rc = rc || layer_tail(L, s, x, b);
        t = lap(KV_PROF_TAIL, t);
    }
    return rc;
}

#define KV_MAX(a, b) ((a) > (b) ? (a) : (b))

int kv_decode_layers(const kv_layer_plan *plan, int64_t layers, float *x, const kv_step *s,
                     int use_avx2) {
    const int timed = profile.on;
    const int64_t start = timed ? monotonic_ns() : 0;
    int64_t gu = 0, qkv = (s->H + 2 * s->KVH) * s->D, att = s->H * s->D, E = 0, k = 0;
    for (int64_t l = 0; l < layers; l++) {
        const kv_layer_plan *L = &plan[l];
        int64_t rows = 0;
        for (int64_t p = 0; p < L->n_gate_up; p++) rows += L->gate_up[p].rows;
        gu = KV_MAX(gu, KV_MAX(rows, 2 * L->ple_gate.rows));
        E = KV_MAX(E, L->n_experts);
        k = KV_MAX(k, L->top_k);
        const int64_t D = layer_dim(L, s);
        qkv = KV_MAX(qkv, KV_MAX((s->H * (1 + L->q_gate) + 2 * layer_kv_heads(L, s)) * D,
                                 L->rc_in[0].rows));
        att = KV_MAX(att, KV_MAX(s->H * D, L->rc_out.cols));
    }
    const int64_t B = s->B;
    float *mem = malloc((size_t)(B * (4 * s->hidden + qkv + att + gu + gu / 2 + E +
                                      3 * k + 2)) * sizeof(float));
    if (!mem) return -1;
    kv_bufs b = {.h = mem};
    b.qkv = b.h + B * s->hidden;
    b.att = b.qkv + B * qkv;
    b.o = b.att + B * att;
    b.gu = b.o + B * s->hidden;
    b.g = b.gu + B * gu;
    b.shared = b.g + B * (gu / 2);
    b.moe_in = b.shared + B * s->hidden;
    b.logits = b.moe_in + B * s->hidden;
    b.route_w = b.logits + B * E;
    b.route_ids = (int64_t *)(b.route_w + B * k);  /* 2k floats per row: 8-byte aligned */
    b.ones = b.route_ids + B * k;
    for (int64_t r = 0; r < B; r++) b.ones[r] = 1;
    const int rc = timed ? run_layers_timed(plan, layers, s, x, &b, use_avx2)
                         : run_layers(plan, layers, s, x, &b, use_avx2);
    free(mem);
    if (timed) {
        lap(KV_PROF_CALL, start);
        profile.calls++;
    }
    return rc ? -1 : 0;
}
