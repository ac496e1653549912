from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenTree(_message.Message):
    __slots__ = ("tokens", "parents", "draft_probs", "source_names", "sources", "q_cu", "q_ids", "q_probs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NAMES_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    Q_CU_FIELD_NUMBER: _ClassVar[int]
    Q_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedScalarFieldContainer[float]
    source_names: _containers.RepeatedScalarFieldContainer[str]
    sources: _containers.RepeatedScalarFieldContainer[int]
    q_cu: _containers.RepeatedScalarFieldContainer[int]
    q_ids: _containers.RepeatedScalarFieldContainer[int]
    q_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[float]] = ..., source_names: _Optional[_Iterable[str]] = ..., sources: _Optional[_Iterable[int]] = ..., q_cu: _Optional[_Iterable[int]] = ..., q_ids: _Optional[_Iterable[int]] = ..., q_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "stop", "stop_token_ids", "ignore_eos", "acceptance", "mjsd_threshold", "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "grammar_kind", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    MJSD_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_KIND_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    acceptance: str
    mjsd_threshold: float
    include_stop_str_in_output: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: int
    grammar_kind: str
    grammar: str
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., acceptance: _Optional[str] = ..., mjsd_threshold: _Optional[float] = ..., include_stop_str_in_output: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[int] = ..., grammar_kind: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class Budget(_message.Message):
    __slots__ = ("max_nodes", "max_depth", "timeout_ms", "min_path_prob")
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_PATH_PROB_FIELD_NUMBER: _ClassVar[int]
    max_nodes: int
    max_depth: int
    timeout_ms: int
    min_path_prob: float
    def __init__(self, max_nodes: _Optional[int] = ..., max_depth: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., min_path_prob: _Optional[float] = ...) -> None: ...

class SpecParams(_message.Message):
    __slots__ = ("proposer", "budget", "overlap", "policy", "restart_depth")
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    RESTART_DEPTH_FIELD_NUMBER: _ClassVar[int]
    proposer: str
    budget: Budget
    overlap: bool
    policy: str
    restart_depth: int
    def __init__(self, proposer: _Optional[str] = ..., budget: _Optional[_Union[Budget, _Mapping]] = ..., overlap: _Optional[bool] = ..., policy: _Optional[str] = ..., restart_depth: _Optional[int] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("num_proposed", "tree_depth", "num_accepted", "accepted_sources", "draft_ms", "verify_ms", "draft_error", "budget_nodes", "budget_depth", "predrafted", "wait_ms", "step_ms", "drafter_busy_ms", "predraft_nodes", "predraft_used", "proposed_per_source")
    class ProposedPerSourceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_SOURCES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ERROR_FIELD_NUMBER: _ClassVar[int]
    BUDGET_NODES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_DEPTH_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_BUSY_MS_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_NODES_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_USED_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_PER_SOURCE_FIELD_NUMBER: _ClassVar[int]
    num_proposed: int
    tree_depth: int
    num_accepted: int
    accepted_sources: _containers.RepeatedScalarFieldContainer[str]
    draft_ms: float
    verify_ms: float
    draft_error: str
    budget_nodes: int
    budget_depth: int
    predrafted: bool
    wait_ms: float
    step_ms: float
    drafter_busy_ms: float
    predraft_nodes: int
    predraft_used: int
    proposed_per_source: _containers.ScalarMap[str, int]
    def __init__(self, num_proposed: _Optional[int] = ..., tree_depth: _Optional[int] = ..., num_accepted: _Optional[int] = ..., accepted_sources: _Optional[_Iterable[str]] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., draft_error: _Optional[str] = ..., budget_nodes: _Optional[int] = ..., budget_depth: _Optional[int] = ..., predrafted: _Optional[bool] = ..., wait_ms: _Optional[float] = ..., step_ms: _Optional[float] = ..., drafter_busy_ms: _Optional[float] = ..., predraft_nodes: _Optional[int] = ..., predraft_used: _Optional[int] = ..., proposed_per_source: _Optional[_Mapping[str, int]] = ...) -> None: ...

class VerifyFeedback(_message.Message):
    __slots__ = ("inputs", "k", "topk", "ngram_tokens", "ngram_lengths")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    NGRAM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NGRAM_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedScalarFieldContainer[int]
    k: int
    topk: _containers.RepeatedScalarFieldContainer[int]
    ngram_tokens: _containers.RepeatedScalarFieldContainer[int]
    ngram_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, inputs: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., topk: _Optional[_Iterable[int]] = ..., ngram_tokens: _Optional[_Iterable[int]] = ..., ngram_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprobs", "k", "top_ids", "top_logprobs", "token_ids")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    k: int
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., k: _Optional[int] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TargetFeatures(_message.Message):
    __slots__ = ("start", "rows", "hidden", "dtype", "data")
    class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        BF16: _ClassVar[TargetFeatures.Dtype]
        FP16: _ClassVar[TargetFeatures.Dtype]
    BF16: TargetFeatures.Dtype
    FP16: TargetFeatures.Dtype
    START_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start: int
    rows: int
    hidden: int
    dtype: TargetFeatures.Dtype
    data: bytes
    def __init__(self, start: _Optional[int] = ..., rows: _Optional[int] = ..., hidden: _Optional[int] = ..., dtype: _Optional[_Union[TargetFeatures.Dtype, str]] = ..., data: _Optional[bytes] = ...) -> None: ...
