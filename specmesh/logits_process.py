"""Logit processors that change the target's distribution: ``logit_bias`` and the repetition penalties.

They run on the logits before warping (``specmesh.warp``), in this order, as vLLM's sampler does:

1. ``logit_bias``: a fixed value added to the logit of each listed token id;
2. ``repetition_penalty`` r (CTRL's, Hugging Face's and vLLM's): the logit of every token that occurs in the prompt
   or in the output so far is divided by r where positive and multiplied by r where negative;
3. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's): the logit of token t is lowered by
   ``f * count(t) + p * (count(t) > 0)``, count over the output so far (the prompt does not count).

Speculative decoding keeps them exact because they are applied per verified row with the context *that row*
sees: the row after the pending token sees the output so far, the row after tree node i sees the output so far
plus the path from the tree's root to i. Greedy verification then takes the argmax of the processed logits, and
sampling warps them, so a tree's acceptance is the plain decoding's choice with the same options at every node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from specmesh.sampling import SamplingParams


def processes_logits(sampling: SamplingParams) -> bool:
    """Whether the request changes the target's logits (any option of this module set)."""
    return bool(sampling.logit_bias) or sampling.repetition_penalty != 1.0 or bool(
        sampling.presence_penalty or sampling.frequency_penalty)


def process_logits(logits: torch.Tensor, sampling: SamplingParams, in_context: torch.Tensor | None,
                   counts: torch.Tensor | None,
                   extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The processed logits (a new tensor; ``logits`` is not changed).

    logits: [R, vocab]; in_context: [vocab] bool, the tokens in the prompt or output (read when the repetition
    penalty is on); counts: [vocab] float, how often each token occurs in the output (read by the frequency and
    presence penalties); extra: (rows [E], tokens [E], occurrences [E]) or None: row r's tokens beyond them (a tree
    row's path), each (row, token) pair once with how often the token occurs there. Every row is processed with
    the shared context in a few broadcast passes; the E entries a path changes are then computed again with their
    own counts (a tree of N nodes and depth D changes at most N·D entries). Tensors on the logits' device.
    """
    x = logits.clone()
    if sampling.logit_bias:
        ids = torch.tensor([t for t, _ in sampling.logit_bias], device=x.device)
        values = torch.tensor([v for _, v in sampling.logit_bias], dtype=x.dtype, device=x.device)
        x[:, ids] += values
    # the penalties touch only the columns of tokens seen in the context (a few hundred of a large vocabulary)
    touched = []
    if sampling.repetition_penalty != 1.0:
        touched.append(in_context)
    if sampling.presence_penalty or sampling.frequency_penalty:
        touched.append(counts > 0)
    if touched:
        cols = (touched[0] if len(touched) == 1 else touched[0] | touched[1]).nonzero()[:, 0]
        if cols.numel():
            x[:, cols] = _penalized(x[:, cols], sampling, None if in_context is None else in_context[cols],
                                    None if counts is None else counts[cols])
    if extra is not None and len(extra[0]):
        rows, tokens, occurrences = extra
        raw = logits[rows, tokens]
        if sampling.logit_bias:  # the bias of each entry's token
            raw = raw + torch.zeros(x.shape[-1], dtype=x.dtype, device=x.device).index_copy_(0, ids, values)[tokens]
        seen = torch.ones_like(raw, dtype=torch.bool)
        x[rows, tokens] = _penalized(raw, sampling, seen, counts[tokens] + occurrences if counts is not None else None)
    return x


def _penalized(x: torch.Tensor, sampling: SamplingParams, seen: torch.Tensor | None,
               counts: torch.Tensor | None) -> torch.Tensor:
    """The repetition, frequency and presence penalties of ``x`` [..., n] given which of the n tokens were seen and
    their output counts ([n], broadcast over the rows, or [...] entry by entry)."""
    if sampling.repetition_penalty != 1.0:
        r = sampling.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if sampling.presence_penalty or sampling.frequency_penalty:
        x = x - (sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0).to(counts.dtype)
                 ).to(x.dtype)
    return x


def process_in_context(logits: torch.Tensor, sampling: SamplingParams, prompt: Sequence[int],
                       output: Sequence[int]) -> torch.Tensor:
    """``process_logits`` for rows that share one context given as token lists (a drafter's view: prompt, then the
    output so far and any drafted tokens). logits: [..., vocab]. Token ids past the logits' vocabulary (a draft
    model with a smaller head) are ignored."""
    if not processes_logits(sampling):
        return logits
    vocab = logits.shape[-1]
    if any(t >= vocab for t, _ in sampling.logit_bias):
        sampling = dataclasses.replace(sampling, logit_bias=tuple((t, v) for t, v in sampling.logit_bias if t < vocab))
    context = ContextCounts(sampling, [t for t in prompt if t < vocab], vocab, logits.device)
    context.add_output([t for t in output if t < vocab])
    return context.apply(logits.reshape(-1, vocab)).reshape(logits.shape)


class ContextCounts:
    """What a session's processors read, kept on the device and updated as tokens are committed.

    ``in_context`` [vocab] bool: the prompt's and output's tokens; ``counts`` [vocab] float32: each output token's
    occurrences. A session made for a request without processors keeps nothing."""

    def __init__(self, sampling: SamplingParams, prompt: Sequence[int], vocab_size: int, device: torch.device) -> None:
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.in_context = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if len(prompt):
            self.in_context[torch.as_tensor(np.asarray(prompt, np.int64), device=device)] = True

    def add_output(self, tokens: Sequence[int]) -> None:
        """Count newly committed output tokens."""
        if not len(tokens):
            return
        ids = torch.as_tensor(np.asarray(tokens, np.int64), device=self.counts.device)
        self.in_context[ids] = True
        self.counts.index_put_((ids,), torch.ones(len(ids), device=self.counts.device), accumulate=True)

    def apply(self, logits: torch.Tensor, tree_tokens: np.ndarray | None = None,
              ancestors: np.ndarray | None = None) -> torch.Tensor:
        """The processed logits of one request's verified rows.

        logits: [1 + N, vocab], the rows after the pending token and after each of N tree nodes; tree_tokens: [N];
        ancestors: [N, N] bool, node i's ancestors and itself (``TokenTree.ancestor_mask``). Without a tree:
        logits [1, vocab]."""
        extra = None
        if tree_tokens is not None and len(tree_tokens):  # row 1 + i counts each token on node i's path
            rows, cols = np.nonzero(ancestors)
            keys, occurrences = np.unique((rows + 1) * self.vocab_size + np.asarray(tree_tokens, np.int64)[cols],
                                          return_counts=True)
            device = logits.device
            extra = (torch.from_numpy(keys // self.vocab_size).to(device),
                     torch.from_numpy(keys % self.vocab_size).to(device),
                     torch.from_numpy(occurrences.astype(np.float32)).to(device))
        return process_logits(logits, self.sampling, self.in_context, self.counts, extra)
