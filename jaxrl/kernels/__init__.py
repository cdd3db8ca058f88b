"""Attention kernels behind one entry point, `jaxrl.kernels.attention`, and the KV-cache
decode attention of the rollout engine, `jaxrl.kernels.decode_attention`."""

from jaxrl.kernels.attention import IMPLEMENTATIONS, NO_WINDOW, attention
from jaxrl.kernels.decode import decode_attention

__all__ = ["IMPLEMENTATIONS", "NO_WINDOW", "attention", "decode_attention"]
