"""The boot process's entry point: `python -I -B -S boot.py < CONFIG_JSON` (see tree.py).

Run as a script in isolated mode without `site` (the standard library only), it loads this
folder's modules as a package `sandbox` without running its `__init__` (the caller's side,
which the sandbox's own processes do not need): an interpreter start is most of a call's cost.
The config comes on stdin, not in argv, where the program would read it in /proc/1/cmdline;
stdin is then /dev/null, as the program's.
"""

import json
import os
import sys
import types

if __name__ == "__main__":
    package = types.ModuleType("sandbox")
    package.__path__ = [os.path.dirname(os.path.abspath(__file__))]
    sys.modules["sandbox"] = package
    from sandbox import tree

    config = json.loads(sys.stdin.buffer.read())
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.exit(tree.boot(config))
