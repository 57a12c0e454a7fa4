"""How kvlab holds GGUF block types on the CPU: the types its C kernels take in 8-row groups
(8 rows interleaved so that one register lane holds one row), the type each is grouped as,
the kernels' id of the grouped layout and its bytes per block (each its file type's size).
A table and nothing else, so the estimator counts the loader's bytes without loading it."""

from __future__ import annotations

from gguf import GGMLQuantizationType

T = GGMLQuantizationType
# type in the file -> type of its 8-row groups (Q4_0 widens to Q8_0: its values fit 8 bits)
GROUPS_AS = {
    T.Q8_0: T.Q8_0, T.Q5_0: T.Q5_0, T.Q4_0: T.Q8_0, T.Q4_K: T.Q4_K, T.Q6_K: T.Q6_K,
    T.Q2_K: T.Q2_K, T.Q3_K: T.Q3_K, T.IQ4_XS: T.IQ4_XS, T.IQ4_NL: T.IQ4_NL, T.Q5_K: T.Q5_K,
    T.MXFP4: T.MXFP4,
}
# grouped type -> the C kernels' id for its layout (KV_Q8_0X8, KV_Q4_KX8, ... in csrc/qk.h)
GROUPED_KERNEL_TYPES = {
    T.Q8_0: 31, T.Q4_K: 32, T.Q6_K: 33, T.Q2_K: 34, T.Q3_K: 35, T.IQ4_XS: 36, T.IQ4_NL: 37,
    T.Q5_0: 38, T.Q5_K: 40, T.MXFP4: 41,  # 39 is GGML's MXFP4 itself
}
# grouped type -> bytes per block of 8 rows' worth, per row (its file type's size)
GROUPED_BLOCK_BYTES = {
    T.Q8_0: 34, T.Q4_K: 144, T.Q6_K: 210, T.Q2_K: 84, T.Q3_K: 110, T.IQ4_XS: 136,
    T.IQ4_NL: 18, T.Q5_0: 22, T.Q5_K: 176, T.MXFP4: 17,
}
