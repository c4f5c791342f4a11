from recpipe.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
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
