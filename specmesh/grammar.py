"""Structured output: a request's grammar (JSON Schema, JSON object, regex, Lark) as a token mask, with llguidance.

A request names its grammar in ``SamplingParams.grammar`` as ``(kind, spec)`` (``GRAMMAR_KINDS``). The verifier
holds a ``GrammarState`` per session, advanced by every committed token, and constrains the target's distribution:
at every verified row the tokens the grammar does not allow after that row's context get probability zero
(``tree_masks``: the matcher is rolled forward along each tree path and back). Output is then exactly the target's
constrained output, greedy or sampled. Draft nodes the grammar rules out are pruned before the forward where that
is exact (``prunable``). The grammar is also a proposer (drafter_service/grammar_proposer.py): where it allows
only one continuation, those tokens are drafted for free.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
import torch

from specmesh.sampling import GRAMMAR_KINDS
from specmesh.tree import TokenTree

GRAMMAR_LOG_LEVEL = 0  # llguidance's own logging: off (a grammar error reaches the caller as a GrammarError)
# JSON as json.dumps writes it: ", " and ": " between items, no other whitespace. With flexible whitespace a model
# may pad forever (newlines inside an object are valid JSON), and the fixed layout lets the grammar force more
# tokens (keys with their separators)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that does not compile (a request error: 400 / INVALID_ARGUMENT)."""


def grammar_source(kind: str, spec: str) -> str:
    """The llguidance grammar of a request's ``(kind, spec)``; GrammarError for a malformed spec."""
    from llguidance import LLMatcher

    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {kind!r}")
    try:
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_LAYOUT)
        if kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(json.loads(spec), overrides=JSON_LAYOUT)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec)
        return LLMatcher.grammar_from_lark(spec)
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise GrammarError(f"invalid {kind} grammar: {exc}") from None


class GrammarTokenizer:
    """The model's tokenizer as llguidance reads it (token bytes, end-of-sequence ids), and compiled grammars by
    their source (a request that repeats a schema does not compile it again)."""

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer_json, self.vocab_size = Path(tokenizer_json), vocab_size
        self._eos = [int(t) for t in eos_token_ids if 0 <= int(t) < vocab_size]

    @cached_property
    def tokenizer(self):
        """llguidance's view of the tokenizer, read on the first structured request (a server that never sees one
        never pays for it)."""
        from llguidance import LLTokenizer

        return LLTokenizer(str(self.tokenizer_json), n_vocab=self.vocab_size, eos_token=self._eos or None)

    @cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.eos_tokens)

    @staticmethod
    def for_model(model_dir: str | Path | None, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarTokenizer | None:
        """The model directory's ``tokenizer.json``, or None when it has none (structured output is then refused)."""
        if model_dir is None or not (Path(model_dir) / "tokenizer.json").is_file():
            return None
        return GrammarTokenizer(Path(model_dir) / "tokenizer.json", vocab_size, eos_token_ids)

    def check(self, kind: str, spec: str) -> str:
        """The grammar's source once it compiles against this tokenizer; GrammarError otherwise."""
        return _checked(self, kind, spec)

    def state(self, kind: str, spec: str) -> GrammarState:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, self.check(kind, spec), log_level=GRAMMAR_LOG_LEVEL)
        if matcher.is_error():
            raise GrammarError(f"invalid {kind} grammar: {matcher.get_error()}")
        return GrammarState(matcher, self.vocab_size, self.eos_token_ids)


@lru_cache(maxsize=256)
def _checked(tokenizer: GrammarTokenizer, kind: str, spec: str) -> str:
    from llguidance import LLMatcher

    source = grammar_source(kind, spec)
    error = LLMatcher.validate_grammar(source, tokenizer.tokenizer)
    if error and not error.startswith("WARNING"):
        raise GrammarError(f"invalid {kind} grammar: {error}")
    return source


class GrammarState:
    """One session's matcher: the grammar after its committed tokens. An end-of-sequence token ends the output and
    is not fed to the matcher (it is allowed where the grammar is complete; rolling back stays exact)."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self._bits = torch.arange(8, dtype=torch.uint8)

    def consume(self, tokens: Sequence[int]) -> bool:
        """Advance by committed tokens; False when one was not allowed (the matcher is then in error)."""
        return all(int(t) in self.eos or self.matcher.consume_token(int(t)) for t in tokens)

    def eos_only(self) -> torch.Tensor:
        """[vocab] bool: the end-of-sequence tokens (what may follow one)."""
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[[t for t in self.eos if t < self.vocab_size]] = True
        return mask

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next (end-of-sequence only once it is complete; nothing once
        in error)."""
        packed = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        return ((packed[:, None] >> self._bits) & 1).flatten()[: self.vocab_size].bool()

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar allows as the only continuation (jump-forward), none in error."""
        if self.matcher.is_error() or self.matcher.is_stopped():
            return []
        return self.matcher.compute_ff_tokens()[:limit]

    @property
    def failed(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


def tree_masks(state: GrammarState, tree: TokenTree) -> tuple[np.ndarray, torch.Tensor]:
    """What the grammar allows at each verified row of ``tree`` (after the committed tokens of ``state``).

    Returns (valid [N] bool: node i's token is allowed after its path, and so is every ancestor's; masks
    [1 + N, vocab] bool: row 0 the tokens allowed after the pending token, row 1 + i after node i's path; a row
    of an invalid node allows everything: it is never read, since acceptance cannot reach it). The matcher walks
    the tree depth first, rolled forward into each valid child and back, and ends where it started."""
    n = tree.num_nodes
    masks = torch.ones(1 + n, state.vocab_size, dtype=torch.bool)
    valid = np.zeros(n, dtype=bool)
    masks[0] = state.allowed()
    children = tree.children  # [n + 1]: index 0 the root's (parent -1), i + 1 node i's
    stack = [(child, 0) for child in reversed(children[0])]  # (node, row of its parent)
    path: list[int] = []  # nodes on the current path: each one token the matcher consumed
    while stack:
        node, parent_row = stack.pop()
        parent = parent_row - 1  # -1: the root
        while path and path[-1] != parent:  # back up to the node's parent
            path.pop()
            state.rollback(1)
        token = int(tree.tokens[node])
        if not masks[parent_row, token]:
            continue
        if token in state.eos:  # the output ends here: nothing is consumed, only the end may follow
            valid[node] = True
            masks[1 + node] = state.eos_only()
            continue  # its descendants stay invalid
        if not state.matcher.consume_token(token):
            continue
        valid[node] = True
        path.append(node)
        masks[1 + node] = state.allowed()
        stack.extend((child, 1 + node) for child in reversed(children[1 + node]))
    state.rollback(len(path))
    return valid, masks


def prunable(tree: TokenTree, greedy: bool) -> bool:
    """Whether dropping the nodes a grammar rules out keeps acceptance exact: always for greedy verification (an
    argmax never picks a masked token), and under sampling when every node is a point mass (a masked point mass is
    rejected without changing the residual); a node drawn from a distribution may not be dropped, since the
    siblings after it were drawn given it."""
    return greedy or not tree.has_draft_dists
