"""The shipped monitoring (deploy/monitoring/), checked offline: alert rules, Grafana dashboard, Kubernetes objects.

- prometheus/alerts.yaml passes `promtool check rules`, and `promtool test rules` runs prometheus/alerts_test.yaml,
  which fires every alert once and keeps it silent on a healthy series (skipped where promtool is absent).
- grafana/specmesh.json is a Grafana dashboard with the panels an operator needs, every expression is valid
  PromQL (promtool parses each as a recording rule), and every series the dashboard and the alerts name is one the
  code exports: the list comes from the project's own registries, instantiated here, not from a copy.
- The PrometheusRule holds the groups of alerts.yaml; `kubectl kustomize deploy/monitoring` builds the PodMonitor,
  the PrometheusRule and the dashboard's ConfigMap, whose selectors and ports match deploy/k8s/rayservice.yaml.
- The Prometheus configs of specmesh's Ray Serve replicas pass `promtool check config`: the laptop's reads the
  targets file deploy/serve_config.yaml has Membership write, with its upstream token; the Kubernetes one reads
  Membership's /targets on the head port and Service rayservice.yaml gives it, with the token its Secret holds.
- The PodMonitors and the PrometheusRule match the Prometheus Operator's CRD schemas vendored in deploy/k8s/schemas/
  (unknown fields rejected, as kubectl's strict field validation does), and broken copies do not.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from crd_helpers import crd_errors

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
MONITORING = DEPLOY / "monitoring"
ALERTS = MONITORING / "prometheus" / "alerts.yaml"
ALERTS_TEST = MONITORING / "prometheus" / "alerts_test.yaml"
LAPTOP_PROMETHEUS = MONITORING / "prometheus" / "prometheus.yml"
KUBERNETES_SCRAPE = MONITORING / "prometheus" / "kubernetes-scrape.yaml"
DASHBOARD = MONITORING / "grafana" / "specmesh.json"
PROVISIONING = MONITORING / "grafana" / "provisioning"
# the Prometheus Operator's CRD schemas (deploy/k8s/schemas/README.md), by the kind of the manifests they check
CRD_SCHEMAS = {"PodMonitor": DEPLOY / "k8s" / "schemas" / "podmonitor-v1.yaml",
               "PrometheusRule": DEPLOY / "k8s" / "schemas" / "prometheusrule-v1.yaml"}
PROMTOOL = shutil.which("promtool")
KUBECTL = shutil.which("kubectl")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian/Ubuntu: apt install "
                                                             "prometheus; or a Prometheus release tarball)")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed (its built-in kustomize builds "
                                                           "deploy/monitoring)")

# Series the rules and the dashboard may name that specmesh does not export: name -> (module file of the package
# that does, relative to the package, the name as that file spells it)
EXTERNAL = {
    # Ray Serve's controller: healthy replicas per deployment (Ray's metrics port, 8080 on KubeRay pods)
    "ray_serve_deployment_replica_healthy": ("ray", "serve/_private/deployment_state.py",
                                             "serve_deployment_replica_healthy"),
}
# what the dashboard shows, by panel title (the list)
REQUIRED_PANELS = ("Draft acceptance rate", "τ: tokens committed per verification step", "Acceptance per position",
                   "Acceptance per proposer", "Time to first token", "Inter-token latency",
                   "End-to-end request latency", "Requests running / waiting", "KV cache usage", "Drafter failovers",
                   "Verifier batch size")
# the Ray Serve pools (issue 74): tests/test_ray_serve.py runs each of their queries against a live application
POOL_PANELS = ("Replicas per pool", "Autoscaler signals", "KV use per pool", "Queue per pool",
               "Drafter latency per pool", "Drafter failovers per pool")
VARIABLES = ("$model_name", "$replica")  # the dashboard's query variables, "All" being .*
MODEL = "m"


# ------------------------------------------------------------------ what the code exports
def family_series(name: str, kind: str) -> set[str]:
    """The series names Prometheus stores for a metric family of ``kind``."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created"), "gaugehistogram": ("_bucket", "_gsum", "_gcount")}
    return {name + suffix for suffix in suffixes.get(kind, ("",))}


def exported_series() -> set[str]:
    """Every series name the three servers' registries can expose, from the registries themselves: the samples
    they hold now and, for families with no child yet (or custom collectors with nothing to report), the series
    their type implies."""
    from drafter_service.metrics import DrafterMetrics
    from orchestrator.metrics import ServeMetrics
    from specmesh_app.fleet_metrics import AutoscaleMetrics, PoolView
    from verifier_service.metrics import VerifierMetrics

    registries = [ServeMetrics(MODEL).registry, VerifierMetrics(list, model_name=MODEL).registry,
                  DrafterMetrics(sessions=dict, model_name=MODEL).registry, AutoscaleMetrics(PoolView).registry]
    names: set[str] = set()
    for registry in registries:
        families = list(registry.collect())
        for collector in list(registry._collector_to_names):  # custom collectors: families without samples too
            describe = getattr(collector, "describe", None)
            if describe is not None:
                families += list(describe())
        for family in families:
            names |= family_series(family.name, family.type)
            names |= {sample.name for sample in family.samples}
    return names


# ------------------------------------------------------------------ PromQL
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
                   "unless", "atan2", "inf", "nan"}


def series_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers that are not functions, keywords, label names in
    grouping clauses, or inside label matchers, ranges and strings. Grafana's variables are replaced first."""
    expr = re.sub(r"\$__\w+|\$\{?\w+\}?", "5m", expr)
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:])(\s*\()?", expr):
        name, call = match.group(1), match.group(2)
        if not call and name.lower() not in PROMQL_KEYWORDS:
            names.add(name)
    return names


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> list[dict]:
    return [p for p in dash["panels"] if p["type"] != "row"]


def dashboard_exprs(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in panels(dash) for t in p.get("targets", [])]
    for variable in dash["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", query["query"] if isinstance(query, dict)
                                else query))
    return exprs


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------ alert rules
@needs_promtool
def test_alert_rules_pass_promtool_check():
    done = promtool("check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_alert_rules_pass_their_unit_tests():
    done = promtool("test", "rules", ALERTS_TEST.name, cwd=ALERTS_TEST.parent)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_promtool_unit_tests_can_fail(tmp_path):
    """A rule file whose threshold moved fails the same unit tests: passing them means something."""
    (tmp_path / "alerts.yaml").write_text(ALERTS.read_text().replace("specmesh_kv_cache_usage_perc > 0.9",
                                                                     "specmesh_kv_cache_usage_perc > 0.99"))
    shutil.copy(ALERTS_TEST, tmp_path / ALERTS_TEST.name)
    done = promtool("test", "rules", ALERTS_TEST.name, cwd=tmp_path)
    assert done.returncode != 0 and "SpecmeshKVCacheNearFull" in done.stdout + done.stderr


def test_every_alert_fires_and_stays_silent_in_a_unit_test():
    """Each alert has a test case that expects it firing and one that expects it silent."""
    tests = yaml.safe_load(ALERTS_TEST.read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    for rule in alert_rules():
        expected = [case["exp_alerts"] for case in cases if case["alertname"] == rule["alert"]]
        assert any(expected) and any(not e for e in expected), rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning"}
        assert {"summary", "description"} <= rule["annotations"].keys()


def test_prometheusrule_holds_the_alert_rules():
    (doc,) = yaml.safe_load_all((MONITORING / "prometheusrule.yaml").read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert doc["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]


# ------------------------------------------------------------------ dashboard
def test_dashboard_is_a_grafana_dashboard():
    dash = dashboard()
    assert dash["uid"] == "specmesh" and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dash):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), panel["title"]
    titles = {p["title"] for p in panels(dash)}
    assert set(REQUIRED_PANELS) | set(POOL_PANELS) <= titles, (set(REQUIRED_PANELS) | set(POOL_PANELS)) - titles


def test_dashboard_selects_replicas_and_shows_the_pools():
    """A `replica` variable (every replica's series on Ray Serve carry the label) narrows every panel's specmesh
    selectors; the Pools row groups by deployment, each replica-level query of it by replica as well."""
    dash = dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    replica = variables["replica"]
    assert replica["type"] == "query" and replica["includeAll"] and replica["allValue"] == ".*"
    assert re.fullmatch(r"label_values\(.*specmesh_.*, replica\)", replica["query"]["query"]), replica["query"]
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    (pools_row,) = [r for r in rows if r["title"].startswith("Pools")]
    pool_panels = [p for p in panels(dash) if p["gridPos"]["y"] > pools_row["gridPos"]["y"]]
    assert {p["title"] for p in pool_panels} == set(POOL_PANELS)
    for panel in panels(dash):
        for target in panel["targets"]:
            expr = target["expr"]
            selectors = re.findall(r"(specmesh_\w+)\{([^}]*)\}", expr)
            if not selectors:  # Ray Serve's own series (their `replica` is Serve's id too, but not narrowed)
                assert "specmesh_" not in expr, (panel["title"], expr)
                continue
            if panel in pool_panels:
                grouped = re.findall(r"by \(([^)]*)\)", expr)
                assert all("deployment" in g or "replica" in g for g in grouped), (panel["title"], expr)
                narrowed = all('replica=~"$replica"' in labels for _, labels in selectors)
                assert narrowed == all("replica" in g for g in grouped), (panel["title"], expr)
            else:
                assert all('replica=~"$replica"' in labels for _, labels in selectors), (panel["title"], expr)


@needs_promtool
def test_dashboard_expressions_are_promql(tmp_path):
    """Each expression, Grafana's variables filled in, parses as PromQL (promtool checks it as a recording
    rule)."""
    exprs = [re.sub(r"\$__rate_interval", "1m", e) for e in dashboard_exprs(dashboard())]
    for variable in VARIABLES:
        exprs = [e.replace(variable, ".*") for e in exprs]
    assert not [e for e in exprs if "$" in e], exprs
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:expr_{i}", "expr": e}
                                                        for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    done = promtool("check", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


def test_dashboard_and_alerts_name_only_exported_series():
    exported = exported_series()
    named = {name: where for where, exprs in (("dashboard", dashboard_exprs(dashboard())),
                                              ("alerts.yaml", [r["expr"] for r in alert_rules()]))
             for expr in exprs for name in series_names(expr)}
    unknown = {name: where for name, where in named.items() if name not in exported and name not in EXTERNAL}
    assert not unknown, f"series the code does not export: {unknown}"
    assert {"specmesh_spec_decode_num_accepted_tokens_total", "specmesh_time_to_first_token_seconds_bucket",
            "specmesh_kv_cache_usage_perc", "specmesh_verifier_batch_sessions_sum"} <= named.keys()


def test_external_series_are_exported_by_their_package():
    """The Ray Serve series the rules use exist in the installed Ray (skipped without Ray)."""
    for name, (package, module, spelled) in EXTERNAL.items():
        spec = importlib.util.find_spec(package)
        if spec is None:
            pytest.skip(f"{package} not installed")
        source = Path(spec.origin).parent / module
        assert f'"{spelled}"' in source.read_text(), f"{name}: not in {source}"


def test_series_names_finds_metrics_not_labels_or_functions():
    expr = ('histogram_quantile(0.9, sum by (model_name, le) (rate(specmesh_a_bucket{model_name=~"$model_name"}'
            '[$__rate_interval]))) / on () group_left () sum(rate(specmesh_b_total[5m] offset 1d)) > 0.5\n'
            'and absent(up{job="x"} > 0) unless label_replace(c, "dst", "$1", "src", "(.*)")')
    assert series_names(expr) == {"specmesh_a_bucket", "specmesh_b_total", "up", "c"}
    assert "specmesh_no_such_total" not in exported_series()  # so a misspelt name fails the test above


def test_grafana_provisioning_loads_the_dashboard():
    (source,) = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert source["type"] == "prometheus"
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "specmesh.yaml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


# ------------------------------------------------------------------ Prometheus configs (Ray Serve replicas)
def app_args(config: dict) -> dict:
    (app,) = config["applications"]
    return app["args"]


def option(options: list[str], name: str) -> str:
    return options[options.index(name) + 1]


@needs_promtool
def test_prometheus_configs_pass_promtool_check(tmp_path):
    """The laptop's prometheus.yml, and the Kubernetes scrape configs inside a config of their own (syntax only:
    their token files exist only where they run)."""
    done = promtool("check", "config", "--syntax-only", str(LAPTOP_PROMETHEUS))
    assert done.returncode == 0, done.stdout + done.stderr
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"scrape_configs": yaml.safe_load(KUBERNETES_SCRAPE.read_text())}))
    done = promtool("check", "config", "--syntax-only", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    config.write_text(config.read_text().replace("http_sd_configs", "http_sd_config"))  # a typo fails the check
    assert promtool("check", "config", "--syntax-only", str(config)).returncode != 0


def test_laptop_prometheus_reads_the_targets_the_serve_config_writes():
    """Paths in prometheus.yml are its directory's, those of the Serve config the repository root's (where `serve
    run` starts): the file_sd glob matches the targets file, the token is the upstream one every replica takes."""
    root = DEPLOY.parent
    prometheus = yaml.safe_load(LAPTOP_PROMETHEUS.read_text())
    args = app_args(yaml.safe_load((DEPLOY / "serve_config.yaml").read_text()))
    (job,) = prometheus["scrape_configs"]
    assert job["honor_labels"] is True  # the replica's own labels, not exported_replica
    (discovery,) = job["file_sd_configs"]
    targets = root / args["metrics_targets_file"]
    assert any(targets.match(str(LAPTOP_PROMETHEUS.parent.resolve() / pattern)) for pattern in discovery["files"])
    token = (LAPTOP_PROMETHEUS.parent / job["authorization"]["credentials_file"]).resolve()
    assert token == (root / option(args["serve"], "--upstream-token-file")).resolve()
    assert token == (root / option(args["verifier"], "--token-file")).resolve() == \
        (root / option(args["drafter"], "--token-file")).resolve()
    assert [(LAPTOP_PROMETHEUS.parent / f).resolve() for f in prometheus["rule_files"]] == [ALERTS.resolve()]
    ignored = (LAPTOP_PROMETHEUS.parent / ".gitignore").read_text()
    assert "/targets/" in ignored and targets.parent.name == "targets"  # git never sees a run's targets


def test_kubernetes_scrape_config_reads_membership_on_the_head():
    (rayservice,) = yaml.safe_load_all((DEPLOY / "k8s" / "rayservice.yaml").read_text())
    cluster = rayservice["spec"]["rayClusterConfig"]
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    args = app_args(yaml.safe_load(rayservice["spec"]["serveConfigV2"]))
    (job,) = yaml.safe_load(KUBERNETES_SCRAPE.read_text())
    assert job["honor_labels"] is True
    (discovery,) = job["http_sd_configs"]
    url = re.fullmatch(r"http://([\w-]+)\.[\w-]+\.svc:(\d+)(/\S*)", discovery["url"])
    assert url, discovery["url"]
    assert url.group(1) == rayservice["metadata"]["name"] + "-head-svc"  # the head Service KubeRay makes
    port = {p["name"]: p["containerPort"] for p in head["ports"]}["membership"]
    assert int(url.group(2)) == port == args["membership_metrics_port"] and url.group(3) == "/targets"
    # both read with the upstream token: the Secret the RayService's pods mount, where the Prometheus resource's
    # `secrets:` puts it
    (secret,) = {v["secret"]["secretName"] for g in cluster["workerGroupSpecs"]
                 for v in g["template"]["spec"]["volumes"] if "secret" in v}
    upstream = Path(option(args["serve"], "--upstream-token-file")).name
    expected = f"/etc/prometheus/secrets/{secret}/{upstream}"
    assert job["authorization"]["credentials_file"] == discovery["authorization"]["credentials_file"] == expected


# ------------------------------------------------------------------ Kubernetes objects
@needs_kubectl
def test_monitoring_kustomization_builds():
    """PodMonitors select the RayService's pods by its pod templates' labels and scrape ports those pods name;
    the dashboard's ConfigMap is the JSON file, labelled for Grafana's sidecar."""
    done = subprocess.run([KUBECTL, "kustomize", str(MONITORING)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    by_kind: dict[str, list] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    assert set(by_kind) == {"ConfigMap", "PodMonitor", "PrometheusRule"}
    (config_map,) = by_kind["ConfigMap"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["specmesh.json"]) == dashboard()

    (rayservice,) = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "rayservice.yaml").read_text())]
    cluster = rayservice["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for monitor in by_kind["PodMonitor"]:
        wanted = monitor["spec"]["selector"]["matchLabels"]
        selected = [t for t in templates if wanted.items() <= t["metadata"]["labels"].items()]
        assert selected, monitor["metadata"]["name"]
        for template in selected:
            ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
            for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                assert endpoint["port"] in ports, (monitor["metadata"]["name"], endpoint["port"])


def operator_documents() -> list[tuple[str, dict]]:
    """(file name, document) of every Prometheus Operator object in deploy/monitoring/."""
    return [(path.name, doc) for path in sorted(MONITORING.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def operator_errors(doc: dict) -> list[str]:
    assert doc["apiVersion"] == "monitoring.coreos.com/v1", doc["apiVersion"]  # the version vendored
    return crd_errors(yaml.safe_load(CRD_SCHEMAS[doc["kind"]].read_text()), doc)


def test_operator_objects_match_the_crd_schemas():
    docs = operator_documents()
    assert sorted({doc["kind"] for _, doc in docs}) == sorted(CRD_SCHEMAS)
    for name, doc in docs:
        errors = operator_errors(doc)
        assert not errors, f"{name} {doc['kind']} {doc['metadata']['name']}:\n" + "\n".join(errors)


def _break_podmonitor(doc: dict, how: str) -> None:
    endpoint = doc["spec"]["podMetricsEndpoints"][0]
    if how == "unknown field":
        doc["spec"]["podMetricEndpoints"] = doc["spec"].pop("podMetricsEndpoints")  # the plural's typo
    elif how == "bad duration":
        endpoint["interval"] = "15 seconds"
    elif how == "wrong type":
        endpoint["port"] = 8080  # a port's name; a number is targetPort
    elif how == "missing required":
        del doc["spec"]["selector"]


def _break_prometheusrule(doc: dict, how: str) -> None:
    rule = doc["spec"]["groups"][0]["rules"][0]
    if how == "unknown field":
        rule["severity"] = rule["labels"].pop("severity")  # a label, not a field of the rule
    elif how == "bad duration":
        rule["for"] = "2 minutes"
    elif how == "wrong type":
        rule["labels"] = ["severity=critical"]
    elif how == "missing required":
        del rule["expr"]


@pytest.mark.parametrize("how", ["unknown field", "bad duration", "wrong type", "missing required"])
@pytest.mark.parametrize("kind", sorted(CRD_SCHEMAS))
def test_crd_schemas_reject_broken_objects(kind, how):
    (_, doc), *_ = [(n, d) for n, d in operator_documents() if d["kind"] == kind]
    broken = copy.deepcopy(doc)
    {"PodMonitor": _break_podmonitor, "PrometheusRule": _break_prometheusrule}[kind](broken, how)
    assert operator_errors(broken), f"a {kind} with a {how} passed"
