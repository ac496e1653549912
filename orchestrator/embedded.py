"""Embedded mode: drafter, verifier and orchestrator in one process, no servers.

This is the one place where the embedded wiring is chosen; the gRPC and Ray
deployments build the same Engine from remote Drafter/Verifier implementations.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from drafter_service.drafter import LocalDrafter
from drafter_service.proposer import make_proposer
from orchestrator.engine import Engine
from orchestrator.policy import StaticPolicy
from specmesh.model_runner import ModelRunner, load_model, load_tokenizer
from verifier_service.verifier import LocalVerifier

NEEDS_DRAFT_MODEL = {"draft_model", "draft_model_tree"}


@dataclass
class EmbeddedStack:
    """Loaded models and tokenizer, shared by every engine built from them."""

    target_runner: ModelRunner
    draft_runner: ModelRunner | None
    tokenizer: object

    @classmethod
    def load(cls, target: str | Path, draft: str | Path | None = None, dtype: torch.dtype = torch.float32) -> EmbeddedStack:
        tokenizer = load_tokenizer(target)
        target_runner = ModelRunner(load_model(target, dtype))
        draft_runner = None
        if draft is not None:
            draft_runner = ModelRunner(load_model(draft, dtype))
            check_compatible(target_runner, draft_runner, tokenizer, load_tokenizer(draft))
        return cls(target_runner, draft_runner, tokenizer)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def engine(self, proposer: str | None, max_nodes: int = 8, max_depth: int = 8, **proposer_opts) -> Engine:
        """An engine with ``proposer`` (None or "none" = plain autoregressive decoding)."""
        drafter = None
        if proposer not in (None, "none", "ar"):
            if proposer in NEEDS_DRAFT_MODEL and self.draft_runner is None:
                raise ValueError(f"proposer {proposer!r} needs a draft model (--draft DIR)")
            drafter = LocalDrafter(make_proposer(proposer, draft_runner=self.draft_runner, **proposer_opts))
        return Engine(LocalVerifier(self.target_runner), drafter, StaticPolicy(max_nodes, max_depth), self.decode)


def check_compatible(target: ModelRunner, draft: ModelRunner, target_tok, draft_tok) -> None:
    """Draft and target must speak the same token ids."""
    if target.info.vocab_size != draft.info.vocab_size:
        raise ValueError(
            f"draft vocabulary ({draft.info.vocab_size}) differs from the target's ({target.info.vocab_size}); "
            "the draft-model proposer needs a shared tokenizer"
        )
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError("draft and target tokenizers differ; the draft-model proposer needs a shared tokenizer")
