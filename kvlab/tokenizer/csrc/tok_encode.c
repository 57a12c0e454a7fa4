/* Encoding: literal splitting, greedy pair merging, the SentencePiece and byte-level paths.
 *
 * The merge is the one of kvlab/tokenizer/merge.py, step for step: symbols are contiguous
 * byte spans of the text (a merged symbol is a longer span), candidate pairs are taken best
 * first by (rank, left symbol) - the initial pairs from a sorted array, pairs formed by merges
 * from a heap - and a popped pair is stale when its left symbol was merged away or its right
 * symbol has grown since the push. merge.py's heap also orders by right symbol and size, but
 * of the candidates sharing a rank and left symbol at most one is ever valid (the current
 * neighbour at its current size), so that order changes no merge.
 *
 * Long text is cut where no merge can ever join it: between two code points (SPM) or bytes
 * (BPE) that are never adjacent inside a vocabulary token (SPM) or merge result (BPE). A merge
 * joining such a pair would produce a piece containing it, so the two sides are independent
 * merges and cutting changes no id. For SentencePiece vocabularies the cuts fall before nearly
 * every U+2581, so the pieces are words: each merges on a tiny heap, and repeats hit the memo.
 */
#include <stdlib.h>
#include <string.h>

#include "tok.h"

#define TK_UNSET (-2)              /* SPM symbol not looked up yet */
#define TK_MAX_RUN (1u << 28)      /* bytes of one run of text or word (offsets are 32-bit) */
#define TK_MEMO_WORDS 65536        /* words in the memo before it is emptied */
#define TK_MEMO_MAX_WORD 64        /* bytes; longer words are not memoised */
#define TK_MEMO_KEY_BYTES (1 << 20)
#define TK_MEMO_IDS (1 << 18)

typedef struct {            /* a candidate merge of symbol `left` and its right neighbour */
    uint64_t key;           /* rank << 32 | left: lower merges first, ties leftmost */
    uint32_t end;           /* byte where the right symbol ended when pushed */
    int32_t result;         /* SPM: token id of the pair; BPE: str entry of the result */
} tk_cand;

typedef struct {            /* one call's scratch */
    tk_model *m;
    tk_cache *cache;        /* the model's memo while this call holds it; NULL: none */
    uint32_t *start;        /* symbol -> first byte; start[n] = end of the piece */
    int32_t *nxt, *prv, *sym;  /* neighbours (nxt = -1: merged away); SPM token / BPE entry */
    size_t cap;
    tk_cand *init;          /* the initial pairs, sorted (and as many slots to sort with) */
    size_t init_cap;
    tk_cand *heap;          /* pairs formed by merges */
    size_t heap_n, heap_cap;
    uint8_t *buf;           /* SPM: the run with spaces escaped; BPE: a word respelled */
    size_t buf_cap;
} tk_work;

/* Makes room for `need` items of `item` bytes, doubling. */
static int grow(void **p, size_t *cap, size_t need, size_t item) {
    if (need <= *cap) return 0;
    size_t cap2 = *cap ? *cap : 64;
    while (cap2 < need) cap2 *= 2;
    void *q = realloc(*p, cap2 * item);
    if (!q) return -1;
    *p = q;
    *cap = cap2;
    return 0;
}

static int ids_push(tk_ids *ids, int32_t id) {
    if (ids->n == ids->cap && grow((void **)&ids->v, &ids->cap, ids->n + 1, sizeof *ids->v))
        return -1;
    ids->v[ids->n++] = id;
    return 0;
}

/* ---------------- the word memo ---------------- */

static int cache_ready(tk_cache *c) {
    if (c->slot) return 0;
    c->slot = calloc(2 * TK_MEMO_WORDS, sizeof *c->slot);
    c->key_off = malloc(TK_MEMO_WORDS * sizeof *c->key_off);
    c->ids_off = malloc(TK_MEMO_WORDS * sizeof *c->ids_off);
    c->key_len = malloc(TK_MEMO_WORDS * sizeof *c->key_len);
    c->ids_len = malloc(TK_MEMO_WORDS * sizeof *c->ids_len);
    c->keys = malloc(TK_MEMO_KEY_BYTES);
    c->ids = malloc(TK_MEMO_IDS * sizeof *c->ids);
    if (c->slot && c->key_off && c->ids_off && c->key_len && c->ids_len && c->keys && c->ids)
        return 0;
    tk_cache_free(c);
    return -1;
}

void tk_cache_free(tk_cache *c) {
    free(c->slot);
    free(c->key_off);
    free(c->ids_off);
    free(c->key_len);
    free(c->ids_len);
    free(c->keys);
    free(c->ids);
    memset(c, 0, sizeof *c);
}

/* 1 and the ids appended when `p` is memoised, 0 when not, -1 out of memory. */
static int cache_get(const tk_cache *c, uint64_t h, const uint8_t *p, uint32_t len,
                     tk_ids *out) {
    const uint32_t mask = 2 * TK_MEMO_WORDS - 1;
    for (uint32_t i = (uint32_t)h & mask;; i = (i + 1) & mask) {
        uint64_t v = c->slot[i];
        if (!v) return 0;
        uint32_t e = (uint32_t)v - 1;
        if (v >> 32 != h >> 32 || c->key_len[e] != len || memcmp(c->keys + c->key_off[e], p, len))
            continue;
        for (uint32_t k = 0; k < c->ids_len[e]; k++)
            if (ids_push(out, c->ids[c->ids_off[e] + k])) return -1;
        return 1;
    }
}

static void cache_put(tk_cache *c, uint64_t h, const uint8_t *p, uint32_t len,
                      const int32_t *ids, size_t n) {
    if (n > UINT16_MAX) return;
    if (c->n == TK_MEMO_WORDS || c->nkeys + len > TK_MEMO_KEY_BYTES || c->nids + n > TK_MEMO_IDS) {
        memset(c->slot, 0, 2 * TK_MEMO_WORDS * sizeof *c->slot);
        c->n = 0;
        c->nkeys = c->nids = 0;
    }
    const uint32_t mask = 2 * TK_MEMO_WORDS - 1;
    uint32_t i = (uint32_t)h & mask, e = c->n++;
    while (c->slot[i]) i = (i + 1) & mask;
    c->slot[i] = (h >> 32) << 32 | (uint64_t)(e + 1);
    c->key_off[e] = (uint32_t)c->nkeys;
    c->key_len[e] = (uint16_t)len;
    c->ids_off[e] = (uint32_t)c->nids;
    c->ids_len[e] = (uint16_t)n;
    memcpy(c->keys + c->nkeys, p, len);
    memcpy(c->ids + c->nids, ids, n * sizeof *ids);
    c->nkeys += len;
    c->nids += n;
}

/* ---------------- literal tokens ---------------- */

/* Id of the longest literal starting at t[pos] (its end in *end), or -1. */
static int32_t longest_literal(const tk_trie *tr, const uint8_t *t, size_t n, size_t pos,
                               size_t *end) {
    int32_t node = tr->root[t[pos]], best = -1;
    for (size_t i = pos + 1; node >= 0; i++) {
        if (tr->term[node] >= 0) {
            best = tr->term[node];
            *end = i;
        }
        uint64_t v;
        if (i == n || !tk_u64_get(&tr->child, (uint64_t)node << 8 | t[i], &v)) break;
        node = (int32_t)v;
    }
    return best;
}

static int push_seg(tk_segs *s, size_t start, size_t end, int32_t id) {
    if (grow((void **)&s->v, &s->cap, s->n + 1, sizeof *s->v)) return -1;
    s->v[s->n++] = (tk_seg){start, end, id};
    return 0;
}

static inline int c_space(uint8_t c) {  /* C's isspace in the "C" locale */
    return c == ' ' || (c >= '\t' && c <= '\r');
}

static inline int strips(const tk_model *m, int32_t id, int flag) {
    return m->strip && (size_t)id < m->n_strip && (m->strip[id] & flag);
}

/* Ordinary runs and literal tokens in order, leftmost-longest (specials.py on UTF-8 bytes);
 * a stripping literal takes the whitespace next to it along. */
int tk_split(const tk_model *m, const uint8_t *t, size_t n, tk_segs *out) {
    size_t start = 0, pos = 0, end = 0;
    while (pos < n) {
        int32_t id = m->lit.root[t[pos]] < 0 ? -1 : longest_literal(&m->lit, t, n, pos, &end);
        if (id < 0) {
            pos++;
            continue;
        }
        size_t left_end = pos;
        if (strips(m, id, TK_LSTRIP))
            while (left_end > start && c_space(t[left_end - 1])) left_end--;
        if ((left_end > start && push_seg(out, start, left_end, -1)) || push_seg(out, pos, end, id))
            return -1;
        start = pos = end;
        if (strips(m, id, TK_RSTRIP))
            while (start < n && c_space(t[start])) start = ++pos;
    }
    return start < n ? push_seg(out, start, n, -1) : 0;
}

/* ---------------- the merge ---------------- */

/* A 4-ary heap: a node's children share one 64-byte line (slot i lives at heap[i + 3]) and
 * the smallest of the four is picked without branches; slots past the end hold the largest
 * key, so every node has four children to compare. On a long run without spaces the pops
 * are most of the time, and this halves it. */
#define TK_NO_KEY UINT64_MAX

static int heap_reserve(tk_work *w, size_t need) {
    if (need + 8 <= w->heap_cap) return 0;
    size_t cap = w->heap_cap ? 2 * w->heap_cap : 64;
    while (cap < need + 8) cap *= 2;
    void *q;
    if (posix_memalign(&q, 64, cap * sizeof(tk_cand))) return -1;
    tk_cand *h = q;
    for (size_t i = 0; i < cap; i++) h[i].key = TK_NO_KEY;
    if (w->heap_n) memcpy(h + 3, w->heap + 3, w->heap_n * sizeof *h);
    free(w->heap);
    w->heap = h;
    w->heap_cap = cap;
    return 0;
}

static int heap_push(tk_work *w, tk_cand c) {
    if (heap_reserve(w, w->heap_n + 1)) return -1;
    tk_cand *h = w->heap + 3;
    size_t i = w->heap_n++;
    while (i > 0 && c.key < h[(i - 1) / 4].key) {
        h[i] = h[(i - 1) / 4];
        i = (i - 1) / 4;
    }
    h[i] = c;
    return 0;
}

static tk_cand heap_pop(tk_work *w) {
    tk_cand *h = w->heap + 3, top = h[0], last = h[--w->heap_n];
    size_t i = 0, n = w->heap_n;
    h[n].key = TK_NO_KEY;
    for (size_t k = 1; k < n; k = 4 * i + 1) {
        size_t a = h[k + 1].key < h[k].key ? k + 1 : k;
        size_t b = h[k + 3].key < h[k + 2].key ? k + 3 : k + 2;
        size_t best = h[b].key < h[a].key ? b : a;
        if (h[best].key >= last.key) break;
        h[i] = h[best];
        i = best;
    }
    if (n) h[i] = last;
    return top;
}

/* Do symbols l and r merge, and how soon? SPM: if their text is a token (rank of its score);
 * BPE: if (l, r) is a merge (its rank). */
static inline int find_pair(const tk_work *w, const uint8_t *p, int32_t l, int32_t r,
                            tk_cand *c) {
    const tk_model *m = w->m;
    uint32_t a = w->start[l], e = w->start[w->nxt[r]];
    if (m->kind == TK_SPM) {
        int32_t entry = e - a > m->max_len ? -1 : tk_str_find(&m->str, p + a, e - a);
        if (entry < 0) return 0;
        int32_t id = m->token_of[entry];
        *c = (tk_cand){(uint64_t)m->rank_of[id] << 32 | (uint32_t)l, e, id};
        return 1;
    }
    int32_t x = w->sym[l], y = w->sym[r];
    uint64_t v;
    if (x < 0 || y < 0 || !tk_u64_get(&m->merge, (uint64_t)x << 32 | (uint32_t)y, &v))
        return 0;
    *c = (tk_cand){(v >> 32) << 32 | (uint32_t)l, e, (int32_t)(uint32_t)v};
    return 1;
}

static int reserve_symbols(tk_work *w, size_t need) {
    if (need <= w->cap) return 0;
    size_t cap = 2 * need;
    uint32_t *start = realloc(w->start, cap * sizeof *start);
    if (start) w->start = start;
    int32_t *nxt = realloc(w->nxt, cap * sizeof *nxt);
    if (nxt) w->nxt = nxt;
    int32_t *prv = realloc(w->prv, cap * sizeof *prv);
    if (prv) w->prv = prv;
    int32_t *sym = realloc(w->sym, cap * sizeof *sym);
    if (sym) w->sym = sym;
    if (!start || !nxt || !prv || !sym) return -1;
    w->cap = cap;
    return 0;
}

/* Symbols of p[0:len]: code points (SPM, UTF-8 BPE) or bytes (BPE), linked in order. */
static int symbols(tk_work *w, const uint8_t *p, uint32_t len, uint32_t *count) {
    if (reserve_symbols(w, (size_t)len + 1)) return -1;
    const tk_model *m = w->m;
    int spm = m->kind == TK_SPM, cps = spm || m->utf8;
    uint32_t n = 0;
    for (uint32_t i = 0; i < len; i++) {
        if (cps && (p[i] & 0xC0) == 0x80) continue;  /* inside a code point */
        w->start[n] = i;
        if (spm) {
            w->sym[n++] = TK_UNSET;
        } else if (m->utf8) {
            uint32_t width = tk_utf8_width(p[i]);
            w->sym[n++] = tk_str_find(&m->str, p + i, width < len - i ? width : len - i);
        } else {
            w->sym[n++] = m->byte_sym[p[i]];
        }
    }
    w->start[n] = len;
    for (uint32_t i = 0; i < n; i++) {
        w->nxt[i] = (int32_t)i + 1;
        w->prv[i] = (int32_t)i - 1;
    }
    *count = n;
    return 0;
}

/* Merge the popped candidate unless stale, then queue the new symbol's two pairs. */
static int apply(tk_work *w, const uint8_t *p, int32_t n, tk_cand c) {
    int32_t l = (int32_t)(uint32_t)c.key, r = w->nxt[l];
    if (r < 0 || r >= n || w->start[w->nxt[r]] != c.end) return 0;  /* stale */
    int32_t after = w->nxt[r];
    w->sym[l] = c.result;
    w->nxt[l] = after;
    w->nxt[r] = -1;
    tk_cand d;
    if (after < n) {
        w->prv[after] = l;
        if (find_pair(w, p, l, after, &d) && heap_push(w, d)) return -1;
    }
    if (w->prv[l] >= 0 && find_pair(w, p, w->prv[l], l, &d) && heap_push(w, d)) return -1;
    return 0;
}

/* Ids of one final symbol, with byte fallback as spm.py and bpe.py do it. */
static int emit(const tk_model *m, const uint8_t *s, uint32_t len, int32_t sym, tk_ids *out) {
    if (m->kind == TK_BPE) {
        int32_t id = sym >= 0 ? m->token_of[sym] : -1;
        if (id >= 0) return ids_push(out, id);
        for (uint32_t i = 0; i < len; i++)  /* its characters, one per byte */
            if (m->byte_id[s[i]] >= 0 && ids_push(out, m->byte_id[s[i]])) return -1;
        return 0;
    }
    if (sym == TK_UNSET) {
        int32_t entry = len > m->max_len ? -1 : tk_str_find(&m->str, s, len);
        sym = entry >= 0 ? m->token_of[entry] : -1;
    }
    if (sym >= 0) return ids_push(out, sym);
    for (uint32_t i = 0; i < len; i++)
        if (m->byte_id[s[i]] < 0) return m->unk >= 0 ? ids_push(out, m->unk) : 0;
    for (uint32_t i = 0; i < len; i++)
        if (ids_push(out, m->byte_id[s[i]])) return -1;
    return 0;
}

/* Sorts candidates by rank, keeping their (ascending) left order: insertion sort for a word,
 * radix sort (11 bits a pass) for a long run. */
static void sort_by_rank(tk_cand *a, tk_cand *tmp, size_t n) {
    if (n <= 64) {
        for (size_t i = 1; i < n; i++) {
            tk_cand c = a[i];
            size_t j = i;
            for (; j > 0 && a[j - 1].key > c.key; j--) a[j] = a[j - 1];
            a[j] = c;
        }
        return;
    }
    uint32_t top = 0;
    for (size_t i = 0; i < n; i++) top |= (uint32_t)(a[i].key >> 32);
    for (unsigned shift = 32; shift < 64 && top >> (shift - 32); shift += 11) {
        size_t count[2049] = {0};
        for (size_t i = 0; i < n; i++) count[(a[i].key >> shift & 2047) + 1]++;
        for (size_t d = 1; d < 2049; d++) count[d] += count[d - 1];
        for (size_t i = 0; i < n; i++) tmp[count[a[i].key >> shift & 2047]++] = a[i];
        memcpy(a, tmp, n * sizeof *a);
    }
}

/* The initial pairs, in merge order (most merges pop from here, not from the heap). */
static int initial_pairs(tk_work *w, const uint8_t *p, int32_t n, size_t *count) {
    size_t cap = w->init_cap / 2;  /* the two halves: pairs, radix sort's buffer */
    if (grow((void **)&w->init, &cap, (size_t)n, 2 * sizeof *w->init)) return -1;
    w->init_cap = 2 * cap;
    size_t k = 0;
    for (int32_t i = 0; i + 1 < n; i++) k += find_pair(w, p, i, i + 1, &w->init[k]);
    sort_by_rank(w->init, w->init + cap, k);
    *count = k;
    return 0;
}

/* Pops candidates best first from the sorted initial pairs and the heap of later ones. */
static int merge_piece(tk_work *w, const uint8_t *p, uint32_t len, tk_ids *out) {
    uint32_t count;
    size_t n_init, next = 0;
    if (symbols(w, p, len, &count)) return -1;
    int32_t n = (int32_t)count;
    if (initial_pairs(w, p, n, &n_init)) return -1;
    while (next < n_init || w->heap_n) {
        int from_init = next < n_init
                        && (!w->heap_n || w->init[next].key < w->heap[3].key);
        if (apply(w, p, n, from_init ? w->init[next++] : heap_pop(w))) return -1;
    }
    for (int32_t i = 0; i < n; i = w->nxt[i]) {
        uint32_t a = w->start[i], e = w->start[w->nxt[i]];
        if (emit(w->m, p + a, e - a, w->sym[i], out)) return -1;
    }
    return 0;
}

/* ---------------- SentencePiece ---------------- */

static inline int spm_joinable(const tk_model *m, uint32_t a, uint32_t b) {
    int sa = tk_small_cp(a), sb = tk_small_cp(b);
    if (sa >= 0 && sb >= 0) {
        uint32_t bit = (uint32_t)sa * 129 + (uint32_t)sb;
        return m->small_pair[bit >> 3] >> (bit & 7) & 1;
    }
    uint64_t v;
    return tk_u64_get(&m->pair_set, (uint64_t)a << 32 | b, &v);
}

/* End of the piece starting at s[i]: the first place no merge can cross. */
static uint32_t spm_piece_end(const tk_model *m, const uint8_t *s, uint32_t n, uint32_t i) {
    uint32_t prev = tk_utf8_next(s, n, &i);
    while (i < n) {
        uint32_t at = i, cp = tk_utf8_next(s, n, &i);
        if (!spm_joinable(m, prev, cp)) return at;
        prev = cp;
    }
    return n;
}

static int bpe_word(tk_work *w, const uint8_t *p, uint32_t len, tk_ids *out);

/* Ids of one piece (SPM) or word (BPE), through the memo when this call holds it. */
static int encode_piece(tk_work *w, const uint8_t *p, uint32_t len, tk_ids *out) {
    tk_cache *c = len <= TK_MEMO_MAX_WORD ? w->cache : NULL;
    uint64_t h = 0;
    if (c) {
        h = tk_hash(p, len);
        int hit = cache_get(c, h, p, len, out);
        if (hit) return hit < 0 ? -1 : 0;
    }
    size_t before = out->n;
    int rc = w->m->kind == TK_SPM ? merge_piece(w, p, len, out) : bpe_word(w, p, len, out);
    if (!rc && c) cache_put(c, h, p, len, out->v + before, out->n - before);
    return rc;
}

/* One run of ordinary text: spaces become U+2581 (and one is prefixed if asked), then each
 * piece merges on its own. */
static int spm_run(tk_work *w, const uint8_t *t, size_t n, int prefix, tk_ids *out) {
    if (n > TK_MAX_RUN) return -2;
    if (grow((void **)&w->buf, &w->buf_cap, 3 * n + 3, 1)) return -1;
    static const uint8_t mark[3] = {0xE2, 0x96, 0x81};
    uint8_t *q = w->buf;
    if (prefix) {
        memcpy(q, mark, 3);
        q += 3;
    }
    for (size_t i = 0; i < n; i++) {
        if (t[i] != ' ') {
            *q++ = t[i];
            continue;
        }
        memcpy(q, mark, 3);
        q += 3;
    }
    uint32_t len = (uint32_t)(q - w->buf);
    for (uint32_t pos = 0; pos < len;) {
        uint32_t end = spm_piece_end(w->m, w->buf, len, pos);
        if (encode_piece(w, w->buf + pos, end - pos, out)) return -1;
        pos = end;
    }
    return 0;
}

/* The call takes the memo if no other thread is using it, else encodes without one. */
static void work_init(tk_work *w, tk_model *m) {
    memset(w, 0, sizeof *w);
    w->m = m;
    if (pthread_mutex_trylock(&m->cache_lock) == 0) {
        if (cache_ready(&m->cache) == 0) w->cache = &m->cache;
        else pthread_mutex_unlock(&m->cache_lock);
    }
}

static void work_free(tk_work *w) {
    if (w->cache) pthread_mutex_unlock(&w->m->cache_lock);
    free(w->start);
    free(w->nxt);
    free(w->prv);
    free(w->sym);
    free(w->init);
    free(w->heap);
    free(w->buf);
}

int tk_encode_spm(tk_model *m, const uint8_t *text, size_t n, tk_ids *out) {
    tk_segs segs = {0};
    int rc = tk_split(m, text, n, &segs), after_literal = 1;
    tk_work w;
    work_init(&w, m);
    for (size_t k = 0; k < segs.n && !rc; k++) {
        tk_seg s = segs.v[k];
        if (s.id >= 0) {
            rc = ids_push(out, s.id);
            after_literal = 1;
        } else {  /* llama.cpp's space prefix: at the start and after every literal token */
            rc = spm_run(&w, text + s.start, s.end - s.start, m->space_prefix && after_literal,
                         out);
            after_literal = 0;
        }
    }
    work_free(&w);
    free(segs.v);
    return rc;
}

/* ---------------- byte-level BPE ---------------- */

/* Llama 3 (ignore_merges): *id is the whole word's token, or -1 when it is not one. */
static int whole_word_token(tk_work *w, const uint8_t *p, uint32_t len, int32_t *id) {
    if (w->m->utf8) {
        int32_t e = tk_str_find(&w->m->str, p, len);
        *id = e >= 0 ? w->m->token_of[e] : -1;
        return 0;
    }
    if (grow((void **)&w->buf, &w->buf_cap, 2 * (size_t)len, 1)) return -1;
    uint32_t k = 0;
    for (uint32_t i = 0; i < len; i++) {
        memcpy(w->buf + k, w->m->spell[p[i]], 2);
        k += w->m->spell_len[p[i]];
    }
    int32_t e = tk_str_find(&w->m->str, w->buf, k);
    *id = e >= 0 ? w->m->token_of[e] : -1;
    return 0;
}

static int newlines_only(const uint8_t *p, uint32_t len) {
    for (uint32_t i = 0; i < len; i++)
        if (p[i] != '\n') return 0;
    return 1;
}

static int bpe_word(tk_work *w, const uint8_t *p, uint32_t len, tk_ids *out) {
    const tk_model *m = w->m;
    if (m->ignore_merges || (m->newline_words && newlines_only(p, len))) {
        int32_t id;
        if (whole_word_token(w, p, len, &id)) return -1;
        if (id >= 0) return ids_push(out, id);
    }
    for (uint32_t pos = 0, end; pos < len; pos = end) {  /* cut where no merge joins bytes */
        for (end = pos + 1; end < len; end++) {
            uint32_t bit = (uint32_t)p[end - 1] << 8 | p[end];
            int inside = m->utf8 && (p[end] & 0xC0) == 0x80;  /* a code point stays whole */
            if (!inside && !(m->byte_pair[bit >> 3] >> (bit & 7) & 1)) break;
        }
        if (merge_piece(w, p + pos, end - pos, out)) return -1;
    }
    return 0;
}

int tk_encode_words(tk_model *m, const uint8_t *bytes, const size_t *ends, size_t n_words,
                    tk_ids *out) {
    tk_work w;
    work_init(&w, m);
    int rc = 0;
    for (size_t k = 0, start = 0; k < n_words && !rc; start = ends[k++]) {
        size_t len = ends[k] - start;
        if (len > TK_MAX_RUN) rc = -2;
        else if (len) rc = encode_piece(&w, bytes + start, (uint32_t)len, out);
    }
    work_free(&w);
    return rc;
}
