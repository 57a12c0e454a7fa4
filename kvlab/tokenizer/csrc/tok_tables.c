/* The tables of a tokenizer model, built once from the vocabulary.
 *
 * Everything the encoder looks up is here: a string map over the token texts, each token's
 * merge rank (SPM: the order of its score; BPE: the merge list), the trie of literal tokens,
 * and the bigram sets that tell where no merge can ever cross (see tok_encode.c).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok.h"

/* ---------------- string map ---------------- */

static int strmap_init(tk_strmap *m, size_t expected) {
    uint32_t slots = 16;
    while (slots < 2 * expected) slots *= 2;
    memset(m, 0, sizeof *m);
    m->slot = calloc(slots, sizeof *m->slot);
    m->mask = slots - 1;
    m->cap = slots / 2;
    m->off = malloc(m->cap * sizeof *m->off);
    m->len = malloc(m->cap * sizeof *m->len);
    return m->slot && m->off && m->len ? 0 : -1;
}

static void strmap_free(tk_strmap *m) {
    free(m->slot);
    free(m->off);
    free(m->len);
    free(m->bytes);
}

static int strmap_grow(tk_strmap *m) {
    uint32_t slots = 2 * (m->mask + 1);
    uint64_t *slot = calloc(slots, sizeof *slot);
    uint32_t *off = realloc(m->off, slots / 2 * sizeof *off);
    if (off) m->off = off;
    uint32_t *len = realloc(m->len, slots / 2 * sizeof *len);
    if (len) m->len = len;
    if (!slot || !off || !len) {
        free(slot);
        return -1;
    }
    for (uint32_t e = 0; e < m->n; e++) {
        uint64_t h = tk_hash(m->bytes + m->off[e], m->len[e]);
        uint32_t i = (uint32_t)h & (slots - 1);
        while (slot[i]) i = (i + 1) & (slots - 1);
        slot[i] = (h >> 32) << 32 | (uint64_t)(e + 1);
    }
    free(m->slot);
    m->slot = slot;
    m->mask = slots - 1;
    m->cap = slots / 2;
    return 0;
}

static int strmap_keep(tk_strmap *m, const uint8_t *s, uint32_t n) {
    if (m->nbytes + n > UINT32_MAX) return -1;
    if (m->nbytes + n > m->bytes_cap) {
        size_t cap = m->bytes_cap ? 2 * m->bytes_cap : 1 << 16;
        while (cap < m->nbytes + n) cap *= 2;
        uint8_t *bytes = realloc(m->bytes, cap);
        if (!bytes) return -1;
        m->bytes = bytes;
        m->bytes_cap = cap;
    }
    memcpy(m->bytes + m->nbytes, s, n);
    m->off[m->n] = (uint32_t)m->nbytes;
    m->len[m->n] = n;
    m->nbytes += n;
    return 0;
}

/* The entry of `s`, added if new; -1 out of memory. */
static int32_t strmap_add(tk_strmap *m, const uint8_t *s, uint32_t n) {
    int32_t found = tk_str_find(m, s, n);
    if (found >= 0) return found;
    if (m->n >= m->cap && strmap_grow(m)) return -1;
    if (strmap_keep(m, s, n)) return -1;
    uint64_t h = tk_hash(s, n);
    uint32_t i = (uint32_t)h & m->mask;
    while (m->slot[i]) i = (i + 1) & m->mask;
    m->slot[i] = (h >> 32) << 32 | (uint64_t)(m->n + 1);
    return (int32_t)m->n++;
}

/* ---------------- uint64 map ---------------- */

static int u64_init(tk_u64map *m, size_t expected) {
    uint32_t slots = 16;
    while (slots < 2 * expected) slots *= 2;
    m->key = malloc(slots * sizeof *m->key);
    m->val = malloc(slots * sizeof *m->val);
    m->mask = slots - 1;
    m->n = 0;
    if (!m->key || !m->val) return -1;
    memset(m->key, 0xff, slots * sizeof *m->key);
    return 0;
}

static void u64_free(tk_u64map *m) {
    free(m->key);
    free(m->val);
}

static void u64_place(uint64_t *key, uint64_t *val, uint32_t mask, uint64_t k, uint64_t v) {
    uint32_t i = (uint32_t)tk_mix(k) & mask;
    while (key[i] != UINT64_MAX && key[i] != k) i = (i + 1) & mask;
    key[i] = k;
    val[i] = v;
}

static int u64_grow(tk_u64map *m) {
    tk_u64map bigger;
    if (u64_init(&bigger, m->mask + 1)) {
        u64_free(&bigger);
        return -1;
    }
    for (uint32_t i = 0; i <= m->mask; i++)
        if (m->key[i] != UINT64_MAX) u64_place(bigger.key, bigger.val, bigger.mask,
                                               m->key[i], m->val[i]);
    bigger.n = m->n;
    u64_free(m);
    *m = bigger;
    return 0;
}

/* Sets k -> v (a key put twice keeps the last value); -1 out of memory. */
static int u64_put(tk_u64map *m, uint64_t k, uint64_t v) {
    if (2 * (m->n + 1) > m->mask + 1 && u64_grow(m)) return -1;
    uint64_t old;
    if (!tk_u64_get(m, k, &old)) m->n++;
    u64_place(m->key, m->val, m->mask, k, v);
    return 0;
}

/* ---------------- literal trie ---------------- */

static int32_t trie_node(tk_trie *t) {
    if (t->n == t->cap) {
        uint32_t cap = t->cap ? 2 * t->cap : 1024;
        int32_t *term = realloc(t->term, cap * sizeof *term);
        if (!term) return -1;
        t->term = term;
        t->cap = cap;
    }
    t->term[t->n] = -1;
    return (int32_t)t->n++;
}

static int trie_insert(tk_trie *t, const uint8_t *s, uint32_t n, int32_t id) {
    int32_t node = t->root[s[0]];
    if (node < 0 && (node = t->root[s[0]] = trie_node(t)) < 0) return -1;
    for (uint32_t i = 1; i < n; i++) {
        uint64_t key = (uint64_t)node << 8 | s[i], v;
        if (tk_u64_get(&t->child, key, &v)) {
            node = (int32_t)v;
            continue;
        }
        int32_t next = trie_node(t);
        if (next < 0 || u64_put(&t->child, key, (uint64_t)next)) return -1;
        node = next;
    }
    t->term[node] = id;  /* a text listed twice keeps its last id */
    return 0;
}

static int trie_build(tk_model *m, tk_strings tokens, const int64_t *first,
                      const int64_t *ids, size_t n_ids) {
    tk_trie *t = &m->lit;
    memset(t->root, 0xff, sizeof t->root);
    size_t bytes = 0;
    for (size_t k = 0; k < n_ids; k++)
        if (ids[k] >= 0 && (size_t)ids[k] < tokens.n) bytes += (size_t)tokens.len[ids[k]];
    if (u64_init(&t->child, bytes)) return -1;
    for (size_t k = 0; k < n_ids; k++) {
        int64_t id = ids[k];
        if (id < 0 || (size_t)id >= tokens.n || tokens.len[id] == 0) continue;
        if (trie_insert(t, tokens.text + first[id], (uint32_t)tokens.len[id], (int32_t)id))
            return -1;
    }
    return 0;
}

/* ---------------- shared by both models ---------------- */

/* Byte offset of each token's text (one pass over the lengths). */
static int64_t *text_offsets(tk_strings s) {
    int64_t *first = malloc((s.n + 1) * sizeof *first);
    if (!first) return NULL;
    first[0] = 0;
    for (size_t i = 0; i < s.n; i++) first[i + 1] = first[i] + s.len[i];
    return first;
}

/* token_of for every str entry: the last token id whose text it is. */
static int index_tokens(tk_model *m, tk_strings tokens, const int64_t *first) {
    m->token_of = malloc((m->str.n + 1) * sizeof *m->token_of);
    if (!m->token_of) return -1;
    for (uint32_t e = 0; e < m->str.n; e++) m->token_of[e] = -1;
    for (size_t i = 0; i < tokens.n; i++) {
        int32_t e = tk_str_find(&m->str, tokens.text + first[i], (uint32_t)tokens.len[i]);
        if (e >= 0) m->token_of[e] = (int32_t)i;
    }
    return 0;
}

static int add_tokens(tk_model *m, tk_strings tokens, const int64_t *first) {
    for (size_t i = 0; i < tokens.n; i++) {
        if (tokens.len[i] > UINT32_MAX / 4) return -1;
        if (strmap_add(&m->str, tokens.text + first[i], (uint32_t)tokens.len[i]) < 0) return -1;
    }
    return 0;
}

static void init_model(tk_model *m, int kind, int32_t unk) {
    memset(m, 0, sizeof *m);
    m->kind = kind;
    m->unk = unk;
    pthread_mutex_init(&m->cache_lock, NULL);
}

int tk_set_strip(tk_model *m, const uint8_t *flags, size_t n) {
    if (!n) return 0;
    m->strip = malloc(n);
    if (!m->strip) return -1;
    memcpy(m->strip, flags, n);
    m->n_strip = n;
    return 0;
}

void tk_free(tk_model *m) {
    free(m->strip);
    strmap_free(&m->str);
    free(m->token_of);
    free(m->rank_of);
    u64_free(&m->pair_set);
    u64_free(&m->merge);
    u64_free(&m->lit.child);
    free(m->lit.term);
    tk_cache_free(&m->cache);
    pthread_mutex_destroy(&m->cache_lock);
}

/* ---------------- SentencePiece ---------------- */

typedef struct {
    double score;
    int32_t id;
} scored;

static int higher_score_first(const void *pa, const void *pb) {
    double a = ((const scored *)pa)->score, b = ((const scored *)pb)->score;
    if (isnan(a) || isnan(b)) return isnan(a) - isnan(b);  /* NaN last */
    return (a < b) - (a > b);
}

/* rank_of[id]: 0 for the highest score; equal scores share a rank, as they tie in Python. */
static int rank_scores(tk_model *m, const double *scores, size_t n) {
    scored *order = malloc((n + 1) * sizeof *order);
    m->rank_of = malloc((n + 1) * sizeof *m->rank_of);
    if (!order || !m->rank_of) {
        free(order);
        return -1;
    }
    for (size_t i = 0; i < n; i++) order[i] = (scored){scores[i], (int32_t)i};
    qsort(order, n, sizeof *order, higher_score_first);
    uint32_t rank = 0;
    for (size_t i = 0; i < n; i++) {
        if (i > 0 && higher_score_first(&order[i - 1], &order[i]) != 0) rank++;
        m->rank_of[order[i].id] = rank;
    }
    free(order);
    return 0;
}

static int spm_note_pair(tk_model *m, uint32_t a, uint32_t b) {
    int sa = tk_small_cp(a), sb = tk_small_cp(b);
    if (sa >= 0 && sb >= 0) {
        uint32_t bit = (uint32_t)sa * 129 + (uint32_t)sb;
        m->small_pair[bit >> 3] |= (uint8_t)(1 << (bit & 7));
        return 0;
    }
    return u64_put(&m->pair_set, (uint64_t)a << 32 | b, 0);
}

/* Every pair of adjacent code points inside some token: a merge can only join text there. */
static int spm_bigrams(tk_model *m) {
    if (u64_init(&m->pair_set, 1 << 16)) return -1;
    for (uint32_t e = 0; e < m->str.n; e++) {
        const uint8_t *s = m->str.bytes + m->str.off[e];
        uint32_t n = m->str.len[e], i = 0;
        if (n == 0) continue;
        uint32_t prev = tk_utf8_next(s, n, &i);
        while (i < n) {
            uint32_t cp = tk_utf8_next(s, n, &i);
            if (spm_note_pair(m, prev, cp)) return -1;
            prev = cp;
        }
        if (n > m->max_len) m->max_len = n;
    }
    return 0;
}

int tk_build_spm(tk_model *m, tk_strings tokens, const double *scores,
                 const int64_t *literal_ids, size_t n_literal, const int64_t *byte_ids,
                 int32_t unk, int space_prefix) {
    init_model(m, TK_SPM, unk);
    m->space_prefix = space_prefix;
    for (int b = 0; b < 256; b++) m->byte_id[b] = byte_ids[b] < 0 ? -1 : (int32_t)byte_ids[b];
    int64_t *first = text_offsets(tokens);
    int rc = !first || strmap_init(&m->str, tokens.n) || add_tokens(m, tokens, first)
             || index_tokens(m, tokens, first) || rank_scores(m, scores, tokens.n)
             || spm_bigrams(m) || trie_build(m, tokens, first, literal_ids, n_literal);
    free(first);
    return rc ? -1 : 0;
}

/* ---------------- byte-level BPE ---------------- */

/* GPT-2's byte alphabet: printable Latin-1 bytes stand for themselves, the rest for 256 + k. */
static void gpt2_alphabet(tk_model *m, uint16_t char_of[256]) {
    int extra = 0;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        char_of[b] = (uint16_t)(printable ? b : 256 + extra++);
        uint16_t c = char_of[b];
        if (c < 0x80) {
            m->spell[b][0] = (uint8_t)c;
            m->spell_len[b] = 1;
        } else {
            m->spell[b][0] = (uint8_t)(0xC0 | c >> 6);
            m->spell[b][1] = (uint8_t)(0x80 | (c & 0x3F));
            m->spell_len[b] = 2;
        }
    }
}

/* The raw bytes a GPT-2-spelled string stands for; -1 if it has a character outside the alphabet. */
static int64_t unspell(const int16_t byte_of[0x144], const uint8_t *s, uint32_t n, uint8_t *out) {
    uint32_t i = 0, k = 0;
    while (i < n) {
        uint32_t cp = tk_utf8_next(s, n, &i);
        if (cp >= 0x144 || byte_of[cp] < 0) return -1;
        out[k++] = (uint8_t)byte_of[cp];
    }
    return k;
}

/* byte_pair: the byte bigrams in some merge result; a merge can only join words there. */
static int bpe_byte_pairs(tk_model *m, const uint16_t char_of[256]) {
    int16_t byte_of[0x144];
    memset(byte_of, 0xff, sizeof byte_of);
    for (int b = 0; b < 256; b++) byte_of[char_of[b]] = (int16_t)b;
    uint8_t *raw = malloc(m->str.nbytes + 1);
    if (!raw) return -1;
    for (uint32_t i = 0; i <= m->merge.mask; i++) {
        if (m->merge.key[i] == UINT64_MAX) continue;
        uint32_t e = (uint32_t)m->merge.val[i];
        const uint8_t *text = m->str.bytes + m->str.off[e];
        int64_t k = m->utf8 ? (int64_t)m->str.len[e] : unspell(byte_of, text, m->str.len[e], raw);
        if (m->utf8) memcpy(raw, text, m->str.len[e]);
        for (int64_t j = 1; j < k; j++) {
            uint32_t bit = (uint32_t)raw[j - 1] << 8 | raw[j];
            m->byte_pair[bit >> 3] |= (uint8_t)(1 << (bit & 7));
        }
    }
    free(raw);
    return 0;
}

/* A merge is "left right"; an empty side never matches a symbol, so it is left out. */
static int add_merge(tk_model *m, const uint8_t *s, uint32_t n, uint32_t rank) {
    const uint8_t *space = n > 1 ? memchr(s + 1, ' ', n - 1) : NULL;  /* as llama.cpp cuts */
    if (!space || space == s + n - 1) return 0;
    uint32_t nl = (uint32_t)(space - s), nr = n - nl - 1;
    int32_t left = strmap_add(&m->str, s, nl);
    int32_t right = strmap_add(&m->str, space + 1, nr);
    uint8_t stack[256], *both = n <= sizeof stack ? stack : malloc(n);
    if (!both) return -1;
    memcpy(both, s, nl);
    memcpy(both + nl, space + 1, nr);
    int32_t result = strmap_add(&m->str, both, n - 1);
    if (both != stack) free(both);
    if (left < 0 || right < 0 || result < 0) return -1;
    return u64_put(&m->merge, (uint64_t)left << 32 | (uint32_t)right,
                   (uint64_t)rank << 32 | (uint32_t)result);
}

static int add_merges(tk_model *m, tk_strings merges) {
    const uint8_t *s = merges.text;
    for (size_t r = 0; r < merges.n; s += merges.len[r], r++) {
        if (merges.len[r] > UINT32_MAX / 4 || r > UINT32_MAX) return -1;
        if (add_merge(m, s, (uint32_t)merges.len[r], (uint32_t)r)) return -1;
    }
    return 0;
}

static void byte_tables(tk_model *m) {
    for (int b = 0; b < 256; b++) {
        if (m->utf8) {  /* no byte symbols; a byte falls back to its <0xNN> token, if any */
            char name[8];
            snprintf(name, sizeof name, "<0x%02X>", b);
            int32_t entry = tk_str_find(&m->str, (const uint8_t *)name, 6);
            m->byte_sym[b] = -1;
            m->byte_id[b] = entry >= 0 ? m->token_of[entry] : -1;
            continue;
        }
        int32_t e = tk_str_find(&m->str, m->spell[b], m->spell_len[b]);
        int32_t id = e >= 0 ? m->token_of[e] : -1;
        m->byte_sym[b] = e;
        m->byte_id[b] = id >= 0 ? id : m->unk;
    }
}

int tk_build_bpe(tk_model *m, tk_strings tokens, tk_strings merges,
                 const int64_t *literal_ids, size_t n_literal, int32_t unk, int options) {
    init_model(m, TK_BPE, unk);
    m->ignore_merges = !!(options & TK_IGNORE_MERGES);
    m->utf8 = !!(options & TK_UTF8);
    m->newline_words = !!(options & TK_NEWLINE_WORDS);
    uint16_t char_of[256];
    gpt2_alphabet(m, char_of);
    int64_t *first = text_offsets(tokens);
    int rc = !first || strmap_init(&m->str, tokens.n + merges.n) || add_tokens(m, tokens, first)
             || u64_init(&m->merge, merges.n) || add_merges(m, merges)
             || index_tokens(m, tokens, first) || bpe_byte_pairs(m, char_of)
             || trie_build(m, tokens, first, literal_ids, n_literal);
    if (!rc) byte_tables(m);
    free(first);
    return rc ? -1 : 0;
}
