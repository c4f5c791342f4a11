from recpipe.v1 import batch_pb2 as _batch_pb2
from recpipe.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RankRequest(_message.Message):
    __slots__ = ("user_dense", "user_sparse", "item_dense", "item_sparse")
    USER_DENSE_FIELD_NUMBER: _ClassVar[int]
    USER_SPARSE_FIELD_NUMBER: _ClassVar[int]
    ITEM_DENSE_FIELD_NUMBER: _ClassVar[int]
    ITEM_SPARSE_FIELD_NUMBER: _ClassVar[int]
    user_dense: _tensor_pb2.Tensor
    user_sparse: _tensor_pb2.Tensor
    item_dense: _tensor_pb2.Tensor
    item_sparse: _tensor_pb2.Tensor
    def __init__(self, user_dense: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., user_sparse: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., item_dense: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., item_sparse: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class RankResponse(_message.Message):
    __slots__ = ("scores", "server_us", "model_version", "queue_us", "compute_us", "batch_size")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    SERVER_US_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    scores: _tensor_pb2.Tensor
    server_us: int
    model_version: str
    queue_us: int
    compute_us: int
    batch_size: int
    def __init__(self, scores: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., server_us: _Optional[int] = ..., model_version: _Optional[str] = ..., queue_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class RankBatchRequest(_message.Message):
    __slots__ = ("entries", "timeout_us", "sequence")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[RankRequest]
    timeout_us: _containers.RepeatedScalarFieldContainer[int]
    sequence: int
    def __init__(self, entries: _Optional[_Iterable[_Union[RankRequest, _Mapping]]] = ..., timeout_us: _Optional[_Iterable[int]] = ..., sequence: _Optional[int] = ...) -> None: ...

class RankEntry(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: RankResponse
    error: _batch_pb2.EntryError
    def __init__(self, ok: _Optional[_Union[RankResponse, _Mapping]] = ..., error: _Optional[_Union[_batch_pb2.EntryError, _Mapping]] = ...) -> None: ...

class RankBatchResponse(_message.Message):
    __slots__ = ("entries", "sequence")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[RankEntry]
    sequence: int
    def __init__(self, entries: _Optional[_Iterable[_Union[RankEntry, _Mapping]]] = ..., sequence: _Optional[int] = ...) -> None: ...
