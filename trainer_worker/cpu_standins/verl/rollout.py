"""A CPU-only rollout for verl: HF ``generate`` behind verl's rollout seams.

verl 0.9.1 registers vLLM, SGLang and TensorRT-LLM rollouts only, none of which runs
without a GPU here (vLLM's CPU build 0.32 needs transformers>=5.16.1, verl 0.9.1
needs <5.11: they do not fit one environment). This module registers a rollout
named ``cpu`` (``actor_rollout_ref.rollout.name=cpu``) with verl's two registries
when imported, so ``main_ppo`` runs on CPU with everything else verl's own (its
trainer, TransferQueue, the agent loop, reward, advantages, the reference policy,
the actor update and the weight sync to the rollout):

- :class:`CpuRolloutReplica` (``RolloutReplicaRegistry``): one server actor per
  replica on the node of its training worker, as verl's vLLM replica starts its
  HTTP server;
- :class:`CpuRolloutServer`: the replica's HF causal LM on CPU; ``generate``
  samples one response (token ids and their log-probabilities) per request;
- :class:`CpuRolloutAdapter` (``_ROLLOUT_REGISTRY``, in each training worker):
  verl's actor-to-rollout weight sync (``checkpoint_engine.backend=naive``, the
  synchronous trainer's) hands it the actor's full tensors after every update, and
  it loads them into its replica's server.

Load it in every process with ``VERL_USE_EXTERNAL_MODULES`` (beside
:mod:`.platform`). For tests and CPU-only runs; a GPU run uses verl's engines.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from transformers import AutoModelForCausalLM
from verl.workers.rollout.base import _ROLLOUT_REGISTRY, BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

__all__ = [
    "ROLLOUT_NAME",
    "CpuRolloutAdapter",
    "CpuRolloutReplica",
    "CpuRolloutServer",
    "server_name",
]

ROLLOUT_NAME = "cpu"
"""The ``actor_rollout_ref.rollout.name`` that selects this rollout."""


NAMESPACE = "lossreduce-cpu-rollout"
"""The Ray namespace of the servers: verl's workers and its trainer differ in theirs."""


def server_name(replica_rank: int) -> str:
    """The Ray actor name of replica ``replica_rank``'s server of this Ray job."""
    return f"server-{ray.get_runtime_context().get_job_id()}-{replica_rank}"


class CpuRolloutServer:
    """One replica's policy copy on CPU, answering verl's token-in, token-out requests."""

    def __init__(
        self, model_path: str, response_length: int, seed: int, deterministic: bool = False
    ) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.response_length = response_length
        self.seed = seed
        self.deterministic = deterministic
        self.generator = torch.Generator().manual_seed(seed)
        self.global_steps: int | None = None
        # How many requests for each prompt this weight version has answered.
        self.asked: dict[tuple[int, ...], int] = {}

    def _generator(self, prompt_ids: list[int]) -> torch.Generator:
        """The request's sampling stream.

        With ``rollout.full_determinism``, a stream of its own seeded from the seed,
        the weight version, the prompt and how many times this version was asked
        for it before: the same responses whatever order the agent loop's requests
        arrive in (the samples of one prompt are interchangeable). verl's TransferQueue
        agent loop names every request ``det-0`` then, so the name cannot tell them
        apart. Otherwise one stream per server.
        """
        if not self.deterministic:
            return self.generator
        prompt = tuple(prompt_ids)
        nth = self.asked.get(prompt, 0)
        self.asked[prompt] = nth + 1
        key = f"{self.seed}/{self.global_steps}/{list(prompt)}/{nth}".encode()
        return torch.Generator().manual_seed(zlib.crc32(key))

    def update_weights(self, state: dict[str, torch.Tensor], global_steps: int | None) -> None:
        """Load the actor's full tensors (HF names) after an update."""
        result = self.model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        # A name the model lacks means the sync sent another model's weights.
        assert not result.unexpected_keys, result.unexpected_keys
        assert set(result.missing_keys) <= tied, result.missing_keys
        self.global_steps = global_steps
        self.asked.clear()

    @torch.no_grad()
    def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        **_unused: Any,  # verl's multimodal and priority fields: none on this path
    ) -> TokenOutput:
        """One response to ``prompt_ids``, sampled at ``sampling_params``'s temperature."""
        del request_id, image_data, video_data
        generator = self._generator(prompt_ids)
        temperature = float(sampling_params.get("temperature", 1.0))
        budget = int(sampling_params.get("max_tokens") or self.response_length)
        ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, P]
        eos = self.model.config.eos_token_id
        tokens: list[int] = []
        log_probs: list[float] = []
        past = None
        step_input = ids
        for _ in range(min(budget, self.response_length)):
            out = self.model(input_ids=step_input, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()  # [V]
            if temperature > 0:
                logp = torch.log_softmax(logits / temperature, dim=-1)  # [V]
                token = int(torch.multinomial(logp.exp(), 1, generator=generator))
            else:
                logp = torch.log_softmax(logits, dim=-1)
                token = int(logp.argmax())
            tokens.append(token)
            log_probs.append(float(logp[token]))
            if token == eos:
                break
            step_input = torch.tensor([[token]], dtype=torch.long)  # [1, 1]
        return TokenOutput(
            token_ids=tokens,
            log_probs=log_probs,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    # verl's replica lifecycle: nothing to free or restore on CPU.
    def wake_up(self) -> None:
        return None

    def sleep(self) -> None:
        return None

    def clear_kv_cache(self) -> None:
        return None

    def release_kv_cache(self) -> None:
        return None

    def resume_kv_cache(self) -> None:
        return None

    def abort_all_requests(self, reject_request: bool = False) -> None:
        return None

    def resume_generation(self) -> None:
        return None

    def start_profile(self) -> None:
        return None

    def stop_profile(self) -> None:
        return None


class CpuRolloutReplica(RolloutReplica):  # type: ignore[misc]
    """verl's rollout replica for ``rollout.name=cpu``: one :class:`CpuRolloutServer`."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        """Start this replica's server on its first training worker's node."""
        node_id = await self.workers[0].__ray_call__.remote(
            lambda _: ray.get_runtime_context().get_node_id()
        )
        config: Any = self.config
        server = (
            ray.remote(CpuRolloutServer)
            .options(
                name=server_name(self.replica_rank),
                namespace=NAMESPACE,
                num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            )
            .remote(
                # An HFModelConfig's local copy, or the launch's path as a DictConfig.
                model_path=getattr(self.model_config, "local_path", None) or self.model_config.path,
                response_length=int(config.response_length),
                # Under full determinism the request, not the replica, picks the stream.
                seed=int(config.seed or 0) + (0 if config.full_determinism else self.replica_rank),
                deterministic=bool(config.full_determinism),
            )
        )
        await server.wake_up.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = server_name(self.replica_rank)


class CpuRolloutAdapter(BaseRollout):  # type: ignore[misc]
    """The rollout in each training worker: forwards verl's weight sync to its replica."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        rollout = self.config
        per_replica = (
            rollout.tensor_model_parallel_size
            * rollout.data_parallel_size
            * rollout.pipeline_model_parallel_size
        )
        # verl's replicas take consecutive training ranks, as its vLLM adapter counts them.
        rank = int(os.environ["RANK"])
        self.replica_rank = rank // per_replica
        # The server holds one full copy: the replica's first rank sends it.
        self.sends = rank % per_replica == 0

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        wire_format: str = "named_tensors",
        global_steps: int | None = None,
        peft_config: Any = None,
        base_sync_done: bool = True,
    ) -> None:
        """Send the actor's full tensors to this rank's replica."""
        del base_sync_done
        # The naive sync of full tensors; LoRA adapters are not on this path.
        assert wire_format == "named_tensors", wire_format
        assert peft_config is None, peft_config
        # Every rank reads the iterator: the full tensors are gathered across ranks.
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
        if not self.sends:
            return
        server = ray.get_actor(server_name(self.replica_rank), namespace=NAMESPACE)
        await server.update_weights.remote(state, global_steps)


_ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.CpuRolloutAdapter"
RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: CpuRolloutReplica)
