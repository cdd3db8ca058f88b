"""Access to the PyTorch reference (verl 0.9.1) for equivalence tests.

Without verl installed, an equivalence test is skipped, so that `pip install -e .` alone still
gives a passing suite; with `JAXRL_REQUIRE_REFERENCE=1` (set by `.ci/run`) a missing reference
is a failure instead, so CI can never pass by skipping the comparisons.
"""

from __future__ import annotations

import ast
import importlib
import os
import textwrap
from collections.abc import Callable
from pathlib import Path
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


def reference_method(path: str, class_name: str, method: str, namespace: dict) -> Callable:
    """A method of a verl class, compiled from verl's own source file (`path` inside the
    installed `verl` package) into `namespace` (its globals: what the method's body names);
    its decorators and annotations are not evaluated. For the few verl methods whose module
    imports what this environment lacks (ray, a vLLM server): the reference's code, without
    its import chain. Skips (fails under `JAXRL_REQUIRE_REFERENCE=1`) without verl."""
    verl = import_reference("verl")
    file = Path(verl.__file__).parent / path
    text = file.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == method:
                    lines = text.splitlines(keepends=True)[item.lineno - 1 : item.end_lineno]
                    # not evaluated: the annotations; the blank lines keep verl's line numbers
                    head = "from __future__ import annotations" + "\n" * (item.lineno - 1)
                    source = head + textwrap.dedent("".join(lines))
                    exec(compile(source, str(file), "exec"), namespace)
                    return namespace[method]
    raise LookupError(f"{file}: no method {class_name}.{method}")
