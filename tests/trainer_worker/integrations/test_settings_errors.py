"""A settings model's validation failure as one ReductionConfigError line naming, per bad
value, its source (config key, flag or LOSSREDUCE_* style variable), the value and what is
allowed."""

from __future__ import annotations

import enum
from typing import Literal

import pytest
from pydantic import BaseModel, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from lossreduce.errors import ReductionConfigError
from lossreduce.trainer_worker.integrations.settings_errors import (
    allowed_values,
    settings_error,
    validate_settings,
)


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Inner(BaseModel):
    rate: float = Field(default=1.0, gt=0, description="A rate.")


class Knobs(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KNOBS_", frozen=True, extra="forbid")

    mode: Literal["a", "b"] = Field(default="a", description="A choice.")
    color: Color = Field(default=Color.RED, description="An enum.")
    wait_s: float = Field(default=1.0, gt=0, le=10, description="A bounded number.")
    count: int = Field(default=1, ge=1, description="A bounded integer.")
    flag: bool = Field(default=False, description="A switch.")
    name: str = Field(default="x", pattern=r"^[a-z]+$", description="A patterned text.")
    token: SecretStr | None = Field(default=None, description="A secret.")
    inner: Inner = Field(default_factory=Inner, description="A nested model.")

    @model_validator(mode="after")
    def _count_needs_a(self) -> Knobs:
        if self.mode == "b" and self.count > 1:
            raise ValueError("count > 1 needs mode 'a'")
        return self


@pytest.fixture(autouse=True)
def _no_knobs_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for field in Knobs.model_fields:
        monkeypatch.delenv(f"KNOBS_{field.upper()}", raising=False)


def refused(given: dict[str, object], **kwargs: object) -> str:
    with pytest.raises(ReductionConfigError) as caught:
        validate_settings(Knobs, given, what="knobs", **kwargs)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "\n" not in message, message
    assert message.startswith("knobs: "), message
    return message.removeprefix("knobs: ")


def test_a_literal_from_a_config_key_names_the_key_the_value_and_the_choices() -> None:
    assert refused({"mode": "c"}, key_prefix="cfg.knobs") == "cfg.knobs.mode=c: must be one of a, b"


def test_an_enum_from_its_environment_variable_names_the_variable_and_the_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KNOBS_COLOR", "green")
    assert refused({}) == "KNOBS_COLOR=green: must be one of red, blue"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            {"wait_s": 0},
            "wait_s=0: Input should be greater than 0 (allowed: a number > 0 and <= 10)",
        ),
        (
            {"wait_s": "soon"},
            "wait_s=soon: Input should be a valid number, unable to parse string as a number "
            "(allowed: a number > 0 and <= 10)",
        ),
        ({"count": 0}, "(allowed: an integer >= 1)"),
        ({"flag": "maybe"}, "flag=maybe: Input should be a valid boolean"),
        ({"name": "A b"}, "name=A b: String should match pattern '^[a-z]+$'"),
    ],
)
def test_a_number_names_its_bounds_and_others_what_they_accept(
    given: dict[str, object], expected: str
) -> None:
    assert expected in refused(given)


def test_a_boolean_says_true_or_false() -> None:
    assert refused({"flag": "maybe"}).endswith("(allowed: true or false)")


def test_every_bad_value_is_on_the_first_line_with_its_own_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KNOBS_WAIT_S", "-1")
    message = refused(
        {"mode": "z", "count": "many", "inner": {"rate": -2}},
        sources={"mode": "trainer(mode=...)"},
        key_prefix="cfg",
    )
    assert message.split("; ") == [
        "trainer(mode=...)=z: must be one of a, b",
        "KNOBS_WAIT_S=-1: Input should be greater than 0 (allowed: a number > 0 and <= 10)",
        "cfg.count=many: Input should be a valid integer, unable to parse string as an integer "
        "(allowed: an integer >= 1)",
        "cfg.inner.rate=-2: Input should be greater than 0 (allowed: a number > 0)",
    ]


def test_a_given_value_wins_over_its_variable_and_is_named_by_its_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KNOBS_COUNT", "0")
    assert validate_settings(Knobs, {"count": 2}, what="knobs").count == 2
    # The variable of a field that was given is not its source.
    assert refused({"count": 0}, key_prefix="cfg").startswith("cfg.count=0:")
    monkeypatch.setenv("KNOBS_MODE", "q")
    assert refused({"count": 2}) == "KNOBS_MODE=q: must be one of a, b"


def test_a_flag_is_shown_as_typed_on_a_command_line() -> None:
    message = refused({"wait_s": "0"}, sources={"wait_s": "--wait-s"})
    assert message.startswith("--wait-s 0: Input should be greater than 0")


def test_an_unknown_key_lists_the_keys_there_are() -> None:
    assert refused({"mdoe": "a"}, key_prefix="cfg") == (
        "cfg.mdoe=a: no such setting (allowed: mode, color, wait_s, count, flag, name, "
        "token, inner)"
    )


def test_a_check_across_fields_says_where_they_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KNOBS_MODE", "b")
    assert refused({"count": 3}, key_prefix="cfg") == (
        "count > 1 needs mode 'a' (from KNOBS_MODE=b, cfg.count=3)"
    )


def test_a_secret_is_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "12345" not in refused({"token": 12345})
    monkeypatch.setenv("KNOBS_TOKEN", "hunter2")
    monkeypatch.setenv("KNOBS_MODE", "b")
    assert "hunter2" not in refused({"count": 2, "token": 7})


def test_a_model_read_from_one_variable_names_the_field_inside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KNOBS_INNER", '{"rate": -1}')
    assert refused({}) == (
        'KNOBS_INNER={"rate": -1}: rate=-1: Input should be greater than 0 (allowed: a number > 0)'
    )


def test_a_variable_that_is_not_json_for_a_model_field_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KNOBS_INNER", "fast")
    message = refused({})
    assert message.startswith("KNOBS_INNER=fast: not valid JSON")
    assert message.endswith("(allowed: a JSON object of inner's fields)")


def test_settings_error_turns_a_caught_error_with_the_environment_given() -> None:
    with pytest.raises(ValidationError) as caught:
        Knobs(wait_s=50)
    err = settings_error(
        caught.value,
        Knobs,
        what="knobs",
        sources={"wait_s": "job.yaml:wait_s"},
        environ={"KNOBS_WAIT_S": "ignored: the field was given"},
        job="j",
        group="g",
    )
    assert isinstance(err, ReductionConfigError)
    assert isinstance(err, ValueError)
    assert (err.job, err.group) == ("j", "g")
    assert str(err) == (
        "knobs: job.yaml:wait_s=50: Input should be less than or equal to 10 "
        "(allowed: a number > 0 and <= 10)"
    )
    # Not given: the variable in ``environ`` is the source.
    err = settings_error(caught.value, Knobs, environ={"knobs_wait_s": "50"})
    assert str(err).startswith("knobs_wait_s=50: Input should be less than or equal to 10")


def test_allowed_values_of_each_kind() -> None:
    fields = Knobs.model_fields
    assert allowed_values(fields["mode"]) == "one of a, b"
    assert allowed_values(fields["color"]) == "one of red, blue"
    assert allowed_values(fields["wait_s"]) == "a number > 0 and <= 10"
    assert allowed_values(fields["count"]) == "an integer >= 1"
    assert allowed_values(fields["flag"]) == "true or false"
    assert allowed_values(fields["name"]) == "text matching ^[a-z]+$"
    assert allowed_values(fields["inner"]) is None
