"""The one exception a bad configuration raises."""

from __future__ import annotations

from collections.abc import Sequence


class ConfigError(ValueError):
    """A configuration that cannot run, with every problem found.

    Each problem names the key, the offending value and what to change.

    Attributes:
        problems: One message per problem.
    """

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        noun = "problem" if len(self.problems) == 1 else "problems"
        super().__init__(f"invalid configuration ({len(self.problems)} {noun}):\n{lines}")
