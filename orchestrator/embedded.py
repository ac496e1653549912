"""Embedded mode: drafter, verifier and orchestrator in one process, no servers.

This is the one place where the embedded wiring is chosen; the gRPC and Ray
deployments run their requests on the same engine core, over verifier replicas
(orchestrator/remote_loop.py) and remote drafters. ``CoreEngine``, what ``EmbeddedStack.engine``
returns, is ``stream``/``generate`` of one request over the core (the per-request
``orchestrator.engine.Engine``'s interface; that engine itself runs in no command).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from drafter_service.draft_kv import draft_kv
from drafter_service.drafter import LocalDrafter
from drafter_service.ngram_store import tokenizer_fingerprint
from drafter_service.proposer import make_proposer, proposer_spec
from orchestrator.arguments import resolve_models
from orchestrator.core import EngineCore
from orchestrator.drafter_link import only
from orchestrator.engine import GenerationResult, StepEvent
from orchestrator.policy import DEFAULT_OVERLAP, DEFAULT_POLICY, build_policy, load_aware, resolve_budget
from orchestrator.requests import Method, QueueOutput, RequestOutput
from orchestrator.stats import RequestStats
from specmesh import models
from specmesh.blocks import DEFAULT_BLOCK_SIZE
from specmesh.contract import ModelInfo
from specmesh.grammar import GrammarTokenizer
from specmesh.grammar_limits import GrammarLimits, grammar_limits
from specmesh.host_runtime import freeze_heap
from specmesh.model_runner import ModelRunner
from specmesh.models import load_runner, load_tokenizer
from specmesh.sampling import SamplingParams
from specmesh.text_tokenizer import load_text_tokenizer
from specmesh.tree import MAX_TREE_NODES
from verifier_service.lookahead import LookaheadConfig
from verifier_service.verifier import LocalVerifier, kv_pool_blocks, served_positions

log = logging.getLogger("specmesh.embedded")

MAX_WINDOW_ROWS = 32  # the largest lookahead window ((N - 1) x W rows) a request on the engine core may ask for
MAX_METHOD_ENGINES = 64  # methods whose engines (proposer, drafter, policy) the stack keeps for its engine core


class CoreEngine:
    """``stream``/``generate`` of one request over an EngineCore (the per-request Engine's interface): for callers
    that consume one request on their own thread (``specmesh generate``, bench, tests). Many threads may use one at
    once."""

    def __init__(self, core: EngineCore, method: Method) -> None:
        self.core, self.method = core, method

    def stream(self, prompt: Sequence[int], sampling: SamplingParams,
               result: GenerationResult | None = None, trace=None) -> Iterator[StepEvent]:
        """Yield the request's events; ``result`` is filled in as the stream ends. Closing the iterator early
        cancels the request. ``trace``: the request's span (``tracing.request_span``), each step a child of it."""
        output = QueueOutput()
        request_id = self.core.submit(prompt, sampling, self.method, output, trace=trace)
        done = False
        try:
            for event in output.events():
                if result is not None:
                    result.text_limit = event.text_limit  # known before the event goes out, as the engine's
                yield event
            done = True
        finally:
            if not done:  # closed early: cancel, and wait for the core to end it (at most one step)
                self.core.cancel(request_id)
                for _ in output.events():
                    pass
            if result is not None and output.result is not None:
                result.token_ids, result.finish_reason = output.result.token_ids, output.result.finish_reason
                result.stats, result.text_limit = output.result.stats, output.result.text_limit

    def generate(self, prompt: Sequence[int], sampling: SamplingParams, trace=None) -> GenerationResult:
        result = GenerationResult([], "", RequestStats())
        for event in self.stream(prompt, sampling, result, trace):
            result.events.append(event)
        return result


@dataclass
class EmbeddedStack:
    """Loaded models and tokenizer, shared by every engine built from them."""

    target_runner: ModelRunner
    draft_runner: ModelRunner | None
    tokenizer: object
    store_spec: str | None = None  # n-gram store of store-backed proposers (see drafter_service.ngram_store.open_store)
    lookahead: LookaheadConfig | None = None  # the verifier's Jacobi window (lookahead n-grams); None = off
    kv_cache_gb: float | None = None  # the engine core's KV pool (None: LocalVerifier's default)
    target_dir: Path | None = None  # where the target was loaded from (its tokenizer, chat template, name)
    prefix_caching: bool = True  # the engine core's verifier shares identical prompt prefixes' KV blocks
    # on CUDA without kv_cache_gb: the share of the device's memory the process may use with the core's pool (its
    # only one; None: LocalVerifier's fixed default, for a process that builds other verifiers too, as `bench`)
    kv_cache_memory: float | None = None
    # time a few forwards when the core is made, for the load-aware policy (off: requests keep their budgets, as
    # one request alone does anyway; `generate`)
    profile_costs: bool = True
    grammar_limits: GrammarLimits = GrammarLimits()  # what one request's grammar may cost (specmesh/grammar_limits.py)
    _core: EngineCore | None = None  # the one engine core of the device, created on first use
    _engines: dict = field(default_factory=dict)  # method -> its CoreEngine (engine-wide proposer), LRU order
    _shared_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @cached_property
    def grammar_tokenizer(self) -> GrammarTokenizer | None:
        """The target's tokenizer for structured output (its directory's tokenizer.json; None without one)."""
        info = self.target_runner.info
        return GrammarTokenizer.for_model(self.target_dir, info.vocab_size, info.eos_token_ids, self.grammar_limits)

    @classmethod
    def load(
        cls,
        target: str | Path,
        draft: str | Path | None = None,
        dtype: torch.dtype = torch.float32,
        draft_dtype: torch.dtype | None = None,
        runner: str = "auto",
        attention: str = "auto",
        store_spec: str | None = None,
        lookahead: LookaheadConfig | None = None,
        device: torch.device | str = "cpu",
        kv_cache_gb: float | None = None,
        kv_cache_memory: float | None = None,
        hf_modules: bool = False,
        prefix_caching: bool = True,
        compile_layers: str = "auto",
        cuda_graphs: str = "auto",
        draft_kv_cache_gb: float | None = None,
        grammar_limits: GrammarLimits | None = None,
    ) -> EmbeddedStack:
        """Load the target (and draft) from local directories; ``runner``: auto | fast | hf; ``attention``: the
        fast runner's attention backend (auto | sdpa | triton), ``compile_layers`` its torch.compile and
        ``cuda_graphs`` its CUDA graphs (auto | on | off);
        ``store_spec``: the n-gram store (``open_store``); ``lookahead``: the verifier's Jacobi window;
        ``device``: where both models run; ``kv_cache_gb``: the engine core's KV pool (``prefix_caching``: with
        a prefix cache, LocalVerifier's; ``kv_cache_memory``: on CUDA without ``kv_cache_gb``, sized by the device's
        free memory); ``draft_kv_cache_gb``: the draft model's paged KV pool (``draft_kv``, made
        here, before any verifier's pool); ``grammar_limits``: structured output's budgets; ``hf_modules``: keep
        the transformers modules and tokenizer (``runner.model``: `bench`'s HF peers), else a Llama-family model
        and its tokenizer load without transformers where that is exact (``models.load_runner``)."""
        if draft is not None:  # from the configs, before any weights load
            check_vocab_sizes(config_vocab_size(target), config_vocab_size(draft))
        tokenizer = model_tokenizer(target, "target", hf_modules)
        target_runner = load_runner(target, dtype, runner, device, attention, hf_modules, compile_layers, cuda_graphs)
        draft_runner = None
        if draft is not None:
            draft_runner = load_runner(draft, draft_dtype or dtype, runner, device, attention, hf_modules,
                                       compile_layers, cuda_graphs)
            check_compatible(target_runner, draft_runner, tokenizer, model_tokenizer(draft, "draft", hf_modules))
            draft_kv(draft_runner, draft_kv_cache_gb)
        return cls(target_runner, draft_runner, tokenizer, store_spec, lookahead, kv_cache_gb, Path(target),
                   prefix_caching, kv_cache_memory, grammar_limits=grammar_limits or GrammarLimits())

    @cached_property
    def store_namespace(self) -> str:
        """The n-gram store namespace of this tokenizer (two vocabularies never share n-grams)."""
        return tokenizer_fingerprint(self.tokenizer.get_vocab())

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def engine(
        self,
        proposer: str | None,
        max_nodes: int | None = None,
        max_depth: int | None = None,
        overlap: bool | None = None,
        policy: str | None = None,
        restart_depth: int | None = None,
        fresh: bool = False,
        **proposer_opts,
    ) -> CoreEngine:
        """The engine of a method on the stack's engine core (``orchestrator/core.py``): ``proposer`` (None or
        "none" = plain autoregressive decoding); ``overlap``: PEARL, drafting ahead on the core's drafting thread;
        ``policy``: static | adaptive (None: defaults); ``restart_depth``: with overlap and the static policy, the
        depth of a tree the verifier has to wait for (pre-verify; None = DEFAULT_RESTART_DEPTH). The requests of
        all threads share the core's step loop and its forwards (a ``CoreEngine`` is safe to use from many threads
        at once). A method's engine is made on first use and kept (the ``MAX_METHOD_ENGINES`` most recently used):
        one proposer and one drafter for every request of the method, so the core drafts all of a step's requests
        of it in one ``propose_batch`` (a draft model: one forward per level for all), in `serve` as in `bench
        --concurrency`. Per-request state lives in the drafter's sessions (by request id) and the request's stats;
        what a proposer learns across requests (an n-gram store, token recycling's table) it learns from all of
        them. ``fresh``: a new engine, neither taken from nor kept among them (a benchmark's run: its proposer
        learns nothing from earlier runs; its load-aware policy still pools its steps with the method's).
        Thread-safe (serve builds engines off its event loop). The per-request ``orchestrator.engine.Engine`` is
        not made here: tests build it themselves (``tests/spec_helpers.engine_for``)."""
        proposer = None if proposer in (None, "none", "ar") else proposer
        overlap = DEFAULT_OVERLAP if overlap is None else bool(overlap)
        key = (proposer, max_nodes, max_depth, overlap, policy, restart_depth, repr(sorted(proposer_opts.items())))
        with self._shared_lock:
            engine = None if fresh else self._engines.pop(key, None)
            if engine is None:
                drafter, chosen, topk, lookahead, features = self._speculation(
                    proposer, max_nodes, max_depth, policy, restart_depth, proposer_opts)
                core = self._engine_core()
                chosen = load_aware(chosen, core.costs, drafting_shares_cores=True, pooled=core.method_steps(key))
                method = Method(only(drafter, proposer or ""), chosen, features, overlap=overlap,
                                feedback_topk=topk, lookahead=lookahead)
                engine = CoreEngine(core, method)
            if fresh:
                return engine
            if len(self._engines) >= MAX_METHOD_ENGINES:  # the least recently used (its requests run on)
                del self._engines[next(iter(self._engines))]
            self._engines[key] = engine  # (last: the most recently used)
            return engine

    def _speculation(self, proposer: str | None, max_nodes: int | None, max_depth: int | None, policy: str | None,
                     restart_depth: int | None, proposer_opts: dict):
        """(drafter or None, policy, the verifier's top-k feedback, its lookahead window, features) of a method."""
        drafter, topk, min_ngram, wanted_window, features = None, 0, 0, None, False
        if proposer is not None:
            if proposer_spec(proposer).needs_draft_model and self.draft_runner is None:
                raise ValueError(f"proposer {proposer!r} needs a draft model (--draft DIR)")
            resources = dict(draft_runner=self.draft_runner, target_runner=self.target_runner,
                             store_spec=self.store_spec, store_namespace=self.store_namespace,
                             grammar_tokenizer=self.grammar_tokenizer)
            prop = make_proposer(proposer, **{**resources, **proposer_opts})
            drafter = LocalDrafter(prop)
            topk = prop.feedback_topk  # token recycling: the verifier reports its top-k rows
            min_ngram = prop.feedback_min_ngram  # n-gram learners: shortest useful harvest
            wanted_window = prop.feedback_window  # lookahead: the window it is tuned for
            features = prop.feedback_features  # Falcon heads: the target's features of committed tokens
        nodes, depth = resolve_budget(proposer, max_nodes, max_depth, MAX_TREE_NODES)
        chosen = build_policy(policy or DEFAULT_POLICY, nodes, depth, restart_depth=restart_depth)
        lookahead = self.lookahead  # (N - 1) * W rows a step: only if used
        if lookahead is None and wanted_window is not None:
            lookahead = LookaheadConfig(*wanted_window)
        lookahead = lookahead if drafter is not None and min_ngram else None
        if lookahead is not None and lookahead.ngram < min_ngram:
            raise ValueError(f"--lookahead N must be at least {min_ngram} for {proposer}'s n-gram store "
                             f"(its contexts are at least {min_ngram - 1} tokens), got {lookahead.ngram}")
        return drafter, chosen, topk, lookahead, features

    @property
    def max_window_rows(self) -> int:
        """The largest lookahead window a request on the core may ask for: MAX_WINDOW_ROWS, or the stack's
        ``--lookahead`` window where that is larger (the context served leaves room for it)."""
        return max(MAX_WINDOW_ROWS, self.lookahead.rows if self.lookahead is not None else 0)

    @property
    def core(self) -> EngineCore:
        """The stack's one engine core (one verifier, one KV pool, one step thread), created on first use: every
        engine of the stack submits its requests to it. What requests differ in (proposer, top-k feedback, lookahead
        window, target features, grammar, processors) are per-row options of its batch."""
        with self._shared_lock:
            return self._engine_core()

    def _engine_core(self) -> EngineCore:
        """``core``, under the stack's lock."""
        if self._core is None:
            local = LocalVerifier(self.target_runner, MAX_TREE_NODES, kv_cache_gb=self.kv_cache_gb,
                                  prefix_caching=self.prefix_caching, kv_cache_memory=self.kv_cache_memory,
                                  grammar_tokenizer=self.grammar_tokenizer, max_window_rows=self.max_window_rows)
            self._core = EngineCore(local, self.decode, costs=local.profile_costs() if self.profile_costs else None)
        return self._core

    def served_info(self) -> ModelInfo:
        """The target's ModelInfo with the context the engine core serves (less than the model's when one request
        alone could outgrow the KV pool: ``served_positions``; with room for the largest lookahead window)."""
        info = self.target_runner.info
        if self.kv_cache_memory is not None and self.target_runner.device.type == "cuda":
            return self.core.info  # its pool is sized by the device's free memory: made now, and read
        num_blocks = kv_pool_blocks(self.target_runner, self.kv_cache_gb, DEFAULT_BLOCK_SIZE)
        served = served_positions(info.max_positions, num_blocks, DEFAULT_BLOCK_SIZE, MAX_TREE_NODES,
                                  self.max_window_rows)
        if served < info.max_positions:
            log.warning("serving a context of %d positions, not the model's %d: one request's KV must fit the pool "
                        "(raise --kv-cache-gb for more)", served, info.max_positions)
        return dataclasses.replace(info, max_positions=served)

    def shared_verifiers(self) -> list[EngineCore]:
        """The engine core, once created ([] before)."""
        return [] if self._core is None else [self._core]

    def close(self) -> None:
        """Stop the engine core."""
        with self._shared_lock:
            core, self._core = self._core, None
            self._engines.clear()
        if core is not None:
            core.close()


# ``EmbeddedBackend.warm_up``'s request: a prompt that repeats itself (copying proposers propose, so a tree step
# runs), and the tokens it generates
WARM_UP_TEXT = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a"
WARM_UP_TOKENS = 8


class EmbeddedBackend:
    """`specmesh serve --embedded`: every request runs on the stack's engine core (one thread steps them all, one
    forward per step) through its method's engine-wide proposer in this process (``EmbeddedStack.engine``:
    a method's requests are drafted together; orchestrator.service.Backend; ``submit``: the service consumes the
    request's events on its event loop, no thread per request)."""

    def __init__(self, stack: EmbeddedStack, draft_timeout: float = 1.0) -> None:
        self.stack = stack
        self.info = stack.served_info()
        self.max_tree_nodes = MAX_TREE_NODES
        self.draft_timeout = draft_timeout
        self.model = str(stack.target_dir or "")

    def submit(self, plan, output: RequestOutput, trace=None, deadline: float | None = None,
               tried: set[str] | None = None, decode: Callable[[list[int]], str] | None = None) -> Callable[[], None]:
        """Queue the request on the stack's engine core (its events go to ``output``, on the core thread; ``trace``:
        its span); returns its cancel. ValueError / CapacityError for a request the core cannot take. One
        verifier and drafters in this process: ``deadline`` (the service enforces it), ``tried`` and ``decode``
        (the core decodes with the stack's tokenizer) are not needed here."""
        engine = self._engine(plan)
        request_id = engine.core.submit(plan.prompt, plan.sampling, engine.method, output, trace=trace)
        return lambda: engine.core.cancel(request_id)

    def warm_up(self, proposer: str | None) -> float:
        """Pay now what the server's first request would otherwise pay, before the server says it is ready: the
        engine core (its KV pool and the forward's cost profile), then one short generation with ``proposer``
        (the server's default method; None: plain decoding only) and one with plain decoding (the first prompt
        chunk, plain step and tree step: the tokenizer, the proposer's set-up, torch's first kernels of each).
        Its engines are fresh, over an in-memory store: a shared store and the method's own proposer learn
        nothing from it. Returns its seconds."""
        started = time.perf_counter()
        self.stack.core  # noqa: B018 (built on first use: the pool, and the cost profile the policies read)
        prompt = self.stack.tokenizer.encode(WARM_UP_TEXT)[-self.info.max_positions // 2 :]
        sampling = SamplingParams(max_new_tokens=WARM_UP_TOKENS, ignore_eos=True)
        for name in dict.fromkeys([proposer, None]):  # (one run when the default is plain decoding)
            options = {"store_spec": "memory"} if name is not None else {}
            self.stack.engine(name, fresh=True, **options).generate(prompt, sampling)
        return time.perf_counter() - started

    def _engine(self, plan) -> CoreEngine:
        return self.stack.engine(plan.proposer, plan.max_nodes, plan.max_depth, overlap=plan.overlap,
                                 policy=plan.policy, restart_depth=plan.restart_depth)

    def retryable(self, exc: Exception) -> bool:
        return False  # one verifier: nowhere else to go

    def healthy(self) -> bool:
        return all(v.alive for v in self.stack.shared_verifiers())

    def load(self) -> dict:
        """Requests and KV blocks of the in-process verifiers (the figures of their /metrics)."""
        from verifier_service.metrics import pool_load

        return pool_load(core.scheduler for core in self.stack.shared_verifiers())

    def register_metrics(self, registry, model_name: str) -> None:
        """The shared verifiers' metrics (KV pool, batches) in ``registry``, beside serve's."""
        from verifier_service.metrics import VerifierMetrics

        VerifierMetrics(lambda: [core.scheduler for core in self.stack.shared_verifiers()], registry, model_name=model_name)


class IncompatibleModels(ValueError):
    """The models given cannot work together (or one of them lacks its tokenizer): a user error, told in one line."""


def config_vocab_size(path: str | Path) -> int | None:
    """``vocab_size`` in a model directory's config.json (a multimodal model's text config's); None if it has none."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) else None


def check_vocab_sizes(target: int | None, draft: int | None) -> None:
    """Draft and target must score the same token ids (sizes unknown: checked on the loaded models instead)."""
    if target is not None and draft is not None and target != draft:
        raise IncompatibleModels(f"the draft's vocabulary has {draft} tokens, the target's {target}: a draft model "
                                 "must share the target's tokenizer")


def check_compatible(target: ModelRunner, draft: ModelRunner, target_tok, draft_tok) -> None:
    """Draft and target must speak the same token ids."""
    check_vocab_sizes(target.info.vocab_size, draft.info.vocab_size)
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise IncompatibleModels("draft and target tokenizers differ: a draft model must share the target's "
                                 "tokenizer")


def model_tokenizer(path: str | Path, role: str, hf: bool = False):
    """The tokenizer saved with a model (transformers' own with ``hf``, else without transformers where that
    gives the same ids: ``specmesh.text_tokenizer``); IncompatibleModels saying which model lacks one."""
    try:
        return load_tokenizer(path) if hf else load_text_tokenizer(path)
    except Exception:  # transformers' own message runs to several lines of guesses; tokenizers' is a bare one
        raise IncompatibleModels(f"no tokenizer could be loaded from the {role} model's directory {path} (it needs "
                                 "the tokenizer files saved with the model, e.g. tokenizer.json)") from None


def load_stack(args: argparse.Namespace, hf_modules: bool = False) -> EmbeddedStack:
    """The stack an embedded command's options name (`orchestrator.arguments.add_embedded_arguments`);
    ``hf_modules``: see ``EmbeddedStack.load``."""
    models.set_threads(args.threads)
    target, draft = resolve_models(args)
    try:
        device = models.resolve_device(args.device)
    except ValueError as exc:
        raise SystemExit(f"specmesh {args.command}: {exc}") from None
    try:
        stack = EmbeddedStack.load(
            target, draft, models.torch_dtype(args.dtype, device),
            models.draft_dtype(args.draft_dtype, args.dtype, device), runner=args.runner, attention=args.attention,
            store_spec=getattr(args, "ngram_store", None), lookahead=getattr(args, "lookahead", None), device=device,
            kv_cache_gb=getattr(args, "kv_cache_gb", None), kv_cache_memory=getattr(args, "kv_cache_memory", None),
            hf_modules=hf_modules,
            prefix_caching=getattr(args, "prefix_caching", True), compile_layers=args.compile_layers,
            cuda_graphs=args.cuda_graphs, draft_kv_cache_gb=getattr(args, "draft_kv_cache_gb", None),
            grammar_limits=grammar_limits(args),
        )
    except IncompatibleModels as exc:
        raise SystemExit(f"specmesh {args.command}: {exc}") from None
    freeze_heap()  # the models are loaded: the GC never walks them again (specmesh/host_runtime.py)
    return stack
