/* The recurrent layers' kernels of hybrid models (qk_recurrent.c) and their Python entry
 * points (qk_recurrent_bindings.c). All tensors fp32 and contiguous; a call carries S
 * sequences as contiguous segments of the token dimension, sequence s has lens[s] tokens and
 * its state in row slots[s] of `states`, read and updated in place (kvlab/kernels/recurrent.py
 * checks shapes, slots and lens before calling).
 *
 *   short conv  x [T, C], w [C, K], bias [C] | NULL, states [num_slots, K-1, C], out [T, C]
 *   gated delta q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], states [num_slots, Hv, Dk, Dv],
 *               out [T, Hv, Dv]
 *   SSD scan    x [T, H, P], dt [T, H], A [H], B, C [T, G, N], D [H] | NULL,
 *               states [num_slots, H, P, N], out [T, H, P]
 *   gated norm  x, z, out [rows, D], w [D]
 *
 * isa: 0 portable C, 1 AVX2, 2 AVX-512 (each falls back to the one below where the build or
 * the CPU lacks it). Each returns 0, or -1 when out of memory. */
#ifndef KVLAB_QK_RECURRENT_H
#define KVLAB_QK_RECURRENT_H

#include <stdint.h>

#define KV_RC_CHUNK 64  /* tokens per chunk of the chunked prefill forms */

int kv_short_conv(const float *x, const float *w, const float *bias, float *states,
                  const int64_t *slots, const int64_t *lens, int64_t S, int64_t C, int64_t K,
                  int silu, float *out, int isa);
int kv_gated_delta_rule(const float *q, const float *k, const float *v, const float *g,
                        const float *beta, float *states, const int64_t *slots,
                        const int64_t *lens, int64_t S, int64_t Hk, int64_t Hv, int64_t Dk,
                        int64_t Dv, float scale, float *out, int isa);
int kv_ssd_scan(const float *x, const float *dt, const float *A, const float *B, const float *C,
                const float *D, float *states, const int64_t *slots, const int64_t *lens,
                int64_t S, int64_t H, int64_t P, int64_t G, int64_t N, float *out, int isa);
int kv_gated_rms_norm(const float *x, const float *z, const float *w, float *out,
                      int64_t rows, int64_t D, int64_t group, float eps, int norm_before_gate,
                      int isa);

#ifdef Py_PYTHON_H
/* adds short_conv, gated_delta_rule, ssd_scan and gated_rms_norm to the module: 0, or -1
 * with the Python error set */
int kv_recurrent_add_methods(PyObject *module);
#endif

#endif
