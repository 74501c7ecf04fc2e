from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Trade(_message.Message):
    __slots__ = ("trade_id", "symbol", "ts_ms", "price", "size", "side", "prev_close", "adv_20")
    TRADE_ID_FIELD_NUMBER: _ClassVar[int]
    SYMBOL_FIELD_NUMBER: _ClassVar[int]
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    PRICE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    PREV_CLOSE_FIELD_NUMBER: _ClassVar[int]
    ADV_20_FIELD_NUMBER: _ClassVar[int]
    trade_id: str
    symbol: str
    ts_ms: int
    price: float
    size: int
    side: str
    prev_close: float
    adv_20: float
    def __init__(self, trade_id: _Optional[str] = ..., symbol: _Optional[str] = ..., ts_ms: _Optional[int] = ..., price: _Optional[float] = ..., size: _Optional[int] = ..., side: _Optional[str] = ..., prev_close: _Optional[float] = ..., adv_20: _Optional[float] = ...) -> None: ...

class TradeFeatures(_message.Message):
    __slots__ = ("log_return_vs_prev_close", "log_size_vs_adv", "side")
    LOG_RETURN_VS_PREV_CLOSE_FIELD_NUMBER: _ClassVar[int]
    LOG_SIZE_VS_ADV_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    log_return_vs_prev_close: float
    log_size_vs_adv: float
    side: int
    def __init__(self, log_return_vs_prev_close: _Optional[float] = ..., log_size_vs_adv: _Optional[float] = ..., side: _Optional[int] = ...) -> None: ...

class SourceCoordinates(_message.Message):
    __slots__ = ("topic", "partition", "offset")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    topic: str
    partition: int
    offset: int
    def __init__(self, topic: _Optional[str] = ..., partition: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class TradeResult(_message.Message):
    __slots__ = ("trade_id", "symbol", "ts_ms", "score", "anomaly", "threshold", "features", "model", "source")
    TRADE_ID_FIELD_NUMBER: _ClassVar[int]
    SYMBOL_FIELD_NUMBER: _ClassVar[int]
    TS_MS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    ANOMALY_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    trade_id: str
    symbol: str
    ts_ms: int
    score: float
    anomaly: bool
    threshold: float
    features: TradeFeatures
    model: str
    source: SourceCoordinates
    def __init__(self, trade_id: _Optional[str] = ..., symbol: _Optional[str] = ..., ts_ms: _Optional[int] = ..., score: _Optional[float] = ..., anomaly: _Optional[bool] = ..., threshold: _Optional[float] = ..., features: _Optional[_Union[TradeFeatures, _Mapping]] = ..., model: _Optional[str] = ..., source: _Optional[_Union[SourceCoordinates, _Mapping]] = ...) -> None: ...
