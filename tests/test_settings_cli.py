"""``lossreduce.settings_cli``: one flag per field, one naming rule, one-line errors."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from lossreduce.settings_cli import (
    FlagError,
    SettingsParser,
    add_settings_flags,
    env_name,
    flag_name,
    parse_settings,
)


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Knobs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    target: str = Field(description="Where to go.")
    wait_s: float = Field(default=1.5, gt=0, description="How long, 100% in seconds.")
    sizes: tuple[int, ...] = Field(default=(2, 4), description="Sizes to try.")
    color: Color = Field(default=Color.RED, description="Which color.")
    mode: Literal["fast", "slow"] = Field(default="fast", description="How.")
    limit: int | None = Field(default=None, ge=1, description="At most this many.")
    out: Path | None = Field(default=None, description="Where to write.")
    loud: bool = Field(default=False, description="Print more.")


class EnvKnobs(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KNOBS_", frozen=True, extra="forbid")

    wait_s: float = Field(default=1.0, gt=0, description="How long.")


def _parse(model: type[BaseModel], argv: list[str]) -> BaseModel:
    parser = SettingsParser(prog="knobs", description="test")
    add_settings_flags(parser, model)
    return parse_settings(model, parser.parse_args(argv))


def test_the_flag_is_the_field_name_with_dashes() -> None:
    assert flag_name("round_timeout_s") == "--round-timeout-s"
    assert flag_name("max_rounds_in_flight") == "--max-rounds-in-flight"


def test_every_kind_of_field_parses() -> None:
    argv = ["--target", "x", "--wait-s", "2", "--sizes", "8, 16", "--color", "blue"]
    argv += ["--mode", "slow", "--limit", "off", "--out", "a/b", "--loud"]
    knobs = _parse(Knobs, argv)
    assert knobs == Knobs(
        target="x",
        wait_s=2.0,
        sizes=(8, 16),
        color=Color.BLUE,
        mode="slow",
        limit=None,
        out=Path("a/b"),
        loud=True,
    )
    assert _parse(Knobs, ["--target", "x", "--no-loud", "--limit", "3"]) == Knobs(
        target="x", limit=3
    )


def test_help_is_the_description_with_default_and_choices() -> None:
    parser = SettingsParser(prog="knobs", description="test")
    add_settings_flags(parser, Knobs, exclude=("out",))
    text = " ".join(parser.format_help().split())
    assert "--wait-s SECONDS How long, 100% in seconds. [default: 1.5]" in text
    assert "--sizes A,B,... Sizes to try. [default: 2,4]" in text
    assert "--mode fast|slow" in text
    assert "--color red|blue" in text
    assert "--loud, --no-loud" in text or "--loud | --no-loud" in text
    assert "--out" not in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target", "x", "--wait-s", "0"], "--wait-s 0: Input should be greater than 0"),
        (["--target", "x", "--sizes", "2,x"], "--sizes 2,x: Input should be a valid integer"),
        (["--target", "x", "--mode", "warp"], "--mode warp: Input should be 'fast' or 'slow'"),
        (["--target", "x", "--limit", "0"], "--limit 0: Input should be greater than"),
        (["--target", "x", "--wait", "1"], "unrecognized arguments: --wait 1"),
        ([], "the following arguments are required: --target"),
    ],
)
def test_a_bad_flag_is_one_line_naming_flag_and_value(argv: list[str], message: str) -> None:
    with pytest.raises(FlagError) as caught:
        _parse(Knobs, argv)
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


def test_settings_models_name_their_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_name(EnvKnobs, "wait_s") == "KNOBS_WAIT_S"
    assert env_name(Knobs, "wait_s") is None
    monkeypatch.setenv("KNOBS_WAIT_S", "soon")
    with pytest.raises(FlagError, match=r"^KNOBS_WAIT_S=soon: Input should be a valid number"):
        _parse(EnvKnobs, [])
    assert _parse(EnvKnobs, ["--wait-s", "3"]) == EnvKnobs(wait_s=3.0)
