"""A stand-in for SkyRL's vLLM inference server, sampling with Hugging Face on CPU.

SkyRL 0.4 generates through vLLM servers over HTTP (``RemoteInferenceClient``) and
pushes the policy's weights to them after every update with vLLM's weight-transfer
engine (NCCL). Neither runs without a GPU, so the CPU launch points SkyRL at this
server as an external one (``generator.inference_engine.external_proxy_url`` and
``external_server_urls``) and replaces the trainer's weight-transfer engine with
:class:`StandinWeightSender` (through :func:`standin_trainer_engine`, which the CPU
worker setup installs as ``weight_senders.build_trainer_engine``). Everything else of
SkyRL's generation is its own: its generator, its environments, its client.

The server answers what ``RemoteInferenceClient`` asks of a vLLM server in a
non-colocated synchronous run: ``/inference/v1/generate`` (token in, token out, with
each token's log-probability), ``/get_world_size``, and the lifecycle calls
(``/pause``, ``/resume``, ``/sleep``, ``/wake_up``, ``/is_sleeping``,
``/reset_prefix_cache``, ``/finish_session``), which change nothing here. Weights
arrive at :data:`LOAD_WEIGHTS` as a ``torch.save`` of the full state dict.

Sampling is reproducible whatever order the requests arrive in: each request draws
from a generator seeded by the server's seed, the prompt's tokens and the request's
session id (SkyRL's ``<prompt uid>_<repetition>``), so a resumed run that reaches the
same weights samples the same responses. For CPU runs and tests only.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "LOAD_WEIGHTS",
    "StandinServer",
    "StandinWeightSender",
    "main",
    "sample",
    "standin_trainer_engine",
]

LOAD_WEIGHTS = "/lossreduce/standin/load_weights"
"""Where :class:`StandinWeightSender` posts the policy's weights."""


@dataclass
class _Policy:
    """The server's copy of the policy and what it has loaded."""

    model: Any
    eos: int
    seed: int
    loads: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _request_seed(seed: int, prompt: list[int], session: str) -> int:
    digest = hashlib.sha256(json.dumps([seed, prompt, session]).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def sample(
    model: Any,
    prompt: list[int],
    *,
    max_tokens: int,
    temperature: float,
    eos: int,
    generator: torch.Generator,
) -> tuple[list[int], list[float], str]:
    """Sample up to ``max_tokens`` tokens after ``prompt`` from the model's whole
    vocabulary (the distribution SkyRL's trainer computes log-probabilities in):
    (tokens, their log-probabilities, vLLM's finish reason)."""
    ids = torch.tensor([prompt])
    tokens: list[int] = []
    log_probs: list[float] = []
    for _ in range(max_tokens):
        logits = model(input_ids=ids).logits[0, -1].float() / max(temperature, 1e-6)  # [V]
        logp = torch.log_softmax(logits, dim=-1)
        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
        tokens.append(token)
        log_probs.append(float(logp[token]))
        if token == eos:
            return tokens, log_probs, "stop"
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, log_probs, "length"


class StandinServer:
    """The HTTP server: one policy, answering SkyRL's client on ``host:port``."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        model.eval()
        self.policy = _Policy(model=model, eos=int(model.config.eos_token_id), seed=seed)

    def generate(self, body: dict[str, Any], session: str) -> dict[str, Any]:
        prompt = [int(t) for t in body["token_ids"]]
        params = body.get("sampling_params") or {}
        generator = torch.Generator().manual_seed(_request_seed(self.policy.seed, prompt, session))
        with self.policy.lock:
            tokens, log_probs, reason = sample(
                self.policy.model,
                prompt,
                max_tokens=int(params.get("max_tokens") or 16),
                temperature=float(params.get("temperature", 1.0)),
                eos=self.policy.eos,
                generator=generator,
            )
        choice: dict[str, Any] = {"token_ids": tokens, "finish_reason": reason}
        if params.get("logprobs") is not None:
            choice["logprobs"] = {"content": [{"logprob": lp} for lp in log_probs]}
        return {"choices": [choice]}

    def load_weights(self, payload: bytes) -> dict[str, Any]:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        with self.policy.lock:
            self.policy.model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
            self.policy.loads += 1
            return {"loads": self.policy.loads}

    def app(self) -> Any:
        from aiohttp import web

        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            session = request.headers.get("X-Session-ID", "")
            answer = await asyncio.to_thread(self.generate, body, session)
            return web.json_response(answer)

        async def load(request: web.Request) -> web.Response:
            answer = await asyncio.to_thread(self.load_weights, await request.read())
            return web.json_response(answer)

        async def world_size(_: web.Request) -> web.Response:
            return web.json_response({"world_size": 1})

        async def sleeping(_: web.Request) -> web.Response:
            return web.json_response({"is_sleeping": False})

        async def nothing(_: web.Request) -> web.Response:
            return web.json_response({})

        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/inference/v1/generate", generate)
        app.router.add_post(LOAD_WEIGHTS, load)
        app.router.add_get("/get_world_size", world_size)
        app.router.add_get("/is_sleeping", sleeping)
        for path in ("/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache"):
            app.router.add_post(path, nothing)
        app.router.add_post("/finish_session", nothing)
        app.router.add_get("/health", nothing)
        return app


# -- the trainer's side -----------------------------------------------------------------


class StandinWeightSender:
    """The trainer's weight-transfer engine for the stand-in server: every rank gathers
    the full weights (the source's iteration is a collective), rank 0 posts them."""

    skyrl_handles_prefix_cache_reset = False
    skyrl_force_disable_expandable_segments = False
    skyrl_empty_cache_after_send = False
    skyrl_draft_source = None

    def __init__(self, source: Any, rank: int, server_urls: list[str]) -> None:
        self.source = source
        self.rank = rank
        self.server_urls = server_urls

    def _gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.source:
            yield name, tensor.detach().cpu()

    def send_weights(self) -> None:
        state = dict(self._gathered())
        if self.rank != 0:
            return
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getvalue()
        for url in self.server_urls:
            request = urllib.request.Request(f"{url}{LOAD_WEIGHTS}", data=payload, method="POST")
            with urllib.request.urlopen(request, timeout=300) as response:
                response.read()

    def shutdown(self) -> None:
        return None


def standin_trainer_engine(
    *,
    ie_cfg: Any,
    colocate_all: bool,
    rank: int,
    inference_world_size: int,
    source_factory: Any,
    draft_source_factory: Any,
    server_urls: list[str],
    data_parallel_size: int,
    base_model_path: str | None = None,
) -> StandinWeightSender:
    """What SkyRL's ``build_trainer_engine`` returns, for the stand-in server (its
    signature, so that the worker's ``init_weight_sync_state`` calls it unchanged)."""
    del colocate_all, inference_world_size, draft_source_factory, data_parallel_size
    del base_model_path
    from skyrl.train.utils.utils import str_to_torch_dtype

    source = source_factory(str_to_torch_dtype(ie_cfg.model_dtype), "nccl")
    return StandinWeightSender(source, rank, list(server_urls))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the policy's folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seed", type=int, default=1, help="the sampling seed")
    options = parser.parse_args(argv)
    from aiohttp import web

    torch.set_num_threads(1)
    server = StandinServer(options.model, options.seed)
    web.run_app(server.app(), host=options.host, port=options.port, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
