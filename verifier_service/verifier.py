"""The in-process Verifier (``specmesh.contract.Verifier``) on a target ModelRunner.

A session's KV cache holds every committed token except the newest one (the
"pending" token: the previous bonus, or the first token after prefill). A verify
step runs one forward over [pending, tree nodes...], accepts a path, keeps the
cache entries of pending + the accepted path, and makes the bonus the new pending
token. Plain autoregressive decoding is the same step with an empty tree.

Feedback (off by default, ``VerifyResult.feedback``), asked per session (``admit``; the constructor's settings
are every session's default, as a replica's flags are): with ``feedback_topk`` = k > 0 the
target's top-k next tokens after every verified row (pending + tree nodes), one
``torch.topk`` per step on the logits the step computes anyway (the largest k asked; each session reads its
first k columns); with ``lookahead`` a Jacobi window
of W guess tokens rides along in the same forward as a branch the tree never sees, and
the n-grams it harvests are reported (``verifier_service/lookahead.py``). Neither changes
what is accepted nor what stays in the KV cache, so sessions with different options share one forward.

Batching: ``step`` runs one forward over the next prompt chunk of any number of prefilling
sessions and the trees of any number of verifying ones (``ModelRunner.forward_batch``:
packed rows, attention per session under its own tree mask), then every decision of the batch
on the device (greedy, sampled and MJSD acceptance, top-k, logprobs: ``verifier_service/decisions.py``)
and one host copy. Every session's KV lives in one paged pool
(``specmesh.kv_pool``): ``admit`` takes the prompt's blocks, a step the blocks its rows write
(``step_blocks`` says how many, before the forward), and compaction gives back a rejected
branch's. When a step cannot get them, its scheduler ``preempt``s a session (every block back;
the session keeps its tokens, sampler and window) and ``resume``s it later: its positions are
computed again as a prefill that yields no token, after which it decodes on exactly as before.
The context served is what one session alone can hold in the pool (``info.max_positions``), so a
request that fits it can always finish. ``prefill`` / ``verify`` are the one-session case; ``StepLoop``
(``verifier_service/step_loop.py``) gathers the calls of many threads into steps and preempts.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specmesh.blocks import DEFAULT_BLOCK_SIZE, blocks_in, default_gib
from specmesh.contract import (
    CapacityError,
    PrefillResult,
    TokenLogprobs,
    UnknownSessionError,
    VerifyCosts,
    VerifyResult,
)
from specmesh.feedback import TargetFeatures, VerifyFeedback
from specmesh.grammar import CompiledGrammar, GrammarState, GrammarTokenizer, prunable, tree_masks
from specmesh.kv_pool import PagedKVCache, compact
from specmesh.logits_process import ContextCounts, processes_logits
from specmesh.model_runner import ModelRunner, TreeMask
from specmesh.row_ops import argmax_last, pack
from specmesh.sampling import SamplingParams
from specmesh.tree import MAX_TREE_NODES, InvalidTreeError, TokenTree, ancestor_mask
from verifier_service.arguments import (
    DEFAULT_KV_CACHE_GB,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_PREFILL_CHUNK,
)
from verifier_service.costs import fit_verify_costs
from verifier_service.decisions import Decisions, HostCopy, Item, packed_runs
from verifier_service.lookahead import (
    LookaheadConfig,
    Window,
    branch_parents,
    harvest,
    initial_window,
    note_successors,
    rows_are_causal,
    shift_window,
    window_inputs,
    window_positions,
    window_span,
)
from verifier_service.verification import Acceptance


def kv_pool_blocks(runner: ModelRunner, kv_cache_gb: float | None, block_size: int,
                   kv_cache_memory: float | None = None, profile_rows: int = DEFAULT_MAX_BATCH_TOKENS) -> int:
    """Blocks that fit in ``kv_cache_gb`` GiB. Without it: on a CUDA device with ``kv_cache_memory`` given (a process
    with one pool: `specmesh verifier`), that share of the device's memory less what is in use and a profiled
    forward of ``profile_rows`` rows needs (``device_kv_bytes``, vLLM's gpu_memory_utilization); otherwise
    DEFAULT_KV_CACHE_GB, capped by ``blocks.default_gib`` (64 sessions at the model's full context)."""
    per_block = runner.kv_bytes_per_token * block_size
    if kv_cache_gb is not None:
        return blocks_in(kv_cache_gb, runner.kv_bytes_per_token, block_size)
    if kv_cache_memory is not None and runner.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(runner.device)
        budget = device_kv_bytes(total, free, forward_peak_bytes(runner, profile_rows), kv_cache_memory)
        if budget < per_block:
            raise ValueError(f"no device memory is left for the KV pool at --kv-cache-memory {kv_cache_memory:g} "
                             f"({free / 2**30:.1f} of {total / 2**30:.1f} GiB free before a forward of "
                             f"{profile_rows} rows): raise it, or give --kv-cache-gb")
        return int(budget // per_block)
    gib = default_gib(DEFAULT_KV_CACHE_GB, runner.info.max_positions, runner.kv_bytes_per_token)
    return blocks_in(gib, runner.kv_bytes_per_token, block_size)


def device_kv_bytes(total: int, free: int, forward_peak: int, fraction: float) -> int:
    """Bytes for the KV pool out of a device of ``total`` bytes with ``free`` free now (the weights, the CUDA
    context and other processes hold the rest), ``forward_peak`` bytes more during the largest forward: what
    leaves ``fraction`` of the device used. Never negative."""
    if not 0 < fraction <= 1:
        raise ValueError(f"--kv-cache-memory must be in (0, 1], got {fraction}")
    return max(0, int(fraction * total) - (total - free) - forward_peak)


def forward_peak_bytes(runner: ModelRunner, rows: int) -> int:
    """The device memory a forward of ``rows`` new rows (one session, every row's logits: a step of that many tree
    rows) takes at its peak beyond what is allocated before it (CUDA; its cache is freed after)."""
    rows = max(1, min(rows, runner.info.max_positions))
    torch.cuda.synchronize(runner.device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(runner.device)
    torch.cuda.reset_peak_memory_stats(runner.device)
    cache = runner.new_cache()
    ids = torch.zeros(rows, dtype=torch.long)
    runner.forward(cache, ids, torch.arange(rows))
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device) - before
    del cache
    torch.cuda.empty_cache()
    return peak


def served_positions(model_positions: int, num_blocks: int, block_size: int, max_tree_nodes: int,
                     window_rows: int = 0) -> int:
    """The context a verifier serves: the model's, or less when one session alone (its tokens, the pending token,
    the largest tree and the lookahead window of a step) could outgrow the pool. ValueError when the pool cannot
    hold one request at all."""
    fits = num_blocks * block_size - 1 - max_tree_nodes - window_rows
    if fits < 2:
        raise ValueError(f"a KV pool of {num_blocks} blocks of {block_size} tokens cannot hold one request with "
                         f"a tree of {max_tree_nodes} nodes; raise --kv-cache-gb")
    return min(model_positions, fits)


log = logging.getLogger(__name__)


@dataclass
class _Session:
    cache: PagedKVCache  # in the verifier's pool; its table is the session's KV blocks
    sampling: SamplingParams
    generator: torch.Generator | None  # a seeded sampled request's own (None: the verifier's shared draws)
    # every token whose KV the cache holds (or will, once computed): the prompt, then each step's pending token and
    # accepted path; what a preempted session computes again when it resumes
    tokens: list[int]
    prefilled: int = 0  # tokens in the cache; < len(tokens) while a prefill (the first, or a resume's) runs
    registered: int = 0  # leading full blocks offered to the prefix cache
    pending: int = -1  # newest committed token, not yet in the cache (-1 until the first prefill is done)
    # lookahead only: the 2-D Jacobi window (N - 1 levels x W columns) and the most recent successor of
    # each committed token (fills)
    window: Window | None = None
    successors: dict[int, int] = field(default_factory=dict)
    lookahead: LookaheadConfig | None = None  # the window's shape (None: no window)
    topk: int = 0  # feedback: the target's top-k after every verified row (0: none)
    # report the target's features (the session asked: a Falcon head drafts for it); then the prompt's, chunk by
    # chunk, until the prefill's result takes them
    features: bool = False
    prompt_features: list[torch.Tensor] = field(default_factory=list)
    # the request's logit processors read these (None without processors): prompt and output tokens, on the device
    context: ContextCounts | None = None
    first_logprobs: TokenLogprobs | None = None  # the first token's (the request asked), until the prefill's result
    # structured output: the grammar after the committed tokens, and the step's masks of its rows ([rows, vocab]
    # bool, on the host; set by _verify_row or for a finishing prefill, read once by step)
    grammar: GrammarState | None = None
    row_masks: torch.Tensor | None = None

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.tokens)


@dataclass(slots=True)
class _Row:
    """One request's part of a batched forward."""

    session: _Session
    start: int  # first packed row
    num_new: int  # rows fed
    prefix_len: int  # cache length before the step
    tree: TokenTree | None = None  # verify: the tree; None for a prefill chunk
    span: int = 0  # verify: Jacobi window columns fed (levels * span rows after the tree rows)
    input_ids: np.ndarray | int | None = None  # [num_new]; an int: plain decoding's one token (row_ops.pack)
    positions: np.ndarray | int | None = None  # [num_new]; an int: that token's position
    attend: TreeMask | None = None  # verify: the rows' tree mask; None = causal
    # verify: logits rows the step needs, [pending, tree nodes..., the window's top level] (1 + nodes + span): a
    # lower level's prediction is never used (its successor in the column is already fed), so its LM head is skipped
    num_out: int = 0
    kept: np.ndarray | None = None  # verify under a grammar: the sent tree's nodes kept (pruned ones dropped)


@dataclass(slots=True)
class StepInFlight:
    """A step ``launch``ed and not ``finish``ed: its rows, what acceptance reads (the staged decisions and copy,
    the handles of the argmax and top-k in it, the features), and the results known already (failed verifies)."""

    start_time: float
    rows: list[_Row]
    verify_rows: list[tuple[int, _Row]]  # (index in the step's verifies, its row)
    results: list  # per verify: its result, or the exception it raised alone (None until ``finish``)
    finishing: list[str] = field(default_factory=list)  # prefills that end with this chunk: their first token
    accepting: list = field(default_factory=list)  # (session, tree, first logits row) of each acceptance
    decisions: Decisions | None = None
    copy: HostCopy | None = None
    argmax_handle: int = -1
    topk_handle: int | None = None
    features: torch.Tensor | None = None  # [feature rows, hidden] of the sessions that asked
    span_start: dict = field(default_factory=dict)  # id(row) -> its first feature row
    queued: float = 0.0  # when its copy was started


NO_GRAMMAR_TOKENIZER = ("structured output needs the target's tokenizer (tokenizer.json in its directory); this "
                        "verifier has none")

class LocalVerifier:
    """Verifier running the target model in this process; one thread drives it (see StepLoop for
    many callers). Its sessions share one paged KV pool, taken step by step (see module doc)."""

    def __init__(
        self,
        runner: ModelRunner,
        max_tree_nodes: int = MAX_TREE_NODES,
        feedback_topk: int = 0,
        lookahead: LookaheadConfig | None = None,
        kv_cache_gb: float | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        features: bool = False,
        prefix_caching: bool = True,
        kv_cache_memory: float | None = None,
        profile_rows: int = DEFAULT_MAX_BATCH_TOKENS,
        grammar_tokenizer: GrammarTokenizer | None = None,
        max_window_rows: int | None = None,
    ) -> None:
        """``features``: report the target's final-layer features of the prompt (``PrefillResult.features``) and
        of every verification's pending + accepted rows (``VerifyResult.features``) for every session, as if each
        had asked (``prefill``/``admit`` ``features=True``); off by default: only the sessions that ask get them,
        and a step with none computes none. ``prefix_caching``: sessions share the KV blocks of identical prompt
        prefixes (``specmesh.blocks``; a session that asks for features computes its whole
        prompt: a Falcon head needs every position's). ``kv_cache_memory``: on CUDA without ``kv_cache_gb``, the
        share of the device's memory the process may use with the pool, after a forward of ``profile_rows`` rows
        (the scheduler's ``max_batch_tokens``) is profiled (``kv_pool_blocks``); None: the fixed default budget (the
        embedded stack, whose pools, one per verifier configuration, must not each take the device).
        ``grammar_tokenizer``: the target's tokenizer for structured output (``SamplingParams.grammar``; without
        one such requests are refused). ``feedback_topk`` and ``lookahead`` are every session's default; a session
        may ask for its own (``admit``), with a window of at most ``max_window_rows`` rows (default: ``lookahead``'s),
        which the context served leaves room for."""
        if feedback_topk < 0:
            raise ValueError(f"feedback_topk must be >= 0, got {feedback_topk}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.runner = runner
        self.info = runner.info
        # whether the forward is queued to run asynchronously to the host (CUDA), or runs in the call (the CPU):
        # where ``step`` calls its ``waiting``
        self.asynchronous = runner.device.type != "cpu"
        # running totals over the steps (benchmarks read them): each step's host work until its one copy (packing,
        # the forward's launches or, on the CPU, the forward itself, the decisions), and its wait in that copy
        # (on a GPU: the device's work still running once the host had queued it all)
        self.queue_seconds = 0.0
        self.copy_seconds = 0.0
        self.max_tree_nodes = max_tree_nodes
        self.feedback_topk = min(feedback_topk, runner.info.vocab_size)
        self.grammar_tokenizer = grammar_tokenizer
        # the draws of every unseeded sampled request: one call per step for all of them (fresh entropy, without
        # touching torch's global RNG); a seeded request has a generator of its own
        self._shared_generator = torch.Generator(device=runner.device)
        self._shared_generator.seed()
        self.lookahead = lookahead
        self.max_window_rows = (lookahead.rows if lookahead is not None else 0) if max_window_rows is None \
            else max(max_window_rows, lookahead.rows if lookahead is not None else 0)
        self.prefill_chunk = prefill_chunk
        self.features = features
        num_blocks = kv_pool_blocks(runner, kv_cache_gb, block_size, kv_cache_memory, profile_rows)
        self.pool = runner.new_pool(num_blocks, block_size)
        runner.pool_graphs(self.pool)  # CUDA graphs for its steps, checked against eager now (cuda_graphs.py)
        self.allocator = self.pool.allocator
        self.prefix_caching = prefix_caching
        # admission leaves this many blocks free, so the running sessions' next steps rarely preempt (vLLM's 1 %)
        self.watermark_blocks = max(1, num_blocks // 100)
        self.model_positions = runner.info.max_positions
        served = served_positions(self.model_positions, num_blocks, block_size, max_tree_nodes,
                                  self.max_window_rows)
        if served < self.model_positions:
            self.info = dataclasses.replace(runner.info, max_positions=served)
        self._sessions: dict[str, _Session] = {}

    # --------------------------------------------------------------- protocol
    def prefill(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams,
                features: bool = False) -> PrefillResult:
        start = time.perf_counter()
        self.admit(session_id, prompt, sampling, features)
        try:
            first = None
            while first is None:
                first = self.step([session_id], ())[0].get(session_id)
        except BaseException:
            self.release(session_id)
            raise
        return PrefillResult(first, time.perf_counter() - start, self.take_prompt_features(session_id),
                             self.take_first_logprobs(session_id))

    def verify(self, session_id: str, tree: TokenTree) -> VerifyResult:
        result = self.verify_batch([(session_id, tree)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def verify_batch(self, requests: Sequence[tuple[str, TokenTree]]) -> list[VerifyResult | Exception]:
        return self.step((), requests)[1]

    def release(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            session.cache.free()

    # ------------------------------------------------------------ scheduling
    def admit(self, session_id: str, prompt: Sequence[int], sampling: SamplingParams, features: bool = False,
              feedback_topk: int | None = None, lookahead: LookaheadConfig | None = None,
              grammar: CompiledGrammar | None = None) -> None:
        """Check the request and take its prompt's KV blocks; the prefill itself runs in ``step``. CapacityError
        when the pool has too few free. ``features``: report the session's target features (see ``__init__``);
        ``feedback_topk``, ``lookahead``: its feedback (None: the verifier's own settings); ``grammar``: its
        grammar compiled (``compile_grammar``, before admission: a step loop never waits on a compile; None: it
        is compiled here)."""
        if session_id in self._sessions:
            raise ValueError(f"session {session_id!r} already exists")
        prompt = list(prompt)
        self.check_request(prompt, sampling)
        compiled = grammar or self.compile_grammar(sampling)
        topk, lookahead = self.session_feedback(feedback_topk, lookahead)
        features = features or self.features
        cache = self._take(prompt, (len(prompt) - 1) // self.allocator.block_size, features)
        generator = None  # an unseeded sampled request draws from the verifier's shared generator
        if not sampling.greedy and sampling.seed is not None:
            generator = torch.Generator(device=self.runner.device).manual_seed(sampling.seed)
        reused = cache.length  # prompt positions found in the prefix cache
        context = grammar = None
        if processes_logits(sampling):
            context = ContextCounts(sampling, prompt, self.info.vocab_size, self.runner.device)
        if compiled is not None:
            grammar = self.grammar_tokenizer.state(*sampling.grammar, compiled=compiled)
        self._sessions[session_id] = _Session(cache, sampling, generator, prompt, reused,
                                              reused // self.allocator.block_size, features=features, context=context,
                                              grammar=grammar, lookahead=lookahead, topk=topk)

    def session_feedback(self, feedback_topk: int | None, lookahead: LookaheadConfig | None
                         ) -> tuple[int, LookaheadConfig | None]:
        """A session's (top-k, window) from what it asks (None: the verifier's settings); ValueError for a window
        larger than the context served leaves room for (``max_window_rows``)."""
        if feedback_topk is None:
            feedback_topk = self.feedback_topk
        elif feedback_topk < 0:
            raise ValueError(f"feedback_topk must be >= 0, got {feedback_topk}")
        lookahead = self.lookahead if lookahead is None else lookahead
        if lookahead is not None and lookahead.rows > self.max_window_rows:
            raise ValueError(f"a lookahead window of {lookahead.rows} rows is larger than this verifier's "
                             f"{self.max_window_rows}")
        return min(feedback_topk, self.info.vocab_size), lookahead

    def preempt(self, session_id: str) -> int:
        """Give back every KV block of a session (prefilling or decoding); returns how many. It keeps its tokens,
        pending token, sampler and lookahead window, and holds nothing until ``resume``."""
        session = self._get(session_id)
        session.prefilled = session.registered = 0
        session.prompt_features = []  # a first prefill cut short collects them again
        return session.cache.free()

    def resume_blocks(self, session_id: str) -> int:
        """KV blocks ``resume`` takes: those of every token the session had in its cache."""
        return self.allocator.blocks_for(len(self._get(session_id).tokens))

    def resume(self, session_id: str) -> None:
        """Take the blocks of a preempted session's tokens again; its next steps as a prefill compute their KV (a
        resumed first prefill finishes as usual; a decoding session's yields no token and decodes on after it).
        CapacityError (nothing taken) when the pool has too few free."""
        session = self._get(session_id)
        first = session.pending < 0  # its first prefill: the last prompt token is computed again for its logits
        size = self.allocator.block_size
        cache = self._take(session.tokens, (len(session.tokens) - first) // size, session.features)
        session.cache, session.prefilled, session.registered = cache, cache.length, cache.length // size

    def held_blocks(self, session_id: str) -> int:
        return len(self._get(session_id).cache.table)

    def step_blocks(self, verifies: Sequence[tuple[str, TokenTree]]) -> dict[str, int]:
        """The KV blocks each session of ``verifies`` has yet to take for its rows of a step (the pending token,
        the tree, the lookahead window). A prefill chunk takes none (admission and ``resume`` took its blocks);
        an unknown or prefilling session counts none (its Verify fails, or waits)."""
        need = {}
        for session_id, tree in verifies:
            session = self._sessions.get(session_id)
            if session is None or session.prefilling:
                continue
            rows = 1 + tree.num_nodes
            if session.window is not None:
                lookahead = session.lookahead
                rows += window_span(session.cache.length, lookahead, self.info.max_positions) * lookahead.levels
            missing = self.allocator.blocks_for(session.cache.length + rows) - self.held_blocks(session_id)
            if missing > 0:
                need[session_id] = missing
        return need

    def check_request(self, prompt: Sequence[int], sampling: SamplingParams) -> None:
        """ValueError for a request this verifier can never serve (reads only its fixed configuration): one past
        the context it serves (the model's, or less when one request alone could outgrow the KV pool)."""
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        vocab = self.info.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t, _ in sampling.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if sampling.grammar is not None and self.grammar_tokenizer is None:
            raise ValueError(NO_GRAMMAR_TOKENIZER)
        if len(prompt) + sampling.max_new_tokens > self.info.max_positions:
            why = ""
            if self.info.max_positions < self.model_positions:
                why = (f" (the model's is {self.model_positions}; one request's KV must fit the pool of "
                       f"{self.allocator.num_blocks * self.allocator.block_size} tokens: raise --kv-cache-gb)")
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds the "
                f"context of {self.info.max_positions} positions this verifier serves{why}"
            )

    def compile_grammar(self, sampling: SamplingParams) -> CompiledGrammar | None:
        """The request's grammar compiled (None without one), on the tokenizer's workers and cached by spec;
        blocks its caller, never a step. ValueError without a tokenizer; GrammarError (a ValueError) when it does
        not compile or is over a budget (``GrammarLimits``)."""
        if sampling.grammar is None:
            return None
        if self.grammar_tokenizer is None:
            raise ValueError(NO_GRAMMAR_TOKENIZER)
        return self.grammar_tokenizer.compile(*sampling.grammar)

    def admission_blocks(self, prompt_len: int) -> int:
        """KV blocks ``admit`` takes: the prompt's."""
        return self.allocator.blocks_for(prompt_len)

    def blocks_to_admit(self, prompt: Sequence[int], features: bool = False) -> int:
        """Free blocks ``admit`` would take now: the prompt's, less those found in the prefix cache that some
        session holds already (a found block no session holds leaves the free count too)."""
        need = self.admission_blocks(len(prompt))
        if not self.prefix_caching or features or self.features:
            return need
        found = self.allocator.lookup(prompt, (len(prompt) - 1) // self.allocator.block_size, count=False)
        return need - len(found) + self.allocator.num_unheld(found)

    def prefilling(self, session_id: str) -> bool:
        return self._get(session_id).prefilling

    def next_chunk(self, session_id: str) -> int:
        """Prompt tokens the session's next ``step`` as a prefill runs (0 once its prefill is done)."""
        session = self._get(session_id)
        return min(self.prefill_chunk, len(session.tokens) - session.prefilled)

    def step(
        self, prefills: Sequence[str], verifies: Sequence[tuple[str, TokenTree]],
    ) -> tuple[dict[str, int], list[VerifyResult | Exception]]:
        """One forward over the next prompt chunk of each session in ``prefills`` (admitted, still prefilling)
        and the trees of ``verifies``: ``finish(launch(...))``. Returns the first token of every prefill that
        finished, and per verify its result or the exception it raised alone (an invalid tree, an unknown
        session)."""
        return self.finish(self.launch(prefills, verifies))

    @torch.inference_mode()
    def launch(self, prefills: Sequence[str], verifies: Sequence[tuple[str, TokenTree]]) -> StepInFlight:
        """The step's first half, every host-side part of it up to its one device-to-host copy: pack the rows, run
        (on a GPU: queue) the forward, stage every decision on the device, start the copy. On a GPU
        (``asynchronous``) the host is then free while the device runs the step: what the caller does before
        ``finish`` (PEARL's drafting ahead, the next step's host work) does not take turns at the interpreter lock
        with this step's. On the CPU the forward runs in this call, its operators without the lock. ``finish``
        must follow, once, before the sessions step again."""
        start_time = time.perf_counter()
        rows: list[_Row] = []
        results: list[VerifyResult | Exception | None] = [None] * len(verifies)
        verify_rows: list[tuple[int, _Row]] = []
        ids, positions, attends = [], [], []
        packed = 0
        for session_id in prefills:
            session = self._get(session_id)
            chunk = session.tokens[session.prefilled : session.prefilled + self.prefill_chunk]
            row = _Row(session, packed, len(chunk), session.prefilled)
            ids.append(np.asarray(chunk, np.int64))
            positions.append(np.arange(session.prefilled, session.prefilled + len(chunk)))
            attends.append(None)
            rows.append(row)
            packed += len(chunk)
        seen = set(prefills)
        for index, (session_id, tree) in enumerate(verifies):
            try:
                if session_id in seen:
                    raise ValueError(f"session {session_id!r} appears twice in one step")
                row = self._verify_row(self._get(session_id), tree, packed)
            except (ValueError, KeyError, CapacityError) as exc:  # an invalid tree; UnknownSessionError; no blocks
                results[index] = exc
                continue
            seen.add(session_id)
            ids.append(row.input_ids)
            positions.append(row.positions)
            attends.append(row.attend)
            rows.append(row)
            verify_rows.append((index, row))
            packed += row.num_new
        if not rows:
            return StepInFlight(start_time, rows, verify_rows, results)
        # logits of: the last row of each finishing prefill chunk, every verified row (pending + tree) of each
        # verify and its window's top level (its last span rows): runs of packed rows (first row, length)
        runs = []
        for row in rows:
            if row.tree is None:
                if row.session.pending < 0 and row.prefix_len + row.num_new == len(row.session.tokens):
                    runs.append((row.start + row.num_new - 1, 1))
            else:
                runs.append((row.start, 1 + row.tree.num_nodes))
                if row.span:
                    runs.append((row.start + row.num_new - row.span, row.span))
        logit_index = torch.from_numpy(packed_runs(runs))
        # features of the sessions that asked: every row of a prefill chunk and every verified row (pending + tree),
        # picked after acceptance; span_start: a row's first feature row
        hidden_index, span_start = None, {}
        asking = [r for r in rows if r.session.features and not (r.tree is None and r.session.pending >= 0)]
        if asking:
            spans = [(r.start, r.start + (r.num_new if r.tree is None else 1 + r.tree.num_nodes)) for r in asking]
            hidden_index = torch.from_numpy(np.concatenate([np.arange(a, b) for a, b in spans]))
            hidden_index = hidden_index.to(self.runner.device, non_blocking=True)
            cu = np.cumsum([0] + [b - a for a, b in spans])
            span_start = {id(r): int(cu[i]) for i, r in enumerate(asking)}
        logits = self.runner.forward_batch(
            [row.session.cache for row in rows], pack(ids), pack(positions),
            [row.num_new for row in rows], attends, logit_index.to(self.runner.device, non_blocking=True),
            hidden_index,
        )  # [len(logit_index), vocab]
        features = None
        if hidden_index is not None:
            logits, features = logits  # features: [len(hidden_index), hidden]
        # acceptance: (session, tree, first logits row) of each finishing prefill (an empty tree) and verify
        accepting: list[tuple[_Session, TokenTree, int]] = []
        finishing: list[str] = []
        offset = 0
        for session_id, row in zip(prefills, rows, strict=False):
            first_prefill = row.session.pending < 0  # else a resumed session's KV computed again: no token
            if id(row) in span_start and first_prefill:
                row.session.prompt_features.append(features[span_start[id(row)] :][: row.num_new])
            row.session.prefilled += row.num_new
            if first_prefill and not row.session.prefilling:
                if row.session.grammar is not None:
                    row.session.row_masks = row.session.grammar.allowed()[None]
                accepting.append((row.session, TokenTree.empty(), offset))
                finishing.append(session_id)
                offset += 1
        for _, row in verify_rows:
            accepting.append((row.session, row.tree, offset))
            offset += row.num_out
        for session, tree, first in accepting:  # logit processors: each row sees its own context (the tree's path)
            n = 1 + tree.num_nodes
            if session.context is not None:
                logits[first : first + n] = session.context.apply(
                    logits[first : first + n], tree.tokens, tree.ancestor_mask if tree.num_nodes else None)
            if session.row_masks is not None:  # structured output: what the grammar allows after each row
                masks, session.row_masks = self._usable(session.row_masks), None
                logits[first : first + n].masked_fill_(~masks.to(logits.device, non_blocking=True), float("-inf"))
        # every decision on the device, then one copy to the host (verifier_service/decisions.py)
        copy = HostCopy()
        argmax_device = argmax_last(logits)
        argmax_handle = copy.add(argmax_device)
        topk_handle = None
        topk_asked = max((row.session.topk for _, row in verify_rows), default=0)  # each reads its first k
        if topk_asked:
            topk_handle = copy.add(torch.topk(logits, topk_asked, dim=-1).indices)  # [R, k]
        decisions = Decisions([Item(s.sampling, s.generator, tree, first) for s, tree, first in accepting],
                              logits, argmax_device, copy, self._shared_generator)
        copy.start()  # the step's one device-to-host transfer, queued (``finish`` waits for it)
        return StepInFlight(start_time, rows, verify_rows, results, finishing, accepting, decisions,
                            copy, argmax_handle, topk_handle, features, span_start, time.perf_counter())

    @torch.inference_mode()
    def finish(self, step: StepInFlight) -> tuple[dict[str, int], list[VerifyResult | Exception]]:
        """The step's second half (see ``launch``): wait for its copy, accept, commit to the sessions' caches.
        Returns what ``step`` does."""
        if not step.rows:
            return {}, step.results
        rows, verify_rows, results, finishing = step.rows, step.verify_rows, step.results, step.finishing
        accepting, copy, features, span_start = step.accepting, step.copy, step.features, step.span_start
        copy.wait()  # marked: the step's one device-to-host sync
        self.queue_seconds += step.queued - step.start_time
        self.copy_seconds += time.perf_counter() - step.queued
        argmax_handle, topk_handle, decisions = step.argmax_handle, step.topk_handle, step.decisions
        argmax = copy[argmax_handle].astype(np.int64)  # [R]: every greedy decision and window
        topk = None if topk_handle is None else copy[topk_handle].astype(np.int64)
        acceptances, logprobs = decisions.resolve(argmax)
        firsts: dict[str, int] = {}
        for session_id, acceptance, lp in zip(finishing, acceptances, logprobs, strict=False):
            firsts[session_id] = acceptance.bonus_token
            self._sessions[session_id].first_logprobs = lp
            self._start_decoding(self._sessions[session_id], acceptance.bonus_token)
        self._compact([row for _, row in verify_rows], acceptances[len(finishing) :])
        elapsed = time.perf_counter() - step.start_time
        verified = zip(verify_rows, accepting[len(finishing) :], acceptances[len(finishing) :],
                       logprobs[len(finishing) :], strict=True)
        for (index, row), (_, _, first), acceptance, lp in verified:
            results[index] = self._finish_verify(row, acceptance, argmax, topk, first, elapsed, len(rows), lp)
            if id(row) in span_start:  # the pending row and the accepted path's rows, at their positions
                offset = span_start[id(row)]
                keep = torch.tensor([0, *map((1).__add__, acceptance.accepted_nodes)])
                keep = keep.to(features.device, non_blocking=True)
                results[index] = dataclasses.replace(
                    results[index], features=TargetFeatures(row.prefix_len, features[offset:][keep]))
        if self.prefix_caching:
            self._register(rows)
        return firsts, results

    def take_first_logprobs(self, session_id: str) -> TokenLogprobs | None:
        """The first token's log-probabilities of a session whose prefill finished (once; None unless it asked)."""
        session = self._sessions.get(session_id)
        if session is None:
            return None
        logprobs, session.first_logprobs = session.first_logprobs, None
        return logprobs

    def take_prompt_features(self, session_id: str) -> TargetFeatures | None:
        """The prompt's target features of a session whose prefill finished (once; None unless it asked)."""
        session = self._sessions.get(session_id)
        if session is None or not session.prompt_features:
            return None
        rows, session.prompt_features = torch.cat(session.prompt_features), []
        return TargetFeatures(0, rows)

    @torch.inference_mode()
    def profile_costs(self, prefix_len: int = 128, sessions: tuple[int, ...] = (1, 8),
                      rows: tuple[int, ...] = (1, 8), repeats: int = 3) -> VerifyCosts:
        """Fit ``VerifyCosts`` to timed batched forwards of ``sessions`` scratch sessions holding ``prefix_len``
        tokens with ``rows`` new tokens each (the fastest of ``repeats`` per point), for the load-aware
        speculation policy. The scratch sessions' blocks are returned; with too small a pool, fewer sessions."""
        prefix_len = max(1, min(prefix_len, self.info.max_positions - max(rows) - 1))
        most = max(sessions)
        per_session = self.allocator.blocks_for(prefix_len + max(rows))
        most = max(1, min(most, self.allocator.num_free // max(per_session, 1)))
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(self.info.vocab_size, (prefix_len,), generator=generator).tolist()
        caches = []  # the scratch sessions
        try:
            for _ in range(most):
                caches.append(self.pool.open(prefix_len + max(rows)))
                self.runner.forward(caches[-1], prompt, range(prefix_len), last_only=True)
            points = []
            for b in sorted({min(s, most) for s in sessions}):
                for n in rows:
                    ids = np.tile(np.resize(np.asarray(prompt, np.int64), n), b)
                    pos = np.tile(np.arange(prefix_len, prefix_len + n), b)
                    best = float("inf")
                    for _ in range(repeats):
                        start = time.perf_counter()
                        self.runner.forward_batch(caches[:b], ids, pos, [n] * b, [None] * b).sum().item()  # synced
                        best = min(best, time.perf_counter() - start)
                        for cache in caches[:b]:
                            cache.truncate(prefix_len)
                    points.append((b, b * n, best))
        finally:
            for cache in caches:
                cache.free()
        return fit_verify_costs(points)

    # -------------------------------------------------------------- internals
    def _take(self, tokens: list[int], max_cached: int, features: bool) -> PagedKVCache:
        """A cache with blocks for ``tokens``: the first (up to ``max_cached``) found in the prefix cache, shared,
        with their positions counted in its length; the rest new. Nothing is looked up for a session that asks
        for features. CapacityError (nothing taken) when the pool has too few free blocks."""
        if not self.prefix_caching or features or max_cached <= 0:
            return self.pool.open(len(tokens))
        return self.pool.open(len(tokens), self.allocator.lookup(tokens, max_cached))

    def _register(self, rows: Sequence[_Row]) -> None:
        """Offer the prefix cache the blocks the step filled with committed tokens (prompt chunks, accepted paths)."""
        size = self.allocator.block_size
        for row in rows:
            session = row.session
            full = session.cache.length // size  # the cache holds session.tokens[:length]
            if full > session.registered:
                self.allocator.register(session.cache.table, session.tokens, session.registered, full)
                session.registered = full

    def _get(self, session_id: str) -> _Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise UnknownSessionError(f"unknown session {session_id!r}") from None

    def _verify_row(self, session: _Session, tree: TokenTree, start: int) -> _Row:
        if session.prefilling:
            raise ValueError("the session's prefill has not finished")
        tree.validate(self.info.vocab_size, max_nodes=self.max_tree_nodes)
        kept = masks = None
        if session.grammar is not None:  # the grammar's mask at every row; nodes it rules out pruned where exact
            valid, masks = tree_masks(session.grammar, tree)
            if not valid.all() and prunable(tree, session.sampling.greedy):
                kept = np.flatnonzero(valid)
                tree = tree.select(valid)
                masks = masks[np.concatenate([[0], 1 + kept])]
        row = self._tree_row(session, tree, start)
        row.kept, session.row_masks = kept, masks
        return row

    def _tree_row(self, session: _Session, tree: TokenTree, start: int) -> _Row:
        prefix_len = session.cache.length
        if prefix_len + 1 + tree.max_depth + 1 > self.info.max_positions:
            raise InvalidTreeError("tree would run past the target's context length")
        window = session.window
        if window is None and not tree.num_nodes:  # plain decoding: the pending token alone, causal
            session.cache.ensure(prefix_len + 1)
            return _Row(session, start, 1, prefix_len, tree, 0, session.pending, prefix_len, num_out=1)
        if window is None:  # no lookahead: [pending, tree]
            span, levels = 0, 1
            input_ids = np.empty(1 + tree.num_nodes, np.int64)
            input_ids[0] = session.pending
            input_ids[1:] = tree.tokens
        else:
            span, levels = window_span(prefix_len, session.lookahead, self.info.max_positions), session.lookahead.levels
            guesses = window_inputs(window, span)  # [levels * span]
            input_ids = np.concatenate([[session.pending], tree.tokens, guesses]).astype(np.int64)
        session.cache.ensure(prefix_len + len(input_ids))
        if rows_are_causal(tree.num_nodes, tree.is_chain, span, levels):  # one chain in row order: causal
            positions = np.arange(prefix_len, prefix_len + len(input_ids))
            attend = None
        else:
            positions = np.concatenate([[prefix_len], prefix_len + 1 + tree.depth,
                                        window_positions(prefix_len, span, levels)])
            # the pending token is the root: tree parents shift by one, -1 becomes it; the window is a comb
            # below it (lookahead.py). The ancestors stay on the host: the runner packs them (kernel) or
            # builds the dense mask on its device (SDPA, HF)
            attend = TreeMask(prefix_len, torch.from_numpy(ancestor_mask(branch_parents(tree.parents, span, levels))))
        return _Row(session, start, len(input_ids), prefix_len, tree, span, input_ids, positions, attend,
                    num_out=1 + tree.num_nodes + span)

    def _compact(self, rows: Sequence[_Row], acceptances: Sequence[Acceptance]) -> None:
        """Keep each verified session's pending row and accepted path in its cache (dropping the rest of the tree
        and the window), every session in one batched move (``kv_pool.compact``), then give back the blocks past
        each one's last position (a rejected branch's)."""
        caches, prefix_lens, offsets = [], [], []
        for row, acceptance in zip(rows, acceptances, strict=True):
            if row.num_new == 1:  # the pending token alone: its cache holds what it keeps
                continue
            caches.append(row.session.cache)
            prefix_lens.append(row.prefix_len)
            offsets.append([0, *map((1).__add__, acceptance.accepted_nodes)])  # (no generator: a frame per node)
        if caches:
            compact(caches, prefix_lens, offsets)
            for cache in caches:
                cache.trim()

    def _finish_verify(self, row: _Row, acceptance: Acceptance, argmax: np.ndarray, topk: np.ndarray | None,
                       first: int, elapsed: float, batch_sessions: int,
                       logprobs: TokenLogprobs | None = None) -> VerifyResult:
        """argmax/topk: the step's [R] / [R, k] outputs, the row's ``num_out`` of them from ``first``."""
        session, tree = row.session, row.tree
        verified = tree.num_nodes + 1  # rows taking part in acceptance
        tokens = acceptance.tokens(tree)
        feedback = None
        if session.topk or session.window is not None:
            ngrams = ()
            if session.window is not None:  # the outputs after the window's top level
                ngrams = self._advance_window(session, argmax[first + verified : first + row.num_out], tokens)
            rows_topk = topk[first : first + verified, : session.topk] if session.topk else None
            feedback = VerifyFeedback.of(np.atleast_1d(row.input_ids)[:verified], rows_topk, ngrams)
        session.tokens.append(session.pending)  # the cache now holds the pending token and the accepted path
        if len(tokens) > 1:
            session.tokens.extend(tokens[:-1])
        session.prefilled = len(session.tokens)
        session.pending = acceptance.bonus_token
        self._note_output(session, tokens)
        accepted = acceptance.accepted_nodes
        if row.kept is not None:  # node indices of the tree as sent, before pruning
            accepted = tuple(int(row.kept[i]) for i in accepted)
        return VerifyResult(accepted, tuple(tokens), elapsed, feedback, batch_sessions, logprobs=logprobs)

    def _start_decoding(self, session: _Session, first: int) -> None:
        session.pending = first
        self._note_output(session, [first])
        if session.lookahead is not None:
            note_successors(session.successors, session.tokens + [first])
            session.window = initial_window(first, session.lookahead, session.successors)

    def _usable(self, masks: torch.Tensor) -> torch.Tensor:
        """A step's grammar masks with every empty row (a grammar complete or failed on a tokenizer that names no
        end of sequence) opened to the model's end-of-sequence tokens, or to everything when it has none."""
        empty = ~masks.any(dim=1)
        if empty.any():
            masks = masks.clone()
            eos = [t for t in self.info.eos_token_ids if 0 <= t < self.info.vocab_size]
            if eos:
                masks[empty.nonzero()[:, 0][:, None], torch.tensor(eos)[None]] = True
            else:
                masks[empty] = True
        return masks

    @staticmethod
    def _note_output(session: _Session, tokens: Sequence[int]) -> None:
        """Newly committed output tokens, to what reads the output: the logit processors' counts, the grammar."""
        if session.context is not None:
            session.context.add_output(tokens)
        if session.grammar is not None and not session.grammar.consume(tokens):
            # its masks are empty from here on: ``_usable`` lets only end of sequence through (everything on a
            # model that names none), so the output ends at the next token
            log.warning("a committed token broke its session's grammar (%s); its output ends with the next token "
                        "(end of sequence)", session.grammar.failed)

    @staticmethod
    def _advance_window(session: _Session, outputs: np.ndarray, committed: list[int]) -> list[tuple[int, ...]]:
        """One Jacobi iteration: harvest its n-grams, then shift the window past the committed tokens.

        outputs: [span], the target's argmax after the top token of each column fed; committed: accepted
        tokens + bonus."""
        ngrams = harvest(session.window, outputs)
        note_successors(session.successors, [session.pending, *committed])
        session.window = shift_window(session.window, outputs, len(committed) - 1, committed[-1], session.successors)
        return ngrams

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def num_blocks_filled(self) -> int:
        """KV blocks holding tokens: those of each session's cache length, a block shared by several (the prefix
        cache) once (a step's rows hold more until it ends: the allocator's ``num_used``). Safe from another thread
        (a scrape): one copy of the sessions, no lock."""
        blocks_for = self.allocator.blocks_for
        filled = set()
        for session in list(self._sessions.values()):
            cache = session.cache
            filled.update(cache.table[: blocks_for(cache.length)])
        return len(filled)

    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def cache_length(self, session_id: str) -> int:
        return self._get(session_id).cache.length
