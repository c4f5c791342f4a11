from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecommendRequest(_message.Message):
    __slots__ = ("user_id", "num_candidates", "num_results")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    NUM_RESULTS_FIELD_NUMBER: _ClassVar[int]
    user_id: int
    num_candidates: int
    num_results: int
    def __init__(self, user_id: _Optional[int] = ..., num_candidates: _Optional[int] = ..., num_results: _Optional[int] = ...) -> None: ...

class StageTiming(_message.Message):
    __slots__ = ("stage", "server_us", "observed_us", "queue_us", "compute_us", "batch_size")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SERVER_US_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_US_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    stage: str
    server_us: int
    observed_us: int
    queue_us: int
    compute_us: int
    batch_size: int
    def __init__(self, stage: _Optional[str] = ..., server_us: _Optional[int] = ..., observed_us: _Optional[int] = ..., queue_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class RecommendResponse(_message.Message):
    __slots__ = ("item_ids", "scores", "timings", "model_version")
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    item_ids: _containers.RepeatedScalarFieldContainer[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    timings: _containers.RepeatedCompositeFieldContainer[StageTiming]
    model_version: str
    def __init__(self, item_ids: _Optional[_Iterable[int]] = ..., scores: _Optional[_Iterable[float]] = ..., timings: _Optional[_Iterable[_Union[StageTiming, _Mapping]]] = ..., model_version: _Optional[str] = ...) -> None: ...
