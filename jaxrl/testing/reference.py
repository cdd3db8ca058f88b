"""Access to the PyTorch reference (verl 0.9.1) for equivalence tests.

Without verl installed, an equivalence test is skipped, so that `pip install -e .` alone still
gives a passing suite; with `JAXRL_REQUIRE_REFERENCE=1` (set by `.ci/run`) a missing reference
is a failure instead, so CI can never pass by skipping the comparisons.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

REQUIRE_REFERENCE_ENV = "JAXRL_REQUIRE_REFERENCE"


def import_reference(module: str = "verl.trainer.ppo.core_algos") -> ModuleType:
    """Import a module of the reference, or skip (fail under `JAXRL_REQUIRE_REFERENCE=1`)."""
    import pytest

    try:
        return importlib.import_module(module)
    except ImportError as e:
        msg = (
            f"the PyTorch reference is not importable ({module}: {e}); install it with "
            "pip install -e '.[test]' && pip install --no-deps verl==0.9.1"
        )
        if os.environ.get(REQUIRE_REFERENCE_ENV) == "1":
            pytest.fail(f"{REQUIRE_REFERENCE_ENV}=1 but {msg}", pytrace=False)
        pytest.skip(msg)
