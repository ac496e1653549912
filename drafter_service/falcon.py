"""The ``falcon`` proposer: a Falcon SAR head (``falcon_head.py``) drafting a custom decoding tree.

Per-session state (``FalconState``): for every context position fed so far, its token, what its input
feature was (the target's, or a stand-in and from which anchor), the LSTM state after it, its LSTM output and
its keys/values; plus the target features received (``DraftFeedback.features``). It is a pure function of
(context tokens, target features known), kept in sync lazily and exactly under rollbacks:

- positions 0..known have their true inputs [f[j-1]; x[j]] (``known`` = target features received, from 0);
- positions after ``known`` (the overlapped loop's hypothesis, or everything when no verifier sends features)
  take stand-in features, block by block from ``known``: the block of positions S..S+k-1 gets the outputs of
  the final-block forward at end S-1 (what drafting from there would have produced);
- before drafting, the first position whose token or kind of input changed is found, everything from there is
  dropped, and the rest is fed again (a rollback is a cut; new features turn stand-ins into true inputs).

Drafting, the custom tree: the final-block forward at the context's end gives k distributions (the next k
tokens). Expanding a node makes its block of k tokens; each further forward pass feeds the chosen block ends at
once (their k tokens as blocks under the relaxed mask: a block's rows see the context, their ancestor blocks and
their whole own block), with one LM-head call per pass, until ``max_depth``, the budget or its deadline.
Under greedy every child is a point mass of its slot's distribution (so any pruning stays lossless) and the
tree is the best ``max_nodes`` by cumulative log q; its shape is ``tree``:
- ``static``: ``shape`` = per pass (N block ends expanded, M children per token node), the first pass the root
  alone (``1xM``): the same tree for every context, the Falcon paper's custom tree;
- ``dynamic``: a token node's children are its slot's top tokens until their q sums to ``cover`` (at most
  ``branching``); each pass expands the ``expand`` best block ends above ``min_path_prob``.
A head's ``config.json`` may hold the tree measured best for it (``head_tree``); options override it.
Under sampling: ``samples`` children of the block's first slot drawn without replacement (each ships the
distribution it was drawn from, conditioned on its earlier siblings) and one sampled child per later slot,
with every node count fixed before the draw (a node's existence never depends on its own value), so the
verifier's rejection sampling stays lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from drafter_service.falcon_head import (
    FalconHead,
    TargetTables,
    head_tree,
    load_head,
    random_head,
    target_tables,
)
from drafter_service.proposer import DraftSessionState, Proposer, proposer_options
from specmesh.contract import Budget
from specmesh.feedback import DraftFeedback
from specmesh.tree import TokenTree
from specmesh.warp import warp_probs

TREE_MODES = ("dynamic", "static")
DEFAULT_SHAPE = "1x4/4x2/4x2"  # a static shape when a head stores none
_SETTINGS = {"tree": str, "branching": int, "expand": int, "samples": int, "cover": float}  # option -> type
TRUE = -1  # kind of a position whose input feature is the target's (else: the anchor its stand-in came from)


class _Rows:
    """A growable [capacity, *shape] buffer; rows [0, length) are in use."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
        self.data = torch.zeros((64, *shape), dtype=dtype, device=device)
        self.length = 0

    def reserve(self, length: int) -> None:
        if length > self.data.shape[0]:
            grown = torch.zeros((max(length, 2 * self.data.shape[0]), *self.data.shape[1:]), dtype=self.data.dtype,
                                device=self.data.device)
            grown[: self.length] = self.data[: self.length]
            self.data = grown

    def put(self, start: int, rows: torch.Tensor) -> None:
        self.reserve(start + rows.shape[0])
        self.data[start : start + rows.shape[0]] = rows
        self.length = max(self.length, start + rows.shape[0])

    def view(self, end: int | None = None) -> torch.Tensor:
        return self.data[: self.length if end is None else end]


class _Features:
    """Target features f[j] by position, kept as received: the rows in one growable buffer, in position order,
    and where each run of consecutive positions starts. A gap between runs (rows lost on the way: a prompt cut
    to its newest rows, a failover to this drafter mid-request) holds nothing and reads as zeros, so memory
    follows the rows received, never the highest position."""

    def __init__(self, hidden: int, dtype: torch.dtype, device) -> None:
        self._rows = _Rows((hidden,), dtype, device)
        self._runs: list[tuple[int, int]] = []  # (first position, its row in _rows), positions ascending

    @property
    def dtype(self) -> torch.dtype:
        return self._rows.data.dtype

    @property
    def device(self) -> torch.device:
        return self._rows.data.device

    @property
    def length(self) -> int:
        """Positions [0, length) are known (gaps read as zeros)."""
        if not self._runs:
            return 0
        position, row = self._runs[-1]
        return position + self._rows.length - row

    @property
    def num_rows(self) -> int:
        """Rows held (what memory grows with)."""
        return self._rows.length

    def put(self, start: int, rows: torch.Tensor) -> None:
        """The rows [n, H] of positions start..start+n-1; rows held for positions from ``start`` on are dropped."""
        if not rows.shape[0]:
            return
        self.truncate(start)
        if self.length != start or not self._runs:
            self._runs.append((start, self._rows.length))
        self._rows.put(self._rows.length, rows)

    def truncate(self, length: int) -> None:
        """Forget the rows of positions from ``length`` on."""
        while self._runs and self._runs[-1][0] >= length:
            self._rows.length = self._runs.pop()[1]
        if self._runs:
            position, row = self._runs[-1]
            self._rows.length = min(self._rows.length, row + length - position)

    def dense(self, first: int, end: int) -> torch.Tensor:
        """[end - first, H] features of positions first..end-1, zeros where none was received (before 0 too)."""
        out = torch.zeros((max(0, end - first), self._rows.data.shape[1]), dtype=self.dtype, device=self.device)
        bounds = [row for _, row in self._runs] + [self._rows.length]  # run i holds rows bounds[i]..bounds[i+1]
        for i, (position, row) in enumerate(self._runs):
            lo, hi = max(first, position), min(end, position + bounds[i + 1] - row)
            if lo < hi:
                out[lo - first : hi - first] = self._rows.data[row + lo - position : row + hi - position]
        return out


@dataclass
class FalconState:
    """One session's head state (see the module docstring). Positions [0, len(tokens)) are fed."""

    head: FalconHead
    tokens: list[int] = field(default_factory=list)
    kinds: list[int] = field(default_factory=list)  # TRUE or the anchor of the stand-in
    states: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # pos -> (h, c) [layers, H]
    known: int = 0  # target features f[0..known-1] received

    def __post_init__(self) -> None:
        cfg, p = self.head.config, next(self.head.parameters())
        hidden, kvh, hd = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
        self.outputs = _Rows((hidden,), p.dtype, p.device)  # LSTM outputs s[j]
        self.keys = _Rows((kvh, hd), p.dtype, p.device)
        self.values = _Rows((kvh, hd), p.dtype, p.device)
        self.features = _Features(hidden, p.dtype, p.device)  # target features f[j]

    @property
    def length(self) -> int:
        return len(self.tokens)

    # ------------------------------------------------------------------ features
    def add_features(self, start: int, rows: torch.Tensor) -> None:
        """Target features [n, H] of positions start.. (a gap before them, features lost on the way, reads as
        zeros and takes no memory)."""
        self.features.put(start, torch.as_tensor(rows).to(self.features.dtype).to(self.features.device))
        self.known = self.features.length

    def truncate_features(self, length: int) -> None:
        """Forget target features past a context of ``length`` tokens (only rows f[j], j < length - 1, stay)."""
        self.features.truncate(max(0, length - 1))
        self.known = self.features.length

    # ---------------------------------------------------------------------- sync
    def cut(self, length: int) -> None:
        """Drop positions from ``length`` on, back to the last position whose LSTM state is kept."""
        while length > 0 and (length - 1) not in self.states:
            length -= 1
        del self.tokens[length:], self.kinds[length:]
        for pos in [p for p in self.states if p >= length]:
            del self.states[pos]
        for rows in (self.outputs, self.keys, self.values):
            rows.length = min(rows.length, length)

    def state_before(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, c) [layers, 1, H] after position pos - 1 (zeros before position 0)."""
        if pos == 0:
            return self.head.zero_state(1)
        h, c = self.states[pos - 1]
        return h[:, None], c[:, None]

    def feed(self, ids: list[int], prev_features: torch.Tensor, kind: int, per_step: bool) -> None:
        """Append positions with tokens ``ids`` and input features ``prev_features`` [n, H]. ``per_step``: keep the
        LSTM state after every position (rollbacks may cut there), else only after the last."""
        start, n = self.length, len(ids)
        x = self.head.inputs(prev_features, torch.tensor(ids, device=prev_features.device))[None]  # [1, n, 2H]
        h0, c0 = self.state_before(start)
        s, hs, cs = self.head.lstm_steps(x, h0, c0)  # hs/cs: [n, layers, 1, H]
        for i in range(n) if per_step else (n - 1,):
            self.states[start + i] = (hs[i, :, 0], cs[i, :, 0])
        positions = torch.arange(start, start + n, device=x.device)
        keys, values = self.head.project_kv(s[0], positions)
        self.outputs.put(start, s[0])
        self.keys.put(start, keys.transpose(0, 1))
        self.values.put(start, values.transpose(0, 1))
        self.tokens += ids
        self.kinds += [kind] * n

    def final_block(self, end: int) -> tuple[torch.Tensor, int]:
        """The final-block forward at ``end`` (inclusive): rows max(0, end-k+1)..end see every position <= end.
        Returns the outputs [rows, H] and the first row's index (row r predicts f[r-1+k] and x[r+k])."""
        k = self.head.config.k
        first = max(0, end - k + 1)
        rows = torch.arange(first, end + 1, device=self.outputs.data.device)
        keys = self.keys.view(end + 1).transpose(0, 1)  # [kvh, end+1, hd]
        values = self.values.view(end + 1).transpose(0, 1)
        return self.head.decode_rows(self.outputs.view(end + 1)[first:], rows, keys, values, None), first

    def standin(self, block_start: int) -> torch.Tensor:
        """Stand-in input features [k, H] of positions block_start..block_start+k-1: the outputs of the final-block
        forward at block_start - 1 (zeros for rows before position 0)."""
        k = self.head.config.k
        out, first = self.final_block(block_start - 1)
        missing = k - out.shape[0]  # rows before position 0
        if missing:
            out = torch.cat([torch.zeros_like(out[:1]).expand(missing, -1), out])
        return out

    @torch.inference_mode()
    def sync(self, context: list[int]) -> None:
        """Bring the fed positions to exactly ``context`` (see the module docstring)."""
        n, known, k = len(context), self.known, self.head.config.k
        kind = [TRUE if j <= known else known for j in range(n)]
        c = 0
        limit = min(self.length, n)
        while c < limit and self.tokens[c] == context[c] and self.kinds[c] == kind[c]:
            c += 1
        if c < self.length:
            self.cut(c)
        c = self.length
        last_true = min(known, n - 1)
        if c <= last_true:  # committed positions with the target's features: one LSTM call
            prev = self.features.dense(c - 1, last_true)  # f[c-1..last_true-1], f[-1] = zeros
            self.feed(context[c : last_true + 1], prev, TRUE, per_step=False)
        while self.length < n:  # stand-in positions, block by block from the anchor
            pos = self.length
            block_start = known + 1 + (pos - known - 1) // k * k
            standins = self.standin(block_start)
            end = min(block_start + k, n)
            self.feed(context[pos:end], standins[pos - block_start : end - block_start], known, per_step=True)


# --------------------------------------------------------------------------------------------------- proposer
@dataclass
class _Cand:
    token: int
    parent: int  # candidate index, -1 = root
    depth: int
    score: float  # cumulative log q
    prob: float  # draft probability of the token (conditioned on earlier siblings when sampled)
    src: int  # fed block whose forward gave its distribution (-1 = the context's final block)
    slot: int  # its place in that block, 0..k-1
    dist: tuple[np.ndarray, np.ndarray] | None = None  # sampled: the sparse distribution it was drawn from


@dataclass
class _Fed:
    """A block fed during drafting: its k rows in the tree buffer, ancestors (fed blocks), outputs, LSTM state."""

    cols: list[int]
    ancestors: list[int]
    outputs: torch.Tensor  # [k, H]
    h: torch.Tensor  # [layers, H] after its last row
    c: torch.Tensor


@dataclass
class FalconProposer(Proposer):
    head: FalconHead
    branching: int = 4  # greedy: children per token node (top-m; dynamic: at most this many)
    expand: int = 4  # dynamic: block ends expanded per forward pass (at most)
    samples: int = 2  # sampling: children drawn (without replacement) in each block's first slot
    tree: str = "dynamic"  # greedy tree: "dynamic" (confidence-driven) or "static" (``shape``)
    shape: tuple[tuple[int, int], ...] = ()  # static: per forward pass (block ends expanded, children per node)
    cover: float = 0.9  # dynamic: a token node's children are its top tokens until their q sums to this
    name: str = "falcon"
    feedback_features: bool = True  # ask the verifier for the target's features

    def __post_init__(self) -> None:
        if self.tree not in TREE_MODES:
            raise ValueError(f"falcon: tree must be one of {', '.join(TREE_MODES)}, got {self.tree!r}")
        if self.tree == "static" and (not self.shape or self.shape[0][0] != 1):
            raise ValueError("falcon: a static tree needs a shape whose first pass expands the root alone (1xM/...)")
        if not 0 < self.cover <= 1 or min(self.branching, self.expand, self.samples) < 1:
            raise ValueError("falcon: cover must be in (0, 1]; branching, expand and samples at least 1")

    def passes(self) -> list[tuple[int, int]]:
        """(block ends expanded, children per token node) of each forward pass, the root's first; a dynamic
        tree's are upper bounds (it runs until the budget, unlikely paths or the deadline stop it)."""
        if self.tree == "static":
            return list(self.shape)
        return [(1, self.branching)] + [(self.expand, self.branching)] * 64

    def observe(self, state: DraftSessionState, feedback: DraftFeedback) -> None:
        fs: FalconState = self.scratch(state)
        for features in feedback.features:
            fs.add_features(features.start, features.rows)

    def release(self, state: DraftSessionState) -> None:
        state.scratch.pop(self.name, None)

    def prepare(self, state: DraftSessionState) -> None:
        state.scratch[self.name] = FalconState(self.head)

    @torch.inference_mode()
    def propose(self, state: DraftSessionState, budget: Budget) -> TokenTree:
        k = self.head.config.k
        n = len(state.tokens)
        if budget.is_zero or n < k:
            return TokenTree.empty()
        fs: FalconState = self.scratch(state)
        fs.truncate_features(n)  # features of positions rolled back (never committed ones) are void
        fs.sync(state.tokens)
        out, _ = fs.final_block(n - 1)  # [k, H]
        return _TreeBuilder(self, fs, state, budget, n).build(out)


class _TreeBuilder:
    """One proposal's custom decoding tree (see the module docstring)."""

    def __init__(self, proposer: FalconProposer, fs: FalconState, state: DraftSessionState, budget: Budget,
                 n: int) -> None:
        self.p, self.fs, self.state, self.budget, self.n = proposer, fs, state, budget, n
        self.head = proposer.head
        self.k = self.head.config.k
        self.sp = state.sampling
        self.cands: list[_Cand] = []
        self.fed: list[_Fed] = []
        self.tree_keys: list[torch.Tensor] = []  # [kvh, rows, hd] per forward
        self.tree_values: list[torch.Tensor] = []
        self.tree_rows = 0
        self.min_score = math.log(budget.min_path_prob) if budget.min_path_prob > 0 else -math.inf
        self.static = proposer.tree == "static"
        self.vocab = self.head.draft_ids()  # a reduced draft vocabulary: index -> target id (None: the identity)

    def build(self, root_out: torch.Tensor) -> TokenTree:
        budget = self.budget
        self.root_out = root_out
        probs = self._dists(root_out)  # [k, vocab]
        passes = self.p.passes() if self.sp.greedy else [(1, 1)] + [(self.p.expand, 1)] * 64
        leaves = self._expand(-1, -1, probs, 0.0, 0, passes[0][1])
        for num_ends, width in passes[1:]:
            if not leaves or budget.expired() or (not self.sp.greedy and len(self.cands) >= budget.max_nodes):
                break
            leaves = [c for c in leaves if self.cands[c].depth + 1 < budget.max_depth
                      and (self.static or self.cands[c].score >= self.min_score)]
            leaves = sorted(leaves, key=lambda c: -self.cands[c].score)[:num_ends]
            if not leaves:
                break
            outs, fed_ids = self._forward(leaves)
            dists = self._dists(torch.cat(outs)).view(len(outs), self.k, -1)  # one LM-head call per pass
            nxt = []
            for leaf, dist, fed in zip(leaves, dists, fed_ids, strict=True):
                if not self.sp.greedy and len(self.cands) >= budget.max_nodes:
                    break
                nxt += self._expand(leaf, fed, dist, self.cands[leaf].score, self.cands[leaf].depth + 1, width)
            leaves = nxt
        return self._tree()

    # -------------------------------------------------------------------- pieces
    def _dists(self, out: torch.Tensor) -> torch.Tensor:
        """[rows, H] outputs -> [rows, V] draft distributions over the head's vocabulary (a reduced head's index i
        is target id ``vocab[i]``): greedy, log q (float32: only the top few are read); sampling, q (float64,
        warped like the target's)."""
        logits = self.head.logits(out).cpu()
        if self.sp.greedy:
            return torch.log_softmax(logits, dim=-1)
        return warp_probs(logits, self.sp.temperature, self.sp.top_k, self.sp.top_p).double()

    def _expand(self, anchor: int, src: int, probs: torch.Tensor, score: float, depth: int, width: int) -> list[int]:
        """Children of ``anchor`` (-1 = root): a block of up to k slots drawn from ``probs`` [k, vocab], ``width``
        children per token node under greedy (static: exactly, dynamic: the top tokens until their q reaches
        ``cover``, at most ``width``). Returns the block ends (candidates at its last slot)."""
        budget = self.budget
        slots = min(self.k, budget.max_depth - depth)
        parents = [(anchor, score)]
        for slot in range(slots):
            made = []
            if self.sp.greedy:
                top = torch.topk(probs[slot], min(width, probs.shape[1]))  # greedy: probs holds log q
                logs = top.values.double().tolist()
                if not self.static:  # confident slots get fewer children (one slot distribution per block)
                    covered = torch.cumsum(top.values.double().exp(), 0) >= self.p.cover
                    logs = logs[: int(torch.argmax(covered.int())) + 1 if bool(covered.any()) else len(logs)]
                tokens = top.indices.numpy() if self.vocab is None else self.vocab[top.indices.numpy()]
                for parent, pscore in parents:
                    for lq, tok in zip(logs, tokens.tolist(), strict=False):
                        if lq == -math.inf:
                            break
                        made.append(_Cand(tok, parent, depth + slot, pscore + lq, math.exp(lq), src, slot))
                made = sorted(made, key=lambda c: -c.score)[: budget.max_nodes]  # pruning point masses is lossless
            else:
                for parent, pscore in parents:
                    room = budget.max_nodes - len(self.cands) - len(made)
                    # counts fixed before drawing: the first slot's samples share what is left for their chains
                    count = 1 if slot else max(1, min(self.p.samples, room // slots))
                    for dist, tok in self._sample(probs[slot], min(count, room)):
                        ids, vals = dist
                        q = float(vals[ids == tok][0])
                        made.append(_Cand(tok, parent, depth + slot, pscore + math.log(q), q, src, slot, dist))
            ids = []
            for cand in made:
                self.cands.append(cand)
                ids.append(len(self.cands) - 1)
            parents = [(i, self.cands[i].score) for i in ids]
            if not parents:
                return []
        return [i for i, _ in parents] if slots == self.k else []

    def _sample(self, q: torch.Tensor, count: int):
        """``count`` tokens drawn from q [V] without replacement; each as a target id with the distribution it was
        drawn from (target ids, sparse: a reduced head's q is 0 outside its vocabulary, exactly)."""
        q = q.clone()
        for _ in range(count):
            total = float(q.sum())
            if total <= 0:
                return
            q = q / total
            index = int(torch.multinomial(q, 1, generator=self.state.generator))
            nz = torch.nonzero(q).flatten().numpy()
            ids, tok = (nz, index) if self.vocab is None else (self.vocab[nz], int(self.vocab[index]))
            yield (ids, q[nz].numpy()), tok
            q[index] = 0.0

    def _chain(self, leaf: int) -> list[int]:
        """The k candidates of the block ending at ``leaf``, first slot first."""
        chain = [leaf]
        while len(chain) < self.k:
            chain.append(self.cands[chain[-1]].parent)
        return chain[::-1]

    def _forward(self, leaves: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        """Feed the blocks ending at ``leaves`` in one forward; their outputs [k, H] and fed-block indices."""
        fs, k, head = self.fs, self.k, self.head
        chains = [self._chain(leaf) for leaf in leaves]
        srcs = [self.cands[chain[0]].src for chain in chains]
        feats, h0, c0 = [], [], []
        for src in srcs:
            if src < 0:
                feats.append(self.root_out)
                h, c = fs.states[self.n - 1]
            else:
                feats.append(self.fed[src].outputs)
                h, c = self.fed[src].h, self.fed[src].c
            h0.append(h)
            c0.append(c)
        ids = torch.tensor([[self.cands[i].token for i in chain] for chain in chains])
        x = head.inputs(torch.stack(feats), ids)  # [N, k, 2H]
        s, hs, cs = head.lstm_steps(x, torch.stack(h0, dim=1), torch.stack(c0, dim=1))
        h_end, c_end = hs[-1], cs[-1]  # [layers, N, H]: the states after the blocks' ends
        num = len(chains)
        positions = torch.tensor([self.n + self.cands[i].depth for chain in chains for i in chain])
        flat = s.reshape(num * k, -1)
        keys, values = head.project_kv(flat, positions)  # [kvh, N*k, hd]
        self.tree_keys.append(keys)
        self.tree_values.append(values)
        first_fed = len(self.fed)
        base = self.tree_rows
        self.tree_rows += num * k
        mask = torch.zeros(num * k, self.n + self.tree_rows, dtype=torch.bool)
        mask[:, : self.n] = True
        for b, src in enumerate(srcs):
            ancestors = (self.fed[src].ancestors if src >= 0 else []) + [first_fed + b]
            cols = list(range(base + b * k, base + (b + 1) * k))
            self.fed.append(_Fed(cols, ancestors, None, h_end[:, b], c_end[:, b]))
            for a in ancestors:
                mask[b * k : (b + 1) * k, [self.n + col for col in self.fed[a].cols]] = True
        all_keys = torch.cat([fs.keys.view(self.n).transpose(0, 1), *self.tree_keys], dim=1)
        all_values = torch.cat([fs.values.view(self.n).transpose(0, 1), *self.tree_values], dim=1)
        out = head.decode_rows(flat, positions, all_keys, all_values, mask).view(num, k, -1)
        for b in range(num):
            self.fed[first_fed + b].outputs = out[b]
        return list(out), list(range(first_fed, first_fed + num))

    def _tree(self) -> TokenTree:
        cands, budget = self.cands, self.budget
        if self.sp.greedy:
            order = sorted(range(len(cands)), key=lambda c: (-cands[c].score, cands[c].depth, c))
            kept = [c for c in order[: budget.max_nodes]
                    if self.static or cands[c].score >= self.min_score or cands[c].depth == 0]
            kept_set = set(kept)
            kept = [c for c in kept if cands[c].parent < 0 or cands[c].parent in kept_set]
        else:
            kept = list(range(min(len(cands), budget.max_nodes)))
        chosen = sorted(kept, key=lambda c: (cands[c].depth, c))
        index = {c: i for i, c in enumerate(chosen)}
        tree = TokenTree(
            np.asarray([cands[c].token for c in chosen], np.int64),
            np.asarray([index[cands[c].parent] if cands[c].parent >= 0 else -1 for c in chosen], np.int64),
            np.asarray([min(1.0, cands[c].prob) for c in chosen], np.float64),
            (self.p.name,) * len(chosen),
        )
        if self.sp.greedy or not chosen:
            return tree
        dists = [cands[c].dist for c in chosen]
        sizes = [len(ids) for ids, _ in dists]
        return TokenTree(tree.tokens, tree.parents, tree.draft_probs, tree.sources,
                         q_cu=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                         q_ids=np.concatenate([ids for ids, _ in dists]).astype(np.int64),
                         q_probs=np.concatenate([vals for _, vals in dists]).astype(np.float64))


# ---------------------------------------------------------------------------------------------------- factory
def falcon_proposer(target_runner=None, draft_runner=None, **given: object) -> FalconProposer:
    """Options: ``head`` (a trained head's directory; without one, an untrained head for the target, which
    drafts valid but rarely accepted trees), ``k`` and ``draft_vocab`` (untrained head only), ``branching``,
    ``expand``, ``samples``.
    The head shares the target's embedding and LM head (``target_runner``; ``draft_runner`` stands in where a
    host offers no target, e.g. the registry-wide tests, whose draft shares the target's vocabulary)."""
    opts = proposer_options(given, ("head", "k", "draft_vocab", "branching", "expand", "samples", "tree", "shape",
                                     "cover"), "falcon")
    runner = target_runner if target_runner is not None else draft_runner
    if runner is None:
        raise ValueError("the falcon proposer needs the target model (its embedding and LM head)")
    tables: TargetTables = target_tables(runner)
    if opts.get("head"):
        if "k" in opts or "draft_vocab" in opts:
            raise ValueError("falcon: k and draft_vocab come from the trained head (its config.json)")
        head = load_head(str(opts["head"]), tables.to(torch.float32), device=tables.embed.device)
        measured = head_tree(str(opts["head"]))  # the tree measured best for this head
    else:
        head = random_head(tables.to(torch.float32), k=int(opts.get("k", 2)), draft_vocab=int(opts.get("draft_vocab", 0)))
        measured = {}
    chosen = {**measured, **opts}  # options override it; what neither sets keeps FalconProposer's default
    settings = {key: cast(chosen[key]) for key, cast in _SETTINGS.items() if key in chosen}
    return FalconProposer(head, shape=parse_shape(str(chosen.get("shape", DEFAULT_SHAPE))), **settings)


def parse_shape(text: str) -> tuple[tuple[int, int], ...]:
    """A static tree shape, ``NxM/NxM/...``: per forward pass, N block ends expanded (the first pass: 1, the
    root) and M children per token node, e.g. ``1x4/4x2/2x2``."""
    try:
        shape = tuple((int(n), int(m)) for n, m in (part.lower().split("x") for part in text.split("/")))
    except ValueError:
        raise ValueError(f"falcon: shape {text!r} is not NxM/NxM/... (e.g. 1x4/4x2/2x2)") from None
    if not shape or min(min(p) for p in shape) < 1:
        raise ValueError(f"falcon: shape {text!r} needs counts of at least 1")
    return shape
