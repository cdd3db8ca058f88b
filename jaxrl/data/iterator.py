"""`PromptIterator`: shuffled, resumable, per-process batches of an `RLDataset`.

Epoch e visits the rows in the order `permutation(seed, e)` (the identity without shuffle). The
global batch k of an epoch is the slice `[k*B, (k+1)*B)` of that order; process p of P takes
the contiguous slice `[p*B/P, (p+1)*B/P)` of it, so the P processes together cover each global
batch exactly once and a process only tokenizes its own rows. The order depends on nothing but
`(seed, epoch)`, so the iterator state is three integers:

    {"epoch": e, "position": k, "seed": s}     (+ "num_rows", checked on load)

`state_dict()` after a batch, saved with a checkpoint and given to `load_state_dict`, makes the
next batches exactly those an uninterrupted run would have seen. With `drop_last=True` (training,
as verl) the last `N mod B` rows of each epoch's order are not used that epoch; with
`drop_last=False` (validation) the last short batch is filled up to a multiple of P with copies
of its last row, flagged in `PromptBatch.is_padding`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxrl.data.batch import PromptBatch
from jaxrl.data.dataset import RLDataset
from jaxrl.data.rows import DataError


def _process_info(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    return process_index, process_count


class PromptIterator:
    """Endless iterator of this process's `PromptBatch` slices, epoch after epoch.

    Args:
        dataset: The rows.
        batch_size: B, prompts per global batch (`data.train_batch_size`), before
            `rollout.n` repetition; a multiple of the process count.
        shuffle: Shuffle the row order each epoch (`data.shuffle`).
        seed: Seed of the shuffle (`data.seed`; null means 1).
        drop_last: Skip the short last batch of an epoch (training) or pad it (validation).
        process_index: This process's index; default `jax.process_index()`.
        process_count: Number of processes; default `jax.process_count()`.
    """

    def __init__(
        self,
        dataset: RLDataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int | None = 1,
        drop_last: bool = True,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = shuffle
        self.seed = 1 if seed is None else int(seed)
        self.drop_last = drop_last
        self.process_index, self.process_count = _process_info(process_index, process_count)
        if self.batch_size < 1 or self.batch_size % self.process_count:
            raise ValueError(
                f"batch size {self.batch_size} must be a positive multiple of the "
                f"{self.process_count} JAX processes (each takes an equal slice)"
            )
        if drop_last and self.batch_size > len(dataset):
            raise DataError(
                f"batch size {self.batch_size} is larger than the dataset ({len(dataset)} rows "
                "after filtering); lower data.train_batch_size (data.gen_batch_size with "
                "dynamic sampling) or add rows"
            )
        self.epoch = 0
        self.position = 0

    @classmethod
    def for_validation(
        cls,
        dataset: RLDataset,
        batch_size: int | None = None,
        *,
        shuffle: bool = False,
        seed: int | None = 1,
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> PromptIterator:
        """verl's validation loader: every row once per pass (`drop_last=False`), in batches of
        `data.val_batch_size` (None: the whole set), rounded up to a multiple of the processes."""
        index, count = _process_info(process_index, process_count)
        size = batch_size or len(dataset)
        size = -(-size // count) * count
        return cls(dataset, size, shuffle=shuffle, seed=seed, drop_last=False,
                   process_index=index, process_count=count)  # fmt: skip

    # ------------------------------------------------------------------------------ order

    @property
    def batches_per_epoch(self) -> int:
        """Global batches in one epoch (verl's `len(train_dataloader)`)."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """int64 [N], the row order of `epoch`: a permutation from `(seed, epoch)` or arange."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(n).astype(np.int64)

    def global_rows(self, epoch: int, position: int) -> np.ndarray:
        """Dataset rows of global batch `position` of `epoch` (shorter for a last batch)."""
        start = position * self.batch_size
        return self.order(epoch)[start : start + self.batch_size]

    def local_slice(self, num_rows: int) -> slice:
        """This process's part of a global batch of `num_rows` (a multiple of P)."""
        per_process = num_rows // self.process_count
        return slice(self.process_index * per_process, (self.process_index + 1) * per_process)

    # -------------------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[PromptBatch]:
        return self

    def __next__(self) -> PromptBatch:
        self.epoch, self.position = self._next_place()
        batch = self._make(self.epoch, self.position)
        self.position += 1
        return batch

    def peek(self) -> PromptBatch:
        """The batch `next` returns, without moving (`state_dict` stays where it is): what a
        trainer that generates one batch ahead (`async_training.mode=one_step_off`) takes
        before the loop asks for it."""
        return self._make(*self._next_place())

    def global_view(self) -> PromptIterator:
        """A copy at the same place that yields whole global batches (as process 0 of 1): a
        reader of every process's rows (`async_training.mode=fully_async`'s prompt feed)."""
        view = PromptIterator(self.dataset, self.batch_size, shuffle=self.shuffle,
                              seed=self.seed, drop_last=self.drop_last, process_index=0,
                              process_count=1)  # fmt: skip
        view.load_state_dict(self.state_dict())
        return view

    def _next_place(self) -> tuple[int, int]:
        """(epoch, position) of the next batch."""
        if self.position >= self.batches_per_epoch:
            return self.epoch + 1, 0
        return self.epoch, self.position

    def one_epoch(self) -> Iterator[PromptBatch]:
        """The remaining batches of the current epoch (validation: a fresh iterator's pass)."""
        while self.position < self.batches_per_epoch:
            yield next(self)

    def _make(self, epoch: int, position: int) -> PromptBatch:
        rows = self.global_rows(epoch, position)
        padding = np.zeros(len(rows), bool)
        short = -len(rows) % self.process_count
        if short:  # only a last batch with drop_last=False
            rows = np.concatenate([rows, np.full(short, rows[-1])])
            padding = np.concatenate([padding, np.ones(short, bool)])
        local = self.local_slice(len(rows))
        return self.dataset.batch(
            rows[local],
            group_offset=local.start,
            uid_prefix=f"{epoch}-{position}-",
            is_padding=padding[local],
        )

    # ------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The JSON-able position: `{"epoch", "position", "seed", "num_rows"}`."""
        return dict(
            epoch=self.epoch, position=self.position, seed=self.seed, num_rows=len(self.dataset)
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`; the seed and the row count must match this dataset."""
        rows = state.get("num_rows", len(self.dataset))
        if rows != len(self.dataset) or state["seed"] != self.seed:
            raise ValueError(
                f"the checkpoint's data state (seed {state['seed']}, {rows} rows) does not match "
                f"this run (seed {self.seed}, {len(self.dataset)} rows); resume with the same "
                "data files, filters and data.seed"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
