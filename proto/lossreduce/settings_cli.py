"""A pydantic settings model as argparse flags: one naming rule for every command.

Every ``lossreduce`` command that takes settings (``serve``, ``train``,
``bench``, ``status``) builds its flags here, so they all follow one rule: the
flag of a field is its name with ``_`` -> ``-`` (``round_timeout_s`` ->
``--round-timeout-s``), and its help is the field's description. Values reach
the model as the strings typed (the model validates them), except:

- ``bool`` fields are ``--name`` / ``--no-name``;
- ``Literal`` and ``Enum`` fields show their choices (the model checks them);
- tuple and list fields take one comma-separated value (``--world-sizes 2,4,8``);
- a field that may be ``None`` takes ``none`` or ``off`` to mean ``None``.

Any bad flag or value raises :class:`FlagError`, whose message is one line
naming the flag and the value (``--workers 0: Input should be ...``).
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import Path

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

__all__ = [
    "NONE_WORDS",
    "FlagError",
    "SettingsParser",
    "add_settings_flags",
    "env_name",
    "field_choices",
    "flag_name",
    "given_settings",
    "parse_settings",
]

NONE_WORDS = ("none", "off")
"""Values (any case) that set a field which may be ``None`` to ``None``."""

_M = typing.TypeVar("_M", bound=BaseModel)


class FlagError(ValueError):
    """Bad command-line arguments; the message is one line naming the flag and the value."""

    def report(self, prog: str) -> int:
        """Print ``PROG: error: MESSAGE`` to stderr; return exit status 2."""
        print(f"{prog}: error: {self}", file=sys.stderr)
        return 2


class SettingsParser(argparse.ArgumentParser):
    """An argument parser whose errors raise :class:`FlagError` (one line, no usage
    dump) instead of exiting, so every command reports them the same way."""

    def __init__(self, *, prog: str, description: str) -> None:
        # No abbreviations: a prefix of a flag (an old name like --round-timeout
        # for --round-timeout-s) must be an error, not silently another flag.
        super().__init__(prog=prog, description=description, allow_abbrev=False)

    def error(self, message: str) -> typing.NoReturn:
        raise FlagError(message)


def flag_name(field: str) -> str:
    """The flag of a settings field: ``round_timeout_s`` -> ``--round-timeout-s``."""
    return "--" + field.replace("_", "-")


def env_name(model: type[BaseModel], field: str) -> str | None:
    """The environment variable a ``pydantic_settings`` model reads ``field`` from
    (``LOSSREDUCE_ROUND_TIMEOUT_S``), or None for a plain model."""
    prefix = model.model_config.get("env_prefix")
    return None if prefix is None else f"{prefix}{field}".upper()


def _members(annotation: object) -> tuple[object, ...]:
    """``X | None`` -> ``(X, NoneType)``; anything else -> ``(annotation,)``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _nullable(annotation: object) -> bool:
    return type(None) in _members(annotation)


def field_choices(annotation: object) -> list[str]:
    """The values a ``Literal`` or ``Enum`` annotation (or ``X | None`` of one) allows,
    as text; empty for any other annotation."""
    choices: list[str] = []
    for member in _members(annotation):
        if typing.get_origin(member) is typing.Literal:
            choices += [str(a) for a in typing.get_args(member)]
        elif isinstance(member, type) and issubclass(member, enum.Enum):
            choices += [str(m.value) for m in member]
    return choices


def _is_sequence(annotation: object) -> bool:
    return any(typing.get_origin(m) in (tuple, list) for m in _members(annotation))


def _comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _metavar(name: str, annotation: object) -> str:
    members = [m for m in _members(annotation) if m is not type(None)]
    if _is_sequence(annotation):
        return "A,B,..."
    if name.endswith("_s"):
        return "SECONDS"
    if Path in members:
        return "PATH"
    if int in members:
        return "N"
    if float in members:
        return "X"
    return name.upper()


def _default_text(field: FieldInfo) -> str:
    # validated_data: pydantic 2.10 asks for it whenever it calls a default factory.
    default = field.get_default(call_default_factory=True, validated_data={})
    if isinstance(default, tuple | list):
        return ",".join(str(v) for v in default)
    return str(default)


def add_settings_flags(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    *,
    exclude: Collection[str] = (),
    shown_defaults: Mapping[str, str] | None = None,
    metavars: Mapping[str, str] | None = None,
) -> None:
    """Add one flag per field of ``model`` (except ``exclude``) to ``parser``.

    Every flag stores under the field's name and defaults to None (not given),
    so :func:`given_settings` tells given flags from defaults. ``shown_defaults``
    replaces a field's default in its help (where the command's default is not
    the model's); ``metavars`` names a value (``HOST:PORT``).
    """
    shown = shown_defaults or {}
    names = metavars or {}
    for name, field in model.model_fields.items():
        if name in exclude:
            continue
        required = field.is_required()
        notes = [] if required else [f"default: {shown.get(name) or _default_text(field)}"]
        env = env_name(model, name)
        if env is not None:
            notes.append(f"env {env}")
        # argparse %-formats help strings.
        help_text = field.description or ""
        if notes:
            help_text += f" [{'; '.join(notes)}]"
        help_text = help_text.replace("%", "%%")
        if field.annotation is bool:
            parser.add_argument(
                flag_name(name),
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
            continue
        # Choices are checked by the model, so a bad one reads like every other bad value.
        choices = field_choices(field.annotation)
        parser.add_argument(
            flag_name(name),
            dest=name,
            default=None,
            required=required,
            type=_comma_list if _is_sequence(field.annotation) else str,
            metavar=names.get(name)
            or ("|".join(choices) if choices else _metavar(name, field.annotation)),
            help=help_text,
        )


def given_settings(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, object]:
    """The fields of ``model`` given as flags, with ``none``/``off`` turned into None
    where the field may be None."""
    given: dict[str, object] = {}
    for name, field in model.model_fields.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        if isinstance(value, str) and value.lower() in NONE_WORDS and _nullable(field.annotation):
            value = None
        given[name] = value
    return given


def _shown(value: object) -> str:
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _describe(err: ValidationError, model: type[BaseModel], given: Mapping[str, object]) -> str:
    """One line naming, for every problem, the flag (or variable) and the value."""
    parts: list[str] = []
    for problem in err.errors():
        message = str(problem["msg"]).removeprefix("Value error, ")
        loc = problem["loc"]
        field = loc[0] if loc and isinstance(loc[0], str) else None
        env = env_name(model, field) if field is not None else None
        if field is not None and field in given:
            parts.append(f"{flag_name(field)} {_shown(given[field])}: {message}")
        elif env is not None and env in os.environ:
            parts.append(f"{env}={os.environ[env]}: {message}")
        elif field is not None and field in model.model_fields:
            parts.append(f"{flag_name(field)}: {message}")
        else:
            parts.append(message)
    return "; ".join(parts)


def parse_settings(
    model: type[_M],
    args: argparse.Namespace,
    *,
    defaults: Mapping[str, object] | None = None,
) -> _M:
    """Validate the flags given in ``args`` over ``defaults`` (the command's own
    defaults, where they differ from the model's) into ``model``.

    A ``pydantic_settings`` model also reads its environment variables for
    fields given neither as a flag nor in ``defaults``. Raises
    :class:`FlagError` naming every bad flag (or variable) and its value.
    """
    given = given_settings(args, model)
    try:
        return model.model_validate({**(defaults or {}), **given})
    except ValidationError as err:
        raise FlagError(_describe(err, model, given)) from None
