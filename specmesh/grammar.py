"""Structured output: a request's grammar (JSON Schema, JSON object, regex, Lark) as a token mask, with llguidance.

A request names its grammar in ``SamplingParams.grammar`` as ``(kind, spec)`` (``GRAMMAR_KINDS``). The verifier
holds a ``GrammarState`` per session, advanced by every committed token, and constrains the target's distribution:
at every verified row the tokens the grammar does not allow after that row's context get probability zero
(``tree_masks``: the matcher is rolled forward along each tree path and back). Output is then exactly the target's
constrained output, greedy or sampled. Draft nodes the grammar rules out are pruned before the forward where that
is exact (``prunable``). The grammar is also a proposer (drafter_service/grammar_proposer.py): where it allows
only one continuation, those tokens are drafted for free.

Grammars are compiled on worker threads before admission (``GrammarCompiler``), within the budgets of
specmesh/grammar_limits.py, the outcomes cached by spec: no step waits on a compile, and a grammar over a budget is
refused naming it (``GrammarLimitError``).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from specmesh.grammar_limits import GrammarLimits
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


class GrammarLimitError(GrammarError):
    """A grammar over one of the server's budgets (``GrammarLimits``); its text names the option."""


class CompiledGrammar:
    """A grammar compiled against the tokenizer with its first mask computed (the lexer's first states: most of
    a compile's cost); every session starts from a copy of it."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher
        self._lock = threading.Lock()  # copies are taken from any thread

    def matcher(self):
        with self._lock:
            return self._matcher.deep_copy()


class GrammarTokenizer:
    """The model's tokenizer as llguidance reads it (token bytes, end-of-sequence ids), and its grammars compiled
    under ``limits`` (``GrammarCompiler``: on worker threads, cached by spec)."""

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, eos_token_ids: Sequence[int],
                 limits: GrammarLimits | None = None) -> None:
        self.tokenizer_json, self.vocab_size = Path(tokenizer_json), vocab_size
        self._eos = [int(t) for t in eos_token_ids if 0 <= int(t) < vocab_size]
        self.limits = limits or GrammarLimits()
        self.compiler = GrammarCompiler(self)

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
    def for_model(model_dir: str | Path | None, vocab_size: int, eos_token_ids: Sequence[int],
                  limits: GrammarLimits | None = None) -> GrammarTokenizer | None:
        """The model directory's ``tokenizer.json``, or None when it has none (structured output is then refused)."""
        if model_dir is None or not (Path(model_dir) / "tokenizer.json").is_file():
            return None
        return GrammarTokenizer(Path(model_dir) / "tokenizer.json", vocab_size, eos_token_ids, limits)

    def compile(self, kind: str, spec: str) -> CompiledGrammar:
        """The grammar compiled (cached; else on a worker, waited for at most the compile timeout); GrammarError
        when it does not compile, GrammarLimitError when it is over a budget."""
        return self.compiler.compile(kind, spec)

    def check(self, kind: str, spec: str) -> None:
        """GrammarError unless the grammar compiles within the budgets."""
        self.compile(kind, spec)

    def state(self, kind: str, spec: str, compiled: CompiledGrammar | None = None) -> GrammarState:
        """A session's grammar at its start: a copy of ``compiled`` (None: ``compile``'s)."""
        compiled = compiled or self.compile(kind, spec)
        return GrammarState(compiled.matcher(), self.vocab_size, self.eos_token_ids)

    def ready_state(self, kind: str, spec: str) -> GrammarState | None:
        """``state`` once the grammar is compiled, without waiting: None while it compiles (the compile is started)
        or when it was refused (a proposer drafts without it meanwhile)."""
        compiled = self.compiler.ready(kind, spec)
        return None if compiled is None else self.state(kind, spec, compiled)


class GrammarCompiler:
    """Grammars compiled on worker threads (llguidance drops the interpreter lock while it builds a matcher and
    computes a mask), so no step loop or event loop waits on one, under the budgets of ``GrammarLimits``; the
    outcomes (compiled grammars and refusals) cached by spec, least recently used dropped past
    ``cache_entries``, a spec being compiled shared by every request that asks for it."""

    def __init__(self, tokenizer: GrammarTokenizer) -> None:
        self.tokenizer, self.limits = tokenizer, tokenizer.limits
        self.num_compiles = 0  # compiles started (a cache hit starts none)
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None  # started by the first grammar

    def submit(self, kind: str, spec: str) -> Future:
        """The compile of ``(kind, spec)``: the cached one, or a new one queued on the workers."""
        key = (kind, spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(key)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.limits.workers, thread_name_prefix="grammar-compile")
            future = self._cache[key] = self._pool.submit(self._compile, kind, spec)
            self.num_compiles += 1
            done = [k for k, f in self._cache.items() if f.done()]  # in-flight ones stay: callers wait on them
            for k in done[: max(0, len(self._cache) - self.limits.cache_entries)]:
                del self._cache[k]
        return future

    def ready(self, kind: str, spec: str) -> CompiledGrammar | None:
        """The compiled grammar if its compile is done and succeeded, else None (started if it was not)."""
        future = self.submit(kind, spec)
        if not future.done() or future.cancelled() or future.exception() is not None:
            return None
        return future.result()

    def compile(self, kind: str, spec: str) -> CompiledGrammar:
        future = self.submit(kind, spec)
        try:
            return future.result(timeout=self.limits.compile_timeout)
        except (TimeoutError, CancelledError):
            future.cancel()  # still queued (behind other compiles): dropped
            raise GrammarLimitError(self._over_time(kind)) from None
        except GrammarError:
            raise
        except BaseException:  # not the grammar's fault (llguidance missing): not kept
            with self._lock:
                if self._cache.get((kind, spec)) is future:
                    del self._cache[kind, spec]
            raise

    def _over_time(self, kind: str) -> str:
        return (f"the {kind} grammar took longer to compile than this server's budget "
                f"(--grammar-compile-timeout {self.limits.compile_timeout:g} s)")

    def _compile(self, kind: str, spec: str) -> CompiledGrammar:
        """On a worker: the matcher, its first mask, and one step past it (a blow-up in the lexer's first
        derivatives, as counted repetitions make, shows there); GrammarError naming what failed."""
        from llguidance import LLMatcher, LLParserLimits

        start = time.perf_counter()
        source = grammar_source(kind, spec)
        tokenizer = self.tokenizer.tokenizer
        limits = LLParserLimits(initial_lexer_fuel=self.limits.lexer_fuel, verbose_errors=False)
        error = LLMatcher.validate_grammar(source, tokenizer, limits=limits)
        if error and not error.startswith("WARNING"):
            raise self._error(kind, error)
        matcher = LLMatcher(tokenizer, source, log_level=GRAMMAR_LOG_LEVEL, limits=limits)
        if not matcher.is_error():
            allowed = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed[list(self.tokenizer.eos_token_ids)] = 0
            first = np.flatnonzero(allowed[: self.tokenizer.vocab_size])
            if first.size:
                probe = matcher.deep_copy()
                if probe.consume_token(int(first[0])):
                    probe.compute_bitmask()
                if probe.is_error():
                    raise self._error(kind, probe.get_error())
        if matcher.is_error():
            raise self._error(kind, matcher.get_error())
        if time.perf_counter() - start > self.limits.compile_timeout:  # kept as a refusal: not compiled again
            raise GrammarLimitError(self._over_time(kind))
        return CompiledGrammar(matcher)

    def _error(self, kind: str, error: str) -> GrammarError:
        error = error.strip().splitlines()[0] if error.strip() else "unknown error"  # not the parser's state
        if any(text in error for text in LIMIT_ERRORS):
            return GrammarLimitError(f"the {kind} grammar is over this server's budget (--grammar-lexer-fuel "
                                     f"{self.limits.lexer_fuel}): {error}")
        return GrammarError(f"invalid {kind} grammar: {error}")


# llguidance's texts for a grammar past its limits (the lexer's fuel and states, the grammar's size)
LIMIT_ERRORS = ("too many expressions", "too many states", "fuel", "max_lexer_states", "grammar size",
                "max_grammar_size", "limit")


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
