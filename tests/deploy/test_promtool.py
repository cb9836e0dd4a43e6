"""``promtool`` over the shipped Prometheus files: the config and the rules are
valid, the rule unit tests pass, and those unit tests make every alert fire and
clear (and fail when an alert can no longer fire)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.prometheus

PROMETHEUS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
ALERT_NAMES = [
    rule["alert"]
    for group in yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"]
    for rule in group["rules"]
    if "alert" in rule
]


def _promtool(promtool: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )


def _duration_s(text: str) -> float:
    units = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * units[unit]
    return float(text)


def test_config_is_valid(promtool: str) -> None:
    result = _promtool(promtool, "check", "config", PROMETHEUS_DIR / "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout + result.stderr


def test_rules_are_valid(promtool: str) -> None:
    result = _promtool(promtool, "check", "rules", PROMETHEUS_DIR / "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(ALERT_NAMES)} rules found" in result.stdout


def test_rule_unit_tests_pass(promtool: str) -> None:
    result = _promtool(promtool, "test", "rules", PROMETHEUS_DIR / "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_unit_tests_fire_then_clear_every_alert() -> None:
    doc = yaml.safe_load((PROMETHEUS_DIR / "alerts_test.yml").read_text())
    fired: dict[str, list[float]] = {}
    quiet: dict[str, list[float]] = {}
    for case in doc["tests"]:
        for check in case["alert_rule_test"]:
            target = fired if check["exp_alerts"] else quiet
            target.setdefault(check["alertname"], []).append(_duration_s(check["eval_time"]))
    for name in ALERT_NAMES:
        assert name in fired, f"no unit test makes {name} fire"
        assert any(t > min(fired[name]) for t in quiet.get(name, [])), (
            f"no unit test checks that {name} clears after it fired"
        )
        assert any(t < min(fired[name]) for t in quiet.get(name, [])), (
            f"no unit test checks that {name} is quiet before its incident"
        )


def test_unit_tests_expect_every_label_and_annotation() -> None:
    doc = yaml.safe_load((PROMETHEUS_DIR / "alerts_test.yml").read_text())
    for case in doc["tests"]:
        for check in case["alert_rule_test"]:
            for expected in check["exp_alerts"]:
                assert "severity" in expected["exp_labels"], check
                assert set(expected["exp_annotations"]) == {"summary", "description"}, check


@pytest.mark.parametrize("alertname", ALERT_NAMES)
def test_unit_tests_fail_when_an_alert_cannot_fire(
    promtool: str, tmp_path: Path, alertname: str
) -> None:
    # Proves the unit tests really exercise each alert: with its expression
    # replaced by one that never returns anything, `promtool test rules` fails.
    doc: dict[str, Any] = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alertname:
                rule["expr"] = "vector(1) == 0"
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(doc))
    shutil.copy(PROMETHEUS_DIR / "alerts_test.yml", tmp_path / "alerts_test.yml")
    result = _promtool(promtool, "test", "rules", tmp_path / "alerts_test.yml")
    assert result.returncode != 0
    assert f"alertname: {alertname}," in result.stdout + result.stderr
