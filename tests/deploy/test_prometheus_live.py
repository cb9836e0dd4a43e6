"""Live: the shipped Prometheus config against a real coordinator and real Ray.

A coordinator runs rounds of every outcome driven by real clients; a node agent
in front of it forwards rounds of its own ranks (one aggregated, one falling
back to per-rank contributions); a local Ray cluster runs an actor recording
trainer steps through ``trainer_worker/metrics.py``; a real Prometheus, started with
``deploy/prometheus/prometheus.yml`` rewritten only where it must be (scrape
targets onto this test's loopback ports, a 1 s scrape interval), scrapes all three
and evaluates ``alerts.yml``. Then every expression of the Grafana dashboard and
of the alert rules (without its threshold), read from the files themselves,
must return data through Prometheus' HTTP API.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

from lossreduce.client import ClientSettings, ReductionClient
from lossreduce.client.agent import AgentSettings, NodeAgentThread
from lossreduce.errors import (
    ContractMismatchError,
    EmptyNormalizerError,
    InvalidPartialError,
    LossReduceError,
    RoundAbortedError,
    RoundTimeoutError,
)
from lossreduce.server import CoordinatorThread, OutcomeKind
from lossreduce.trainer_worker.train.metrics import WorkerMetrics
from tests.ray_support import local_ray

JOB, GROUP = "deploy-live", "actor"
AGENT_GROUP = "agent"
"""The group of the rounds that go through the node agent."""
RATE_WINDOW = "5m"  # stands in for Grafana's $__rate_interval; long enough to outlast any wait
RUN = "dashboard-run"
WAIT_S = 90.0  # bound on every wait for Prometheus; normally a few seconds
COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")


# -- reading the expressions out of the files (pure) ------------------------------


def strip_threshold(expr: str) -> str:
    """``EXPR > 0.1`` -> ``EXPR``: drop a final top-level comparison with a number.

    Comparisons inside parentheses, braces, brackets or strings are not top
    level; an expression without a final ``OP NUMBER`` is returned unchanged.
    """
    depth, quote, last = 0, "", -1
    i = 0
    while i < len(expr):
        ch = expr[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'`":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and expr.startswith(COMPARISONS, i):
            # `=~` / `!~` are matchers (only inside braces); `==` and `!=` are two characters.
            op = next(c for c in COMPARISONS if expr.startswith(c, i))
            last = i
            i += len(op) - 1
        i += 1
    if last < 0:
        return expr.strip()
    op = next(c for c in COMPARISONS if expr.startswith(c, last))
    right = expr[last + len(op) :].strip().removeprefix("bool").strip()
    try:
        float(right)
    except ValueError:
        return expr.strip()
    return expr[:last].strip()


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every target expression of the dashboard, template variables filled in
    with their "All" value and ``$__rate_interval`` with :data:`RATE_WINDOW`."""
    values = {"__rate_interval": RATE_WINDOW}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            values[variable["name"]] = variable["allValue"]
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            # Longest names first, so `$group` is not read as `$g` + `roup`.
            for name in sorted(values, key=len, reverse=True):
                expr = expr.replace("${" + name + "}", values[name]).replace(
                    "$" + name, values[name]
                )
            assert "$" not in expr, f"unknown template variable in {target['expr']!r}"
            queries.append(expr)
    return queries


def alert_queries(alert_rules: list[dict[str, Any]]) -> list[str]:
    return [strip_threshold(rule["expr"]) for rule in alert_rules]


def rewrite_config(
    config: dict[str, Any], targets: dict[str, str], rules: Path, sd_dir: Path
) -> dict[str, Any]:
    """The shipped config with every scrape job pointed at ``targets[job_name]``.

    Static targets are replaced; file-based discovery reads a file written
    here. Everything else stays as shipped, but for a 1 s scrape and rule
    evaluation interval and the rule file's absolute path.
    """
    rewritten = copy.deepcopy(config)
    rewritten["global"]["scrape_interval"] = "1s"
    rewritten["global"]["evaluation_interval"] = "1s"
    rewritten["rule_files"] = [str(rules)]
    for job in rewritten["scrape_configs"]:
        name = job["job_name"]
        assert name in targets, f"the live test has no target for scrape job {name!r}"
        for static in job.get("static_configs", []):
            static["targets"] = [targets[name]]
        for sd in job.get("file_sd_configs", []):
            sd_file = sd_dir / f"{name}.json"
            sd_file.write_text(json.dumps([{"targets": [targets[name]], "labels": {}}]))
            sd["files"] = [str(sd_file)]
    return rewritten


def test_strip_threshold_drops_only_a_final_top_level_number_comparison() -> None:
    assert strip_threshold('up{job="c"} == 0') == 'up{job="c"}'
    assert strip_threshold("sum(rate(a[5m]))\n  /\nsum(rate(b[5m]))\n  > 0.1\n") == (
        "sum(rate(a[5m]))\n  /\nsum(rate(b[5m]))"
    )
    assert strip_threshold("histogram_quantile(0.99, sum by (le) (x)) > 30") == (
        "histogram_quantile(0.99, sum by (le) (x))"
    )
    assert strip_threshold("increase(x[15m]) >= 3") == "increase(x[15m])"
    assert strip_threshold("x > bool 1") == "x"
    assert strip_threshold('x{a!="b", c=~"d>1"}') == 'x{a!="b", c=~"d>1"}'
    assert strip_threshold("max(x > 1)") == "max(x > 1)"
    assert strip_threshold("a > b") == "a > b"


def test_dashboard_queries_fill_in_every_variable() -> None:
    dashboard = {
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource"},
                {"name": "group", "type": "query", "allValue": ".*"},
                {"name": "g", "type": "query", "allValue": "G"},
            ]
        },
        "panels": [
            {"type": "row"},
            {"targets": [{"expr": 'rate(x{group=~"$group", g="${g}"}[$__rate_interval])'}]},
        ],
    }
    assert dashboard_queries(dashboard) == [f'rate(x{{group=~".*", g="G"}}[{RATE_WINDOW}])']


def test_rewrite_config_moves_only_the_targets(
    tmp_path: Path, prometheus_config: dict[str, Any]
) -> None:
    targets = {
        "lossreduce-coordinator": "127.0.0.1:1",
        "ray": "127.0.0.1:2",
        "lossreduce-agent": "127.0.0.1:3",
    }
    rewritten = rewrite_config(prometheus_config, targets, tmp_path / "alerts.yml", tmp_path)
    for shipped, moved in zip(
        prometheus_config["scrape_configs"], rewritten["scrape_configs"], strict=True
    ):
        assert {k: v for k, v in shipped.items() if not k.endswith("_configs")} == {
            k: v for k, v in moved.items() if not k.endswith("_configs")
        }
    sd_file = Path(rewritten["scrape_configs"][1]["file_sd_configs"][0]["files"][0])
    assert json.loads(sd_file.read_text())[0]["targets"] == ["127.0.0.1:2"]


# -- the live environment ------------------------------------------------------------


class Prometheus:
    """A Prometheus process of this test, queried over its HTTP API."""

    def __init__(self, binary: str, config: Path, storage: Path, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = storage.parent / "prometheus.log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={storage}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        result: list[dict[str, Any]] = data["result"]
        return result

    def wait_ready(self) -> None:
        self.wait_for("Prometheus ready", self._ready)

    def _ready(self) -> bool:
        assert self.process.poll() is None, self.log.read_text()
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def wait_for(self, what: str, condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(f"gave up waiting for: {what}\n{self.log.read_text()[-3000:]}")
            time.sleep(0.25)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@contextmanager
def running_prometheus(
    binary: str, config: dict[str, Any], tmp_path: Path, port: int
) -> Iterator[Prometheus]:
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    prometheus = Prometheus(binary, config_file, tmp_path / "data", port)
    try:
        prometheus.wait_ready()
        yield prometheus
    finally:
        prometheus.stop()


@contextmanager
def ray_node(metrics_port: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # User metrics reach the export port every 10 s by default; 0.5 s keeps the test short.
    monkeypatch.setenv("RAY_metrics_report_interval_ms", "500")
    with local_ray(num_cpus=1, metrics_export_port=metrics_port):
        yield


def _pair(
    first: Callable[[], object], second: Callable[[], object]
) -> tuple[object | BaseException, object | BaseException]:
    """Run two ranks' calls concurrently; each result or the exception it raised."""

    def call(fn: Callable[[], object]) -> object | BaseException:
        try:
            return fn()
        except LossReduceError as err:
            return err

    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(call, first), pool.submit(call, second)
        return a.result(), b.result()


def drive_every_outcome(target: str, base_step: int) -> None:
    """One round of each outcome between ranks 0 and 1, plus a deduplicated retry."""
    with (
        # A run that claims the group, so its holder series has data.
        ReductionClient(target, job=JOB, group=GROUP, rank=0, world_size=2, run=RUN) as r0,
        ReductionClient(target, job=JOB, group=GROUP, rank=1, world_size=2, run=RUN) as r1,
    ):
        step = base_step
        ok0, ok1 = _pair(
            lambda: r0.reduce(step, {"pg": 3.0, "kl": 0.0}),
            lambda: r1.reduce(step, {"pg": 5.0, "kl": 2.0}),
        )
        assert ok0 == ok1 == {"pg": 8.0, "kl": 2.0}
        assert r0.reduce(step, {"pg": 3.0, "kl": 0.0}) == ok0  # a retry, answered from the round

        empty = _pair(
            lambda: r0.reduce(step + 1, {"pg": 0.0}), lambda: r1.reduce(step + 1, {"pg": 0.0})
        )
        assert all(isinstance(e, EmptyNormalizerError) for e in empty), empty

        bad, peer = _pair(
            lambda: r0.reduce(step + 2, {"pg": math.nan}), lambda: r1.reduce(step + 2, {"pg": 1.0})
        )
        assert isinstance(bad, InvalidPartialError), bad
        assert isinstance(peer, RoundAbortedError), peer

        with pytest.raises(RoundTimeoutError):
            r0.reduce(step + 3, {"pg": 1.0})  # rank 1 never comes

        mismatch = _pair(
            lambda: r0.reduce(step + 4, {"pg": 1.0}, {"pg": "mean:token_mean"}),
            lambda: r1.reduce(step + 4, {"pg": 1.0}, {"pg": "sum:token_mean"}),
        )
        assert any(isinstance(e, ContractMismatchError) for e in mismatch), mismatch


def drive_agent(target: str, base_step: int) -> None:
    """Through the node agent of ranks 0 and 1: one aggregated round, one where rank 0
    sends NaN, so the agent falls back to per-rank contributions."""
    settings = ClientSettings(token=None, retry_budget_s=1.0)
    r0, r1 = (
        ReductionClient(target, job=JOB, group=AGENT_GROUP, rank=r, world_size=2, settings=settings)
        for r in (0, 1)
    )
    with r0, r1:
        ok0, ok1 = _pair(
            lambda: r0.reduce(base_step, {"pg": 3.0}), lambda: r1.reduce(base_step, {"pg": 5.0})
        )
        assert ok0 == ok1 == {"pg": 8.0}
        bad, peer = _pair(
            lambda: r0.reduce(base_step + 1, {"pg": math.nan}),
            lambda: r1.reduce(base_step + 1, {"pg": 1.0}),
        )
        assert isinstance(bad, InvalidPartialError), bad
        assert isinstance(peer, RoundAbortedError), peer


def record_worker_steps(recorder: Any, reward: float) -> None:
    ray.get(
        recorder.record_step.remote(
            0.2, {"pg": 0.3, "kl": 0.01}, {"pg": 8.0, "kl": 2.0}, reward, False
        )
    )
    ray.get(recorder.record_step.remote(0.05, {}, {}, reward, True))


# -- the test ---------------------------------------------------------------------------


@pytest.mark.prometheus
@pytest.mark.ray
def test_every_dashboard_and_alert_expression_returns_data(
    *,
    prometheus_bin: str,
    prometheus_config: dict[str, Any],
    alert_rules: list[dict[str, Any]],
    dashboard: dict[str, Any],
    deploy_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    free_port: Callable[[], int],
    coordinator_factory: Callable[..., CoordinatorThread],
) -> None:
    ray_metrics_port = free_port()
    coordinator = coordinator_factory(round_timeout_s=0.5)  # the timeout round is short
    agent_settings = AgentSettings(
        local_ranks=(0, 1), metrics_port=0, token=None, retry_budget_s=1.0, shutdown_grace_s=0.2
    )
    with (
        ray_node(ray_metrics_port, monkeypatch),
        NodeAgentThread(coordinator.target, job=JOB, settings=agent_settings) as agent,
    ):
        recorder = ray.remote(num_cpus=0)(WorkerMetrics).remote(JOB)
        targets = {
            "lossreduce-coordinator": f"127.0.0.1:{coordinator.metrics_port}",
            "ray": f"127.0.0.1:{ray_metrics_port}",
            "lossreduce-agent": f"127.0.0.1:{agent.metrics_port}",
        }
        config = rewrite_config(
            prometheus_config, targets, deploy_dir / "prometheus" / "alerts.yml", tmp_path
        )
        with running_prometheus(prometheus_bin, config, tmp_path, free_port()) as prometheus:
            prometheus.wait_for(
                "both scrape targets up",
                lambda: (
                    sorted(s["metric"]["job"] for s in prometheus.query("up == 1"))
                    == sorted(targets)
                ),
            )
            # Two waves with a scrape between them: counters and histograms
            # must exist before they grow, or rate() and increase() see nothing.
            drive_every_outcome(coordinator.target, base_step=0)
            drive_agent(agent.target, base_step=0)
            record_worker_steps(recorder, reward=0.25)
            outcomes = {kind.value for kind in OutcomeKind} - {"aborted_shutdown"}
            prometheus.wait_for(
                "the first wave scraped",
                lambda: (
                    {
                        s["metric"]["outcome"]
                        for s in prometheus.query(f'lossreduce_rounds_total{{job="{JOB}"}} > 0')
                    }
                    == outcomes
                    and bool(
                        prometheus.query(
                            f'ray_lossreduce_worker_skipped_steps_total{{job="{JOB}"}}'
                        )
                    )
                    and bool(
                        prometheus.query(
                            f'lossreduce_agent_fallbacks_total{{job="{JOB}", reason="invalid"}} > 0'
                        )
                    )
                ),
            )
            drive_every_outcome(coordinator.target, base_step=100)
            drive_agent(agent.target, base_step=100)
            record_worker_steps(recorder, reward=0.75)

            queries = dashboard_queries(dashboard) + alert_queries(alert_rules)
            missing: dict[str, list[dict[str, Any]]] = {}

            def all_have_data() -> bool:
                missing.clear()
                for query in queries:
                    result = prometheus.query(query)
                    if not any(math.isfinite(float(s["value"][1])) for s in result):
                        missing[query] = result
                return not missing

            deadline = time.monotonic() + WAIT_S
            while not all_have_data() and time.monotonic() < deadline:
                time.sleep(0.5)
            assert not missing, "queries without finite data:\n" + "\n".join(
                f"{q}\n  -> {r}" for q, r in missing.items()
            )

            groups = prometheus.get("/api/v1/rules")["groups"]
            rules = {rule["name"]: rule for group in groups for rule in group["rules"]}
            assert set(rules) == {rule["alert"] for rule in alert_rules}
            for name, rule in rules.items():
                assert rule["health"] == "ok", (name, rule.get("lastError"))
