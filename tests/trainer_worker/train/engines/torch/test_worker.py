"""Worker-side pieces that run without a cluster: the initial policy, the
round timer, the gradient comparison of ``--verify``, failure messages."""

from __future__ import annotations

import time
from collections.abc import Mapping

import pytest
import torch
from torch import Tensor

from lossreduce.errors import EmptyNormalizerError
from lossreduce.trainer_worker.normalizers import LocalNormalizer, NormalizerHandle, ReadyHandle
from lossreduce.trainer_worker.train.engines.torch.worker import TimedNormalizer, build_policy
from lossreduce.trainer_worker.train.placement import BundleSlot
from lossreduce.trainer_worker.train.train_settings import TrainSettings
from lossreduce.trainer_worker.train.verify import VERIFY_RTOL, compare_gradients
from lossreduce.trainer_worker.train.worker_group import describe_failure


def test_every_rank_builds_the_same_initial_policy() -> None:
    settings = TrainSettings(d_model=16, heads=2, layers=1, seed=3)
    a = build_policy(settings, torch.device("cpu")).state_dict()
    b = build_policy(settings, torch.device("cpu")).state_dict()
    c = build_policy(settings.model_copy(update={"seed": 4}), torch.device("cpu")).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


class _SlowNormalizer:
    """Takes ``delay_s`` per round, then answers like :class:`LocalNormalizer`."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.inner = LocalNormalizer(job="j", group="g")

    def start(
        self, step: int, partials: Mapping[str, Tensor], contracts: Mapping[str, str] | None = None
    ) -> NormalizerHandle:
        return ReadyHandle(lambda: self.reduce(step, partials, contracts))

    def reduce(
        self, step: int, partials: Mapping[str, Tensor], contracts: Mapping[str, str] | None = None
    ) -> dict[str, Tensor]:
        time.sleep(self.delay_s)
        return self.inner.reduce(step, partials, contracts)


def test_timed_normalizer_times_each_round_and_passes_answers_and_errors_through() -> None:
    slow = _SlowNormalizer(0.05)
    timed = TimedNormalizer(slow)
    answer = timed.reduce(
        0, {"pg": torch.tensor(5.0, dtype=torch.float64)}, {"pg": "mean:token_mean"}
    )
    assert float(answer["pg"]) == 5.0
    # At least the round's own time; the upper bound only catches a wrong unit (ms, ns).
    assert 0.05 <= timed.last_seconds < 5.0
    slow.delay_s = 0.15
    with pytest.raises(EmptyNormalizerError, match="'pg'"):
        timed.reduce(1, {"pg": torch.tensor(0.0, dtype=torch.float64)}, {"pg": "mean:token_mean"})
    assert 0.15 <= timed.last_seconds < 5.0  # a failed round is timed too


def _grads(scale: float) -> Mapping[str, Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(4, 4) * scale, "b": torch.randn(4) * scale}


def test_compare_gradients_passes_on_equal_and_fails_on_a_wrong_normalizer() -> None:
    ref = _grads(1.0)
    same = compare_gradients(ref, ref, world_size=2, distributed_loss=1.0, single_loss=1.0)
    assert same.passed
    assert same.max_abs_diff == 0.0
    # A per-rank mean over 2 equal shards instead of the global one doubles the gradient.
    wrong = compare_gradients(_grads(2.0), ref, world_size=2, distributed_loss=2.0, single_loss=1.0)
    assert not wrong.passed
    assert wrong.tolerance == pytest.approx(VERIFY_RTOL * wrong.scale + 1e-9)
    assert {d.name for d in wrong.diffs} == {"w", "b"}


def test_compare_gradients_rejects_different_parameters() -> None:
    with pytest.raises(ValueError, match="only distributed"):
        compare_gradients(
            {"a": torch.zeros(1)},
            {"b": torch.zeros(1)},
            world_size=1,
            distributed_loss=0,
            single_loss=0,
        )


def test_failure_message_names_dead_failed_and_hung_ranks_with_nodes() -> None:
    slots = [
        BundleSlot(0, "aaaaaaaaaaaaaaaa", "10.0.0.1"),
        BundleSlot(1, "bbbbbbbbbbbbbbbb", "10.0.0.2"),
        BundleSlot(2, "cccccccccccccccc", "10.0.0.3"),
    ]
    message = describe_failure(
        "training",
        7,
        slots,
        dead={1: "The actor died unexpectedly"},
        errors={0: "RoundTimeoutError: ranks [1] missing"},
        hung=[2],
    )
    assert message == (
        "step 7 (training) failed: rank 1 on node 10.0.0.2 (id bbbbbbbbbbbb) died "
        "(The actor died unexpectedly); "
        "rank 0 on node 10.0.0.1 (id aaaaaaaaaaaa) failed: RoundTimeoutError: ranks [1] missing; "
        "ranks [2] on node 10.0.0.3 (id cccccccccccc) did not answer in time"
    )
