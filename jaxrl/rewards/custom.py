"""A user's scoring function from a Python file (`custom_reward_function.path` / `.name`).

The function is called as verl calls it, with keyword arguments and the configured
`reward_kwargs` merged in (they win over the call's own):

    fn(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **reward_kwargs)

and returns a float or a dict with a "score" key (every other key becomes reward extra info).
For the `batch` manager it is called once per batch with the plural names (`data_sources`,
`solution_strs`, `ground_truths`, `extra_infos`) and returns a list.

`CustomRewardFn` is picklable (it pickles its path, name and kwargs and loads the file again in
the receiving process), so the parallel manager's worker processes can use it.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from jaxrl.rewards.scorers import default_compute_score

PKG_PREFIX = "pkg://"
FILE_PREFIX = "file://"


class CustomRewardError(ValueError):
    """The custom reward function cannot be loaded (the message names the path and name)."""


class CustomRewardFileNotFoundError(CustomRewardError, FileNotFoundError):
    """`custom_reward_function.path` names no file (verl raises FileNotFoundError here too)."""


class CustomRewardNameError(CustomRewardError, AttributeError):
    """`custom_reward_function.name` is not in the file (verl raises AttributeError here)."""


def _load_module(path: str) -> ModuleType:
    if path.startswith(PKG_PREFIX):
        module_name = path[len(PKG_PREFIX) :].replace("/", ".")
        try:
            return importlib.import_module(module_name)
        except ImportError as e:
            raise CustomRewardError(
                f"custom_reward_function.path={path!r}: cannot import module {module_name!r} "
                f"({e}); check the package name or give a .py file path instead"
            ) from e
    file = Path(path[len(FILE_PREFIX) :] if path.startswith(FILE_PREFIX) else path).expanduser()
    if not file.is_file():
        raise CustomRewardFileNotFoundError(
            f"custom_reward_function.path={path!r}: no such file ({file.resolve()}); set it to "
            "an existing .py file, or to null for the built-in scorers"
        )
    # A name unique per file, so two reward files never share a module object.
    digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(f"jaxrl_custom_reward_{digest}", file)
    if spec is None or spec.loader is None:
        raise CustomRewardError(
            f"custom_reward_function.path={path!r}: not a loadable Python file; give a .py file"
        )
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise CustomRewardError(
            f"custom_reward_function.path={path!r}: executing the file failed with "
            f"{type(e).__name__}: {e}"
        ) from e
    return module


def _load_function(path: str, name: str) -> Callable[..., Any]:
    module = _load_module(path)
    fn = getattr(module, name, None)
    if fn is None:
        names = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise CustomRewardNameError(
            f"custom_reward_function.name={name!r} is not defined in {path!r}; functions there: "
            f"{names}. Set custom_reward_function.name to one of them"
        )
    if not callable(fn):
        raise CustomRewardError(
            f"custom_reward_function.name={name!r} in {path!r} is a {type(fn).__name__}, "
            "not a function"
        )
    return fn


class CustomRewardFn:
    """`fn(**kwargs, **reward_kwargs)` for the function `name` in the file `path`.

    Loading happens at construction, so a bad path or name fails at start-up, not mid-run.
    Coroutine functions are run to completion (`asyncio.run`) on each call.
    """

    def __init__(self, path: str, name: str = "compute_score", reward_kwargs=None) -> None:
        self.path = os.fspath(path)
        self.name = name
        self.reward_kwargs = dict(reward_kwargs or {})
        self._fn = _load_function(self.path, self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._fn(*args, **{**kwargs, **self.reward_kwargs})
        return asyncio.run(out) if inspect.iscoroutine(out) else out

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "name": self.name, "reward_kwargs": self.reward_kwargs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def __repr__(self) -> str:
        return f"CustomRewardFn(path={self.path!r}, name={self.name!r})"


def load_custom_reward_fn(
    path: str | os.PathLike | None,
    name: str | None = "compute_score",
    reward_kwargs: Mapping[str, Any] | None = None,
) -> CustomRewardFn | None:
    """The user's function, or None when `path` is empty (use the built-in scorers).

    Raises:
        CustomRewardError: The file does not exist or fails to execute, or `name` is missing.
    """
    if not path:
        return None
    if not name:
        raise CustomRewardError(
            f"custom_reward_function.path={os.fspath(path)!r} is set but "
            "custom_reward_function.name is empty; name the function to call"
        )
    return CustomRewardFn(os.fspath(path), name, reward_kwargs)


def compute_score_from_config(custom_reward_function: Any) -> Callable[..., Any]:
    """The scoring function a `CustomRewardFunctionConfig` selects: the user's function, or
    `default_compute_score` when its path is null."""
    cfg = custom_reward_function
    fn = load_custom_reward_fn(
        getattr(cfg, "path", None),
        getattr(cfg, "name", "compute_score"),
        getattr(cfg, "reward_kwargs", None),
    )
    return fn if fn is not None else default_compute_score
