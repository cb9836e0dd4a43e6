"""lossreduce installs into each framework's environment without changing it (pip's resolver).

For every stack of :data:`tests.install.stacks.STACKS`, pip resolves the framework's
install alone and with ``lossreduce[extra]`` (this checkout): both resolve, the second
installs lossreduce, and every watched package the stack has (torch, protobuf,
transformers, vllm, sglang, ray) keeps the version the stack picked. The installs of
:data:`~tests.install.stacks.UNRESOLVABLE` fail even alone, for the reason recorded.

Opt-in (network, minutes): ``make test-resolve`` (tests/install/conftest.py).
"""

from __future__ import annotations

import re

import pytest

from tests.install import stacks
from tests.install.conftest import Results

pytestmark = [pytest.mark.resolution, pytest.mark.timeout(3600)]


def _id(entry: stacks.Stack | stacks.Unresolvable) -> str:
    return re.sub(r"\W+", "-", entry.name).strip("-") + f"-py{entry.python}"


def _outcome(results: Results, stack: stacks.Stack) -> stacks.Outcome:
    (outcome,) = [o for o in results[0] if o.stack == stack]
    return outcome


@pytest.mark.parametrize("stack", stacks.STACKS, ids=_id)
def test_lossreduce_installs_into_the_stack_unchanged(
    stack: stacks.Stack, resolutions: Results
) -> None:
    outcome = _outcome(resolutions, stack)
    for result in (outcome.alone, outcome.together):
        if isinstance(result, stacks.Failure):
            pytest.fail(str(result.error), pytrace=False)
    assert isinstance(outcome.alone, stacks.Resolution)
    assert isinstance(outcome.together, stacks.Resolution)
    alone, together = outcome.alone.versions, outcome.together.versions
    assert "lossreduce" in together, (
        f"{stack.id}: lossreduce[{stack.extra}] did not put lossreduce in the install list"
    )
    assert "lossreduce" not in alone
    watched_alone = {name: alone[name] for name in stacks.WATCHED if name in alone}
    watched_together = {name: together.get(name) for name in watched_alone}
    assert watched_together == watched_alone, f"{stack.id}: {outcome.verdict}"
    assert "torch" in watched_alone, f"{stack.id}: the stack resolved without torch"


@pytest.mark.parametrize("fact", stacks.UNRESOLVABLE, ids=_id)
def test_the_install_does_not_resolve_even_alone(
    fact: stacks.Unresolvable, resolutions: Results
) -> None:
    (result,) = [r for u, r in resolutions[1] if u == fact]
    assert isinstance(result, stacks.Failure), (
        f"{fact.id}: {' '.join(fact.specs)} resolves now: move it to STACKS"
    )
    assert fact.expect in result.error.output, str(result.error)
