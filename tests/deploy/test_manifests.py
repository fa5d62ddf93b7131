"""Containers and Kubernetes without Docker or a cluster: the compose file and every manifest parse,
each Kubernetes object validates offline against the Kubernetes 1.37 schemas (kubernetes-validate),
and their commands, ports, probe paths and names agree with the code."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from fastapi.testclient import TestClient

from openai_frontend.app import create_app
from openai_frontend.settings import parse_settings
from scripts import serve
from scripts.servers import REPO_ROOT, TritonServer
from tests.fake_engine import FakeEngineClient

K8S = REPO_ROOT / "deploy" / "k8s"
ENGINE_METRICS_PY = REPO_ROOT / "triton_backend" / "metrics.py"


def manifests() -> dict[tuple[str, str], dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    objects = {}
    for name in kustomization["resources"]:
        for obj in yaml.safe_load_all((K8S / name).read_text()):
            objects[(obj["kind"], obj["metadata"]["name"])] = obj
    return objects


def container(obj: dict) -> dict:
    [c] = obj["spec"]["template"]["spec"]["containers"]
    return c


def answered(paths: set[str]) -> bool:
    """Whether the frontend answers these paths (with a ready fake engine: 200)."""
    with TestClient(create_app(FakeEngineClient())) as client:
        return all(client.get(path).status_code == 200 for path in paths)


def test_kustomization_lists_every_manifest():
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("key", sorted(manifests()), ids=lambda k: f"{k[0]}/{k[1]}")
def test_every_object_validates_against_the_kubernetes_schemas(key):
    kubernetes_validate.validate(manifests()[key], "1.37.0", strict=True)


def test_manifests_agree_with_the_code():
    objects = manifests()
    triton, frontend = objects[("Deployment", "triton")], objects[("Deployment", "frontend")]
    service = objects[("Service", "triton")]
    defaults = TritonServer()
    ports = {p["name"]: p["containerPort"] for p in container(triton)["ports"]}
    assert ports == {"http": defaults.http_port, "grpc": defaults.grpc_port, "metrics": defaults.metrics_port}
    tc = container(triton)
    assert (
        tc["command"][-3:] == ["scripts.serve", "--only", "triton"]
        and serve.build_parser().parse_args(tc["command"][-2:]).only == "triton"
    )
    assert {"name": "TRITON_ADDRESS", "value": "0.0.0.0"} in tc["env"]
    assert tc["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert tc["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert tc["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The headless Service selects the Triton pods and its gRPC port is theirs.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= triton["spec"]["template"]["metadata"]["labels"].items()
    [grpc] = service["spec"]["ports"]  # only gRPC: the frontends need nothing else
    assert grpc["name"] == "grpc" and grpc["port"] == defaults.grpc_port
    policy = objects[("NetworkPolicy", "triton")]
    assert (
        policy["spec"]["podSelector"]["matchLabels"].items() <= triton["spec"]["template"]["metadata"]["labels"].items()
    )
    allowed = {r["ports"][0]["port"]: r["from"][0] for r in policy["spec"]["ingress"]}
    assert (
        allowed[defaults.grpc_port]["podSelector"]["matchLabels"].items()
        <= frontend["spec"]["template"]["metadata"]["labels"].items()
    )
    assert set(allowed) == {defaults.grpc_port, defaults.metrics_port}
    # The frontend routes over that Service's name, with flags its parser accepts.
    fc = container(frontend)
    settings = parse_settings(fc["command"][3:])
    assert settings.triton_urls == (f"{service['metadata']['name']}:{grpc['port']}",)
    assert settings.port == fc["ports"][0]["containerPort"]
    assert (
        fc["readinessProbe"]["httpGet"]["path"] == "/health/ready"
        and fc["livenessProbe"]["httpGet"]["path"] == "/health"
    )
    assert answered({fc["readinessProbe"]["httpGet"]["path"], fc["livenessProbe"]["httpGet"]["path"]})
    assert frontend["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > settings.shutdown_grace_s
    # The autoscaler scales the Triton Deployment on a metric the model exports.
    hpa = objects[("HorizontalPodAutoscaler", "triton")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "triton"
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric == "llm_num_waiting" and '"num_waiting":' in ENGINE_METRICS_PY.read_text()
    assert metric in (REPO_ROOT / "deploy" / "README.md").read_text()
    for name in ("triton", "frontend"):
        pdb = objects[("PodDisruptionBudget", name)]
        pods = objects[("Deployment", name)]["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pods.items()
    # Images are the ones the Dockerfiles say they build.
    assert tc["image"] in (REPO_ROOT / "docker" / "Dockerfile.gpu").read_text()
    assert fc["image"] in (REPO_ROOT / "docker" / "Dockerfile.cpu").read_text()


def test_compose_file_agrees_with_the_code():
    compose = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"triton-a", "triton-b", "frontend"}
    defaults = TritonServer()
    for name in ("triton-a", "triton-b"):
        triton = services[name]
        assert serve.build_parser().parse_args(triton["command"][3:]).only == "triton"
        assert triton["environment"]["TRITON_ADDRESS"] == "0.0.0.0"
        assert {str(defaults.http_port), str(defaults.grpc_port), str(defaults.metrics_port)} == set(triton["expose"])
        assert f":{defaults.http_port}/v2/health/ready" in " ".join(triton["healthcheck"]["test"])
    frontend = services["frontend"]
    settings = parse_settings(frontend["command"][3:])
    assert settings.triton_urls == (f"triton-a:{defaults.grpc_port}", f"triton-b:{defaults.grpc_port}")
    assert frontend["ports"] == [f"{settings.port}:{settings.port}"] and settings.host == "0.0.0.0"
    assert set(frontend["depends_on"]) == {"triton-a", "triton-b"}
    for service in services.values():
        assert service["image"] in (REPO_ROOT / "docker" / "Dockerfile.cpu").read_text()
        assert Path(REPO_ROOT, service["command"][0]).name == "python"


def test_triton_and_the_frontends_share_the_model_control_key():
    from protocol.wire import CONTROL_KEY_ENV

    objects = manifests()
    for name in ("triton", "frontend"):
        env = {e["name"]: e for e in container(objects[("Deployment", name)]).get("env", [])}
        assert env[CONTROL_KEY_ENV]["valueFrom"]["secretKeyRef"] == {"name": "triton-control-key", "key": "key"}
    compose = yaml.safe_load((REPO_ROOT / "docker" / "compose.yaml").read_text())
    for service in compose["services"].values():
        assert service["environment"][CONTROL_KEY_ENV].startswith("${" + CONTROL_KEY_ENV + ":?")


def test_pods_and_images_run_unprivileged_within_limits():
    objects = manifests()
    for name in ("triton", "frontend"):
        c = container(objects[("Deployment", name)])
        security = c["securityContext"]
        assert security["runAsNonRoot"] and security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        assert {"cpu", "memory"} <= set(c["resources"]["limits"])
        # A read-only root: what the servers write (temporary files, caches under HOME, logs) is on volumes.
        assert security["readOnlyRootFilesystem"] is True
        volumes = {v["name"]: v for v in objects[("Deployment", name)]["spec"]["template"]["spec"]["volumes"]}
        mounted = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
        home = next(e["value"] for e in c["env"] if e["name"] == "HOME")
        assert {"/tmp", "/app/artifacts", home} <= set(mounted) and all("emptyDir" in v for v in mounted.values())
        user = security["runAsUser"]
        for dockerfile in ("Dockerfile.cpu", "Dockerfile.gpu"):
            assert f"USER {user}" in (REPO_ROOT / "docker" / dockerfile).read_text()
    env = {e["name"]: e for e in container(objects[("Deployment", "frontend")])["env"]}
    assert env["FRONTEND_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "frontend-api-key"
