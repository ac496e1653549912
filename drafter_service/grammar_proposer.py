"""The grammar as a proposer (SGLang's jump-forward, verified): where a request's grammar (``SamplingParams.grammar``)
allows only one continuation (a JSON key, punctuation, closing brackets), those tokens are drafted for free.

The forced tokens come first, as a chain of point masses; with ``then=NAME`` another proposer drafts on from the
end of that chain (its context extended by the forced tokens), so a JSON record's fixed parts and its values are
drafted in one tree. Every token is verified like any other draft, so the output stays exactly the target's
constrained output; a forced token is always accepted when the verifier applies the same grammar. Requests
without a grammar get the ``then`` proposer's tree alone (``copy`` by default; ``then=none``: nothing).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from drafter_service.proposer import DraftSessionState, Proposer, make_proposer, proposer_options
from specmesh.contract import Budget, common_prefix_len
from specmesh.grammar import GrammarState, GrammarTokenizer
from specmesh.tree import TokenTree


@dataclass
class _Matcher:
    state: GrammarState
    consumed: list[int]  # output tokens the matcher has consumed, in order
    broken: bool = False  # a token the grammar does not allow: nothing more is forced


@dataclass
class GrammarProposer(Proposer):
    tokenizer: GrammarTokenizer | None
    then: Proposer | None = None
    name: str = "grammar"

    def __post_init__(self) -> None:
        if self.then is not None:  # the verifier feedback the inner proposer learns from
            self.feedback_topk = self.then.feedback_topk
            self.feedback_min_ngram = self.then.feedback_min_ngram
            self.feedback_window = self.then.feedback_window
            self.feedback_features = self.then.feedback_features

    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        forced = self._forced(state, min(budget.max_nodes, budget.max_depth))
        rest = None
        if self.then is not None and len(forced) < min(budget.max_nodes, budget.max_depth):
            ahead = dataclasses.replace(state, tokens=state.tokens + forced) if forced else state
            rest = self.then.propose(ahead, dataclasses.replace(
                budget, max_nodes=budget.max_nodes - len(forced), max_depth=budget.max_depth - len(forced)))
        return graft(TokenTree.chain(forced, source=self.name), rest)

    def prepare(self, state: DraftSessionState) -> None:
        if self.then is not None:
            self.then.prepare(state)

    def observe(self, state: DraftSessionState, feedback) -> None:
        if self.then is not None:
            self.then.observe(state, feedback)

    def release(self, state: DraftSessionState) -> None:
        state.scratch.pop(self.name, None)
        if self.then is not None:
            self.then.release(state)

    def _forced(self, state: DraftSessionState, limit: int) -> list[int]:
        """The tokens the grammar forces after the session's output."""
        grammar = synced_grammar(state, self.tokenizer, self.name) if limit > 0 else None
        return [] if grammar is None else [int(t) for t in grammar.forced(limit)]


def synced_grammar(state: DraftSessionState, tokenizer: GrammarTokenizer | None, slot: str) -> GrammarState | None:
    """The session's grammar after its output so far (the request's ``SamplingParams.grammar``), kept in the
    session's scratch under ``slot`` and synced incrementally (rolled back where a hypothesis drafted ahead on was
    dropped); None without a grammar, a tokenizer, or once the output ended or left the grammar. A caller that
    feeds it drafted tokens rolls them back before returning."""
    if state.sampling.grammar is None or tokenizer is None:
        return None
    matcher = state.scratch.get(slot)
    if matcher is None:  # never waits on a compile (a drafter's model thread serves every session): no help until
        grammar = tokenizer.ready_state(*state.sampling.grammar)  # it is compiled, none if it was refused
        if grammar is None:
            return None
        matcher = state.scratch[slot] = _Matcher(grammar, [])
    output = state.tokens[state.prompt_len :]
    common = common_prefix_len(matcher.consumed, output)
    if common < len(matcher.consumed):  # a hypothesis drafted ahead on was dropped
        matcher.state.rollback(len(matcher.consumed) - common)
        del matcher.consumed[common:]
        matcher.broken = False
    if matcher.broken:
        return None
    for token in output[common:]:
        if int(token) in matcher.state.eos:  # the output ended: nothing to draft
            return None
        if not matcher.state.matcher.consume_token(int(token)):  # the output left the grammar: no more help
            matcher.broken = True
            fresh = tokenizer.ready_state(*state.sampling.grammar)
            if fresh is None:  # dropped from the cache meanwhile: a new matcher next time
                del state.scratch[slot]
            else:
                matcher.state, matcher.consumed = fresh, []
            return None
        matcher.consumed.append(int(token))
    return matcher.state


def allowed_after(grammar: GrammarState, path: list[int]) -> torch.Tensor:
    """[vocab] bool: what the grammar allows after ``path`` (drafted tokens beyond its state; rolled back after)."""
    fed = 0
    for token in path:
        if token in grammar.eos:
            grammar.rollback(fed)
            return grammar.eos_only()
        if not grammar.matcher.consume_token(int(token)):  # cannot happen for tokens drafted under the mask
            grammar.rollback(fed)
            return torch.ones(grammar.vocab_size, dtype=torch.bool)
        fed += 1
    allowed = grammar.allowed()
    grammar.rollback(fed)
    return allowed


def graft(stem: TokenTree, rest: TokenTree | None) -> TokenTree:
    """``rest`` hung below the last node of the chain ``stem`` (its root's children become that node's); draft
    distributions kept (the stem's nodes as point masses when ``rest`` has them)."""
    if rest is None or not rest.num_nodes:
        return stem
    if not stem.num_nodes:
        return rest
    n = stem.num_nodes
    parents = np.concatenate([stem.parents, np.where(rest.parents < 0, n - 1, rest.parents + n)])
    q_cu = q_ids = q_probs = None
    if rest.q_cu is not None:
        q_cu = np.concatenate([np.arange(n + 1), n + rest.q_cu[1:]]).astype(np.int64)
        q_ids = np.concatenate([stem.tokens, rest.q_ids]).astype(np.int64)
        q_probs = np.concatenate([np.ones(n), rest.q_probs])
    sources = (stem.sources or ("",) * n) + (rest.sources or ("",) * rest.num_nodes)
    return TokenTree(np.concatenate([stem.tokens, rest.tokens]), parents.astype(np.int64),
                     np.concatenate([stem.draft_probs, rest.draft_probs]), sources, q_cu, q_ids, q_probs)


DEFAULT_THEN = "copy"  # model-free, and it copies the values a record repeats from the prompt


def grammar_proposer(grammar_tokenizer: GrammarTokenizer | None = None, then: str = DEFAULT_THEN,
                     **resources) -> GrammarProposer:
    """``then``: the proposer that drafts on after the forced tokens (any registered name, or ``none`` for the forced
    tokens alone; default copy)."""
    proposer_options(resources, (), "grammar")  # no options of its own beside ``then``
    inner = None if then in ("none", "") else make_proposer(then, grammar_tokenizer=grammar_tokenizer, **resources)
    return GrammarProposer(grammar_tokenizer, inner)
