"""The reward-model role: a sequence-classification model scoring rollouts on the mesh.

For each row, the model reads prompt + response and its 1-label head's output at the last valid
token is the score, placed on the last valid token of the actor's response:

    reward_tensor[b, last valid response position of b] = score(prompt_b + response_b)

When the reward model shares the actor's tokenizer, the actor's tokens are scored as they are
(left-padded prompt, right-padded response; positions from the mask). When it does not, each
row is re-templated as verl 0.9.1's reward loop does it:

    response = actor_tokenizer.decode(valid response ids), with the eos text removed
    chat     = raw_prompt messages + [{"role": "assistant", "content": response}]
    text     = rm_tokenizer.apply_chat_template(chat, tokenize=False), leading bos text removed
    ids      = rm_tokenizer(text, add_special_tokens=True)   (truncated to max_length)

and the rows are right-padded to a length bucket (`jaxrl.data.batch.bucket`), so one compiled
scorer serves many batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float, Int

from jaxrl.data.batch import bucket
from jaxrl.models import DecoderConfig, from_pretrained, sequence_scores
from jaxrl.models.params import Params, param_shardings
from jaxrl.rewards.inputs import place_scores
from jaxrl.sharding.layouts import Layout, use_layout

Messages = Sequence[Mapping[str, Any]]


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two HF tokenizers give the same ids and chat template (then no re-templating)."""
    if a is b:
        return True
    return (
        a.get_vocab() == b.get_vocab()
        and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
        and a.bos_token == b.bos_token
        and a.eos_token == b.eos_token
    )


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


class RewardModel:
    """Scores rollouts with a reward model (an HF `*ForSequenceClassification`, 1 label).

    Args:
        config: The reward model (`head` must be a classification head).
        params: Its parameters (placed by `layout` if given).
        tokenizer: The reward model's tokenizer.
        input_tokenizer: The actor's tokenizer; None: the same as `tokenizer`.
        layout: Run the scorer on this mesh and layout (batch sharded over its batch axes);
            None: the default device.
        max_length: Longest re-tokenised sequence; longer ones are cut on the `truncation` side.
        truncation: `right` (keep the start, verl's default), `left` (keep the end) or `error`.
        micro_batch_size: Rows per compiled call; None: the whole batch.
        length_multiple: Re-tokenised rows are padded to at least this many tokens, and beyond
            to the length buckets of `jaxrl.data.batch.bucket` (at most 1.5x padding, a few
            compiled programs).
        retokenize: Force (True) or skip (False) re-templating; None: when the tokenizers differ.
    """

    def __init__(
        self,
        config: DecoderConfig,
        params: Params,
        tokenizer: Any,
        input_tokenizer: Any = None,
        *,
        layout: Layout | None = None,
        max_length: int | None = None,
        truncation: str = "right",
        micro_batch_size: int | None = None,
        length_multiple: int = 64,
        retokenize: bool | None = None,
    ) -> None:
        if config.head == "causal_lm" or config.num_labels != 1:
            raise ValueError(
                f"a reward model needs a 1-label classification head; this checkpoint has "
                f"head={config.head!r} with {config.num_labels} labels (save it as "
                "*ForSequenceClassification with num_labels=1)"
            )
        if truncation not in ("right", "left", "error"):
            raise ValueError(f"truncation must be 'right', 'left' or 'error', got {truncation!r}")
        self.config = config
        self.params = params
        self.tokenizer = tokenizer
        self.input_tokenizer = input_tokenizer if input_tokenizer is not None else tokenizer
        self.layout = layout
        self.max_length = max_length
        self.truncation = truncation
        self.micro_batch_size = micro_batch_size
        self.length_multiple = length_multiple
        if retokenize is None:
            retokenize = not same_tokenizer(self.input_tokenizer, tokenizer)
        self.retokenize = retokenize
        self._scorer = self._build_scorer()

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        input_tokenizer: Any = None,
        *,
        dtype: str = "float32",
        layout: Layout | None = None,
        trust_remote_code: bool = False,
        model: tuple[DecoderConfig, Params] | None = None,
        **kwargs: Any,
    ) -> RewardModel:
        """Load an HF checkpoint folder (weights and tokenizer) as a reward model.

        Args:
            path: The folder (config.json, safetensors, tokenizer files).
            input_tokenizer: The actor's tokenizer (an object or a path); None: the same.
            dtype: Parameter and compute dtype.
            layout: Place the parameters and run on this layout.
            trust_remote_code: Passed to `AutoTokenizer`.
            model: The checkpoint's (config, params), already loaded in `layout` (a run's
                cluster loads every role the same way); None: loaded here in `dtype`.
            **kwargs: Further `RewardModel` options.
        """
        from transformers import AutoTokenizer

        if model is None:
            config, params = from_pretrained(path, dtype=dtype, layout=layout)
            model = config.replace(dtype=dtype), params
        config, params = model
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if isinstance(input_tokenizer, str):
            input_tokenizer = AutoTokenizer.from_pretrained(
                input_tokenizer, trust_remote_code=trust_remote_code
            )
        return cls(config, params, tokenizer, input_tokenizer, layout=layout, **kwargs)

    @classmethod
    def from_config(
        cls,
        reward_model: Any,
        input_tokenizer: Any = None,
        layout: Layout | None = None,
        model: tuple[DecoderConfig, Params] | None = None,
    ) -> RewardModel:
        """From a `RewardModelConfig` (`reward_model.*`); `input_tokenizer` is the actor's
        tokenizer (or `reward_model.model.input_tokenizer` names one); `model` as in
        `from_pretrained`."""
        if not reward_model.model.path:
            raise ValueError(
                "reward_model.enable needs reward_model.model.path (an HF sequence-"
                "classification checkpoint folder)"
            )
        tokenizer = input_tokenizer or reward_model.model.input_tokenizer
        return cls.from_pretrained(
            reward_model.model.path,
            tokenizer,
            dtype=reward_model.dtype,
            layout=layout,
            trust_remote_code=reward_model.model.trust_remote_code,
            model=model,
            max_length=reward_model.max_length,
            micro_batch_size=reward_model.micro_batch_size_per_gpu
            and reward_model.micro_batch_size_per_gpu * (layout.batch_shards() if layout else 1),
        )

    # ------------------------------------------------------------------------------ scoring

    def _build_scorer(self):
        config = self.config

        def score(params, input_ids, attention_mask):
            return sequence_scores(config, params, input_ids, attention_mask)[:, 0]

        if self.layout is None:
            return jax.jit(score)
        layout = self.layout
        params_sharding = param_shardings(config, layout)
        compiled: dict[tuple[int, ...], Any] = {}  # one jitted function per token shape

        def run(params, input_ids, attention_mask):
            if input_ids.shape not in compiled:
                tokens = layout.tokens(input_ids.shape)
                compiled[input_ids.shape] = jax.jit(
                    score,
                    in_shardings=(params_sharding, tokens, tokens),
                    out_shardings=layout.replicated(),
                )
            with use_layout(layout):  # shard() constraints apply while tracing
                return compiled[input_ids.shape](params, input_ids, attention_mask)

        return run

    def score_tokens(
        self, input_ids: Int[np.ndarray, "b t"], attention_mask: Int[np.ndarray, "b t"]
    ) -> Float[np.ndarray, " b"]:
        """[B] float32 scores of token rows (any padding; the last 1 of the mask is read)."""
        ids, mask = np.asarray(input_ids, np.int32), np.asarray(attention_mask, np.int32)
        b = ids.shape[0]
        step = self.micro_batch_size or b
        step = _round_up(step, 1 if self.layout is None else self.layout.batch_shards())
        out = []
        for start in range(0, b, step):
            chunk_ids, chunk_mask = ids[start : start + step], mask[start : start + step]
            pad = step - chunk_ids.shape[0]
            if pad:  # filler rows hold one token so no row is fully masked
                chunk_ids = np.pad(chunk_ids, ((0, pad), (0, 0)))
                chunk_mask = np.pad(chunk_mask, ((0, pad), (0, 0)))
                chunk_mask[-pad:, 0] = 1
            scores = self._scorer(self.params, jnp.asarray(chunk_ids), jnp.asarray(chunk_mask))
            out.append(np.asarray(scores, np.float32)[: step - pad])
        return np.concatenate(out)

    def rm_text(self, messages: Messages, response_ids: Sequence[int]) -> str:
        """The reward model's input text for one row (see the module docstring)."""
        src, dst = self.input_tokenizer, self.tokenizer
        response = src.decode(list(response_ids))
        if src.eos_token:
            response = response.replace(src.eos_token, "")
        chat = [dict(m) for m in messages] + [{"role": "assistant", "content": response}]
        text = dst.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
        if dst.bos_token and text.startswith(dst.bos_token):
            text = text[len(dst.bos_token) :]
        return text

    def retokenize_rows(
        self,
        raw_prompts: Sequence[Messages],
        response_ids: Int[np.ndarray, "b r"],
        response_mask: Int[np.ndarray, "b r"],
    ) -> tuple[Int[np.ndarray, "b t"], Int[np.ndarray, "b t"]]:
        """Right-padded (ids [B, T], mask [B, T]) in the reward model's tokenizer."""
        lengths = np.asarray(response_mask).sum(-1)
        rows = []
        for b, messages in enumerate(raw_prompts):
            text = self.rm_text(messages, np.asarray(response_ids)[b, : lengths[b]].tolist())
            ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
            if self.max_length is not None and len(ids) > self.max_length:
                if self.truncation == "error":
                    raise ValueError(
                        f"row {b}: {len(ids)} reward-model tokens > reward_model.max_length="
                        f"{self.max_length}; raise it or choose a truncation side"
                    )
                ids = (
                    ids[: self.max_length]
                    if self.truncation == "right"
                    else ids[-self.max_length :]
                )
            rows.append(ids)
        t = bucket(max(len(r) for r in rows), minimum=self.length_multiple)
        pad_id = self.tokenizer.pad_token_id or 0
        out_ids = np.full((len(rows), t), pad_id, np.int32)
        out_mask = np.zeros((len(rows), t), np.int32)
        for b, r in enumerate(rows):
            out_ids[b, : len(r)], out_mask[b, : len(r)] = r, 1
        return out_ids, out_mask

    def compute_rm_score(
        self,
        response_ids: Int[np.ndarray, "b r"],
        response_mask: Int[np.ndarray, "b r"],
        prompt_ids: Int[np.ndarray, "b p"] | None = None,
        prompt_mask: Int[np.ndarray, "b p"] | None = None,
        raw_prompts: Sequence[Messages] | None = None,
    ) -> Float[np.ndarray, "b r"]:
        """Reward tensor [B, R] float32: each row's score on its last valid response token.

        Args:
            response_ids: Actor response tokens, right-padded.
            response_mask: 1 on valid response tokens.
            prompt_ids: Actor prompt tokens, left-padded (used when not re-tokenising).
            prompt_mask: 1 on valid prompt tokens.
            raw_prompts: Each row's prompt as chat messages (needed when re-tokenising).
        """
        response_ids, response_mask = np.asarray(response_ids), np.asarray(response_mask)
        if self.retokenize:
            if raw_prompts is None:
                raise ValueError(
                    "the reward model's tokenizer differs from the actor's, so each row is "
                    "re-templated from its chat messages: pass raw_prompts (the dataset's "
                    "prompt messages)"
                )
            ids, mask = self.retokenize_rows(raw_prompts, response_ids, response_mask)
        else:
            if prompt_ids is None or prompt_mask is None:
                raise ValueError("pass prompt_ids and prompt_mask (or raw_prompts to re-template)")
            ids = np.concatenate([np.asarray(prompt_ids), response_ids], axis=1)
            mask = np.concatenate([np.asarray(prompt_mask), response_mask], axis=1)
        return place_scores(self.score_tokens(ids, mask), response_mask)
