"""Writer schemas by id, read from a Schema Registry once and cached.

A lookup has three outcomes: the schema (cached for the life of the process: an id never
changes its schema), :class:`UnknownSchema` (the registry answered that the id does not exist:
the record's fault, dead-lettered), or a wait: the registry could not be reached or failed
(connection refused, timeout, HTTP 5xx), so the lookup is retried with backoff until it answers
or :meth:`WriterSchemas.close` is called (then :class:`RegistryUnavailable`). A registry outage
thus holds back the records that need a new id, never dead-letters them; records of ids already
cached keep flowing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from streamproc.errors import ConfigError, DecodeError, RegistryUnavailable
from streamproc.logs import get_logger

__all__ = ["RegistryUnavailable", "UnknownSchema", "WriterSchemas"]

log = get_logger(__name__)
T = TypeVar("T")

NOT_FOUND = 404
# the registry's own "not found" codes: no schema with this id, no such subject or version
NOT_FOUND_CODES = frozenset({40401, 40402, 40403})


class UnknownSchema(DecodeError):
    """The registry holds no schema with this id (the record is dead-lettered)."""


class WriterSchemas:
    """Schemas by id from one registry; thread-safe (decode threads share one instance).

    Args:
        settings: the ``SchemaRegistryClient`` configuration (``url`` and optionally
            ``basic.auth.user.info``, ``ssl.ca.location``, ``ssl.certificate.location``,
            ``ssl.key.location``); never logged (it may hold credentials).
        backoff_s: first wait after a failed lookup, in seconds; doubled per failure.
        max_backoff_s: the longest wait between attempts, in seconds.
        client: a client to use instead of building one from ``settings`` (tests).
    """

    def __init__(
        self,
        settings: Mapping[str, Any],
        backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
        client: Any = None,
    ) -> None:
        self._client = client or SchemaRegistryClient(dict(settings))
        self._url = str(settings.get("url", "?")).split("@")[-1]  # no user info in logs
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._cache: dict[int, Schema] = {}
        self._references: dict[tuple[str, int], str] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.outages = 0  # lookups that had to wait for the registry (for tests and metrics)

    @classmethod
    def probed(
        cls, settings: Mapping[str, Any], backoff_s: float, max_backoff_s: float
    ) -> WriterSchemas:
        """Writer schemas over the registry ``settings`` (the ``SchemaRegistryClient``'s), the
        registry probed (:meth:`probe`; closed again if that raises).

        Raises:
            ConfigError: the registry answered the probe with a client error.
        """
        schemas = cls(settings, backoff_s, max_backoff_s)
        try:
            schemas.probe()
        except BaseException:
            schemas.close()
            raise
        return schemas

    def get(self, schema_id: int) -> Schema:
        """The schema registered under ``schema_id``.

        Raises:
            UnknownSchema: the registry answered that no such id exists.
            RegistryUnavailable: the registry did not answer before :meth:`close`.
        """
        schema = self._cache.get(schema_id)
        if schema is not None:
            return schema
        with self._lock:  # one lookup per id, however many threads ask
            schema = self._cache.get(schema_id)
            if schema is None:
                schema = self._fetch(schema_id)
                self._cache[schema_id] = schema
        return schema

    def probe(self) -> None:
        """Check at start-up that ``url`` is a Schema Registry this client may read (lists the
        subjects). A registry that does not answer is only logged: records wait for it.

        Raises:
            ConfigError: it answered with a client error (a wrong path, bad credentials, no
                permission), naming ``schema_registry.url``.
        """
        try:
            self._client.get_subjects()
        except SchemaRegistryError as exc:
            if 400 <= exc.http_status_code < 500:
                raise ConfigError(
                    f"schema_registry.url: {self._url} answered HTTP {exc.http_status_code} "
                    f"({exc.error_message}); allowed: the URL of a Confluent-compatible API "
                    "(Apicurio: .../apis/ccompat/v7) and credentials that may read it"
                ) from exc
            log.warning("schema registry not ready at start-up", registry=self._url, error=str(exc))
        except Exception as exc:
            log.warning("schema registry unreachable at start-up; records needing it will wait",
                        registry=self._url, error=f"{type(exc).__name__}: {exc}"[:300])  # fmt: skip

    def cached(self, schema_id: int) -> bool:
        """True when ``schema_id`` needs no registry call."""
        return schema_id in self._cache

    def _fetch(self, schema_id: int) -> Schema:
        def lookup() -> Schema:
            schema: Schema = self._client.get_schema(schema_id)
            return schema

        return self._ask(lookup, f"schema id {schema_id}", f"unknown schema id {schema_id}")

    def reference(self, subject: str, version: int) -> str:
        """The schema text of a reference (``subject``, ``version``) a writer schema names
        (Confluent schema references), read once and cached.

        Raises:
            UnknownSchema: the registry has no such subject version.
            RegistryUnavailable: the registry did not answer before :meth:`close`.
        """
        key = (subject, version)
        text = self._references.get(key)
        if text is None:

            def lookup() -> str:
                return str(self._client.get_version(subject, version).schema.schema_str or "")

            what = f"reference {subject} version {version}"
            text = self._ask(lookup, what, f"unknown {what}")
            self._references[key] = text
        return text

    def _ask(self, call: Callable[[], T], what: str, unknown: str) -> T:
        """``call()``, retried with backoff while the registry cannot be reached (any answer
        but its own "not found", which raises :class:`UnknownSchema` with ``unknown``)."""
        wait_s = self._backoff_s
        waited = False
        while True:
            try:
                answer = call()
            except SchemaRegistryError as exc:
                if exc.http_status_code == NOT_FOUND and exc.error_code in NOT_FOUND_CODES:
                    raise UnknownSchema(f"schema: {unknown} (the registry has none)") from exc
                # any other answer (a 404 of a wrong path or a proxy, 401, 5xx) is the
                # registry's state or its configuration: wait, never refuse the record
                failure: Exception = exc
            except Exception as exc:  # connection refused, timeout, TLS: the registry's state
                failure = exc
            else:
                if waited:
                    log.info("schema registry reachable again", looking_up=what)
                return answer
            if not waited:
                waited = True
                self.outages += 1
                log.warning(
                    "schema registry unavailable; retrying",
                    registry=self._url,
                    looking_up=what,
                    error=f"{type(failure).__name__}: {failure}"[:300],
                )
            if self._closed.wait(wait_s):
                raise RegistryUnavailable(
                    f"schema registry {self._url} unavailable while closing ({what})"
                ) from failure
            wait_s = min(wait_s * 2, self._max_backoff_s)

    def abandon(self) -> None:
        """Give up lookups that are waiting for an unreachable registry, now and from now on
        (they raise :class:`RegistryUnavailable`); a lookup the registry is answering finishes.
        Idempotent."""
        self._closed.set()

    def close(self) -> None:
        """:meth:`abandon`, and close the client's HTTP session. Idempotent."""
        self.abandon()
        self._client.close()
