"""Attention kernels behind one entry point, `jaxrl.kernels.attention`, the KV-cache decode
attention of the rollout engine, `jaxrl.kernels.decode_attention` (and `extend_attention` for
tokens appended to a cache), and the decode step's C++
CPU kernels, `jaxrl.kernels.cpu_decode`."""

from jaxrl.kernels.attention import IMPLEMENTATIONS, NO_WINDOW, attention
from jaxrl.kernels.decode import decode_attention, extend_attention

__all__ = ["IMPLEMENTATIONS", "NO_WINDOW", "attention", "decode_attention", "extend_attention"]
