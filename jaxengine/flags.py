"""Command-line flags generated from the argument dataclasses (`EngineArgs`, `FrontendArgs`).

One flag per field, by vLLM's names with dashes (`--max-num-seqs`,
`--enable-prefix-caching/--no-enable-prefix-caching`, ...), with the help text the field declares
and its type resolved from the annotation, so the CLI never drifts from the engine. A flag that
is not given is not passed: the dataclass keeps its own default. Used by `jaxengine/cli.py` and
the lab's commands (`jaxengine/lab/commands.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import scheduler
from jaxengine.engine import args as engine_args_module
from jaxengine.engine.args import EngineArgs

CHOICES = {"dtype": engine_args_module.DTYPES,
           "quantization": engine_args_module.QUANTIZATIONS,
           "kv_cache_dtype": tuple(engine_args_module.KV_CACHE_DTYPES),
           # live: a policy `--scheduling-policy MODULE:CLASS` registers is a choice too
           "scheduling_policy": scheduler.POLICIES.keys(),
           "attention_backend": engine_args_module.ATTENTION_BACKENDS}


def _json_dict(text: str) -> dict[str, Any]:
    """A flag's JSON object (`--speculative-config '{"method": "ngram", ...}'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object {{...}}, got {text!r}")
    return value


def policy_from_flag(text: str) -> str:
    """The registered policy name a `--scheduling-policy` value stands for: a name, or
    `MODULE:CLASS` imported and registered (`scheduler.resolve_policy`); the module is looked
    for in the working directory too, as uvicorn looks for an app (a console script's sys.path
    does not hold it).

    Raises:
      ValueError: what `scheduler.resolve_policy` raises, naming `text`.
    """
    if ":" in text and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return scheduler.resolve_policy(text)


def policy_argument(text: str) -> str:
    """`policy_from_flag` as an argparse `type`: its error is the flag's message."""
    try:
        return policy_from_flag(text)
    except ValueError as e:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(e)) from None


# Fields whose flag parses more than its type: the value is resolved when the flag is read.
_FIELD_PARSERS: dict[str, Callable[[str], Any]] = {"scheduling_policy": policy_argument}

# The value types a flag parses, keyed by the field's resolved type (`typing.get_type_hints`)
# with its `| None` taken off; bool fields get --flag/--no-flag instead.
_PARSERS: dict[Any, Callable[[str], Any]] = {int: int, float: float, str: str,
                                             dict[str, Any]: _json_dict}


def _flag_type(name: str, hint: Any) -> Any:
    """The type field `name`'s flag parses: its resolved type `hint` without an optional None
    (a flag that is not given keeps the field's None default): bool, a key of `_PARSERS`, or
    a `Literal` of values of one such type (the flag's choices)."""
    if get_origin(hint) in (Union, UnionType):
        others = [a for a in get_args(hint) if a is not type(None)]
        hint = others[0] if len(others) == 1 else hint
    if hint is bool or hint in _PARSERS:
        return hint
    if get_origin(hint) is Literal:
        kinds = {type(v) for v in get_args(hint)}
        if len(kinds) == 1 and kinds <= _PARSERS.keys():
            return hint
    raise TypeError(f"field {name!r} of type {hint!r} has no CLI mapping; add one to _PARSERS")


def add_engine_flags(parser: argparse.ArgumentParser, *, skip: Sequence[str] = ()) -> None:
    """Add one flag per `EngineArgs` field (except `skip`) in an "engine arguments" group."""
    add_flags(parser.add_argument_group("engine arguments (EngineArgs; vLLM's names)"),
               EngineArgs, skip=skip)


def add_flags(group: Any, cls: type, *, skip: Sequence[str] = ()) -> None:
    """One flag per field of the dataclass `cls` (except `skip`), with the help text and the
    default the field declares."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = _flag_type(f.name, hints[f.name])
        default = f.default
        help_text = f"{f.metadata['help']} (default: {default})"
        flag = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text)
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if get_origin(kind) is Literal:
            kw["choices"] = get_args(kind)
            kind = type(kw["choices"][0])
        elif f.name in CHOICES:
            kw["choices"] = CHOICES[f.name]
        else:
            kw["metavar"] = f.name.upper()
        group.add_argument(flag, type=_FIELD_PARSERS.get(f.name, _PARSERS[kind]), **kw)


def engine_args_from(ns: argparse.Namespace, parser: argparse.ArgumentParser,
                     **overrides: Any) -> EngineArgs:
    """`EngineArgs` from the flags that were given; a bad value exits with the engine's message."""
    return args_from(EngineArgs, ns, parser, **overrides)


def args_from[T](cls: type[T], ns: argparse.Namespace, parser: argparse.ArgumentParser,
                  **overrides: Any) -> T:
    """The dataclass `cls` from the flags that were given (and `overrides` that are not None);
    a bad value exits with its message."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    given = {k: v for k, v in vars(ns).items() if k in names}
    given.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return cls(**given)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
