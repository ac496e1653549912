"""How a request's verifier session accepts drafts: decided here, from the proposer the request asked for.

Every proposer is verified exactly (lossless) except those whose registry entry says otherwise
(``ProposerSpec.acceptance``; today only ``mjsd``: LOSSY joint-likelihood acceptance). Such an acceptance is
opt-in: a request gets it only by naming that proposer (never a server default, a policy or a fused mix), and a
request that asks for it with any other proposer is refused. Every front end resolves its requests here: the
serving path (``GenerationService.plan``: gRPC Generate, HTTP, `serve --embedded`), `specmesh generate` and
`specmesh bench`.
"""

from __future__ import annotations

import dataclasses

from drafter_service.proposer import proposer_spec
from specmesh.sampling import SamplingParams


def acceptance_of(proposer: str | None) -> str:
    """The acceptance a request naming ``proposer`` gets (None or "none" = plain decoding: exact)."""
    if proposer in (None, "none", "ar"):
        return "exact"
    return proposer_spec(proposer).acceptance


def request_sampling(proposer: str | None, sampling: SamplingParams,
                     mjsd_threshold: float | None = None) -> SamplingParams:
    """``sampling`` with the acceptance of ``proposer`` (and ``mjsd_threshold`` when given). ValueError for an
    acceptance or threshold asked for without its proposer, and for a lossy proposer with sampling
    (temperature > 0): MJSD is greedy only."""
    acceptance = acceptance_of(proposer)
    if acceptance == "exact":
        if sampling.acceptance != "exact":
            raise ValueError(f"acceptance {sampling.acceptance!r} (lossy) comes only with the proposer of that name; "
                             f"this request's proposer is {proposer or 'none'}")
        if mjsd_threshold is not None:
            raise ValueError(f"an MJSD threshold applies to the mjsd proposer only, not {proposer or 'none'}")
        return sampling
    if not sampling.greedy:
        raise ValueError(f"proposer {proposer} (lossy joint-likelihood acceptance) is greedy only: it needs "
                         f"temperature 0, got {sampling.temperature}")
    threshold = sampling.mjsd_threshold if mjsd_threshold is None else float(mjsd_threshold)
    return dataclasses.replace(sampling, acceptance=acceptance, mjsd_threshold=threshold)
