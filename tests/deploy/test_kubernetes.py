"""deploy/kubernetes: every overlay renders (kubectl kustomize), every object passes the Kubernetes
OpenAPI schema offline (kubernetes-validate, strict), and the numbers that must agree do: probes on
/health, grace period vs preStop + --shutdown-timeout, HPA metrics vs adapter rules vs the metric
names the server and router really export, the p2p configs, the blue-green selector.

Needs `kubectl` (Debian: apt-get install kubernetes-client) or `kustomize` on PATH, and
`kubernetes-validate` (pip)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import yaml

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "deploy", "kubernetes")
OVERLAYS = ("cpu", "gpu", "pd", "router", "bluegreen")
TARGETS = ("base", "monitoring", *(f"overlays/{o}" for o in OVERLAYS))
KUBERNETES_VERSION = "1.31.0"
CUSTOM_RESOURCE_KINDS = {"ServiceMonitor"}
"""CRDs (prometheus-operator's): no schema in kubernetes-validate, skipped by kind on purpose."""


def _kustomize_command() -> list[str]:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    pytest.fail("neither kubectl nor kustomize is on PATH: install kubernetes-client "
                "(apt-get install -y kubernetes-client) to render deploy/kubernetes")


_rendered: dict[str, list[dict]] = {}


def render(target: str) -> list[dict]:
    if target not in _rendered:
        result = subprocess.run([*_kustomize_command(), os.path.join(ROOT, target)], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, f"kustomize {target}:\n{result.stderr}"
        _rendered[target] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return _rendered[target]


def objects(target: str, kind: str) -> list[dict]:
    return [o for o in render(target) if o["kind"] == kind]


def server_containers(target: str) -> list[tuple[dict, dict]]:
    """(Deployment, container) of every `kvtide serve` container (the router's has a command)."""
    return [(d, c) for d in objects(target, "Deployment") for c in d["spec"]["template"]["spec"]["containers"]
            if "command" not in c]


def router_containers(target: str) -> list[tuple[dict, dict]]:
    return [(d, c) for d in objects(target, "Deployment") for c in d["spec"]["template"]["spec"]["containers"]
            if c.get("command", [])[:2] == ["kvtide", "router"]]


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} not in {args}"
    return args[args.index(name) + 1]


def prestop_sleep(container: dict) -> float:
    pre = container["lifecycle"]["preStop"]
    if "sleep" in pre:
        return float(pre["sleep"]["seconds"])
    command = pre["exec"]["command"]
    assert command[0] == "sleep", command
    return float(command[1])


@pytest.mark.parametrize("target", TARGETS)
def test_renders_and_validates(target):
    import kubernetes_validate

    docs = render(target)
    assert docs
    for doc in docs:
        if doc["kind"] in CUSTOM_RESOURCE_KINDS:
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{target}: {doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployments(overlay):
    deployments = objects(f"overlays/{overlay}", "Deployment")
    assert deployments
    pdb_selectors = [p["spec"]["selector"]["matchLabels"]
                     for p in objects(f"overlays/{overlay}", "PodDisruptionBudget")]
    for d in deployments:
        spec = d["spec"]
        assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, d["metadata"]["name"]
        pod = spec["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        labels = spec["template"]["metadata"]["labels"]
        assert any(all(labels.get(k) == v for k, v in sel.items()) for sel in pdb_selectors), \
            f"no PodDisruptionBudget covers {d['metadata']['name']}"
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["image"].startswith("kvtide:"), c["image"]  # an overlay set the tag
            port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
            assert flag(c["args"], "--port") == str(port)
            grace = pod["terminationGracePeriodSeconds"]
            drain = prestop_sleep(c) + float(flag(c["args"], "--shutdown-timeout"))
            assert grace >= drain, f"{d['metadata']['name']}: grace {grace} < preStop + --shutdown-timeout {drain}"
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
            assert c["readinessProbe"]["httpGet"]["port"] in ("http", port)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_server_probes(overlay):
    containers = server_containers(f"overlays/{overlay}")
    assert containers
    for d, c in containers:
        port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            get = c[probe]["httpGet"]
            assert get["path"] == "/health" and get["port"] in ("http", port), (d["metadata"]["name"], probe)
        # /health waits up to 5 s for the engine core: a shorter timeout fails a busy pod.
        assert all(c[p]["timeoutSeconds"] > 5 for p in ("readinessProbe", "livenessProbe", "startupProbe"))
        startup = c["startupProbe"]
        assert startup["failureThreshold"] * startup["periodSeconds"] >= 600  # a model load
        # Liveness outlasts a drain (/health is 503 while draining).
        live = c["livenessProbe"]
        assert live["failureThreshold"] * live["periodSeconds"] > float(flag(c["args"], "--shutdown-timeout"))
        assert c["args"][0].startswith("/models/")
        env = {e["name"]: e for e in c["env"]}
        assert env["KVTIDE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "kvtide-api-key"
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/models", "/tmp", "/cache"} <= mounts


def test_router_reads_the_api_key_from_the_environment(monkeypatch):
    """The router manifests hand the key over as $KVTIDE_API_KEY only (never in the arguments)."""
    from kvtide.cli import build_parser
    from kvtide.router.cli import settings_from_args

    monkeypatch.setenv("KVTIDE_API_KEY", "sk-from-env")
    args = build_parser().parse_args(["router", "--backends", "http://127.0.0.1:9"])
    assert settings_from_args(args).api_key == "sk-from-env"


def _exported_names(registry) -> set[str]:
    """Every sample name a registry can export (histogram _bucket/_sum/_count, counter _total...),
    labelled families without children included."""
    suffixes = {"histogram": ("_bucket", "_sum", "_count", "_created"), "counter": ("_total", "_created"),
                "gauge": ("",), "summary": ("_sum", "_count", "_created")}
    names = set()
    for family in registry.collect():
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
        names |= {s.name for s in family.samples}
    return names


def _adapter_rules() -> list[dict]:
    (config_map,) = [c for c in objects("monitoring", "ConfigMap") if c["metadata"]["name"] == "kvtide-adapter-config"]
    return yaml.safe_load(config_map["data"]["config.yaml"])["rules"]


def test_adapter_rules_match_real_metrics():
    from kvtide.router.metrics import RouterMetrics
    from kvtide.server.metrics import ServerMetrics

    real = _exported_names(ServerMetrics("m").registry) | _exported_names(RouterMetrics().registry)
    assert "kvtide:num_requests_waiting" in real  # the helper sees what it should
    for rule in _adapter_rules():
        series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"]).group(0)
        assert series in real, f"adapter rule on {series}: no such metric"
        assert re.fullmatch(rule["name"]["matches"], series)
        assert {"namespace", "pod"} <= set(rule["resources"]["overrides"])
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
    ttft = [r for r in _adapter_rules() if "time_to_first_token" in r["seriesQuery"]]
    assert ttft and "histogram_quantile(0.99" in ttft[0]["metricsQuery"]


@pytest.mark.parametrize("target", ["base", "overlays/cpu", "overlays/bluegreen"])
def test_hpa_metrics_are_served_by_the_adapter(target):
    exposed = {r["name"]["as"] for r in _adapter_rules()}
    deployments = {d["metadata"]["name"] for d in objects(target, "Deployment")}
    hpas = objects(target, "HorizontalPodAutoscaler")
    assert hpas
    for hpa in hpas:
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
        names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
        assert {"kvtide_num_requests_waiting", "kvtide_time_to_first_token_p99"} <= names
        assert names <= exposed, names - exposed
        behavior = hpa["spec"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
        assert behavior["scaleUp"]["policies"] and behavior["scaleDown"]["policies"]


def test_pd_kv_transfer_configs(monkeypatch):
    from kvtide.disagg.config import parse_kv_transfer_config

    monkeypatch.setenv("KVTIDE_KV_SECRET", "test-secret")
    roles = {}
    for d, c in server_containers("overlays/pd"):
        env = {e["name"]: e for e in c["env"]}
        assert env["KVTIDE_KV_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "kvtide-kv-secret"
        text = flag(c["args"], "--kv-transfer-config")
        # The kubelet substitutes $(VAR) from the container's env; every reference must resolve.
        for ref in re.findall(r"\$\((\w+)\)", text):
            assert ref in env, f"{ref} not in the env of {d['metadata']['name']}"
        config = parse_kv_transfer_config(re.sub(r"\$\((\w+)\)", "10.1.2.3", text))
        roles[config.kv_role] = d["metadata"]["name"]
        if config.kv_role == "kv_producer":
            # Consumers pull from kv_ip:kv_port: the pod's own IP, a fixed port.
            assert json.loads(text)["kv_ip"] == "$(POD_IP)"
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert config.kv_port > 0
    assert roles == {"kv_producer": "kvtide-prefill", "kv_consumer": "kvtide-decode"}
    (router,) = router_containers("overlays/pd")
    args = router[1]["args"]
    assert flag(args, "--prefill") == "http://kvtide-prefill:8000"
    assert flag(args, "--decode") == "http://kvtide-decode:8000"
    services = {s["metadata"]["name"] for s in objects("overlays/pd", "Service")}
    assert {"kvtide-prefill", "kvtide-decode", "kvtide-router"} <= services


def test_router_overlay():
    (router,) = router_containers("overlays/router")
    assert flag(router[1]["args"], "--backends") == "http://kvtide:8000"
    assert router[1]["livenessProbe"]["tcpSocket"]["port"] == "http"  # no healthy backend is no reason to restart
    assert {s["metadata"]["name"] for s in objects("overlays/router", "Service")} >= {"kvtide", "kvtide-router"}


def test_bluegreen_selects_exactly_one_slot():
    deployments = {d["metadata"]["name"]: d for d in objects("overlays/bluegreen", "Deployment")}
    assert set(deployments) == {"kvtide-blue", "kvtide-green"}
    images = {d["spec"]["template"]["spec"]["containers"][0]["image"] for d in deployments.values()}
    assert len(images) == 2, images
    (service,) = [s for s in objects("overlays/bluegreen", "Service") if s["metadata"]["name"] == "kvtide"]

    def selected(selector: dict) -> list[str]:
        return [name for name, d in deployments.items()
                if all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items())]

    assert selected(service["spec"]["selector"]) == ["kvtide-blue"]
    # The documented switch: `kubectl patch service kvtide -p '{"spec":{"selector":{"slot":"green"}}}'`
    # (a strategic merge: the other selector keys stay).
    assert selected({**service["spec"]["selector"], "slot": "green"}) == ["kvtide-green"]
    with open(os.path.join(ROOT, "README.md")) as f:
        assert """kubectl patch service kvtide -p '{"spec":{"selector":{"slot":"green"}}}'""" in f.read()
