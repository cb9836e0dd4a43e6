from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoundState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUND_STATE_UNSPECIFIED: _ClassVar[RoundState]
    ROUND_STATE_COLLECTING: _ClassVar[RoundState]
    ROUND_STATE_COMPLETED: _ClassVar[RoundState]
    ROUND_STATE_FAILED: _ClassVar[RoundState]
    ROUND_STATE_UNKNOWN: _ClassVar[RoundState]
ROUND_STATE_UNSPECIFIED: RoundState
ROUND_STATE_COLLECTING: RoundState
ROUND_STATE_COMPLETED: RoundState
ROUND_STATE_FAILED: RoundState
ROUND_STATE_UNKNOWN: RoundState

class RoundKey(_message.Message):
    __slots__ = ("job", "group", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    group: str
    step: int
    def __init__(self, job: _Optional[str] = ..., group: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class TermPartial(_message.Message):
    __slots__ = ("term", "value", "contract", "expansion", "zero_ranks")
    TERM_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_FIELD_NUMBER: _ClassVar[int]
    EXPANSION_FIELD_NUMBER: _ClassVar[int]
    ZERO_RANKS_FIELD_NUMBER: _ClassVar[int]
    term: str
    value: float
    contract: str
    expansion: _containers.RepeatedScalarFieldContainer[float]
    zero_ranks: int
    def __init__(self, term: _Optional[str] = ..., value: _Optional[float] = ..., contract: _Optional[str] = ..., expansion: _Optional[_Iterable[float]] = ..., zero_ranks: _Optional[int] = ...) -> None: ...

class ReduceRequest(_message.Message):
    __slots__ = ("round", "rank", "world_size", "partials", "covered_ranks", "run", "covered_digests")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PARTIALS_FIELD_NUMBER: _ClassVar[int]
    COVERED_RANKS_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    COVERED_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    round: RoundKey
    rank: int
    world_size: int
    partials: _containers.RepeatedCompositeFieldContainer[TermPartial]
    covered_ranks: _containers.RepeatedScalarFieldContainer[int]
    run: str
    covered_digests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, round: _Optional[_Union[RoundKey, _Mapping]] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., partials: _Optional[_Iterable[_Union[TermPartial, _Mapping]]] = ..., covered_ranks: _Optional[_Iterable[int]] = ..., run: _Optional[str] = ..., covered_digests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TermNormalizer(_message.Message):
    __slots__ = ("term", "value", "zero_ranks")
    TERM_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    ZERO_RANKS_FIELD_NUMBER: _ClassVar[int]
    term: str
    value: float
    zero_ranks: int
    def __init__(self, term: _Optional[str] = ..., value: _Optional[float] = ..., zero_ranks: _Optional[int] = ...) -> None: ...

class ReduceResponse(_message.Message):
    __slots__ = ("round", "normalizers", "error")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NORMALIZERS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    round: RoundKey
    normalizers: _containers.RepeatedCompositeFieldContainer[TermNormalizer]
    error: _status_pb2.Status
    def __init__(self, round: _Optional[_Union[RoundKey, _Mapping]] = ..., normalizers: _Optional[_Iterable[_Union[TermNormalizer, _Mapping]]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("round", "rank", "run")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    round: RoundKey
    rank: int
    run: str
    def __init__(self, round: _Optional[_Union[RoundKey, _Mapping]] = ..., rank: _Optional[int] = ..., run: _Optional[str] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ("round", "run", "took_over")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    TOOK_OVER_FIELD_NUMBER: _ClassVar[int]
    round: RoundKey
    run: str
    took_over: bool
    def __init__(self, round: _Optional[_Union[RoundKey, _Mapping]] = ..., run: _Optional[str] = ..., took_over: bool = ...) -> None: ...

class GetRoundRequest(_message.Message):
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: RoundKey
    def __init__(self, round: _Optional[_Union[RoundKey, _Mapping]] = ...) -> None: ...

class RoundStatus(_message.Message):
    __slots__ = ("round", "state", "world_size", "arrived_ranks", "missing_ranks", "partial_sums", "age_seconds", "error", "run")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_RANKS_FIELD_NUMBER: _ClassVar[int]
    MISSING_RANKS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_SUMS_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    round: RoundKey
    state: RoundState
    world_size: int
    arrived_ranks: _containers.RepeatedScalarFieldContainer[int]
    missing_ranks: _containers.RepeatedScalarFieldContainer[int]
    partial_sums: _containers.RepeatedCompositeFieldContainer[TermNormalizer]
    age_seconds: float
    error: _status_pb2.Status
    run: str
    def __init__(self, round: _Optional[_Union[RoundKey, _Mapping]] = ..., state: _Optional[_Union[RoundState, str]] = ..., world_size: _Optional[int] = ..., arrived_ranks: _Optional[_Iterable[int]] = ..., missing_ranks: _Optional[_Iterable[int]] = ..., partial_sums: _Optional[_Iterable[_Union[TermNormalizer, _Mapping]]] = ..., age_seconds: _Optional[float] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., run: _Optional[str] = ...) -> None: ...

class ListRoundsRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class ListRoundsResponse(_message.Message):
    __slots__ = ("rounds",)
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    rounds: _containers.RepeatedCompositeFieldContainer[RoundStatus]
    def __init__(self, rounds: _Optional[_Iterable[_Union[RoundStatus, _Mapping]]] = ...) -> None: ...
