"""What this machine applies: `isolation()` runs `pass` once per process and caches it.

`check(required)` raises `SandboxUnavailable` when a required layer is missing here, so a tool
can refuse at start-up, before any untrusted code arrives (every run checks again, in the
runner, before its exec).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from .host import run_python
from .layers import LAYERS, SandboxUnavailable, validate


def isolation() -> dict[str, bool]:
    """Which layers this machine applies (keys: `LAYERS`), probed once by running `pass`.

    A layer is False where the kernel refused it (e.g. no unprivileged user namespaces, no
    Landlock). `docs/sandbox.md` says what each one means.
    """
    return dict(_probe())


@functools.cache
def _probe() -> dict[str, bool]:
    try:
        result = run_python("pass", timeout_s=30, cpu_s=10, memory_mb=1024, require=())
    except OSError:
        return dict.fromkeys(LAYERS, False)
    return result.isolation


def check(required: Sequence[str]) -> None:
    """Raise `SandboxUnavailable` unless this machine applies every layer in `required`."""
    layers = isolation()
    missing = [layer for layer in validate(required) if not layers.get(layer)]
    if missing:
        raise SandboxUnavailable(missing)
