"""lossreduce inside Hugging Face TRL: :class:`LossReduceGRPOTrainer`.

TRL's ``loss_type`` decides both the per-token loss and what it is divided by;
the divisors of ``grpo``, ``bnpo`` and ``dr_grpo`` are per micro-step, so an
optimizer step's update changes with how TRL splits the batch into processes
and gradient-accumulation micro-steps. This trainer keeps TRL's per-token loss
(clipping, KL, importance sampling, masks) and replaces the division:

1. Right after each generation batch is generated and split into micro-steps,
   before any backward, every process computes per-row weights and, for each
   optimizer step the batch feeds, one partial normalizer per term (policy
   gradient in ``mode``; the KL for ``beta > 0`` and the entropy bonus each as
   their own ``token_mean`` term), and the normalizer backend (torch.distributed,
   or a lossreduce coordinator: at its address, or the job's coordinator actor on
   the processes' Ray cluster) sums and validates them once.
2. Each micro-step's loss is its share of the step's global loss,
   ``num_processes * sum(w_i * l * m) / N``, with gradient accumulation and
   the processes' gradient averaging accounted for, so the update of one
   optimizer step is the formula of docs/reduction-semantics.md over that
   step's completions however TRL split them. ``sapo``, whose per-token loss
   TRL computes only in its per-sequence-mean branch, has that branch's
   division undone row by row through the advantage (with ``beta == 0``; a
   scalar beta cannot undo it for the KL, so other values are refused).

Every loss type's own division is a lossreduce mode (``options.own_division``:
``luspo`` is ``constant`` with divisor 1, ``dr_grpo`` ``constant`` with
``max_completion_length``, ``grpo`` and ``sapo`` ``seq_mean``, the others
``token_mean``); where ``mode`` is another, the trainer says so once at
construction (a warning when the mode is the default nobody chose).

The rounds of every optimizer step of a generation batch start together,
right after the split, and each is waited for only when its step first
needs it; every micro-step lets the rounds still in flight progress
without blocking. Where the policy gradient is the only term (``beta == 0``,
no entropy bonus, no router aux loss), the micro-step's forward leaves no
gradient synchronization pending (more than one accumulation micro-step
without ``sync_each_batch``, or one process) and the round was not answered
at its start, the first micro-step runs its forward with a divisor of 1 and
waits for the round after it, before the backward, then divides by the
global normalizer: the same float operations as dividing inside TRL's loss,
so the result is bit-identical, and the round hides behind the forward. With
several terms the divisors sit inside TRL's loss, so the wait comes first.
Either way ``lossreduce/round_latency_s``, ``lossreduce/normalizer_wait_s``
(time actually blocked) and ``lossreduce/overlapped`` (1 where the forward
ran during the round) are logged per optimizer step.

An empty step (a global normalizer of 0) raises the same
:class:`~lossreduce.errors.EmptyNormalizerError` on every process, or with
``on_empty_step='skip'`` is skipped on every process: no backward, no
gradients, so the optimizer leaves weights and its state untouched (a
forward already run while the round was in flight is discarded; the step's
later micro-steps run none). A failed round raises on every process before
that step's backward (a later step's round may fail after earlier steps of
the same generation batch trained).

Needs ``pip install 'lossreduce[trl]'``; importing :mod:`lossreduce.trainer_worker`
never imports TRL, only this module does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.integrations.settings import GRPOReductionSettings
from lossreduce.trainer_worker.integrations.trl.options import (
    CLIPPED,
    ENTROPY_TERM,
    KL_TERM,
    POLICY_TERM,
    ROW_MEAN,
    check_trl_version,
    division_notice,
    reduction_settings,
    refuse_coordinator_without_ray,
    refuse_unsupported,
)
from lossreduce.trainer_worker.integrations.trl.window import (
    MicroStep,
    Window,
    generated_bad_inputs,
    loss_mask,
)
from lossreduce.trainer_worker.integrations.worker_rounds import (
    DataParallel,
    WorkerRounds,
    poison,
)
from lossreduce.trainer_worker.normalizers import GlobalNormalizer, ReadyHandle
from lossreduce.trainer_worker.policy_gradient import PolicyGradientReduction
from lossreduce.trainer_worker.step_rows import StepRows, plan_rows

try:
    import trl
    from accelerate.utils import DistributedType
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "lossreduce.trainer_worker.integrations.trl needs TRL: pip install 'lossreduce[trl]'"
    ) from err

__all__ = ["LossReduceGRPOTrainer"]

_GROUP_KEY = "lossreduce_group"  # [B] prompt group of each row, over the whole generation batch
_ROW_KEY = "lossreduce_row"  # [B] each row's place in the generation batch, before TRL's shuffle
_PLAN_KEY = "lossreduce_plan"  # the micro-step's MicroStep, added after the split

_log = logging.getLogger(__name__)

check_trl_version(trl.__version__)


class _CloseClient(TrainerCallback):  # type: ignore[misc]
    def __init__(self, trainer: LossReduceGRPOTrainer) -> None:
        self.trainer = trainer

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.close()


class LossReduceGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
    """A :class:`trl.GRPOTrainer` whose loss is normalized by lossreduce.

    Takes GRPOTrainer's arguments (all but the first two by keyword) plus ``reduction``:
    :class:`GRPOReductionSettings`, or a mapping of some of its fields, the others (all of
    them by default) read from ``LOSSREDUCE_*`` variables; a bad value raises
    :class:`~lossreduce.errors.ReductionConfigError` naming it (``reduction.mode=...``
    or ``LOSSREDUCE_MODE=...``) and what is allowed, before TRL's own setup. ``reduction_run`` is this run's
    identity (:mod:`~lossreduce.trainer_worker.integrations.run_identity`) and
    ``reduction_job`` the job its rounds carry (``trl-grpo-<run>`` unless a job is
    set). Each optimizer step's round is numbered by TRL's ``state.global_step``, so
    a run resumed from a checkpoint continues where the checkpoint left off.
    ``skipped_steps`` counts optimizer steps skipped as empty. ``rounds`` is this
    process's :class:`~lossreduce.trainer_worker.integrations.worker_rounds.WorkerRounds`
    (its backend, over accelerate's processes). With ``normalizer='coordinator'`` the
    rounds go to ``coordinator``, or without an address to the job's coordinator actor
    on the Ray cluster the process is connected to (refused at construction when it is
    connected to none). The coordinator client is closed when training ends; after a
    failed ``train()`` call :meth:`close`.
    """

    # GRPOTrainer's attributes this class reads or swaps for one micro-step.
    loss_type: str
    beta: float
    entropy_coef: float
    _entropy_bonus_enabled: bool

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        *,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list[Callable[..., Any]] | None = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
        reduction: GRPOReductionSettings | Mapping[str, Any] | None = None,
    ) -> None:
        # First, before TRL loads a model or starts anything distributed: a bad
        # setting costs nothing and is named with where it came from.
        self.reduction_settings = reduction_settings(reduction)
        if args is not None:
            refuse_unsupported(args, self.reduction_settings)
        refuse_coordinator_without_ray(self.reduction_settings)
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )
        refuse_unsupported(self.args, self.reduction_settings)
        self.rounds = WorkerRounds(
            self.reduction_settings,
            self._data_parallel,
            device=lambda: self.accelerator.device,
        )
        # Every process builds the trainer at once, inside accelerate's process group:
        # rank 0's draw (when neither setting nor launcher names the run) is shared here.
        self.reduction_run, self.reduction_job = self.rounds.identity()
        if (
            self.reduction_settings.on_empty_step == "skip"
            and self.accelerator.distributed_type == DistributedType.DEEPSPEED
        ):
            raise ReductionConfigError(
                f"LossReduceGRPOTrainer (job {self.reduction_job!r}, run "
                f"{self.reduction_run!r}): on_empty_step='skip' with DeepSpeed: its engine "
                "steps the optimizer even without gradients; use on_empty_step='raise'",
                job=self.reduction_job,
                group=self.reduction_settings.group,
            )
        self.policy_reduction: PolicyGradientReduction = self.reduction_settings.reduction
        self._announce_division()
        self.skipped_steps = 0
        self._open_windows: list[Window] = []
        self.add_callback(_CloseClient(self))

    def _announce_division(self) -> None:
        """Say once, on the main process, which division the run gets where it is not
        its loss type's own: a warning where the mode is the default nobody chose (e.g.
        ``luspo`` silently divided by tokens instead of completions), else an info line."""
        notice = division_notice(self.args, self.reduction_settings, self.reduction_job)
        if notice is None or not self.accelerator.is_main_process:
            return
        chosen = "mode" in self.reduction_settings.model_fields_set
        _log.log(logging.INFO if chosen else logging.WARNING, notice)

    # -- the normalizer backend ------------------------------------------------------

    def _data_parallel(self) -> DataParallel:
        """accelerate's processes: each holds different completions and all reduce
        together, over the default process group."""
        return DataParallel(
            group=None,
            rank=self.accelerator.process_index,
            size=self.accelerator.num_processes,
            round_group=self.reduction_settings.group,
        )

    def normalizer(self) -> GlobalNormalizer:
        """The backend summing partials over processes (made on first use)."""
        return self.rounds.normalizer()

    def close(self) -> None:
        """Close the coordinator client, if any; the next step opens a new one.

        Rounds of the current generation batch still in flight end with it
        (ClientClosedError if a later ``train()`` call resumes inside that batch).
        """
        self.rounds.close()
        self._open_windows = []

    @property
    def contracts(self) -> dict[str, str]:
        """Term name -> contract of every term of this run."""
        out = {POLICY_TERM: self.policy_reduction.contract_for("sum")}
        token_mean = PolicyGradientReduction("token_mean").contract_for("sum")
        if self.beta != 0.0:
            out[KL_TERM] = token_mean
        if self._entropy_bonus_enabled:
            out[ENTROPY_TERM] = token_mean
        return out

    # -- generation: mark groups, then plan every optimizer step of the batch --------

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output: dict[str, Any] = super()._generate_and_score_completions(inputs)
        rows = output["completion_ids"].size(0)
        # TRL scores groups as consecutive num_generations rows of the batch
        # gathered in process order; number them the same way.
        first = self.accelerator.process_index * rows
        index = torch.arange(first, first + rows, device=output["completion_ids"].device)
        output[_GROUP_KEY] = torch.div(index, self.num_generations, rounding_mode="floor")
        # TRL shuffles the rows next: a bad input is named by this place, where the user
        # finds the row.
        output[_ROW_KEY] = index
        return output

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        buffered = self._buffered_inputs
        inputs: dict[str, Any] = super()._prepare_inputs(generation_batch)
        if self.model.training and self._buffered_inputs is not buffered:
            self._plan(self._buffered_inputs)
        return inputs

    def _plan(self, slices: list[dict[str, Any]]) -> None:
        """Reduce the normalizers of every optimizer step of a new generation batch."""
        ga = self.args.gradient_accumulation_steps
        n_windows = len(slices) // ga
        masks = [loss_mask(s) for s in slices]  # each [B, T]
        local = torch.cat(
            [
                torch.stack(
                    [
                        torch.full((m.size(0),), float(i // ga), dtype=torch.float64),
                        s[_GROUP_KEY].detach().to("cpu", torch.float64),
                        m.sum(-1).to("cpu", torch.float64),
                    ],
                    dim=1,
                )
                for i, (s, m) in enumerate(zip(slices, masks, strict=True))
            ]
        )  # [R_local, 3]: window, group, tokens
        device = self.accelerator.device
        table = self.accelerator.gather(local.to(device)).cpu()  # [R, 3]
        rows_per_process = local.size(0)
        rows = StepRows(
            process=torch.div(torch.arange(table.size(0)), rows_per_process, rounding_mode="floor"),
            window=table[:, 0].long(),
            group=table[:, 1].long(),
            tokens=table[:, 2],
        )
        plan = plan_rows(self.policy_reduction, rows, self.accelerator.process_index, n_windows)
        # Every step's round in flight at once; each is waited for when needed.
        bad: list[list[str]] = [[] for _ in range(n_windows)]
        for i, (s, m) in enumerate(zip(slices, masks, strict=True)):
            advantages = s["advantages"].detach()  # [B] or [B, T]
            if advantages.dim() == 1:
                advantages = advantages[:, None].expand(m.shape)
            # A NaN advantage at an active token would reach the gradient: every
            # process's round of that step aborts instead (masked rows are ignored).
            found = generated_bad_inputs(
                m.cpu(),
                {"advantages": advantages.cpu()},
                s[_ROW_KEY].cpu(),
                self.accelerator.process_index,
                rows_per_process,
            )
            bad[i // ga] += [f"micro-step {i % ga}: {what}" for what in found]
        windows = self._open_windows = [
            self._start_window(w, plan.policy_partials[w], plan.token_partials[w], bad[w])
            for w in range(n_windows)
        ]
        offset = 0
        for i, (s, m) in enumerate(zip(slices, masks, strict=True)):
            s[_PLAN_KEY] = MicroStep(
                window=windows[i // ga],
                weights=plan.weights[offset : offset + m.size(0)],
                first=i % ga == 0,
            )
            offset += m.size(0)

    def _start_window(self, window: int, policy: float, tokens: float, bad: list[str]) -> Window:
        step = int(self.state.global_step) + window
        partials = {POLICY_TERM: policy}
        if self.beta != 0.0:
            partials[KL_TERM] = tokens
        if self._entropy_bonus_enabled:
            partials[ENTROPY_TERM] = tokens
        device = self.accelerator.device
        sent = poison(
            {t: torch.tensor(v, dtype=torch.float64, device=device) for t, v in partials.items()},
            POLICY_TERM,
            bad,
        )
        handle = self.normalizer().start(step, sent, self.contracts)
        return Window(
            handle,
            self.reduction_settings.on_empty_step,
            step=step,
            rank=self.accelerator.process_index,
            bad=bad,
            sent=sent,
        )

    # -- the loss -------------------------------------------------------------------

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        micro: MicroStep | None = inputs.get(_PLAN_KEY)
        if micro is None:
            # Evaluation batches are neither accumulated nor split: TRL's own loss.
            loss: Tensor = super()._compute_loss(model, inputs)
            return loss
        inputs = {k: v for k, v in inputs.items() if k not in (_PLAN_KEY, _GROUP_KEY, _ROW_KEY)}
        self._poll_windows()
        window = micro.window
        deferred: Tensor | None = None
        logged: dict[str, int] = {}
        if not window.answered and self._may_defer(micro):
            logged = {key: len(values) for key, values in self._metrics["train"].items()}
            # The forward runs while the round is in flight; divided below.
            deferred = self._scaled_loss(model, inputs, micro.weights, None)
        normalizers = window.resolve()
        if normalizers is None and deferred is not None:
            # The discarded forward's own metrics go with it.
            self._truncate_metrics(logged)
        if micro.first:
            self._log_window(window, overlapped=deferred is not None)
        if normalizers is None:
            if micro.first:
                self.skipped_steps += 1
            # No backward through any forward: no parameter gets a gradient, so the
            # optimizer step that follows changes neither the weights nor its state.
            return torch.zeros((), device=self.accelerator.device, requires_grad=True)
        if deferred is not None:
            return deferred / self._divisor(normalizers[POLICY_TERM], deferred.device)
        return self._scaled_loss(model, inputs, micro.weights, normalizers)

    def _poll_windows(self) -> None:
        """Let every round of the generation batch progress without blocking: the
        coordinator client has no thread of its own, so its answers and retries
        move only while someone polls or waits."""
        for window in self._open_windows:
            if not window.answered:
                window.handle.done()

    def _truncate_metrics(self, lengths: dict[str, int]) -> None:
        metrics = self._metrics["train"]
        for key in list(metrics):
            if key in lengths:
                del metrics[key][lengths[key] :]
            else:
                del metrics[key]

    def _may_defer(self, micro: MicroStep) -> bool:
        """Whether this micro-step may run its forward before its round is answered.

        Only the policy-gradient term may be divided after the forward (every other
        term's divisor sits inside TRL's loss), and only a forward that leaves no
        gradient synchronization pending may be discarded when the step is skipped
        (DDP expects a backward after a synchronizing forward).
        """
        single_term = (
            self.beta == 0.0
            and not self._entropy_bonus_enabled
            and not getattr(self, "aux_loss_enabled", False)
        )
        sync_each = self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
        no_sync_pending = self.accelerator.num_processes == 1 or (
            self.current_gradient_accumulation_steps > 1 and not sync_each
        )
        # A round answered when it started (one process) gains nothing.
        in_flight = not isinstance(micro.window.handle, ReadyHandle)
        if not (
            self.reduction_settings.overlap
            and single_term
            and micro.first
            and no_sync_pending
            and in_flight
        ):
            return False
        # The placeholder divisor must be exactly 1 for the later division to be
        # bit-exact (it is whenever steps_per_generation is a multiple of the
        # micro-steps of this window; a short last window of an epoch may not be).
        placeholder = self._divisor(float(self.accelerator.num_processes), torch.device("cpu"))
        return float(placeholder) == 1.0

    def _divisor(self, n_pg: float, device: torch.device) -> Tensor:
        """TRL's token-sum divisor for ``num_items_in_batch = n_pg * spg / GA``, in
        the float operations TRL's ``dapo`` branch uses (train mode)."""
        ga: int = self.current_gradient_accumulation_steps
        spg: int = self.args.steps_per_generation
        processes: int = self.accelerator.num_processes
        num_items = torch.tensor(n_pg * spg / ga, dtype=torch.float64, device=device)
        return num_items.clamp(min=1.0) / processes * ga / spg

    def _log_window(self, window: Window, *, overlapped: bool) -> None:
        metrics = self._metrics["train"]
        metrics["lossreduce/skipped"].append(float(window.normalizers is None))
        metrics["lossreduce/overlapped"].append(float(overlapped))
        for term, value in (window.normalizers or {}).items():
            metrics[f"lossreduce/normalizer/{term}"].append(value)
        # A window trained on again (num_iterations > 1) ran no round this time.
        latency = window.handle.latency_s if not window.reported else 0.0
        metrics["lossreduce/round_latency_s"].append(latency if latency is not None else 0.0)
        metrics["lossreduce/normalizer_wait_s"].append(0.0 if window.reported else window.wait_s)
        window.reported = True

    def _scaled_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        weights: Tensor,
        normalizers: dict[str, float] | None,
    ) -> Tensor:
        """TRL's loss with the division replaced (see the module docstring);
        ``normalizers=None``: the policy-gradient-only loss with a divisor of
        exactly 1, to be divided by :meth:`_divisor` once the round is answered.

        TRL's token-sum branch computes ``sum((pg + beta * kl) * m) / D`` with
        ``D = num_items_in_batch / P * GA / steps_per_generation`` and subtracts
        ``coef * sum(H * m) / max(sum(m), 1) / GA``. With the advantages
        scaled by ``w_i >= 0`` (the clipped, cispo, vespo and sapo per-token losses
        are positively homogeneous in the advantage), ``num_items_in_batch``
        set so that ``D = N_pg / P``, ``beta`` scaled by ``N_pg / N_kl`` and
        ``coef`` by ``P * GA * max(sum(m), 1) / N_entropy``, that is exactly
        ``P * (sum(w * pg * m) / N_pg + beta * sum(kl * m) / N_kl
        - coef * sum(H * m) / N_entropy)``; the processes' gradient average
        divides the P back out.

        ``sapo`` (:data:`ROW_MEAN`) runs in TRL's per-sequence branch, which
        ignores ``num_items_in_batch`` and divides row i by ``max(D_i, 1)``, the
        micro-step's mean over its B rows by GA: each row's advantage is also
        scaled by ``max(D_i, 1) * B * GA``, so TRL returns ``sum(w * pg * m)``
        (a divisor of 1, as deferred), and the loss is divided by :meth:`_divisor`
        here, with ``coef`` scaled by that divisor too (``beta`` is 0: refused
        otherwise). Deferred or not, the policy term goes through the same float
        operations, so a forward run during the round stays bit-identical.
        """
        processes = self.accelerator.num_processes
        ga = self.current_gradient_accumulation_steps
        spg = self.args.steps_per_generation
        # Deferred: N_pg = P makes num_items_in_batch = P * spg / GA an integer
        # (spg is a multiple of GA), so TRL's D = ((num_items / P) * GA) / spg is
        # exactly 1.0 and dividing by it changes no bit.
        n_pg = normalizers[POLICY_TERM] if normalizers is not None else float(processes)
        advantages = inputs["advantages"]
        scale = weights  # [B] float64, on the host (plan_rows)
        after: Tensor | None = None  # the divisor applied after TRL's loss (ROW_MEAN)
        if self.loss_type in ROW_MEAN:
            # [B]: TRL's per-row divisor; whole token counts, exact in float64 on the
            # host (some accelerators have no float64).
            tokens = loss_mask(inputs).sum(-1).to("cpu", torch.float64).clamp(min=1.0)
            scale = scale * tokens * float(tokens.size(0) * ga)
            if normalizers is not None:
                after = self._divisor(n_pg, advantages.device)
        scale = scale.to(device=advantages.device, dtype=advantages.dtype)
        inputs["advantages"] = advantages * (scale if advantages.dim() == 1 else scale[:, None])
        inputs["num_items_in_batch"] = torch.tensor(
            n_pg * spg / ga, dtype=torch.float64, device=advantages.device
        )
        saved = (self.loss_type, self.beta, self.entropy_coef)
        logged = len(self._metrics["train"].get("entropy_coef", ()))
        try:
            if self.loss_type in CLIPPED:
                self.loss_type = "dapo"
            if normalizers is None:
                # _may_defer admits the policy-gradient term alone.
                assert self.beta == 0.0, "a deferred loss has no KL term"
                assert not self._entropy_bonus_enabled, "a deferred loss has no entropy term"
            else:
                if self.beta != 0.0:
                    # refuse_unsupported keeps row_mean types at beta == 0.
                    self.beta = saved[1] * n_pg / normalizers[KL_TERM]
                if self._entropy_bonus_enabled:
                    local_tokens = max(float(loss_mask(inputs).sum()), 1.0)
                    self.entropy_coef = (
                        saved[2] * processes * ga * local_tokens / normalizers[ENTROPY_TERM]
                    )
                    if after is not None:
                        self.entropy_coef *= float(after)  # divided back out below
            loss: Tensor = super()._compute_loss(model, inputs)
        finally:
            self.loss_type, self.beta, self.entropy_coef = saved
        coef_log = self._metrics["train"].get("entropy_coef")
        if coef_log is not None and len(coef_log) > logged:
            coef_log[-1] = self.entropy_coef  # TRL logged the scaled coefficient
        return loss if after is None else loss / after
