/* A decode step's layers in one call (qk_decode.c): the layer plan the models build
 * (kvlab/models/decode_c.py), one step's shapes and cache addresses, and the forward. */
#ifndef KVLAB_QK_DECODE_H
#define KVLAB_QK_DECODE_H

#include <stdint.h>

#include "qk.h"

/* gelu_tanh(gate) * up, silu(gate) * up, or relu(up)^2 of one ungated product (Nemotron-H) */
enum { KV_GATE_GELU_TANH = 0, KV_GATE_SILU = 1, KV_GATE_RELU2 = 2 };
/* softmax over every expert then top k; top k of the logits then softmax over them; sigmoid
 * scores, grouped top k of score + bias, weights the scores (kvlab/models/moe.py) */
enum { KV_ROUTE_SOFTMAX = 0, KV_ROUTE_TOPK_SOFTMAX = 1, KV_ROUTE_SIGMOID = 2 };
/* what mixes a layer's tokens: attention over the KV cache, a recurrent step on the
 * sequence's state row (a short convolution, Gated DeltaNet, Mamba-2), or nothing (a layer
 * that is its MLP alone: Nemotron-H's) */
enum { KV_MIX_ATTENTION = 0, KV_MIX_SHORT_CONV = 1, KV_MIX_GATED_DELTA = 2, KV_MIX_MAMBA2 = 3,
       KV_MIX_NONE = 4 };

typedef struct {
    int64_t attn_norm, n_qkv;          /* attn_norm (and mlp_norm) 0: no norm before (OLMo 2) */
    kv_wdesc qkv[3];
    int64_t qkv_bias;                  /* fp32 [q | k | v] added after the product, or 0 */
    int64_t q_norm, k_norm;            /* per-head RMSNorm before RoPE, or 0 (RoPE only) */
    int64_t sinks;                     /* fp32 [H]: attention sink logits (gpt-oss); 0: none */
    kv_wdesc o;
    int64_t post_attn_norm, mlp_norm;  /* post norms: x += norm(h); 0: x += h */
    int64_t n_gate_up;
    kv_wdesc gate_up[2];
    int64_t gate;                      /* KV_GATE_*: act(gate) * up */
    kv_wdesc down;
    int64_t post_mlp_norm, sliding;
    int64_t qk_norm_whole;             /* q_norm, k_norm over all heads at once (OLMoE) */
    int64_t router;                    /* mixture of experts: fp32 [E, hidden]; 0: dense */
    int64_t n_experts, top_k, norm_topk;
    int64_t experts;                   /* int64 [E, 3, 5]: kv_moe_experts' table */
    int64_t shexp_gate;                /* fp32 [hidden]: the shared expert's gate; 0: none */
    int64_t o_bias;                    /* fp32 [hidden] added after o (gpt-oss), or 0 */
    int64_t scoring;                   /* KV_ROUTE_*: how the router's logits choose */
    int64_t router_bias;               /* fp32 [E]: on the logits (gpt-oss), on the choice
                                        * (sigmoid: the correction bias); 0: none */
    int64_t groups, top_groups;        /* sigmoid: the best top_groups of groups kept */
    int64_t routed_scale;              /* fp32 bits: the chosen weights times this */
    int64_t gate_up_bias, down_bias;   /* fp32 [E, 2 * inter], [E, hidden]: expert biases;
                                        * a dense relu2 MLP's [inter], [hidden] (no router) */
    int64_t expert_clamp;              /* 1: the clamped SwiGLU (gpt-oss); 0: silu */
    int64_t clamp_alpha, clamp_limit;  /* its alpha and limit, fp32 bits */
    int64_t shexp_ungated;             /* 1: the shared expert added as it is (GLM-4.5) */
    /* a recurrent layer in attention's place (KV_MIX_*; 0: attention), its input products
     * side by side (n_rc_in of rc_in), rc_out after it; conv fp32 [C, K]. LFM2's short
     * convolution: rc_in -> [b | c | u] each C wide, y = c * conv(b * u) over the sequence's
     * conv state (its K - 1 inputs before this token). Qwen3.5's Gated DeltaNet: rc_in ->
     * qkv | z | b | a; qkv through the conv and SiLU, q and k L2-normed (value head j reads
     * key head j % k_heads where v_tiled, else j / (v_heads / k_heads)), the delta rule
     * with g = ssm_a * softplus(a + dt_bias), beta = sigmoid(b) on the recurrent state,
     * each head RMSNormed by rc_norm [v_dim] times silu(z) */
    int64_t mixer, n_rc_in;
    kv_wdesc rc_in[4], rc_out;
    int64_t conv, conv_k;
    int64_t ssm_a, dt_bias, rc_norm;   /* fp32 [v_heads], [v_heads], [v_dim] */
    int64_t k_heads, v_heads, k_dim, v_dim, v_tiled;
    /* Qwen3.5's gated attention: q_gate 1: each head's q product is its query then its
     * output gate (out * sigmoid(gate) before o); rotary: RoPE on each head's first dims
     * (the step's tables are that wide), 0 all */
    int64_t q_gate, rotary;
    /* Mamba-2 (KV_MIX_MAMBA2): rc_in[0] gives z | xBC | dt (plus rc_in_bias), xBC through
     * the conv (conv_bias) and SiLU on the conv state row, x | B | C; dt softplus(dt +
     * dt_bias) clamped to [dt_min, dt_max]; the SSD step on the recurrent state row with A
     * ssm_a [H] and the skip ssm_d [H]; y * silu(z) RMSNormed in k_heads groups times
     * rc_norm [H * P]; rc_out (plus rc_out_bias). Its shapes: v_heads H heads of v_dim P,
     * k_heads groups of B and C, each k_dim wide (the state size N) */
    int64_t ssm_d, rc_in_bias, conv_bias, rc_out_bias;
    int64_t dt_min, dt_max;            /* fp32 bits */
    int64_t residual_scale;            /* fp32 bits: x += scale * out (Granite); 0: 1 */
    int64_t expert_relu2;              /* 1: ungated relu(up)^2 experts (KV_MOE_RELU2) */
    /* experts in a latent narrower than hidden (Nemotron-3 Super): their input through
     * latent_in, their weighted sum through latent_out; ptr 0: none */
    kv_wdesc latent_in, latent_out;
    /* Gemma 4: the layer's own head size and KV heads (0: the step's D and KVH); kv_shared
     * 1: no K/V of its own, it attends over the store its caches row names (an earlier
     * layer's, written this step); values_from_keys 1: q|k products only, v = k before k's
     * norm and RoPE; v_norm: fp32 [head_dim], each value head RMSNormed, or 0 */
    int64_t head_dim, kv_heads, kv_shared, values_from_keys, v_norm;
    /* the per-layer input after the MLP, ple_gate.ptr 0 for none: x += norm(ple_out(
     * gelu_tanh(ple_gate(x)) * the step's per-layer row at column ple_col)) */
    kv_wdesc ple_gate, ple_out;
    int64_t ple_col, ple_post_norm;
    int64_t layer_scalar;              /* fp32 [1]: x *= it after the layer, or 0 */
    /* experts beside a dense MLP (Gemma 4's MoE): each reads x through its own norm (router,
     * experts; 0: the mlp_norm'ed h), the chosen weights times expert_scale [E] (0: none),
     * the dense and the experts' outputs normed each before their sum (0: not) */
    int64_t router_norm, experts_norm, expert_scale, shexp_out_norm, experts_out_norm;
    int64_t expert_gelu;               /* 1: GeGLU experts (KV_MOE_GELU); 0: by expert_clamp */
    /* multi-head latent attention (DeepSeek-V2/V3) in place of qkv when mla is 1: q from
     * q_b (after q_a and q_a_norm; plain q when q_a's ptr is 0), the latent and the rotary
     * key part from kv_a (the latent through kv_a_norm), heads of D = nope + rope, W_UK and
     * W_UV^T absorbed (qk_mla.h); the cache holds rank + rope per token */
    int64_t mla;
    kv_wdesc q_a, q_b, kv_a;
    int64_t q_a_norm, kv_a_norm;
    int64_t w_uk, w_uv_t;              /* fp32 [H, nope, rank], [H, rank, vdim] */
    int64_t rank, rope, vdim;
} kv_layer_plan;

#define KV_PLAN_FIELDS ((int64_t)(sizeof(kv_layer_plan) / sizeof(int64_t)))

typedef struct {
    int64_t B, hidden, H, KVH, D;
    float eps, scale, softcap;              /* softcap: on the attention scores, 0 none */
    const float *cos[2], *sin[2];           /* [B, D]: global (0) and local (1) RoPE */
    const int64_t *slot_mapping[2];         /* [B]: full (0) and sliding (1) layers' pools */
    const int64_t *slots[2], *lengths[2];   /* [B, C]: full (0) and sliding (1) keys */
    int64_t C[2];
    const int64_t *caches;                  /* [layers, 4]: K, V stores, K, V scales */
    int kv_kind;                            /* KV_CACHE_*: fp32, fp16 or q8_0 (scaled) */
    const float *ple;                       /* [B, ple_width]: per-layer inputs, or NULL */
    int64_t ple_width;
    const int64_t *states;                  /* [layers, 2]: a recurrent layer's conv and
                                             * recurrent states [num_slots, ...], or NULL */
    const int64_t *state_slots;             /* [B]: each sequence's row in them */
} kv_step;

/* The opt-in time split of kv_decode_layers: the calling thread's wall time (monotonic
 * clock) around each layer's stages, summed over calls by what the stage is: attention
 * (latent and gated too), a recurrent mixer, the MLP or experts, the layer's tail (Gemma 4's
 * per-layer input and scale); KV_PROF_CALL is each whole call (its buffers too). Off until
 * enabled; enable, reset and read hold the job lock, as the calls do. */
enum { KV_PROF_ATTENTION = 0, KV_PROF_RECURRENT = 1, KV_PROF_MLP = 2, KV_PROF_TAIL = 3,
       KV_PROF_CALL = 4, KV_PROF_KINDS = 5 };
void kv_decode_profile_enable(int on);
void kv_decode_profile_reset(void);
/* the nanoseconds per KV_PROF_* into ns; returns the calls they were summed over */
int64_t kv_decode_profile_read(int64_t ns[KV_PROF_KINDS]);

/* Runs every layer of the plan on x [B, hidden] (the residual stream, updated in place),
 * writing each layer's new K/V into its caches; 0, -1 out of memory. Callers hold the job
 * lock (qk_runtime.h). */
int kv_decode_layers(const kv_layer_plan *plan, int64_t layers, float *x, const kv_step *s,
                     int use_avx2);

#endif
