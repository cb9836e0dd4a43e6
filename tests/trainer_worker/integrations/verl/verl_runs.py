"""Runs of verl's real ``TrainingWorker`` and of ``LossReduceTrainingWorker`` on the tiny setup.

A layout is a number of data-parallel ranks (1 or 2, gloo on loopback, spawned
here); every rank of a layout runs the same list of :class:`Case` s in a row,
each on a fresh worker (verl's FSDP2 engine on the CPU platform of
:mod:`lossreduce.trainer_worker.cpu_standins.verl.platform`), one ``train_mini_batch`` call per case, and saves per
case every parameter's update, the optimizer's state, the normalizers the
worker used and any error.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.spawn import spawn

from lossreduce.trainer_worker.cpu_standins.verl.env import CPU_ENV
from tests.trainer_worker.integrations.verl import tiny_verl

# What every test process needs before it imports verl: lossreduce's CPU platform for
# verl, plus quiet logs and no hub.
VERL_ENV = {
    **CPU_ENV,
    "VERL_LOGGING_LEVEL": "ERROR",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
LR = 1.0
VALUE_MODEL = "value-model"
"""The critic's value model, saved in this folder of the actor's model folder
(``cpu_standins.verl.launch.save_value_model``)."""
CLIPRANGE_VALUE = 0.2


def prepare_test_process() -> None:
    """Set :data:`VERL_ENV` and import verl once with exactly its import-time warnings
    filtered: every optional engine it cannot load here (Megatron, TorchTitan, VeOmni,
    ...) and Ray's deprecated state API (the pytest config turns warnings into errors)."""
    for key, value in VERL_ENV.items():
        os.environ.setdefault(key, value)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"(torchtitan|veomni|automodel|mindspeed|megatron) engine is not available",
            category=UserWarning,
        )
        warnings.filterwarnings(
            "ignore", message="Ray state API is no longer experimental", category=DeprecationWarning
        )
        # Where Megatron-Core is installed (make test-verl-megatron), verl imports its
        # engine: Megatron warns of the absent Transformer Engine and Apex and of its own
        # deprecations.
        warnings.filterwarnings(
            "ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed"
        )
        warnings.filterwarnings(
            "ignore",
            message=r"(The following imports from `dynamic_context\.py`|`torch\.jit\.script_method`)",
            category=DeprecationWarning,
        )
        import verl.workers.engine_workers  # noqa: F401


@dataclass(frozen=True)
class Case:
    name: str
    worker: str = "lossreduce"  # or "verl": the stock TrainingWorker with ppo_loss
    mode: str = "token_mean"
    divisor: float | None = None
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: int | None = None
    micro: int = 2  # micro_batch_size_per_gpu
    dynamic: bool = False  # use_dynamic_bsz with a 20-token budget
    normalizer: str = "torch"
    coordinator: str | None = None
    on_empty_step: str = "raise"
    batch: str = "default"  # see batch_of
    optimizer: str = "sgd"  # sgd: the update is -LR * gradient; adamw: verl's default
    epochs: int = 1
    mini_batches: int = 1  # per train_mini_batch call
    shuffle: bool = False  # actor.shuffle (critic.shuffle): verl's loader reorders each share
    kl: bool = True
    entropy_coeff: float = tiny_verl.ENTROPY_COEFF
    loss_mode: str = "vanilla"  # actor.policy_loss.loss_mode
    policy_loss: tuple[tuple[str, Any], ...] = ()  # more actor.policy_loss options
    statistics: str = "mini_batch"
    role: str = "actor"  # or "critic": the value model and verl's value_loss
    seed: int = 0  # torch's seed before the worker is built (verl's own clip_cov draw)
    job: str | None = None  # the rounds' job; None: test-<name>; "": verl's default (the run's)
    run: str | None = None  # the run id; None: rank 0 draws one, as a launch does
    # actor.data_loader_seed (critic's): the config's (None: verl's default, 42) and the
    # seed the trainer sends with the batch (None: tiny_verl.LOADER_SEED)
    loader_seed: int | None = None
    # old_log_probs recomputed by the worker itself before the step (verl's
    # compute_log_prob), and the trainer mode's flag saying so; reuse_old_log_prob.
    recomputed: bool = False
    reuse: bool = True
    ulysses: int = 1  # ulysses_sequence_parallel_size (> 1: packed rows, the CPU stand-ins)


def batch_of(case: Case, model_dir: Path) -> tiny_verl.Rows:
    """The case's batch; ``near-*`` is the same batch with old and reference
    log-probabilities near the model's own (:func:`tiny_verl.near_policy`)."""
    if case.batch.startswith("near"):
        plain = dataclasses.replace(
            case, batch=case.batch.removeprefix("near").lstrip("-") or "default"
        )
        return tiny_verl.near_policy(batch_of(plain, model_dir), model_dir)
    if case.batch == "dense":
        return tiny_verl.rows(masked_row=None)
    if case.batch == "all_masked":
        return tiny_verl.rows(all_masked=True)
    if case.batch == "interleaved":
        # On one rank, mini-batches of 4 in this order hold what two ranks' first
        # and second mini-batches of 2 each hold.
        return tiny_verl.select(tiny_verl.rows(), [0, 1, 4, 5, 2, 3, 6, 7])
    rows = tiny_verl.rows()
    if case.batch == "rank1_masked":
        rows.response_mask[4:] = 0
    elif case.batch == "nan_advantage":
        rows.advantages[6, 1] = float("nan")
    elif case.batch == "masked_nan":
        rows.advantages[tiny_verl.MASKED_ROW] = float("nan")
    elif case.batch == "nan_return":
        assert rows.returns is not None
        rows.returns[6, 1] = float("nan")
    return rows


def _worker(case: Case, model_dir: Path) -> Any:
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import (
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        TrainingWorkerConfig,
    )

    critic = case.role == "critic"
    torch.manual_seed(case.seed)
    attention = "eager"
    if case.ulysses > 1:
        from lossreduce.trainer_worker.cpu_standins.verl import ulysses

        ulysses.install()
        attention = ulysses.ATTENTION
    model = HFModelConfig(
        path=str(model_dir / VALUE_MODEL if critic else model_dir),
        use_remove_padding=case.ulysses > 1,
        override_config={"attn_implementation": attention},
    )
    engine = FSDPEngineConfig(
        strategy="fsdp2",
        model_dtype="fp32",
        mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        use_torch_compile=False,
        micro_batch_size_per_gpu=case.micro,
        max_token_len_per_gpu=20,
        use_dynamic_bsz=case.dynamic,
        ulysses_sequence_parallel_size=case.ulysses,
    )
    optim = FSDPOptimizerConfig(
        optimizer="SGD" if case.optimizer == "sgd" else "AdamW",
        lr=LR if case.optimizer == "sgd" else 1e-2,
        weight_decay=0.0 if case.optimizer == "sgd" else 0.1,
        clip_grad=1e9,
    )
    config = TrainingWorkerConfig(
        model_type="value_model" if critic else "language_model",
        model_config=model,
        engine_config=engine,
        optimizer_config=optim,
        checkpoint_config=CheckpointConfig(),
    )
    return ready_worker(case, config, case_loss(case, "fsdp2"))


def case_loss(case: Case, strategy: str) -> Any:
    """verl's loss function of the case: ``ppo_loss`` with the case's actor config, or
    ``value_loss`` with its critic config, for an engine of ``strategy``."""
    from verl.workers.config import ActorConfig, CriticConfig, PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss, value_loss

    # What the actor's and the critic's configs share: sizes, layout, aggregation, epochs.
    shared: dict[str, Any] = {
        "strategy": strategy,
        "ppo_mini_batch_size": tiny_verl.BATCH // case.mini_batches,
        "ppo_micro_batch_size_per_gpu": case.micro,
        "use_dynamic_bsz": case.dynamic,
        "ppo_max_token_len_per_gpu": 20,
        "loss_agg_mode": case.loss_agg_mode,
        "loss_scale_factor": case.loss_scale_factor,
        "ppo_epochs": case.epochs,
        "rollout_n": 1,
    }
    if case.role == "critic":
        return partial(value_loss, config=CriticConfig(**shared, cliprange_value=CLIPRANGE_VALUE))
    actor = ActorConfig(
        **shared,
        use_kl_loss=case.kl,
        kl_loss_coef=tiny_verl.KL_COEF,
        kl_loss_type="low_var_kl",
        entropy_coeff=case.entropy_coeff,
        clip_ratio=tiny_verl.CLIP,
        policy_loss=PolicyLossConfig(loss_mode=case.loss_mode, **dict(case.policy_loss)),
        **({} if case.loader_seed is None else {"data_loader_seed": case.loader_seed}),
    )
    return partial(ppo_loss, config=actor)


def ready_worker(case: Case, config: Any, loss: Any) -> Any:
    """The case's worker on ``config`` (any engine): verl's stock ``TrainingWorker``, or
    ``LossReduceTrainingWorker`` (``LossReduceCriticWorker`` for the critic) with the
    case's settings, reset and given ``loss``."""
    from verl.workers.engine_workers import TrainingWorker

    critic = case.role == "critic"
    if case.worker == "verl":
        worker = TrainingWorker(config)
    else:
        from lossreduce.trainer_worker.integrations.verl import (
            LossReduceCriticWorker,
            LossReduceTrainingWorker,
            VerlReductionSettings,
        )

        mode_key, divisor_key = ("critic_mode", "critic_divisor") if critic else ("mode", "divisor")
        fields: dict[str, Any] = {
            mode_key: case.mode,
            divisor_key: case.divisor,
            "normalizer": case.normalizer,
            "coordinator": case.coordinator,
            "on_empty_step": case.on_empty_step,
            "statistics": case.statistics,
            "run": case.run,
            "reuse_old_log_prob": case.reuse,
        }
        if case.job != "":
            fields["job"] = case.job or f"test-{case.name}"
        settings = VerlReductionSettings.model_validate(fields)
        cls = LossReduceCriticWorker if critic else LossReduceTrainingWorker
        worker = cls(config, reduction=settings)
    worker.reset()
    worker.set_loss_fn(loss)
    return worker


def _params(worker: Any) -> dict[str, torch.Tensor]:
    # FSDP2 shards parameters as DTensors; every rank gathers every parameter in order.
    out = {}
    for name, p in worker.engine.module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def _optimizer_state(worker: Any) -> dict[str, Any]:
    state = worker.engine.optimizer.state_dict()["state"]
    return {
        str(k): {
            n: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
            if isinstance(v, torch.Tensor)
            else v
            for n, v in s.items()
        }
        for k, s in state.items()
    }


def recomputed_old_log_probs(worker: Any, rows: tiny_verl.Rows) -> torch.Tensor:
    """``[B, R]``: the log-probabilities of ``rows``' responses under the worker's current
    weights, as verl's trainer recomputes ``old_log_prob`` (``compute_log_prob``: the
    worker's ``infer_batch``, in eval mode, in inference micro-batches of 4, not the
    training's)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    probe = tiny_verl.tensordict(rows, mini_batch_size=rows.size)
    tu.assign_non_tensor(
        probe, compute_loss=False, calculate_entropy=False, micro_batch_size_per_gpu=4
    )
    found = no_padding_2_padding(worker.infer_batch(probe)["log_probs"], probe).float()
    out = torch.zeros(rows.old_log_probs.shape)
    out[:, : found.shape[1]] = found
    return out


def run_case(case: Case, rank: int, world: int, model_dir: Path) -> dict[str, Any]:
    worker = _worker(case, model_dir)
    # The ranks of one sequence-parallel group hold the same rows.
    rows = tiny_verl.shard(batch_of(case, model_dir), rank // case.ulysses, world // case.ulysses)
    if case.recomputed:
        rows = dataclasses.replace(rows, old_log_probs=recomputed_old_log_probs(worker, rows))
    data = tiny_verl.tensordict(
        rows,
        mini_batch_size=tiny_verl.BATCH // case.mini_batches,
        epochs=case.epochs,
        shuffle=case.shuffle,
        seed=tiny_verl.LOADER_SEED if case.loader_seed is None else case.loader_seed,
    )
    if case.recomputed:
        from verl.utils import tensordict_utils as tu

        from lossreduce.trainer_worker.integrations.verl.worker import OLD_LOG_PROBS_CURRENT_KEY

        # What the trainer mode tells the actor when it recomputed old_log_prob.
        tu.assign_non_tensor(data, **{OLD_LOG_PROBS_CURRENT_KEY: True})
    result = measured_step(
        worker,
        data,
        params=lambda: _params(worker),
        optimizer_state=lambda: _optimizer_state(worker),
        label=f"rank {rank}: case {case.name}",
    )
    close = getattr(worker, "close", None)
    if close is not None:
        close()
    return result


def measured_step(
    worker: Any,
    data: Any,
    *,
    params: Callable[[], dict[str, torch.Tensor]],
    optimizer_state: Callable[[], Any],
    label: str,
) -> dict[str, Any]:
    """One ``train_mini_batch`` of ``worker`` (any engine) on ``data``: its metrics or its
    error, every parameter's update (``params()`` before and after), the optimizer's
    state, the normalizers, the skipped steps and the round group."""
    before = params()
    result: dict[str, Any] = {}
    try:
        output = worker.train_mini_batch(data)
        if output is not None:
            result["metrics"] = dict(output["metrics"])
    except Exception as err:
        result["error"] = {
            "type": type(err).__name__,
            "message": str(err),
            "rank": getattr(err, "rank", None),
            "ranks": getattr(err, "ranks", ()),
            "terms": getattr(err, "terms", ()),
        }
        result["traceback"] = traceback.format_exc()
        # Said at once: a rank that fails alone leaves its peers waiting in a collective,
        # and the case's results are saved only once every case has run.
        print(f"{label} raised:\n{result['traceback']}", file=sys.stderr)
    after = params()
    result["update"] = {n: after[n] - before[n] for n in before}
    result["optimizer"] = optimizer_state()
    result["normalizers"] = getattr(worker, "last_normalizers", None)
    result["skipped_steps"] = getattr(worker, "skipped_steps", None)
    rounds = getattr(worker, "rounds", None)
    result["group"] = None if rounds is None else rounds.group()
    # The job the rounds carried (the default job carries the run id); resolved by then
    # wherever a round ran (resolving it here could be a collective a failed peer skips).
    result["job"] = rounds.job if rounds is not None and rounds.started else None
    return result


@dataclass(frozen=True)
class Job:
    """What every rank of one layout runs."""

    world: int
    cases: list[Case]
    model_dir: str
    out_dir: str
    port: int
    env: dict[str, str] = field(default_factory=dict)
    ray_address: str | None = None
    """A Ray cluster every rank joins first (cases whose workers start or join the
    job's coordinator actor)."""


def run_layout(rank: int, job: Job) -> None:
    """One rank: every case in a row; saves ``rank{rank}.pt``."""
    os.environ.update(VERL_ENV)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job.port),
        RANK=str(rank),
        LOCAL_RANK="0",
        WORLD_SIZE=str(job.world),
        LOCAL_WORLD_SIZE=str(job.world),
    )
    results: dict[str, Any] = {}
    try:
        # verl's own init asks for "cpu:gloo,cpu:gloo" on this platform; gloo alone it is.
        torch.distributed.init_process_group("gloo", rank=rank, world_size=job.world)
        if job.ray_address is not None:
            import ray

            # One namespace, as verl's workers of one job share theirs (each driver
            # would otherwise get a namespace, and named actors, of its own).
            ray.init(
                address=job.ray_address,
                namespace="verl-runs",
                logging_level="ERROR",
                log_to_driver=False,
            )
        for case in job.cases:
            results[case.name] = run_case(case, rank, job.world, Path(job.model_dir))
    except Exception:
        results["crash"] = traceback.format_exc()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if job.ray_address is not None:
            import ray

            ray.shutdown()
    torch.save(results, Path(job.out_dir) / f"rank{rank}.pt")


def run(
    world: int,
    cases: list[Case],
    model_dir: Path,
    out_dir: Path,
    port: int,
    *,
    ray_address: str | None = None,
) -> list[Any]:
    """Every rank's results of the cases on ``world`` spawned ranks (each joined to the
    Ray cluster at ``ray_address`` first, if given)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    job = Job(world, cases, str(model_dir), str(out_dir), port, ray_address=ray_address)
    spawn(run_layout, args=(job,), nprocs=world, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


class LayoutRuns:
    """Each layout's cases (``cases(world)``), run once on spawned ranks and kept.

    Layouts of 2 ranks join a local Ray cluster first when ``ray_for`` names them (cases
    whose workers start or join the job's coordinator actor); every rank's crash fails
    the caller at once.
    """

    def __init__(
        self,
        cases: Callable[[int], list[Case]],
        model_dir: Path,
        out_root: Path,
        *,
        ray_for: frozenset[int] = frozenset(),
    ) -> None:
        self.cases = cases
        self.model_dir = model_dir
        self.out_root = out_root
        self.ray_for = ray_for
        self._cache: dict[int, list[dict[str, Any]]] = {}

    def __call__(self, world: int) -> list[dict[str, Any]]:
        if world not in self._cache:
            import pytest

            from lossreduce.ports import free_port

            out = self.out_root / f"dp{world}"
            root = Path(__file__).resolve().parents[4]
            with pytest.MonkeyPatch.context() as patch:
                # Spawned ranks import this module (and verl its CPU platform) by name.
                patch.syspath_prepend(str(root))
                cases = self.cases(world)
                if world in self.ray_for:
                    import ray

                    from tests.ray_support import local_ray

                    with local_ray():
                        address = ray.get_runtime_context().gcs_address
                        got = run(
                            world, cases, self.model_dir, out, free_port(), ray_address=address
                        )
                else:
                    got = run(world, cases, self.model_dir, out, free_port())
            self._cache[world] = got
        for rank, result in enumerate(self._cache[world]):
            assert "crash" not in result, f"dp{world} rank {rank}: {result['crash']}"
        return self._cache[world]

    def case(self, world: int, name: str, *, ok: bool = True) -> list[dict[str, Any]]:
        """Every rank's result of case ``name`` on ``world`` ranks (``ok``: none raised)."""
        per_rank = [r[name] for r in self(world)]
        if ok:
            for rank, result in enumerate(per_rank):
                assert "error" not in result, f"dp{world} {name} rank {rank}: {result['traceback']}"
        return per_rank


def relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """``|got - want| / |want|`` over every parameter's update."""
    num = sum(float(((got[n] - want[n]).double() ** 2).sum()) for n in want)
    den = sum(float((want[n].double() ** 2).sum()) for n in want)
    return math.sqrt(num / den)


def is_zero(update: dict[str, torch.Tensor]) -> bool:
    return all(not bool(delta.any()) for delta in update.values())
