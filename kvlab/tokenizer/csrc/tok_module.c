/* CPython entry points of kvlab.tokenizer._tok; kvlab/tokenizer/native.py is the Python side.
 *
 * The vocabulary arrives as flat buffers: all token texts as one UTF-8 byte string plus an
 * int64 array of their lengths (merges alike), scores as float64. Each entry point copies
 * what it needs out of Python objects, releases the GIL while it builds or encodes, and
 * turns the result into Python objects afterwards.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

#include "tok.h"

typedef struct {
    PyObject_HEAD
    tk_model m;
} Model;

static void model_dealloc(Model *self) {
    tk_free(&self->m);  /* a Model exists only once build() has filled (or zeroed) m */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *fail(int rc) {
    if (rc == -2)
        return PyErr_Format(PyExc_ValueError,
                            "a run of text between literal tokens is over 256 MiB; split it");
    return PyErr_NoMemory();
}

static PyObject *ids_list(const tk_ids *ids) {
    PyObject *list = PyList_New((Py_ssize_t)ids->n);
    for (size_t i = 0; list && i < ids->n; i++) {
        PyObject *v = PyLong_FromLong(ids->v[i]);
        if (!v) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, v);
    }
    return list;
}

/* Checks a buffer holds `n` items of `item` bytes (n < 0: any count); returns the count. */
static Py_ssize_t items(const Py_buffer *b, Py_ssize_t item, Py_ssize_t n, const char *what) {
    if (b->len % item || (n >= 0 && b->len / item != n)) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %s%zd items of %zd bytes", what,
                     b->len, n >= 0 ? "" : "whole ", n >= 0 ? n : b->len / item, item);
        return -1;
    }
    return b->len / item;
}

/* Texts back to back plus their lengths: the lengths must be >= 0 and add up. */
static int strings(const Py_buffer *text, const Py_buffer *lens, tk_strings *out,
                   const char *what) {
    Py_ssize_t n = items(lens, 8, -1, what);
    if (n < 0) return -1;
    *out = (tk_strings){text->buf, lens->buf, (size_t)n};
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n && total <= text->len; i++) {
        if (out->len[i] < 0) total = text->len + 1;
        else total += out->len[i];
    }
    if (total != text->len) {
        PyErr_Format(PyExc_ValueError, "%s: the lengths do not add up to the %zd text bytes",
                     what, text->len);
        return -1;
    }
    return 0;
}

static PyTypeObject ModelType;

typedef struct {            /* what tk_build_spm / tk_build_bpe take */
    int kind;
    tk_strings tokens, merges;
    const double *scores;
    const int64_t *literal_ids, *byte_ids;
    size_t n_literal;
    int unk, flag;          /* flag: SPM space_prefix, BPE options (TK_IGNORE_MERGES, ...) */
    Py_buffer *strip;       /* one TK_LSTRIP | TK_RSTRIP byte per token, or empty */
} build_args;

/* A Model with the tables built, the GIL released meanwhile. */
static PyObject *build(const build_args *a) {
    Model *self = PyObject_New(Model, &ModelType);
    if (!self) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = a->kind == TK_SPM
             ? tk_build_spm(&self->m, a->tokens, a->scores, a->literal_ids, a->n_literal,
                            a->byte_ids, a->unk, a->flag)
             : tk_build_bpe(&self->m, a->tokens, a->merges, a->literal_ids, a->n_literal, a->unk,
                            a->flag);
    if (!rc) rc = tk_set_strip(&self->m, a->strip->buf, (size_t)a->strip->len);
    Py_END_ALLOW_THREADS
    if (rc) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static int literal_ids(const Py_buffer *b, build_args *a) {
    Py_ssize_t n = items(b, 8, -1, "literal ids");
    a->literal_ids = b->buf;
    a->n_literal = n < 0 ? 0 : (size_t)n;
    return n < 0 ? -1 : 0;
}

static int strip_flags(const Py_buffer *b, const build_args *a) {
    return b->len && items(b, 1, (Py_ssize_t)a->tokens.n, "strip flags") < 0 ? -1 : 0;
}

static void release(Py_buffer *b, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&b[i]);
}

static PyObject *spm(PyObject *mod, PyObject *args) {
    Py_buffer b[6];  /* token texts, their lengths, scores, literal ids, byte ids, strip */
    build_args a = {.kind = TK_SPM, .strip = &b[5]};
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*ipy*", &b[0], &b[1], &b[2], &b[3], &b[4], &a.unk,
                          &a.flag, &b[5]))
        return NULL;
    PyObject *out = NULL;
    if (!strings(&b[0], &b[1], &a.tokens, "tokens")
        && items(&b[2], 8, (Py_ssize_t)a.tokens.n, "scores") >= 0 && !literal_ids(&b[3], &a)
        && items(&b[4], 8, 256, "byte ids") >= 0 && !strip_flags(&b[5], &a)) {
        a.scores = b[2].buf;
        a.byte_ids = b[4].buf;
        out = build(&a);
    }
    release(b, 6);
    return out;
}

static PyObject *bpe(PyObject *mod, PyObject *args) {
    Py_buffer b[6];  /* token texts, their lengths, merge texts, their lengths, literal ids, strip */
    build_args a = {.kind = TK_BPE, .strip = &b[5]};
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*iiy*", &b[0], &b[1], &b[2], &b[3], &b[4], &a.unk,
                          &a.flag, &b[5]))
        return NULL;
    PyObject *out = NULL;
    if (!strings(&b[0], &b[1], &a.tokens, "tokens") && !strings(&b[2], &b[3], &a.merges, "merges")
        && !literal_ids(&b[4], &a) && !strip_flags(&b[5], &a))
        out = build(&a);
    release(b, 6);
    return out;
}

static PyObject *model_encode(Model *self, PyObject *arg) {
    if (self->m.kind != TK_SPM)
        return PyErr_Format(PyExc_TypeError, "encode() is for SentencePiece models; "
                                             "byte-level BPE takes encode_words()");
    Py_ssize_t n;
    const char *text = PyUnicode_AsUTF8AndSize(arg, &n);  /* lives as long as `arg` */
    if (!text) return NULL;
    tk_ids ids = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tk_encode_spm(&self->m, (const uint8_t *)text, (size_t)n, &ids);
    Py_END_ALLOW_THREADS
    PyObject *out = rc ? fail(rc) : ids_list(&ids);
    free(ids.v);
    return out;
}

/* The words' UTF-8 back to back in *bytes, and where each ends. */
static int gather_words(PyObject *list, uint8_t **bytes, size_t **ends) {
    Py_ssize_t n = PyList_GET_SIZE(list), total = 0;
    *ends = malloc(((size_t)n + 1) * sizeof **ends);
    for (Py_ssize_t i = 0; *ends && i < n; i++) {
        Py_ssize_t len;
        if (!PyUnicode_Check(PyList_GET_ITEM(list, i))
            || !PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(list, i), &len)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "words must be str");
            return -1;
        }
        total += len;
        (*ends)[i] = (size_t)total;
    }
    *bytes = malloc((size_t)total + 1);
    if (!*ends || !*bytes) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0, at = 0; i < n; i++) {
        Py_ssize_t len;
        const char *s = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(list, i), &len);
        memcpy(*bytes + at, s, (size_t)len);
        at += len;
    }
    return 0;
}

static PyObject *model_encode_words(Model *self, PyObject *arg) {
    if (self->m.kind != TK_BPE)
        return PyErr_Format(PyExc_TypeError, "encode_words() is for byte-level BPE models");
    if (!PyList_Check(arg)) return PyErr_Format(PyExc_TypeError, "words must be a list of str");
    uint8_t *bytes = NULL;
    size_t *ends = NULL;
    PyObject *out = NULL;
    if (!gather_words(arg, &bytes, &ends)) {
        size_t n = (size_t)PyList_GET_SIZE(arg);
        tk_ids ids = {0};
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = tk_encode_words(&self->m, bytes, ends, n, &ids);
        Py_END_ALLOW_THREADS
        out = rc ? fail(rc) : ids_list(&ids);
        free(ids.v);
    }
    free(bytes);
    free(ends);
    return out;
}

static PyObject *segs_list(const char *text, const tk_segs *segs) {
    PyObject *list = PyList_New((Py_ssize_t)segs->n);
    for (size_t i = 0; list && i < segs->n; i++) {
        tk_seg s = segs->v[i];
        PyObject *v = s.id >= 0 ? PyLong_FromLong(s.id)
                                : PyUnicode_DecodeUTF8(text + s.start,
                                                       (Py_ssize_t)(s.end - s.start), "strict");
        if (!v) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, v);
    }
    return list;
}

static PyObject *model_split(Model *self, PyObject *arg) {
    Py_ssize_t n;
    const char *text = PyUnicode_AsUTF8AndSize(arg, &n);
    if (!text) return NULL;
    tk_segs segs = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = tk_split(&self->m, (const uint8_t *)text, (size_t)n, &segs);
    Py_END_ALLOW_THREADS
    PyObject *out = rc ? fail(rc) : segs_list(text, &segs);
    free(segs.v);
    return out;
}

static PyMethodDef model_methods[] = {
    {"encode", (PyCFunction)model_encode, METH_O,
     "encode(text) -> ids: SentencePiece, literal tokens and space prefix included."},
    {"encode_words", (PyCFunction)model_encode_words, METH_O,
     "encode_words(words) -> ids: byte-level BPE of pre-tokenized words, in order."},
    {"split", (PyCFunction)model_split, METH_O,
     "split(text) -> [str | int]: ordinary runs and literal-token ids, leftmost-longest."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ModelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvlab.tokenizer._tok.Model",
    .tp_basicsize = sizeof(Model),
    .tp_dealloc = (destructor)model_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A tokenizer's tables; built by spm() or bpe(), read-only afterwards.",
    .tp_methods = model_methods,
};

static PyMethodDef module_methods[] = {
    {"spm", spm, METH_VARARGS,
     "spm(tokens, token_lengths, scores, literal_ids, byte_ids, unk_id, space_prefix, strip): "
     "strip is b'' or one byte per token, 1 lstrip | 2 rstrip"},
    {"bpe", bpe, METH_VARARGS,
     "bpe(tokens, token_lengths, merges, merge_lengths, literal_ids, unk_id, options, strip): "
     "options 1 ignore_merges, 2 UTF-8 symbols with <0xNN> fallback, 4 whole newline words"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tok", "GGUF tokenizers in C (see kvlab/tokenizer/native.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__tok(void) {
    if (PyType_Ready(&ModelType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&ModelType);
    if (PyModule_AddObject(m, "Model", (PyObject *)&ModelType) < 0) {
        Py_DECREF(&ModelType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
