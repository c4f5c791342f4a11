from recpipe.v1 import batch_pb2 as _batch_pb2
from recpipe.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AugmentUserRequest(_message.Message):
    __slots__ = ("user_id",)
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    user_id: int
    def __init__(self, user_id: _Optional[int] = ...) -> None: ...

class AugmentUserResponse(_message.Message):
    __slots__ = ("user_id", "dense", "sparse", "recent_items", "server_us", "queue_us", "compute_us", "batch_size")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    RECENT_ITEMS_FIELD_NUMBER: _ClassVar[int]
    SERVER_US_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    user_id: int
    dense: _tensor_pb2.Tensor
    sparse: _tensor_pb2.Tensor
    recent_items: _tensor_pb2.Tensor
    server_us: int
    queue_us: int
    compute_us: int
    batch_size: int
    def __init__(self, user_id: _Optional[int] = ..., dense: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., sparse: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., recent_items: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., server_us: _Optional[int] = ..., queue_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class AugmentItemsRequest(_message.Message):
    __slots__ = ("user_id", "item_ids")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    user_id: int
    item_ids: _tensor_pb2.Tensor
    def __init__(self, user_id: _Optional[int] = ..., item_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class AugmentItemsResponse(_message.Message):
    __slots__ = ("dense", "sparse", "server_us", "queue_us", "compute_us", "batch_size")
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    SERVER_US_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    dense: _tensor_pb2.Tensor
    sparse: _tensor_pb2.Tensor
    server_us: int
    queue_us: int
    compute_us: int
    batch_size: int
    def __init__(self, dense: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., sparse: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., server_us: _Optional[int] = ..., queue_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class AugmentUserBatchRequest(_message.Message):
    __slots__ = ("entries", "timeout_us", "sequence")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AugmentUserRequest]
    timeout_us: _containers.RepeatedScalarFieldContainer[int]
    sequence: int
    def __init__(self, entries: _Optional[_Iterable[_Union[AugmentUserRequest, _Mapping]]] = ..., timeout_us: _Optional[_Iterable[int]] = ..., sequence: _Optional[int] = ...) -> None: ...

class AugmentUserEntry(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: AugmentUserResponse
    error: _batch_pb2.EntryError
    def __init__(self, ok: _Optional[_Union[AugmentUserResponse, _Mapping]] = ..., error: _Optional[_Union[_batch_pb2.EntryError, _Mapping]] = ...) -> None: ...

class AugmentUserBatchResponse(_message.Message):
    __slots__ = ("entries", "sequence")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AugmentUserEntry]
    sequence: int
    def __init__(self, entries: _Optional[_Iterable[_Union[AugmentUserEntry, _Mapping]]] = ..., sequence: _Optional[int] = ...) -> None: ...

class AugmentItemsBatchRequest(_message.Message):
    __slots__ = ("entries", "timeout_us", "sequence")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AugmentItemsRequest]
    timeout_us: _containers.RepeatedScalarFieldContainer[int]
    sequence: int
    def __init__(self, entries: _Optional[_Iterable[_Union[AugmentItemsRequest, _Mapping]]] = ..., timeout_us: _Optional[_Iterable[int]] = ..., sequence: _Optional[int] = ...) -> None: ...

class AugmentItemsEntry(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: AugmentItemsResponse
    error: _batch_pb2.EntryError
    def __init__(self, ok: _Optional[_Union[AugmentItemsResponse, _Mapping]] = ..., error: _Optional[_Union[_batch_pb2.EntryError, _Mapping]] = ...) -> None: ...

class AugmentItemsBatchResponse(_message.Message):
    __slots__ = ("entries", "sequence")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AugmentItemsEntry]
    sequence: int
    def __init__(self, entries: _Optional[_Iterable[_Union[AugmentItemsEntry, _Mapping]]] = ..., sequence: _Optional[int] = ...) -> None: ...
