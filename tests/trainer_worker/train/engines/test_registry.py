"""The engine registry: one line per engine, pure to list, each engine behind one interface."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from lossreduce.trainer_worker.train.cli import build_parser
from lossreduce.trainer_worker.train.engines.base import Engine
from lossreduce.trainer_worker.train.engines.registry import (
    ENGINE_PACKAGES,
    engine_names,
    get_engine,
)
from lossreduce.trainer_worker.train.train_settings import TrainSettings


def test_every_registered_engine_is_named_as_its_registry_line() -> None:
    assert engine_names() == ("torch", "trl", "verl", "areal")
    for name in engine_names():
        spec = get_engine(name)
        assert spec.name == name
        assert spec.summary


def test_an_unknown_engine_is_refused_naming_the_choices() -> None:
    with pytest.raises(
        KeyError, match=r"no engine 'nope'; registered engines: torch, trl, verl, areal"
    ):
        get_engine("nope")
    with pytest.raises(
        ValidationError, match=r"no engine 'nope'; choose one of: torch, trl, verl, areal"
    ):
        TrainSettings(engine="nope")


def test_the_engine_flag_lists_every_engine_and_its_summary() -> None:
    help_text = build_parser().format_help()
    assert "--engine {torch,trl,verl,areal}" in help_text
    for name in engine_names():
        assert get_engine(name).summary.split()[0] in help_text


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
# verl and AReaL have environments of their own (their pins conflict with ours): their
# engines load in tests/trainer_worker/train/engines/{verl,areal}; their absence is
# tested in test_verl_missing.py and test_areal_engine.py.
@pytest.mark.parametrize("name", [n for n in ENGINE_PACKAGES if n not in ("verl", "areal")])
def test_each_engine_loads_a_factory_whose_engines_have_the_interface(name: str) -> None:
    factory = get_engine(name).load()
    for method in ("start", "describe", "train", "verify", "shutdown"):
        assert callable(getattr(factory, method)), f"{name}: {method}"
        assert method in Engine.__dict__


def test_listing_engines_and_checking_flags_imports_no_framework_and_no_ray() -> None:
    code = (
        "import sys\n"
        "from lossreduce.trainer_worker.train.train_settings import TrainSettings\n"
        "from lossreduce.trainer_worker.train.cli import build_parser\n"
        "build_parser().format_help()\n"
        "TrainSettings(engine='trl', prompts_per_step=4, samples_per_prompt=2)\n"
        "TrainSettings(engine='areal')\n"
        "print(sorted(m for m in ('trl', 'areal', 'transformers', 'ray') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
