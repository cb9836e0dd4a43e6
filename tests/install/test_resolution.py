"""lossreduce installs into each framework's environment without changing it (pip's resolver).

For every stack of :data:`tests.install.stacks.STACKS`, pip resolves the framework's
install alone and with ``lossreduce[extra]`` (this checkout): both resolve, the second
installs lossreduce, and every watched package the stack has (torch, protobuf,
transformers, vllm, sglang, ray) keeps the version the stack picked. The installs of
:data:`~tests.install.stacks.UNRESOLVABLE` fail even alone, for the reason recorded.

Opt-in (network, minutes): ``make test-resolve`` (tests/install/conftest.py). The checks
are ``resolution_report``'s: the main run applies them to the committed outcome
(``resolutions.json``, ``test_resolution_report.py``) instead of resolving.
"""

from __future__ import annotations

import pytest

from tests.install import stacks
from tests.install.conftest import Results, param_id
from tests.install.resolution_report import fact_problems, side, stack_problems, stack_record

pytestmark = [pytest.mark.resolution, pytest.mark.timeout(3600)]


def _fail_on(problems: list[str], *results: stacks.Resolution | stacks.Failure) -> None:
    """Fails the test with ``problems`` and pip's last lines of every failed resolution."""
    if problems:
        errors = [str(r.error) for r in results if isinstance(r, stacks.Failure)]
        pytest.fail("\n".join([*problems, *errors]), pytrace=False)


@pytest.mark.parametrize("stack", stacks.STACKS, ids=param_id)
def test_lossreduce_installs_into_the_stack_unchanged(
    stack: stacks.Stack, resolutions: Results
) -> None:
    (outcome,) = [o for o in resolutions[0] if o.stack == stack]
    _fail_on(stack_problems(stack, stack_record(outcome)), outcome.alone, outcome.together)


@pytest.mark.parametrize("fact", stacks.UNRESOLVABLE, ids=param_id)
def test_the_install_does_not_resolve_even_alone(
    fact: stacks.Unresolvable, resolutions: Results
) -> None:
    (result,) = [r for u, r in resolutions[1] if u == fact]
    _fail_on(fact_problems(fact, side(result)), result)
