"""Ways the fault tests damage files on disk."""

from __future__ import annotations

from pathlib import Path


def flip_bytes(path: Path, count: int = 64) -> None:
    """Invert `count` bytes in the middle of a file (its size unchanged)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, min(middle + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
