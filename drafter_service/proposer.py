"""The Proposer base class, per-session drafter state and the proposer registry.

A proposer turns a session's committed tokens into a candidate TokenTree within a
budget. Proposers keep any per-session state (a draft model's KV cache, ...) in
``DraftSessionState.scratch`` under their own name, so one proposer object serves
every session and the drafter shell owns session lifetimes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specmesh.contract import Budget
from specmesh.feedback import DraftFeedback
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree

if TYPE_CHECKING:
    import torch

DRAFT_SEED_OFFSET = 0x5DEECE66D  # a seeded request's draft randomness is independent of the verifier's


@dataclass
class DraftSessionState:
    session_id: str
    tokens: list[int]  # every committed token: prompt + generated
    sampling: SamplingParams
    scratch: dict[str, Any] = field(default_factory=dict)  # per-proposer state
    # tokens[:committed_len] are committed (the rest a hypothesis drafted ahead on), as last told by
    # the orchestrator; 0 = never told
    committed_len: int = 0
    prompt_len: int = -1  # tokens[:prompt_len] are the prompt (-1: all the tokens it was opened with)
    _generator: torch.Generator | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            self.prompt_len = len(self.tokens)

    def processed(self, logits: torch.Tensor, drafted: Sequence[int] = ()) -> torch.Tensor:
        """Draft logits [..., vocab] under the request's logit processors (penalties, logit_bias), as the verifier
        applies them to the target's: context = the output so far + ``drafted`` (the path the rows follow), so the
        draft proposes what the processed target would. Unchanged without processors."""
        from specmesh.logits_process import process_in_context

        return process_in_context(logits, self.sampling, self.tokens[: self.prompt_len],
                                  [*self.tokens[self.prompt_len :], *drafted])

    @property
    def generator(self) -> torch.Generator | None:
        """The session's draft randomness when sampling (None for greedy), made on first use, so
        proposers that draw nothing never load torch: seeded from the request's seed (offset, so it is
        independent of the verifier's), else from fresh entropy without touching torch's global RNG."""
        if self.sampling.greedy:
            return None
        if self._generator is None:
            import torch

            generator = torch.Generator()
            if self.sampling.seed is not None:
                generator.manual_seed(self.sampling.seed + DRAFT_SEED_OFFSET)
            else:
                generator.seed()
            self._generator = generator
        return self._generator


class Proposer:
    """Base of every proposer. ``propose`` is required; the hooks do nothing unless overridden.

    One proposer object serves every session of a drafter; per-session state lives in
    ``DraftSessionState.scratch`` under the proposer's name. Capabilities are plain attributes:
    ``feedback_topk`` (top-k rows it wants the verifier to report after every verified row,
    e.g. Token Recycling), ``feedback_min_ngram`` (the shortest Jacobi n-gram it learns from;
    0 = none, so no verifier window runs for it) and ``feedback_window`` ((W, N): the verifier window
    it wants when the host has none configured; None = the host's choice)."""

    name: str = "proposer"
    feedback_topk: int = 0
    feedback_min_ngram: int = 0
    feedback_window: tuple[int, int] | None = None
    feedback_features: bool = False  # wants the target's final-layer features (DraftFeedback.features): Falcon

    def prepare(self, state: DraftSessionState) -> None:
        """Run when a session opens (a draft model prefills the prompt here, so the first step does
        not pay for it and the prefill can overlap the verifier's)."""

    def observe(self, state: DraftSessionState, feedback: DraftFeedback) -> None:
        """Run before ``propose`` when the orchestrator sends feedback: the verifications since the last
        call (target top-k rows, Jacobi n-grams) and how much of the context is committed."""

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        """A candidate tree for ``state.tokens`` within ``budget``."""
        raise NotImplementedError

    def propose_batch(self, states: Sequence[DraftSessionState], budgets: Sequence[Budget]) -> list[TokenTree]:
        """``propose`` for many sessions at once (an engine step's): the same trees as one call each. A proposer
        whose work batches (a draft model: one forward per level for every session) overrides it."""
        return [self.propose(state, budget) for state, budget in zip(states, budgets, strict=True)]

    def scratch(self, state: DraftSessionState) -> Any:
        """This proposer's per-session state, made by ``prepare`` first if the session has none yet."""
        if self.name not in state.scratch:
            self.prepare(state)
        return state.scratch[self.name]

    def release(self, state: DraftSessionState) -> None:
        """Run at close; the orchestrator syncs the context to exactly the committed tokens first, so a
        proposer may learn from ``state.tokens`` here."""


# ------------------------------------------------------------------ registry
ProposerFactory = Callable[..., Proposer]


@dataclass(frozen=True)
class ProposerSpec:
    """What the registry knows of a proposer before one is built: enough for an orchestrator to check a
    request and choose its budget without loading the proposer's module (or a model stack)."""

    name: str
    factory: str | ProposerFactory  # "module:function", imported on first use, or the function itself
    max_nodes: int  # default budget: nodes per tree ...
    max_depth: int  # ... and depth (tuned with `specmesh bench` on the stdlib-code pair)
    needs_draft_model: bool = False
    help: str = ""  # one line for --help
    # how the verifier accepts this proposer's trees (specmesh.sampling.ACCEPTANCES): "exact" (lossless), or
    # "mjsd" (LOSSY: the orchestrator turns it on for requests that ask for this proposer, and only for them)
    acceptance: str = "exact"
    # needs the target model in its own process (shares its embedding and LM head, reads its features): embedded,
    # or a drafter server started with ``--target`` (its shared tables); a drafter server without one refuses it
    needs_target: bool = False
    # drafts well only with a trained head given as an option (``head=DIR``; without one, an untrained head: tests
    # only): a benchmark's default methods leave it out
    needs_head: bool = False

    @property
    def lossy(self) -> bool:
        return self.acceptance != "exact"

    @property
    def default_budget(self) -> tuple[int, int]:
        return self.max_nodes, self.max_depth

    def build(self, **resources: Any) -> Proposer:
        factory = self.factory
        if isinstance(factory, str):
            module, _, attr = factory.partition(":")
            factory = getattr(importlib.import_module(module), attr)
        return factory(**resources)


# A new proposer is one module with a factory plus one line here.
_REGISTRY: dict[str, ProposerSpec] = {spec.name: spec for spec in (
    ProposerSpec("draft_model", "drafter_service.draft_model:chain_proposer", 3, 3, needs_draft_model=True,
                 help="a chain from the draft model"),
    ProposerSpec("draft_model_tree", "drafter_service.draft_model:tree_proposer", 8, 4, needs_draft_model=True,
                 help="a dynamic tree from the draft model (EAGLE-2 style)"),
    ProposerSpec("prompt_lookup", "drafter_service.prompt_lookup:chain_proposer", 8, 8,
                 help="the continuation of the context's suffix earlier in the context (a chain)"),
    ProposerSpec("prompt_lookup_tree", "drafter_service.prompt_lookup:tree_proposer", 16, 10,
                 help="several such continuations, merged into a tree"),
    ProposerSpec("copy", "drafter_service.copy_proposer:copy_proposer", 16, 10,
                 help="CopySpec: the longest repeated match anywhere in the context, several as a tree"),
    ProposerSpec("suffix", "drafter_service.suffix:suffix_proposer", 32, 24,
                 help="SuffixDecoding: the most frequent continuations of the context's longest match in counted "
                      "suffix tries of this request and of earlier outputs, deeper the longer the match"),
    ProposerSpec("retrieval", "drafter_service.retrieval:retrieval_proposer", 16, 10,
                 help="REST: the most frequent continuations in an n-gram store that learns from every output"),
    ProposerSpec("recycling", "drafter_service.recycling:recycling_proposer", 10, 6,
                 help="Token Recycling: the target's own top-k candidates seen in verification"),
    ProposerSpec("jacobi", "drafter_service.jacobi:jacobi_proposer", 6, 6,
                 help="Jacobi decoding: the target's own predictions for the next positions, one fixed-point "
                      "iteration per verification"),
    ProposerSpec("lookahead", "drafter_service.lookahead:lookahead_proposer", 12, 3,
                 help="lookahead decoding: n-grams from the verifier's 2-D Jacobi window (W x N-1 levels), "
                      "up to G of them starting with the last token verified as one tree"),
    ProposerSpec("falcon", "drafter_service.falcon:falcon_proposer", 16, 6, needs_target=True, needs_head=True,
                 help="a Falcon semi-autoregressive head (head=DIR, `specmesh train-falcon`) on the target's features: "
                      "k tokens per forward, a custom decoding tree"),
    ProposerSpec("grammar", "drafter_service.grammar_proposer:grammar_proposer", 16, 10,
                 help="structured output: the tokens a request's grammar forces (jump-forward), then=NAME drafting "
                      "on after them (default copy; then=none: the forced tokens alone)"),
    ProposerSpec("fused", "drafter_service.fusion:fused_proposer", 24, 12,
                 help="one tree merged from several proposers (--members), ranked by live acceptance"),
    ProposerSpec("mjsd", "drafter_service.mjsd:mjsd_proposer", 4, 4, needs_draft_model=True, acceptance="mjsd",
                 help="LOSSY (opt-in): MJSD, the draft model's best beam (width 8, length = depth) accepted by "
                      "joint likelihood ratio p/q >= a threshold (--mjsd-threshold); greedy only, and the output "
                      "differs from the target's own"),
)}


# The default of `generate`, `serve` and the drafter server, chosen by measurement (docs/PERFORMANCE.md):
# on the benchmark pair level with the best single proposer on a first request (1.88-1.92x greedy), the
# fastest sampled (1.17-1.19x) and once its store has seen similar requests (2.3-2.5x); on the demo pair
# 1.13x first (copy 1.25x) and 1.78x after; draft_model, the earlier default, ran at 0.55x there.
DEFAULT_PROPOSER = "fused"
DEFAULT_PROPOSER_WHY = ("model-free and the fastest measured overall: ~1.9x plain decoding on the benchmark pair, "
                        "1.2x sampled, 2.3-2.5x once this process has served similar requests")


def register(spec: ProposerSpec) -> ProposerSpec:
    """Add a proposer to the registry (or replace the one of that name)."""
    _REGISTRY[spec.name] = spec
    return spec


def proposer_names() -> list[str]:
    return sorted(_REGISTRY)


def proposer_spec(name: str) -> ProposerSpec:
    """The registered proposer ``name``; ValueError naming the choices otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown proposer {name!r}; choose from {', '.join(proposer_names())}") from None


# what hosts (the embedded stack, the drafter server) offer every proposer factory
RESOURCES = frozenset({"draft_runner", "target_runner", "store", "store_spec", "store_namespace", "grammar_tokenizer"})


def proposer_options(given: dict[str, Any], allowed: tuple[str, ...], name: str) -> dict[str, Any]:
    """A factory's own options among ``given`` (the host's resources dropped); ValueError on unknown ones."""
    options = {k: v for k, v in given.items() if k not in RESOURCES}
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{name} has no option {', '.join(unknown)}; its options: {', '.join(allowed) or 'none'}")
    return options


def make_proposer(name: str, **resources: Any) -> Proposer:
    """Build a registered proposer. ``resources``: what the host offers every proposer (``draft_runner``,
    ``store`` or ``store_spec`` and ``store_namespace`` for n-gram stores), plus this proposer's options.
    Factories take the resources they use and ignore the others (``**_resources``)."""
    return proposer_spec(name).build(**resources)
