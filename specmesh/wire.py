"""Conversions between core types and the specmesh.v1 wire messages.

Pure functions; servers call them at their edges. Conversions *from* the wire raise
ValueError (or InvalidTreeError, a ValueError) on malformed input, which servers map
to INVALID_ARGUMENT; trees are validated against the vocabulary by the verifier.
"""

from __future__ import annotations

import numpy as np

from specmesh.contract import Budget, TokenLogprobs, VerifyCosts
from specmesh.feedback import DraftFeedback, TargetFeatures, VerifyFeedback
from specmesh.sampling import DEFAULT_MJSD_THRESHOLD, SamplingParams
from specmesh.tree import InvalidTreeError, TokenTree
from specmesh.v1 import common_pb2, drafter_pb2, generate_pb2, verifier_pb2

# full names of the services (health checks, reflection, retry policies)
DRAFTER_SERVICE = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
VERIFIER_SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
GENERATE_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generate"].full_name


# --------------------------------------------------------------------- trees
def tree_to_proto(tree: TokenTree) -> common_pb2.TokenTree:
    names = sorted(set(tree.sources))
    index = {name: i for i, name in enumerate(names)}
    msg = common_pb2.TokenTree(
        tokens=tree.tokens.tolist(),
        parents=tree.parents.tolist(),
        draft_probs=tree.draft_probs.tolist(),
        source_names=names,
        sources=[index[s] for s in tree.sources],
    )
    if tree.q_cu is not None:
        msg.q_cu.extend(tree.q_cu.tolist())
        msg.q_ids.extend(tree.q_ids.tolist())
        msg.q_probs.extend(tree.q_probs.tolist())
    return msg


def tree_from_proto(msg: common_pb2.TokenTree) -> TokenTree:
    """Structural decoding only; call ``validate(vocab_size, ...)`` on the result."""
    n = len(msg.tokens)
    if len(msg.parents) != n or len(msg.draft_probs) != n:
        raise InvalidTreeError(f"tokens, parents and draft_probs must have one entry per node ({n})")
    if msg.sources and len(msg.sources) != n:
        raise InvalidTreeError(f"sources must be empty or have one entry per node ({n})")
    if any(not 0 <= s < len(msg.source_names) for s in msg.sources):
        raise InvalidTreeError("a source index points outside source_names")
    sources = tuple(msg.source_names[s] for s in msg.sources)
    q = {}
    if msg.q_cu:
        q = dict(
            q_cu=np.asarray(msg.q_cu, np.int64),
            q_ids=np.asarray(msg.q_ids, np.int64),
            q_probs=np.asarray(msg.q_probs, np.float64),
        )
    return TokenTree(
        np.asarray(msg.tokens, np.int64),
        np.asarray(msg.parents, np.int64),
        np.asarray(msg.draft_probs, np.float64),
        sources,
        **q,
    )


# ------------------------------------------------------------------ sampling
def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        max_new_tokens=params.max_new_tokens,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        acceptance=params.acceptance,
        mjsd_threshold=params.mjsd_threshold,
        include_stop_str_in_output=params.include_stop_str_in_output,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias),
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.grammar is not None:
        msg.grammar_kind, msg.grammar = params.grammar
    return msg


def sampling_from_proto(msg: common_pb2.SamplingParams, default_max_new_tokens: int = 128) -> SamplingParams:
    """Unset fields take the defaults a user expects (top_p 0 = off, max_new_tokens 0 = default, acceptance "" =
    exact, mjsd_threshold 0 = the default, repetition_penalty 0 = off)."""
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.top_p else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        max_new_tokens=msg.max_new_tokens or default_max_new_tokens,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        acceptance=msg.acceptance or "exact",
        mjsd_threshold=msg.mjsd_threshold or DEFAULT_MJSD_THRESHOLD,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        grammar=(msg.grammar_kind, msg.grammar) if msg.grammar_kind else None,
    )


# ------------------------------------------------------------------ logprobs
def logprobs_to_proto(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    k = len(lp.top_ids[0]) if lp.top_ids else 0
    return common_pb2.TokenLogprobs(token_ids=lp.token_ids, logprobs=lp.logprobs, k=k, top_ids=[t for row in lp.top_ids for t in row],
                                    top_logprobs=[v for row in lp.top_logprobs for v in row])


def logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> TokenLogprobs:
    """ValueError for a message whose sizes disagree."""
    n, k = len(msg.logprobs), msg.k
    if k < 0 or len(msg.token_ids) != n or len(msg.top_ids) != n * k or len(msg.top_logprobs) != n * k:
        raise ValueError(f"token logprobs: {n} log-probabilities with k={k} need {n} tokens and {n * k} top ids and "
                         f"log-probabilities, got {len(msg.token_ids)}, {len(msg.top_ids)} and {len(msg.top_logprobs)}")
    ids, values = list(msg.top_ids), list(msg.top_logprobs)
    return TokenLogprobs(tuple(msg.token_ids), tuple(msg.logprobs), tuple(tuple(ids[i * k : (i + 1) * k]) for i in range(n)),
                         tuple(tuple(values[i * k : (i + 1) * k]) for i in range(n)))


# -------------------------------------------------------------------- budget
def budget_to_proto(budget: Budget, timeout_ms: int = 0) -> common_pb2.Budget:
    return common_pb2.Budget(max_nodes=budget.max_nodes, max_depth=budget.max_depth, timeout_ms=timeout_ms,
                             min_path_prob=budget.min_path_prob)


def budget_from_proto(msg: common_pb2.Budget, now: float) -> Budget:
    """``now``: time.monotonic() when the message arrived; the deadline is relative to it (0 = none)."""
    if msg.timeout_ms < 0:
        raise ValueError(f"budget timeout_ms must be >= 0 (0 = no deadline), got {msg.timeout_ms}")
    deadline = now + msg.timeout_ms / 1000.0 if msg.timeout_ms > 0 else None
    return Budget(msg.max_nodes, msg.max_depth, deadline, msg.min_path_prob)


# --------------------------------------------------------------------- costs
def costs_into_proto(costs: VerifyCosts | None, msg: verifier_pb2.VerifierInfo | verifier_pb2.VerifyBatchResponse) -> None:
    """A replica's forward costs into ``msg``'s ``cost_*_s`` fields (left 0, "not measured", when ``costs`` is None)."""
    if costs is not None:
        msg.cost_base_s, msg.cost_per_session_s, msg.cost_per_row_s = costs.base, costs.per_session, costs.per_row


def costs_from_proto(msg: verifier_pb2.VerifierInfo | verifier_pb2.VerifyBatchResponse) -> VerifyCosts | None:
    """The forward costs ``msg`` reports; None when it reports none (every field 0: not measured)."""
    if not (msg.cost_base_s or msg.cost_per_session_s or msg.cost_per_row_s):
        return None
    return VerifyCosts(msg.cost_base_s, msg.cost_per_session_s, msg.cost_per_row_s)


# ------------------------------------------------------------------ feedback
def feedback_to_proto(fb: VerifyFeedback) -> common_pb2.VerifyFeedback:
    msg = common_pb2.VerifyFeedback(inputs=fb.inputs.tolist(), k=fb.k, topk=fb.topk.reshape(-1).tolist())
    for gram in fb.ngrams:
        msg.ngram_tokens.extend(gram)
        msg.ngram_lengths.append(len(gram))
    return msg


def feedback_from_proto(msg: common_pb2.VerifyFeedback) -> VerifyFeedback:
    rows, k = len(msg.inputs), msg.k
    if k < 0 or len(msg.topk) != rows * k:
        raise ValueError(f"feedback top-k has {len(msg.topk)} ids for {rows} rows of width {k}")
    if any(n < 1 for n in msg.ngram_lengths) or sum(msg.ngram_lengths) != len(msg.ngram_tokens):
        raise ValueError("feedback n-gram lengths must be positive and add up to the n-gram tokens")
    tokens, grams, at = list(msg.ngram_tokens), [], 0
    for n in msg.ngram_lengths:
        grams.append(tuple(tokens[at : at + n]))
        at += n
    topk = np.asarray(msg.topk, np.int64).reshape(rows, k)
    return VerifyFeedback(np.asarray(msg.inputs, np.int64), topk, tuple(grams))


def draft_feedback_from_proto(msgs, committed_len: int, features=()) -> DraftFeedback | None:
    """The feedback fields of a Propose (``features``: its TargetFeatures messages, decoded to float32 numpy
    rows); None when it carries none."""
    verified = tuple(feedback_from_proto(m) for m in msgs)
    decoded = tuple(features_from_proto(m) for m in features)
    if not verified and not decoded and committed_len == 0:
        return None
    return DraftFeedback(int(committed_len), verified, decoded)


# ------------------------------------------------------------ target features
# One message's share of target features: half of gRPC's message limit (specmesh.rpc.MAX_MESSAGE_BYTES, 16 MiB),
# so the rest of a Prefill/Verify answer or a Propose always fits. Larger sets are cut to their newest rows
# (``newest_features``): a Falcon head drafts on zeros where rows are missing, which costs acceptance only.
MAX_FEATURE_BYTES = 8 * 1024 * 1024
FEATURE_DTYPES = {"bf16": common_pb2.TargetFeatures.BF16, "fp16": common_pb2.TargetFeatures.FP16}
_BYTES_PER_VALUE = 2  # both wire dtypes


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest even (as torch rounds); NaN stays NaN."""
    values = np.ascontiguousarray(x, dtype=np.float32)
    bits = values.view(np.uint32).astype(np.uint64)  # no overflow while rounding the largest values (to inf)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (uint16): exact."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def features_to_proto(features: TargetFeatures, dtype: str = "bf16") -> common_pb2.TargetFeatures:
    """``features.rows``: a float numpy array [rows, hidden] (a torch tensor: ``.float().cpu().numpy()`` first);
    sent as ``dtype`` ("bf16", the default, or "fp16": float16 overflows past 65504), little-endian."""
    rows = np.asarray(features.rows, dtype=np.float32)
    if rows.ndim != 2:
        raise ValueError(f"target features must be [rows, hidden], got shape {rows.shape}")
    if dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature dtype must be one of {', '.join(FEATURE_DTYPES)}, got {dtype!r}")
    values = float32_to_bf16_bits(rows).astype("<u2") if dtype == "bf16" else rows.astype("<f2")
    return common_pb2.TargetFeatures(start=features.start, rows=rows.shape[0], hidden=rows.shape[1],
                                     dtype=FEATURE_DTYPES[dtype], data=values.tobytes())


def features_from_proto(msg: common_pb2.TargetFeatures) -> TargetFeatures:
    """TargetFeatures with float32 numpy rows [rows, hidden]; ValueError when the sizes do not add up."""
    if msg.dtype not in FEATURE_DTYPES.values():
        raise ValueError(f"unknown target feature dtype {msg.dtype}")
    if msg.rows and msg.hidden < 1:
        raise ValueError("target features need hidden >= 1")
    if len(msg.data) != msg.rows * msg.hidden * _BYTES_PER_VALUE:
        raise ValueError(f"target features of {msg.rows} x {msg.hidden} 2-byte values need "
                         f"{msg.rows * msg.hidden * _BYTES_PER_VALUE} bytes, got {len(msg.data)}")
    if msg.dtype == common_pb2.TargetFeatures.BF16:
        values = bf16_bits_to_float32(np.frombuffer(msg.data, dtype="<u2"))
    else:
        values = np.frombuffer(msg.data, dtype="<f2").astype(np.float32)
    return TargetFeatures(int(msg.start), values.reshape(msg.rows, msg.hidden))


def newest_features(items, max_bytes: int = MAX_FEATURE_BYTES) -> list[TargetFeatures]:
    """The newest rows of ``items`` (TargetFeatures in arrival order) whose wire size fits ``max_bytes``: older
    items are dropped, and the oldest kept one loses its first rows."""
    kept, budget = [], max_bytes
    for item in reversed(list(items)):
        if not len(item):
            continue
        hidden = item.rows.shape[1]
        fit = min(len(item), budget // (hidden * _BYTES_PER_VALUE))
        if fit <= 0:
            break
        cut = len(item) - fit
        kept.append(item if cut == 0 else TargetFeatures(item.start + cut, item.rows[cut:]))
        budget -= fit * hidden * _BYTES_PER_VALUE
        if cut:
            break
    return kept[::-1]
