/* A layer's routed experts (qk_moe.c): the router's top k per token, and the chosen
 * experts' MLPs on every token in one call. */
#ifndef KVLAB_QK_MOE_H
#define KVLAB_QK_MOE_H

#include <stdint.h>

#include "qk.h"

/* One token's routing from its router scores [E]: softmax in fp32, the k largest (the first
 * of equals first), in descending order, renormalized over the k when norm. groups > 1
 * (DeepSeek-V2's group_limited_greedy): the k only from the top_groups of `groups`
 * consecutive groups whose best score is highest. */
void kv_moe_route(const float *logits, int64_t E, int64_t k, int64_t groups,
                  int64_t top_groups, int norm, int64_t *ids, float *weights);
/* gpt-oss's routing of one token: logits [E] (the router's bias already added), the k
 * largest, descending, weights their softmax in fp32 */
void kv_moe_route_topk_softmax(const float *logits, int64_t E, int64_t k, int64_t *ids,
                               float *weights);
/* A sigmoid router's (GLM-4.5, DeepSeek-V3): scores sigmoid(logits); the choice ranks
 * scores + bias among the top_groups of `groups` groups whose two best biased scores sum
 * highest; weights the chosen scores, over their sum when norm, times scale. logits [E] is
 * overwritten by the scores. */
void kv_moe_route_sigmoid(float *logits, const float *bias, int64_t E, int64_t k,
                          int64_t groups, int64_t top_groups, int norm, float scale,
                          int64_t *ids, float *weights);
/* A layer's routed experts on T tokens: experts [E][3] = gate|up in one or two parts (the
 * second rows 0 when one), down; ids, weights [T, k]; out [T, hidden] = sum over each
 * token's k slots of weight * down(silu(gate) * up). 0, -1 out of memory. Callers hold the
 * job lock (qk_runtime.h). */
int kv_moe_experts(const kv_isa *isa, const kv_wdesc *experts, int64_t E, const float *x,
                   int64_t T, int64_t hidden, const int64_t *ids, const float *weights,
                   int64_t k, float *out);

/* An expert's options beyond SwiGLU without biases (gpt-oss): fp32 bias rows added to the
 * gate|up product ([E, 2 * inter], gate | up halves) and to down's ([E, hidden]), NULL for
 * none; the gate silu(gate) * up, the clamped SwiGLU (kv_swiglu_clamp_mul),
 * gelu_tanh(gate) * up (Gemma 4), or relu(up)^2 of an expert with one up product
 * [inter, hidden] and no gate (Nemotron-H) */
enum { KV_MOE_SILU = 0, KV_MOE_SWIGLU_CLAMP = 1, KV_MOE_GELU = 2, KV_MOE_RELU2 = 3 };
typedef struct {
    const float *gate_up_bias, *down_bias;
    int act;
    float alpha, limit;
} kv_moe_opts;

/* y[i] = relu(x[i])^2 over n values (x == y allowed): one rounding, as torch's
 * relu(x).square() */
void kv_relu2(const float *x, float *y, int64_t n);

/* kv_moe_experts with those options (NULL: kv_moe_experts') */
int kv_moe_experts_opts(const kv_isa *isa, const kv_wdesc *experts, int64_t E, const float *x,
                        int64_t T, int64_t hidden, const int64_t *ids, const float *weights,
                        int64_t k, const kv_moe_opts *opts, float *out);

#endif
