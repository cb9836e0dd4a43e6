"""What LossReduceGRPOTrainer refuses, its TRL version check, and what importing it costs."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.integrations.settings import GRPOReductionSettings

ROOT = Path(__file__).resolve().parents[4]


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_importing_the_library_or_the_integrations_package_does_not_import_trl() -> None:
    done = run_python(
        "import sys, lossreduce.trainer_worker, lossreduce.trainer_worker.integrations;"
        "assert 'trl' not in sys.modules and 'transformers' not in sys.modules, 'imported'"
    )
    assert done.returncode == 0, done.stderr


def test_without_trl_the_import_error_says_what_to_install() -> None:
    done = run_python(
        "import sys; sys.modules['trl'] = None\nimport lossreduce.trainer_worker.integrations.trl"
    )
    assert done.returncode != 0
    assert "pip install 'lossreduce[trl]'" in done.stderr


def test_settings_validate_mode_divisor_and_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="needs a divisor"):
        GRPOReductionSettings.model_validate({"mode": "constant"})
    with pytest.raises(ValueError, match="only valid with mode 'constant'"):
        GRPOReductionSettings.model_validate({"mode": "seq_mean", "divisor": 4.0})
    # No address: the job's coordinator actor on the Ray cluster (the trainer checks Ray).
    assert GRPOReductionSettings(normalizer="coordinator").coordinator is None
    assert GRPOReductionSettings.joins_ray_coordinator
    monkeypatch.setenv("LOSSREDUCE_MODE", "prompt_mean")
    monkeypatch.setenv("LOSSREDUCE_NORMALIZER", "coordinator")
    monkeypatch.setenv("LOSSREDUCE_COORDINATOR", "127.0.0.1:5")
    settings = GRPOReductionSettings()
    assert (settings.mode, settings.coordinator) == ("prompt_mean", "127.0.0.1:5")


# -- with TRL -----------------------------------------------------------------------------

trl_needed = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


@pytest.fixture
def trl_module() -> Any:
    pytest.importorskip("trl", reason="needs the trl extra: pip install 'lossreduce[trl]'")
    from lossreduce.trainer_worker.integrations import trl as integration

    return integration


@trl_needed
def test_a_trl_version_outside_the_tested_range_is_named(trl_module: Any) -> None:
    low, high = trl_module.TRL_TESTED
    trl_module.check_trl_version(str(low))
    for version in ("1.15.9", str(high)):
        with pytest.raises(ImportError, match=rf"trl>={low},<{high}, but trl {version}"):
            trl_module.check_trl_version(version)


@trl_needed
@pytest.mark.parametrize(
    ("option", "named"),
    [
        (
            {"loss_type": "sapo", "beta": 0.04},
            "loss_type='sapo' with beta=0.04: TRL adds beta * KL to sapo's per-token loss and "
            "divides each completion's sum by its own token count D_i",
        ),
        ({"loss_type": "sapo", "beta": 0.04}, "which would need beta * D_i / N_kl"),
        ({"top_entropy_quantile": 0.5}, "top_entropy_quantile=0.5"),
        ({"use_adaptive_entropy": True}, "use_adaptive_entropy=True"),
        (
            {"gradient_accumulation_steps": 2, "steps_per_generation": 3},
            "steps_per_generation=3 is not a multiple of gradient_accumulation_steps=2",
        ),
    ],
)
def test_options_it_cannot_honour_are_refused_at_construction(
    trl_module: Any, tmp_path: Path, option: dict[str, Any], named: str
) -> None:
    from trl import GRPOConfig

    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=4,
        report_to=[],
        **option,
    )
    settings = GRPOReductionSettings(job="refusals")
    with pytest.raises(ReductionConfigError, match="refusals") as caught:
        # Refused before TRL loads anything: the model path is never opened.
        trl_module.LossReduceGRPOTrainer(
            str(tmp_path / "absent"), None, args=args, reduction=settings
        )
    assert named in str(caught.value)


@trl_needed
def test_a_bad_lossreduce_variable_is_refused_before_trl_loads_anything(
    trl_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOSSREDUCE_MODE", "bogus")
    started = time.monotonic()
    with pytest.raises(ReductionConfigError) as caught:
        # The model path is never opened: the settings come first.
        trl_module.LossReduceGRPOTrainer(str(tmp_path / "absent"), None)
    assert time.monotonic() - started < 5
    assert str(caught.value) == (
        "LossReduceGRPOTrainer reduction settings: LOSSREDUCE_MODE=bogus: must be one of "
        "token_mean, seq_mean, prompt_mean, constant"
    )


@trl_needed
def test_bad_reduction_arguments_are_named_as_arguments(
    trl_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOSSREDUCE_ON_EMPTY_STEP", "skip")  # given below: not the source
    with pytest.raises(ReductionConfigError) as caught:
        trl_module.LossReduceGRPOTrainer(
            str(tmp_path / "absent"),
            None,
            reduction={"on_empty_step": "never", "overlap": "sometimes"},
        )
    assert str(caught.value) == (
        "LossReduceGRPOTrainer reduction settings: reduction.on_empty_step=never: must be one "
        "of raise, skip; reduction.overlap=sometimes: Input should be a valid boolean, unable "
        "to interpret input (allowed: true or false)"
    )


@trl_needed
def test_a_mapping_of_reduction_fields_is_read_over_the_variables(
    trl_module: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lossreduce.trainer_worker.integrations.trl.options import reduction_settings

    monkeypatch.setenv("LOSSREDUCE_JOB", "from-env")
    monkeypatch.setenv("LOSSREDUCE_MODE", "token_mean")
    settings = reduction_settings({"mode": "seq_mean"})
    assert (settings.mode, settings.job) == ("seq_mean", "from-env")
    given = GRPOReductionSettings(job="given")
    assert reduction_settings(given) is given


@trl_needed
@pytest.mark.parametrize("ray_importable", [True, False])
def test_the_coordinator_actor_outside_a_ray_cluster_is_refused_before_trl_loads_anything(
    trl_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ray_importable: bool
) -> None:
    import ray

    assert not ray.is_initialized(), "a test left Ray running"
    if not ray_importable:
        monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("LOSSREDUCE_RUN", raising=False)
    monkeypatch.delenv("LOSSREDUCE_COORDINATOR", raising=False)
    started = time.monotonic()
    with pytest.raises(ReductionConfigError) as caught:
        # The model path is never opened: refused with the settings.
        trl_module.LossReduceGRPOTrainer(
            str(tmp_path / "absent"), None, reduction={"normalizer": "coordinator"}
        )
    assert time.monotonic() - started < 5
    err = caught.value
    assert (err.job, err.group, err.run) == ("trl-grpo-<run>", "policy", "")
    not_installed = "" if ray_importable else " (Ray is not installed here)"
    assert str(err) == (
        "LossReduceGRPOTrainer (job 'trl-grpo-<run>', run not drawn yet, group 'policy'): "
        "normalizer='coordinator' without a coordinator address sends the rounds to the job's "
        "coordinator actor on this process's Ray cluster, but the process is not connected "
        f"to one{not_installed}; pass coordinator=HOST:PORT (LOSSREDUCE_COORDINATOR), or "
        "connect every process to one Ray cluster (ray.init) before building the trainer"
    )


@trl_needed
def test_the_refusal_names_a_run_known_before_the_trainer_is_built(
    trl_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-7")
    settings = GRPOReductionSettings(normalizer="coordinator", group="grpo")
    with pytest.raises(ReductionConfigError) as caught:
        trl_module.LossReduceGRPOTrainer(str(tmp_path / "absent"), None, reduction=settings)
    err = caught.value
    assert (err.job, err.group, err.run) == ("trl-grpo-rdzv-7", "grpo", "rdzv-7")
    assert str(err).startswith(
        "LossReduceGRPOTrainer (job 'trl-grpo-rdzv-7', run 'rdzv-7', group 'grpo'): "
    )


# -- which division a run gets --------------------------------------------------------


def _args(loss_type: str, max_completion_length: int = 6) -> Any:
    """What own_division reads of a GRPOConfig."""
    return SimpleNamespace(loss_type=loss_type, max_completion_length=max_completion_length)


@trl_needed
def test_each_loss_types_own_division_is_a_lossreduce_mode(trl_module: Any) -> None:
    from lossreduce.trainer_worker.integrations.trl.options import division_notice, own_division
    from lossreduce.trainer_worker.policy_gradient import PolicyGradientReduction
    from tests.trainer_worker.integrations.trl import tiny_grpo

    for loss_type, (mode, divisor) in tiny_grpo.OWN_DIVISION.items():
        args = _args(loss_type, tiny_grpo.MAX_COMPLETION)
        want = PolicyGradientReduction(mode, divisor)
        assert own_division(args).contract == want.contract, loss_type
        settings = GRPOReductionSettings.model_validate({"mode": mode, "divisor": divisor})
        assert division_notice(args, settings, "j") is None, loss_type


@trl_needed
def test_a_division_other_than_the_loss_types_own_is_named(trl_module: Any) -> None:
    from lossreduce.trainer_worker.integrations.trl.options import division_notice

    assert division_notice(_args("luspo"), GRPOReductionSettings(), "j") == (
        "LossReduceGRPOTrainer (job 'j'): loss_type='luspo' divides its policy loss by the "
        "step's completions (mode='constant', divisor=1); this run divides it by the step's tokens "
        "(mode='token_mean', from its reduction settings), so the update is not luspo's own; "
        "set mode='constant', divisor=1 to keep luspo's division"
    )
    dr_grpo = division_notice(
        _args("dr_grpo", 256),
        GRPOReductionSettings.model_validate({"mode": "constant", "divisor": 6.5}),
        "j",
    )
    assert dr_grpo == (
        "LossReduceGRPOTrainer (job 'j'): loss_type='dr_grpo' divides its policy loss by 256 x "
        "the step's completions (mode='constant', divisor=256); this run divides it by 6.5 x the "
        "step's completions "
        "(mode='constant', divisor=6.5, from its reduction settings), so the update is not "
        "dr_grpo's own; set mode='constant', divisor=256 to keep dr_grpo's division"
    )
    sapo = division_notice(
        _args("sapo"), GRPOReductionSettings.model_validate({"mode": "prompt_mean"}), "j"
    )
    assert sapo is not None
    assert (
        "loss_type='sapo' divides its policy loss each completion by its own tokens, then by "
        "the step's completions (mode='seq_mean')" in sapo
    )
    assert "this run divides it each prompt group by its own tokens, then by the step's" in sapo


@trl_needed
@pytest.mark.filterwarnings("ignore:.*experimental.*:UserWarning")
def test_the_trainer_says_at_construction_which_division_it_uses(
    trl_module: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A warning where the mode is the default nobody chose, an info line where it was
    chosen, nothing where it is the loss type's own."""
    from trl import GRPOConfig

    from lossreduce.trainer_worker.integrations.trl.options import division_notice
    from tests.trainer_worker.integrations.trl import tiny_grpo

    monkeypatch.delenv("LOSSREDUCE_MODE", raising=False)
    model = tiny_grpo.save_model(tmp_path / "model")
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=tiny_grpo.MAX_COMPLETION,
        loss_type="luspo",
    )
    logger = "lossreduce.trainer_worker.integrations.trl.trainer"
    seen: list[tuple[int, str]] = []
    for reduction in (
        {"job": "default"},
        {"job": "chosen", "mode": "token_mean"},
        {"job": "own", "mode": "constant", "divisor": 1},
    ):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=logger):
            trainer = trl_module.LossReduceGRPOTrainer(
                str(model),
                tiny_grpo.reward_func,
                args=args,
                train_dataset=tiny_grpo.dataset(),
                processing_class=tiny_grpo.tokenizer(),
                reduction=reduction,
            )
        trainer.close()
        seen += [(r.levelno, r.getMessage()) for r in caplog.records if r.name == logger]
    notice = division_notice(args, GRPOReductionSettings(), "{job}")
    assert notice is not None
    assert seen == [
        (logging.WARNING, notice.format(job="default")),
        (logging.INFO, notice.format(job="chosen")),
    ]
