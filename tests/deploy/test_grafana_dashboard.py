"""The Grafana dashboard (deploy/k8s/grafana/llm-serving.json) without Grafana or Prometheus: it is a
dashboard Grafana can load, every PromQL expression parses, and every metric and label it names is one
the code exports, so renaming a metric fails here rather than leave a panel empty. Its ConfigMap (the
kustomization's configMapGenerator) validates against the Kubernetes schemas and carries the label
Grafana's dashboard sidecar watches for."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator, Set
from functools import cache

import kubernetes_validate
import promql_parser
import pytest
import yaml

from openai_frontend.metrics import Metrics
from openai_frontend.server_pool import ServerPool
from scripts.servers import REPO_ROOT
from tests.deploy.test_manifests import container, manifests

K8S = REPO_ROOT / "deploy" / "k8s"
DASHBOARD = K8S / "grafana" / "llm-serving.json"

# Triton's own metrics, with their labels, as Triton's metrics documentation lists them (the server
# repository's docs/user_guide/metrics.md: "Inference Request Metrics", "GPU Metrics", "CPU Metrics")
# and as the tritonserver of the nvidia-pytriton wheel serves them (the nv_gpu_* ones only with a GPU).
# Triton exports these itself, so no code here defines them: this list is what expressions are held to.
TRITON_METRICS = {
    "nv_inference_request_success": {"model", "version"},
    "nv_inference_request_failure": {"model", "version", "reason"},  # BACKEND, CANCELED, OTHER, REJECTED
    "nv_inference_count": {"model", "version"},
    "nv_inference_exec_count": {"model", "version"},
    "nv_inference_request_duration_us": {"model", "version"},
    "nv_inference_queue_duration_us": {"model", "version"},
    "nv_inference_compute_input_duration_us": {"model", "version"},
    "nv_inference_compute_infer_duration_us": {"model", "version"},
    "nv_inference_compute_output_duration_us": {"model", "version"},
    "nv_inference_pending_request_count": {"model", "version"},
    "nv_gpu_utilization": {"gpu_uuid"},
    "nv_gpu_memory_total_bytes": {"gpu_uuid"},
    "nv_gpu_memory_used_bytes": {"gpu_uuid"},
    "nv_gpu_power_usage": {"gpu_uuid"},
    "nv_cpu_utilization": set(),
    "nv_cpu_memory_total_bytes": set(),
    "nv_cpu_memory_used_bytes": set(),
}
# Labels Prometheus adds to every series it scrapes (the target's), beside the metric's own.
TARGET_LABELS = {"job", "instance", "namespace", "pod"}
# Grafana's built-in interval variables, each replaced by a duration before parsing.
GRAFANA_INTERVALS = ("__rate_interval", "__interval", "__range")


def prometheus_client_metrics(*collectors: object) -> Iterator[tuple[str, set[str]]]:
    """(exposed sample name, label names) of each prometheus_client metric held by these objects."""
    from prometheus_client.metrics import MetricWrapperBase

    for owner in collectors:
        for metric in vars(owner).values():
            if not isinstance(metric, MetricWrapperBase):
                continue
            # prometheus_client keeps a metric's name and label names only in these attributes.
            name, labels = metric._name, set(metric._labelnames)
            if metric._type == "counter":
                yield f"{name}_total", labels
            elif metric._type == "histogram":
                yield f"{name}_bucket", labels | {"le"}
                yield f"{name}_sum", labels
                yield f"{name}_count", labels
            else:
                yield name, labels


def engine_metrics() -> Iterator[tuple[str, set[str]]]:
    """The `llm_*` families triton_backend/metrics.py makes, with the labels of their metrics: the module
    run against a stand-in for Triton's pb_utils that records what it is asked to make."""
    made: dict[str, set[str]] = {}

    class MetricFamily:
        GAUGE, COUNTER = "gauge", "counter"

        def __init__(self, name: str, description: str, kind: str) -> None:
            self.name = name
            made[name] = set()

        def Metric(self, labels: dict[str, str]) -> object:  # pb_utils' name
            made[self.name] |= set(labels)
            return types.SimpleNamespace(set=lambda value: None, increment=lambda value: None)

    stub = types.ModuleType("triton_python_backend_utils")
    stub.MetricFamily = MetricFamily
    saved = sys.modules.get(stub.__name__)
    sys.modules[stub.__name__] = stub
    try:
        spec = importlib.util.spec_from_file_location("_engine_metrics", REPO_ROOT / "triton_backend" / "metrics.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.EngineMetrics("a-model", "a-model_0")
    finally:
        if saved is None:
            del sys.modules[stub.__name__]
        else:
            sys.modules[stub.__name__] = saved
    return iter(made.items())


@cache
def exported() -> dict[str, frozenset[str]]:
    """Every metric name a scrape can show, with its labels: the frontend's (its app registry and the
    server pool's), the engine's custom metrics on Triton, and Triton's own."""
    pool = ServerPool(["triton-a:8001"], make_client=lambda url: None, resolve=lambda url: [url])
    names: dict[str, frozenset[str]] = {}
    for name, labels in [*prometheus_client_metrics(Metrics(), pool), *engine_metrics(), *TRITON_METRICS.items()]:
        assert name not in names, f"{name} exported twice"
        names[name] = frozenset(labels)
    return names


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict) -> Iterator[dict]:
    """Every panel, those inside collapsed rows too."""
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", ())


def expressions(board: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every query target."""
    for panel in panels(board):
        for target in panel.get("targets", ()):
            yield f"panel {panel['id']} ({panel['title']}) {target['refId']}", target["expr"]


def variables(board: dict) -> dict[str, dict]:
    return {v["name"]: v for v in board["templating"]["list"]}


def substituted(expr: str, declared: Set[str]) -> str:
    """The expression as Grafana sends it: interval variables as durations, the dashboard's own as a
    value; a variable the dashboard does not declare is an error."""

    def value(match: re.Match) -> str:
        name = match["braced"] or match["plain"]
        if name in GRAFANA_INTERVALS:
            return "5m"
        assert name in declared, f"${name} is not a variable of the dashboard"
        return "x"

    return re.sub(r"\$(?:\{(?P<braced>\w+)(?::\w+)?\}|(?P<plain>\w+))", value, expr)


def check_expression(expr: str, declared: Set[str] = frozenset({"model"})) -> set[str]:
    """Parses the expression and checks each metric it selects and each label it matches or groups by
    against what the code exports; returns the metric names."""
    known = exported()
    tree = promql_parser.parse(substituted(expr, declared))  # ValueError where it does not parse
    used: set[str] = set()

    def selected(node) -> list[promql_parser.VectorSelector]:
        found: list[promql_parser.VectorSelector] = []
        promql_parser.walk(node, lambda n: found.append(n) if isinstance(n, promql_parser.VectorSelector) else None)
        return found

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            assert node.name in known, f"{node.name} is not a metric the code exports ({expr!r})"
            used.add(node.name)
            for matcher in node.matchers.matchers:
                label = matcher.name
                assert label in known[node.name] | TARGET_LABELS, f"{node.name} has no label {label!r} ({expr!r})"
        grouping = isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None
        inside = selected(node.expr) if grouping else []
        # An unknown metric inside is reported where its selector is visited, next.
        if grouping and node.modifier.type == promql_parser.AggModifierType.By and all(s.name in known for s in inside):
            inner = set().union(*(known[s.name] for s in inside))
            for label in node.modifier.labels:
                assert label in inner | TARGET_LABELS, (
                    f"grouped by {label!r}, a label none of its metrics has ({expr!r})"
                )

    promql_parser.walk(tree, visit)
    return used


def test_the_checks_catch_a_renamed_metric_a_wrong_label_and_bad_syntax():
    with pytest.raises(AssertionError, match="llm_generated_tokens_total is not a metric"):
        check_expression("rate(llm_generated_tokens_total[5m])")
    with pytest.raises(AssertionError, match="has no label 'model'"):
        check_expression('rate(frontend_generation_tokens_total{model=~"$model"}[$__rate_interval])')
    with pytest.raises(AssertionError, match="grouped by 'model'"):
        check_expression("sum by (model) (rate(frontend_time_to_first_token_seconds_bucket[5m]))")
    with pytest.raises(AssertionError, match=r"\$nope is not a variable"):
        check_expression('llm_num_running{model=~"$nope"}')
    with pytest.raises(ValueError):
        check_expression("sum(rate(llm_generation_tokens_total[5m])")


def test_the_names_come_from_the_code():
    known = exported()
    assert {"frontend_e2e_request_latency_seconds_bucket", "frontend_requests_total", "frontend_server_healthy"} <= set(
        known
    )
    assert known["llm_num_waiting"] == {"model", "instance"} and "llm_spec_accepted_tokens_total" in known
    assert known["frontend_requests_total"] == {"endpoint", "status"}


def test_dashboard_is_one_grafana_can_load():
    board = dashboard()
    assert {"title", "uid", "schemaVersion", "panels", "templating", "time", "editable"} <= set(board)
    assert board["uid"] and len(board["uid"]) <= 40 and isinstance(board["schemaVersion"], int)
    assert "id" not in board or board["id"] is None  # an id ties a dashboard to the database it came from
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    taken: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        assert {"id", "type", "title", "gridPos"} <= set(panel)
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
        cells = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & taken, f"panel {panel['id']} overlaps another"
        taken |= cells
        if panel["type"] == "row":
            continue
        # Every query goes to the Prometheus the `datasource` variable picks.
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs))
        assert all(t["datasource"] == panel["datasource"] and t["expr"].strip() for t in panel["targets"])


def test_datasource_and_model_variables():
    declared = variables(dashboard())
    source = declared["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    model = declared["model"]
    assert model["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    [(metric, label)] = re.findall(r"^label_values\((\w+), *(\w+)\)$", model["query"]["query"])
    assert model["definition"] == model["query"]["query"]
    assert label == "model" and label in exported()[metric]
    assert model["includeAll"] and model["allValue"] == ".*"  # so `model=~"$model"` matches every model


def test_every_expression_parses_and_names_exported_metrics():
    board = dashboard()
    declared = set(variables(board))
    used: set[str] = set()
    for where, expr in expressions(board):
        try:
            used |= check_expression(expr, declared)
        except (AssertionError, ValueError) as e:
            raise AssertionError(f"{where}: {e}") from None
    # What the operators asked to see is all on it.
    assert {
        "llm_generation_tokens_total",
        "frontend_time_to_first_token_seconds_bucket",
        "frontend_inter_token_latency_seconds_bucket",
        "frontend_e2e_request_latency_seconds_bucket",
        "llm_num_waiting",
        "llm_num_running",
        "llm_kv_blocks_used",
        "llm_kv_blocks_free",
        "llm_prefix_cache_hit_ratio",
        "llm_rejected_requests_total",
        "frontend_requests_total",
        "frontend_stream_integrity_violations_total",
        "llm_spec_draft_tokens_total",
        "llm_spec_accepted_tokens_total",
    } <= used
    quantiles = {
        (m, q)
        for _, expr in expressions(board)
        for q, m in re.findall(r"histogram_quantile\((0\.\d+), .*?\((\w+)_bucket", expr)
    }
    for metric in ("frontend_time_to_first_token_seconds", "frontend_inter_token_latency_seconds"):
        assert {(metric, q) for q in ("0.5", "0.9", "0.99")} <= quantiles
    assert {("frontend_e2e_request_latency_seconds", q) for q in ("0.5", "0.9", "0.99")} <= quantiles


def test_prometheus_scrapes_both_pods_where_their_metrics_are():
    for name in ("triton", "frontend"):
        deployment = manifests()[("Deployment", name)]
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        ports = {p["containerPort"] for p in container(deployment)["ports"]}
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) in ports


def generated_configmap() -> dict:
    """The ConfigMap the kustomization's generator makes, built as kustomize builds it."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    [generator] = kustomization["configMapGenerator"]
    data = {}
    for path in generator["files"]:
        key, _, file = path.rpartition("=")
        source = (K8S / file).resolve()
        assert source.is_relative_to(K8S), "kustomize reads files only in or below the kustomization's folder"
        data[key or source.name] = source.read_text()
    options = generator["options"]
    labels = {p: v for entry in kustomization["labels"] for p, v in entry["pairs"].items()} | options["labels"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": generator["name"], "labels": labels},
        "data": data,
    }


def test_the_dashboard_configmap():
    configmap = generated_configmap()
    kubernetes_validate.validate(configmap, "1.37.0", strict=True)
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's default label
    assert configmap["data"] == {DASHBOARD.name: DASHBOARD.read_text()}
    assert len(DASHBOARD.read_bytes()) < 256 * 1024  # kubectl apply keeps a copy in an annotation of at most this
    assert yaml.safe_load((K8S / "kustomization.yaml").read_text())["configMapGenerator"][0]["options"][
        "disableNameSuffixHash"
    ]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl here to render the kustomization")
def test_kustomize_renders_the_dashboard_configmap():
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(rendered)}
    expected = generated_configmap()
    assert objects[("ConfigMap", expected["metadata"]["name"])] == expected
