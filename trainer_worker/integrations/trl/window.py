"""One optimizer step's normalizer round inside TRL's micro-steps: :class:`Window`
(started when the generation batch is split, waited for when first needed),
:class:`MicroStep`, what each micro-step carries beyond TRL's inputs, and
:func:`generated_bad_inputs`, a micro-step's bad inputs named by the rows as TRL
generated them (before its shuffle)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lossreduce.errors import EmptyNormalizerError, LossReduceError
from lossreduce.trainer_worker.integrations.worker_rounds import bad_input_error
from lossreduce.trainer_worker.normalizers import NormalizerHandle
from lossreduce.trainer_worker.step_rows import bad_inputs

__all__ = ["MicroStep", "Window", "generated_bad_inputs", "loss_mask"]


@dataclass
class Window:
    """One optimizer step's normalizer round, started when its batch was split."""

    handle: NormalizerHandle
    on_empty_step: str
    step: int = 0
    rank: int = 0
    bad: list[str] = field(default_factory=list)
    """What is wrong with this process's inputs to the step (its partials went as NaN)."""
    sent: dict[str, Tensor] = field(default_factory=dict)
    """The partials this process sent."""
    answered: bool = False
    normalizers: dict[str, float] | None = None
    """The global normalizers by term once answered (None: the step is skipped)."""
    wait_s: float = 0.0
    """Seconds this process was blocked waiting for the answer."""
    reported: bool = False
    """Whether its round's timing was logged (a reused window logs no wait)."""

    def resolve(self) -> dict[str, float] | None:
        """Wait for the round (once); its normalizers, None for a skipped step, or
        the round's error (the same on every process)."""
        if not self.answered:
            started = time.perf_counter()
            try:
                totals = self.handle.wait()
            except EmptyNormalizerError:
                if self.bad or self.on_empty_step == "raise":
                    raise
                self.normalizers = None
            except LossReduceError as err:
                if not self.bad:
                    raise
                raise bad_input_error(err, self.step, self.rank, self.bad, self.sent) from err
            else:
                self.normalizers = {t: float(n) for t, n in totals.items()}
            finally:
                self.wait_s = time.perf_counter() - started
            self.answered = True
        return self.normalizers


@dataclass(frozen=True)
class MicroStep:
    """What one micro-step needs beyond TRL's inputs."""

    window: Window
    weights: Tensor  # [B] float64: w_i of the micro-step's rows
    first: bool  # the first micro-step of its optimizer step


def loss_mask(inputs: dict[str, Any]) -> Tensor:
    """[B, T] the tokens whose loss counts, as TRL's loss masks them."""
    mask: Tensor = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    return mask


def generated_bad_inputs(
    mask: Tensor, inputs: dict[str, Tensor], rows: Tensor, rank: int, per_process: int
) -> list[str]:
    """Each input (``[B, T]``, like ``mask``) with a NaN or inf where ``mask`` is set, as
    ``"advantages: nan at 3 active tokens of rank 1 rows [0, 4] (generation-batch rows
    [6, 10])"``; masked positions are ignored (they are zeroed before the loss).

    TRL shuffles each process's generation batch before it splits it into micro-steps,
    so a row's place in the micro-step (``mask``'s rows) is not where the user finds it.
    ``rows`` (``[B]``) gives each of ``mask``'s rows its index in the generation batch
    gathered over the processes, as generated (process ``rank``'s ``i``-th row is
    ``rank * per_process + i``, TRL's own order when it scores groups): the rows are
    named by that index and by ``i``."""
    return bad_inputs(mask, inputs, rank, rows=rows, share=per_process, batch="generation-batch")
