"""Rewards: rule-based scorers, a user's scoring function, reward managers (host), and the
reward-model role (device).

Host side (no JAX needed; safe to import in scoring worker processes):

    default_compute_score(data_source, solution_str, ground_truth, extra_info=None)
    load_custom_reward_fn(path, name, reward_kwargs)        # custom_reward_function.*
    make_reward_manager(config, tokenizer)                  # naive, batch, dapo, prime
    manager(RewardInputs(...)) -> RewardOutput              # or manager.submit(...) -> Future

Device side: `jaxrl.rewards.reward_model.RewardModel` (imported on demand, it loads JAX).
"""

from jaxrl.rewards.custom import (
    CustomRewardError,
    CustomRewardFn,
    compute_score_from_config,
    load_custom_reward_fn,
)
from jaxrl.rewards.inputs import RewardInputs, RewardOutput, place_scores
from jaxrl.rewards.managers import (
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    OverlongBuffer,
    RewardManager,
)
from jaxrl.rewards.parallel import ParallelRewardManager, ScoringPool
from jaxrl.rewards.registry import (
    REWARD_MANAGERS,
    get_reward_manager_cls,
    make_reward_manager,
    register_reward_manager,
)
from jaxrl.rewards.scorers import default_compute_score

__all__ = [
    "REWARD_MANAGERS",
    "BatchRewardManager",
    "CustomRewardError",
    "CustomRewardFn",
    "DAPORewardManager",
    "NaiveRewardManager",
    "OverlongBuffer",
    "ParallelRewardManager",
    "RewardInputs",
    "RewardManager",
    "RewardOutput",
    "ScoringPool",
    "compute_score_from_config",
    "default_compute_score",
    "get_reward_manager_cls",
    "load_custom_reward_fn",
    "make_reward_manager",
    "place_scores",
    "register_reward_manager",
]
