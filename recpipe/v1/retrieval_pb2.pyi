from recpipe.v1 import batch_pb2 as _batch_pb2
from recpipe.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RetrieveRequest(_message.Message):
    __slots__ = ("user_dense", "user_sparse", "recent_items", "k", "nprobe", "ef_search")
    USER_DENSE_FIELD_NUMBER: _ClassVar[int]
    USER_SPARSE_FIELD_NUMBER: _ClassVar[int]
    RECENT_ITEMS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    NPROBE_FIELD_NUMBER: _ClassVar[int]
    EF_SEARCH_FIELD_NUMBER: _ClassVar[int]
    user_dense: _tensor_pb2.Tensor
    user_sparse: _tensor_pb2.Tensor
    recent_items: _tensor_pb2.Tensor
    k: int
    nprobe: int
    ef_search: int
    def __init__(self, user_dense: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., user_sparse: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., recent_items: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., k: _Optional[int] = ..., nprobe: _Optional[int] = ..., ef_search: _Optional[int] = ...) -> None: ...

class RetrieveResponse(_message.Message):
    __slots__ = ("item_ids", "scores", "server_us", "model_version", "queue_us", "compute_us", "batch_size")
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    SERVER_US_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    item_ids: _tensor_pb2.Tensor
    scores: _tensor_pb2.Tensor
    server_us: int
    model_version: str
    queue_us: int
    compute_us: int
    batch_size: int
    def __init__(self, item_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., scores: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., server_us: _Optional[int] = ..., model_version: _Optional[str] = ..., queue_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class RetrieveBatchRequest(_message.Message):
    __slots__ = ("entries", "timeout_us", "sequence")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[RetrieveRequest]
    timeout_us: _containers.RepeatedScalarFieldContainer[int]
    sequence: int
    def __init__(self, entries: _Optional[_Iterable[_Union[RetrieveRequest, _Mapping]]] = ..., timeout_us: _Optional[_Iterable[int]] = ..., sequence: _Optional[int] = ...) -> None: ...

class RetrieveEntry(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: RetrieveResponse
    error: _batch_pb2.EntryError
    def __init__(self, ok: _Optional[_Union[RetrieveResponse, _Mapping]] = ..., error: _Optional[_Union[_batch_pb2.EntryError, _Mapping]] = ...) -> None: ...

class RetrieveBatchResponse(_message.Message):
    __slots__ = ("entries", "sequence")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[RetrieveEntry]
    sequence: int
    def __init__(self, entries: _Optional[_Iterable[_Union[RetrieveEntry, _Mapping]]] = ..., sequence: _Optional[int] = ...) -> None: ...
