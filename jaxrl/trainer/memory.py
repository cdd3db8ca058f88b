"""Device memory of a step, from XLA's analysis of the compiled programs (nothing runs).

    plan = trainer.memory_plan()     # PPOTrainer: compile_step's programs and its resident state
    plan.peak, plan.largest, plan.programs["actor micro-batch"].temporaries

Per device, a step holds its resident state (parameters, optimizer states, the reference
model) throughout, and one program at a time adds what XLA reports for it: its inputs beyond
the resident state (the micro-batch, the gradient accumulator, the rollout copy of the
weights, offloaded state brought back for it), its outputs that do not reuse a donated input,
its temporaries, offloaded state brought back for its phase that it does not take as an
argument (the optimizer state during an update's micro-batches), and, for the passes and
updates, the step's batch (`RLBatch`, held on the trainer's devices from scoring through the
updates, of which they take micro-batches):

    peak  ~=  resident + max over programs p of (arguments_p - resident_p + outputs_p
                                                  - aliased_p + temporaries_p + reloaded_p)

where resident_p is the part of program p's arguments that is resident state. Offloaded state
(`param_offload`, `optimizer_offload`) is not resident: it lives in host memory (`host`) and
counts only for the programs that need it. Roles placed on device groups of their own
(`mesh.placement`) each have this sum over their group's resident state and programs, and the
peak is the largest group's. Phases that run no compiled program of their own (the weight sync
to the rollout) add what they hold. This is an estimate: the allocator's fragmentation, XLA's
own workspace and the host runtime come on top.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxrl.trainer.batch import RLBatch


def worst_case_batch(
    rows: int, prompt_len: int, response_len: int, fields: tuple[str, ...]
) -> RLBatch:
    """An abstract batch (`jax.ShapeDtypeStruct`s, nothing allocated) whose widest
    micro-batch is the largest a step can see: row 0 a full `prompt_len` + `response_len`
    tokens, every other row one prompt and one response token.

    Micro-batches are trimmed to their longest row, so the one holding row 0 is full width;
    with a fixed row count it has as many rows as any, and with a token budget
    (`use_dynamic_bsz`) its other shards' parts are as many of the short rows as the budget
    admits: the most padded token slots a budget allows. `fields` are float32 [rows, R].
    """
    tokens = {
        "prompts": jax.ShapeDtypeStruct((rows, prompt_len), np.int32),
        "prompt_mask": jax.ShapeDtypeStruct((rows, prompt_len), np.int32),
        "responses": jax.ShapeDtypeStruct((rows, response_len), np.int32),
        "response_mask": jax.ShapeDtypeStruct((rows, response_len), np.int32),
        "loss_mask": jax.ShapeDtypeStruct((rows, response_len), np.int32),
        "group_ids": jax.ShapeDtypeStruct((rows,), np.int32),
    }
    floats = {name: jax.ShapeDtypeStruct((rows, response_len), np.float32) for name in fields}
    lengths = (1,) * (rows - 1)
    return RLBatch(
        **tokens,
        **floats,
        prompt_lengths=(prompt_len, *lengths),
        response_lengths=(response_len, *lengths),
    )


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a tree of arrays (or `ShapeDtypeStruct`s with shardings):
    the largest shard of each leaf, summed."""
    total = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        shape = x.shape if sharding is None else sharding.shard_shape(x.shape)
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """XLA's memory analysis of one compiled program, bytes per device."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> ProgramMemory:
        stats = compiled.memory_analysis()
        return cls(
            arguments=int(stats.argument_size_in_bytes),
            outputs=int(stats.output_size_in_bytes),
            aliased=int(stats.alias_size_in_bytes),
            temporaries=int(stats.temp_size_in_bytes),
        )

    def beyond(self, resident: int) -> int:
        """What the program adds on top of `resident` bytes of its arguments (resident state
        it reads; jit drops unused arguments, hence the floor at 0)."""
        return max(self.arguments - resident, 0) + self.outputs - self.aliased + self.temporaries


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The estimate of a step's peak device memory (see the module doc), bytes per device.

    Attributes:
        resident: Resident device state per role ("actor", "ref", "critic").
        programs: Each program's analysis.
        adds: What each program (or phase) adds to the resident state while it runs.
        host: Offloaded state per role, in host memory between the programs that use it.
        groups: Role or program name -> its device group (absent: the one group "train").
        batch: The step's batch on a device, held from scoring through the updates: in the
            adds of the programs that run meanwhile (reported, counted there).
    """

    resident: dict[str, int]
    programs: dict[str, ProgramMemory]
    adds: dict[str, int]
    host: dict[str, int] = dataclasses.field(default_factory=dict)
    groups: dict[str, str] = dataclasses.field(default_factory=dict)
    batch: int = 0

    def _group(self, name: str) -> str:
        return self.groups.get(name, "train")

    def group_peak(self, group: str) -> int:
        """A device group's resident state plus its largest program's addition."""
        resident = sum(v for role, v in self.resident.items() if self._group(role) == group)
        adds = [v for name, v in self.adds.items() if self._group(name) == group]
        return resident + max(adds, default=0)

    @property
    def peak(self) -> int:
        """The largest device group's peak, bytes per device."""
        groups = {self._group(name) for name in (*self.resident, *self.adds)}
        return max((self.group_peak(g) for g in groups), default=0)

    @property
    def largest(self) -> str:
        """The program (or phase) of the peak: the largest addition on the peak's group."""
        groups = {self._group(name) for name in (*self.resident, *self.adds)}
        group = max(groups, key=self.group_peak)
        mine = {k: v for k, v in self.adds.items() if self._group(k) == group}
        return max(mine, key=mine.__getitem__)


def memory_plan(
    programs: Mapping[str, jax.stages.Compiled],
    resident: Mapping[str, Any],
    resident_arguments: Mapping[str, Any],
    reloaded: Mapping[str, Any] | None = None,
    host: Mapping[str, Any] | None = None,
    groups: Mapping[str, str] | None = None,
    phases: Mapping[str, Any] | None = None,
    batch: tuple[Any, tuple[str, ...]] | None = None,
) -> MemoryPlan:
    """The step's memory plan.

    Args:
        programs: `PPOTrainer.compile_step()`'s programs.
        resident: Role name -> its resident device tree (an `UpdateState`, the reference
            parameters; without what is offloaded).
        resident_arguments: Program name -> the resident tree it takes as an argument (the
            role's parameters or whole state, without what is offloaded); absent: none
            (generation takes the rollout copy of the weights, made for it).
        reloaded: Program name -> offloaded trees on the devices while it runs that it does
            not take as arguments.
        host: Role name -> its offloaded trees (reported, not counted).
        groups: Role, program or phase name -> its device group; absent: "train".
        phases: Phase name -> the trees it holds on the devices beyond the resident state
            (no compiled program of its own).
        batch: (the step's batch as placed on the devices, the programs that run while it
            is held): it adds to each of those (they take micro-batches of it).
    """
    reloaded, host = reloaded or {}, host or {}
    held, during = batch if batch is not None else (None, ())
    analysed = {name: ProgramMemory.of(c) for name, c in programs.items()}
    adds = {
        name: stats.beyond(bytes_per_device(resident_arguments.get(name)))
        + bytes_per_device(reloaded.get(name))
        + (bytes_per_device(held) if name in during else 0)
        for name, stats in analysed.items()
    }
    adds.update({name: bytes_per_device(tree) for name, tree in (phases or {}).items()})
    return MemoryPlan(
        resident={role: bytes_per_device(tree) for role, tree in resident.items()},
        programs=analysed,
        adds=adds,
        host={role: bytes_per_device(tree) for role, tree in host.items()},
        groups=dict(groups or {}),
        batch=bytes_per_device(held),
    )


def gib(n: int) -> str:
    """Bytes as a short human figure."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
