from specmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("session_id", "prompt", "sampling", "return_features", "lease_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    return_features: bool
    lease_id: str
    def __init__(self, session_id: _Optional[str] = ..., prompt: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_features: _Optional[bool] = ..., lease_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "seconds", "features", "logprobs")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    seconds: float
    features: _common_pb2.TargetFeatures
    logprobs: _common_pb2.TokenLogprobs
    def __init__(self, first_token: _Optional[int] = ..., seconds: _Optional[float] = ..., features: _Optional[_Union[_common_pb2.TargetFeatures, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "tree", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tree: _common_pb2.TokenTree
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, session_id: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class VerifyBatchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ...) -> None: ...

class VerifyOutcome(_message.Message):
    __slots__ = ("result", "code", "message")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    result: VerifyResponse
    code: int
    message: str
    def __init__(self, result: _Optional[_Union[VerifyResponse, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class VerifyBatchResponse(_message.Message):
    __slots__ = ("items", "cost_base_s", "cost_per_session_s", "cost_per_row_s")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    COST_BASE_S_FIELD_NUMBER: _ClassVar[int]
    COST_PER_SESSION_S_FIELD_NUMBER: _ClassVar[int]
    COST_PER_ROW_S_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyOutcome]
    cost_base_s: float
    cost_per_session_s: float
    cost_per_row_s: float
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyOutcome, _Mapping]]] = ..., cost_base_s: _Optional[float] = ..., cost_per_session_s: _Optional[float] = ..., cost_per_row_s: _Optional[float] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted_nodes", "tokens", "seconds", "feedback", "batch_sessions", "features", "logprobs")
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    BATCH_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    seconds: float
    feedback: _common_pb2.VerifyFeedback
    batch_sessions: int
    features: _common_pb2.TargetFeatures
    logprobs: _common_pb2.TokenLogprobs
    def __init__(self, accepted_nodes: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., seconds: _Optional[float] = ..., feedback: _Optional[_Union[_common_pb2.VerifyFeedback, _Mapping]] = ..., batch_sessions: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.TargetFeatures, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class LeaseEvent(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierInfo(_message.Message):
    __slots__ = ("vocab_size", "max_positions", "eos_token_ids", "max_tree_nodes", "num_sessions", "model", "cost_base_s", "cost_per_session_s", "cost_per_row_s", "kv_blocks_total", "kv_blocks_free", "kv_block_size", "num_waiting")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COST_BASE_S_FIELD_NUMBER: _ClassVar[int]
    COST_PER_SESSION_S_FIELD_NUMBER: _ClassVar[int]
    COST_PER_ROW_S_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    max_positions: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tree_nodes: int
    num_sessions: int
    model: str
    cost_base_s: float
    cost_per_session_s: float
    cost_per_row_s: float
    kv_blocks_total: int
    kv_blocks_free: int
    kv_block_size: int
    num_waiting: int
    def __init__(self, vocab_size: _Optional[int] = ..., max_positions: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_tree_nodes: _Optional[int] = ..., num_sessions: _Optional[int] = ..., model: _Optional[str] = ..., cost_base_s: _Optional[float] = ..., cost_per_session_s: _Optional[float] = ..., cost_per_row_s: _Optional[float] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., num_waiting: _Optional[int] = ...) -> None: ...
