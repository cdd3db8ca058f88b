"""Balanced-brace scanning shared by the `\\boxed{...}` extractors."""

from __future__ import annotations


def balanced_from(text: str, start: int) -> str | None:
    """`text[start : end + 1]`, where `end` is the brace that closes the first `{` opened at or
    after `start`; None when it never closes."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None
