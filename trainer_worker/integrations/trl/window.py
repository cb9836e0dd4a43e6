"""One optimizer step's normalizer round inside TRL's micro-steps: :class:`Window`
(started when the generation batch is split, waited for when first needed) and
:class:`MicroStep`, what each micro-step carries beyond TRL's inputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lossreduce.errors import EmptyNormalizerError, LossReduceError
from lossreduce.trainer_worker.integrations.worker_rounds import bad_input_error
from lossreduce.trainer_worker.normalizers import NormalizerHandle

__all__ = ["MicroStep", "Window", "loss_mask"]


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
