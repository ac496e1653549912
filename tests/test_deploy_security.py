"""The shipped configurations are secure and placeable (issue 35 item 6), checked offline.

- Both Serve configs carry tokens the way the commands take them: the orchestrator checks client tokens
  (`serve --token-file`) and presents its own upstream token (`--upstream-token-file`), which is what verifiers
  and drafters accept (their `--token-file`); with real token files, the commands' own security loaders accept
  the wiring. The laptop config's HTTP binds loopback and its token files are ones git ignores.
- deploy/k8s: the Secret is mounted, with the keys each pool needs, in the pods its replicas run on; verifier pods
  tolerate the GPU taint and select GPU nodes; every Ray pod has a memory-backed /dev/shm; the RayService upgrades
  to a new cluster; every replica declares memory, and no pod is promised more than it holds; the Ray metrics port
  is named on every pod. The manifests still build with kustomize and pass Kubernetes' schemas, the example
  NetworkPolicy included.
"""

from __future__ import annotations

import argparse
import ipaddress
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
KUBERNETES_VERSION = "1.33.0"
SECRET = "specmesh-tokens"
KUBECTL = shutil.which("kubectl")
QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


# ------------------------------------------------------------------ loading
def rayservice() -> dict:
    (doc,) = yaml.safe_load_all((K8S / "rayservice.yaml").read_text())
    return doc


def serve_config(which: str) -> dict:
    if which == "laptop":
        return yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    return yaml.safe_load(rayservice()["spec"]["serveConfigV2"])


def app_options(which: str) -> dict[str, argparse.Namespace]:
    """The application's option lists, parsed by the `specmesh` commands as the application parses them."""
    pytest.importorskip("ray.serve")
    from specmesh_app.deploy import AppArgs, parse_options

    (app,) = serve_config(which)["applications"]
    args = AppArgs.model_validate(app["args"])
    return {command: parse_options(command, getattr(args, command)) for command in ("verifier", "drafter", "serve")}


def deployments(which: str) -> dict[str, dict]:
    (app,) = serve_config(which)["applications"]
    return {d["name"]: d for d in app["deployments"]}


def groups() -> list[dict]:
    """Head and worker groups as {name, labels, template, rayStartParams}."""
    cluster = rayservice()["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    found = [{"name": "head", "labels": head.get("labels", {}), "template": head["template"],
              "params": head["rayStartParams"]}]
    found += [{"name": g["groupName"], "labels": g.get("labels", {}), "template": g["template"],
               "params": g.get("rayStartParams", {})} for g in cluster["workerGroupSpecs"]]
    return found


def group_of(deployment: dict) -> dict:
    """The group whose Ray node labels the deployment's label_selector asks for (the head's for Membership)."""
    selector = deployment["ray_actor_options"]["label_selector"]
    (group,) = [g for g in groups() if selector.items() <= g["labels"].items()]
    return group


def quantity(value) -> float:
    value = str(value)
    for suffix, factor in QUANTITY.items():
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * factor
    return float(value)


def secret_files(template: dict, container: str = "ray-worker") -> dict[str, str]:
    """Path inside ``container`` -> key of the tokens Secret, for every key the pod mounts."""
    spec = template["spec"]
    volumes = {v["name"]: v["secret"] for v in spec.get("volumes", [])
               if v.get("secret", {}).get("secretName") == SECRET}
    (main,) = [c for c in spec["containers"] if c["name"] == container]
    files = {}
    for mount in main.get("volumeMounts", []):
        if mount["name"] in volumes:
            assert mount.get("readOnly"), mount
            items = volumes[mount["name"]].get("items") or [{"key": k, "path": k} for k in ("clients", "upstream")]
            files.update({str(PurePosixPath(mount["mountPath"]) / i["path"]): i["key"] for i in items})
    return files


# ------------------------------------------------------------------ tokens in the Serve configs
@pytest.mark.parametrize("which", ["laptop", "kuberay"])
def test_serve_configs_carry_client_and_upstream_tokens(which):
    options = app_options(which)
    serve, verifier, drafter = options["serve"], options["verifier"], options["drafter"]
    assert serve.token_file is not None and serve.upstream_token_file is not None
    assert serve.token_file != serve.upstream_token_file  # a client token must not open the verifiers
    assert verifier.token_file == drafter.token_file == serve.upstream_token_file


@pytest.mark.parametrize("which", ["laptop", "kuberay"])
def test_token_wiring_passes_the_commands_security_checks(which, tmp_path, monkeypatch):
    """With the files in place (distinct tokens), every replica's listener and the orchestrator's upstream
    credentials load as the commands load them, and the orchestrator presents what the replicas accept."""
    from specmesh import rpc, serving

    monkeypatch.delenv(rpc.TOKEN_ENV, raising=False)
    monkeypatch.delenv(rpc.UPSTREAM_TOKEN_ENV, raising=False)
    options = app_options(which)
    serve = options["serve"]
    files = {serve.token_file: "client-token-1\nclient-token-2\n", serve.upstream_token_file: "upstream-token\n"}
    moved = {path: tmp_path / path.name for path in files}
    for path, text in files.items():
        moved[path].write_text(text)
    for args in options.values():
        for name in ("token_file", "upstream_token_file"):
            if getattr(args, name, None) is not None:
                setattr(args, name, moved[getattr(args, name)])
    server = serving.server_security(serve)
    upstream = serving.upstream_security(serve, server)
    assert server.tokens == ("client-token-1", "client-token-2")
    for command in ("verifier", "drafter"):
        assert serving.server_security(options[command]).tokens == (upstream.token,)


def test_laptop_config_binds_loopback_and_keeps_tokens_out_of_git():
    config = serve_config("laptop")
    assert ipaddress.ip_address(config["http_options"]["host"]).is_loopback
    serve = app_options("laptop")["serve"]
    for path in (serve.token_file, serve.upstream_token_file):
        assert not path.is_absolute()  # relative to the repository root, where `serve run` starts
        ignored = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT)
        if ignored.returncode == 128:
            pytest.skip("not a git checkout")
        assert ignored.returncode == 0, f"{path} would be committed"


def test_every_replica_reserves_memory():
    for which in ("laptop", "kuberay"):
        for name in ("Verifier", "Drafter", "Orchestrator"):
            assert deployments(which)[name]["ray_actor_options"]["memory"] > 0, (which, name)


# ------------------------------------------------------------------ Kubernetes placement and mounts
def test_token_files_are_mounted_where_their_replicas_run():
    """Each deployment's token paths are files of the Secret mounted in the pods of its group, and a group gets
    no key its replicas do not use."""
    options = app_options("kuberay")
    needs = {"Verifier": {options["verifier"].token_file},
             "Drafter": {options["drafter"].token_file},
             "Orchestrator": {options["serve"].token_file, options["serve"].upstream_token_file},
             "Membership": {options["serve"].upstream_token_file}}  # its metrics port takes the upstream token
    used: dict[str, set[str]] = {}
    for name, paths in needs.items():
        group = group_of(deployments("kuberay")[name])
        mounted = secret_files(group["template"], group["template"]["spec"]["containers"][0]["name"])
        for path in paths:
            assert str(path) in mounted, f"{name}: {path} not mounted in {group['name']}"
            used.setdefault(group["name"], set()).add(str(path))
    for group in groups():
        assert set(secret_files(group["template"], group["template"]["spec"]["containers"][0]["name"])) == \
            used.get(group["name"], set()), group["name"]


def test_verifier_pods_land_on_gpu_nodes():
    group = group_of(deployments("kuberay")["Verifier"])
    spec = group["template"]["spec"]
    assert spec["nodeSelector"], "no accelerator node selector"
    assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in spec["tolerations"])
    (container,) = spec["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1


def test_ray_pods_have_memory_backed_shm_and_a_metrics_port():
    for group in groups():
        spec = group["template"]["spec"]
        (container,) = spec["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert volume["emptyDir"]["medium"] == "Memory", group["name"]
        # the object store fits in /dev/shm, and both fit in the container's memory limit
        shm = quantity(volume["emptyDir"]["sizeLimit"])
        limit = quantity(container["resources"]["limits"]["memory"])
        assert quantity(group["params"]["object-store-memory"]) <= shm < limit, group["name"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == int(group["params"]["metrics-export-port"]), group["name"]
        assert group["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "specmesh"


def test_replicas_never_promise_a_pod_more_memory_than_it_has():
    """However Ray packs a group's replicas by CPU (and GPU), their reserved memory and the object store fit the
    pod's memory limit."""
    for group in groups():
        if group["name"] == "head":
            continue
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        room = quantity(limits["memory"]) - quantity(group["params"]["object-store-memory"])
        on_group = [d["ray_actor_options"] for d in deployments("kuberay").values()
                    if d["ray_actor_options"].get("label_selector") and group_of(d)["name"] == group["name"]]
        assert on_group, group["name"]
        for actor in on_group:
            fits = quantity(limits["cpu"]) // actor["num_cpus"]
            if actor.get("num_gpus"):
                fits = min(fits, int(limits["nvidia.com/gpu"]) // actor["num_gpus"])
            assert fits * actor["memory"] <= room, (group["name"], actor)


def test_rayservice_upgrades_to_a_new_cluster():
    assert rayservice()["spec"]["upgradeStrategy"]["type"] == "NewCluster"
    (redis,) = [d for d in yaml.safe_load_all((K8S / "redis.yaml").read_text()) if d["kind"] == "Deployment"]
    assert redis["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


# ------------------------------------------------------------------ offline validators
def test_network_policy_example_matches_kubernetes_schema_and_the_pods():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = list(yaml.safe_load_all((K8S / "optional" / "networkpolicy.yaml").read_text()))
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    ray_policy, redis_policy = docs
    selector = ray_policy["spec"]["podSelector"]["matchLabels"]
    assert all(selector.items() <= g["template"]["metadata"]["labels"].items() for g in groups())
    (redis,) = [d for d in yaml.safe_load_all((K8S / "redis.yaml").read_text()) if d["kind"] == "Deployment"]
    assert redis_policy["spec"]["podSelector"]["matchLabels"].items() <= \
        redis["spec"]["template"]["metadata"]["labels"].items()
    serve_ports = {p["port"] for rule in ray_policy["spec"]["ingress"] if "from" not in rule for p in rule["ports"]}
    config = serve_config("kuberay")
    assert serve_ports == {config["http_options"]["port"], config["grpc_options"]["port"]}


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed (its built-in kustomize builds deploy/k8s)")
def test_kustomize_builds_the_manifests_with_the_secret_mounts():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    done = subprocess.run([KUBECTL, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "RayService"}
    for doc in docs:
        if doc["kind"] != "RayService":  # test_deploy_config.py checks it against KubeRay's CRD schema
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    (built,) = [d for d in docs if d["kind"] == "RayService"]
    assert built == rayservice()
