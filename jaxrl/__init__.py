"""jaxrl: verl-style RL post-training for HuggingFace LLMs on one JAX device mesh."""

__version__ = "0.1.0.dev0"
