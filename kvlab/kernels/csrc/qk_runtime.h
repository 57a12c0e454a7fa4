/* The kernels' run-time state and the row jobs built on it (qk_runtime.c): the active kernel
 * set, the job lock, the scratch buffer, the count of weight bytes read, and products,
 * dequantization and quantization split over the thread pool by rows.
 *
 * The callers above it (qk_bindings.c, qk_decode.c, qk_moe.c) take the job lock around
 * every job that uses the thread pool or the scratch buffer: both serve one job at a time.
 */
#ifndef KVLAB_QK_RUNTIME_H
#define KVLAB_QK_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#include "qk.h"

/* load time: the fp16 table, the best kernel set the CPU runs, the fork handler */
void kv_runtime_init(void);

void kv_job_lock(void);
void kv_job_unlock(void);

/* the kernel set the jobs use; kv_set_active_isa under the job lock */
const kv_isa *kv_active_isa(void);
void kv_set_active_isa(const kv_isa *isa);
const kv_isa *kv_best_isa(void);  /* AVX2 where the CPU has AVX2, FMA and F16C */
int kv_cpu_has_avx2(void);
int kv_avx2_active(void);         /* the active set is the AVX2 one */

/* bytes of weights the products (and embedding-row lookups) have read since the module
 * loaded: what a decode step costs, counted where it is spent */
void kv_count_weight_bytes(int64_t bytes);
int64_t kv_weight_bytes_read(void);

/* grow-only working memory of the jobs; the job lock holds it for one job */
void *kv_scratch(size_t bytes);

/* y[:, 0:w->rows] (rows ystride floats apart) = x[n, w->cols] . W^T on the thread pool,
 * x first quantized to the activation blocks the active kernel takes; 0, -1 out of memory */
int kv_product(const kv_wdesc *w, const float *x, int64_t n, float *y, int64_t ystride);
/* out[rows, cols] fp32; parallel = 0 keeps it on the calling thread */
void kv_dequantize(int qtype, const uint8_t *w, int64_t rows, int64_t cols, int64_t row_bytes,
                   float *out, int parallel);
/* row r of a matrix -> fp32 (grouped rows are spread over their group's blocks) */
void kv_dequantize_row(int qtype, const uint8_t *w, int64_t row_bytes, int64_t r, int64_t cols,
                       float *out);
/* fp32 [rows, cols] -> GGUF blocks of Q8_0, Q4_K, Q5_K or Q6_K, on the thread pool */
void kv_quantize_rows(int qtype, const float *x, int64_t rows, int64_t cols, uint8_t *out);

#endif
