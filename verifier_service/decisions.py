"""A verify step's decisions, made on the target's device for the whole batch and brought to the host in one copy.

After the forward, every request of the step has a tree (a finishing prefill: the empty tree) and rows of logits
(processed: penalties, bias and grammar masks applied). ``Decisions`` stages on the device what the host will need:

- greedy requests: nothing beyond the step's argmax (the host walks each tree over the copied argmax, chains of a
  large batch in one numpy pass);
- MJSD requests (lossy, greedy): each node's log-probability under its parent's row;
- sampled requests: their rows warped (temperature, top-k, top-p; float32), then ``sample_trees`` (tree rejection
  sampling, the bonus token drawn by an exponential race), with each request's draws from its own generator
  (seeded ones) or one shared draw (the rest);
- requests asking for logprobs: their rows' log-distributions, the top k of each, every node's log-probability and
  the bonus's.

``HostCopy`` packs all of it (with the step's argmax and top-k feedback) into one float64 vector and copies it once
(pinned, non-blocking, then one stream sync on CUDA): the only device-to-host transfer of a step. ``resolve`` then
builds each request's ``Acceptance`` and ``TokenLogprobs`` from the host arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specmesh.contract import TokenLogprobs
from specmesh.sampling import SamplingParams
from specmesh.tree import TokenTree
from specmesh.warp import warp_grouped, warp_groups
from verifier_service.verification import (
    Acceptance,
    SampledTrees,
    node_logprobs_device,
    sample_packed,
    verify_greedy,
    verify_greedy_chains,
    verify_mjsd,
)

VECTORISE_FROM = 8  # greedy chains of a step accepted in one numpy pass from this many on (fewer: one walk each)
SAMPLING_DTYPE = torch.float32  # warping and acceptance: full rate on every GPU; ratios are compared, never divided


class HostCopy:
    """Device tensors a step needs on the host, gathered by ``add`` and brought over by one ``fetch``."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._host: list[np.ndarray] | None = None
        self._started = False
        self._flat: torch.Tensor | None = None  # [staged elements] float64, from ``start`` to ``wait``
        self._pinned: torch.Tensor | None = None  # its host copy in flight (CUDA)

    def add(self, tensor: torch.Tensor) -> int:
        """Stage ``tensor`` (any shape; integers below 2**53 and floats); returns its handle."""
        assert not self._started, "staged after the copy"
        self._parts.append(tensor)
        return len(self._parts) - 1

    def start(self) -> None:
        """Queue the one transfer: every staged tensor, packed into one float64 vector (on a GPU into pinned host
        memory, without waiting: the host is free until ``wait``)."""
        assert not self._started, "started twice"
        self._started = True
        parts = self._parts
        self._flat = torch.cat([t.reshape(-1).to(torch.float64) for t in parts]) if parts else None
        if self._flat is not None and self._flat.is_cuda:
            self._pinned = torch.empty(self._flat.shape, dtype=torch.float64, pin_memory=True)
            self._pinned.copy_(self._flat, non_blocking=True)

    def wait(self) -> None:
        """Wait for the transfer ``start`` queued (a host-device sync) and unpack it."""
        flat, self._flat = self._flat, None
        if flat is None:
            self._host = []
            return
        if self._pinned is not None:
            torch.cuda.current_stream(flat.device).synchronize()  # (releases the interpreter lock while it waits)
            host, self._pinned = self._pinned, None
        else:
            host = flat.cpu()
        values = host.numpy()
        self._host, at = [], 0
        for t in self._parts:
            self._host.append(values[at : at + t.numel()].reshape(t.shape))
            at += t.numel()

    def fetch(self) -> None:
        """``start``, then ``wait``: the one transfer, at once."""
        self.start()
        self.wait()

    def __getitem__(self, handle: int) -> np.ndarray:
        assert self._host is not None, "read before the copy"
        return self._host[handle]


@dataclass(slots=True)  # not frozen: one per request and step (a frozen init costs 2x)
class Item:
    """One request's part of a step's decisions."""

    sampling: SamplingParams
    generator: torch.Generator | None  # a seeded sampled request's own; None: the step's shared draws
    tree: TokenTree
    first: int  # the row of the tree's root in the step's logits; node i's is first + 1 + i


class Decisions:
    """Acceptance and log-probabilities of every item, staged on the device into ``copy`` (see the module doc)."""

    def __init__(self, items: Sequence[Item], logits: torch.Tensor, argmax: torch.Tensor, copy: HostCopy,
                 shared: torch.Generator | None = None) -> None:
        """logits: [R, vocab] the step's processed logits; argmax: [R] their argmax (on the device)."""
        self.items = items
        self._copy = copy
        # one pass over the items (a step has one per request): MJSD's, sampled ones, those asking for logprobs
        self.mjsd, self.sampled, self.asking = [], [], []
        for i, it in enumerate(items):
            sampling = it.sampling
            if sampling.acceptance == "mjsd":
                self.mjsd.append(i)
            elif not sampling.greedy:
                self.sampled.append(i)
            if sampling.logprobs is not None:
                self.asking.append(i)
        self._mjsd_lp = None
        if self.mjsd:
            self._mjsd_lp = copy.add(node_logprobs_device([items[i].tree for i in self.mjsd], logits,
                                                          [items[i].first for i in self.mjsd]))
        # the sampled items' rows are packed in their order: item j's from sampled_first[j]
        self._sampled_at = {i: j for j, i in enumerate(self.sampled)}
        self._sampled_first = np.zeros(len(self.sampled) + 1, np.int64)
        np.cumsum([items[i].tree.num_nodes + 1 for i in self.sampled], out=self._sampled_first[1:])
        probs = sampled = None
        self._plan = self._sampled_out = None
        if self.sampled:
            probs = self._warped(logits)  # [Rs, vocab]
            self._plan, sampled = sample_packed([items[i].tree for i in self.sampled], probs, self._sampled_first[:-1],
                                                [items[i].generator for i in self.sampled], shared)
            self._sampled_out = copy.add(sampled.host_columns())
        self._stage_logprobs(logits, probs, sampled)

    def _warped(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampled items' rows, packed in their order, each warped with its item's parameters (one warp per
        group of equal temperature, top-k and top-p: usually one for the whole batch)."""
        items = [self.items[i] for i in self.sampled]
        rows = packed_runs([(it.first, it.tree.num_nodes + 1) for it in items])
        keys = [(it.sampling.temperature, it.sampling.top_k, it.sampling.top_p)
                for it in items for _ in range(it.tree.num_nodes + 1)]
        packed = logits.index_select(0, torch.from_numpy(rows).to(logits.device, non_blocking=True))
        return warp_grouped(packed, warp_groups(keys, logits.device), SAMPLING_DTYPE)

    def _stage_logprobs(self, logits: torch.Tensor, probs: torch.Tensor | None, sampled: SampledTrees | None) -> None:
        """For the items asking: their rows' log-distributions (greedy and MJSD: the processed logits' log-softmax;
        sampled: the log of the warped rows acceptance used), packed: item i's rows from ``self._row0[i]``."""
        items = self.items
        if not self.asking:
            return
        device = logits.device
        sampled_at, sampled_first = self._sampled_at, self._sampled_first
        greedy_rows, sampled_rows = [], []
        for i in self.asking:
            n = items[i].tree.num_nodes + 1
            if i in sampled_at:
                sampled_rows.append(np.arange(sampled_first[sampled_at[i]], sampled_first[sampled_at[i]] + n))
            else:
                greedy_rows.append(np.arange(items[i].first, items[i].first + n))
        parts = []
        if greedy_rows:
            index = torch.from_numpy(np.concatenate(greedy_rows)).to(device, non_blocking=True)
            parts.append(torch.log_softmax(logits[index].float(), dim=-1))
        if sampled_rows:
            parts.append(torch.log(probs[torch.from_numpy(np.concatenate(sampled_rows)).to(device, non_blocking=True)]))
        logp = torch.cat(parts)  # [M, vocab]: the greedy askers' rows, then the sampled askers'
        order = [i for i in self.asking if i not in sampled_at] + [i for i in self.asking if i in sampled_at]
        self._row0, self._node0 = {}, {}
        rows, cols, at_row, at_node = [], [], 0, 0
        for i in order:
            tree = items[i].tree
            self._row0[i], self._node0[i] = at_row, at_node
            rows.append(at_row + 1 + tree.parents)
            cols.append(tree.tokens)
            at_row += tree.num_nodes + 1
            at_node += tree.num_nodes
        k = max(items[i].sampling.logprobs for i in self.asking)
        top = torch.topk(logp, k, dim=-1)  # sorted, most likely first
        index_rows = torch.from_numpy(np.concatenate(rows + [np.zeros(0, np.int64)])).to(device, non_blocking=True)
        index_cols = torch.from_numpy(np.concatenate(cols + [np.zeros(0, np.int64)])).to(device, non_blocking=True)
        self._lp = (
            self._copy.add(logp[index_rows, index_cols]),  # [nodes] each node's token under its parent's row
            self._copy.add(logp.max(dim=-1).values),  # [M] the argmax's: a greedy bonus's
            self._copy.add(top.values),  # [M, k]
            self._copy.add(top.indices),  # [M, k]
            None if sampled is None else self._copy.add(torch.log(probs[sampled.bonus_row, sampled.bonus])),
        )

    def resolve(self, argmax: np.ndarray) -> tuple[list[Acceptance], list[TokenLogprobs | None]]:
        """After the copy (``HostCopy.wait``): each item's accepted path and bonus, and its log-probabilities (None unless it
        asked). argmax: [R] the step's argmax, copied."""
        acceptances = self._accept(argmax)
        return acceptances, self._logprobs(acceptances)

    def _accept(self, argmax: np.ndarray) -> list[Acceptance]:
        items = self.items
        out: list[Acceptance | None] = [None] * len(items)
        if self.sampled:
            for i, acceptance in zip(self.sampled, self._plan.acceptances(self._copy[self._sampled_out]), strict=True):
                out[i] = acceptance
        if self.mjsd:
            logp, at = self._copy[self._mjsd_lp], 0
            for i in self.mjsd:
                it = items[i]
                n = it.tree.num_nodes
                out[i] = verify_mjsd(it.tree, argmax[it.first : it.first + n + 1], logp[at : at + n],
                                     it.sampling.mjsd_threshold)
                at += n
        chains = []
        for i, it in enumerate(items):
            if out[i] is not None:
                continue
            if it.tree.num_nodes == 0:  # plain decoding: the target's token
                out[i] = Acceptance((), int(argmax[it.first]))
            elif it.tree.is_chain:
                chains.append(i)
            else:
                out[i] = verify_greedy(it.tree, argmax[it.first : it.first + it.tree.num_nodes + 1])
        if len(chains) < VECTORISE_FROM:  # numpy's per-call cost outweighs a short host walk
            for i in chains:
                it = items[i]
                out[i] = verify_greedy(it.tree, argmax[it.first : it.first + it.tree.num_nodes + 1])
        elif chains:
            trees = [items[i].tree for i in chains]
            cu_nodes = np.zeros(len(chains) + 1, np.int64)
            np.cumsum([tree.num_nodes for tree in trees], out=cu_nodes[1:])
            tokens = np.concatenate([tree.tokens for tree in trees])
            firsts = np.fromiter((items[i].first for i in chains), np.int64, len(chains))
            num_accepted, bonus = verify_greedy_chains(argmax, firsts, tokens, cu_nodes)
            for i, count, token in zip(chains, num_accepted.tolist(), bonus.tolist(), strict=True):
                out[i] = Acceptance(tuple(range(count)), token)
        return out

    def _logprobs(self, acceptances: Sequence[Acceptance]) -> list[TokenLogprobs | None]:
        """Token j's log-probability is read from its parent's row: the root's for the first, then each accepted
        node's; an accepted node's from the node's own entry, the bonus's from its row (greedy: the row's best)."""
        out: list[TokenLogprobs | None] = [None] * len(self.items)
        if not self.asking:
            return out
        node_lp, best, top_vals, top_ids, bonus_lp = (None if h is None else self._copy[h] for h in self._lp)
        sampled_at = self._sampled_at
        for i in self.asking:
            it, acceptance = self.items[i], acceptances[i]
            n = it.sampling.logprobs
            rows = self._row0[i] + np.asarray([0, *(1 + a for a in acceptance.accepted_nodes)], np.int64)
            values = [float(node_lp[self._node0[i] + a]) for a in acceptance.accepted_nodes]
            values.append(float(bonus_lp[sampled_at[i]] if i in sampled_at else best[rows[-1]]))
            out[i] = TokenLogprobs(tuple(acceptance.tokens(it.tree)), tuple(values),
                                   tuple(map(tuple, top_ids[rows, :n].astype(np.int64).tolist())),
                                   tuple(map(tuple, top_vals[rows, :n].tolist())))
        return out


def packed_runs(runs: Sequence[tuple[int, int]]) -> np.ndarray:
    """[sum of lengths] int64: rows first, first + 1, ..., first + length - 1 of each run (first, length), in order."""
    if len(runs) <= 1:
        return np.arange(runs[0][0], runs[0][0] + runs[0][1], dtype=np.int64) if runs else np.zeros(0, np.int64)
    firsts, lengths = np.asarray(runs, np.int64).T
    cu = np.cumsum(lengths)
    return np.repeat(firsts - (cu - lengths), lengths) + np.arange(cu[-1])
