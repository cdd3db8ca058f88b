"""`CodeInterpreter`: the policy writes Python in a tool call; the sandbox runs it.

    tool = CodeInterpreter(config={"type": "native", "timeout": 10, "memory_limit_mb": 1024})
    instance_id, _ = await tool.create()
    response, reward, metrics = await tool.execute(instance_id, {"code": "print(2 + 3)"})
    response.text        # "5"

Each call is a fresh program in `jaxrl.agent.sandbox.run_python` (its own temporary directory,
no network, time, CPU, memory and output limits; see docs/sandbox.md): nothing persists
between calls, as with verl's sandbox-fusion code tool. The response is the program's stdout,
then its stderr under a `[stderr]` line, then one bracketed line per event the policy should
know about: a limit that stopped it, an access the sandbox denied, truncated output, a
non-zero exit code.

Config options (the tool YAML's `config`): `timeout` (wall-clock seconds, 10), `cpu_time` (CPU
seconds, 10), `memory_limit_mb` (1024), `max_output_length` (bytes kept per stream, 4096),
`max_processes` (64); the isolation it requires: `required_isolation` (layer names, default
`jaxrl.agent.sandbox.REQUIRED`: the unprivileged identity, the file-system view, the network,
PID and IPC namespaces, the syscall filter), `allow_weaker_isolation` (false: the tool refuses
to start where a required layer is missing, naming it and the kernel setting it needs; true: it
runs with a warning per run), `sandbox_uid`/`sandbox_gid` (the host ids the program runs as
when the trainer is root, default `SANDBOX_HOST_ID`). A config written for verl's
`SandboxFusionTool` (which the registry maps here) works as it is: its `default_timeout` is the
timeout, and its options for the remote service (`sandbox_fusion_url`, `num_workers`, rate
limits) are ignored.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from jaxrl.agent.sandbox import (
    REQUIRED,
    SANDBOX_HOST_ID,
    SandboxResult,
    SandboxUnavailable,
    check,
    run_python,
)
from jaxrl.agent.sandbox.layers import validate
from jaxrl.agent.tools.base import BaseTool, ToolResponse

log = logging.getLogger("jaxrl.agent")

DEFAULTS = {
    "timeout": 10.0,
    "cpu_time": 10.0,
    "memory_limit_mb": 1024,
    "max_output_length": 4096,
    "max_processes": 64,
}


class CodeInterpreter(BaseTool):
    """Runs the `code` parameter as a Python program in the sandbox and returns its output.

    Args:
        config: The tool's `config` mapping (`DEFAULTS` lists its options).
        tool_schema: Its OpenAI function schema; None: `default_schema()` (name
            `code_interpreter`, one required string parameter `code`).
    """

    def __init__(self, config: dict[str, Any] | None, tool_schema: Any = None):
        super().__init__(config, tool_schema)
        options = {**DEFAULTS, **{k: v for k, v in self.config.items() if k in DEFAULTS}}
        if "timeout" not in self.config and "default_timeout" in self.config:
            options["timeout"] = self.config["default_timeout"]  # verl's SandboxFusionTool
        for name, value in options.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{type(self).__name__}: {name} must be > 0, got {value!r}")
        self.timeout = float(options["timeout"])
        self.cpu_time = float(options["cpu_time"])
        self.memory_limit_mb = int(options["memory_limit_mb"])
        self.max_output_length = int(options["max_output_length"])
        self.max_processes = int(options["max_processes"])
        self.isolation_options = _isolation_options(self.config)
        try:
            check(self.isolation_options["require"])  # refuse before any code arrives
        except SandboxUnavailable as exc:
            if not self.isolation_options["allow_weaker_isolation"]:
                raise
            log.warning(
                "code_interpreter: allow_weaker_isolation: running untrusted code without "
                "%s (docs/sandbox.md)", ", ".join(exc.missing),
            )  # fmt: skip

    def default_schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": "code_interpreter",
                "description": (
                    "Run a Python program and return what it prints (stdout and stderr). "
                    "Each call starts fresh (no state is kept between calls) in an empty "
                    "directory, without network access, with limits on time and memory; "
                    "print the results you need."
                ),
                "parameters": {
                    "type": "object",
                    "properties": {
                        "code": {"type": "string", "description": "The Python program to run."}
                    },
                    "required": ["code"],
                },
            },
        }

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[ToolResponse, float, dict]:
        """Run `parameters["code"]` off the event loop (the sandbox blocks a thread).

        Bad parameters, and a sandbox that cannot start, give an error text, not an exception.
        """
        code = parameters.get("code") if isinstance(parameters, dict) else None
        if not isinstance(code, str):
            got = "no `code`" if code is None else f"`code` of type {type(code).__name__}"
            text = f"Error: the parameters must give `code`, a string of Python source; got {got}."
            return ToolResponse(text=text), 0.0, {"bad_parameters": True}
        try:
            result = await asyncio.to_thread(
                run_python,
                code,
                timeout_s=self.timeout,
                cpu_s=self.cpu_time,
                memory_mb=self.memory_limit_mb,
                max_output_bytes=self.max_output_length,
                max_processes=self.max_processes,
                **self.isolation_options,
            )
        except SandboxUnavailable as exc:  # a layer vanished since start-up: fail closed
            log.error("code_interpreter: %s", exc)
            return ToolResponse(text=f"Error: the sandbox refused to run the code: {exc}"), 0.0, {}
        except OSError as exc:  # the sandbox could not start (no interpreter, no temp dir)
            log.warning("code_interpreter: the sandbox failed to start: %r", exc)
            return ToolResponse(text=f"Error: the sandbox failed to start: {exc}"), 0.0, {}
        except Exception as exc:  # a fault of the sandbox's own: this call fails, not training
            log.exception("code_interpreter: the sandbox failed")
            return ToolResponse(text=f"Error: the sandbox failed: {exc!r}"), 0.0, {}
        return ToolResponse(text=self.render(result)), 0.0, _metrics(result)

    def render(self, result: SandboxResult) -> str:
        """The response text: stdout, `[stderr]` and stderr, then the notes in brackets."""
        parts = []
        if result.stdout.strip():
            parts.append(result.stdout.rstrip("\n"))
        if result.stderr.strip():
            parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
        parts += [f"[{note}]" for note in self.notes(result)]
        return "\n".join(parts) if parts else "[no output]"

    def notes(self, result: SandboxResult) -> list[str]:
        """What stopped or limited the run, in words the policy can act on."""
        notes = []
        reason = result.killed_reason
        if reason == "timeout":
            notes.append(
                f"Stopped: the program exceeded the time limit of {self.timeout:g} s and "
                "was killed."
            )
        elif reason == "cpu_time":
            notes.append(
                f"Stopped: the program exceeded the CPU time limit of {self.cpu_time:g} s "
                "and was killed."
            )
        elif reason == "memory":
            notes.append(
                f"Stopped: the program exceeded the memory limit of {self.memory_limit_mb} MB "
                "(MemoryError)."
            )
        elif reason == "processes":
            notes.append(
                "Stopped: the program reached the limit on processes (a fork or a new thread "
                "failed)."
            )
        elif reason == "permission":
            notes.append(
                "Permission denied: the sandbox allows writing only in the current directory, "
                "reading only the Python installation and system libraries, and no network."
            )
        elif reason == "signal":
            notes.append(f"Stopped: the program was killed by {_signal_name(result.signal)}.")
        if result.truncated:
            notes.append(
                f"Output truncated: more than {self.max_output_length} bytes on a stream; "
                "the middle was left out."
            )
        if result.error:
            notes.append(f"Sandbox error: {result.error}")
        elif result.exit_code not in (0, None) and reason is None:
            notes.append(f"Exit code: {result.exit_code}")
        return notes


def _isolation_options(config: dict[str, Any]) -> dict[str, Any]:
    """The run_python keywords for the isolation the config asks for (validated)."""
    required = config.get("required_isolation", REQUIRED)
    if isinstance(required, str) or not all(isinstance(name, str) for name in required):
        raise ValueError(
            f"CodeInterpreter: required_isolation must be a list of layer names, got {required!r}"
        )
    required = validate(required)  # unknown names: ValueError listing the layers
    allow = config.get("allow_weaker_isolation", False)
    if not isinstance(allow, bool):
        raise ValueError(
            f"CodeInterpreter: allow_weaker_isolation must be true or false, got {allow!r}"
        )
    ids = {key: config.get(key, SANDBOX_HOST_ID) for key in ("sandbox_uid", "sandbox_gid")}
    for key, value in ids.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"CodeInterpreter: {key} must be an unprivileged id (> 0), got {value!r}"
            )
    return {"require": required, "allow_weaker_isolation": allow, **ids}


def _signal_name(number: int | None) -> str:
    try:
        return signal.Signals(number).name
    except (TypeError, ValueError):
        return f"signal {number}"


def _metrics(result: SandboxResult) -> dict[str, Any]:
    return {
        "exit_code": result.exit_code,
        "timed_out": result.timed_out,
        "killed_reason": result.killed_reason,
        "truncated": result.truncated,
        "wall_time_s": result.wall_s,
    }
