"""The served model as Ollama's model routes describe it: /api/tags, /api/show, /api/ps.

Everything is read from the engine's snapshot (fixed once the engine is built): the weights'
size in memory, the architecture, the parameter count and the quantization (the file type
the GGUF name ends with, else the GGML type holding most of the weight matrices' bytes). The digest is a sha256 of the name and size, so
it is stable for a server's life and changes when another model is served. `capabilities`
says what this server acts on for the model: for a model that generates, completion, tools
(through the model's own tool format or kvlab's generic one) and thinking where the template
writes reasoning; embedding for every model (/api/embed).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from datetime import datetime, timedelta, timezone
from typing import Any

from kvlab.engine import EngineSnapshot
from kvlab.server.core.bodies import parse, parse_json_body
from kvlab.server.core.errors import ApiError
from kvlab.server.core.serving import Serving
from kvlab.server.ollama.protocol import DEFAULTS, ShowRequest, check_model, ollama_name

STARTED = datetime.now(timezone.utc)
# a GGUF file's name ends with its type: gemma-3-270m-q4_k_m.gguf, llama-3-8b.Q8_0.gguf
_FILE_TYPE = re.compile(r"(?i)[-_.]((?:I?Q\d_[A-Z0-9_]*?)|BF16|F16|F32)(?:\.gguf)?$")
KEEP_LOADED = timedelta(days=365 * 100)  # /api/ps: the model never expires while served


def _stamp(when: datetime) -> str:
    return when.isoformat().replace("+00:00", "Z")


def parameter_size(n: int) -> str:
    """Ollama's spelling: 268.10M, 8.0B."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def quantization_level(snap: EngineSnapshot) -> str:
    """The file type the GGUF name ends with, as Ollama shows it (Q4_K_M, Q8_0, F16), else
    the GGML type holding most of the weight matrices' bytes, where the spec lists them."""
    named = _FILE_TYPE.search(snap.model_name)
    if named:
        return named.group(1).upper()
    bytes_by_type: Counter[str] = Counter()
    for layer in snap.spec.layers:
        for m in layer.matrices:
            bytes_by_type[m.qtype] += m.nbytes
    if snap.spec.output_matrix is not None:
        bytes_by_type[snap.spec.output_matrix.qtype] += snap.spec.output_matrix.nbytes
    return bytes_by_type.most_common(1)[0][0] if bytes_by_type else "unknown"


def details(snap: EngineSnapshot) -> dict[str, Any]:
    family = snap.model.architecture
    return {"parent_model": "", "format": "gguf", "family": family, "families": [family],
            "parameter_size": parameter_size(snap.spec.n_params),
            "quantization_level": quantization_level(snap)}


def _entry(serving: Serving) -> dict[str, Any]:
    snap = serving.engine.snapshot()
    name = ollama_name(serving)
    digest = hashlib.sha256(f"{name}:{snap.weight_bytes}".encode()).hexdigest()
    return {"name": name, "model": name, "size": snap.weight_bytes, "digest": digest,
            "details": details(snap)}


def tags(serving: Serving) -> dict[str, Any]:
    """GET /api/tags: the one served model."""
    return {"models": [{**_entry(serving), "modified_at": _stamp(STARTED)}]}


def running(serving: Serving) -> dict[str, Any]:
    """GET /api/ps: the served model, loaded for the server's life (held in host memory)."""
    return {"models": [{**_entry(serving), "size_vram": 0,
                        "context_length": serving.engine.max_model_len,
                        "expires_at": _stamp(STARTED + KEEP_LOADED)}]}


def model_info(serving: Serving) -> dict[str, Any]:
    """GGUF-style keys; `<arch>.context_length` is the served context."""
    snap = serving.engine.snapshot()
    c = snap.model
    arch = c.architecture
    info: dict[str, Any] = {
        "general.architecture": arch, "general.parameter_count": snap.spec.n_params,
        f"{arch}.context_length": serving.engine.max_model_len,
        f"{arch}.embedding_length": c.hidden_size, f"{arch}.block_count": c.num_layers,
        f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.attention.head_count": c.num_heads,
        f"{arch}.attention.head_count_kv": c.num_kv_heads,
        f"{arch}.attention.key_length": c.head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": c.rms_norm_eps,
        f"{arch}.vocab_size": c.vocab_size}
    if c.sliding_window is not None:
        info[f"{arch}.attention.sliding_window"] = c.sliding_window
    tok = serving.tokenizer
    if tok.bos_id is not None:
        info["tokenizer.ggml.bos_token_id"] = tok.bos_id
    if tok.eos_ids:
        info["tokenizer.ggml.eos_token_id"] = tok.eos_ids[0]
    return info


def capabilities(serving: Serving) -> list[str]:
    """Every model embeds (/api/embed pools its hidden states); an encoder does only that."""
    if not serving.engine.snapshot().can_generate:
        return ["embedding"]
    caps = ["completion", "tools"]
    if serving.reasoning is not None:
        caps.append("thinking")
    return [*caps, "embedding"]


def parameters(serving: Serving) -> str:
    """The defaults this server applies, in Modelfile PARAMETER form."""
    rows = [("num_ctx", serving.engine.max_model_len), *DEFAULTS.items()]
    return "\n".join(f"{k:<30} {v}" for k, v in rows)


def show(serving: Serving, body: bytes) -> dict[str, Any]:
    """POST /api/show: details, model_info, the chat template (Jinja, as the model file
    holds it), the defaults applied, and what the server can do with the model."""
    req = parse(ShowRequest, parse_json_body(body))
    check_model(serving, req.model)
    if req.verbose:
        raise ApiError(400, "verbose is not supported: model_info holds no vocabulary lists "
                            "(tokenizer.ggml.tokens, merges); /tokenize and /detokenize map "
                            "text and ids", param="verbose")
    snap = serving.engine.snapshot()
    name = ollama_name(serving)
    params = parameters(serving)
    modelfile = "\n".join([f"# Modelfile of {name} as kvlab serves it", f"FROM {name}",
                           *(f"PARAMETER {line}" for line in params.splitlines())])
    return {"modelfile": modelfile, "parameters": params,
            "template": serving.tokenizer.chat_template or "", "details": details(snap),
            "model_info": model_info(serving), "capabilities": capabilities(serving),
            "modified_at": _stamp(STARTED)}
