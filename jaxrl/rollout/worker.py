"""The rollout role: a copy of the policy's weights in the rollout layout and dtype, and
generation on it (verl's rollout worker; "Seams II" grows it into an engine with
conversations and prefix sharing).

    worker = RolloutWorker(config, layout, max_prompt_length=512, max_num_seqs=64)
    worker.load_weights(actor_params)     # reshard train layout -> rollout layout
    out = worker.generate(input_ids, attention_mask, sampling, rng)
    worker.release()                      # free the copy (colocated: the train step's memory)

`load_weights` is the jitted re-layout of `jaxrl.sharding.reshard`: the source may live on the
same devices (colocated) or on others (the rollout on its own device group); either way one
program moves and casts every leaf, no host copy.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxrl.models.config import DecoderConfig
from jaxrl.models.params import param_shardings
from jaxrl.rollout.engine import GenerationOutput, compile_generate, generate
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.sharding.layouts import Layout, placed_abstract
from jaxrl.sharding.reshard import free, reshard


class RolloutWorker:
    """The rollout's weights and generation.

    Args:
        config: The rollout model: its weights are held in `param_dtype` (the actor's master
            dtype, as they come from the trainer) and it computes in `dtype`.
        layout: The rollout layout (mesh `dp` x `tp`) its weights and batches live in.
        max_prompt_length: Refuse longer prompts (`data.max_prompt_length`).
        max_num_seqs: KV-cache slots (`rollout.max_num_seqs`; None: one per row).
    """

    def __init__(
        self,
        config: DecoderConfig,
        layout: Layout,
        *,
        max_prompt_length: int | None = None,
        max_num_seqs: int | None = None,
    ):
        self.config, self.layout = config, layout
        self.max_prompt_length, self.max_num_seqs = max_prompt_length, max_num_seqs
        self.shardings = param_shardings(config, layout)
        self.params: Any = None

    def load_weights(self, params: Any) -> None:
        """Copy `params` (any layout, any devices) into the rollout layout (cast to the
        config's `param_dtype` if they differ), replacing (and freeing) the previous copy."""
        self.release()
        self.params = reshard(params, self.shardings, dtype=self.config.param_dtype)

    def release(self) -> None:
        """Free the weights' device memory (verl's sleep mode between rollouts)."""
        if self.params is not None:
            free(self.params)
            self.params = None

    def generate(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        sampling: SamplingParams,
        rng: jax.Array,
    ) -> GenerationOutput:
        """`jaxrl.rollout.generate` on the loaded weights (see it for multi-process runs)."""
        if self.params is None:
            raise RuntimeError("the rollout has no weights: call load_weights (sync_weights) first")
        return generate(
            self.config,
            self.params,
            input_ids,
            attention_mask,
            sampling,
            rng,
            layout=self.layout,
            max_prompt_length=self.max_prompt_length,
            max_num_seqs=self.max_num_seqs,
        )

    def copy_of(self, like: Any) -> Any:
        """What `load_weights(like)` makes, as `jax.ShapeDtypeStruct`s in the rollout's
        shardings (nothing allocated)."""
        return placed_abstract(like, self.shardings, self.config.param_dtype)

    def compile(self, like: Any, prompts: int, prompt_len: int, sampling: SamplingParams):
        """`generate`'s program for `prompts` prompts of `prompt_len` tokens on a copy of
        `like` (a parameter tree, abstract or not), compiled but not run."""
        params = self.copy_of(like)
        return compile_generate(
            self.config,
            params,
            np.zeros((prompts, prompt_len), np.int32),
            np.ones((prompts, prompt_len), np.int32),
            sampling,
            layout=self.layout,
            max_num_seqs=self.max_num_seqs,
        )
