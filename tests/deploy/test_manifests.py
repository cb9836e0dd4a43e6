"""Structural tests of ``deploy/``.

Every file parses; Kubernetes objects validate against the Kubernetes API
schemas (``kubernetes-validate``), the ``ray up`` config against the schema Ray
ships; the dashboard and the alerts carry what an operator needs; and ports,
flags, names and images agree with the code (``CoordinatorSettings``,
``lossreduce serve|train --help``, the proto's service name, the metric names,
``pyproject.toml``), so the files cannot drift from it silently.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import shlex
import subprocess
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import ray.autoscaler
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.metrics_core import Metric

from lossreduce.client.agent_metrics import AgentMetrics
from lossreduce.server import SERVICE_NAME, CoordinatorMetrics, CoordinatorSettings
from lossreduce.server.cli import build_parser, settings_from_args
from lossreduce.server.hardening import harden
from lossreduce.server.security import InsecureBindingError
from lossreduce.v2 import coordinator_pb2, coordinator_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
OPTIONAL_LABEL = "lossreduce.dev/optional"
SEVERITIES = {"critical", "warning", "info"}
# What Ray exports for trainer_worker/metrics.py (a `ray_` prefix; counters get
# `_total`); the live Prometheus test checks these against a real Ray.
WORKER_SERIES = {
    "ray_lossreduce_worker_step_seconds_bucket",
    "ray_lossreduce_worker_loss",
    "ray_lossreduce_worker_global_normalizer",
    "ray_lossreduce_worker_reward",
    "ray_lossreduce_worker_skipped_steps_total",
}
SERIES_NAME = re.compile(r"\b(?:ray_)?lossreduce_[a-z_]+\b")
TOKEN_ENV = "LOSSREDUCE_TOKEN"
ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")

DEFAULTS = CoordinatorSettings.model_fields
GRPC_PORT: int = DEFAULTS["port"].default
METRICS_PORT: int = DEFAULTS["metrics_port"].default


# -- helpers -------------------------------------------------------------------


def _load_all(relative: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / relative).read_text()) if doc]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


@functools.cache
def _help_flags(command: str) -> frozenset[str]:
    """Every ``--flag`` that ``lossreduce COMMAND --help`` documents."""
    result = subprocess.run(
        [sys.executable, "-m", "lossreduce.cli", command, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return frozenset(re.findall(r"(--[a-z][a-z0-9-]*)", result.stdout))


def _flags(argv: list[str]) -> dict[str, str]:
    """``--flag value`` / ``--flag=value`` pairs of an argument list (``""`` for bare flags)."""
    flags: dict[str, str] = {}
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        name, eq, value = arg.partition("=")
        if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
        flags[name] = value
    return flags


def _lossreduce_command(shell_line: str, subcommand: str) -> list[str]:
    """The ``lossreduce SUBCOMMAND ...`` words of a shell command line (up to a redirection)."""
    words = shlex.split(shell_line)
    start = words.index("lossreduce")
    assert words[start + 1] == subcommand, shell_line
    end = next((i for i in range(start, len(words)) if words[i][0] in "<>&|;"), len(words))
    return words[start:end]


def _env_names(shell_line: str) -> set[str]:
    """The variables a shell command line assigns for its command (``NAME=value cmd``)."""
    names = set()
    for word in shlex.split(shell_line):
        if not ENV_WORD.match(word):
            break
        names.add(word.split("=", 1)[0])
    return names


def _check_serve_config(
    argv: list[str], env: set[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> CoordinatorSettings:
    """Do what ``lossreduce serve ARGV`` does before it binds: parse the flags over
    the environment (each variable in ``env`` set as a deployment would, a token
    for the token), load the tokens and TLS files, apply the binding rule, open
    the journal (moved under ``tmp_path``)."""
    monkeypatch.chdir(tmp_path)  # a relative (default) journal lands here
    for name in {k for k in os.environ if k.startswith("LOSSREDUCE_")}:
        monkeypatch.delenv(name)
    for name in env:
        assert name == TOKEN_ENV, f"no test value for {name}"
        monkeypatch.setenv(name, secrets.token_urlsafe(24))
    argv = list(argv)
    if "--journal" in argv:
        argv[argv.index("--journal") + 1] = str(tmp_path / "journal.sqlite3")
    settings = settings_from_args(build_parser().parse_args(argv))
    harden(settings).close()
    return settings


def _secret_env(container: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Variables of a container set from a Secret: name -> (secret, key)."""
    return {
        e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


def _exported_series() -> set[str]:
    """The series names the coordinator and the node agent export, as PromQL selects them."""
    suffix = {"counter": "_total", "histogram": "_bucket", "gauge": ""}
    families: list[Metric] = [
        *CoordinatorMetrics().registry.collect(),
        *AgentMetrics("upstream:1").registry.collect(),
    ]
    return {family.name + suffix[family.type] for family in families}


def _k8s_validate(doc: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as err:
        kind, name = doc.get("kind"), doc.get("metadata", {}).get("name")
        pytest.fail(f"{kind} {name}: {err.message} at {list(err.absolute_path)}")


def _as_pod_template(name: str, template: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": name},
        "template": template,
    }


def _container_port(container: dict[str, Any], name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert name in ports, f"container {container['name']} has no port named {name!r}"
    port: int = ports[name]
    return port


def _dashboard_exprs(dashboard: dict[str, Any]) -> Iterator[str]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield target["expr"]


# -- every file ----------------------------------------------------------------

EXPECTED_FILES = {
    "Dockerfile",
    "Dockerfile.dockerignore",
    "README.md",
    "grafana/lossreduce.json",
    "k8s/coordinator.yaml",
    "kuberay/rayjob.yaml",
    "prometheus/alerts.yml",
    "prometheus/alerts_test.yml",
    "prometheus/prometheus.yml",
    "ray/cluster.yaml",
}


def test_deploy_holds_the_expected_files() -> None:
    files = {str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*") if p.is_file()}
    assert files == EXPECTED_FILES


@pytest.mark.parametrize(
    "relative", sorted(f for f in EXPECTED_FILES if f.endswith((".yml", ".yaml")))
)
def test_yaml_parses(relative: str) -> None:
    assert _load_all(relative)


def test_dashboard_json_parses() -> None:
    assert json.loads((DEPLOY / "grafana/lossreduce.json").read_text())["panels"]


def test_readme_walks_through_every_file() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for relative in EXPECTED_FILES - {"README.md"}:
        assert f"`{relative}`" in readme or f"({relative})" in readme, relative


# -- Grafana -------------------------------------------------------------------


def test_dashboard_datasource_is_templated(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "group"):
        assert variables[name]["datasource"] == DATASOURCE
        assert variables[name]["includeAll"]
        assert variables[name]["allValue"] == ".*"
    assert "__inputs" not in dashboard  # nothing to map by hand on import


def test_every_panel_has_a_prometheus_target(dashboard: dict[str, Any]) -> None:
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_dashboard_shows_every_coordinator_and_worker_series(dashboard: dict[str, Any]) -> None:
    used = {name for expr in _dashboard_exprs(dashboard) for name in SERIES_NAME.findall(expr)}
    assert _exported_series() | WORKER_SERIES <= used


def test_dashboard_and_alerts_use_only_exported_series(
    dashboard: dict[str, Any], alert_rules: list[dict[str, Any]]
) -> None:
    exprs = [*_dashboard_exprs(dashboard), *(rule["expr"] for rule in alert_rules)]
    used = {name for expr in exprs for name in SERIES_NAME.findall(expr)}
    assert used <= _exported_series() | WORKER_SERIES


# -- Prometheus ------------------------------------------------------------------


def _scrape_job(config: dict[str, Any], name: str) -> dict[str, Any]:
    jobs: dict[str, dict[str, Any]] = {job["job_name"]: job for job in config["scrape_configs"]}
    assert name in jobs, f"prometheus.yml has no scrape job {name!r}"
    return jobs[name]


def _coordinator_scrape_job_name(alert_rules: list[dict[str, Any]]) -> str:
    (rule,) = (r for r in alert_rules if r["alert"] == "LossReduceCoordinatorDown")
    match = re.search(r'up\{job="([^"]+)"\}', rule["expr"])
    assert match, rule["expr"]
    return match.group(1)


def test_every_alert_has_severity_summary_and_description(
    alert_rules: list[dict[str, Any]],
) -> None:
    names = [rule["alert"] for rule in alert_rules]
    assert len(names) == len(set(names))
    for rule in alert_rules:
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert rule["annotations"]["description"].strip(), rule["alert"]


def test_prometheus_scrapes_the_coordinator_on_its_default_metrics_port(
    prometheus_config: dict[str, Any], alert_rules: list[dict[str, Any]]
) -> None:
    job = _scrape_job(prometheus_config, _coordinator_scrape_job_name(alert_rules))
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets
    assert all(t.rsplit(":", 1)[1] == str(METRICS_PORT) for t in targets)
    # The lossreduce series carry their own `job` label: keep it as it is.
    assert job["honor_labels"] is True


def test_prometheus_scrapes_ray_through_its_discovery_file(
    prometheus_config: dict[str, Any],
) -> None:
    from ray._private.ray_constants import PROMETHEUS_SERVICE_DISCOVERY_FILE

    job = _scrape_job(prometheus_config, "ray")
    files = [f for sd in job["file_sd_configs"] for f in sd["files"]]
    assert files == [f"/tmp/ray/{PROMETHEUS_SERVICE_DISCOVERY_FILE}"]
    assert job["honor_labels"] is True


def test_prometheus_loads_the_alert_rules(prometheus_config: dict[str, Any]) -> None:
    assert prometheus_config["rule_files"] == ["alerts.yml"]
    assert (DEPLOY / "prometheus" / prometheus_config["rule_files"][0]).is_file()


# -- Kubernetes: the coordinator --------------------------------------------------


@pytest.fixture(scope="module")
def coordinator_docs() -> list[dict[str, Any]]:
    return _load_all("k8s/coordinator.yaml")


@pytest.fixture(scope="module")
def coordinator_container(coordinator_docs: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = _one(coordinator_docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def test_kubernetes_objects_match_the_api_schemas(coordinator_docs: list[dict[str, Any]]) -> None:
    built_in = [doc for doc in coordinator_docs if "." not in doc["apiVersion"].split("/")[0]]
    assert {doc["kind"] for doc in built_in} == {"Deployment", "Service", "PersistentVolumeClaim"}
    for doc in built_in:
        _k8s_validate(doc)


def test_coordinator_container_serves_on_the_default_ports(
    coordinator_container: dict[str, Any],
) -> None:
    args = coordinator_container["args"]
    assert args[0] == "serve"
    flags = _flags(args)
    assert set(flags) <= _help_flags("serve")
    assert flags["--host"] == "0.0.0.0"
    assert int(flags["--port"]) == _container_port(coordinator_container, "grpc") == GRPC_PORT
    assert (
        int(flags["--metrics-port"])
        == _container_port(coordinator_container, "metrics")
        == METRICS_PORT
    )
    assert coordinator_container["image"]


def test_coordinator_probes_use_grpc_health(coordinator_container: dict[str, Any]) -> None:
    grpc_port = _container_port(coordinator_container, "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert coordinator_container[probe]["grpc"]["port"] == grpc_port, probe
    # Readiness follows the service, which turns NOT_SERVING first on shutdown.
    assert coordinator_container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME


def test_coordinator_has_resources_and_drains_within_its_grace_period(
    coordinator_docs: list[dict[str, Any]], coordinator_container: dict[str, Any]
) -> None:
    requests = coordinator_container["resources"]["requests"]
    assert {"cpu", "memory"} <= set(requests)
    assert "memory" in coordinator_container["resources"]["limits"]
    pod = _one(coordinator_docs, "Deployment")["spec"]["template"]["spec"]
    grace = float(
        _flags(coordinator_container["args"]).get(
            "--shutdown-grace-s", DEFAULTS["shutdown_grace_s"].default
        )
    )
    assert pod["terminationGracePeriodSeconds"] > grace
    mounts = {m["mountPath"] for m in coordinator_container["volumeMounts"]}
    assert coordinator_container["workingDir"] in mounts  # writable under a read-only root


def test_service_and_service_monitor_reach_the_coordinator(
    coordinator_docs: list[dict[str, Any]],
    coordinator_container: dict[str, Any],
    alert_rules: list[dict[str, Any]],
) -> None:
    deployment = _one(coordinator_docs, "Deployment")
    service = _one(coordinator_docs, "Service")
    monitor = _one(coordinator_docs, "ServiceMonitor")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    container_ports = {p["name"] for p in coordinator_container["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in container_ports
        assert port["port"] == _container_port(coordinator_container, port["targetPort"])
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
    # The Prometheus Operator names the scrape job after the Service: the
    # coordinator-down alert must match it as it matches prometheus.yml's.
    assert service["metadata"]["name"] == _coordinator_scrape_job_name(alert_rules)
    assert monitor["metadata"]["labels"][OPTIONAL_LABEL] == "true"
    for doc in coordinator_docs:
        if doc is not monitor:
            assert OPTIONAL_LABEL not in doc["metadata"]["labels"], doc["kind"]


def test_coordinator_container_passes_the_binding_rule_with_its_secret(
    coordinator_container: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = coordinator_container["args"][1:]
    secret_env = set(_secret_env(coordinator_container))
    assert secret_env == {TOKEN_ENV}
    settings = _check_serve_config(argv, secret_env, tmp_path, monkeypatch)
    assert settings.host == "0.0.0.0"  # so the rule really applied
    assert settings.journal is not None
    with pytest.raises(InsecureBindingError):  # and the Secret is what satisfies it
        _check_serve_config(argv, set(), tmp_path, monkeypatch)


def test_coordinator_container_args_start_a_serving_coordinator(
    coordinator_container: dict[str, Any], tmp_path: Path, free_port: Callable[[], int]
) -> None:
    # Run the manifest's own command line and environment, moved onto free
    # loopback ports and a temporary journal.
    argv = list(coordinator_container["args"])
    port = free_port()
    overrides = {
        "--host": "127.0.0.1",
        "--port": str(port),
        "--metrics-port": "0",
        "--journal": str(tmp_path / "journal.sqlite3"),
    }
    for flag, value in overrides.items():
        argv[argv.index(flag) + 1] = value
    token = secrets.token_urlsafe(24)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOSSREDUCE_")}
    env |= dict.fromkeys(_secret_env(coordinator_container), token)
    process = subprocess.Popen(
        [sys.executable, "-m", "lossreduce.cli", *argv],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            health = health_pb2_grpc.HealthStub(channel)
            answer = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
            stub = coordinator_pb2_grpc.ReductionCoordinatorStub(channel)
            request = coordinator_pb2.ListRoundsRequest()
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListRounds(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stub.ListRounds(request, timeout=10, metadata=[("authorization", f"Bearer {token}")])
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output


# -- KubeRay ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def rayjob_docs() -> list[dict[str, Any]]:
    return _load_all("kuberay/rayjob.yaml")


def _ray_groups(rayjob: dict[str, Any]) -> list[dict[str, Any]]:
    spec = rayjob["spec"]["rayClusterSpec"]
    return [spec["headGroupSpec"], *spec["workerGroupSpecs"]]


def test_rayjob_pod_templates_match_the_api_schemas(rayjob_docs: list[dict[str, Any]]) -> None:
    rayjob = _one(rayjob_docs, "RayJob")
    assert rayjob["apiVersion"] == "ray.io/v1"
    for i, group in enumerate(_ray_groups(rayjob)):
        _k8s_validate(_as_pod_template(f"group-{i}", group["template"]))
        (container,) = group["template"]["spec"]["containers"]
        assert {"cpu", "memory"} <= set(container["resources"]["requests"])


def test_rayjob_trains_against_the_coordinator_service(
    rayjob_docs: list[dict[str, Any]], coordinator_docs: list[dict[str, Any]]
) -> None:
    rayjob = _one(rayjob_docs, "RayJob")
    argv = _lossreduce_command(rayjob["spec"]["entrypoint"], "train")
    flags = _flags(argv)
    assert set(flags) <= _help_flags("train")
    service = _one(coordinator_docs, "Service")
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert flags["--coordinator"] == f"{service['metadata']['name']}:{grpc_port}"
    workers = sum(g["replicas"] for g in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"])
    assert int(flags["--workers"]) == workers  # one rank per worker pod


def trainer_image(coordinator_container: dict[str, Any]) -> str:
    """The trainer image's tag: the coordinator's, built from the same wheel (``-trainer``)."""
    return f"{coordinator_container['image']}-trainer"


def test_rayjob_exports_ray_metrics_and_uses_the_trainer_image(
    rayjob_docs: list[dict[str, Any]], coordinator_container: dict[str, Any]
) -> None:
    rayjob = _one(rayjob_docs, "RayJob")
    monitor = _one(rayjob_docs, "PodMonitor")
    installed_major = ray.__version__.split(".")[0]
    assert rayjob["spec"]["rayClusterSpec"]["rayVersion"].split(".")[0] == installed_major
    for group in _ray_groups(rayjob):
        (container,) = group["template"]["spec"]["containers"]
        assert container["image"] == trainer_image(coordinator_container)
        metrics_port = int(group["rayStartParams"]["metrics-export-port"])
        assert _container_port(container, "metrics") == metrics_port
        own_labels = monitor["spec"]["selector"]["matchLabels"].items() - {
            ("ray.io/is-ray-node", "yes")
        }
        assert own_labels <= group["template"]["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    assert monitor["metadata"]["labels"][OPTIONAL_LABEL] == "true"


def test_rayjob_trainers_send_the_coordinators_token(
    rayjob_docs: list[dict[str, Any]], coordinator_container: dict[str, Any]
) -> None:
    expected = _secret_env(coordinator_container)[TOKEN_ENV]
    for group in _ray_groups(_one(rayjob_docs, "RayJob")):
        (container,) = group["template"]["spec"]["containers"]
        assert _secret_env(container) == {TOKEN_ENV: expected}


# -- ray up ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster_config() -> dict[str, Any]:
    (config,) = _load_all("ray/cluster.yaml")
    return config


def test_ray_cluster_config_matches_rays_schema(cluster_config: dict[str, Any]) -> None:
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(cluster_config, schema)


def test_ray_cluster_runs_the_coordinator_where_prometheus_looks(
    cluster_config: dict[str, Any], coordinator_container: dict[str, Any]
) -> None:
    # The head runs Ray and `lossreduce serve`: the trainer image has both.
    assert cluster_config["docker"]["image"] == trainer_image(coordinator_container)
    commands = cluster_config["head_start_ray_commands"]
    serve = [_lossreduce_command(c, "serve") for c in commands if "lossreduce serve" in c]
    assert len(serve) == 1
    flags = _flags(serve[0])
    assert flags["--journal"]  # kept beside the log, not in whatever the cwd is
    assert set(flags) <= _help_flags("serve")
    assert int(flags["--port"]) == GRPC_PORT
    assert int(flags["--metrics-port"]) == METRICS_PORT  # prometheus.yml: localhost:9464
    starts = [
        c
        for key in ("head_start_ray_commands", "worker_start_ray_commands")
        for c in cluster_config[key]
        if "ray start" in c
    ]
    assert len(starts) == 2
    assert all("--metrics-export-port=" in c for c in starts)


def test_ray_cluster_shares_the_token_with_the_coordinator_and_every_raylet(
    cluster_config: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands = [
        c
        for key in ("head_start_ray_commands", "worker_start_ray_commands")
        for c in cluster_config[key]
        if "ray start" in c or "lossreduce serve" in c
    ]
    (token_dir,) = cluster_config["file_mounts"]
    token_file = f"{token_dir}/token"
    for command in commands:
        # Ray's workers (the trainer ranks) inherit the raylet's environment.
        assert _env_names(command) == {TOKEN_ENV}, command
        assert f"$(cat {token_file})" in command, command
    (serve,) = (c for c in commands if "lossreduce serve" in c)
    settings = _check_serve_config(
        _lossreduce_command(serve, "serve")[2:], _env_names(serve), tmp_path, monkeypatch
    )
    assert settings.host == "0.0.0.0"


def test_ray_cluster_train_commands_use_real_flags_and_reach_the_head(
    cluster_config: dict[str, Any],
) -> None:
    prefix = "#   ray exec deploy/ray/cluster.yaml "
    lines = (DEPLOY / "ray/cluster.yaml").read_text().splitlines()
    train = [
        _flags(_lossreduce_command(shlex.split(line.removeprefix(prefix))[0], "train"))
        for line in lines
        if line.startswith(prefix) and "lossreduce train" in line
    ]
    assert len(train) == 2, train  # the run's own coordinator, and the head's
    for flags in train:
        assert set(flags) <= _help_flags("train"), flags
    assert "--coordinator" not in train[0]
    # Ranks and agents on every node dial it: the head's address, never loopback.
    assert train[1]["--coordinator"] == f"{cluster_config['provider']['head_ip']}:{GRPC_PORT}"


def test_rayjob_aggregates_per_pod(rayjob_docs: list[dict[str, Any]]) -> None:
    rayjob = _one(rayjob_docs, "RayJob")
    flags = _flags(_lossreduce_command(rayjob["spec"]["entrypoint"], "train"))
    assert flags["--aggregation"] == "node"


def test_image_serves_only_with_a_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cmd = json.loads(dict(_image())["CMD"])
    with pytest.raises(InsecureBindingError):
        _check_serve_config(cmd[1:], set(), tmp_path, monkeypatch)
    _check_serve_config(cmd[1:], {TOKEN_ENV}, tmp_path, monkeypatch)


# -- the image ---------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


DEFAULT_TARGET = ""
"""The stage `docker build` builds without --target: the last one (unnamed here)."""


def _stages() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """Stage name -> (what it is FROM, its own instructions), in file order."""
    stages: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    instructions: list[tuple[str, str]] = []
    for op, args in _dockerfile():
        if op == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else DEFAULT_TARGET
            instructions = []
            stages[name] = (words[0], instructions)
        elif stages:
            instructions.append((op, args))
    # Only the last stage may go unnamed: it is the default target.
    assert list(stages).index(DEFAULT_TARGET) == len(stages) - 1
    return stages


def _image(target: str = DEFAULT_TARGET) -> list[tuple[str, str]]:
    """The instructions that make ``target``'s image: its parent stages' first."""
    stages = _stages()
    base, own = stages[target]
    return [*(_image(base) if base in stages else []), *own]


def test_the_default_image_is_the_coordinator_with_the_service_side_only() -> None:
    stages = _stages()
    assert stages[DEFAULT_TARGET] == ("coordinator", [])
    installs = [args for op, args in _image() if op == "RUN" and "pip install" in args]
    assert len(installs) == 1
    # `pip install <the wheel>`: no extra, so no torch and no Ray (tests/test_fresh_install.py).
    assert "[" not in installs[0], installs[0]
    assert not [args for op, args in _image() if op == "RUN" and "apt-get" in args]


def test_the_trainer_image_adds_the_trainer_extra_to_the_coordinator_image() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "trainer" in pyproject["project"]["optional-dependencies"]
    base, own = _stages()["trainer"]
    assert base == "coordinator"
    (install,) = [args for op, args in own if op == "RUN" and "pip install" in args]
    assert install.endswith('lossreduce-*.whl)[trainer]"'), install
    # KubeRay's default probes on Ray pods run wget.
    assert [
        args
        for op, args in own
        if op == "RUN" and "install -y --no-install-recommends wget" in args
    ]
    users = [args for op, args in _image("trainer") if op == "USER"]
    assert users[-1] == "1000"


def test_image_exposes_the_default_ports() -> None:
    exposed = {int(p) for op, args in _image() if op == "EXPOSE" for p in args.split()}
    assert exposed == {GRPC_PORT, METRICS_PORT}


def test_image_copies_every_package_and_runs_the_console_script() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied = {
        source.rstrip("/")
        for op, args in _dockerfile()
        if op == "COPY" and not args.startswith("--from")
        for source in args.split()[:-1]  # the last word is the destination
    }
    folders = {
        path.split("/")[0] for path in pyproject["tool"]["setuptools"]["package-dir"].values()
    }
    assert folders | {"pyproject.toml", pyproject["project"]["readme"]} <= copied
    for path in copied:
        assert (ROOT / path).exists(), path
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for path in copied:
        assert f"!{path}" in ignore or f"!{path}/" in ignore, path
    for target in (DEFAULT_TARGET, "trainer"):
        instructions = dict(_image(target))
        assert json.loads(instructions["ENTRYPOINT"]) == ["lossreduce"]
        assert instructions["USER"] == "1000"
        cmd = json.loads(instructions["CMD"])
        assert cmd[0] == "serve"
        assert set(_flags(cmd)) <= _help_flags("serve")
    assert "lossreduce" in pyproject["project"]["scripts"]
