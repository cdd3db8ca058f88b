"""Single prompts for `async_training.mode=fully_async`'s rollouter, from the train loader, with
a record of every prompt drawn and not yet trained, so that a checkpoint loses none and a
resumed run trains each once.

    feed = PromptFeed(loader)     # the loader's own (a global view: every process's rows)
    prompt = feed.next()          # the next prompt (those to generate again first); thread-safe
    feed.requeue(prompt)          # dropped before training (too stale): generated again
    feed.trained([p, ...])        # trained: done
    feed.state_dict()             # {"pending": rows drawn, not trained; "draws": n; "loader": ...}
    feed.load_state_dict(state)   # a resumed run: the pending rows come first

The loader's own saved position (the checkpoint's `data`) is past every batch the feed has
drawn, so the rows of those batches not trained yet are the `pending` list, in the order they
would have been generated.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jaxrl.data.batch import PromptBatch


@dataclasses.dataclass(frozen=True)
class FedPrompt:
    """One prompt of the feed.

    Attributes:
        row: Its dataset row.
        draw: Its draw's number (unique in the run: the group's sampling key).
        input_ids: int [P], left-padded to the dataset's prompt width.
        attention_mask: int [P].
    """

    row: int
    draw: int
    input_ids: np.ndarray
    attention_mask: np.ndarray


class PromptFeed:
    """The rollouter's prompts (module doc).

    Args:
        loader: The train loader (a `PromptIterator`: its `dataset` rebuilds pending rows).
    """

    def __init__(self, loader: Iterator[PromptBatch]):
        self.loader, self.dataset = loader, loader.dataset
        self._lock = threading.Lock()
        self._supply: collections.deque[tuple[int, np.ndarray, np.ndarray]] = collections.deque()
        self._again: collections.deque[FedPrompt] = collections.deque()
        self._out: dict[int, FedPrompt] = {}  # drawn, not trained, by draw number
        self.draws = 0

    def next(self) -> FedPrompt:
        """The next prompt to generate: one dropped before training first, else the supply's
        next (reading the loader's next batch when it is empty)."""
        with self._lock:
            if self._again:
                prompt = self._again.popleft()
            else:
                if not self._supply:
                    self._extend(next(self.loader))
                row, ids, mask = self._supply.popleft()
                prompt = FedPrompt(row, self.draws, ids, mask)
                self.draws += 1
            self._out[prompt.draw] = prompt
            return prompt

    def requeue(self, prompt: FedPrompt) -> None:
        """A drawn prompt that will not be trained as generated: generated again, first (a
        new draw, so a new sampling key)."""
        with self._lock:
            self._out.pop(prompt.draw, None)
            again = FedPrompt(prompt.row, self.draws, prompt.input_ids, prompt.attention_mask)
            self.draws += 1
            self._again.append(again)

    def trained(self, prompts: Sequence[FedPrompt]) -> None:
        with self._lock:
            for prompt in prompts:
                self._out.pop(prompt.draw)

    def state_dict(self) -> dict[str, Any]:
        """{"pending": the dataset rows drawn and not trained (in flight, queued, to generate
        again) then the supply's, in generation order; "draws": the draw counter; "loader":
        the loader's state}, taken together (the rollouter draws meanwhile)."""
        with self._lock:
            out = sorted(self._out.values(), key=lambda p: p.draw)
            rows = [p.row for p in out] + [p.row for p in self._again]
            rows += [row for row, _, _ in self._supply]
            return {"pending": rows, "draws": self.draws, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed run's feed: `pending` rows are the supply, before any loader batch (the
        loader's state is the checkpoint's `data`)."""
        with self._lock:
            self._supply.clear()
            self._again.clear()
            self._out.clear()
            self.draws = int(state["draws"])
            if state["pending"]:
                self._extend(self.dataset.batch([int(r) for r in state["pending"]]))

    def _extend(self, batch: PromptBatch) -> None:
        rows = zip(batch.row_ids, batch.input_ids, batch.attention_mask, strict=True)
        self._supply.extend((int(r), ids, mask) for r, ids, mask in rows)
