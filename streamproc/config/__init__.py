"""One frozen, validated configuration tree: the root and its loading (:mod:`.loading`), the
sections (:mod:`.sections`). Import from here: ``from streamproc.config import load_config``."""

from streamproc.config.loading import Config, load_config
from streamproc.config.sections import (
    AdminConfig,
    BatchingConfig,
    BuffersConfig,
    KafkaConfig,
    LoggingConfig,
    MetricsConfig,
    ModelConfig,
    ModelPrecision,
    PipelineConfig,
    Scalar,
    SchemaRegistryConfig,
    WorkerConfig,
)

__all__ = [
    "AdminConfig",
    "BatchingConfig",
    "BuffersConfig",
    "Config",
    "KafkaConfig",
    "LoggingConfig",
    "MetricsConfig",
    "ModelConfig",
    "ModelPrecision",
    "PipelineConfig",
    "Scalar",
    "SchemaRegistryConfig",
    "WorkerConfig",
    "load_config",
]
