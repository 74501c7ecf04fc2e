"""The root of the configuration tree (:class:`Config`) and its loading (:func:`load_config`).

Sources, later ones winning: defaults < YAML file (``--config`` or ``$STREAMPROC_CONFIG``) <
environment variables ``STREAMPROC_<SECTION>__<KEY>`` (e.g. ``STREAMPROC_BATCHING__MAX_WAIT_MS=5``;
lists such as ``STREAMPROC_PIPELINES`` take JSON). The broker address is, in order: the
``--bootstrap`` flag, ``kafka.bootstrap_servers``, ``$KAFKA_BOOTSTRAP_SERVERS``.

Every invalid value raises :class:`~streamproc.errors.ConfigError` at start-up, naming the key
(dotted path) and what is allowed. Units are part of the key names. The sections are in
:mod:`streamproc.config.sections`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from streamproc.config.sections import (
    AdminConfig,
    BatchingConfig,
    BuffersConfig,
    KafkaConfig,
    LoggingConfig,
    MetricsConfig,
    PipelineConfig,
    SchemaRegistryConfig,
    TracingConfig,
    WorkerConfig,
)
from streamproc.errors import ConfigError
from streamproc.logs import SECRET_KEY as _SECRET_KEY


class Config(BaseSettings):
    """The whole configuration; frozen after validation."""

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        env_prefix="STREAMPROC_",
        env_nested_delimiter="__",
        case_sensitive=False,
    )

    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    pipelines: tuple[PipelineConfig, ...] = Field(min_length=1)
    processing_guarantee: Literal["at_least_once", "exactly_once"] = "at_least_once"
    buffers: BuffersConfig = Field(default_factory=BuffersConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    # validated from {} (not built): $OTEL_EXPORTER_OTLP_ENDPOINT is read
    tracing: TracingConfig = Field(default_factory=dict, validate_default=True)
    # validated from {} (not built): $SCHEMA_REGISTRY_URL errors name schema_registry.url
    schema_registry: SchemaRegistryConfig = Field(default_factory=dict, validate_default=True)
    # validated from {} (not built): $STREAMPROC_ADMIN_TOKEN is read
    admin: AdminConfig = Field(default_factory=dict, validate_default=True)
    shutdown_timeout_s: float = Field(default=30.0, gt=0)
    revoke_timeout_s: float = Field(default=10.0, gt=0)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment overrides the file (passed as init kwargs).
        return (env_settings, init_settings)

    @model_validator(mode="after")
    def _checks(self) -> Config:
        loops = [
            p.input_topic
            for p in self.pipelines
            if p.input_topic in (p.output_topic, p.dead_letter_topic)
        ]
        if loops:
            raise ValueError(
                f"pipelines: output_topic or dlq_topic equals input_topic {loops} (a feedback loop)"
            )
        inputs = [p.input_topic for p in self.pipelines]
        if len(set(inputs)) != len(inputs):
            raise ValueError(f"pipelines: each input_topic may appear once, got {inputs}")
        managed = [
            p.name for p in self.pipelines if p.format != "json" or p.result_format != "json"
        ]
        if managed and not self.schema_registry.url:
            raise ValueError(
                f"schema_registry.url: pipelines {managed} read or write a schema-managed format "
                "(pipelines[].format or output_format: avro, protobuf, jsonschema) and need the "
                "registry's URL "
                "(http:// or https://)"
            )
        names = [p.name for p in self.pipelines]
        if len(set(names)) != len(names):
            raise ValueError(f"pipelines: each name may appear once, got {names}")
        if self.kafka.group_type == "share":
            if self.exactly_once:
                raise ValueError(
                    "processing_guarantee: exactly_once is not supported with "
                    "kafka.group_type=share (a share group acknowledges records one by one "
                    "and cannot commit them inside a transaction); use at_least_once, or set "
                    "kafka.group_type to consumer"
                )
            ordered = [p.name for p in self.pipelines if p.ordered]
            if ordered:
                raise ValueError(
                    f"pipelines[].ordered: pipelines {ordered} need their results in per-key "
                    "order, which a share group (kafka.group_type=share) does not keep; set "
                    "kafka.group_type to consumer, or ordered to false"
                )
        return self

    @property
    def schema_managed(self) -> bool:
        """True when a pipeline reads or writes through the Schema Registry."""
        return any(p.format != "json" or p.result_format != "json" for p in self.pipelines)

    @property
    def exactly_once(self) -> bool:
        return self.processing_guarantee == "exactly_once"

    @property
    def bootstrap_servers(self) -> str:
        """The broker address: config, else ``$KAFKA_BOOTSTRAP_SERVERS``.

        Raises:
            ConfigError: neither is set.
        """
        value = self.kafka.bootstrap_servers or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        if not value:
            raise ConfigError(
                "kafka.bootstrap_servers: not set; pass --bootstrap, set it in the config "
                "file or export KAFKA_BOOTSTRAP_SERVERS"
            )
        return value


def _format_error(err: ValidationError) -> str:
    lines = []
    errors = err.errors()
    nested = {str(e["loc"][0]) for e in errors if len(e["loc"]) > 1}
    for item in errors:
        key = ".".join(str(part) for part in item["loc"]) or "<root>"
        if item["type"] == "too_short" and key in nested:
            continue  # a consequence of an invalid entry, reported on its own line
        if key == "<root>":  # model-level check: the message names the keys
            lines.append(item["msg"].removeprefix("Value error, "))
            continue
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = f"unknown key; allowed: {_allowed_keys(item['loc'])}"
        elif "input" in item and item["type"] not in ("missing",):
            shown = "***" if _SECRET_KEY.search(key) else repr(item["input"])
            message = f"{message} (got {shown})"
        message = message.removeprefix("Value error, ")
        lines.append(f"{key}: {message}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _allowed_keys(loc: tuple[int | str, ...]) -> list[str]:
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            break
        annotation = field.annotation
        inner = getattr(annotation, "__args__", (annotation,))
        nested = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if nested is None:
            break
        model = nested
    return sorted(model.model_fields)


_NOT_CONFIG_ENV = {
    "STREAMPROC_CONFIG",
    "STREAMPROC_CACHE_DIR",
    "STREAMPROC_INSTANCE_ID",
    "STREAMPROC_TEST_BROKER",
    "STREAMPROC_MODEL_REPOSITORY",  # pipelines[].model.repository's default
    "STREAMPROC_ADMIN_TOKEN",  # admin.token's default
    "STREAMPROC_ADMIN_URL",  # `streamproc model use --url`
}


def _check_environment() -> None:
    """A ``STREAMPROC_<SECTION>__...`` variable must name a real section (typos fail loudly)."""
    sections = set(Config.model_fields)
    for name in os.environ:
        upper = name.upper()
        if not upper.startswith("STREAMPROC_") or upper in _NOT_CONFIG_ENV:
            continue
        section = upper.removeprefix("STREAMPROC_").split("__", 1)[0].lower()
        if section not in sections:
            raise ConfigError(
                f"environment variable {name}: unknown config section {section!r}; "
                f"allowed: {sorted(sections)}"
            )


def load_config(
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    bootstrap: str | None = None,
) -> Config:
    """Build the frozen config from a YAML file, environment variables and overrides.

    Args:
        path: YAML file; defaults to ``$STREAMPROC_CONFIG``; None and unset means defaults only.
        overrides: a mapping merged over the file (used by the demo and tests).
        bootstrap: the ``--bootstrap`` flag; wins over every other source.

    Raises:
        ConfigError: unreadable file, invalid YAML, or any invalid key (named with allowed values).
    """
    path = path or os.environ.get("STREAMPROC_CONFIG")
    _check_environment()
    data: dict[str, Any] = {}
    if path:
        try:
            with Path(path).open() as handle:  # the file name appears in YAML error marks
                loaded = yaml.safe_load(handle)
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path}: invalid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping")
        data = loaded or {}
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    if bootstrap:
        data["kafka"] = {**data.get("kafka", {}), "bootstrap_servers": bootstrap}
    try:
        return Config(**data)
    except ValidationError as exc:
        message = _format_error(exc)
        if not path and "pipelines" not in data and "STREAMPROC_PIPELINES" not in os.environ:
            message += (
                "\n  (no config file given: pass --config FILE or set STREAMPROC_CONFIG; "
                "README.md shows a config)"
            )
        raise ConfigError(message) from None
