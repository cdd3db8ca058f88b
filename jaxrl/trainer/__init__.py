"""Training: the roles on the mesh (`roles`), a trained role's update (`learner`, `update`,
`losses`, `optim`), the PPO step (`ppo_trainer`), the run (`fit`: loop, validation,
checkpoints, logs) and its memory plan (`memory`). See docs/architecture.md."""

from jaxrl.trainer.optim import learning_rate_schedule, make_optimizer
from jaxrl.trainer.update import UpdateState

__all__ = ["UpdateState", "learning_rate_schedule", "make_optimizer"]
