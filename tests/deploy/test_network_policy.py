"""deploy/kubernetes: who may connect to which kvtide pod, read from the rendered NetworkPolicies,
and no pod holds a Kubernetes API token.

    clients ─▶ router ─▶ servers (http: the router's pods and Prometheus only)
    decode  ─▶ prefill's p2p KV port (decode pods only)
    every kvtide pod isolated by a default-deny policy; without a router (cpu, gpu, bluegreen) the
    servers take clients on http, and nothing else

Needs kubectl or kustomize on PATH (see test_kubernetes.py)."""

from __future__ import annotations

import json

import pytest
from test_kubernetes import OVERLAYS, TARGETS, flag, objects

POD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
ROUTED = ("router", "pd")
"""Overlays with `kvtide router` in front: their servers admit only the router and Prometheus."""
PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def _pods(target: str) -> list[dict]:
    """Every workload's pod template, with its owner's name."""
    return [{"name": o["metadata"]["name"], "labels": o["spec"]["template"]["metadata"]["labels"],
             "spec": o["spec"]["template"]["spec"]} for kind in POD_KINDS for o in objects(target, kind)]


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"matchExpressions are not read here: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _policies_of(target: str, pod: dict) -> list[dict]:
    return [p for p in objects(target, "NetworkPolicy") if _selects(p["spec"]["podSelector"], pod["labels"])
            and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]


def _container_ports(pod: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}


def _admitted(target: str, pod: dict) -> list[tuple[dict | None, int]]:
    """(peer, container port) pairs the pod's policies admit; peer None: from anywhere."""
    ports = _container_ports(pod)
    pairs = []
    for policy in _policies_of(target, pod):
        for rule in policy["spec"].get("ingress", []):
            assert rule.get("ports"), f"{policy['metadata']['name']}: a rule without ports opens every port"
            rule_ports = []
            for p in rule["ports"]:
                assert p.get("protocol", "TCP") == "TCP"
                rule_ports.append(ports[p["port"]] if isinstance(p["port"], str) else p["port"])
            for peer in rule.get("from") or [None]:
                pairs += [(peer, port) for port in rule_ports]
    return pairs


def _pod(target: str, name_suffix: str) -> dict:
    (pod,) = [p for p in _pods(target) if p["name"].endswith(name_suffix)]
    return pod


WORKLOAD_TARGETS = [t for t in TARGETS if t != "monitoring"]
"""The targets that run pods (monitoring/ holds rules and a ServiceMonitor)."""


@pytest.mark.parametrize("target", WORKLOAD_TARGETS)
def test_no_pod_mounts_a_service_account_token(target):
    assert _pods(target)
    for pod in _pods(target):
        assert pod["spec"].get("automountServiceAccountToken") is False, pod["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_kvtide_pod_is_isolated_and_reachable(overlay):
    target = f"overlays/{overlay}"
    pods = _pods(target)
    assert pods
    for pod in pods:
        policies = _policies_of(target, pod)
        assert any(not p["spec"].get("ingress") for p in policies), f"{pod['name']}: no default-deny selects it"
        admitted_ports = {port for _, port in _admitted(target, pod)}
        # Every declared port is reachable by someone, and nothing else is.
        assert admitted_ports == set(_container_ports(pod).values()), pod["name"]


@pytest.mark.parametrize("overlay", ROUTED)
def test_servers_admit_only_the_router_and_prometheus(overlay):
    target = f"overlays/{overlay}"
    routers = [p for p in _pods(target) if p["name"].endswith("-router")]
    servers = [p for p in _pods(target) if p not in routers]
    assert routers and servers
    for server in servers:
        http = _container_ports(server)["http"]
        peers = [peer for peer, port in _admitted(target, server) if port == http]
        assert None not in peers, f"{server['name']}: http open to anyone"
        assert PROMETHEUS in peers, f"{server['name']}: Prometheus cannot scrape /metrics"
        for peer in peers:
            if peer == PROMETHEUS:
                continue
            assert set(peer) == {"podSelector"}, peer  # this namespace's pods, selected by label
            chosen = [p["name"] for p in _pods(target) if _selects(peer["podSelector"], p["labels"])]
            assert chosen and all(name.endswith("-router") for name in chosen), (server["name"], chosen)
    for router in routers:  # the clients' entry
        assert (None, _container_ports(router)["http"]) in _admitted(target, router)


def test_prefill_kv_port_admits_only_decode():
    target = "overlays/pd"
    prefill, decode = _pod(target, "-prefill"), _pod(target, "-decode")
    (container,) = prefill["spec"]["containers"]
    kv_port = json.loads(flag(container["args"], "--kv-transfer-config"))["kv_port"]
    assert _container_ports(prefill)["kv"] == kv_port
    peers = [peer for peer, port in _admitted(target, prefill) if port == kv_port]
    assert peers
    for peer in peers:
        assert peer is not None and set(peer) == {"podSelector"}, peer
        chosen = [p["name"] for p in _pods(target) if _selects(peer["podSelector"], p["labels"])]
        assert chosen == [decode["name"]], chosen
    assert kv_port not in {port for _, port in _admitted(target, decode)}  # decode serves no KV


@pytest.mark.parametrize("overlay", sorted(set(OVERLAYS) - set(ROUTED)))
def test_servers_without_a_router_take_clients_on_http_only(overlay):
    target = f"overlays/{overlay}"
    for pod in _pods(target):
        assert set(_admitted(target, pod)) == {(None, _container_ports(pod)["http"])}, pod["name"]


def test_default_deny_selects_only_kvtide_pods():
    """It selects by label, not `podSelector: {}`: other workloads in the namespace are untouched."""
    for target in WORKLOAD_TARGETS:
        policies = objects(target, "NetworkPolicy")
        assert policies, target
        for policy in policies:
            assert policy["spec"]["podSelector"].get("matchLabels"), policy["metadata"]["name"]
