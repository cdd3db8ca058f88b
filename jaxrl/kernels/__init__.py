"""Attention kernels behind one entry point, `jaxrl.kernels.attention`."""

from jaxrl.kernels.attention import IMPLEMENTATIONS, NO_WINDOW, attention

__all__ = ["IMPLEMENTATIONS", "NO_WINDOW", "attention"]
