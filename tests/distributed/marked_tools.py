"""A calculator that can say it is running: the multi-process fault test's tool.

`MarkedCalculator` answers as `jaxrl.agent.tools.calculator.Calculator` (its name and schema
too, so a run with it samples the same tokens). With `JAXRL_TEST_TOOL_MARK=DIR` in the
environment, each call first touches `DIR/process_<JAXRL_PROCESS_ID>` and then waits
`JAXRL_TEST_TOOL_DELAY` seconds (default 5): a test sees that a process is inside a tool call
and has time to kill it there.
"""

import asyncio
import os
from pathlib import Path

from jaxrl.agent.tools.calculator import Calculator


class MarkedCalculator(Calculator):
    async def execute(self, instance_id, parameters, **kwargs):
        folder = os.environ.get("JAXRL_TEST_TOOL_MARK")
        if folder:
            Path(folder, f"process_{os.environ.get('JAXRL_PROCESS_ID', '0')}").touch()
            await asyncio.sleep(float(os.environ.get("JAXRL_TEST_TOOL_DELAY", "5")))
        return await super().execute(instance_id, parameters, **kwargs)
