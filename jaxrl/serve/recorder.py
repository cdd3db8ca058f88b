"""What the server generated for each episode, and the training sequences it makes.

    recorder = Recorder()
    recorder.open("episode-3")             # the api_key an external agent's client uses
    ... the agent's requests: the server records each choice it answers under the key ...
    calls = recorder.close("episode-3")    # [Call]: prompt ids, sampled tokens, log-probs
    sequences = episode_sequences(calls)   # [Conversation]: one when the calls chain

The trainer opens each episode with its sampling settings, key and token budgets
(`open(key, sampling=, rng=, response_length=, max_prompt_length=)`); the server then asks
`turn(key, ids, copies)` how to run each of the episode's requests (`Turn.sampling`):

    sampling   the trainer's temperature, top_k, top_p, do_sample and end tokens (the
               distribution the trainer's log-probs assume), whatever the request asked;
               its `stop` strings added to the trainer's; `max_tokens` at most the
               response tokens the episode has left: `response_length` less the tokens
               after the root its prompt continues (a root: the prompt of a request that
               continued no earlier one, e.g. the first; the longest such prefix)
    keys       its copy j samples with `fold_in(rng, c + j)`, c the copies the episode's
               earlier requests took: an agent calling once per turn samples turn t with
               `fold_in(rng, t)`, as the internal agent loop samples row i's turn t (a
               request that fails after its turn was given, e.g. retried after a 429 or a
               timeout, has used its number)
    exhausted  no response tokens left: the server answers an empty choice, finish reason
               "length", without the engine (the internal loop ends such a trajectory)

A root longer than `max_prompt_length` is refused (400): a root is a training row's prompt,
and the internal loop refuses such a row too.

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

import jax

from jaxrl.rollout.sampling import SamplingParams
from jaxrl.rollout.slots import Conversation
from jaxrl.serve.protocol import ApiError


@dataclasses.dataclass(frozen=True)
class Call:
    """One choice the server answered for an episode.

    Attributes:
        prompt: The request's prompt ids (the chat template over its messages and tools).
        tokens: The sampled tokens, the end token included.
        log_probs: Their log-probs (the processed distribution).
        finish: "stop", "length" or "abort".
        versions: The weights version that sampled each token (None: unversioned).
        tool_calls: The tool calls the server read in it (`tool_calls` of its message).
    """

    prompt: list[int]
    tokens: list[int]
    log_probs: list[float]
    finish: str
    versions: list[int | None] | None = None
    tool_calls: int = 0


@dataclasses.dataclass(frozen=True)
class Turn:
    """How the server runs one request of an episode (`Recorder.turn`; the default: as the
    client asked).

    Attributes:
        own: The episode's sampling settings (None: the client's).
        key: Its copies' key (None: the server's own keys).
        first_copy: Copy j samples with `fold_in(key, first_copy + j)`.
        left: Response tokens the episode has left (None: no bound).
        exhausted: None left: answer an empty "length" choice.
    """

    own: SamplingParams | None = None
    key: jax.Array | None = None
    first_copy: int = 0
    left: int | None = None
    exhausted: bool = False

    def sampling(self, asked: SamplingParams) -> SamplingParams:
        """The client's settings as the episode runs them (module doc)."""
        own = self.own
        if own is not None:
            asked = dataclasses.replace(
                asked, temperature=own.temperature, top_k=own.top_k, top_p=own.top_p,
                do_sample=own.do_sample, ignore_eos=own.ignore_eos,
                eos_token_ids=own.eos_token_ids, stop_token_ids=own.stop_token_ids,
                stop=tuple(dict.fromkeys(own.stop + asked.stop)), seed=None,
            )  # fmt: skip
        if self.left is not None and asked.max_tokens > self.left:
            asked = dataclasses.replace(asked, max_tokens=self.left)
        return asked


@dataclasses.dataclass
class _Episode:
    calls: list[Call]
    sampling: SamplingParams | None
    rng: jax.Array | None
    response_length: int | None
    max_prompt_length: int | None
    copies: int = 0  # sampling keys its requests took
    roots: list[list[int]] = dataclasses.field(default_factory=list)


class Recorder:
    """Calls by episode key, for keys opened (thread-safe: the server records from its event
    loop, the trainer opens and closes).

    Args:
        exclusive: Refuse requests whose key is no open episode's (401): a trainer's server
            serves its episodes only.
    """

    def __init__(self, exclusive: bool = False):
        self.exclusive = exclusive
        self._lock = threading.Lock()
        self._episodes: dict[str, _Episode] = {}

    def open(
        self,
        key: str,
        *,
        sampling: SamplingParams | None = None,
        rng: jax.Array | None = None,
        response_length: int | None = None,
        max_prompt_length: int | None = None,
    ) -> None:
        """Record requests with `key` from now on, run as the module doc says."""
        with self._lock:
            if key in self._episodes:
                raise ValueError(f"episode {key!r} is open already")
            self._episodes[key] = _Episode([], sampling, rng, response_length, max_prompt_length)

    def records(self, key: str | None) -> bool:
        """Whether requests with this key are recorded."""
        with self._lock:
            return key in self._episodes

    def turn(self, key: str | None, ids: Sequence[int], copies: int) -> Turn:
        """How to run a request of `copies` copies with prompt `ids` under `key` (module
        doc; not an open episode's: as the client asked). Raises `ApiError` for a root past
        the episode's `max_prompt_length`."""
        with self._lock:
            episode = self._episodes.get(key) if key is not None else None
            if episode is None:
                return Turn()
            ids = list(ids)
            continued = [r for r in episode.roots if ids[: len(r)] == r]
            root = max(continued, key=len, default=None)
            if root is None:
                limit = episode.max_prompt_length
                if limit is not None and len(ids) > limit:
                    raise ApiError(
                        400,
                        f"the episode's prompt is {len(ids)} tokens, more than the trainer's "
                        f"data.max_prompt_length={limit} (a request that continues no "
                        "earlier one starts a training row): shorten the messages or the "
                        "tools, or raise it",
                        param="messages",
                    )
                root = ids
                episode.roots.append(ids)
            left = None
            if episode.response_length is not None:
                left = episode.response_length - (len(ids) - len(root))
                if left <= 0:
                    return Turn(episode.sampling, exhausted=True)
            turn = Turn(episode.sampling, episode.rng, episode.copies, left)
            episode.copies += copies
            return turn

    def record(self, key: str, call: Call) -> None:
        with self._lock:
            if key in self._episodes:
                self._episodes[key].calls.append(call)

    def close(self, key: str) -> list[Call]:
        """The episode's calls in the order they were answered; the key is no longer recorded."""
        with self._lock:
            return self._episodes.pop(key).calls


def episode_sequences(calls: Sequence[Call]) -> list[Conversation]:
    """The training sequences of an episode's calls (module doc): one per chain."""
    return [sequence for sequence, _ in episode_chains(calls)]


def episode_chains(calls: Sequence[Call]) -> list[tuple[Conversation, list[int]]]:
    """Each training sequence of an episode's calls with the indices of the calls it holds
    (module doc)."""
    chains: list[tuple[Conversation, list[int]]] = []
    for i, call in enumerate(calls):
        # the longest sequence so far that this call's prompt continues (choices of one
        # request, or concurrent calls, each grow a sequence of their own)
        continued = [c for c in chains if _continues(call.prompt, c[0])]
        chain = max(continued, key=lambda c: len(c[0].response), default=None)
        if chain is None:
            chain = (Conversation(list(call.prompt)), [])
            chains.append(chain)
        current, members = chain
        between = call.prompt[len(current.prompt) + len(current.response) :]
        current.response += between
        current.sampled += [0] * len(between)
        current.log_probs += [0.0] * len(between)
        current.versions += [None] * len(between)
        current.response += call.tokens
        current.sampled += [1] * len(call.tokens)
        current.log_probs += call.log_probs
        current.versions += call.versions or [None] * len(call.tokens)
        members.append(i)
    return chains


def _continues(prompt: Sequence[int], sequence: Conversation) -> bool:
    so_far = sequence.prompt + sequence.response
    return len(prompt) >= len(so_far) and list(prompt[: len(so_far)]) == so_far
