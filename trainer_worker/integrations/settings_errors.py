"""A settings model's validation failure as one :class:`~lossreduce.errors.ReductionConfigError`
whose first line names, for every bad value, where it came from, the value and what is allowed.

Pydantic's own ``ValidationError`` names the field only on its second line and
never says whether the value came from a framework's config key, a trainer
argument or a ``LOSSREDUCE_*`` environment variable. Every integration and
``lossreduce train`` builds its settings through :func:`validate_settings` (or
turns a caught error with :func:`settings_error`), so a bad value reads the same
everywhere, e.g.::

    LossReduceGRPOTrainer reduction settings: LOSSREDUCE_MODE=bogus: must be one of
    token_mean, seq_mean, prompt_mean, constant

A field the caller gave is named by its *source label* (a config key such as
``actor_rollout_ref.lossreduce.mode``, a trainer argument, a ``--flag``); a field
it did not give, of a ``pydantic_settings`` model, by the environment variable
it was read from (the model's ``env_prefix``, as
:func:`lossreduce.settings_cli.env_name` spells it). Secret values are never
shown. Imports no framework, Ray or gRPC.
"""

from __future__ import annotations

import enum
import os
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, SecretBytes, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import SettingsError

from lossreduce.errors import ReductionConfigError
from lossreduce.settings_cli import env_name, field_choices

__all__ = ["allowed_values", "settings_error", "validate_settings"]

_M = TypeVar("_M", bound=BaseModel)

_CHOICE_ERRORS = frozenset({"enum", "literal_error"})
_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
_MASK = "**********"


def validate_settings(
    model: type[_M],
    given: Mapping[str, Any] | None = None,
    *,
    what: str,
    sources: Mapping[str, str] | None = None,
    key_prefix: str = "",
    job: str = "",
    group: str = "",
) -> _M:
    """``model(**given)`` (a ``pydantic_settings`` model also reads its environment
    variables for the fields not given), or :class:`ReductionConfigError` from
    :func:`settings_error`.

    Each given field is named by ``sources[field]``, else ``key_prefix.field``
    (``key_prefix="actor_rollout_ref.lossreduce"``), else the field's name;
    ``what`` (``"LossReduceGRPOTrainer reduction settings"``) starts the message.
    """
    values = dict(given or {})
    named = sources or {}
    labels = {
        key: named.get(key) or (f"{key_prefix}.{key}" if key_prefix else key) for key in values
    }
    try:
        return model(**values)
    except (ValidationError, SettingsError) as err:
        # from None: the raw pydantic report would otherwise print above this one.
        raise settings_error(err, model, what=what, sources=labels, job=job, group=group) from None


def settings_error(
    err: ValidationError | SettingsError,
    model: type[BaseModel],
    *,
    what: str = "",
    sources: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    job: str = "",
    group: str = "",
) -> ReductionConfigError:
    """One :class:`ReductionConfigError` for every problem of ``err``, raised by
    validating ``model``, on one line: ``WHAT: PROBLEM; PROBLEM``.

    Each problem names its source and value (``actor_rollout_ref.lossreduce.mode=bogus``,
    ``LOSSREDUCE_MODE=bogus``, ``--workers 0``), the reason, and what is allowed: a
    choice field's choices, a number's bounds, a model's keys for an unknown one.
    ``sources`` maps each field the caller gave to its label (a label starting with
    ``--`` is a flag, shown as ``--flag VALUE``); a field not in it was read from its
    environment variable in ``environ`` (default ``os.environ``) if that is set, else
    it is named by its field name. A check across fields keeps its own message,
    followed by where the fields it names came from.
    """
    env = os.environ if environ is None else environ
    context = _Context(model, sources or {}, env)
    if isinstance(err, SettingsError):
        problems = [context.unparsable(err)]
    else:
        problems = [context.problem(dict(p)) for p in err.errors()]
    message = "; ".join(problems).replace("\n", " ")
    return ReductionConfigError(f"{what}: {message}" if what else message, job=job, group=group)


def allowed_values(field: FieldInfo) -> str | None:
    """What ``field`` accepts, as the end of an error message: its choices
    (``one of a, b``), ``true or false``, a number's bounds (``a number > 0 and <= 1e+06``),
    a text's pattern or length; None when nothing short says it."""
    annotation = field.annotation
    choices = field_choices(annotation)
    if choices:
        return "one of " + ", ".join(choices)
    members = [m for m in _members(annotation) if m is not type(None)]
    if members == [bool]:
        return "true or false"
    bounds = [
        f"{symbol} {_number(getattr(meta, name))}"
        for meta in field.metadata
        for name, symbol in _BOUNDS
        if getattr(meta, name, None) is not None
    ]
    if int in members or float in members:
        kind = "a number" if float in members else "an integer"
        return " ".join([kind, " and ".join(bounds)]) if bounds else kind
    if str in members:
        pattern = next((m.pattern for m in field.metadata if getattr(m, "pattern", None)), None)
        if pattern is not None:
            return f"text matching {pattern}"
        low = next((m.min_length for m in field.metadata if getattr(m, "min_length", None)), None)
        if low is not None:
            return f"text of at least {low} character{'s' if low != 1 else ''}"
    return None


class _Context:
    """How to name the fields of one validation of ``model``."""

    def __init__(
        self, model: type[BaseModel], sources: Mapping[str, str], environ: Mapping[str, str]
    ) -> None:
        self.model = model
        self.sources = sources
        self.environ = environ

    def env_value(self, field: str) -> tuple[str, str] | None:
        """(variable, raw text) where ``field`` was not given and its variable is set."""
        if field in self.sources or field not in self.model.model_fields:
            return None
        name = env_name(self.model, field)
        if name is None:
            return None
        if name in self.environ:
            return name, self.environ[name]
        # pydantic_settings matches variable names in any case unless told otherwise.
        if not self.model.model_config.get("case_sensitive", False):
            for key, value in self.environ.items():
                if key.upper() == name:
                    return key, value
        return None

    def problem(self, problem: dict[str, Any]) -> str:
        loc = tuple(problem["loc"])
        reason = str(problem["msg"]).removeprefix("Value error, ")
        kind = str(problem["type"])
        if not loc or not isinstance(loc[0], str):
            return reason + self.involved(reason, problem.get("input"))
        top = loc[0]
        path, field, owner = _resolve(self.model, loc, keep_last=kind == "extra_forbidden")
        secret = field is not None and _is_secret(field.annotation)
        value = _MASK if secret else _shown(problem.get("input"))
        from_env = self.env_value(top)
        if from_env is not None:
            variable, raw = from_env
            hidden = secret or _holds_secret(self.model.model_fields[top])
            pair = f"{variable}={_MASK if hidden else raw}"
            if len(path) > 1:
                # A whole model read from one variable (JSON): name the field inside it.
                reason = f"{'.'.join(path[1:])}={value}: {reason}"
        else:
            label = self.sources.get(top, top)
            full = label + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path[1:])
            pair = f"{full} {value}" if full.startswith("--") else f"{full}={value}"
        if kind == "extra_forbidden":
            return f"{pair}: no such setting (allowed: {', '.join(owner.model_fields)})"
        if kind in _CHOICE_ERRORS and field is not None and field_choices(field.annotation):
            return f"{pair}: must be one of {', '.join(field_choices(field.annotation))}"
        # A text's pattern or length is already in pydantic's reason.
        allowed = allowed_values(field) if field is not None and "string_" not in kind else None
        return f"{pair}: {reason}" + (f" (allowed: {allowed})" if allowed else "")

    def involved(self, message: str, values: object) -> str:
        """`` (from A=1, B=2)``: where the fields a cross-field check's message names
        came from, unless the message already says it."""
        given = values if isinstance(values, Mapping) else {}
        parts: list[str] = []
        for field in self.model.model_fields:
            if not re.search(rf"(?<![\w-]){re.escape(field)}\b", message):
                continue
            from_env = self.env_value(field)
            if from_env is not None:
                variable, raw = from_env
                hidden = _holds_secret(self.model.model_fields[field])
                parts.append(f"{variable}={_MASK if hidden else raw}")
            elif field in self.sources and field in given:
                label = self.sources[field]
                if label != field and label not in message:
                    value = given[field]
                    parts.append(
                        f"{label} {_shown(value)}"
                        if label.startswith("--")
                        else f"{label}={_shown(value)}"
                    )
        return f" (from {', '.join(parts)})" if parts else ""

    def unparsable(self, err: SettingsError) -> str:
        """pydantic_settings could not decode a variable (a model field wants JSON)."""
        found = re.search(r'field "(\w+)"', str(err))
        field = found.group(1) if found else None
        from_env = self.env_value(field) if field is not None else None
        cause = f": {err.__cause__}" if err.__cause__ is not None else ""
        if field is None or from_env is None:
            return f"{err}{cause}"
        variable, raw = from_env
        if _holds_secret(self.model.model_fields[field]):
            raw = _MASK
        return (
            f"{variable}={raw}: not valid JSON{cause} (allowed: a JSON object of {field}'s fields)"
        )


def _members(annotation: object) -> tuple[object, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _model_of(annotation: object) -> type[BaseModel] | None:
    for member in _members(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _resolve(
    model: type[BaseModel], loc: tuple[Any, ...], *, keep_last: bool
) -> tuple[list[str], FieldInfo | None, type[BaseModel]]:
    """The field path of ``loc`` (without pydantic's union-member tags), the
    field it ends at, and the model that holds that field."""
    path: list[str] = []
    field: FieldInfo | None = None
    owner: type[BaseModel] = model
    current: type[BaseModel] | None = model
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path.append(str(part))
            continue
        if current is not None and part in current.model_fields:
            owner = current
            field = current.model_fields[part]
            path.append(part)
            current = _model_of(field.annotation)
        elif keep_last and i == len(loc) - 1:
            owner = current or owner
            field = None
            path.append(str(part))
    return path, field, owner


def _is_secret(annotation: object) -> bool:
    return any(m in (SecretStr, SecretBytes) for m in _members(annotation))


def _holds_secret(field: FieldInfo) -> bool:
    """Whether ``field``, or a model it holds (read from one variable as JSON), is secret."""
    if _is_secret(field.annotation):
        return True
    inner = _model_of(field.annotation)
    return inner is not None and any(_holds_secret(f) for f in inner.model_fields.values())


def _number(bound: object) -> str:
    return format(bound, "g") if isinstance(bound, float) else str(bound)


def _shown(value: object) -> str:
    """A value as typed: text as is (quoted when empty or padded), enums by value."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str):
        return repr(value) if value != value.strip() or not value else value
    if isinstance(value, list | tuple):
        return ",".join(_shown(v) for v in value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    return str(value)
