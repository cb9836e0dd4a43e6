"""verl's actor worker as ``lossreduce train`` configures it, from the run's settings.

One :class:`~lossreduce.trainer_worker.integrations.verl.LossReduceTrainingWorker`
per rank: verl's FSDP2 engine on the checkpoint folder of the built-in policy,
in fp32 with eager attention and ``use_remove_padding=False`` (what runs on CPU
as well as on CUDA), AdamW at ``--lr`` with no weight decay (the torch engine's Adam) and verl's
default gradient clipping (:data:`CLIP_GRAD`), and verl's ``ppo_loss``: the vanilla
clipped policy loss at ``--clip-eps`` and, with ``--kl-coef``, verl's KL loss
(``low_var_kl``, the k3 estimator) as a term with its own normalizer. Imports
verl: the process must be prepared first (:mod:`.env`).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from verl.trainer.config.config import CheckpointConfig
from verl.workers.config import (
    ActorConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
    TrainingWorkerConfig,
)
from verl.workers.utils.losses import ppo_loss

from lossreduce.trainer_worker.integrations.verl import (
    LossReduceTrainingWorker,
    VerlReductionSettings,
)
from lossreduce.trainer_worker.train.train_settings import TrainSettings

__all__ = ["CLIP_GRAD", "build_actor"]

CLIP_GRAD = 1.0
"""Gradient-norm clipping of verl's optimizer step: verl's default (and TRL's). Without
it, the default run's reward peaked at 0.29 by step 30 and fell back (0.47 with it)."""
_FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def build_actor(
    settings: TrainSettings, model_dir: Path, reduction: VerlReductionSettings
) -> LossReduceTrainingWorker:
    """A ready actor worker (weights loaded, loss set) on this process's device."""
    config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=HFModelConfig(
            path=str(model_dir),
            load_tokenizer=False,  # token ids throughout
            use_remove_padding=False,
            override_config={"attn_implementation": "eager"},
        ),
        engine_config=FSDPEngineConfig(
            strategy="fsdp2",
            model_dtype="fp32",
            mixed_precision=_FP32,
            use_torch_compile=False,
            use_dynamic_bsz=False,
            micro_batch_size_per_gpu=1,  # each mini-batch sets its own (see .batch)
        ),
        optimizer_config=FSDPOptimizerConfig(
            optimizer="AdamW", lr=settings.lr, weight_decay=0.0, clip_grad=CLIP_GRAD
        ),
        checkpoint_config=CheckpointConfig(),
    )
    actor = ActorConfig(
        strategy="fsdp2",
        ppo_mini_batch_size=settings.prompts_per_step * settings.samples_per_prompt,
        ppo_micro_batch_size_per_gpu=1,
        use_kl_loss=settings.kl_coef > 0,
        kl_loss_coef=settings.kl_coef,
        kl_loss_type="low_var_kl",
        entropy_coeff=0.0,
        clip_ratio=settings.clip_eps,
        rollout_n=1,
    )
    worker = LossReduceTrainingWorker(config, reduction=reduction)
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=actor))
    return worker
