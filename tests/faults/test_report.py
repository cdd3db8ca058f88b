"""docs/reliability.md's table is current: a row for every fault test, each from a passing run
(regenerate: JAXRL_FAULT_REPORT=docs/reliability.md JAXRL_SOAK_KILLS=10 pytest tests/faults)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

HERE = Path(__file__).parent
DOC = HERE.parents[1] / "docs" / "reliability.md"


def fault_tests() -> set[str]:
    names = set()
    for path in HERE.glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                "mark.fault" in ast.unparse(d) for d in node.decorator_list
            ):
                names.add(node.name)
    return names


def test_every_fault_test_has_a_passing_row():
    table = DOC.read_text().split("<!-- faults:begin -->")[1].split("<!-- faults:end -->")[0]
    rows = re.findall(r"\| `(test_\w+)(?:\[[^\]]*\])?` \| (\w+)", table)
    assert rows, "no table: regenerate it (see this module's docstring)"
    assert {name for name, _ in rows} == fault_tests()
    assert {result for _, result in rows} == {"passed"}
