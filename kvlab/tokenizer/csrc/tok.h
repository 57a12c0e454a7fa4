/* kvlab.tokenizer._tok: GGUF tokenizers in C, id for id equal to the Python reference.
 *
 * A model's tables (string map, ranks, literal trie, boundary sets) are built once from the
 * vocabulary and only read afterwards, so any number of threads may encode at once; each call
 * has its own scratch. The word cache is the one mutable part: a call that finds it in use
 * by another thread encodes without it.
 */
#ifndef KV_TOK_H
#define KV_TOK_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum { TK_SPM = 0, TK_BPE = 1 };
/* BPE options: Llama 3's whole-word tokens; symbols are UTF-8 code points with <0xNN> byte
 * fallback instead of GPT-2-spelled bytes (Gemma 4); a word of newlines that is a token is
 * emitted whole (Gemma 4). */
enum { TK_IGNORE_MERGES = 1, TK_UTF8 = 2, TK_NEWLINE_WORDS = 4 };
/* A literal token that swallows the ASCII whitespace before (LSTRIP) or after (RSTRIP) it. */
enum { TK_LSTRIP = 1, TK_RSTRIP = 2 };

typedef struct {            /* growable list of token ids */
    int32_t *v;
    size_t n, cap;
} tk_ids;

typedef struct {            /* byte string -> dense entry number; the map keeps the bytes */
    uint64_t *slot;         /* hash tag << 32 | (entry + 1); 0: empty */
    uint32_t mask;
    uint32_t *off, *len;    /* entry -> its bytes in `bytes` */
    uint32_t n, cap;
    uint8_t *bytes;
    size_t nbytes, bytes_cap;
} tk_strmap;

typedef struct {            /* uint64 -> uint64; UINT64_MAX is never a key */
    uint64_t *key, *val;
    uint32_t mask, n;
} tk_u64map;

typedef struct {            /* byte trie of the literal tokens (control, user-defined, unknown) */
    int32_t root[256];      /* first byte -> node; -1: no literal starts with it */
    tk_u64map child;        /* node << 8 | byte -> node */
    int32_t *term;          /* node -> id of the literal ending there; -1: none */
    uint32_t n, cap;
} tk_trie;

typedef struct {            /* bounded word -> ids memo; emptied when full */
    uint64_t *slot;         /* hash tag << 32 | (entry + 1) */
    uint32_t *key_off, *ids_off;
    uint16_t *key_len, *ids_len;
    uint32_t n;
    uint8_t *keys;
    int32_t *ids;
    size_t nkeys, nids;
} tk_cache;

typedef struct {
    int kind;
    tk_strmap str;          /* token texts; BPE: also every merge's two sides and result */
    int32_t *token_of;      /* str entry -> token id (a text listed twice: the last id); -1 */
    uint32_t *rank_of;      /* SPM: token id -> rank of its score, 0 = highest (merges first) */
    uint32_t max_len;       /* SPM: longest token, bytes */
    uint8_t small_pair[(129 * 129 + 7) / 8];  /* SPM: bigrams of ASCII and U+2581 in tokens */
    tk_u64map pair_set;     /* SPM: the other code point bigrams found in tokens */
    tk_u64map merge;        /* BPE: left << 32 | right entry -> rank << 32 | result entry */
    uint8_t byte_pair[256 * 256 / 8];  /* BPE: byte bigrams found in some merge result */
    int32_t byte_sym[256];  /* BPE: str entry of the byte's GPT-2 character; -1 none */
    int32_t byte_id[256];   /* SPM, UTF-8 BPE: id of <0xNN>; BPE: id of the byte's character,
                               else unk */
    uint8_t spell[256][2], spell_len[256];    /* BPE: GPT-2 character of each byte, UTF-8 */
    int32_t unk;            /* -1: none */
    int space_prefix, ignore_merges, utf8, newline_words;
    tk_trie lit;
    uint8_t *strip;         /* token id -> TK_LSTRIP | TK_RSTRIP; NULL: none strips */
    size_t n_strip;
    tk_cache cache;
    pthread_mutex_t cache_lock;
} tk_model;

typedef struct {            /* a piece of split text: a run of ordinary text, or a literal */
    size_t start, end;
    int32_t id;             /* literal token id; -1: ordinary text */
} tk_seg;

typedef struct {
    tk_seg *v;
    size_t n, cap;
} tk_segs;

typedef struct {            /* a vocabulary as flat buffers (UTF-8 texts back to back) */
    const uint8_t *text;
    const int64_t *len;
    size_t n;
} tk_strings;

/* Build; 0 on success, -1 out of memory. `scores`, `byte_ids` (256 entries) for SPM. */
int tk_build_spm(tk_model *m, tk_strings tokens, const double *scores,
                 const int64_t *literal_ids, size_t n_literal, const int64_t *byte_ids,
                 int32_t unk, int space_prefix);
int tk_build_bpe(tk_model *m, tk_strings tokens, tk_strings merges,
                 const int64_t *literal_ids, size_t n_literal, int32_t unk, int options);
/* Copies the literal tokens' strip flags (n entries, one per token id); 0 or -1 no memory. */
int tk_set_strip(tk_model *m, const uint8_t *flags, size_t n);
void tk_free(tk_model *m);
void tk_cache_free(tk_cache *c);

/* Encoding; 0 on success, -1 out of memory, -2 a run of text or a word over 256 MiB. */
int tk_split(const tk_model *m, const uint8_t *text, size_t n, tk_segs *out);
int tk_encode_spm(tk_model *m, const uint8_t *text, size_t n, tk_ids *out);
int tk_encode_words(tk_model *m, const uint8_t *bytes, const size_t *ends, size_t n_words,
                    tk_ids *out);

/* ---------------- lookups on the hot path ---------------- */

static inline uint64_t tk_mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

static inline uint64_t tk_hash(const uint8_t *p, size_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ULL * (n + 1), w;
    for (; n >= 8; p += 8, n -= 8) {
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xbf58476d1ce4e5b9ULL;
        h = h << 27 | h >> 37;
    }
    w = 0;
    memcpy(&w, p, n);
    return tk_mix(h ^ w);
}

/* The entry holding exactly s[0:n], or -1. */
static inline int32_t tk_str_find(const tk_strmap *m, const uint8_t *s, uint32_t n) {
    uint64_t h = tk_hash(s, n), tag = h >> 32;
    for (uint32_t i = (uint32_t)h & m->mask;; i = (i + 1) & m->mask) {
        uint64_t v = m->slot[i];
        if (!v) return -1;
        uint32_t e = (uint32_t)v - 1;
        if (v >> 32 == tag && m->len[e] == n && !memcmp(m->bytes + m->off[e], s, n))
            return (int32_t)e;
    }
}

static inline int tk_u64_get(const tk_u64map *m, uint64_t k, uint64_t *v) {
    for (uint32_t i = (uint32_t)tk_mix(k) & m->mask;; i = (i + 1) & m->mask) {
        if (m->key[i] == k) {
            *v = m->val[i];
            return 1;
        }
        if (m->key[i] == UINT64_MAX) return 0;
    }
}

static inline uint32_t tk_utf8_width(uint8_t lead) {
    return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}

/* The code point at s[*i] (text is valid UTF-8; a truncated tail is read as far as it goes). */
static inline uint32_t tk_utf8_next(const uint8_t *s, uint32_t n, uint32_t *i) {
    uint32_t k = *i, w = tk_utf8_width(s[k]);
    if (w > n - k) w = n - k;
    uint32_t cp = w == 1 ? s[k] : s[k] & (0x7Fu >> w);
    for (uint32_t j = 1; j < w; j++) cp = cp << 6 | (s[k + j] & 0x3F);
    *i = k + w;
    return cp;
}

/* ASCII and U+2581 (the escaped space) have a dense bigram bitmap; -1: look in pair_set. */
static inline int tk_small_cp(uint32_t cp) {
    return cp < 128 ? (int)cp : cp == 0x2581 ? 128 : -1;
}

#endif
