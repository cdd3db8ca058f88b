"""What the server generated for each episode, and the training sequences it makes.

    recorder = Recorder()
    recorder.open("episode-3")             # the api_key an external agent's client uses
    ... the agent's requests: the server records each choice it answers under the key ...
    calls = recorder.close("episode-3")    # [Call]: prompt ids, sampled tokens, log-probs
    sequences = episode_sequences(calls)   # [Conversation]: one when the calls chain

An external agent (any OpenAI client) sends each request with its whole message history, so
call k+1's prompt is the chat template over call k's messages, its reply and what came after
(tool results, the next user message). When that prompt begins with call k's prompt and
sampled tokens exactly (the template re-renders the reply as it was sampled, its tool calls
included), the calls chain into one sequence, as the internal agent loop builds it: call 1's
prompt, then each call's sampled tokens (trained on: `sampled` 1, their log-probs) and the
tokens between them (the template's rest: tool results, user turns; attended to, not trained
on). A call whose prompt does not continue the sequence so far (the agent edited or dropped
history, or the template renders the reply differently) starts a new sequence: one sample
per such call. A call continues the longest sequence its prompt begins with, so the choices
of an `n` > 1 request, or calls made concurrently, each grow their own.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from jaxrl.rollout.slots import Conversation


@dataclasses.dataclass(frozen=True)
class Call:
    """One choice the server answered for an episode.

    Attributes:
        prompt: The request's prompt ids (the chat template over its messages and tools).
        tokens: The sampled tokens, the end token included.
        log_probs: Their log-probs (the processed distribution).
        finish: "stop", "length" or "abort".
        versions: The weights version that sampled each token (None: unversioned).
    """

    prompt: list[int]
    tokens: list[int]
    log_probs: list[float]
    finish: str
    versions: list[int | None] | None = None


class Recorder:
    """Calls by episode key, for keys opened (thread-safe: the server records from its event
    loop, the trainer opens and closes)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls: dict[str, list[Call]] = {}

    def open(self, key: str) -> None:
        with self._lock:
            if key in self._calls:
                raise ValueError(f"episode {key!r} is open already")
            self._calls[key] = []

    def records(self, key: str | None) -> bool:
        """Whether requests with this key are recorded."""
        with self._lock:
            return key in self._calls

    def record(self, key: str, call: Call) -> None:
        with self._lock:
            if key in self._calls:
                self._calls[key].append(call)

    def close(self, key: str) -> list[Call]:
        """The episode's calls in the order they were answered; the key is no longer recorded."""
        with self._lock:
            return self._calls.pop(key)


def episode_sequences(calls: Sequence[Call]) -> list[Conversation]:
    """The training sequences of an episode's calls (module doc): one per chain."""
    sequences: list[Conversation] = []
    for call in calls:
        # the longest sequence so far that this call's prompt continues (choices of one
        # request, or concurrent calls, each grow a sequence of their own)
        continued = [s for s in sequences if _continues(call.prompt, s)]
        current = max(continued, key=lambda s: len(s.response), default=None)
        if current is None:
            current = Conversation(list(call.prompt))
            sequences.append(current)
        else:
            between = call.prompt[len(current.prompt) + len(current.response) :]
            current.response += between
            current.sampled += [0] * len(between)
            current.log_probs += [0.0] * len(between)
            current.versions += [None] * len(between)
        current.response += call.tokens
        current.sampled += [1] * len(call.tokens)
        current.log_probs += call.log_probs
        current.versions += call.versions or [None] * len(call.tokens)
    return sequences


def _continues(prompt: Sequence[int], sequence: Conversation) -> bool:
    so_far = sequence.prompt + sequence.response
    return len(prompt) >= len(so_far) and list(prompt[: len(so_far)]) == so_far
