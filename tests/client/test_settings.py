"""ClientSettings validation and the channel options derived from it."""

from __future__ import annotations

import pydantic
import pytest

from lossreduce.client import ClientSettings, channel_options
from lossreduce.client.settings import BASE_CHANNEL_OPTIONS


def test_every_field_is_described() -> None:
    undescribed = [
        name for name, field in ClientSettings.model_fields.items() if not field.description
    ]
    assert not undescribed


def test_defaults_keep_the_deadline_above_the_coordinators_round_timeout() -> None:
    settings = ClientSettings()
    assert settings.call_timeout_s > 300.0
    assert settings.use_stream


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("call_timeout_s", 0.0),
        ("retry_budget_s", -1.0),
        ("jitter", 1.0),
        ("backoff_multiplier", 0.5),
        ("max_message_bytes", 0),
    ],
)
def test_out_of_range_values_are_rejected_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(pydantic.ValidationError, match=field):
        ClientSettings.model_validate({field: value})


def test_initial_backoff_above_max_is_rejected_naming_both() -> None:
    with pytest.raises(
        pydantic.ValidationError, match=r"initial_backoff_s=5\.0.*max_backoff_s=1\.0"
    ):
        ClientSettings(initial_backoff_s=5.0, max_backoff_s=1.0)


def test_unknown_fields_are_rejected() -> None:
    with pytest.raises(pydantic.ValidationError, match="call_timeout"):
        ClientSettings.model_validate({"call_timeout": 3})


def test_channel_options_carry_keepalive_sizes_and_reconnect_backoff() -> None:
    settings = ClientSettings(
        keepalive_time_s=12.0,
        keepalive_timeout_s=3.0,
        max_message_bytes=1234,
        initial_backoff_s=0.25,
        max_backoff_s=1.5,
    )
    options = dict(channel_options(settings))
    assert options["grpc.keepalive_time_ms"] == 12_000
    assert options["grpc.keepalive_timeout_ms"] == 3_000
    assert options["grpc.max_send_message_length"] == 1234
    assert options["grpc.max_receive_message_length"] == 1234
    assert options["grpc.min_reconnect_backoff_ms"] == 250
    assert options["grpc.max_reconnect_backoff_ms"] == 1500
    assert set(BASE_CHANNEL_OPTIONS) <= set(channel_options(settings))
