"""The code sandbox (`jaxrl.agent.sandbox`) and the `code_interpreter` tool.

Normal programs and their output; runaway programs (an infinite loop, a fork bomb, a 10 GB
allocation, the host's network) are stopped or denied and reported, and leave no process
behind; the tool's text. The attacks, judged from the host side and run as root and as an
ordinary user, are in test_sandbox_redteam.py. Limits are small so the file runs in seconds.
"""

import asyncio
import os
import pathlib
import socket
import time
import uuid

import pytest
from _procs import assert_session_empty

from jaxrl.agent.sandbox import LAYERS, SandboxResult, isolation, run_python
from jaxrl.agent.tools.code import CodeInterpreter

LIMITS = {"timeout_s": 5, "cpu_s": 2, "memory_mb": 512, "max_output_bytes": 4096}
pytestmark = pytest.mark.sandbox


def assert_nothing_left(result: SandboxResult) -> None:
    """No process of the run's session survives it."""
    assert_session_empty(result.pid)


# ------------------------------------------------------------------------------ normal code


def test_prints_output():
    result = run_python("print(2 + 3)", **LIMITS)
    assert result.stdout == "5\n"
    assert (result.exit_code, result.killed_reason, result.truncated) == (0, None, False)
    assert result.stderr == "" and result.error is None


def test_threads_processes_and_numpy_work():
    # What the syscall filter and the view must leave working: threads (clone3 -> clone),
    # a multiprocessing pool (semaphores in /dev/shm), a child process, numpy.
    code = (
        "import concurrent.futures as cf, multiprocessing as mp, subprocess\n"
        "with cf.ThreadPoolExecutor(4) as ex:\n    print(sum(ex.map(lambda x: x * x, range(10))))\n"
        "with mp.Pool(2) as pool:\n    print(pool.map(abs, [-1, -2]))\n"
        "print(subprocess.run(['echo', 'hi'], capture_output=True, text=True).stdout.strip())\n"
        "import numpy as np\nprint(np.linalg.inv(2 * np.eye(3)).sum())\n"
    )
    result = run_python(code, **{**LIMITS, "timeout_s": 30, "memory_mb": 1024})
    assert result.stdout == "285\n[1, 2]\nhi\n1.5\n", result
    assert result.exit_code == 0 and result.error is None


def test_exception_traceback_is_returned():
    result = run_python("def f():\n    raise ValueError('boom')\n\nf()", **LIMITS)
    assert result.exit_code == 1 and result.exception == "ValueError"
    assert 'File "<code>", line 2, in f' in result.stderr
    assert "raise ValueError('boom')" in result.stderr  # the source line
    assert result.stderr.rstrip().endswith("ValueError: boom")
    assert "sandbox.py" not in result.stderr  # the sandbox's own frames are hidden


def test_exception_is_named_when_later_writes_follow_its_traceback():
    # A fork bomb's processes all fail at once and their tracebacks interleave: stderr can
    # end in another process's first line or in a line the kill cut (CI saw this).
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: sys.stderr.write('Traceback (most recent call last):\\n  Fi'))\n"
        "raise BlockingIOError(11, 'Resource temporarily unavailable')"
    )
    result = run_python(code, **LIMITS)
    assert result.stderr.endswith("Traceback (most recent call last):\n  Fi"), result
    assert result.exception == "BlockingIOError" and result.killed_reason == "processes"


def test_output_over_the_limit_is_truncated_and_marked():
    code = "print('a' * 100_000)\nprint('END')"
    result = run_python(code, **{**LIMITS, "max_output_bytes": 1000})
    assert result.truncated
    assert "bytes truncated ...]" in result.stdout
    assert len(result.stdout) < 1100
    assert result.stdout.startswith("aaa") and result.stdout.rstrip().endswith("END")


def test_minimal_environment_own_directory_closed_stdin(monkeypatch, tmp_path):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("JAXRL_TEST_SECRET", secret)
    code = (
        "import os, sys\n"
        "print(sorted(os.environ))\n"
        "print(os.environ.get('JAXRL_TEST_SECRET'))\n"
        "print(os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR'])\n"
        "print(repr(sys.stdin.read()))\n"
        "open('made_here.txt', 'w').write('ok')\n"
        "print(open('made_here.txt').read())\n"
        "print(os.getcwd())\n"
    )
    result = run_python(code, **LIMITS, tmp_dir=str(tmp_path))
    lines = result.stdout.splitlines()
    assert secret not in result.stdout and lines[1] == "None"
    assert "JAXRL_TEST_SECRET" not in lines[0]
    assert lines[2:5] == ["True", "''", "ok"]  # HOME = cwd; stdin is empty; cwd is writable
    assert lines[5] == "/sandbox"  # the run's directory, as the file-system view shows it
    assert list(tmp_path.iterdir()) == []  # removed on the host afterwards


# ------------------------------------------------------------------------- runaway programs


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    result = run_python("while True: pass", **{**LIMITS, "timeout_s": 4, "cpu_s": 1})
    # CPU time at 1 s (SIGXCPU); under a heavy load the wall clock may come first.
    assert result.killed_reason in ("cpu_time", "timeout"), result
    assert result.exit_code is None
    assert result.wall_s < 4 + 8
    assert_nothing_left(result)


def test_sleeping_program_is_stopped_by_the_wall_clock():
    code = "import time\nprint('started')\ntime.sleep(60)"
    result = run_python(code, **{**LIMITS, "timeout_s": 1})
    assert result.timed_out and result.killed_reason == "timeout"
    assert result.stdout == "started\n"  # output before the kill is kept
    assert result.wall_s < 1 + 8
    assert_nothing_left(result)


def test_fork_bomb_is_stopped_and_leaves_no_process():
    code = "import os\nwhile True: os.fork()"
    result = run_python(code, **{**LIMITS, "timeout_s": 1.5, "cpu_s": 1})
    # Stopped by the process limit (the fork fails: EAGAIN), the CPU or the wall clock.
    assert result.killed_reason in ("processes", "cpu_time", "timeout"), result
    assert result.exit_code != 0
    assert_nothing_left(result)


@pytest.mark.skipif(not isolation()["pid_namespace"], reason="no PID namespace here")
def test_fork_bomb_leaving_the_session_is_still_killed():
    # Children that fork, ignore the failures and leave the session: only the PID
    # namespace (all killed when its init exits) catches them.
    code = (
        "import os\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"
        "    except OSError:\n"
        "        pass\n"
    )
    result = run_python(code, **{**LIMITS, "timeout_s": 1.5, "cpu_s": 1})
    assert result.killed_reason in ("cpu_time", "timeout"), result
    assert_nothing_left(result)
    survivors = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"--run" in cmdline and b"jaxrl_sandbox_" in cmdline:
            survivors.append(int(entry))  # a runner of this (finished) run
    assert survivors == []


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "no_namespaces"])
def test_background_processes_end_with_the_program(namespaces):
    # Without namespaces (the fallback) the boot kills the init's process group instead.
    code = "import subprocess\nsubprocess.Popen(['sleep', '30'])\nprint('started')"
    result = run_python(code, **LIMITS, namespaces=namespaces, allow_weaker_isolation=True)
    assert result.stdout == "started\n" and result.exit_code == 0, result
    assert result.wall_s < 5
    assert result.isolation["pid_namespace"] is (namespaces and isolation()["pid_namespace"])
    assert_nothing_left(result)


def test_ten_gigabyte_allocation_is_denied():
    result = run_python("x = bytearray(10 * 1024**3)\nprint('allocated')", **LIMITS)
    assert result.killed_reason == "memory" and result.exception == "MemoryError"
    assert "allocated" not in result.stdout
    assert result.stderr.rstrip().endswith("MemoryError")


# ---------------------------------------------------------------------- files and network

ATTEMPT = """
import os
def attempt(label, action):
    try:
        value = action()
    except FileNotFoundError:
        print(label, "NOTFOUND")
    except PermissionError:
        print(label, "DENIED")
    except OSError as error:  # e.g. ENETUNREACH in an empty network namespace
        print(label, "FAILED", error.errno)
    else:
        print(label, "DONE", value)
"""


def test_the_hosts_network_is_unreachable():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = ATTEMPT + (
            "import socket\n"
            f"attempt('local', lambda: socket.create_connection(('127.0.0.1', {port}), 1))\n"
            "attempt('remote', lambda: socket.create_connection(('1.1.1.1', 53), 1))\n"
        )
        result = run_python(code, **LIMITS)
        server.settimeout(0)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the host's loopback
    # Denied (Landlock, the audit hook) or unreachable (an empty network namespace).
    assert result.exit_code == 0, result
    for label in ("local", "remote"):
        assert f"{label} DENIED" in result.stdout or f"{label} FAILED" in result.stdout, result


def test_isolation_reports_every_layer_once():
    layers = isolation()
    assert set(layers) == set(LAYERS) and all(isinstance(v, bool) for v in layers.values())
    layers["landlock_fs"] = "changed"
    start = time.monotonic()
    assert isolation()["landlock_fs"] in (True, False)  # a copy of the cached probe
    assert time.monotonic() - start < 0.1


# ----------------------------------------------------------------------------------- tool

TOOL_CONFIG = {"type": "native", "timeout": 5, "cpu_time": 2, "memory_limit_mb": 512}


def execute(tool: CodeInterpreter, parameters):
    async def call():
        instance_id, _ = await tool.create()
        out = await tool.execute(instance_id, parameters)
        await tool.release(instance_id)
        return out

    return asyncio.run(call())


def test_tool_schema_and_defaults():
    tool = CodeInterpreter({"type": "native"})
    schema = tool.get_openai_tool_schema()["function"]
    assert tool.name == schema["name"] == "code_interpreter"
    assert schema["parameters"]["required"] == ["code"]
    assert schema["parameters"]["properties"]["code"]["type"] == "string"
    assert (tool.timeout, tool.cpu_time, tool.memory_limit_mb, tool.max_output_length) == (
        10.0, 10.0, 1024, 4096,
    )  # fmt: skip
    with pytest.raises(ValueError, match="timeout"):
        CodeInterpreter({"timeout": -1})
    verl_config = {"type": "native", "sandbox_fusion_url": "http://x", "default_timeout": 30}
    assert CodeInterpreter(verl_config).timeout == 30.0  # verl's SandboxFusionTool config


def test_tool_returns_the_output():
    response, reward, metrics = execute(CodeInterpreter(TOOL_CONFIG), {"code": "print(2 + 3)"})
    assert response.text == "5" and reward == 0.0
    assert metrics["exit_code"] == 0 and metrics["killed_reason"] is None


def test_tool_reports_an_exception_and_a_denial():
    tool = CodeInterpreter(TOOL_CONFIG)
    response, _, metrics = execute(tool, {"code": "print('hi')\nopen('/etc/x', 'w')"})
    text = response.text
    assert text.startswith("hi\n[stderr]\nTraceback (most recent call last):")
    assert "PermissionError" in text and "[Permission denied: the sandbox allows" in text
    assert metrics["killed_reason"] == "permission"


def test_tool_reports_the_memory_limit():
    response, _, metrics = execute(CodeInterpreter(TOOL_CONFIG), {"code": "x = bytearray(10**10)"})
    assert "[Stopped: the program exceeded the memory limit of 512 MB (MemoryError).]" in (
        response.text
    )
    assert metrics["killed_reason"] == "memory"


@pytest.mark.parametrize(
    "parameters, expected",
    [({}, "no `code`"), ({"code": 5}, "`code` of type int"), (None, "no `code`")],
)
def test_tool_bad_parameters(parameters, expected):
    response, reward, metrics = execute(CodeInterpreter(TOOL_CONFIG), parameters)
    assert response.text.startswith("Error: the parameters must give `code`")
    assert expected in response.text and reward == 0.0 and metrics == {"bad_parameters": True}


def result(**fields) -> SandboxResult:
    base = {"stdout": "", "stderr": "", "exit_code": 0, "signal": None, "timed_out": False}
    base |= {"killed_reason": None, "truncated": False, "wall_s": 0.1}
    return SandboxResult(**{**base, **fields})


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"exit_code": None, "timed_out": True, "killed_reason": "timeout", "stdout": "a\n"},
         "a\n[Stopped: the program exceeded the time limit of 5 s and was killed.]"),
        ({"exit_code": None, "signal": 24, "killed_reason": "cpu_time"},
         "[Stopped: the program exceeded the CPU time limit of 2 s and was killed.]"),
        ({"exit_code": None, "signal": 9, "killed_reason": "signal"},
         "[Stopped: the program was killed by SIGKILL.]"),
        ({"exit_code": 1, "killed_reason": "processes", "stderr": "BlockingIOError\n"},
         "[stderr]\nBlockingIOError\n[Stopped: the program reached the limit on processes"),
        ({"stdout": "x\n[... 9 bytes truncated ...]\ny\n", "truncated": True},
         "x\n[... 9 bytes truncated ...]\ny\n[Output truncated: more than 4096 bytes"),
        ({"exit_code": 3}, "[Exit code: 3]"),
        ({}, "[no output]"),
        ({"exit_code": None, "error": "the runner did not start"},
         "[Sandbox error: the runner did not start]"),
    ],
)  # fmt: skip
def test_tool_text_names_what_stopped_the_program(fields, expected):
    text = CodeInterpreter(TOOL_CONFIG).render(result(**fields))
    assert text.startswith(expected), text
