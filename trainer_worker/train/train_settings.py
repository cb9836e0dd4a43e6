"""Settings of ``lossreduce train``: one pydantic model, every field described.

``lossreduce.trainer_worker.train.cli`` turns each field into a flag
(``--field-name``), so this model is the single place where a knob, its
default, its bounds and its help text live.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lossreduce.trainer_worker.integrations.run_identity import RUN_PATTERN
from lossreduce.trainer_worker.train.engines.registry import engine_names, get_engine

__all__ = ["Mode", "TrainSettings"]

Mode = Literal["token_mean", "seq_mean", "prompt_mean", "constant"]

MAX_TIMEOUT_S = 1e6
"""Upper bound of the timeouts (about 11 days): Ray's waits and torch.distributed's
timeout overflow on infinite or astronomically large ones."""


class TrainSettings(BaseModel):
    """Everything a training run needs; defaults finish in minutes on 2 CPU cores."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: str = Field(
        default="torch",
        description="What trains on each Ray worker: "
        + "; ".join(f"'{name}' ({get_engine(name).summary})" for name in engine_names())
        + ".",
    )
    # -- cluster ------------------------------------------------------------
    address: str | None = Field(
        default_factory=lambda: os.environ.get("RAY_ADDRESS") or None,
        description="Ray cluster to join (default: $RAY_ADDRESS; unset: start a local "
        "cluster sized to this machine and shut it down at the end).",
    )
    num_cpus: int | None = Field(
        default=None,
        ge=1,
        description="CPUs of the local Ray cluster (default: all of this machine).",
    )
    workers: int = Field(
        default=2, ge=1, le=256, description="Number of TrainerWorker actors (ranks)."
    )
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        default="PACK", description="Placement-group strategy for the worker bundles."
    )
    coordinator: str | None = Field(
        default=None,
        pattern=r"^[^\s:]+:\d{1,5}$",
        description="HOST:PORT of an external coordinator (e.g. `lossreduce serve`); "
        "default: start one as a named Ray actor.",
    )
    normalizer: Literal["coordinator", "torch"] = Field(
        default="coordinator",
        description="Where global normalizers come from: the coordinator over gRPC, or a "
        "torch.distributed all-reduce among the workers.",
    )
    tls_ca: Path | None = Field(
        default=None,
        description="PEM CA bundle the --coordinator's TLS certificate must chain to (read "
        "on the driver and handed to workers and agents through Ray); only with --coordinator: "
        "the embedded coordinator makes its own CA for the run.",
    )
    aggregation: Literal["auto", "node", "off"] = Field(
        default="auto",
        description="Node aggregation: 'node' runs one agent per node that sends one "
        "contribution per round for its ranks; 'off' has every rank talk to the coordinator; "
        "'auto' is 'node' when the workers span more than one node. Results are bit-identical.",
    )
    round_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        allow_inf_nan=False,
        description="Round timeout of the embedded coordinator, in seconds; also bounds how "
        "long the driver waits for a step beyond it before declaring it hung, and the workers' "
        "call deadline (this plus 30 s). With --coordinator, set it to that coordinator's "
        "--round-timeout-s, so no worker gives up on a round its peers still complete.",
    )
    step_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        allow_inf_nan=False,
        description="Longest the driver waits for the workers to finish one phase of a step "
        "(sampling or training) before declaring the run hung.",
    )
    job: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.\-]{1,64}$",
        description="Job name for coordinator rounds and metrics (default: "
        "train-<run>, new for every run). A given job is kept as is; a coordinator "
        "shared by many runs then refuses a second run claiming it while the first is active.",
    )
    run: str | None = Field(
        default=None,
        pattern=RUN_PATTERN,
        description="This run's identity on the coordinator, sent with every round (default: "
        "a short random id the driver draws once and gives every worker).",
    )
    # -- the RL loop ----------------------------------------------------------
    steps: int = Field(default=60, ge=1, description="Training steps (one batch of rollouts each).")
    prompts_per_step: int = Field(default=64, ge=1, description="Prompts sampled per step.")
    samples_per_prompt: int = Field(
        default=8,
        ge=2,
        description="Responses sampled per prompt (the GRPO group size before filtering).",
    )
    microbatches: int = Field(
        default=2,
        ge=1,
        description="Microbatches each worker splits its shard into (groups stay whole).",
    )
    mode: Mode = Field(
        default="prompt_mean",
        description="Policy-gradient reduction: token_mean (DAPO), seq_mean (GRPO), "
        "prompt_mean (every prompt weighs the same), constant (Dr. GRPO, needs --divisor).",
    )
    divisor: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="Token budget C of --mode constant (default there: --response-len); "
        "rejected with any other mode.",
    )
    kl_coef: float = Field(
        default=0.02,
        ge=0,
        allow_inf_nan=False,
        description="Weight of the KL-to-reference term (its own token_mean normalizer); 0 "
        "leaves the term out.",
    )
    clip_eps: float = Field(
        default=0.2,
        gt=0,
        lt=1,
        description="PPO clip range: the probability ratio is clipped to [1 - clip_eps, 1 + clip_eps].",
    )
    lr: float = Field(default=5e-3, gt=0, allow_inf_nan=False, description="Adam learning rate.")
    temperature: float = Field(
        default=1.0, gt=0, allow_inf_nan=False, description="Sampling temperature of rollouts."
    )
    on_empty_step: Literal["raise", "skip"] = Field(
        default="skip",
        description="A step whose filter left no tokens anywhere: raise (stop the run with "
        "an error) or skip (no backward, no optimizer step) — applied on every rank.",
    )
    seed: int = Field(default=0, ge=0, description="Seed of the model init, prompts and sampling.")
    # -- task and model -------------------------------------------------------
    prompt_len: int = Field(default=3, ge=2, le=8, description="Digits shown in each prompt.")
    response_len: int = Field(
        default=4, ge=1, le=8, description="Digits each response must continue."
    )
    max_step: int = Field(
        default=3,
        ge=1,
        le=9,
        description="Hidden rule: progression steps are drawn from 1..max_step.",
    )
    d_model: int = Field(default=64, ge=8, description="Policy width.")
    layers: int = Field(default=2, ge=1, description="Policy transformer blocks.")
    heads: int = Field(default=4, ge=1, description="Attention heads per block.")
    model: Path | None = Field(
        default=None,
        description="A local Hugging Face causal-LM checkpoint folder (with its tokenizer) as "
        "the policy, for the engines that train one (--engine trl); default there: a tiny Qwen2 "
        "of --d-model, --layers, --heads built from its config.",
    )
    # -- output ---------------------------------------------------------------
    out: Path | None = Field(
        default=None,
        description="Directory for metrics.jsonl and the plot (default: runs/<timestamp>/).",
    )
    verify: bool = Field(
        default=False,
        description="Instead of training, check partition invariance on one step: gradients "
        "reduced across the workers vs. one process with all the data.",
    )
    progress: bool = Field(default=True, description="Show the live progress bar.")

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        if name not in engine_names():
            raise ValueError(f"no engine {name!r}; choose one of: {', '.join(engine_names())}")
        return name

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainSettings:
        if self.divisor is not None and self.mode != "constant":
            raise ValueError(
                f"--divisor {self.divisor:g} is only valid with --mode constant, not --mode {self.mode}"
            )
        if self.tls_ca is not None and self.coordinator is None:
            raise ValueError(
                f"--tls-ca {self.tls_ca} needs --coordinator: the embedded coordinator makes "
                "its own CA for the run"
            )
        if self.aggregation == "node" and self.normalizer == "torch":
            raise ValueError(
                "--aggregation node needs --normalizer coordinator: the torch normalizer "
                "sends nothing to aggregate"
            )
        if self.d_model % self.heads:
            raise ValueError(f"--d-model {self.d_model} must be divisible by --heads {self.heads}")
        get_engine(self.engine).check_flags(self)
        return self

    @property
    def effective_divisor(self) -> float | None:
        """The constant-mode divisor, defaulting to the response length."""
        if self.mode != "constant":
            return None
        return self.divisor if self.divisor is not None else float(self.response_len)
