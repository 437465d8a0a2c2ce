from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class NodeRef(_message.Message):
    __slots__ = ("node_rank", "address")
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_rank: int
    address: str
    def __init__(self, node_rank: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...
