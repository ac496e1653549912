"""`specmesh serve MODEL` under the flags of `vllm serve`: vLLM's names for what specmesh has, mapped onto its own
options, and a one-line error naming what to use instead for what it does not have.

``add_vllm_arguments`` defines them (a group of `serve`'s options); ``apply_vllm_arguments`` translates a parsed
namespace in place before anything loads: ``--served-model-name`` → the served names, ``--api-key`` (or
``$SPECMESH_API_KEY`` / ``$VLLM_API_KEY``) → bearer tokens, ``--gpu-memory-utilization`` → ``--kv-cache-memory``,
``--max-num-seqs`` → ``--max-concurrent``, ``--enforce-eager`` → ``--cuda-graphs off --compile off``,
``--no-enable-prefix-caching`` → ``--no-prefix-caching``, ``--speculative-config`` → ``--proposer`` (and
``--draft``, the default tree budget), ``--enable-auto-tool-choice`` / ``--tool-call-parser`` → tool_choice
"auto"'s parser (orchestrator/tool_calls.py); ``--dtype half`` and the flags of features not built (tensor
parallelism beyond one device, EAGLE/MTP/Medusa heads) are refused with what to use. docs/http-api.md,
"vLLM's command line", has the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from drafter_service.proposer import proposer_names, proposer_spec
from orchestrator.tool_calls import DEFAULT_PARSER, PARSERS
from specmesh import models

log = logging.getLogger("specmesh.serve")
API_KEY_ENVS = ("SPECMESH_API_KEY", "VLLM_API_KEY")  # read when no --api-key is given, in this order
# vLLM's --speculative-config methods specmesh has, as its proposers (num_speculative_tokens: the chain's length)
SPECULATIVE_METHODS = {"ngram": "prompt_lookup", "draft_model": "draft_model"}
NOT_BUILT_METHODS = {  # vLLM's methods specmesh does not have: what to use instead
    "eagle": "EAGLE heads are not supported yet; a feature-head drafter: --proposer falcon (a head from "
             "`specmesh train-falcon`), or the model-free default fused",
    "eagle3": "EAGLE-3 heads are not supported yet; a feature-head drafter: --proposer falcon (a head from "
              "`specmesh train-falcon`), or the model-free default fused",
    "suffix": "suffix decoding is not built yet; the longest repeated match: --proposer copy, or fused",
    "medusa": "Medusa heads are not supported; --proposer falcon (a trained head) or fused",
    "mlp_speculator": "MLP speculators are not supported; --proposer falcon (a trained head) or fused",
    "mtp": "multi-token prediction heads are not supported; --proposer falcon (a trained head) or fused",
    "deepseek_mtp": "multi-token prediction heads are not supported; --proposer falcon (a trained head) or fused",
}
SPECULATIVE_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                    "max_nodes", "max_depth", "draft_tensor_parallel_size"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config`` as specmesh's: the default proposer, its budget (None: the proposer's default),
    and the draft model it needs (None: none, or --draft's)."""

    proposer: str
    max_nodes: int | None = None
    max_depth: int | None = None
    draft: str | None = None


def add_vllm_arguments(p: argparse.ArgumentParser) -> None:
    v = p.add_argument_group("vLLM's names", "the flags of `vllm serve` for what specmesh has (docs/http-api.md: "
                                             "\"vLLM's command line\"); what it lacks is refused with what to use")
    v.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's ids in the HTTP API: a request may name any of them; responses, /v1/models' "
                        "first entry, traces and metrics carry the first (default: --model-name, else MODEL as "
                        "given on the command line)")
    v.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="a bearer token HTTP requests (and gRPC calls) must carry (repeatable; beside --token-file; "
                        f"default: ${API_KEY_ENVS[0]}, else ${API_KEY_ENVS[1]})")
    v.add_argument("--max-model-len", type=models.positive_int, default=None, metavar="N",
                   help="the longest context served, prompt + output (default: the model's, or what one request "
                        "can hold in the KV pool)")
    v.add_argument("--gpu-memory-utilization", type=float, dest="kv_cache_memory", default=argparse.SUPPRESS,
                   metavar="FRACTION", help="= --kv-cache-memory")
    v.add_argument("--max-num-seqs", type=models.positive_int, dest="max_concurrent", default=argparse.SUPPRESS,
                   metavar="N", help="= --max-concurrent")
    v.add_argument("--enforce-eager", action="store_true",
                   help="= --cuda-graphs off --compile off (eager forwards)")
    v.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, dest="vllm_prefix_caching",
                   default=None, help="--no-enable-prefix-caching = --no-prefix-caching (default: on)")
    v.add_argument("--tensor-parallel-size", "-tp", type=models.positive_int, default=1, metavar="N",
                   help="devices one replica's target spans: 1 (tensor parallelism is not built yet)")
    v.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculation settings as specmesh's default proposer: {\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": K} = --proposer prompt_lookup with a K-token chain; "
                        "\"draft_model\" (with \"model\": DIR) = --proposer draft_model --draft DIR; any specmesh "
                        "proposer's name (fused, copy, ...) with optional max_nodes / max_depth")
    v.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice \"auto\" (the default when a chat request has tools): the model's output "
                        "is read for calls by --tool-call-parser; without it \"auto\" is a 400, \"required\" and "
                        "named functions work anyway (constrained to the functions' schemas)")
    v.add_argument("--tool-call-parser", default=None, choices=PARSERS,
                   help=f"how \"auto\" reads calls: hermes (<tool_call>{{...}}</tool_call>, also what a template "
                        f"without tools is taught), llama3_json (default: {DEFAULT_PARSER})")
    v.add_argument("--trust-remote-code", action="store_true",
                   help="accepted, no effect: specmesh runs no model code from the hub")


def apply_vllm_arguments(args: argparse.Namespace) -> None:
    """Translate the vLLM flags of a parsed `serve` namespace into specmesh's own options, in place (module doc);
    SystemExit with one line for what is refused."""
    def refuse(message: str) -> None:
        raise SystemExit(f"specmesh serve: {message}")

    if args.served_model_name and args.model_name:
        refuse("give the model's name as --model-name or as --served-model-name, not both")
    if args.tensor_parallel_size != 1:
        refuse(f"--tensor-parallel-size {args.tensor_parallel_size}: tensor parallelism is not built yet; a replica "
               "runs its target on one device (scale out with more verifier replicas: `specmesh verifier`, deploy/)")
    args.tool_parser = (args.tool_call_parser or DEFAULT_PARSER) if args.enable_auto_tool_choice else None
    try:
        models.check_dtype_name(getattr(args, "dtype", None))
    except ValueError as exc:
        refuse(str(exc))
    if args.trust_remote_code:
        log.info("--trust-remote-code has no effect: specmesh runs no model code from the hub")
    if args.enforce_eager:
        args.cuda_graphs, args.compile_layers = "off", "off"
    if args.vllm_prefix_caching is not None:
        args.prefix_caching = args.vllm_prefix_caching
    keys = args.api_key or [k for k in (os.environ.get(name) for name in API_KEY_ENVS) if k][:1]
    if any(not k or any(c.isspace() for c in k) for k in keys):
        refuse("an API key must be non-empty and hold no whitespace")
    args.api_keys = tuple(keys)
    args.speculative = None
    if args.speculative_config is not None:
        try:
            spec = parse_speculative_config(args.speculative_config)
        except ValueError as exc:
            refuse(f"--speculative-config: {exc}")
        args.proposer, args.speculative = spec.proposer, spec
        if spec.draft is not None:
            if args.draft is not None and Path(args.draft) != Path(spec.draft):
                refuse("--speculative-config names a draft model and --draft another one")
            args.draft = Path(spec.draft)


def served_names(args: argparse.Namespace, default: str) -> tuple[str, ...]:
    """The model's names in the HTTP API, the first its id (``--served-model-name``, else ``--model-name``, else
    MODEL as given on the command line, as vLLM names it, else ``default``)."""
    if args.served_model_name:
        return tuple(dict.fromkeys(args.served_model_name))
    if args.model_name:
        return (args.model_name,)
    model = getattr(args, "model", None)
    if model is None or models.served_name(model) == "demo":  # (the bundled demo target is `demo` however named)
        return (default,)
    return (str(model),)


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """vLLM's ``--speculative-config`` JSON as specmesh's default proposer; ValueError saying what is wrong, or
    what to use instead of a method specmesh lacks."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(config, dict):
        raise ValueError("expected a JSON object, e.g. {\"method\": \"ngram\", \"num_speculative_tokens\": 4}")
    unknown = sorted(set(config) - SPECULATIVE_KEYS)
    if unknown:
        raise ValueError(f"unknown keys {', '.join(unknown)}; known: {', '.join(sorted(SPECULATIVE_KEYS))}")
    method = config.get("method") or ("draft_model" if config.get("model") else None)
    if method is None:
        raise ValueError("give a \"method\" (ngram, draft_model, or a specmesh proposer's name)")
    if method in NOT_BUILT_METHODS:
        raise ValueError(f"method {method!r}: {NOT_BUILT_METHODS[method]}")
    proposer = SPECULATIVE_METHODS.get(method, method)
    if proposer not in proposer_names():
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(SPECULATIVE_METHODS)}, or a specmesh "
                         f"proposer: {', '.join(proposer_names())}")
    if proposer_spec(proposer).lossy:
        raise ValueError(f"{proposer} is lossy: it cannot be the default proposer (requests ask for it by name)")
    for key in ("num_speculative_tokens", "max_nodes", "max_depth", "draft_tensor_parallel_size"):
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
    if config.get("draft_tensor_parallel_size") not in (None, 1):
        raise ValueError("draft_tensor_parallel_size: a drafter runs on one device")
    if config.get("model") is not None and not proposer_spec(proposer).needs_draft_model:
        raise ValueError(f"\"model\" names a draft model, which {proposer} does not use")
    if "prompt_lookup_max" in config or "prompt_lookup_min" in config:
        log.info("--speculative-config: prompt_lookup_min/max have no effect: prompt_lookup matches the longest "
                 "suffix of the context it finds earlier in it")
    tokens = config.get("num_speculative_tokens")
    max_depth = config.get("max_depth", tokens)
    max_nodes = config.get("max_nodes", tokens)  # a chain of K tokens: K nodes, depth K
    return SpeculativeConfig(proposer, max_nodes, max_depth, config.get("model"))
