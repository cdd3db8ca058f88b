"""Routing rows to distillation teachers (verl 0.9.1's multi-teacher distillation).

With several entries in `distillation.teacher_models`, each row of a step goes to the teacher
whose `key` equals the row's field `distillation.teacher_key` (default `data_source`; any of
`Row.fields`): that teacher alone scores the row's response tokens. One teacher scores every
row, whatever its field says (verl's single-teacher path).

    router = TeacherRouter.from_config(cfg)        # None with one teacher
    router.check_rows(dataset.rows, "data.train_files")   # before training: every row routed
    route = router.routes(prompts)                 # int32 [B]: index into router.roles
    rows_of_math = np.flatnonzero(route == router.index("teacher:math"))

The trainer carries each row's route beside its other host arrays (`ROUTE` in the step's
rows) through generation, over-sampling, dynamic sampling and the gather of processes, and
runs each teacher's pass over its rows only (`jaxrl.trainer.learner.infer(row_ids=...)`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl.config import Config
from jaxrl.config.checks import teacher_roles
from jaxrl.data.batch import PromptBatch
from jaxrl.data.rows import DataError, Row

ROUTE = "teacher_route"  # the step's host rows: int32 [N], each row's index in `roles`


@dataclasses.dataclass(frozen=True)
class TeacherRouter:
    """Which teacher scores each row.

    Attributes:
        field: The rows' field that routes them (`distillation.teacher_key`).
        roles: The teachers' role names (`teacher:<key>`), in the cluster's order.
        keys: Each role's routing key (the value of `field` its rows hold).
    """

    field: str
    roles: tuple[str, ...]
    keys: tuple[Any, ...]

    @classmethod
    def from_config(cls, cfg: Config) -> TeacherRouter | None:
        """The router of a run with several teachers, else None (one teacher scores all)."""
        roles = teacher_roles(cfg) if cfg.distillation.enabled else {}
        if len(roles) < 2:
            return None
        keys = tuple(key for _, key in roles.values())
        return cls(cfg.distillation.teacher_key, tuple(roles), keys)

    def _problem(self, value: Any) -> str | None:
        if value is None:
            return (
                f"it has no field {self.field!r} (distillation.teacher_key), which routes rows "
                "to the teachers"
            )
        if value not in self.keys:
            typed = (
                f"; it is a {type(value).__name__} and the keys are strings, as verl types them"
                if str(value) in self.keys
                else ""
            )
            return (
                f"its {self.field}={value!r} is the key of no teacher (distillation."
                f"teacher_models.*.key: {list(self.keys)}){typed}"
            )
        return None

    def check_rows(self, rows: Sequence[Row], key: str) -> None:
        """Raise `DataError` naming the first rows (file and row) no teacher would score."""
        bad = []
        for row in rows:
            problem = self._problem(row.fields().get(self.field))
            if problem is not None:
                bad.append(f"{row.source[0]}: row {row.source[1]}: {problem}")
        if bad:
            more = f" (and {len(bad) - 3} more rows)" if len(bad) > 3 else ""
            raise DataError(
                f"{key}: {len(bad)} rows cannot be routed to a distillation teacher: "
                + "; ".join(bad[:3])
                + more
                + ". Give each teacher the key of its rows, or set distillation.teacher_key "
                "to the field that holds them"
            )

    def index(self, role: str) -> int:
        """The route of teacher `role` (its place in `roles`)."""
        return self.roles.index(role)

    def routes(self, prompts: PromptBatch) -> np.ndarray:
        """int32 [B]: each row's teacher, as an index into `roles`."""
        values = prompts.field(self.field)
        out = np.empty(len(values), np.int32)
        for i, value in enumerate(values):
            problem = self._problem(value)
            if problem is not None:  # `check_rows` found none in the data set: a bug
                raise ValueError(f"prompt row {prompts.row_ids[i]}: {problem}")
            out[i] = self.keys.index(value)
        return out

    def host_fields(self, prompts: PromptBatch) -> dict[str, np.ndarray]:
        """The rows' routes as a field of the step's host rows (`ROUTE`)."""
        return {ROUTE: self.routes(prompts)}
