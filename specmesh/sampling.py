"""Sampling parameters of a request (torch-free: part of the contracts every floor speaks).

The warping they describe (temperature, then top-k, then top-p) is ``specmesh.warp.warp_probs``.

``acceptance`` is how the verifier accepts drafted tokens: ``exact`` (every method: greedy output identical
to autoregressive decoding, sampling with the same distribution) or ``mjsd`` (MJSD's joint-likelihood
acceptance, ``verifier_service.verification.verify_mjsd``: greedy only and LOSSY, its output differs from the
target's own). The orchestrator sets ``mjsd`` only for the proposer that asks for it (the registry's
``ProposerSpec.acceptance``: ``mjsd``); nothing else ever chooses it.
"""

from __future__ import annotations

from dataclasses import dataclass

# sane caps: every stop string is matched against the text of every step
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# a temperature below this decodes greedily (vLLM's _SAMPLING_EPS): dividing logits by a denormal one overflows
GREEDY_BELOW = 1e-5
MAX_LOGIT_BIAS = 300  # OpenAI's cap on logit_bias entries
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")  # structured output (specmesh/grammar.py)
MAX_GRAMMAR_CHARS = 1 << 16  # a grammar's spec at most (a JSON Schema, a regex, a Lark grammar)
MAX_LOGPROBS = 20  # top log-probabilities per token at most (OpenAI's chat cap; vLLM's default max_logprobs)

ACCEPTANCES = ("exact", "mjsd")  # exact: lossless; mjsd: lossy joint-likelihood acceptance (opt-in)
# MJSD accepts the longest drafted prefix whose joint likelihood ratio p/q is at least this; chosen by measurement
# on the stdlib-code pair (docs/PERFORMANCE.md, "Jacobi, lookahead, CLLM, MJSD"): speed against the target's perplexity of the outputs
DEFAULT_MJSD_THRESHOLD = 0.3


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    acceptance: str = "exact"  # "exact" | "mjsd" (lossy; set by the orchestrator for the mjsd proposer only)
    mjsd_threshold: float = DEFAULT_MJSD_THRESHOLD  # acceptance "mjsd": the joint likelihood ratio to reach
    include_stop_str_in_output: bool = False  # a matched stop string ends the text instead of being cut (vLLM's)
    # logit processors (specmesh.logits_process), applied to the target's logits before warping
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]: minus p for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]: minus f per occurrence in the output
    repetition_penalty: float = 1.0  # CTRL's (> 0, 1 = off): tokens of the prompt or output divided by it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value in [-100, 100]) added to its logit
    # report each token's log-probability and the top ``logprobs`` alternatives (0: the token's only); None = off
    logprobs: int | None = None
    # structured output: (kind, spec), kind one of GRAMMAR_KINDS (spec: the JSON Schema as JSON text, the regex, the
    # Lark grammar; "" for json_object); the output is the target's own under the grammar's token mask
    grammar: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < float("inf"):  # NaN fails the comparison too
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings of 1 to {MAX_STOP_CHARS} characters each")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, each >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        if any(t < 0 or not -100.0 <= v <= 100.0 for t, v in self.logit_bias):
            raise ValueError("logit_bias maps token ids >= 0 to values in [-100, 100]")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token id twice")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.grammar is not None:
            kind, spec = self.grammar
            if kind not in GRAMMAR_KINDS:
                raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {kind!r}")
            if (not spec and kind != "json_object") or len(spec) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"a {kind} grammar needs a spec of 1 to {MAX_GRAMMAR_CHARS} characters")
        if self.acceptance not in ACCEPTANCES:
            raise ValueError(f"acceptance must be one of {', '.join(ACCEPTANCES)}, got {self.acceptance!r}")
        if not 0.0 < self.mjsd_threshold < float("inf"):
            raise ValueError(f"mjsd_threshold must be a finite number > 0, got {self.mjsd_threshold}")
        if self.acceptance == "mjsd" and not self.greedy:
            raise ValueError("MJSD (lossy joint-likelihood acceptance) is greedy only: it needs temperature 0, "
                             f"got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def lossy(self) -> bool:
        """Whether the output may differ from the target's own decoding (MJSD acceptance)."""
        return self.acceptance != "exact"
