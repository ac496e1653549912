"""Validating a manifest against a custom resource's vendored schema (deploy/k8s/schemas/) the way the API server
would: unknown fields rejected, as kubectl's strict field validation does."""

from __future__ import annotations

import jsonschema


def closed(schema: dict) -> dict:
    """A copy of a CRD's structural schema in which an object with listed properties admits no other: the API
    server drops unknown fields (kubectl's default strict field validation rejects them), where plain
    JSON-schema validation lets them through."""
    node = dict(schema)
    if "properties" in node:
        node["properties"] = {name: closed(sub) for name, sub in node["properties"].items()}
        if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            node[key] = closed(node[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in node:
            node[key] = [closed(sub) for sub in node[key]]
    return node


def crd_errors(schema: dict, doc: dict) -> list[str]:
    """What is wrong with ``doc`` under the CRD's ``schema.openAPIV3Schema`` (closed), one line per error:
    ``path.to.field: message``; [] when it is valid."""
    validator = jsonschema.Draft7Validator(closed(schema))
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc))
