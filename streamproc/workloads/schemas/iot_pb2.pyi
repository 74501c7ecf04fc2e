from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sample(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class SensorWindow(_message.Message):
    __slots__ = ("device_id", "ts_ms", "window_id", "channels", "window")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_ID_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    ts_ms: int
    window_id: int
    channels: _containers.RepeatedScalarFieldContainer[str]
    window: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, device_id: _Optional[str] = ..., ts_ms: _Optional[int] = ..., window_id: _Optional[int] = ..., channels: _Optional[_Iterable[str]] = ..., window: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class SourceCoordinates(_message.Message):
    __slots__ = ("topic", "partition", "offset")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    offset: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class SensorWindowResult(_message.Message):
    __slots__ = ("device_id", "ts_ms", "window_id", "score", "anomaly", "threshold", "model", "source")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    ANOMALY_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    ts_ms: int
    window_id: int
    score: float
    anomaly: bool
    threshold: float
    model: str
    source: SourceCoordinates
    def __init__(self, device_id: _Optional[str] = ..., ts_ms: _Optional[int] = ..., window_id: _Optional[int] = ..., score: _Optional[float] = ..., anomaly: _Optional[bool] = ..., threshold: _Optional[float] = ..., model: _Optional[str] = ..., source: _Optional[_Union[SourceCoordinates, _Mapping]] = ...) -> None: ...
