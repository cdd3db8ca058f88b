"""The PyTorch reference (verl 0.9.1) imports and computes in the test environment.

The equivalence tests of later modules compare against it; this checks the installation
itself, so a broken reference environment fails here, by name, rather than as a skip.
"""

import numpy as np

from jaxrl.testing import import_reference


def test_verl_core_algos_computes_grpo():
    core_algos = import_reference("verl.trainer.ppo.core_algos")
    import torch

    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = scores
    mask = torch.ones(4, 3)
    index = np.array(["a", "a", "b", "b"], dtype=object)
    adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index)
    # Group a: scores (1, 0), mean 0.5, unbiased std sqrt(0.5); group b: equal scores -> 0.
    expected = 0.5 / (np.sqrt(0.5) + 1e-6)
    # verl computes in float32: a mean, a std and a division, each rounded (6e-8 relative),
    # against the float64 value: < 3e-7 relative (measured 3.6e-8); the tied group is exactly 0.
    np.testing.assert_allclose(adv[:, 0].numpy(), [expected, -expected, 0.0, 0.0], rtol=1e-6)
    assert "grpo" in core_algos.ADV_ESTIMATOR_REGISTRY


def test_verl_reward_score_imports():
    reward_score = import_reference("verl.utils.reward_score")
    assert reward_score.default_compute_score("openai/gsm8k", "#### 42", "42") == 1.0
