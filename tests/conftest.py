"""Fixtures shared by every test package: a real coordinator on free loopback ports.

- ``free_port`` (a fixture, and :func:`lossreduce.ports.free_port` itself):
  a TCP port on 127.0.0.1 that was free a moment ago.
- ``coordinator_factory(**overrides)``: start a :class:`CoordinatorThread`
  (gRPC on port 0, metrics on port 0, 2 s round timeout, 0.5 s shutdown grace
  unless overridden by :class:`CoordinatorSettings` field names); every one it
  started is stopped when the test ends.
- ``coordinator``: one such coordinator with the defaults; ``.target`` is
  ``"127.0.0.1:PORT"``, ``.metrics_url`` its ``/metrics``. Parametrize it
  indirectly with a dict of overrides:
  ``@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 0.5}], indirect=True)``.
- ``ranks``: raw generated stubs talking to ``coordinator`` (``tests.raw_stub``).
- ``flag_error(main, argv, capsys, prog)``: run a command's ``main`` on bad flags,
  check it exits 2 with one line ``PROG: error: ...``, return that message.

A run ends with its own exit status without the interpreter's teardown, naming any
non-daemon thread a test left running (:func:`pytest_unconfigure`).

A test marked ``extended`` repeats, for the same framework, what another check of
``make test`` already shows (a second kill-and-resume variant of a launch): it is
skipped, saying so, unless ``LOSSREDUCE_EXTENDED=1`` (``make test-all``).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from lossreduce.ports import free_port
from lossreduce.server import CoordinatorSettings, CoordinatorThread
from tests.raw_stub import Ranks
from tests.ray_support import GCS_PORT_WAIT_S

# Every Ray start of the run (local_ray, the 3-raylet cluster, lossreduce train's own
# and the CLI's) waits this long for its GCS: Ray's 30 s is short on a loaded machine.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(GCS_PORT_WAIT_S))

CoordinatorFactory = Callable[..., CoordinatorThread]

EXTENDED = "LOSSREDUCE_EXTENDED"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "extended: repeats, for the same framework, what another check of `make test` "
        f"shows; runs with {EXTENDED}=1 (`make test-all`)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(EXTENDED) == "1":
        return
    skip = pytest.mark.skip(
        reason="repeats what another check of `make test` shows: `make test-all` runs it "
        "(docs/development.md, What `make test-all` adds)"
    )
    for item in items:
        if item.get_closest_marker("extended") is not None:
            item.add_marker(skip)


TEST_SETTINGS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 0,
    "metrics_port": 0,
    "round_timeout_s": 2.0,
    "shutdown_grace_s": 0.5,
}
"""What the coordinator fixtures change from the production defaults."""


@pytest.fixture(name="free_port")
def free_port_fixture() -> Callable[[], int]:
    """``free_port()`` as a fixture: call it for each port you need."""
    return free_port


def flag_error(
    main: Callable[[Sequence[str]], int],
    argv: Sequence[str],
    capsys: pytest.CaptureFixture[str],
    prog: str,
) -> str:
    """``main(argv)`` must exit 2 printing exactly one line, ``PROG: error: MESSAGE``
    (every ``lossreduce`` command reports bad flags so); returns ``MESSAGE``."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"{prog}: error: "), err
    return err.removeprefix(f"{prog}: error: ").rstrip("\n")


@pytest.fixture
def coordinator_factory() -> Iterator[CoordinatorFactory]:
    started: list[CoordinatorThread] = []

    def make(**overrides: Any) -> CoordinatorThread:
        settings = CoordinatorSettings.model_validate({**TEST_SETTINGS, **overrides})
        thread = CoordinatorThread(settings).start()
        started.append(thread)
        return thread

    yield make
    for thread in reversed(started):
        thread.stop()


@pytest.fixture(scope="module")
def coordinator_target() -> Iterator[str]:
    """A coordinator on a free loopback port for one test module's cases: its address."""
    thread = CoordinatorThread(CoordinatorSettings.model_validate(TEST_SETTINGS)).start()
    yield thread.target
    thread.stop()


@pytest.fixture
def coordinator(
    request: pytest.FixtureRequest, coordinator_factory: CoordinatorFactory
) -> CoordinatorThread:
    overrides: dict[str, Any] = getattr(request, "param", {})
    return coordinator_factory(**overrides)


@pytest.fixture
def ranks(coordinator: CoordinatorThread) -> Iterator[Ranks]:
    """:class:`tests.raw_stub.Ranks` talking to the ``coordinator`` fixture."""
    r = Ranks(coordinator.target)
    yield r
    r.close()


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


def _threads_left() -> list[threading.Thread]:
    """The non-daemon threads still running besides the main one."""
    main = threading.main_thread()
    return [t for t in threading.enumerate() if t is not main and not t.daemon]


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Once every report is written, end the process with the run's status, skipping
    the interpreter's teardown.

    One process here loads Ray's core worker, grpcio and torch, each with a gRPC or
    C++ runtime of its own, and their static destructors at exit run in no set
    order: the teardown died of SIGSEGV, printing no stack, after every test had
    passed, in the floor cell (Python 3.10, grpcio 1.72.1, Ray 2.57.1) once and in
    verl's lane on a fresh clone once. A thread still running then helps nobody: the
    teardown would join a non-daemon one (an idle executor's worker, which AReaL's
    suite leaves), or hang on a stuck one. Its name is printed instead, so that what
    a test did not stop shows. ``LOSSREDUCE_TEST_TEARDOWN=full`` runs the teardown
    (``PYTHONFAULTHANDLER``, which the Makefile sets, prints each thread's stack if
    it crashes).
    """
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None or os.environ.get("LOSSREDUCE_TEST_TEARDOWN") == "full":
        return
    left = _threads_left()
    if left:
        names = ", ".join(sorted(t.name for t in left))
        print(f"conftest: threads left running at exit: {names}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
