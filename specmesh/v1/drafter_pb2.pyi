from specmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("proposers", "default_proposer", "vocab_size", "num_sessions", "feature_proposers")
    PROPOSERS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PROPOSER_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_PROPOSERS_FIELD_NUMBER: _ClassVar[int]
    proposers: _containers.RepeatedScalarFieldContainer[str]
    default_proposer: str
    vocab_size: int
    num_sessions: int
    feature_proposers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, proposers: _Optional[_Iterable[str]] = ..., default_proposer: _Optional[str] = ..., vocab_size: _Optional[int] = ..., num_sessions: _Optional[int] = ..., feature_proposers: _Optional[_Iterable[str]] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("session_id", "prompt", "sampling", "proposer", "prompt_len")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    proposer: str
    prompt_len: int
    def __init__(self, session_id: _Optional[str] = ..., prompt: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., proposer: _Optional[str] = ..., prompt_len: _Optional[int] = ...) -> None: ...

class Propose(_message.Message):
    __slots__ = ("step", "new_tokens", "budget", "rollback", "feedback", "committed_len", "features")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LEN_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    step: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    budget: _common_pb2.Budget
    rollback: int
    feedback: _containers.RepeatedCompositeFieldContainer[_common_pb2.VerifyFeedback]
    committed_len: int
    features: _containers.RepeatedCompositeFieldContainer[_common_pb2.TargetFeatures]
    def __init__(self, step: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., budget: _Optional[_Union[_common_pb2.Budget, _Mapping]] = ..., rollback: _Optional[int] = ..., feedback: _Optional[_Iterable[_Union[_common_pb2.VerifyFeedback, _Mapping]]] = ..., committed_len: _Optional[int] = ..., features: _Optional[_Iterable[_Union[_common_pb2.TargetFeatures, _Mapping]]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("open", "propose")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    open: OpenSession
    propose: Propose
    def __init__(self, open: _Optional[_Union[OpenSession, _Mapping]] = ..., propose: _Optional[_Union[Propose, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("step", "tree", "draft_ms")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    step: int
    tree: _common_pb2.TokenTree
    draft_ms: float
    def __init__(self, step: _Optional[int] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., draft_ms: _Optional[float] = ...) -> None: ...
