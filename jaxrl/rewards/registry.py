"""Reward managers by verl's names, and building one from the config.

    manager = make_reward_manager(config, tokenizer)        # config: jaxrl.config.Config
    future = manager.submit(RewardInputs(...))              # scores on the host meanwhile
    out = future.result()                                   # RewardOutput

`config.reward_model.reward_manager` picks the class; `config.custom_reward_function` the
scoring function (the built-in `default_compute_score` when its path is null);
`config.data.reward_fn_key` the data-source column; `config.data.max_response_length` is the
dapo manager's `max_resp_len`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxrl.rewards.custom import compute_score_from_config
from jaxrl.rewards.managers import (
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    OverlongBuffer,
    RewardManager,
)
from jaxrl.rewards.parallel import ParallelRewardManager

REWARD_MANAGERS: dict[str, type[RewardManager]] = {
    "naive": NaiveRewardManager,
    "batch": BatchRewardManager,
    "dapo": DAPORewardManager,
    "prime": ParallelRewardManager,
    "parallel": ParallelRewardManager,  # jaxrl's descriptive alias of `prime`
}


def register_reward_manager(name: str, cls: type[RewardManager]) -> type[RewardManager]:
    """Add a manager class under `name` (a different class under a taken name is an error)."""
    if REWARD_MANAGERS.get(name, cls) is not cls:
        raise ValueError(f"reward manager {name!r} is already registered")
    REWARD_MANAGERS[name] = cls
    return cls


def get_reward_manager_cls(name: str) -> type[RewardManager]:
    """The manager class registered as `name`."""
    if name not in REWARD_MANAGERS:
        raise ValueError(
            f"unknown reward manager {name!r} (reward_model.reward_manager); "
            f"registered: {sorted(REWARD_MANAGERS)}"
        )
    return REWARD_MANAGERS[name]


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def make_reward_manager(
    config: Any, tokenizer: Any = None, num_examine: int = 0, **kwargs: Any
) -> RewardManager:
    """The reward manager a `jaxrl.config.Config` describes.

    Args:
        config: The full config (its `reward_model`, `custom_reward_function` and `data`).
        tokenizer: The actor's tokenizer (to decode token ids; dapo also strips its eos).
        num_examine: Rows per data source to print per batch (verl prints 1 in validation).
        **kwargs: Manager options that win over the config: `compute_score_timeout` (naive,
            dapo), `overlong_buffer_cfg` and `max_resp_len` (dapo), `num_workers` and
            `timeout_s` (prime), `reward_kwargs` (batch).

    Optional config keys read when present (see the rewards package docstring):
    `reward_model.overlong_buffer.{enable,len,penalty_factor,log}`,
    `reward_model.compute_score_timeout`, `reward_model.num_workers`, `reward_model.timeout_s`,
    `reward_model.reward_kwargs`.
    """
    rm = config.reward_model
    name = _get(rm, "reward_manager", "naive")
    cls = get_reward_manager_cls(name)
    options: dict[str, Any] = {}
    if issubclass(cls, NaiveRewardManager):
        options["compute_score_timeout"] = _get(rm, "compute_score_timeout")
    if issubclass(cls, DAPORewardManager):
        buffer = _get(rm, "overlong_buffer")
        if buffer is not None:
            fields = ("enable", "len", "penalty_factor", "log")
            buffer = OverlongBuffer(
                **{f: _get(buffer, f) for f in fields if _get(buffer, f) is not None}
            )
        options["overlong_buffer_cfg"] = buffer
        options["max_resp_len"] = _get(config.data, "max_response_length")
    if issubclass(cls, ParallelRewardManager):
        for key in ("num_workers", "timeout_s"):
            if _get(rm, key) is not None:
                options[key] = _get(rm, key)
    if issubclass(cls, BatchRewardManager):
        options["reward_kwargs"] = dict(_get(rm, "reward_kwargs") or {})
    options.update(kwargs)
    return cls(
        tokenizer=tokenizer,
        num_examine=num_examine,
        compute_score=compute_score_from_config(config.custom_reward_function),
        reward_fn_key=_get(config.data, "reward_fn_key", "data_source"),
        error_score=_get(rm, "error_score", 0.0),
        **options,
    )
