from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Frame(_message.Message):
    __slots__ = ("camera_id", "frame_no", "capture_ts_ms", "image")
    CAMERA_ID_FIELD_NUMBER: _ClassVar[int]
    FRAME_NO_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_TS_MS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    camera_id: str
    frame_no: int
    capture_ts_ms: int
    image: bytes
    def __init__(self, camera_id: _Optional[str] = ..., frame_no: _Optional[int] = ..., capture_ts_ms: _Optional[int] = ..., image: _Optional[bytes] = ...) -> None: ...

class TopClass(_message.Message):
    __slots__ = ("class_id", "label", "score")
    CLASS_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    class_id: int
    label: str
    score: float
    def __init__(self, class_id: _Optional[int] = ..., label: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class SourceCoordinates(_message.Message):
    __slots__ = ("topic", "partition", "offset")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    offset: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class FrameResult(_message.Message):
    __slots__ = ("camera_id", "frame_no", "top5", "model", "source")
    CAMERA_ID_FIELD_NUMBER: _ClassVar[int]
    FRAME_NO_FIELD_NUMBER: _ClassVar[int]
    TOP5_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    camera_id: str
    frame_no: int
    top5: _containers.RepeatedCompositeFieldContainer[TopClass]
    model: str
    source: SourceCoordinates
    def __init__(self, camera_id: _Optional[str] = ..., frame_no: _Optional[int] = ..., top5: _Optional[_Iterable[_Union[TopClass, _Mapping]]] = ..., model: _Optional[str] = ..., source: _Optional[_Union[SourceCoordinates, _Mapping]] = ...) -> None: ...
