"""The logical axis vocabulary and the default layouts (logical name -> mesh axes), as data.

    train   (mesh dp, fsdp, tp, sp): weights ZeRO-3 over `fsdp` and tensor-parallel over `tp`,
            replicated over `dp`; batch over (dp, fsdp); sequence over `sp`.
    rollout (mesh dp, tp): weights tensor-parallel over `tp` only, replicated over `dp`; every
            `dp` slice is a generation replica; KV cache over batch (dp) and kv heads (tp).

The config group `mesh` holds these as `train_rules` / `rollout_rules`, so a run can change
them (`mesh.train_rules.vocab=null`). A name a layout leaves out is replicated.
"""

from __future__ import annotations

# Parameter axes (jaxrl.models.params) and activation / cache axes.
LOGICAL_AXES = (
    "vocab",
    "embed",
    "mlp",
    "heads",
    "kv_heads",
    "head_dim",
    "layers",
    "labels",
    "batch",
    "seq",
    "cache_seq",
)

TRAIN_MESH_AXES = ("dp", "fsdp", "tp", "sp")
ROLLOUT_MESH_AXES = ("dp", "tp")

TRAIN_RULES: dict[str, str | list[str] | None] = {
    "vocab": "tp",
    "embed": "fsdp",
    "mlp": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "batch": ["dp", "fsdp"],
    "seq": "sp",
}

ROLLOUT_RULES: dict[str, str | list[str] | None] = {
    "vocab": "tp",
    "mlp": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "batch": "dp",
}


def rule_problems(rules: dict, mesh_axes: tuple[str, ...], key: str) -> list[str]:
    """Messages for rules naming unknown logical names or mesh axes, or a mesh axis twice."""
    problems = []
    for name, target in rules.items():
        if name not in LOGICAL_AXES:
            problems.append(
                f"{key}.{name}: unknown logical axis; use one of {', '.join(LOGICAL_AXES)}"
            )
        if target is not None and not isinstance(target, str | list | tuple):
            problems.append(
                f"{key}.{name}: {target!r} is not a mesh axis name, a list of them or null"
            )
            continue
        axes = [] if target is None else [target] if isinstance(target, str) else list(target)
        for axis in axes:
            if axis not in mesh_axes:
                problems.append(
                    f"{key}.{name}: {axis!r} is not a mesh axis here; use {', '.join(mesh_axes)}"
                )
        if len(set(axes)) != len(axes):
            problems.append(f"{key}.{name}: a mesh axis appears twice in {axes}")
    return problems
