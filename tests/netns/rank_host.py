"""The ranks of one node: a process in the node's namespace, one shipped client per rank.

Run as a script (``python rank_host.py --target ... --ranks 0,1 ...``) so the
child imports only the installed package. Each rank gets its own
:class:`~lossreduce.client.AsyncReductionClient` (its own channel and TCP
connection, as separate rank processes would have). It reads one JSON command
per stdin line:

- ``{"step": S}`` (optionally ``"ranks": [...]``): those ranks reduce step S
  concurrently; each writes one JSON line when its call ends:
  ``{"rank", "step", "ok", "normalizers" (term -> float.hex), "error" (class
  name), "message", "seconds"}``.
- ``{"quit": true}``: close the clients and exit.

:func:`partials` is the one definition of what rank ``r`` sends at step ``s``
(the tests compute the expected global normalizers from it with ``math.fsum``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

TERMS = ("tokens", "groups")
CONTRACTS = {"tokens": "mean:token_mean", "groups": "mean:prompt_mean"}


def partials(seed: int, rank: int, step: int) -> dict[str, float]:
    """Random doubles, so a contribution counted twice or lost changes the sum."""
    rng = random.Random(f"{seed}/{rank}/{step}")
    return {"tokens": float(rng.randrange(1, 4096)), "groups": rng.uniform(0.0, 1e6)}


async def _reduce(client: object, seed: int, rank: int, step: int) -> dict[str, object]:
    from lossreduce.client import AsyncReductionClient, LossReduceError

    assert isinstance(client, AsyncReductionClient)
    started = time.monotonic()
    line: dict[str, object] = {"rank": rank, "step": step}
    try:
        result = await client.reduce(step, partials(seed, rank, step), CONTRACTS)
    except LossReduceError as err:
        line.update(ok=False, error=type(err).__name__, message=str(err))
    else:
        line.update(ok=True, normalizers={t: v.hex() for t, v in result.items()})
    line["seconds"] = time.monotonic() - started
    return line


async def _main(args: argparse.Namespace) -> None:
    from lossreduce.client import AsyncReductionClient, ClientSettings

    settings = ClientSettings.model_validate({"token": None, **json.loads(args.settings)})
    ranks = [int(r) for r in args.ranks.split(",")]
    clients = {
        r: AsyncReductionClient(
            args.target,
            job=args.job,
            group="actor",
            rank=r,
            world_size=args.world,
            settings=settings,
        )
        for r in ranks
    }
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    async def one(rank: int, step: int) -> None:
        line = await _reduce(clients[rank], args.seed, rank, step)
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()

    print(json.dumps({"ready": ranks}), flush=True)
    while True:
        text = await loop.run_in_executor(None, sys.stdin.readline)
        if not text:
            break
        command = json.loads(text)
        if command.get("quit"):
            break
        for rank in command.get("ranks", ranks):
            task = loop.create_task(one(rank, int(command["step"])))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for client in clients.values():
        await client.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--ranks", required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--settings", default="{}")
    asyncio.run(_main(parser.parse_args()))
