"""The boot process's entry point: `python -I -B -S boot.py CONFIG_JSON` (see tree.py).

Run as a script in isolated mode without `site` (the standard library only), it loads this
folder's modules as a package `sandbox` without running its `__init__` (the caller's side,
which the sandbox's own processes do not need): an interpreter start is most of a call's cost.
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

    sys.exit(tree.boot(json.loads(sys.argv[1])))
