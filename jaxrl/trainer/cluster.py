"""The run's roles on the mesh: what each model is, where it lives, and the state a checkpoint
holds. An algorithm (`PPOTrainer`; a DPO or SFT trainer alike) works over a cluster and loads
nothing itself.

    cluster = Cluster.load(cfg, {"actor": Training(loss, optimizer, grad_clip), ...})
    cluster.sync_weights()                      # actor -> rollout (jitted reshard)
    out = cluster.rollout.generate(ids, mask, sampling, rng)
    cluster.actor.update(batch, ...)            # a trainable role's Learner
    items, meta = cluster.state_items()         # what a checkpoint holds
    cluster.restore(items, meta)

Each role of `role_specs(cfg)` is loaded by `load_role` into its layout: trainable roles
(actor, critic) become `Learner`s with the algorithm's loss and optimizer (`Training`), the
reference keeps its parameters (`Frozen`), the reward model is a `RewardModel`, and the rollout
holds a copy of the actor's weights that `sync_weights` refreshes. Colocated (the default)
every role shares the train layout and the rollout the rollout layout, on the trainer's
devices; the reward model, colocated, scores each process's rows on its first local device
(layout None). `mesh.placement` puts the rollout,
ref, critic or reward model on a device group of its own (`cluster_layouts`): weights move
between groups with the jitted reshard, and each role's passes take the batch in its own
layout. Offloaded state (verl's `param_offload` / `optimizer_offload`) lives in pinned host
memory and comes to the devices only around the passes that use it (`on_device`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from jaxrl.config import Config
from jaxrl.data.batch import bucket
from jaxrl.models.config import DecoderConfig
from jaxrl.models.lora import split
from jaxrl.rewards.reward_model import RewardModel
from jaxrl.rollout.engine import RolloutEngine
from jaxrl.sharding.layouts import Layout, role_layouts
from jaxrl.sharding.offload import offload, reload, supports_host_offload
from jaxrl.sharding.processes import global_array, to_host
from jaxrl.trainer.fingerprint import tree_hash
from jaxrl.trainer.learner import Learner, LossFn, shardings_of
from jaxrl.trainer.roles import (
    RoleSpec,
    check_teacher_tokenizer,
    is_teacher,
    load_role,
    placement_group,
    role_specs,
)
from jaxrl.trainer.staleness import groups_cap
from jaxrl.trainer.update import UpdateState, init_state

log = logging.getLogger("jaxrl.train")


@dataclasses.dataclass(frozen=True)
class Training:
    """How an algorithm trains one role: its loss (made from the loaded model's config), its
    optimizer and its gradient clip."""

    loss: Callable[[DecoderConfig], LossFn]
    optimizer: optax.GradientTransformation
    grad_clip: float | None


@dataclasses.dataclass
class Frozen:
    """A role the run does not train: its model config, parameters and layout."""

    config: DecoderConfig
    params: Any
    layout: Layout | None


class BaseOf:
    """The reference policy of a LoRA actor: the actor's frozen base, read at each use (an
    offload moves it between host and device memory)."""

    def __init__(self, learner: Learner):
        self._learner = learner

    @property
    def config(self) -> DecoderConfig:
        return self._learner.config

    @property
    def params(self) -> Any:
        return self._learner.base

    @property
    def layout(self) -> Layout | None:
        return self._learner.layout


def cluster_layouts(
    cfg: Config, specs: Mapping[str, RoleSpec], devices=None
) -> dict[str, Layout | None]:
    """Each role's layout: its own group's when placed (`mesh.placement`), else colocated:
    the train layout (actor, ref, critic), the rollout layout over the trainer's devices, and
    for the reward model None (each process scores its rows on its first local device)."""
    groups = role_layouts(cfg, devices)
    colocated = {"reward": None}
    return {
        name: groups.get(placement_group(name), colocated.get(name, groups["train"]))
        for name in specs
    }


def rollout_slots(cfg: Config, dp: int = 1) -> int:
    """The rollout engine's KV-cache slots: `rollout.max_num_seqs`, but under
    `async_training.mode=fully_async` no more than its staleness gate can ever fill, n x
    R x T x (1 + θ) (`staleness.groups_cap`), rounded up to a multiple of the rollout's `dp`
    (the engine keeps a multiple of it): the cache holds every slot's `max_model_len` tokens
    whether the gate can fill it or not (validation's batch generation on the engine then
    decodes in waves of that many rows)."""
    rollout, at = cfg.actor_rollout_ref.rollout, cfg.async_training
    if at.mode != "fully_async":
        return rollout.max_num_seqs
    cap = groups_cap(cfg.data.train_batch_size, at.trigger_parameter_sync_step,
                     at.staleness_threshold)  # fmt: skip
    slots = min(rollout.max_num_seqs, -(-rollout.n * cap // dp) * dp)
    if slots < rollout.max_num_seqs:
        log.info(
            "async_training.mode=fully_async runs at most %d groups of %d at once: the "
            "rollout holds %d KV-cache slots, not max_num_seqs=%d",
            cap, rollout.n, slots, rollout.max_num_seqs,
        )  # fmt: skip
    return slots


class Cluster:
    """The run's roles: `learners` (trainable), `frozen` (ref), `rollout`, `reward_model`.

    Built by `Cluster.load`; the attributes below name the usual roles.

    Attributes:
        specs: Every role's `RoleSpec`.
        layouts: Every role's layout.
        learners: Trainable roles by name (`actor`, `critic`).
        frozen: Frozen roles by name (`ref`, `teacher` or several `teacher:<key>`).
        rollout: The rollout engine (weights loaded by `sync_weights`).
        reward_model: The reward model (`reward_model.enable`), else None.
    """

    def __init__(
        self,
        specs: dict[str, RoleSpec],
        layouts: dict[str, Layout | None],
        learners: dict[str, Learner],
        frozen: dict[str, Frozen],
        rollout: RolloutEngine | None,
        reward_model: RewardModel | None = None,
        *,
        shared_ref: bool = False,
    ):
        self.specs, self.layouts = specs, layouts
        self.learners, self.frozen = learners, frozen
        self.rollout, self.reward_model = rollout, reward_model
        # LoRA on the actor: the reference is the actor's frozen base (no copy of its own)
        self.shared_ref = shared_ref
        # each role's model config group, for messages (the offline trainers': `model`)
        self.model_keys = {"actor": "actor_rollout_ref.model", "critic": "critic.model"}
        self._on_device: set[tuple[str, str]] = set()  # (role, "params" | "opt") brought back

    @classmethod
    def load(
        cls,
        cfg: Config,
        training: Mapping[str, Training],
        *,
        tokenizer: Any = None,
        devices=None,
        abstract: bool = False,
    ) -> Cluster:
        """Load every role `cfg` uses. `training` gives each trainable role's loss and
        optimizer; `tokenizer` (the actor's) is the reward model's input tokenizer.
        `abstract`: parameters and optimizer states are `jax.ShapeDtypeStruct`s in their
        shardings, nothing is read but `config.json` (a cluster that only compiles), and no
        reward model is loaded."""
        specs = _offload_supported(role_specs(cfg))
        if "reward" in specs and tokenizer is None and not abstract:
            raise ValueError(
                "reward_model.enable: Cluster.load needs the actor's tokenizer (tokenizer=...) "
                "to tell whether the reward model's differs and responses must be re-templated"
            )
        teacher_paths = {spec.path for name, spec in specs.items() if is_teacher(name)}
        if teacher_paths and not abstract:
            if tokenizer is None:
                raise ValueError(
                    "distillation.enabled: Cluster.load needs the actor's tokenizer "
                    "(tokenizer=...) to check that the teacher's is the same"
                )
            for path in sorted(teacher_paths):
                check_teacher_tokenizer(path, tokenizer)
        layouts = cluster_layouts(cfg, specs, devices)
        shared_ref = _shares_ref(specs)
        learners, frozen, models = _load_roles(specs, layouts, training, abstract, shared_ref)
        reward_model = None
        if "reward" in models:
            reward_model = RewardModel.from_config(
                cfg.reward_model, tokenizer, layouts["reward"], model=models["reward"]
            )
        spec = specs["rollout"]
        rollout_cfg = cfg.actor_rollout_ref.rollout
        # A conversation's prompt is padded to its bucket: room for the whole response after it.
        context = learners["actor"].config.rope.max_position_embeddings
        first = rollout_cfg.prompt_length
        if rollout_cfg.agent.external:  # a later call's prompt: the conversation so far
            first += rollout_cfg.response_length
        max_model_len = rollout_cfg.max_model_len or min(
            bucket(first) + rollout_cfg.response_length, context
        )
        rollout = RolloutEngine(
            learners["actor"].config.replace(
                param_dtype=spec.param_dtype,
                dtype=spec.compute_dtype,
                remat="none",
                attention_impl=spec.attention_impl,
            ),
            layouts["rollout"],
            # an external agent's later calls are whole conversations (their first prompt is
            # held to it by the server's recorder)
            max_prompt_length=None if rollout_cfg.agent.external else cfg.data.max_prompt_length,
            max_num_seqs=rollout_slots(cfg, int(layouts["rollout"].mesh.shape.get("dp", 1))),
            max_model_len=max_model_len,
            tokenizer=tokenizer,
            decode_backend=rollout_cfg.decode_backend,
            every_process=jax.process_count() > 1,  # its devices may be some processes' only
        )
        cluster = cls(
            specs, layouts, learners, frozen, rollout, reward_model, shared_ref=shared_ref
        )
        if not abstract:
            cluster._offload_at_start()
        return cluster

    @classmethod
    def offline(
        cls,
        specs: Mapping[str, RoleSpec],
        layout: Layout | None,
        training: Mapping[str, Training],
        *,
        abstract: bool = False,
    ) -> Cluster:
        """A cluster without rollout or reward model, every role on `layout`: the offline
        trainers' (the trained actor and, for DPO / KTO, a frozen `ref`; with a LoRA actor
        the reference is its base, as in RL)."""
        specs = _offload_supported(dict(specs))
        layouts = {name: layout for name in specs}
        shared_ref = _shares_ref(specs)
        learners, frozen, _ = _load_roles(specs, layouts, training, abstract, shared_ref)
        cluster = cls(specs, layouts, learners, frozen, None, shared_ref=shared_ref)
        cluster.model_keys = {name: "model" for name in specs}
        if not abstract:
            cluster._offload_at_start()
        return cluster

    def _offload_at_start(self) -> None:
        for name, spec in self.specs.items():
            if name in self.learners or name in self.frozen:
                opt = spec.optimizer_offload and name in self.learners
                if spec.param_offload or opt:
                    self._move(name, offload, spec.param_offload, opt)

    @contextlib.contextmanager
    def on_device(self, name: str, *, optimizer: bool = False) -> Iterator[None]:
        """Within the block, role `name`'s offloaded parameters (and with `optimizer` its
        offloaded optimizer state) are in device memory; after it, back in host memory
        (verl's load/offload around each use). Nothing moves for a role not offloaded. The
        reference shared with a LoRA actor is the actor's base: the actor's offload applies."""
        if name == "ref" and self.shared_ref:
            name = "actor"
        spec = self.specs[name]
        params = spec.param_offload and (name, "params") not in self._on_device
        opt = optimizer and spec.optimizer_offload and (name, "opt") not in self._on_device
        moved = {key for key, moves in (((name, "params"), params), ((name, "opt"), opt)) if moves}
        if not moved:  # not offloaded, or already brought back by an enclosing block
            yield
            return
        self._move(name, reload, params, opt)
        self._on_device |= moved
        try:
            yield
        except BaseException:
            # Left on the devices: an update that failed may have donated (deleted) the
            # state, and moving it would raise over the error that matters.
            self._on_device -= moved
            raise
        self._on_device -= moved
        self._move(name, offload, params, opt)

    def _move(self, name: str, move: Callable[[Any], Any], params: bool, opt: bool) -> None:
        if name in self.learners:
            learner = self.learners[name]
            state = learner.state
            learner.state = state.replace(
                params=move(state.params) if params else state.params,
                opt_state=move(state.opt_state) if opt else state.opt_state,
            )
            if params and learner.base is not None:
                learner.base = move(learner.base)
        elif params:
            self.frozen[name].params = move(self.frozen[name].params)

    def resident(self, name: str) -> dict[str, Any]:
        """What role `name` keeps in device memory throughout a step: its parameters unless
        offloaded and, trainable, its update count and optimizer state unless offloaded."""
        spec, out = self.specs[name], {}
        if name in self.learners:
            state = self.learners[name].state
            out["step"] = state.step
            if not spec.param_offload:
                out["params"] = state.params
                if self.learners[name].base is not None:
                    out["base"] = self.learners[name].base
            if not spec.optimizer_offload:
                out["opt_state"] = state.opt_state
        elif name in self.frozen and not spec.param_offload:
            out["params"] = self.frozen[name].params
        return out

    @property
    def actor(self) -> Learner:
        return self.learners["actor"]

    @property
    def critic(self) -> Learner | None:
        return self.learners.get("critic")

    @property
    def ref(self) -> Frozen | BaseOf | None:
        """The reference policy: a frozen role, or with a LoRA actor its base (the same
        arrays: the actor's weights without adapters)."""
        if self.shared_ref:
            return BaseOf(self.actor)
        return self.frozen.get("ref")

    @property
    def teachers(self) -> dict[str, Frozen]:
        """The distillation teachers by role name (`teacher`, or `teacher:<key>` each of
        several); empty without distillation."""
        return {name: role for name, role in self.frozen.items() if is_teacher(name)}

    @property
    def rollout_colocated(self) -> bool:
        """Whether the rollout shares the actor's devices (then its weights are freed after
        each generation, for the passes that follow)."""
        return self.device_group("rollout") == "train"

    def device_group(self, name: str) -> str:
        """The device group role `name` lives on: "train" (the actor's devices) or, placed
        on devices of its own, its `mesh.placement` entry (`teacher` for every teacher)."""
        layout, actor = self.layouts.get(name), self.layouts["actor"]
        if layout is None or set(layout.mesh.devices.flat) == set(actor.mesh.devices.flat):
            return "train"
        return placement_group(name)

    @property
    def num_devices(self) -> int:
        """Devices the roles live on (all of them together)."""
        devices = set()
        for layout in self.layouts.values():
            if layout is not None:
                devices |= set(layout.mesh.devices.flat)
        return len(devices)

    def sync_weights(self) -> bool:
        """Publish the actor's weights to the rollout (its layout and dtype), once per
        version (`Learner.version`): returns False, copying nothing, when the rollout holds
        this version already. With LoRA, after the first sync only the adapters move (the
        rollout keeps the base), unless the actor's parameters are offloaded: then the
        rollout keeps no base on the devices between steps (it could be the offloaded arrays
        themselves) and each sync copies the whole model, as without LoRA."""
        actor, rollout = self.actor, self.rollout
        if rollout.params is not None and rollout.version == actor.version:
            return False
        with self.on_device("actor"):
            keep_base = actor.base is not None and not self.specs["actor"].param_offload
            rollout.load_weights(actor.params, frozen_base=keep_base, version=actor.version)
        return True

    def param_hashes(self) -> dict[str, jax.Array]:
        """`fingerprint.tree_hash` of each trainable role's parameters (on the devices, one
        role at a time when offloaded)."""
        hashes = {}
        for name, learner in self.learners.items():
            with self.on_device(name):
                hashes[name] = tree_hash(learner.state.params)
        return hashes

    def state_items(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(arrays, meta) of a checkpoint: each trainable role's parameters and optimizer
        state (`{role}_params`, `{role}_opt`) and, as JSON, its update count
        (`{role}_steps`) and what `jaxrl.export` needs to write the actor as an HF model."""
        items, meta = {}, {}
        for name, learner in self.learners.items():
            items[f"{name}_params"] = learner.state.params  # with LoRA: the adapters
            items[f"{name}_opt"] = learner.state.opt_state
            meta[f"{name}_steps"] = int(to_host(learner.state.step))
            if learner.config.lora is not None:
                meta[f"{name}_lora"] = _lora_meta(learner.config)
        actor = self.specs["actor"]
        meta["model_path"] = str(Path(actor.path).expanduser().absolute())
        meta["param_dtype"] = actor.param_dtype
        meta["override_config"] = dict(actor.override_config)
        return items, meta

    def restore(self, items: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        """Put back what `state_items` returned (`items` restored in the roles' shardings,
        their memory kinds included: offloaded state comes back to host memory).

        Raises:
            ValueError: for a checkpoint of other LoRA settings (rank, alpha, targets).
        """
        for name, learner in self.learners.items():
            saved, now = meta.get(f"{name}_lora"), _lora_meta(learner.config)
            if saved != now:
                key = self.model_keys.get(name, f"{name}.model")
                raise ValueError(
                    f"the checkpoint's {name} was trained with LoRA {saved}, this run asks for "
                    f"{now} (None: no LoRA): set {key}.lora_rank / lora_alpha / target_modules "
                    "as the checkpoint has them"
                )
            step = global_array(np.asarray(meta[f"{name}_steps"], learner.state.step.dtype),
                                learner.state.step.sharding)  # fmt: skip
            learner.state = UpdateState(items[f"{name}_params"], items[f"{name}_opt"], step)
            learner.version = int(meta[f"{name}_steps"])
        if self.rollout is not None:  # its copy, if any, is of the weights before the restore
            self.rollout.release()


def _shares_ref(specs: Mapping[str, RoleSpec]) -> bool:
    """Whether the reference is the LoRA actor's base (no model of its own)."""
    shared = "ref" in specs and specs["actor"].lora is not None
    if shared:
        _warn_ref_settings(specs["ref"], specs["actor"])
    return shared


def _load_roles(
    specs: Mapping[str, RoleSpec],
    layouts: Mapping[str, Layout | None],
    training: Mapping[str, Training],
    abstract: bool,
    shared_ref: bool,
) -> tuple[dict[str, Learner], dict[str, Frozen], dict[str, tuple[DecoderConfig, Any]]]:
    """Load every role but the rollout (and, abstract, the reward model; and, `shared_ref`,
    the reference a LoRA actor's base stands for): (learners, frozen roles,
    {"reward": (config, params)})."""
    learners, frozen, models = {}, {}, {}
    for name, spec in specs.items():
        if name == "rollout" or (name == "reward" and abstract) or (name == "ref" and shared_ref):
            continue
        if spec.trainable and name not in training:
            raise ValueError(f"the {name} role is trainable but the algorithm gave no Training")
        config, params = load_role(spec, layouts[name], abstract=abstract)
        if spec.trainable:
            keep = ("score",) if spec.head == "value" else ()
            learners[name] = _learner(config, params, training[name], layouts[name], keep)
        elif name == "reward":
            models[name] = (config, params)
        else:
            frozen[name] = Frozen(config, params, layouts[name])
    return learners, frozen, models


def _offload_supported(specs: dict[str, RoleSpec]) -> dict[str, RoleSpec]:
    """The specs, with offload turned off (and a warning) where the backend has no pinned
    host memory."""
    offloading = [n for n, s in specs.items() if s.offloads]
    if not offloading or supports_host_offload():
        return specs
    log.warning(
        "%s: this backend has no pinned host memory; the offloaded state stays on the devices",
        ", ".join(f"{name} offload" for name in offloading),
    )
    off = dict(param_offload=False, optimizer_offload=False)
    return {n: dataclasses.replace(s, **off) if n in offloading else s for n, s in specs.items()}


def _learner(
    config: DecoderConfig, params: Any, training: Training, layout, keep: tuple[str, ...] = ()
) -> Learner:
    """A `Learner` over `params`; with LoRA it trains the adapters (and the `keep` entries:
    a critic's fresh value head) and holds the rest frozen."""
    base = None
    if config.lora is not None:
        base, params = split(params, keep)
    state = init_state(params, training.optimizer, layout, shardings_of(params))
    return Learner(
        config,
        state,
        training.optimizer,
        training.loss(config),
        layout=layout,
        grad_clip=training.grad_clip,
        base=base,
    )


def _lora_meta(config: DecoderConfig) -> dict[str, Any] | None:
    """A role's LoRA settings as a checkpoint's manifest records them (None: no LoRA)."""
    spec = config.lora
    if spec is None:
        return None
    return {"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets)}


def _warn_ref_settings(ref: RoleSpec, actor: RoleSpec) -> None:
    """The reference of a LoRA actor is its base: the ref's own dtypes and offload have
    nothing to apply to; say so when they are set (a placement of its own is a config error,
    `config.checks`)."""
    ignored = []
    if (ref.param_dtype, ref.compute_dtype) != (actor.param_dtype, actor.compute_dtype):
        ignored.append("actor_rollout_ref.ref.model_dtype / dtype (the actor's apply)")
    if ref.param_offload:
        ignored.append("actor_rollout_ref.ref.param_offload (the actor's applies)")
    if ignored:
        log.warning(
            "LoRA: the reference policy is the actor's base without adapters (no copy of its "
            "own); %s do not apply", "; ".join(ignored),
        )  # fmt: skip
