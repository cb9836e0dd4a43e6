"""The node agent's upstream: a broken stream is reopened and resent without
losing a decided round; an unreachable coordinator or refused credentials are
named; ``lossreduce status`` and the blocking :class:`NodeAgentThread` work
through an agent."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from typing import Any

import grpc
import pytest
from pydantic import SecretStr

from lossreduce.client import (
    AsyncReductionClient,
    AuthenticationError,
    ClientSettings,
    CoordinatorUnavailableError,
    LossReduceError,
    ReductionClient,
    status_cli,
)
from lossreduce.client.agent import AgentSettings, NodeAgent, NodeAgentThread
from lossreduce.v2 import coordinator_pb2 as pb
from lossreduce.v2 import coordinator_pb2_grpc as pb_grpc
from tests.client.test_agent import run
from tests.server.test_tls import Authority, Issued
from tests.tcp_proxy import TcpProxy

JOB, GROUP = "agent-up", "actor"
CONTRACTS = {"n": "mean:token_mean"}
TOKEN = "agent-test-token-0123456789abcdef"
OTHER_TOKEN = "another-token-0123456789abcdef"


def rank_settings(**overrides: Any) -> ClientSettings:
    base: dict[str, Any] = {
        "retry_budget_s": 0.5,
        "initial_backoff_s": 0.02,
        "max_backoff_s": 0.1,
        "call_timeout_s": 30.0,
        "token": None,
    }
    return ClientSettings.model_validate({**base, **overrides})


def agent_settings(ranks: tuple[int, ...], **overrides: Any) -> AgentSettings:
    base: dict[str, Any] = {
        "local_ranks": ranks,
        "retry_budget_s": 5.0,
        "initial_backoff_s": 0.02,
        "max_backoff_s": 0.1,
        "shutdown_grace_s": 0.2,
        "token": None,
    }
    return AgentSettings.model_validate({**base, **overrides})


async def reduce(
    target: str, rank: int, world: int, step: int, value: float, *, settings: ClientSettings
) -> dict[str, float] | LossReduceError:
    async with AsyncReductionClient(
        target, job=JOB, group=GROUP, rank=rank, world_size=world, settings=settings
    ) as client:
        try:
            return await client.reduce(step, {"n": value}, CONTRACTS)
        except LossReduceError as err:
            return err


async def arrived(target: str, step: int, ranks: set[int]) -> None:
    """Return once the coordinator's round ``step`` holds ``ranks`` (bounded by ``run``)."""
    key = pb.RoundKey(job=JOB, group=GROUP, step=step)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.ReductionCoordinatorStub(channel)
        while not ranks <= set((await stub.GetRound(pb.GetRoundRequest(round=key))).arrived_ranks):
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("coordinator", [{"round_timeout_s": 60.0}], indirect=True)
def test_a_broken_upstream_is_reopened_and_no_decided_round_is_lost(coordinator):
    """Agent A (ranks 0, 1) reaches the coordinator through a proxy; its round is
    upstream when the link is cut, and node B completes the round meanwhile. A
    reopens its stream, sends its contribution again and gets the stored
    outcome: every rank gets the same normalizers, counted once."""

    async def main() -> tuple[list[Any], float, int]:
        proxy = TcpProxy(coordinator.port)
        await proxy.start()
        a = NodeAgent(f"127.0.0.1:{proxy.port}", settings=agent_settings((0, 1)))
        b = NodeAgent(coordinator.target, settings=agent_settings((2, 3)))
        await a.start()
        await b.start()
        try:
            ranks = rank_settings(retry_budget_s=5.0)
            on_a = [
                asyncio.create_task(reduce(a.target, r, 4, 1, r + 1.0, settings=ranks))
                for r in (0, 1)
            ]
            await arrived(coordinator.target, 1, {0, 1})
            proxy.cut()
            on_b = [reduce(b.target, r, 4, 1, r + 1.0, settings=ranks) for r in (2, 3)]
            results = list(await asyncio.gather(*on_a, *on_b))
            # The next round goes up the new stream.
            nxt = [reduce(a.target, r, 4, 2, 1.0, settings=ranks) for r in (0, 1)]
            nxt += [reduce(b.target, r, 4, 2, 1.0, settings=ranks) for r in (2, 3)]
            results += await asyncio.gather(*nxt)
            reconnects = a.metrics.registry.get_sample_value(
                "lossreduce_agent_upstream_reconnects_total", {"job": JOB, "group": GROUP}
            )
            return results, reconnects or 0.0, proxy.accepted
        finally:
            await a.stop()
            await b.stop()
            await proxy.close()

    results, reconnects, accepted = run(main)
    assert results == [{"n": 10.0}] * 4 + [{"n": 4.0}] * 4, results
    assert reconnects >= 1
    assert accepted >= 2


def test_an_unreachable_upstream_is_named(free_port):
    upstream = f"127.0.0.1:{free_port()}"

    async def main() -> tuple[LossReduceError | dict[str, float], BaseException]:
        agent = NodeAgent(upstream, settings=agent_settings((0,), retry_budget_s=0.2))
        await agent.start()
        try:
            result = await reduce(
                agent.target, 0, 1, 1, 1.0, settings=rank_settings(retry_budget_s=0.0)
            )
            with pytest.raises(CoordinatorUnavailableError) as checked:
                await agent.check_upstream()
            return result, checked.value
        finally:
            await agent.stop()

    result, checked = run(main)
    assert isinstance(result, CoordinatorUnavailableError), result
    assert f"the coordinator at {upstream} is unavailable to the node" in str(result)
    assert "step 1" in str(result)
    assert upstream in str(checked)
    assert "cannot be reached" in str(checked)


def test_one_outage_spends_one_retry_budget_for_every_request(coordinator_factory, free_port):
    """A rank's client retries the node's UNAVAILABLE; the node's budget counts from the
    outage's start, not afresh per re-send, so the rank hears within its own budget plus
    the node's once; once the coordinator answers again, the outage is over."""
    port = free_port()
    upstream = f"127.0.0.1:{port}"
    budget_s = 1.0

    async def main() -> tuple[list[float], Any]:
        loop = asyncio.get_running_loop()
        agent = NodeAgent(upstream, settings=agent_settings((0,), retry_budget_s=budget_s))
        await agent.start()
        took = []
        try:
            for step in (1, 2):
                started = loop.time()
                result = await reduce(
                    agent.target, 0, 1, step, 1.0, settings=rank_settings(retry_budget_s=0.0)
                )
                assert isinstance(result, CoordinatorUnavailableError), result
                took.append(loop.time() - started)
            await asyncio.to_thread(coordinator_factory, port=port)
            after = await reduce(
                agent.target, 0, 1, 3, 1.0, settings=rank_settings(retry_budget_s=5.0)
            )
            return took, after
        finally:
            await agent.stop()

    (first, second), after = run(main)
    assert first >= budget_s * 0.8, first  # the node retried for its budget
    assert second < budget_s / 2, second  # the same outage: one attempt, no second budget
    assert after == {"n": 1.0}


def test_refused_credentials_are_named_and_ranks_need_the_agents_token(coordinator_factory):
    coordinator = coordinator_factory(metrics_port=None, token=TOKEN)

    async def main() -> list[Any]:
        wrong = NodeAgent(coordinator.target, settings=agent_settings((0,), token=OTHER_TOKEN))
        right = NodeAgent(coordinator.target, settings=agent_settings((0,), token=TOKEN))
        await wrong.start()
        await right.start()
        try:
            other = rank_settings(token=SecretStr(OTHER_TOKEN))
            refused = await reduce(wrong.target, 0, 1, 1, 1.0, settings=other)
            with pytest.raises(AuthenticationError) as checked:
                await wrong.check_upstream()
            tokenless = await reduce(right.target, 0, 1, 1, 1.0, settings=rank_settings())
            ok = await reduce(
                right.target, 0, 1, 1, 1.0, settings=rank_settings(token=SecretStr(TOKEN))
            )
            return [refused, checked.value, tokenless, ok]
        finally:
            await wrong.stop()
            await right.stop()

    refused, checked, tokenless, ok = run(main)
    assert isinstance(refused, AuthenticationError), refused
    assert f"the coordinator at {coordinator.target} refused the node's request" in str(refused)
    assert isinstance(checked, AuthenticationError)
    assert "refused the agent's credentials" in str(checked)
    assert isinstance(tokenless, AuthenticationError), tokenless
    assert "accepts only its ranks' bearer token" in str(tokenless)
    assert ok == {"n": 1.0}


def test_status_and_blocking_clients_work_through_an_agent_thread(coordinator, capsys):
    settings = agent_settings((0, 1))
    with NodeAgentThread(coordinator.target, job=JOB, world_size=2, settings=settings) as agent:
        agent.check_upstream()
        with contextlib.ExitStack() as stack, concurrent.futures.ThreadPoolExecutor(2) as pool:
            clients = [
                stack.enter_context(
                    ReductionClient(
                        agent.target,
                        job=JOB,
                        group=GROUP,
                        rank=r,
                        world_size=2,
                        settings=rank_settings(),
                        run="run-via-agent",
                    )
                )
                for r in (0, 1)
            ]
            calls = [pool.submit(c.reduce, 3, {"n": 2.0}, CONTRACTS) for c in clients]
            assert [f.result() for f in calls] == [{"n": 4.0}] * 2
        assert status_cli.main(["--coordinator", agent.target, "--job", JOB]) == 0
        listing = capsys.readouterr().out
        assert "completed" in listing
        # The agent's one aggregated request named the ranks' run.
        assert "run-via-agent" in listing
        assert f"{JOB}  {GROUP}" in listing
        code = status_cli.main(
            ["--coordinator", agent.target, "--job", JOB, "--group", GROUP, "--step", "3"]
        )
        assert code == 0
        assert "2/2" in capsys.readouterr().out
        assert agent.metrics_url is None


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> tuple[Authority, Issued]:
    """A CA and a certificate it issued for a coordinator on 127.0.0.1."""
    ca = Authority(tmp_path_factory.mktemp("pki"), "agent-test-ca")
    return ca, ca.issue("server", server=True)


def test_an_agent_reaches_a_tls_coordinator_with_an_in_memory_ca(
    coordinator_factory, tls_server: tuple[Authority, Issued]
):
    """The agent's upstream is the client's channel: a CA held in memory verifies a
    TLS coordinator; an agent without it gets no round, naming the coordinator."""
    authority, server = tls_server
    coord = coordinator_factory(metrics_port=None, tls_cert=server.cert, tls_key=server.key)
    ca = authority.root.read_bytes()

    async def main() -> list[Any]:
        trusting = NodeAgent(coord.target, settings=agent_settings((0,), tls_root_cert_pem=ca))
        blind = NodeAgent(coord.target, settings=agent_settings((0,), tls=True, retry_budget_s=0.2))
        await trusting.start()
        await blind.start()
        try:
            settings = rank_settings(retry_budget_s=0.0)
            return [
                await reduce(trusting.target, 0, 1, 1, 3.0, settings=settings),
                await reduce(blind.target, 0, 1, 1, 3.0, settings=settings),
            ]
        finally:
            await trusting.stop()
            await blind.stop()

    ok, refused = run(main)
    assert ok == {"n": 3.0}
    assert isinstance(refused, CoordinatorUnavailableError), refused
    assert f"the coordinator at {coord.target} is unavailable to the node" in str(refused)
