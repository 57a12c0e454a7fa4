"""Checkpoint files -> named raw tensors, in three modules so that reading a file's header
never loads torch: `gguf_file` (a GGUF file's metadata and tensor directory, numpy only),
`checkpoint` (GGUF files and HF safetensors directories as torch tensors: `open_checkpoint`)
and `default_model` (where the default model is).
"""
