/* A layer's routed experts in one call (kvlab/kernels/fused.py: moe_experts).
 *
 * The T * k (token, slot) pairs are sorted by expert (a counting sort), so the n_e rows of
 * expert e lie together and its weights are read once for all of them:
 *
 *   x [T, hidden] --8-bit blocks, one row per pair, by expert--> A [T * k rows]
 *   A --gate|up of every chosen expert: one pool job (+ its bias row)--> GU [T * k, 2I]
 *   GU --silu(gate) * up, or the clamped SwiGLU--> G [T * k, I] --8-bit blocks--> B
 *   B --down of every chosen expert: one pool job (+ its bias row)--> D [T * k, hidden]
 *   out[t] = sum over t's slots s, in slot order, of weight[t, s] * D[row of (t, s)]
 *
 * Each product is the kernel qmatmul runs on the same 8-bit blocks, so every D row equals
 * the per-expert path's; the weighted sum is a multiply then an add, slot after slot, the
 * same for every T (a batch gets the bits each sequence gets alone).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "qk.h"
#include "qk_moe.h"
#include "qk_pool.h"
#include "qk_runtime.h"

#define MOE_MAX_PARTS 64
#define MOE_UNIT_BYTES 16384  /* weight bytes per unit of work, as the dense products */

/* one product: rows of W times n activation rows (xstride bytes apart) into y */
typedef struct {
    kv_gemv_fn fn;
    const uint8_t *w;
    int64_t row_bytes, cols;
    const void *xq;
    int64_t xstride, n;
    float *y;
    int64_t ystride;
} moe_prod;

typedef struct {
    int32_t prod;
    int64_t r0, r1;
} moe_unit;

/* Many products as one pool job: their row ranges in units, split into one part per thread
 * (each a run of units, so a thread streams through its experts front to back); a thread
 * done with its part takes units from the next parts. */
typedef struct {
    const moe_prod *prods;
    const moe_unit *units;
    int nparts;
    struct {
        _Alignas(64) atomic_llong next;
        int64_t end;
    } parts[MOE_MAX_PARTS];
} moe_job;

static void prods_task(void *p, int tid, int nthreads) {
    moe_job *job = p;
    (void)nthreads;
    for (int k = 0; k < job->nparts; k++) {
        int64_t end = job->parts[(tid + k) % job->nparts].end;
        atomic_llong *next = &job->parts[(tid + k) % job->nparts].next;
        for (int64_t u; (u = atomic_fetch_add(next, 1)) < end;) {
            const moe_unit *un = &job->units[u];
            const moe_prod *pr = &job->prods[un->prod];
            pr->fn(pr->w, pr->row_bytes, un->r0, un->r1, pr->cols, pr->xq, pr->xstride, pr->n,
                   pr->y, pr->ystride);
        }
    }
}

/* rows per unit of work: ~MOE_UNIT_BYTES of weights, whole 8-row groups for the grouped types */
static int64_t unit_rows(const kv_wdesc *w) {
    const int64_t align = kv_is_grouped(w->qt) ? 8 : 1;
    return (MOE_UNIT_BYTES / (w->row_bytes > 0 ? w->row_bytes : 1) / align + 1) * align;
}

static int64_t make_units(const kv_wdesc *ws, int64_t count, moe_unit *units) {
    int64_t nu = 0;
    for (int64_t p = 0; p < count; p++)
        for (int64_t r = 0, step = unit_rows(&ws[p]); r < ws[p].rows; r += step)
            units[nu++] = (moe_unit){(int32_t)p, r, r + step < ws[p].rows ? r + step : ws[p].rows};
    return nu;
}

/* The parts split the units at equal shares of their cost (weight bytes times the rows of x
 * they serve, plus the bytes themselves); one thread below 64 KiB of weights. */
static void run_prods(const moe_prod *prods, const kv_wdesc *ws, int64_t count,
                      moe_unit *units) {
    const int64_t nu = make_units(ws, count, units);
    double total = 0, bytes = 0;
    for (int64_t u = 0; u < nu; u++) {
        const double b = (double)(units[u].r1 - units[u].r0) * ws[units[u].prod].row_bytes;
        bytes += b;
        total += b * (8 + prods[units[u].prod].n);
    }
    const int nt = bytes < 65536 ? 1 : kv_pool_threads();
    moe_job job = {.prods = prods, .units = units,
                   .nparts = nt < MOE_MAX_PARTS ? nt : MOE_MAX_PARTS};
    double cost = 0;
    int64_t u = 0;
    for (int k = 0; k < job.nparts; k++) {
        atomic_store(&job.parts[k].next, u);
        for (; u < nu && (k == job.nparts - 1 || cost < total * (k + 1) / job.nparts); u++)
            cost += (double)(units[u].r1 - units[u].r0) * ws[units[u].prod].row_bytes *
                    (8 + prods[units[u].prod].n);
        job.parts[k].end = u;
    }
    kv_pool_run(prods_task, &job, nt);
    kv_count_weight_bytes((int64_t)bytes);
}

/* ---- rows of activations -> 8-bit blocks, in parallel for a prefill's thousands ---- */
typedef struct {
    const kv_isa *isa;
    int kind;
    const float *x;
    int64_t cols, rows, xstride;
    char *out;
    atomic_llong next;
} act_job;

#define ACT_CHUNK 16

static void act_task(void *p, int tid, int nthreads) {
    act_job *j = p;
    (void)tid, (void)nthreads;
    for (int64_t r0; (r0 = atomic_fetch_add(&j->next, ACT_CHUNK)) < j->rows;)
        for (int64_t r = r0; r < r0 + ACT_CHUNK && r < j->rows; r++)
            kv_act_row(j->isa, j->kind, j->x + r * j->cols, j->cols, j->out + r * j->xstride);
}

static void act_rows(const kv_isa *isa, int kind, const float *x, int64_t rows, int64_t cols,
                     char *out) {
    act_job j = {.isa = isa, .kind = kind, .x = x, .cols = cols, .rows = rows,
                 .xstride = kv_act_row_bytes(kind, cols), .out = out};
    atomic_store(&j.next, 0);
    kv_pool_run(act_task, &j, rows * cols >= 65536 ? kv_pool_threads() : 1);
}

/* ---- the call ---- */

static size_t up64(size_t n) { return (n + 63) & ~(size_t)63; }

/* rows[i] = the row of pair i (token i / k, slot i % k) once the pairs are sorted by expert
 * (stable); first[e] = the first row of expert e, first[E] = T * k.
 *   ids [[2, 0], [0, 1]] -> counts 2 1 1 -> first 0 2 3 4 -> rows [3, 0, 1, 2] */
static void sort_pairs(const int64_t *ids, int64_t pairs, int64_t E, int64_t *first,
                       int64_t *rows) {
    memset(first, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < pairs; i++) first[ids[i] + 1]++;
    for (int64_t e = 0; e < E; e++) first[e + 1] += first[e];
    int64_t *fill = rows + pairs;  /* E scratch counters after the rows */
    memcpy(fill, first, (size_t)E * sizeof(int64_t));
    for (int64_t i = 0; i < pairs; i++) rows[i] = fill[ids[i]]++;
}

typedef struct {
    int64_t E, T, k, hidden, inter, gu_rows, nparts;
    int kind[3];       /* activation blocks of gate|up part 0, part 1, down */
    int64_t xs[3];     /* their bytes per row */
} moe_shape;

/* one product per chosen expert and weight part p (0, 1: gate|up; 2: down) */
static int64_t expert_prods(const kv_isa *isa, const kv_wdesc *experts, const moe_shape *s,
                            const int64_t *first, int p, const char *xq, float *y,
                            int64_t y_off, int64_t ystride, moe_prod *prods, kv_wdesc *ws) {
    int64_t count = 0;
    for (int64_t e = 0; e < s->E; e++) {
        const int64_t n = first[e + 1] - first[e];
        const kv_wdesc *w = &experts[3 * e + p];
        if (n == 0 || w->rows == 0) continue;
        ws[count] = *w;
        prods[count++] = (moe_prod){
            .fn = isa->gemv[w->qt], .w = (const uint8_t *)(intptr_t)w->ptr,
            .row_bytes = w->row_bytes, .cols = w->cols, .xq = xq + first[e] * s->xs[p],
            .xstride = s->xs[p], .n = n, .y = y + first[e] * ystride + y_off,
            .ystride = ystride};
    }
    return count;
}

/* x's rows as blocks of `kind`, one per pair in sorted order */
static void gather_act(const kv_isa *isa, int kind, int64_t xs, const float *x,
                       const moe_shape *s, const int64_t *rows, char *tmp, char *out) {
    act_rows(isa, kind, x, s->T, s->hidden, tmp);
    for (int64_t i = 0; i < s->T * s->k; i++)
        memcpy(out + rows[i] * xs, tmp + i / s->k * xs, (size_t)xs);
}

static void weighted_sum(const float *D, const moe_shape *s, const int64_t *rows,
                         const float *weights, float *out) {
    for (int64_t t = 0; t < s->T; t++) {
        float *o = out + t * s->hidden;
        memset(o, 0, (size_t)s->hidden * sizeof(float));
        for (int64_t j = 0; j < s->k; j++) {
            const float w = weights[t * s->k + j], *d = D + rows[t * s->k + j] * s->hidden;
            for (int64_t i = 0; i < s->hidden; i++) o[i] += w * d[i];
        }
    }
}

/* y's rows of expert e (first[e] .. first[e + 1]) += bias row e [width]; nothing for NULL */
static void add_bias(float *y, int64_t width, const int64_t *first, int64_t E,
                     const float *bias) {
    if (!bias) return;
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = first[e]; r < first[e + 1]; r++)
            for (int64_t i = 0; i < width; i++) y[r * width + i] += bias[e * width + i];
}

void kv_relu2(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float r = x[i] > 0.0f ? x[i] : 0.0f;
        y[i] = r * r;
    }
}

static void gate_rows(const float *GU, float *G, int64_t pairs, int64_t inter,
                      const kv_moe_opts *o) {
    if (o && o->act == KV_MOE_RELU2)
        kv_relu2(GU, G, pairs * inter);
    else if (o && o->act == KV_MOE_SWIGLU_CLAMP)
        kv_swiglu_clamp_mul(GU, G, pairs, inter, o->alpha, o->limit);
    else if (o && o->act == KV_MOE_GELU)
        kv_gelu_mul(GU, G, pairs, inter);
    else
        kv_silu_mul(GU, G, pairs, inter);
}

int kv_moe_experts(const kv_isa *isa, const kv_wdesc *experts, int64_t E, const float *x,
                   int64_t T, int64_t hidden, const int64_t *ids, const float *weights,
                   int64_t k, float *out) {
    return kv_moe_experts_opts(isa, experts, E, x, T, hidden, ids, weights, k, NULL, out);
}

int kv_moe_experts_opts(const kv_isa *isa, const kv_wdesc *experts, int64_t E, const float *x,
                        int64_t T, int64_t hidden, const int64_t *ids, const float *weights,
                        int64_t k, const kv_moe_opts *opts, float *out) {
    const int64_t pairs = T * k;
    moe_shape s = {.E = E, .T = T, .k = k, .hidden = hidden,
                   .gu_rows = experts[0].rows + experts[1].rows,
                   .nparts = experts[1].rows ? 2 : 1};
    s.inter = opts && opts->act == KV_MOE_RELU2 ? s.gu_rows : s.gu_rows / 2;  /* no gate */
    for (int p = 0; p < 3; p++) {
        s.kind[p] = isa->act_kind[experts[p].qt];
        const int unused = p == 1 && s.nparts == 1;  /* no second gate|up part */
        s.xs[p] = unused ? 0 : kv_act_row_bytes(s.kind[p], p < 2 ? hidden : s.inter);
    }
    int64_t units = 0;  /* the most units one job can have: every expert chosen */
    for (int p = 0; p < 3; p++)
        units += (experts[p].rows + unit_rows(&experts[p]) - 1) / unit_rows(&experts[p]) *
                 (pairs < E ? pairs : E);
    const size_t sz[] = {
        (size_t)(E + 1) * 8, (size_t)(pairs + E) * 8, (size_t)T * (s.xs[0] + s.xs[1]),
        (size_t)pairs * s.xs[0], (size_t)pairs * s.xs[1], (size_t)pairs * s.gu_rows * 4,
        (size_t)pairs * s.inter * 4, (size_t)pairs * s.xs[2], (size_t)pairs * hidden * 4,
        (size_t)units * sizeof(moe_unit), (size_t)2 * E * (sizeof(moe_prod) + sizeof(kv_wdesc))};
    size_t total = 0, off[11];
    for (int i = 0; i < 11; i++) off[i] = total, total += up64(sz[i]);
    char *m = kv_scratch(total);
    if (!m) return -1;
    int64_t *first = (int64_t *)(m + off[0]), *rows = (int64_t *)(m + off[1]);
    char *tmp = m + off[2], *A0 = m + off[3], *A1 = m + off[4], *B = m + off[7];
    float *GU = (float *)(m + off[5]), *G = (float *)(m + off[6]), *D = (float *)(m + off[8]);
    moe_unit *un = (moe_unit *)(m + off[9]);
    moe_prod *prods = (moe_prod *)(m + off[10]);
    kv_wdesc *ws = (kv_wdesc *)(prods + 2 * E);

    sort_pairs(ids, pairs, E, first, rows);
    gather_act(isa, s.kind[0], s.xs[0], x, &s, rows, tmp, A0);
    int64_t n = expert_prods(isa, experts, &s, first, 0, A0, GU, 0, s.gu_rows, prods, ws);
    if (s.nparts == 2) {
        gather_act(isa, s.kind[1], s.xs[1], x, &s, rows, tmp, A1);
        n += expert_prods(isa, experts, &s, first, 1, A1, GU, experts[0].rows, s.gu_rows,
                          prods + n, ws + n);
    }
    run_prods(prods, ws, n, un);
    add_bias(GU, s.gu_rows, first, E, opts ? opts->gate_up_bias : NULL);
    gate_rows(GU, G, pairs, s.inter, opts);
    act_rows(isa, s.kind[2], G, pairs, s.inter, B);
    n = expert_prods(isa, experts, &s, first, 2, B, D, 0, hidden, prods, ws);
    run_prods(prods, ws, n, un);
    add_bias(D, hidden, first, E, opts ? opts->down_bias : NULL);
    weighted_sum(D, &s, rows, weights, out);
    return 0;
}

/* the k largest of v [E] (E <= 256) not masked, descending, the first of equals first */
static void top_k(const float *v, const uint64_t *masked, int64_t E, int64_t k, int64_t *ids) {
    uint64_t taken[4] = {0, 0, 0, 0};
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (!((taken[e / 64] | masked[e / 64]) >> (e % 64) & 1) &&
                (best < 0 || v[e] > v[best]))
                best = e;
        taken[best / 64] |= (uint64_t)1 << (best % 64);
        ids[j] = best;
    }
}

void kv_moe_route_topk_softmax(const float *logits, int64_t E, int64_t k, int64_t *ids,
                               float *weights) {
    const uint64_t none[4] = {0, 0, 0, 0};
    top_k(logits, none, E, k, ids);
    float sum = 0;
    for (int64_t j = 0; j < k; j++) sum += weights[j] = expf(logits[ids[j]] - logits[ids[0]]);
    for (int64_t j = 0; j < k; j++) weights[j] /= sum;
}

/* the groups outside the top_groups best masked: each group ranked by its best choice value
 * (softmax: DeepSeek-V2's group_limited_greedy) or by its two best summed (sigmoid) */
static void mask_groups(const float *choice, int64_t E, int64_t groups, int64_t top_groups,
                        int by_best, uint64_t *masked) {
    const int64_t per = E / groups;
    float best[256];
    for (int64_t g = 0; g < groups; g++) {
        float a = -INFINITY, b = -INFINITY;
        for (int64_t e = g * per; e < (g + 1) * per; e++) {
            if (choice[e] > a) b = a, a = choice[e];
            else if (choice[e] > b) b = choice[e];
        }
        best[g] = by_best ? a : a + b;
    }
    int64_t keep[256];
    const uint64_t none[4] = {0, 0, 0, 0};
    top_k(best, none, groups, top_groups, keep);
    memset(masked, 0xff, 4 * sizeof(uint64_t));
    for (int64_t j = 0; j < top_groups; j++)
        for (int64_t e = keep[j] * per; e < (keep[j] + 1) * per; e++)
            masked[e / 64] &= ~((uint64_t)1 << (e % 64));
}

void kv_moe_route(const float *logits, int64_t E, int64_t k, int64_t groups,
                  int64_t top_groups, int norm, int64_t *ids, float *weights) {
    float m = logits[0], sum = 0;
    for (int64_t e = 1; e < E; e++) m = logits[e] > m ? logits[e] : m;
    for (int64_t e = 0; e < E; e++) sum += expf(logits[e] - m);
    /* softmax is monotone: the logits rank the experts and the groups as the scores do */
    uint64_t masked[4] = {0, 0, 0, 0};  /* E <= 256 */
    if (groups > 1) mask_groups(logits, E, groups, top_groups, 1, masked);
    top_k(logits, masked, E, k, ids);
    float top = 0;
    for (int64_t j = 0; j < k; j++) top += weights[j] = expf(logits[ids[j]] - m) / sum;
    if (norm)
        for (int64_t j = 0; j < k; j++) weights[j] /= top;
}

void kv_moe_route_sigmoid(float *logits, const float *bias, int64_t E, int64_t k,
                          int64_t groups, int64_t top_groups, int norm, float scale,
                          int64_t *ids, float *weights) {
    float choice[256];
    for (int64_t e = 0; e < E; e++) {
        logits[e] = 1.0f / (1.0f + expf(-logits[e]));
        choice[e] = logits[e] + (bias ? bias[e] : 0.0f);
    }
    uint64_t masked[4] = {0, 0, 0, 0};
    if (groups > 1) mask_groups(choice, E, groups, top_groups, 0, masked);
    top_k(choice, masked, E, k, ids);
    float sum = 0;
    for (int64_t j = 0; j < k; j++) sum += weights[j] = logits[ids[j]];
    for (int64_t j = 0; j < k; j++)
        weights[j] = (norm ? weights[j] / (sum + 1e-20f) : weights[j]) * scale;
}
