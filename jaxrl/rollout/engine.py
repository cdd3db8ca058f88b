"""`RolloutEngine`: the rollout role's weights, its compiled programs, and conversations.

    engine = RolloutEngine(config, layout, max_num_seqs=64, max_model_len=4096, tokenizer=tok)
    engine.load_weights(actor_params)             # reshard train layout -> rollout layout
    out = engine.generate(ids, mask, sampling, rng)   # batch generation (continuous batching)
    slots = engine.start(ids, mask)               # conversations (`jaxrl.rollout.slots`)
    engine.release()                              # free weights and cache (verl's sleep)
    mine = engine.local()                         # this process's share (several processes)

`generate` is `jaxrl.rollout.generation.generate` on the loaded weights: its KV cache lives in
its program. The conversations (`start`, `decode`, `append`, `end`, ...) are the engine's
`ConversationSlots` half (`jaxrl.rollout.slots`): a cache that lives across calls, and each
slot's host record.

The weights are a `RolloutWeights` (`jaxrl.rollout.weights`: the jitted re-layout of the
actor's, their version, a LoRA base kept between loads); the engine's conversations and
generation read them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxrl.models.config import DecoderConfig
from jaxrl.models.params import param_shardings
from jaxrl.rollout.backends import choose_backend
from jaxrl.rollout.generation import GenerationOutput, compile_generate, generate
from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.slots import Conversation, ConversationSlots, Turn
from jaxrl.rollout.weights import RolloutWeights
from jaxrl.sharding.layouts import ROLLOUT_RULES, Layout, rollout_mesh
from jaxrl.sharding.processes import local_mesh, local_view, spans_processes

__all__ = ["Conversation", "RolloutEngine", "Turn"]  # the records, where they were


class RolloutEngine(ConversationSlots):
    """The rollout's weights, generation, and conversations.

    Args:
        config: The rollout model: its weights are held in `param_dtype` (the cluster sets
            it to `rollout.dtype`, as verl's vLLM copy) and it computes in `dtype`.
        layout: The rollout layout (mesh `dp` x `tp`) its weights, batches and caches live
            in; None: the first device.
        max_prompt_length: Refuse longer prompts (`data.max_prompt_length`).
        max_num_seqs: KV-cache slots (`rollout.max_num_seqs`): rows `generate` decodes at
            once (None: one per row), and conversations open at once (required for them).
        max_model_len: Tokens a conversation holds (its prompt bucket's padding included);
            None: the model's context.
        tokenizer: Detokenizes turns for stop strings (`SamplingParams.stop`).
        stop_check_tokens: Tokens sampled between two stop-string checks.
        decode_backend: How the decode step runs (`rollout.decode_backend`: "auto", "xla"
            or "cpu_kernels"; `jaxrl.rollout.backends`).
        every_process: Whether every process calls its batch generation (`generate`'s):
            True for an engine on some processes' devices that every process generates on;
            None: when its mesh has devices of other processes than the caller's.
    """

    def __init__(
        self,
        config: DecoderConfig,
        layout: Layout | None = None,
        *,
        max_prompt_length: int | None = None,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        tokenizer: Any = None,
        stop_check_tokens: int = 16,
        decode_backend: str = "auto",
        every_process: bool | None = None,
    ):
        if layout is None:
            layout = Layout.create(rollout_mesh(1, jax.devices()[:1]), ROLLOUT_RULES)
        context = config.rope.max_position_embeddings
        if max_model_len is not None and not 2 < max_model_len <= context:
            raise ValueError(
                f"max_model_len={max_model_len}: must be in (2, {context}] (the model's "
                "context, max_position_embeddings)"
            )
        if stop_check_tokens < 1:
            raise ValueError(f"stop_check_tokens={stop_check_tokens}: must be >= 1")
        self.config, self.layout = config, layout
        self.max_prompt_length, self.max_num_seqs = max_prompt_length, max_num_seqs
        self.max_model_len = max_model_len or context
        self.tokenizer, self.stop_check_tokens = tokenizer, stop_check_tokens
        self.shardings = param_shardings(config, layout)
        self.decode_backend, self.every_process = decode_backend, every_process
        self.backend = choose_backend(decode_backend, config, layout)
        self.weights = RolloutWeights(config, self.shardings, per_layer=self.backend.name == "xla")
        self._local: RolloutEngine | None = None  # this process's share (`local`)
        super().__init__()

    # ---- weights -------------------------------------------------------------------------

    def load_weights(
        self, params: Any, *, frozen_base: bool = False, version: int | None = None
    ) -> None:
        """Copy `params` (any layout, any devices) into the rollout layout
        (`RolloutWeights.load`), replacing the previous copy; `version` (the policy's) is what
        the scheduler's handles record. Open conversations keep their caches (computed with
        the earlier weights)."""
        self.weights.load(params, frozen_base=frozen_base, version=version)
        if self._local is not None:  # the share's view of the copy just freed: the new one
            self._view_weights()

    @property
    def params(self) -> Any:
        """The loaded weights (None: none)."""
        return self.weights.params

    @property
    def version(self) -> int | None:
        """The loaded weights' version (`load_weights`)."""
        return self.weights.version

    def release(self) -> None:
        """Free the weights' and the conversation cache's device memory (verl's sleep mode
        between rollouts); open conversations are ended. A LoRA base is kept (the next load
        moves only the adapters)."""
        self.weights.release()
        self._drop_slots()
        if self._local is not None:
            self._local.release()  # its view of the weights is gone with them

    # ---- this process's share --------------------------------------------------------------

    def local(self) -> RolloutEngine:
        """This process's share of the engine: the rows of the rollout mesh (its `dp` groups)
        on this process's devices, their weights a view of the loaded copy (the same device
        buffers: `jaxrl.sharding.processes.local_view`), and `max_num_seqs` in proportion
        (the same slots per device). Its conversations and generation run on this process
        alone, at its own pace: each process's agent loop or streamed groups. The engine
        itself when its mesh is this process's (one process). Kept between calls: every
        `load_weights` views the new copy, and `release` ends its conversations too."""
        mesh = self.layout.mesh
        if not spans_processes(mesh):
            return self
        if self._local is None:
            own = local_mesh(mesh)
            share = (own.devices.shape[0], mesh.devices.shape[0])  # its rows of the mesh's
            slots = self.max_num_seqs and max(self.max_num_seqs * share[0] // share[1], 1)
            self._local = RolloutEngine(
                self.config,
                Layout(own, self.layout.rules),
                max_prompt_length=self.max_prompt_length,
                max_num_seqs=slots,
                max_model_len=self.max_model_len,
                tokenizer=self.tokenizer,
                stop_check_tokens=self.stop_check_tokens,
                decode_backend=self.backend.name,  # the weights' form (per layer or not)
            )
            self._view_weights()  # `load_weights` keeps it current from now on
        return self._local

    def _view_weights(self) -> None:
        """The share's weights: a view of the loaded copy."""
        view = local_view(self.weights.get(), self._local.layout.mesh)
        self._local.weights.borrow(view, version=self.version)

    def _weights(self) -> Any:
        return self.weights.get()

    def copy_of(self, like: Any) -> Any:
        """What `load_weights(like)` makes, abstract (`RolloutWeights.copy_of`)."""
        return self.weights.copy_of(like)

    # ---- batch generation ----------------------------------------------------------------

    def generate(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        sampling: SamplingParams,
        rng: jax.Array,
        *,
        defer: bool = False,
    ) -> GenerationOutput:
        """`jaxrl.rollout.generate` on the loaded weights (see it for multi-process runs and
        `defer`)."""
        return generate(
            self.config,
            self._weights(),
            input_ids,
            attention_mask,
            sampling,
            rng,
            layout=self.layout,
            max_prompt_length=self.max_prompt_length,
            max_num_seqs=self.max_num_seqs,
            decode_backend=self.decode_backend,
            every_process=self.every_process,
            defer=defer,
        )

    def compile(self, like: Any, prompts: int, prompt_len: int, sampling: SamplingParams):
        """`generate`'s program for `prompts` prompts of `prompt_len` tokens on a copy of
        `like` (a parameter tree, abstract or not), compiled but not run."""
        return compile_generate(
            self.config,
            self.copy_of(like),
            np.zeros((prompts, prompt_len), np.int32),
            np.ones((prompts, prompt_len), np.int32),
            sampling,
            layout=self.layout,
            max_num_seqs=self.max_num_seqs,
            decode_backend=self.decode_backend,
        )
