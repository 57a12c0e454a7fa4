/* The kernels' persistent thread pool (qk_pool.c): the caller is thread 0 and takes part in
 * the work. Jobs are serialized by their caller (qk_runtime.h: the job lock). */
#ifndef KVLAB_QK_POOL_H
#define KVLAB_QK_POOL_H

#include <stdint.h>

typedef void (*kv_task_fn)(void *ctx, int tid, int nthreads);
int kv_pool_set_threads(int n);  /* 0 on success */
int kv_pool_threads(void);
void kv_pool_set_spin_us(int us);
void kv_pool_run(kv_task_fn fn, void *ctx, int nthreads);
void kv_pool_after_fork_child(void);
/* xor of the buffer's 64-bit words, read by every kernel thread (a bandwidth probe) */
uint64_t kv_stream_read(const void *p, int64_t bytes);

#endif
