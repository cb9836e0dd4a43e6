"""The public surfaces (``__all__``) are honest, and what they export works.

Every exported name resolves to an object of that name (not an alias of
something else), every exported exception is one the wire or ``lossreduce
serve`` can report, and the documented entry points construct and serve.
"""

from __future__ import annotations

import importlib
import inspect
import math
from types import ModuleType

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from lossreduce import server
from lossreduce.errors import LossReduceError
from lossreduce.server.hardening import CONFIG_ERRORS
from lossreduce.status_codec import from_status, to_status
from tests.raw_stub import CALL_TIMEOUT_S

PUBLIC_MODULES = (
    "lossreduce.server",
    "lossreduce.errors",
    "lossreduce.status_codec",
    "lossreduce.settings_cli",
    "lossreduce.ports",
)


def _exports(name: str) -> tuple[ModuleType, list[str]]:
    module = importlib.import_module(name)
    return module, list(module.__all__)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_exported_name_resolves_once_to_an_object_of_that_name(module_name: str) -> None:
    module, names = _exports(module_name)
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)
    for name in names:
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__name__ == name, f"{module_name}.{name} is {obj.__qualname__}"
            assert obj.__module__.startswith("lossreduce."), (name, obj.__module__)


def _exported_exceptions(module_name: str) -> list[type[BaseException]]:
    module, names = _exports(module_name)
    found = [getattr(module, n) for n in names]
    return [obj for obj in found if inspect.isclass(obj) and issubclass(obj, BaseException)]


@pytest.mark.parametrize(
    "exc",
    _exported_exceptions("lossreduce.server") + _exported_exceptions("lossreduce.errors"),
    ids=lambda e: e.__name__,
)
def test_every_exported_exception_is_reportable(exc: type[BaseException]) -> None:
    """A lossreduce error survives the status codec with its type and context; the
    server's own exceptions are configuration errors ``serve`` reports as one line."""
    if not issubclass(exc, LossReduceError):
        assert issubclass(exc, CONFIG_ERRORS), (
            f"{exc.__name__} is neither on the wire nor a config error"
        )
        return
    err = exc("bad value", job="j", group="g", step=3, rank=1, terms=["t"], values=[math.inf])
    back = from_status(to_status(err))
    # An abstract class (no reason of its own) travels as the base error.
    assert type(back) is (exc if exc.reason != "UNKNOWN" else LossReduceError)
    assert back.message == "bad value"
    assert (back.job, back.group, back.step, back.rank) == ("j", "g", 3, 1)
    assert (back.terms, back.values) == (("t",), (math.inf,))


def test_settings_validate_their_bounds() -> None:
    defaults = server.CoordinatorSettings()
    assert defaults.round_timeout_s > 0
    with pytest.raises(ValidationError, match="round_timeout_s"):
        server.CoordinatorSettings(round_timeout_s=0)
    with pytest.raises(ValidationError, match="extra"):
        server.CoordinatorSettings.model_validate({"round_timeout": 3})


def test_round_table_constructs_from_settings_alone() -> None:
    table = server.RoundTable(server.CoordinatorSettings())
    assert isinstance(table, server.RoundTable)


def test_the_async_entry_points_are_coroutines() -> None:
    assert inspect.iscoroutinefunction(server.serve)
    assert inspect.iscoroutinefunction(server.start)


def test_coordinator_thread_serves_health_on_its_target(
    coordinator: server.CoordinatorThread,
) -> None:
    assert coordinator.target.startswith("127.0.0.1:")
    with grpc.insecure_channel(coordinator.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", server.SERVICE_NAME):
            reply = health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT_S
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
