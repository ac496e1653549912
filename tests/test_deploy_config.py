"""The deployment files, checked offline (no Ray cluster, no Kubernetes, no network).

- The two Ray Serve configs, deploy/serve_config.yaml (laptop) and the `serveConfigV2` inside
  deploy/k8s/rayservice.yaml (KubeRay), parse as Serve's schema with no key Serve would silently ignore; their
  `args` are specmesh_app.deploy.AppArgs whose option lists parse as the `specmesh` commands they are for;
  their deployments and autoscaling policies name what exists.
- deploy/k8s/*.yaml: built-in kinds against Kubernetes' schemas (kubernetes-validate, strict), the RayService
  against KubeRay's CRD schema vendored in deploy/k8s/schemas/ (unknown fields rejected, as kubectl's strict
  field validation does), and the pieces agree with each other (ports, node labels, Redis).
- Each check rejects a deliberately broken copy, so that passing means something.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import types
from pathlib import Path
from typing import Union, get_args, get_origin
from urllib.parse import urlparse

import pytest
from crd_helpers import crd_errors

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
K8S = DEPLOY / "k8s"
CRD_SCHEMA = K8S / "schemas" / "rayservice-v1.json"
KUBERNETES_VERSION = "1.33.0"  # the oldest these manifests target; kubernetes-validate ships 1.25 to 1.37

APP_IMPORT_PATH = "specmesh_app.deploy:build_app"
GENERATE_SERVICER = "specmesh.v1.generate_pb2_grpc.add_GenerateServicer_to_server"
# AppArgs field -> the `specmesh` command whose options it holds, and the options Serve decides for it
SERVE_CONFIGS = ["laptop", "kuberay"]


# ------------------------------------------------------------------ loading
def k8s_documents() -> list[tuple[str, dict]]:
    """(file name, document) of every manifest in deploy/k8s/ (kustomization.yaml is kustomize's, not one)."""
    return [(path.name, doc) for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def rayservice() -> dict:
    (doc,) = [doc for _, doc in k8s_documents() if doc["kind"] == "RayService"]
    return doc


def serve_config(which: str) -> dict:
    if which == "laptop":
        return yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    return yaml.safe_load(rayservice()["spec"]["serveConfigV2"])


def only_app(config: dict) -> dict:
    (app,) = config["applications"]
    return app


def deployments(config: dict) -> dict[str, dict]:
    return {d["name"]: d for d in only_app(config).get("deployments", [])}


# ------------------------------------------------------------------ checkers
def unknown_keys(annotation, value, where: str = "") -> list[str]:
    """Keys of ``value`` that the pydantic model ``annotation`` (and the models nested in it) does not define.
    Serve's schemas ignore such keys: a misspelt ``min_replica`` would otherwise pass unnoticed."""
    from pydantic import BaseModel

    def is_model(a) -> bool:
        return isinstance(a, type) and issubclass(a, BaseModel)

    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):  # e.g. Union[Dict, AutoscalingConfig]: Serve makes the model of it
        arms = [a for a in args if is_model(a) or get_origin(a) is list]
        return min((unknown_keys(a, value, where) for a in arms), key=len, default=[])
    if origin is list and isinstance(value, list):
        return [k for i, item in enumerate(value) for k in unknown_keys(args[0], item, f"{where}[{i}]")]
    if is_model(annotation) and isinstance(value, dict):
        fields = annotation.model_fields
        names = set(fields) | {f.alias for f in fields.values() if f.alias}
        found = [f"{where}.{key}" for key in value if key not in names]
        for key, item in value.items():
            if key in fields:
                found += unknown_keys(fields[key].annotation, item, f"{where}.{key}")
        return found
    return []


def check_serve_config(config: dict) -> None:
    """Serve's own validation, plus the keys it would ignore and the autoscaling configs it validates only at
    deploy time (which imports each custom policy)."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(config)
    ignored = unknown_keys(ServeDeploySchema, config)
    assert not ignored, f"keys Serve would ignore: {ignored}"
    for deployment in deployments(config).values():
        if deployment.get("autoscaling_config") is not None:
            AutoscalingConfig.model_validate(deployment["autoscaling_config"])


def check_app_args(args: dict) -> dict[str, argparse.Namespace]:
    """``args`` as AppArgs, each option list parsed by its command the way the application parses it (options
    Serve decides refused): field -> parsed options."""
    from specmesh_app.deploy import REPLICA_OPTIONS, SERVE_OPTIONS, AppArgs, parse_options

    app_args = AppArgs.model_validate(args)
    decided = {"verifier": REPLICA_OPTIONS, "drafter": REPLICA_OPTIONS, "serve": SERVE_OPTIONS}
    return {field: parse_options(field, getattr(app_args, field), decided[field]) for field in decided
            if getattr(app_args, field) is not None}  # drafter: null = no drafter deployment


def check_policy(policy: dict) -> None:
    """The policy's import path names a callable; a class must accept the config's policy_kwargs."""
    module, _, name = policy["policy_function"].partition(":")
    target = getattr(importlib.import_module(module), name)
    if isinstance(target, type):
        target = target(**policy.get("policy_kwargs", {}))
    assert callable(target), policy["policy_function"]


def check_rayservice(doc: dict) -> None:
    errors = crd_errors(json.loads(CRD_SCHEMA.read_text()), doc)
    assert not errors, "\n".join(errors)


def check_builtin(doc: dict) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")

    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


# ------------------------------------------------------------------ Ray Serve configs
@pytest.mark.parametrize("which", SERVE_CONFIGS)
def test_serve_config_is_valid(which):
    pytest.importorskip("ray.serve")
    check_serve_config(serve_config(which))


@pytest.mark.parametrize("which", SERVE_CONFIGS)
def test_serve_config_runs_specmesh(which):
    """One application, specmesh's builder at /, the Generate service on Serve's gRPC proxy."""
    config = serve_config(which)
    app = only_app(config)
    assert (app["import_path"], app["route_prefix"]) == (APP_IMPORT_PATH, "/")
    servicers = config["grpc_options"]["grpc_servicer_functions"]
    assert servicers == [GENERATE_SERVICER]
    module, _, name = GENERATE_SERVICER.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))


@pytest.mark.parametrize("which", SERVE_CONFIGS)
def test_app_args_are_specmesh_command_lines(which):
    pytest.importorskip("ray.serve")
    parsed = check_app_args(only_app(serve_config(which))["args"])
    assert parsed.keys() == {"verifier", "drafter", "serve"}  # both configs run a drafter pool


@pytest.mark.parametrize("which", SERVE_CONFIGS)
def test_deployment_overrides_name_the_apps_deployments(which):
    """Every override names a deployment of the application the import path builds from these args, the way
    `serve run` / `serve deploy` call it (their builder-signature check included), and the ingress is the
    Orchestrator."""
    pytest.importorskip("ray.serve")
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app as build_serve_app

    config = serve_config(which)
    app = only_app(config)
    application = call_user_app_builder_with_args_if_necessary(import_attr(app["import_path"]), app["args"])
    built = build_serve_app(application, name=app["name"])
    assert built.ingress_deployment_name == "Orchestrator"
    assert set(deployments(config)) <= {d.name for d in built.deployments}


@pytest.mark.parametrize("which", SERVE_CONFIGS)
def test_autoscaling_policies_exist(which):
    policies = {name: d["autoscaling_config"]["policy"] for name, d in deployments(serve_config(which)).items()
                if "policy" in d.get("autoscaling_config", {})}
    assert {"Verifier", "Drafter"} <= policies.keys()
    for policy in policies.values():
        check_policy(policy)


# ------------------------------------------------------------------ Kubernetes manifests
def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {path.name for path in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(manifests)


@pytest.mark.parametrize("name, doc", [(n, d) for n, d in k8s_documents() if d["kind"] != "RayService"],
                         ids=lambda x: x if isinstance(x, str) else x["kind"])
def test_builtin_kinds_match_kubernetes_schema(name, doc):
    check_builtin(doc)


def test_rayservice_matches_kuberay_crd():
    check_rayservice(rayservice())


def test_rayservice_pieces_agree():
    """The head exposes Serve's ports to KubeRay's serve Service, and Membership's metrics port, with Membership
    placed there; every label selector of a replica matches a group's Ray node labels; drafters reach the Redis
    Service of redis.yaml."""
    cluster, config = rayservice()["spec"]["rayClusterConfig"], serve_config("kuberay")
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["serve"] == config["http_options"]["port"]
    assert ports["serve-grpc"] == config["grpc_options"]["port"]

    groups = [group.get("labels", {}) for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]]
    for name, deployment in deployments(config).items():
        selector = deployment.get("ray_actor_options", {}).get("label_selector")
        if selector:
            assert any(selector.items() <= labels.items() for labels in groups), f"{name}: no group has {selector}"
    # Membership, on the head only, serves /targets on the head port the Service carries (http_sd_configs)
    membership = deployments(config)["Membership"]["ray_actor_options"]["label_selector"]
    assert [g for g in groups if membership.items() <= g.items()] == [groups[0]]
    assert ports["membership"] == only_app(config)["args"]["membership_metrics_port"]

    store = urlparse(check_app_args(only_app(config)["args"])["drafter"].ngram_store)
    (service,) = [d for n, d in k8s_documents() if n == "redis.yaml" and d["kind"] == "Service"]
    assert store.hostname == service["metadata"]["name"]
    assert store.port in {p["port"] for p in service["spec"]["ports"]}


def test_redis_evicts_least_frequently_used():
    """deploy/README.md: the n-gram store's Redis runs with maxmemory and allkeys-lfu."""
    (deployment,) = [d for n, d in k8s_documents() if n == "redis.yaml" and d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lfu"
    assert "--maxmemory" in args
    assert "readinessProbe" in container


# ------------------------------------------------------------------ the checks can fail
BROKEN_SERVE_CONFIGS = {  # each changes a copy of the laptop config: (config, its deployments by name)
    "wrong type": lambda config, deps: config["http_options"].update(port="eighty"),
    "misspelt key": lambda config, deps: deps["Verifier"]["autoscaling_config"].update(min_replica=1),
    "misspelt nested key": lambda config, deps: deps["Drafter"]["ray_actor_options"].update(num_cpu=1),
    "no replicas": lambda config, deps: deps["Verifier"]["autoscaling_config"].update(max_replicas=0),
}


@pytest.mark.parametrize("breakage", BROKEN_SERVE_CONFIGS)
def test_serve_checks_reject_broken_configs(breakage):
    pytest.importorskip("ray.serve")
    from pydantic import ValidationError

    config = copy.deepcopy(serve_config("laptop"))
    BROKEN_SERVE_CONFIGS[breakage](config, deployments(config))
    with pytest.raises((ValidationError, AssertionError)):
        check_serve_config(config)


def test_app_args_checks_reject_broken_args():
    pytest.importorskip("ray.serve")
    from pydantic import ValidationError

    args = only_app(serve_config("laptop"))["args"]
    with pytest.raises(ValidationError):
        check_app_args({**args, "verifier": "--threads 1"})  # a string, not a list
    with pytest.raises(ValueError, match="--kv-cache-gbs"):
        check_app_args({**args, "verifier": ["--kv-cache-gbs", "1"]})  # no such option
    with pytest.raises(ValueError, match="invalid choice"):
        check_app_args({**args, "serve": ["--proposer", "fuzed"]})
    with pytest.raises(ValueError, match="--listen is decided by Ray Serve"):
        check_app_args({**args, "verifier": ["--listen", "0.0.0.0:50052"]})
    with pytest.raises(ValueError, match="--health is decided by Ray Serve"):  # Serve's proxy answers the probes
        check_app_args({**args, "serve": ["--health", "0.0.0.0:8081"]})


def test_policy_check_rejects_broken_policies():
    with pytest.raises(AttributeError):
        check_policy({"policy_function": "specmesh_app.autoscaling:NoSuchPolicy"})
    policy = copy.deepcopy(deployments(serve_config("laptop"))["Verifier"]["autoscaling_config"]["policy"])
    policy["policy_kwargs"]["target_session"] = 8  # misspelt kwarg
    with pytest.raises(TypeError):
        check_policy(policy)


def test_kubernetes_checks_reject_broken_manifests():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    jsonschema = pytest.importorskip("jsonschema")

    (deployment,) = [d for n, d in k8s_documents() if d["kind"] == "Deployment"]
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "one"
    unknown_field = copy.deepcopy(deployment)
    unknown_field["spec"]["replica"] = 1
    for doc in (wrong_type, unknown_field):
        with pytest.raises(kubernetes_validate.ValidationError):
            check_builtin(doc)

    wrong_type = copy.deepcopy(rayservice())
    wrong_type["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "four"
    unknown_field = copy.deepcopy(rayservice())
    unknown_field["spec"]["rayClusterConfig"]["workerGroupSpec"] = []
    for doc in (wrong_type, unknown_field):
        with pytest.raises(AssertionError):
            check_rayservice(doc)
    with pytest.raises(jsonschema.ValidationError):  # the vendored schema itself, unclosed, still checks types
        jsonschema.validate(wrong_type, json.loads(CRD_SCHEMA.read_text()))
