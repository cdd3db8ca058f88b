"""jaxrl: verl-style RL post-training for HuggingFace LLMs on one JAX device mesh."""

from jaxrl.cpu_threads import ensure_cpu_threads

__version__ = "0.1.0.dev0"

# before JAX creates its CPU backend: enough pool threads for fake devices (cpu_threads)
ensure_cpu_threads()
