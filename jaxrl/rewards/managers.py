"""Reward managers: score decoded responses on the host and place each score on the last valid
response token (verl 0.9.1's `naive`, `batch` and `dapo` managers; `prime` is in `parallel.py`).

A manager turns a `RewardInputs` batch into a `RewardOutput`:

    reward_tensor[b, r] = score_b  if r == last valid response position of row b,  else 0
    reward_extra_info[k] = [info_b[k] for b in rows]       (None where row b has no key k)
    metrics = {"reward/errors": rows whose scorer raised or timed out, "reward/timeouts": ...}

`compute_score` returns a float, or a dict whose "score" is the reward and whose every key
(including "score") is extra info; for a float, extra info gets `acc = score`, as verl 0.9.1's
reward loop records it. A scorer that raises, times out, or returns something that is not a
finite number (NaN, inf, a string, a batch of the wrong length) scores `error_score`
(`reward_model.error_score`, default 0) for that row and is counted in `reward/errors` (and
`reward/timeouts`); the first three are logged with their reason, then one line with the
batch's count; the run goes on. (verl's own `naive` manager lets the exception end the run; its
`prime` manager scores 0, as here by default.)

Scoring runs on the host in the calling process. `submit(inputs)` scores in a background
thread and returns a `concurrent.futures.Future`, so the device can work meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxrl.rewards.inputs import RewardInputs, RewardOutput, last_valid_index, place_scores
from jaxrl.rewards.scorers import default_compute_score

logger = logging.getLogger(__name__)

ScoreFn = Callable[..., Any]


# ------------------------------------------------------------------------------- one row's result


@dataclass
class RowResult:
    """What scoring one row gave: `value` (the scorer's return) or an error."""

    value: Any = None
    error: str | None = None
    timed_out: bool = False


def split_result(
    result: RowResult, error_score: float = 0.0
) -> tuple[float, dict[str, Any], str | None]:
    """(reward, extra info, error) of one row; a failed, non-numeric or non-finite result is
    reward `error_score`."""
    if result.error is not None:
        return error_score, {}, result.error
    value = result.value
    try:
        if isinstance(value, Mapping):
            score, info = float(value["score"]), dict(value)
        else:
            score, info = float(value), {"acc": value}
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        return (
            error_score,
            {},
            f"compute_score returned {value!r}, not a number or a dict with 'score' ({e})",
        )
    if not np.isfinite(score):
        return error_score, {}, f"compute_score returned {score}, not a finite number"
    return score, info, None


def call_scorer(fn: ScoreFn, **kwargs: Any) -> RowResult:
    """Run one scorer call, turning an exception into a `RowResult` error."""
    try:
        return RowResult(value=fn(**kwargs))
    except Exception as e:
        return RowResult(error=f"{type(e).__name__}: {e}", timed_out=isinstance(e, TimeoutError))


@contextlib.contextmanager
def alarm_timeout(seconds: float | None):
    """Raise TimeoutError in the block after `seconds` (SIGALRM; main thread only, else a no-op,
    as in verl's naive manager). For timeouts that always work, use the `prime` manager."""
    if not seconds or seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"compute_score timed out after {seconds}s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------------------------------- managers


class RewardManager:
    """Shared machinery: decoding, assembling the output, `submit`, printing examples.

    Subclasses implement `score_rows(inputs, responses) -> list[RowResult]`.
    """

    name = "base"
    strip_eos = False  # drop a trailing `tokenizer.eos_token` from decoded text (dapo)

    def __init__(
        self,
        tokenizer: Any = None,
        num_examine: int = 0,
        compute_score: ScoreFn | None = None,
        reward_fn_key: str = "data_source",
        error_score: float = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.num_examine = num_examine
        self.compute_score = compute_score or default_compute_score
        self.reward_fn_key = reward_fn_key
        self.error_score = float(error_score)
        self._executor: ThreadPoolExecutor | None = None

    # -- subclasses
    def score_rows(self, inputs: RewardInputs, responses: list[str]) -> list[RowResult]:
        raise NotImplementedError

    def extra_reward(self, inputs: RewardInputs) -> tuple[np.ndarray, dict[str, list[Any]]]:
        """[B] additions to the score and their extra info (the dapo overlong penalty)."""
        return np.zeros(len(inputs)), {}

    # -- public
    def decode(self, inputs: RewardInputs) -> list[str]:
        """The decoded responses ([B] strings), from `inputs.responses` or the token ids."""
        if inputs.responses is not None:
            texts = [str(s) for s in inputs.responses]
        else:
            if self.tokenizer is None:
                raise ValueError(f"the {self.name} manager needs a tokenizer to decode token ids")
            ids = np.asarray(inputs.response_ids)
            lengths = inputs.response_lengths
            texts = [
                self.tokenizer.decode(ids[i, : lengths[i]].tolist(), skip_special_tokens=True)
                for i in range(len(inputs))
            ]
        eos = getattr(self.tokenizer, "eos_token", None) if self.strip_eos else None
        if eos:
            texts = [t[: -len(eos)] if t.endswith(eos) else t for t in texts]
        return texts

    def inputs_from_columns(self, columns: Mapping[str, Sequence[Any]], response_mask, **kw):
        """`RewardInputs.from_columns` with this manager's `reward_fn_key`."""
        return RewardInputs.from_columns(
            columns, response_mask, reward_fn_key=self.reward_fn_key, **kw
        )

    def __call__(self, inputs: RewardInputs) -> RewardOutput:
        """Score a batch (blocking)."""
        responses = self.decode(inputs)
        results = self.score_rows(inputs, responses)
        out = self._assemble(inputs, results)
        self._examine(inputs, responses, results, out)
        return out

    def submit(self, inputs: RewardInputs) -> Future[RewardOutput]:
        """Score a batch in a background thread; `.result()` gives the `RewardOutput`."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"reward-{self.name}")
        return self._executor.submit(self, inputs)

    def close(self) -> None:
        """Stop the background thread (and any worker processes)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals
    def _assemble(self, inputs: RewardInputs, results: list[RowResult]) -> RewardOutput:
        b = len(inputs)
        scores = np.zeros(b)
        infos: list[dict[str, Any]] = []
        errors = timeouts = 0
        for i, result in enumerate(results):
            scores[i], info, error = split_result(result, self.error_score)
            infos.append(info)
            if error is not None:
                errors += 1
                timeouts += int(result.timed_out)
                if errors <= 3:
                    logger.warning(
                        "%s reward manager: row %d (data_source=%r) scored %g: %s",
                        self.name,
                        i,
                        inputs.data_sources[i],
                        self.error_score,
                        error,
                    )
        if errors > 3:
            logger.warning(
                "%s reward manager: and %d more rows (reward/errors=%d of %d rows, "
                "reward/timeouts=%d)",
                self.name,
                errors - 3,
                errors,
                b,
                timeouts,
            )
        extra_b, extra_info = self.extra_reward(inputs)
        scores = scores.astype(np.float32) + extra_b.astype(np.float32)
        keys = list(dict.fromkeys(k for info in infos for k in info))
        reward_extra_info = {k: [info.get(k) for info in infos] for k in keys}
        reward_extra_info.update(extra_info)
        return RewardOutput(
            reward_tensor=place_scores(scores, inputs.response_mask),
            reward_extra_info=reward_extra_info,
            metrics={"reward/errors": float(errors), "reward/timeouts": float(timeouts)},
        )

    def _examine(self, inputs, responses, results, out: RewardOutput) -> None:
        if self.num_examine <= 0:
            return
        shown: dict[str, int] = {}
        rows = last_valid_index(inputs.response_mask)
        for i, result in enumerate(results):
            source = inputs.data_sources[i]
            if shown.get(source, 0) >= self.num_examine:
                continue
            shown[source] = shown.get(source, 0) + 1
            if inputs.prompts is not None:
                print("[prompt]", inputs.prompts[i])
            print("[response]", responses[i])
            print("[ground_truth]", inputs.ground_truths[i])
            if isinstance(result.value, Mapping):
                for key, value in result.value.items():
                    print(f"[{key}]", value)
            else:
                print("[score]", out.reward_tensor[i, rows[i]], result.error or "")


class NaiveRewardManager(RewardManager):
    """`naive`: `compute_score(data_source, solution_str, ground_truth, extra_info)` per row,
    in this process, with an optional SIGALRM timeout per row (verl's
    `compute_score_timeout`; it only works when called from the main thread)."""

    name = "naive"

    def __init__(self, *args: Any, compute_score_timeout: float | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.compute_score_timeout = compute_score_timeout

    def score_rows(self, inputs: RewardInputs, responses: list[str]) -> list[RowResult]:
        results = []
        for i, response in enumerate(responses):
            try:
                with alarm_timeout(self.compute_score_timeout):
                    result = call_scorer(
                        self.compute_score,
                        data_source=inputs.data_sources[i],
                        solution_str=response,
                        ground_truth=inputs.ground_truths[i],
                        extra_info=inputs.extra_info(i),
                    )
            except TimeoutError as e:  # the alarm fired between the call and the block's end
                result = RowResult(error=str(e), timed_out=True)
            results.append(result)
        return results


class DAPORewardManager(NaiveRewardManager):
    """`dapo`: `naive` plus DAPO's overlong penalty, added to the score of each row of length L:

        expected = max_resp_len - overlong_buffer.len
        overlong_reward = min(-(L - expected) / overlong_buffer.len * penalty_factor, 0)

    i.e. 0 up to `expected` tokens, falling linearly to `-penalty_factor` at `max_resp_len`.
    With `overlong_buffer.log`, extra info gets `overlong_reward` and `overlong` (penalised).
    A trailing `tokenizer.eos_token` is cut from the decoded response, as verl does.

    Args:
        overlong_buffer_cfg: Any object with `enable`, `len`, `penalty_factor`, `log`
            (verl's `reward_kwargs.overlong_buffer_cfg`), or a mapping with those keys.
        max_resp_len: The rollout's maximum response length (`data.max_response_length`).
    """

    name = "dapo"
    strip_eos = True

    def __init__(
        self,
        *args: Any,
        max_resp_len: int | None = None,
        overlong_buffer_cfg: Any = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        if isinstance(overlong_buffer_cfg, Mapping):
            overlong_buffer_cfg = OverlongBuffer(**overlong_buffer_cfg)
        self.overlong_buffer_cfg = overlong_buffer_cfg
        self.max_resp_len = max_resp_len
        cfg = overlong_buffer_cfg
        if cfg is not None and cfg.enable:
            if max_resp_len is None:
                raise ValueError(
                    "the overlong penalty needs max_resp_len (set it to data.max_response_length)"
                )
            if cfg.len <= 0:
                raise ValueError(
                    f"overlong_buffer.len must be positive, got {cfg.len}; to disable the "
                    "penalty set overlong_buffer.enable=false"
                )
            if max_resp_len < cfg.len:
                raise ValueError(
                    f"max_resp_len ({max_resp_len}) must be at least overlong_buffer.len "
                    f"({cfg.len})"
                )

    def extra_reward(self, inputs: RewardInputs) -> tuple[np.ndarray, dict[str, list[Any]]]:
        cfg = self.overlong_buffer_cfg
        if cfg is None or not cfg.enable:
            return super().extra_reward(inputs)
        exceed = inputs.response_lengths - (self.max_resp_len - cfg.len)
        # float32 throughout, as verl's torch arithmetic, so the sums agree bit for bit.
        f32 = np.float32
        penalty = np.minimum(-exceed.astype(f32) / f32(cfg.len) * f32(cfg.penalty_factor), f32(0))
        info = {}
        if cfg.log:
            info = {
                "overlong_reward": [float(p) for p in penalty],
                "overlong": [bool(p < 0) for p in penalty],
            }
        return penalty, info


@dataclass(frozen=True)
class OverlongBuffer:
    """DAPO's overlong penalty settings (verl's `overlong_buffer_cfg`)."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False


def _rowwise_batch_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    """The default batch scorer: `default_compute_score` row by row."""
    return [
        default_compute_score(d, s, g, e, **kwargs)
        for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos, strict=True)
    ]


class BatchRewardManager(RewardManager):
    """`batch`: one call for the whole batch,

        compute_score(data_sources=[B], solution_strs=[B], ground_truths=[B], extra_infos=[B],
                      **reward_kwargs) -> [B] floats or dicts

    If that call raises, every row scores `error_score` and counts as an error. Without a
    `compute_score`, the built-in scorers are applied row by row (verl requires a function).
    """

    name = "batch"

    def __init__(self, *args: Any, reward_kwargs: Mapping[str, Any] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if self.compute_score is default_compute_score:
            self.compute_score = _rowwise_batch_score
        self.reward_kwargs = dict(reward_kwargs or {})

    def score_rows(self, inputs: RewardInputs, responses: list[str]) -> list[RowResult]:
        batch = call_scorer(
            self.compute_score,
            data_sources=list(inputs.data_sources),
            solution_strs=responses,
            ground_truths=list(inputs.ground_truths),
            extra_infos=[inputs.extra_info(i) for i in range(len(inputs))],
            **self.reward_kwargs,
        )
        if batch.error is None and (
            not isinstance(batch.value, Sequence | np.ndarray) or len(batch.value) != len(inputs)
        ):
            n = len(batch.value) if isinstance(batch.value, Sequence | np.ndarray) else "no"
            batch = RowResult(error=f"batch compute_score returned {n} scores for {len(inputs)}")
        if batch.error is not None:
            return [batch] * len(inputs)
        return [RowResult(value=v) for v in batch.value]
