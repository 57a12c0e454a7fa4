/* Multi-head latent attention (DeepSeek-V2/V3) on the latent cache, in absorbed form
 * (qk_mla.c), and its Python entry points (qk_mla_bindings.c).
 *
 *   q      [T, H, nope + rope]   rows q_stride floats apart, the rope part already rotated
 *   w_uk   [H, nope, rank]       fp32: head h's key up-projection, W_UK_h
 *   w_uv_t [H, rank, vdim]       fp32: head h's value up-projection, transposed (W_UV_h^T)
 *   cache  [num_slots, 1, rank + rope]: per token the latent (after its norm) then the
 *          rotated key part shared by all heads; the values are the latent
 *   out    [T, H * vdim]
 *
 * Per token and head: q_lat = q_nope W_UK_h (rank values), scores = scale * ([q_lat | q_rope]
 * . [latent_j | k_rope_j]), p = softmax, out_h = (sum_j p_j latent_j) W_UV_h^T. */
#ifndef KVLAB_QK_MLA_H
#define KVLAB_QK_MLA_H

#include <stdint.h>

#include "qk.h"

typedef struct {
    const float *w_uk, *w_uv_t;
    int64_t H, nope, rope, rank, vdim;
} kv_mla_heads;

/* The keys a call attends to. Decode (prefill 0): row b of B attends to the first
 * lengths[b] of its C slots (all C when lengths is NULL). Prefill (prefill 1): one sequence's
 * n = B tokens at positions start.. (causal), keys at positions [first, start + n) in
 * slots[0 ..): kv_attend_prefill's scheme on the latent. */
typedef struct {
    int prefill;
    const int64_t *slots, *lengths;
    int64_t B, C, first, start;
} kv_mla_keys;

/* out [B, H * vdim]; isa: 0 portable C, 1 AVX2, 2 AVX-512. 0, or -1 out of memory. */
int kv_mla_attend(const float *q, int64_t q_stride, const kv_mla_heads *m,
                  const kv_cache_ref *kv, const kv_mla_keys *keys, float scale, float *out,
                  int isa);

#endif
