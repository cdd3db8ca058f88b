"""Loading a `Config`: YAML file, then `key=value` overrides in Hydra's grammar, then checks.

OmegaConf (the layer under verl's Hydra) does the typed merging: `Config` becomes a structured
config, so a value of the wrong type is refused with the key named. Hydra's override parser reads
the command line exactly as verl's `main_ppo` does (`a.b=[1,2]`, `x=null`, `'quoted'`, `+a.b=1`).
On top of that this module adds what a user needs to act on a mistake: every key is looked up
first, so an unknown key names the closest valid one; verl keys that jaxrl renames or ignores are
handled by `verl_compat`; and all problems found are reported together.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf import errors as oc_errors

from jaxrl.config import verl_compat
from jaxrl.config.checks import check, normalize
from jaxrl.config.errors import ConfigError
from jaxrl.config.schema import Config, is_group
from jaxrl.config.verl_compat import Ignored

log = logging.getLogger("jaxrl.config")


@dataclasses.dataclass(frozen=True)
class Schema:
    """A config tree one entry point loads (`python -m jaxrl.train`: `PPO`; `jaxrl.sft` and
    `jaxrl.dpo` have theirs in `config.offline`).

    Attributes:
        root: The root dataclass.
        renamed: verl key -> the key it lands on (`verl_compat.RENAMED` for PPO).
        ignored: verl key pattern -> `Ignored` (dropped with a warning, or refused).
        normalize: The resolved config -> its canonical spelling (raises `ConfigError`).
        check: `check(cfg, num_devices=...)` raises `ConfigError` listing every problem.
    """

    root: type
    renamed: Mapping[str, str]
    ignored: Mapping[str, Ignored]
    normalize: Callable[[Any], Any]
    check: Callable[..., None]


PPO = Schema(Config, verl_compat.RENAMED, verl_compat.IGNORED, normalize, check)


# ----------------------------------------------------------------------------- schema index


@dataclasses.dataclass(frozen=True)
class KeyInfo:
    """What the schema says about one dotted key.

    Attributes:
        kind: `group` (a nested dataclass), `mapping` (a free-form dict) or `leaf`.
        type: The resolved annotation.
    """

    kind: str
    type: Any


@functools.cache
def schema_index(root: type = Config) -> dict[str, KeyInfo]:
    """Every dotted key of the schema, groups included, in declaration order."""
    index: dict[str, KeyInfo] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key, tp = prefix + f.name, hints[f.name]
            if is_group(tp):
                index[key] = KeyInfo("group", tp)
                walk(tp, key + ".")
            elif typing.get_origin(tp) is dict:
                index[key] = KeyInfo("mapping", tp)
            else:
                index[key] = KeyInfo("leaf", tp)

    walk(root, "")
    return index


def describe_type(tp: Any) -> str:
    """`int | None` -> 'an integer or null', for error messages."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [describe_type(a) for a in args if a is not type(None)]
        return " or ".join(inner) + (" or null" if type(None) in args else "")
    if typing.get_origin(tp) is tuple:
        item = describe_type(args[0]).removeprefix("an ").removeprefix("a ")
        return f"a list of {len(args)} {item}s" if Ellipsis not in args else f"a list of {item}s"
    if typing.get_origin(tp) is dict:
        return "a mapping"
    names = {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "a string"}
    return names.get(tp, "any value")


def closest_key(
    key: str, candidates: Iterable[str] | None = None, root: type = Config
) -> str | None:
    """The valid key a user most likely meant, preferring siblings of the same group."""
    keys = (
        [k for k, i in schema_index(root).items() if i.kind != "group"]
        if candidates is None
        else [*candidates]
    )
    parent, _, name = key.rpartition(".")
    sibling_names = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]

    def sibling(cutoff: float) -> str | None:
        match = difflib.get_close_matches(name, sibling_names, 1, cutoff)
        return (f"{parent}.{match[0]}" if parent else match[0]) if match else None

    # A near-certain typo in the same group, then the exact name in another group
    # (`data.ppo_mini_batch_size`), then looser matches.
    same_name = [k for k in keys if k.rpartition(".")[2] == name]
    loose = difflib.get_close_matches(key, keys, 1, 0.6)
    return (
        sibling(0.85)
        or (same_name[0] if same_name else None)
        or sibling(0.6)
        or (loose[0] if loose else None)
    )


# ---------------------------------------------------------------------------- input reading


def _flatten(
    tree: Mapping[str, Any], prefix: str, out: list[tuple[str, Any]], root: type = Config
) -> None:
    """YAML mapping -> (dotted key, value) pairs, stopping at schema leaves and mappings."""
    index = schema_index(root)
    for name, value in tree.items():
        key = f"{prefix}{name}"
        info = index.get(key)
        if isinstance(value, Mapping) and value and (info is None or info.kind == "group"):
            _flatten(value, key + ".", out, root)
        else:
            out.append((key, value))


def read_yaml(path: str | os.PathLike, root: type = Config) -> list[tuple[str, Any]]:
    """A YAML config file as (dotted key, value) pairs; interpolations are kept as written."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"config file not found: {path} (pass an existing --config path)"])
    try:
        tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (yaml.YAMLError, oc_errors.OmegaConfBaseException) as e:
        raise ConfigError([f"{path}: not valid YAML: {e}"]) from e
    except OSError as e:  # OmegaConf's answer to a file whose top level is not a mapping
        msg = f"{path}: the top level must be a mapping of config groups ({e})"
        raise ConfigError([msg]) from None
    if tree is None:
        return []
    if not isinstance(tree, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of config groups"])
    pairs: list[tuple[str, Any]] = []
    _flatten(tree, "", pairs, root)
    return pairs


def parse_overrides(overrides: Sequence[str], root: type = Config) -> list[tuple[str, Any]]:
    """`key=value` strings in Hydra's override grammar as (dotted key, value) pairs."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    pairs: list[tuple[str, Any]] = []
    problems: list[str] = []
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException as e:
            problem = f"cannot parse override {text!r}: {str(e).splitlines()[0]}"
            key, _, value = text.partition("=")
            if "~" in value:
                # Hydra's grammar keeps `~` for deletions: a value holding it must be quoted.
                problem += f"; quote a value that holds ~ ({key}='{value}') or use $HOME"
            problems.append(problem)
            continue
        key = override.key_or_group
        if override.type is OverrideType.DEL:
            problems.append(f"{text!r}: deleting keys is not supported; set {key}=VALUE instead")
        elif override.is_sweep_override():
            problems.append(f"{text!r}: sweeps (a=1,2) are not supported; run once per value")
        elif override.package is not None:
            problems.append(f"{text!r}: package overrides (@pkg) are not supported")
        else:
            value = override.value()
            if isinstance(value, Mapping):
                nested: list[tuple[str, Any]] = []
                _flatten({key: value}, "", nested, root)
                pairs.extend(nested)
            else:
                pairs.append((key, value))
    if problems:
        raise ConfigError(problems)
    return pairs


# ------------------------------------------------------------------------------- merging


def _route(key: str, value: Any, schema: Schema) -> tuple[str | None, str | None]:
    """Where a (key, value) goes: (jaxrl key, None), (None, None) to drop, or (None, error)."""
    index = schema_index(schema.root)
    head = key
    while "." in head and head not in index:
        head = head.rpartition(".")[0]
    info = index.get(head)
    if info is not None and (head == key or info.kind == "mapping"):
        if info.kind == "group" and (value is None or value == {}):
            return None, None  # `critic:` with nothing under it changes nothing
        if info.kind == "group":
            return None, (
                f"{key} is a group of keys, not a value; set one of its keys, "
                f"e.g. {closest_key(key + '.x', [k for k in index if k.startswith(key + '.')])}"
            )
        return key, None
    if (target := schema.renamed.get(key)) is not None:
        log.info("verl key %s is %s in jaxrl; using it there", key, target)
        return target, None
    if (entry := verl_compat.ignored_entry(key, schema.ignored)) is not None:
        if entry.accepted is not None and value not in entry.accepted:
            allowed = " or ".join(repr(a) for a in entry.accepted)
            return (
                None,
                f"{key}={value!r} is not supported by jaxrl: {entry.reason} (allowed: {allowed})",
            )
        log.warning("ignoring verl key %s=%r: %s", key, value, entry.reason)
        return None, None
    hint = closest_key(key, root=schema.root)
    return None, f"unknown config key {key!r}" + (f"; did you mean {hint!r}?" if hint else "")


def _assign(cfg: DictConfig, key: str, value: Any, root: type) -> str | None:
    """Set one key on the structured config; a type mismatch comes back as a message."""
    try:
        OmegaConf.update(cfg, key, value, merge=True)
    except oc_errors.ValidationError:
        info = schema_index(root).get(key)
        expected = describe_type(info.type) if info else "another type"
        return f"{key}: {value!r} is not valid here; expected {expected}"
    except oc_errors.OmegaConfBaseException as e:
        return f"{key}={value!r}: {str(e).splitlines()[0]}"
    return None


def _unfreeze(node: DictConfig | ListConfig) -> None:
    """Frozen dataclasses make read-only OmegaConf nodes; merging needs them writable."""
    OmegaConf.set_readonly(node, None)
    items = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for k in items:
        child = node._get_node(k)
        if isinstance(child, DictConfig | ListConfig):
            _unfreeze(child)
        else:
            child._set_flag("readonly", None)


def _freeze(x: Any) -> Any:
    """Resolved OmegaConf objects -> frozen dataclasses, tuples and read-only mappings."""
    if dataclasses.is_dataclass(x):
        return type(x)(**{f.name: _freeze(getattr(x, f.name)) for f in dataclasses.fields(x)})
    if isinstance(x, list | tuple):
        return tuple(_freeze(v) for v in x)
    if isinstance(x, dict):
        return types.MappingProxyType({k: _freeze(v) for k, v in x.items()})
    return x


def merge(pairs: Iterable[tuple[str, Any]], schema: Schema = PPO) -> Any:
    """Apply (dotted key, value) pairs in order onto the defaults and resolve."""
    cfg = OmegaConf.structured(schema.root)
    _unfreeze(cfg)
    problems = []
    for key, value in pairs:
        target, problem = _route(key, value, schema)
        if target is not None:
            problem = _assign(cfg, target, value, schema.root)
        if problem:
            problems.append(problem)
    if problems:
        raise ConfigError(problems)
    try:
        resolved = OmegaConf.to_object(cfg)
    except oc_errors.MissingMandatoryValue as e:
        key = e.full_key
        raise ConfigError(
            [f"{key} is required: set it in the config file or pass {key}=VALUE"]
        ) from None
    except oc_errors.OmegaConfBaseException as e:
        msg = str(e).splitlines()[0]
        raise ConfigError([f"{e.full_key}: cannot resolve its value: {msg}"]) from None
    cfg = _freeze(resolved)
    if problems := _type_problems(cfg, schema.root):  # interpolations are typed only once resolved
        raise ConfigError(problems)
    return cfg


def _matches(value: Any, tp: Any) -> bool:
    """Whether a resolved value fits the schema's annotation `tp` (unknown types: yes)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if tp is type(None):
        return value is None
    if origin is dict:
        return isinstance(value, Mapping)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if Ellipsis in args:
            return all(_matches(v, args[0]) for v in value)
        if len(value) != len(args):
            return False
        return all(_matches(v, t) for v, t in zip(value, args, strict=True))
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return True


def _type_problems(cfg: Any, root: type) -> list[str]:
    problems = []
    for key, info in schema_index(root).items():
        if info.kind == "group":
            continue
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if not _matches(value, info.type):
            problems.append(
                f"{key}: {value!r} is not valid here; expected {describe_type(info.type)}"
            )
    return problems


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    num_devices: int | None = None,
    schema: Schema = PPO,
) -> Any:
    """Defaults, then the YAML file at `path`, then `overrides`; checked and frozen.

    Args:
        path: A YAML file shaped like verl's config groups; None: defaults only.
        overrides: `dotted.key=value` strings in Hydra's grammar, applied after the file.
        num_devices: Device count for the mesh checks; None skips the checks that need it.
        schema: The config tree (`PPO`: `Config`, `python -m jaxrl.train`'s).

    Raises:
        ConfigError: listing every problem found, each naming the key and what to change.
    """
    root = schema.root
    pairs = (read_yaml(path, root) if path is not None else []) + parse_overrides(overrides, root)
    try:
        cfg = schema.normalize(merge(pairs, schema))
        schema.check(cfg, num_devices=num_devices)
    except ConfigError as e:
        given = [k for k, _ in pairs]
        raise ConfigError(_name_verl_keys(e.problems, given, schema.renamed)) from None
    return cfg


def _name_verl_keys(problems: list[str], given: list[str], renamed: Mapping[str, str]) -> list[str]:
    """Problems about a key that was given under its verl name also name that verl key."""
    as_given = {t: k for k in given if (t := renamed.get(k)) is not None}
    out = []
    for p in problems:
        for target, key in as_given.items():
            if p.startswith(target) and p[len(target) : len(target) + 1] in ":= " and key not in p:
                p = f"{key} (jaxrl's {target}){p[len(target) :]}"
                break
        out.append(p)
    return out


# ------------------------------------------------------------------------------- output


def to_dict(x: Any) -> Any:
    """A `Config` (or part of one) as plain dicts and lists, in declaration order."""
    if dataclasses.is_dataclass(x):
        return {f.name: to_dict(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, list | tuple):
        return [to_dict(v) for v in x]
    if isinstance(x, Mapping):
        return {k: to_dict(v) for k, v in x.items()}
    return x


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML that `load_config` reads back to the same `Config`."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def save_config(cfg: Config, run_dir: str | os.PathLike) -> Path:
    """Write the resolved config to `run_dir/config.yaml`; returns its path."""
    out = Path(run_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.yaml"
    path.write_text(to_yaml(cfg))
    return path
