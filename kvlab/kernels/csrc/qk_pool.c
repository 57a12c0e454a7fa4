/* A small persistent thread pool for the kernels.
 *
 * Decode calls a product about a hundred times per token, each a few tens of
 * microseconds, so waking threads through the kernel every time would cost more than
 * the work. Workers therefore spin for a short while (spin_us) after each job and only
 * then sleep on a condition variable. The caller runs as thread 0.
 *
 * Wake-up protocol: the caller bumps `generation` and then reads `sleepers`; a worker
 * increments `sleepers` under the mutex and then re-reads `generation`. With sequentially
 * consistent atomics one of the two always sees the other, so no wake-up is lost.
 *
 * Joining a job: jobs hand out their work dynamically, so the caller never waits for a
 * worker that has not started (on a busy machine it may not be scheduled for
 * milliseconds). A worker increments `busy`, then checks the job is still `open`; the
 * caller, once the work is all taken, clears `open` and waits for `busy` to drain. Either
 * the caller sees the increment or the worker sees the job closed, never neither.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KV_PAUSE() _mm_pause()
#else
#define KV_PAUSE() ((void)0)
#endif

#include "qk_pool.h"

#define KV_MAX_THREADS 256

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t threads[KV_MAX_THREADS];
    int nworkers;                /* spawned workers (thread ids 1..nworkers) */
    atomic_uint generation;      /* bumped once per job */
    atomic_int sleepers;
    atomic_int busy;             /* workers inside the current job */
    atomic_int open;             /* the current job still accepts workers */
    atomic_int quit;
    kv_task_fn fn;
    void *ctx;
    int active;                  /* threads taking part in the current job */
    unsigned start_generation;   /* generation when the workers were created */
    atomic_int spin_us;
} pool = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .cv = PTHREAD_COND_INITIALIZER,
    .spin_us = 300,
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Wait until the generation moves past `seen`: spin first, then sleep. The spin yields
 * the CPU now and then: on a busy machine the scheduler may have put this worker on the
 * caller's CPU, and a plain spin would then take half of the caller's time. */
static unsigned wait_for_job(unsigned seen) {
    const int64_t deadline = now_ns() + (int64_t)atomic_load(&pool.spin_us) * 1000;
    for (unsigned it = 1;; it++) {
        const unsigned g = atomic_load(&pool.generation);
        if (g != seen) return g;
        KV_PAUSE();
        if ((it & 63) == 0) {
            sched_yield();
            if (now_ns() > deadline) break;
        }
    }
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add(&pool.sleepers, 1);
    while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
    atomic_fetch_sub(&pool.sleepers, 1);
    pthread_mutex_unlock(&pool.mu);
    return atomic_load(&pool.generation);
}

static void *worker_main(void *arg) {
    const int tid = (int)(intptr_t)arg;
    unsigned seen = pool.start_generation;  /* not a fresh load: a job may already be out */
    for (;;) {
        seen = wait_for_job(seen);
        if (atomic_load(&pool.quit)) return NULL;
        atomic_fetch_add(&pool.busy, 1);
        /* `open` is stored after fn, ctx and active, so seeing it set means seeing them */
        if (atomic_load(&pool.open) && tid < pool.active) pool.fn(pool.ctx, tid, pool.active);
        atomic_fetch_sub(&pool.busy, 1);
    }
}

static void publish_job(void) {
    atomic_fetch_add(&pool.generation, 1);
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
}

static void stop_workers(void) {
    if (pool.nworkers == 0) return;
    atomic_store(&pool.quit, 1);
    publish_job();
    for (int i = 0; i < pool.nworkers; i++) pthread_join(pool.threads[i], NULL);
    pool.nworkers = 0;
    atomic_store(&pool.quit, 0);
}

int kv_pool_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > KV_MAX_THREADS) n = KV_MAX_THREADS;
    if (n - 1 == pool.nworkers) return 0;
    stop_workers();
    pool.start_generation = atomic_load(&pool.generation);
    for (int i = 0; i < n - 1; i++) {
        if (pthread_create(&pool.threads[i], NULL, worker_main, (void *)(intptr_t)(i + 1))) {
            pool.nworkers = i;
            return -1;
        }
        pool.nworkers = i + 1;
    }
    return 0;
}

int kv_pool_threads(void) { return pool.nworkers + 1; }

/* In a forked child only the forking thread exists: forget the workers (set_threads
 * starts new ones) and reset the synchronization state. */
void kv_pool_after_fork_child(void) {
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    pool.nworkers = 0;
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.busy, 0);
    atomic_store(&pool.open, 0);
    atomic_store(&pool.quit, 0);
}

void kv_pool_set_spin_us(int us) { atomic_store(&pool.spin_us, us < 0 ? 0 : us); }

/* Runs fn(ctx, tid, nthreads) on the caller and on the workers that arrive in time, and
 * returns when every thread that joined has left. fn must share its work dynamically
 * (the caller's fn returns only when all work is taken). Not reentrant: the caller
 * serializes jobs (qk_runtime.h: the job lock). */
void kv_pool_run(kv_task_fn fn, void *ctx, int nthreads) {
    if (nthreads > pool.nworkers + 1) nthreads = pool.nworkers + 1;
    if (nthreads <= 1) {
        fn(ctx, 0, 1);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    pool.active = nthreads;
    atomic_store(&pool.open, 1);
    publish_job();
    fn(ctx, 0, nthreads);
    atomic_store(&pool.open, 0);
    for (unsigned it = 1; atomic_load(&pool.busy) > 0; it++) {
        KV_PAUSE();
        if ((it & 63) == 0) sched_yield();  /* a preempted worker may need this CPU */
    }
}

/* ---- memory read bandwidth: every thread streams its own slice of one buffer ----
 * Eight independent 64-bit xor chains per thread (the compiler vectorizes them): no
 * arithmetic stands between the loads, so the time is the memory system's. The xor of all
 * words is returned so that the reads cannot be dropped. */
typedef struct {
    const uint64_t *p;
    int64_t words;
    uint64_t out[KV_MAX_THREADS];
} stream_job;

static void stream_task(void *ctx, int tid, int nthreads) {
    stream_job *job = ctx;
    const int64_t per = (job->words / nthreads) & ~(int64_t)7;
    const int64_t w0 = per * tid, w1 = tid == nthreads - 1 ? job->words : w0 + per;
    uint64_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = w0;
    for (; i + 8 <= w1; i += 8)
        for (int k = 0; k < 8; k++) a[k] ^= job->p[i + k];
    for (; i < w1; i++) a[0] ^= job->p[i];
    job->out[tid] = a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7];
}

uint64_t kv_stream_read(const void *p, int64_t bytes) {
    static stream_job job;  /* callers hold the module lock: one stream at a time */
    const int nt = kv_pool_threads();
    job.p = p;
    job.words = bytes / 8;
    kv_pool_run(stream_task, &job, nt);
    uint64_t x = 0;
    for (int t = 0; t < nt; t++) x ^= job.out[t];
    return x;
}
