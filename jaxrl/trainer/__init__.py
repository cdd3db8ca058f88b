"""Training machinery: optimizers and schedules, the sharded update step (the PPO loop comes
with the trainer issue)."""

from jaxrl.trainer.optim import learning_rate_schedule, make_optimizer
from jaxrl.trainer.update import UpdateState, make_update_step

__all__ = ["UpdateState", "learning_rate_schedule", "make_optimizer", "make_update_step"]
