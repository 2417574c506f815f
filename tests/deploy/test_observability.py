"""deploy/grafana/kvtide.json, deploy/prometheus/alerts.yml and deploy/compose/ against the real
servers they watch:

    dashboard   loads, has a Grafana dashboard's structure (title, uid, schemaVersion, a datasource
                variable; every panel with a type, gridPos and, but for rows, targets with expr;
                unique panel ids)
    names       every kvtide metric named in a dashboard expr or an alert expr is on the /metrics
                of a live `kvtide serve` (a tiny Qwen2-MoE with ngram speculative decoding, a host
                memory KV tier and --api-keys-file, so the feature-gated families have samples) or
                of a live `kvtide router --policy cache_aware` in front of it, after a few requests
    PromQL      with promtool on PATH (Debian package `prometheus`): `promtool check rules` on
                alerts.yml, and on every dashboard expr (Grafana variables substituted) wrapped as
                a recording rule; without it, the rules' YAML structure is checked instead
    runbooks    each alert's runbook_url points at a heading of docs/deployment.md
    compose     docker-compose.yml parses, every file it mounts or builds from exists, published
                ports bind 127.0.0.1, images are pinned, and Prometheus loads alerts.yml
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from router_helpers import start_router
from serve_helpers import API_KEY, MODEL_NAME, launch_server, wait_idle

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvtide.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
COMPOSE_DIR = ROOT / "deploy" / "compose"
DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"

METRIC_NAME = re.compile(r"\b(kvtide(?::|_)[A-Za-z0-9_:]+)")
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$model_name": ".*"}

QWEN2_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=96,
    norm_topk_prob=False,
    mlp_only_layers=[1],
)
"""tests/server/test_metrics_moe.py's tiny MoE: kvtide:moe_* families get samples."""
QUOTA_KEY = "sk-deploy-quota"

DECLARED_ONLY = {
    # kvtide/router/metrics.py RouterMetrics.retries: labelled by reason, so a series appears only
    # once a request was retried on another backend (needs a failing backend; the router tests
    # cover it). The family itself must still be declared on the live /metrics.
    "kvtide_router_retries_total",
}
"""Names the live servers declare (# TYPE) without a sample after this module's workload."""


# ---- helpers ----------------------------------------------------------------------------------
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    exprs = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
    return exprs


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


def exposed_names(text: str) -> tuple[set[str], set[str]]:
    """(sample names present, sample names of every declared family) of one /metrics page."""
    present, declared = set(), set()
    suffixes = {
        "counter": ["_total"],
        "histogram": ["_bucket", "_sum", "_count"],
        "gauge": [""],
        "summary": ["", "_sum", "_count"],
    }
    for family in text_string_to_metric_families(text):
        present.update(sample.name for sample in family.samples)
        declared.update(family.name + suffix for suffix in suffixes.get(family.type, [""]))
    return present, declared


def github_anchor(heading: str) -> str:
    anchor = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return anchor.replace(" ", "-")


# ---- (a) dashboard structure ---------------------------------------------------------------------
def test_dashboard_is_a_grafana_dashboard():
    model = dashboard()
    assert (
        model["title"]
        and model["uid"]
        and isinstance(model["schemaVersion"], int)
        and model["schemaVersion"] >= 36
    )
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    ids = [panel["id"] for panel in model["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in model["panels"]:
        assert panel["type"] and panel["title"], panel
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"][
            "w"
        ] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"].strip() for t in panel["targets"]), panel[
            "title"
        ]


def test_dashboard_covers_the_brief():
    text = " ".join(dashboard_exprs())
    for name in (
        "kvtide:time_to_first_token_seconds_bucket",
        "kvtide:request_time_per_output_token_seconds_bucket",
        "kvtide:inter_token_latency_seconds_bucket",
        "kvtide:generation_tokens_total",
        "kvtide:num_requests_waiting",
        "kvtide:kv_cache_usage_perc",
        "kvtide:prefix_cache_hits_total",
        "kvtide:num_preemptions_total",
        "kvtide:spec_decode_num_accepted_tokens_total",
        "kvtide:moe_expert_load_imbalance",
        "kvtide:kv_connector_hit_tokens_total",
        "kvtide:quota_requests_total",
        "kvtide_router_requests_total",
        "kvtide_router_retries_total",
        "kvtide_router_backend_healthy",
        "kvtide_router_pd_prefill_seconds_bucket",
    ):
        assert name in text, name
    for quantile in ("0.5", "0.99", "0.999"):
        assert (
            f"histogram_quantile({quantile}, sum by (le) (rate(kvtide:time_to_first_token_seconds_bucket"
            in text
        )


# ---- (b) every metric name is on a live server's or router's /metrics -----------------------------------
@pytest.fixture(scope="module")
def live_metrics(checkpoint_factory, tmp_path_factory) -> tuple[set[str], set[str]]:
    """/metrics of one `kvtide serve` and one `kvtide router` in front of it, after a workload
    that evicts a prompt to the host tier and loads it back, drafts with ngram, and goes through
    a quota key and the router."""
    model = checkpoint_factory("Qwen2MoeForCausalLM", **QWEN2_MOE)
    keys = tmp_path_factory.mktemp("deploy") / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": QUOTA_KEY, "name": "team-a", "requests_per_minute": 1000}]}))
    # 512 KiB of device KV (256 tokens of this model): four 181-token prompts evict the first, which
    # then comes back from the 8 MiB host tier (kvtide:kv_connector_hit_tokens_total{tier="cpu"}).
    server = launch_server(
        model,
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
        "--kv-cache-memory",
        "512KiB",
        "--kv-offload-memory",
        "8MiB",
        "--api-keys-file",
        str(keys),
        "--no-ui",
        "--cpu-weight-prepack",
        "off",
        "--speculative-config",
        json.dumps({"method": "ngram", "num_speculative_tokens": 2}),
    )
    router = None
    try:
        with httpx.Client(
            base_url=server.base_url, headers={"Authorization": f"Bearer {QUOTA_KEY}"}, timeout=60.0
        ) as client:
            first = " ".join(f"a{i}" for i in range(60))[:180]
            prompts = (
                [first]
                + [" ".join(f"{c}{i}" for i in range(60))[:180] for c in "bcd"]
                + [first, "ab ab ab ab ab ab ab ab"]
            )
            usages = []
            for prompt in prompts:
                r = client.post(
                    "/v1/completions",
                    json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0},
                )
                assert r.status_code == 200, r.text
                usages.append(r.json()["usage"])
            assert usages[4]["prompt_tokens_details"]["cached_tokens"] > 0, usages
        router = start_router(
            "--backends", server.base_url, "--policy", "cache_aware", "--backend-api-key", API_KEY
        )
        r = httpx.post(
            router.url("/v1/completions"),
            json={"model": MODEL_NAME, "prompt": "hello router", "max_tokens": 4, "temperature": 0},
            timeout=60.0,
        )
        assert r.status_code == 200, r.text
        wait_idle(server)
        server_text = httpx.get(server.url("/metrics"), headers=server.headers, timeout=30.0).text
        router_text = router.metrics()
    finally:
        if router is not None:
            router.stop()
        server.stop()
    server_present, server_declared = exposed_names(server_text)
    router_present, router_declared = exposed_names(router_text)
    return server_present | router_present, server_declared | router_declared


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_metric_name_is_exported(live_metrics, source):
    present, declared = live_metrics
    exprs = dashboard_exprs() if source == "dashboard" else [rule["expr"] for rule in alert_rules()]
    names = set().union(*(metric_names(e) for e in exprs))
    assert names, f"no kvtide metric in the {source}'s expressions"
    missing = sorted(n for n in names - present if not (n in DECLARED_ONLY and n in declared))
    assert not missing, f"{source} uses metrics no live server exposes: {missing}"
    assert DECLARED_ONLY <= declared, "an allowlisted family is no longer declared at all"


# ---- (c) alert rules -------------------------------------------------------------------------------
def _promtool_check(rules_file: Path) -> None:
    result = subprocess.run(
        ["promtool", "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_are_valid(tmp_path):
    """promtool when on PATH (apt package `prometheus`); otherwise the YAML structure only."""
    if shutil.which("promtool"):
        _promtool_check(ALERTS)
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    names = [group["name"] for group in groups]
    assert len(names) == len(set(names))
    for rule in alert_rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, rule
        assert rule["alert"] and rule["expr"], rule
        assert rule["labels"]["severity"] in ("warning", "critical"), rule
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"]), rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s")), rule


def test_alerts_cover_the_brief():
    exprs = {rule["alert"]: rule["expr"] for rule in alert_rules()}
    text = " ".join(exprs.values())
    for needle in (
        'up{job="kvtide"} == 0',
        "kvtide:num_requests_waiting",
        "kvtide:time_to_first_token_seconds_bucket",
        "kvtide:kv_cache_usage_perc) > 0.95",
        "kvtide:num_preemptions_total",
        "kvtide_router_backend_healthy",
    ):
        assert needle in text, needle


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not on PATH (apt-get install prometheus)"
)
def test_dashboard_exprs_are_valid_promql(tmp_path):
    """Each expr, Grafana's variables replaced by plain values, as a recording rule for promtool."""
    rules = []
    for i, expr in enumerate(dashboard_exprs()):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"an unknown Grafana variable in {expr}"
        rules.append({"record": f"kvtide_dashboard:expr_{i}", "expr": expr})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    _promtool_check(path)


def test_runbook_links_point_at_deployment_doc_headings():
    headings = {
        github_anchor(m.group(1))
        for m in re.finditer(r"^#+\s+(.+)$", DEPLOYMENT_DOC.read_text(), re.MULTILINE)
    }
    for rule in alert_rules():
        path, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert path == "docs/deployment.md", rule["alert"]
        assert anchor in headings, f"{rule['alert']}: no heading for #{anchor} in docs/deployment.md"


# ---- (d) compose -----------------------------------------------------------------------------------
def _default(value: str) -> str:
    """${VAR:-default} -> default (what compose uses with VAR unset)."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def test_compose_file_references_existing_files():
    compose = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"kvtide", "prometheus", "grafana"} <= set(services)
    build = services["kvtide"]["build"]
    context = (COMPOSE_DIR / build["context"]).resolve()
    assert context == ROOT and (context / build["dockerfile"]).is_file()
    mounts = {}
    for name, service in services.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
        if "image" in service and name != "kvtide":
            tag = service["image"].rpartition(":")[2]
            assert tag and tag != "latest" and re.search(r"\d", tag), service["image"]
        for volume in service.get("volumes", []):
            source, target = _default(volume).split(":")[:2]
            if source.startswith("."):
                host = (COMPOSE_DIR / source).resolve()
                assert host.exists(), f"{name} mounts {source}, which does not exist"
                mounts[(name, target)] = host
            else:
                assert source in compose.get("volumes", {}), f"{name}: undeclared named volume {source}"
    assert mounts[("prometheus", "/etc/prometheus/alerts.yml")] == ALERTS
    assert mounts[("grafana", "/var/lib/grafana/dashboards/kvtide.json")] == DASHBOARD
    prometheus = yaml.safe_load(mounts[("prometheus", "/etc/prometheus/prometheus.yml")].read_text())
    assert "/etc/prometheus/alerts.yml" in prometheus["rule_files"]
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["kvtide"]["static_configs"][0]["targets"] == ["kvtide:8000"]  # alerts select job="kvtide"
    provisioning = mounts[("grafana", "/etc/grafana/provisioning/dashboards")]
    providers = [yaml.safe_load(p.read_text()) for p in provisioning.glob("*.yml")]
    assert any(
        p["options"]["path"] == "/var/lib/grafana/dashboards" for doc in providers for p in doc["providers"]
    )
    datasources = yaml.safe_load(
        (mounts[("grafana", "/etc/grafana/provisioning/datasources")] / "prometheus.yml").read_text()
    )["datasources"]
    assert datasources[0]["type"] == "prometheus" and datasources[0]["url"] == "http://prometheus:9090"


@pytest.mark.skipif(
    shutil.which("docker") is None
    or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
    reason="docker compose CLI not installed",
)
def test_docker_compose_config_validates():
    env = dict(os.environ)
    env.pop("KVTIDE_MODEL", None)
    result = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE_DIR / "docker-compose.yml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stderr
