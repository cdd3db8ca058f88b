"""Tool calls run on the host while the policy decodes: one asyncio loop on a thread.

    runner = ToolRunner(tools, timeout=30.0, workers=8)
    future = runner.submit(call, create_kwargs={})     # a concurrent.futures.Future
    ...                                                # the decoder goes on
    result = future.result()                           # ToolResult: text, reward, metrics
    runner.close()

Each call runs its tool's `create`, `execute` and `release` (verl 0.9's per-call lifecycle) as
one task on the runner's event loop, so calls of many trajectories run concurrently. A tool
whose methods are coroutines (verl's) runs on the loop; one with plain methods runs its
`create` + `execute` on a daemon thread of its own, at most `workers` at once (a call waits for
a free worker before its clock starts). `create` and `execute` together have `timeout`
seconds; past it the call's answer says it timed out and the trajectory goes on (a coroutine
is cancelled; a plain function's thread cannot be stopped: it finishes in the background, its
result dropped, and holds its worker until then, so tools that hang eat the workers). A call
that cannot run (the parser's error, an unknown tool, a missing required argument, an
exception in the tool) answers with the problem instead; `ToolResult.error` names its kind for
the metrics. An unknown tool's and a failing tool's answers are verl 0.9.1's texts
(`Unknown function 'NAME'. Available tools: [...]`, `Error executing tool 'NAME': MESSAGE`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import inspect
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.agent.parser import ToolCall, argument_problems
from jaxrl.agent.tools.base import ToolResponse, schema_dict

log = logging.getLogger("jaxrl.agent")

ERRORS = ("malformed", "unknown_tool", "bad_arguments", "timeout", "exception")


@dataclasses.dataclass
class ToolResult:
    """One call's outcome.

    Attributes:
        name: The tool called ("" when the call could not be read).
        text: The answer the policy reads.
        reward: The tool's step reward.
        metrics: The tool's own metrics.
        error: None, or one of `ERRORS`.
        seconds: Wall time of the call.
    """

    name: str
    text: str
    reward: float = 0.0
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0


class ToolRunner:
    """Runs tool calls on a background event loop (see the module doc).

    Args:
        tools: The run's tools by name.
        timeout: Seconds a call's `create` + `execute` may take.
        workers: Threads for tools whose methods are plain functions.
    """

    def __init__(self, tools: Mapping[str, Any], *, timeout: float = 30.0, workers: int = 8):
        if timeout <= 0 or workers < 1:
            raise ValueError(f"tool timeout={timeout} and workers={workers} must be positive")
        self.tools, self.timeout = dict(tools), timeout
        self.schemas = {name: schema_dict(tool.tool_schema) for name, tool in self.tools.items()}
        self._loop = asyncio.new_event_loop()
        self._workers = asyncio.Semaphore(workers)  # bound to the loop on first use
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="jaxrl-tools", daemon=True
        )
        self._thread.start()

    def submit(
        self,
        call: ToolCall,
        create_kwargs: Mapping[str, Any] | None = None,
        allowed: Sequence[str] | None = None,
    ) -> concurrent.futures.Future[ToolResult]:
        """Start `call` (with the row's `create_kwargs` for its tool; `allowed`: the tools the
        row may use, None: all); returns at once."""
        if not self._loop.is_running():
            raise RuntimeError("ToolRunner.submit after close()")
        tools = self.tools if allowed is None else {n: self.tools[n] for n in allowed
                                                    if n in self.tools}  # fmt: skip
        coroutine = self._run(call, dict(create_kwargs or {}), tools)
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def close(self) -> None:
        """Cancel the calls still running (waiting up to a second for them to unwind: a plain
        function's thread is abandoned, a daemon), then stop the loop."""
        if self._loop.is_running():
            ended = asyncio.run_coroutine_threadsafe(_cancel_tasks(1.0), self._loop)
            with contextlib.suppress(concurrent.futures.TimeoutError):
                ended.result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def _run(
        self, call: ToolCall, create_kwargs: dict[str, Any], tools: Mapping[str, Any]
    ) -> ToolResult:
        start = time.perf_counter()
        result = await self._checked(call, create_kwargs, tools)
        result.seconds = time.perf_counter() - start
        return result

    async def _checked(
        self, call: ToolCall, create_kwargs: dict[str, Any], tools: Mapping[str, Any]
    ) -> ToolResult:
        if call.error:
            return ToolResult(call.name, f"Error: {call.error}", error="malformed")
        tool = tools.get(call.name)
        if tool is None:  # verl's answer, word for word
            text = f"Unknown function '{call.name}'. Available tools: {list(tools)}"
            return ToolResult(call.name, text, error="unknown_tool")
        problems = argument_problems(call.arguments, self.schemas[call.name])
        if problems:
            text = f"Error: bad arguments for {call.name}: {'; '.join(problems)}"
            return ToolResult(call.name, text, error="bad_arguments")
        instance: list[str] = []
        try:
            response, reward, metrics = await self._timed(
                tool, call.arguments, create_kwargs, instance
            )
        except TimeoutError:
            text = f"Error: {call.name} timed out after {self.timeout:g} s"
            return ToolResult(call.name, text, error="timeout")
        except Exception as e:  # verl's answer, word for word
            text = f"Error executing tool '{call.name}': {e}"
            return ToolResult(call.name, text, error="exception")
        finally:
            if instance:
                await _release(tool, instance[0])
        text = response.text if isinstance(response, ToolResponse) else response
        text = getattr(text, "text", text)  # verl's pydantic ToolResponse
        return ToolResult(call.name, "" if text is None else str(text), float(reward or 0.0),
                          dict(metrics or {}))  # fmt: skip

    async def _timed(
        self, tool: Any, arguments: dict[str, Any], create_kwargs: dict[str, Any], instance: list
    ) -> tuple[Any, float, dict]:
        """`create` then `execute`, within the timeout (see the module doc)."""
        if _is_async(tool.create) and _is_async(tool.execute):

            async def lifecycle():
                instance_id, _ = await tool.create(create_kwargs=create_kwargs)
                instance.append(instance_id)
                return await tool.execute(instance_id, arguments)

            return await asyncio.wait_for(lifecycle(), self.timeout)
        await self._workers.acquire()  # a free worker, before the clock starts

        def lifecycle_in_thread():
            instance_id, _ = _sync(tool.create, create_kwargs=create_kwargs)
            instance.append(instance_id)
            return _sync(tool.execute, instance_id, arguments)

        done = _in_daemon_thread(lifecycle_in_thread, on_exit=self._workers.release)
        return await asyncio.wait_for(asyncio.shield(done), self.timeout)


async def _cancel_tasks(seconds: float) -> None:
    """Cancel every other task of the running loop and give them `seconds` to end (a task
    left pending when the loop closes is reported as destroyed when it is collected)."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=seconds)


def _is_async(method: Any) -> bool:
    return inspect.iscoroutinefunction(method)


def _sync(method: Any, *args, **kwargs) -> Any:
    """Call `method` on this (worker) thread, running it to completion if it is async."""
    result = method(*args, **kwargs)
    return asyncio.run(result) if inspect.isawaitable(result) else result


def _in_daemon_thread(fn: Any, on_exit: Any = None) -> asyncio.Future:
    """An asyncio future of `fn()` run on a new daemon thread (`on_exit` runs on the loop when
    the thread ends, even after the future was given up)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)
        if on_exit is not None:
            on_exit()

    def work() -> None:
        try:
            outcome = (fn(), None)
        except BaseException as e:  # handed to the awaiting task
            outcome = (None, e)
        with contextlib.suppress(RuntimeError):  # the runner was closed meanwhile
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=work, name="jaxrl-tool", daemon=True).start()
    return future


async def _call(method: Any, *args, **kwargs) -> Any:
    """Await a coroutine method; run a plain one on a daemon thread."""
    if _is_async(method):
        return await method(*args, **kwargs)
    return await _in_daemon_thread(lambda: _sync(method, *args, **kwargs))


async def _release(tool: Any, instance_id: str) -> None:
    try:
        await asyncio.wait_for(_call(tool.release, instance_id), 10.0)
    except Exception as e:  # the call's answer stands; the leak is logged
        log.warning(
            "tool %s: release(%s) failed: %s: %s", tool.name, instance_id, type(e).__name__, e
        )
