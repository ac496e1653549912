"""Lookahead decoding's n-gram pool and verification branch, as a proposer.

Lookahead decoding (Fu et al., 2024) runs two branches in every target forward: the lookahead
branch, a 2-D window of Jacobi iterations (N - 1 levels x W columns) whose columns yield n-grams,
and the verification branch, up to G pool n-grams that start with the newest committed token.
Here the lookahead branch runs in the verifier (``verifier_service/lookahead.py``: it needs the
target's forward) and reports its n-grams as feedback; this proposer keeps the pool and drafts
the verification branch:

- pool: per session, the key token -> up to G continuations of N - 1 tokens, least recently
  seen dropped first (the paper's GUESS_SET_SIZE with its LRU rule). It learns every harvested
  n-gram (key = its first token), the prompt's n-grams (``from_prompt``; the paper's
  POOL_FROM_PROMPT) and the n-grams of the committed output (as the paper adds generated text);
- proposal: the G continuations of the context's last token, most recently seen first, merged
  into one prefix-sharing tree within the budget. One verification forward checks all of them,
  so a match of any commits up to N - 1 tokens plus the bonus.

``feedback_window`` = (W, N) asks the host to run the verifier's window with those sizes (the
embedded stack does, unless ``--lookahead`` says otherwise; a verifier server runs the window its
``--lookahead`` configures). Without any window the pool still learns from the prompt and the
output, i.e. it degrades to an n-gram prompt lookup keyed on one token.

Trees are deterministic (point masses), so sampling stays lossless; the window uses the target's
argmax only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from drafter_service.proposer import DraftSessionState, Proposer, proposer_options
from drafter_service.tree_builders import TreeBuilder
from specmesh.contract import Budget
from specmesh.feedback import DraftFeedback
from specmesh.tree import TokenTree

# Defaults measured on the stdlib pair (docs/PERFORMANCE.md, "Jacobi, lookahead, CLLM, MJSD";
# benchmarks/results/{functions,continuation}_issue14.md)
DEFAULT_WINDOW = 2
DEFAULT_NGRAM = 4
DEFAULT_GUESSES = 4


@dataclass
class NGramPool:
    """key token -> its continuations (tuples of N - 1 tokens), most recently seen last; at most ``guesses`` each."""

    guesses: int
    entries: dict[int, OrderedDict[tuple[int, ...], None]] = field(default_factory=dict)

    def add(self, gram: Sequence[int]) -> None:
        """Learn an n-gram: its first token is the key, the rest the continuation (refreshed if known)."""
        if len(gram) < 2:
            return
        bucket = self.entries.setdefault(int(gram[0]), OrderedDict())
        cont = tuple(int(t) for t in gram[1:])
        bucket.pop(cont, None)
        bucket[cont] = None
        while len(bucket) > self.guesses:
            bucket.popitem(last=False)

    def add_text(self, tokens: Sequence[int], ngram: int, start: int = 0) -> None:
        """Learn the n-grams of ``tokens`` that start at ``start`` or later, in order."""
        for i in range(start, len(tokens) - ngram + 1):
            self.add(tokens[i : i + ngram])

    def continuations(self, key: int) -> list[tuple[int, ...]]:
        """The key's continuations, most recently seen first."""
        return list(reversed(self.entries.get(int(key), ())))


@dataclass
class PoolSession:
    pool: NGramPool
    learned_upto: int  # committed text before this position has had its n-grams learned


def pool_tree(continuations: Sequence[tuple[int, ...]], budget: Budget, source: str) -> TokenTree:
    """Merge continuations (best first) into one prefix-sharing tree within the budget."""
    builder = TreeBuilder()
    for cont in continuations:
        if len(builder) >= budget.max_nodes:
            break
        builder.add_path(cont[: budget.max_depth], source, max_nodes=budget.max_nodes)
    return builder.build()


@dataclass
class LookaheadProposer(Proposer):
    window: int = DEFAULT_WINDOW  # W: columns of the verifier's window; 0 = none (the pool learns prompt and output)
    ngram: int = DEFAULT_NGRAM  # N: n-gram length (the window has N - 1 levels)
    guesses: int = DEFAULT_GUESSES  # G: continuations kept per key and verified per step
    from_prompt: bool = True  # seed the pool with the prompt's n-grams
    name: str = "lookahead"

    def __post_init__(self) -> None:
        for label, value, low in (("window", self.window, 0), ("ngram", self.ngram, 2), ("guesses", self.guesses, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"lookahead {label} must be an integer >= {low}, got {value!r}")

    @property
    def feedback_min_ngram(self) -> int:
        return 2 if self.window else 0  # learns harvested n-grams of any length

    @property
    def feedback_window(self) -> tuple[int, int] | None:
        return (self.window, self.ngram) if self.window else None

    def prepare(self, state: DraftSessionState) -> None:
        pool = NGramPool(self.guesses)
        if self.from_prompt:
            pool.add_text(state.tokens, self.ngram)
        state.scratch[self.name] = PoolSession(pool, len(state.tokens))

    def observe(self, state: DraftSessionState, feedback: DraftFeedback) -> None:
        session: PoolSession = self.scratch(state)
        for verified in feedback.verified:
            for gram in verified.ngrams:
                session.pool.add(gram)
        committed = state.committed_len
        if committed > session.learned_upto:  # n-grams that end in newly committed text
            start = max(0, session.learned_upto - self.ngram + 1)
            session.pool.add_text(state.tokens[:committed], self.ngram, start)
            session.learned_upto = committed

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        if budget.is_zero or not state.tokens:
            return TokenTree.empty()
        session: PoolSession = self.scratch(state)
        found = session.pool.continuations(state.tokens[-1])[: self.guesses]
        return pool_tree(found, budget, self.name)

    def release(self, state: DraftSessionState) -> None:
        state.scratch.pop(self.name, None)


def lookahead_proposer(**given) -> LookaheadProposer:
    """Options: ``window`` (W), ``ngram`` (N), ``guesses`` (G), ``from_prompt`` (0/1)."""
    options = proposer_options(given, ("window", "ngram", "guesses", "from_prompt"), "lookahead")
    typed = {k: int(v) for k, v in options.items() if k != "from_prompt"}
    if "from_prompt" in options:
        typed["from_prompt"] = str(options["from_prompt"]).lower() not in ("0", "false", "no", "off")
    return LookaheadProposer(**typed)
