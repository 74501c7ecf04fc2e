"""The ``models-<pipeline>`` thread: looks at the pipeline's model source every
``model.poll_interval_s`` and serves the operator's requests (the admin endpoint's
``POST /models/<pipeline>``); loads and warms a new version up beside the serving one and
offers it to :class:`~streamproc.models.versions.ModelVersions`, which switches at the next
batch boundary. A version that fails to be fetched, loaded or warmed up is refused; the
serving one never stops serving meanwhile."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from streamproc.config_sections import ModelConfig
from streamproc.logs import get_logger
from streamproc.models.loading import Loader, VersionRefused
from streamproc.models.sources import ModelSource, ModelSourceError
from streamproc.models.versions import ModelVersions

log = get_logger(__name__)

Mode = Literal["swap", "shadow", "drop"]
TRANSIENT = frozenset({"busy", "source"})
"""Refusal reasons polling tries again (no room yet; the source unreachable or a download
failed): the others (memory, load, warmup, contract) refuse the version for good."""


@dataclass(frozen=True)
class _Request:
    reference: str
    mode: Mode
    answer: Future[dict[str, Any]]
    restore: bool = False  # a rollback to a version that served well (not the operator's)


class ModelManager:
    """One versioned pipeline's model thread.

    Args:
        pipeline: the pipeline's name (thread name, answers).
        config: its ``model`` section.
        versions: its resident versions.
        source: where its versions come from.
        load: loads a version beside the serving one (:data:`~streamproc.models.loading.Loader`).
    """

    def __init__(
        self,
        pipeline: str,
        config: ModelConfig,
        versions: ModelVersions,
        source: ModelSource,
        load: Loader,
    ) -> None:
        self.pipeline = pipeline
        self.versions = versions
        self._config = config
        self._source = source
        self._load = load
        self._requests: queue.Queue[_Request | None] = queue.Queue()
        self._last_error: str | None = None
        # the operator asked for a version other than model.version's: polling waits until
        # they ask for model.version's reference again (a poll would undo their choice)
        self.pinned: str | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"models-{pipeline}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Stop after the load in progress, if any (idempotent); requests still queued, and
        any made from now on, are refused at once (reason ``stopped``)."""
        self._stopping.set()
        self._requests.put(None)
        if self._thread.ident is not None:
            self._thread.join(timeout_s)

    def request(self, reference: str, mode: Mode = "swap") -> Future[dict[str, Any]]:
        """Ask for version ``reference`` (a name, ``latest``, MLflow's ``@alias``): served from
        the next batch boundary (``swap``) or scored in shadow (``shadow``). The future's
        result says what was done; it raises :class:`VersionRefused` for a refused version
        (the serving one goes on)."""
        answer: Future[dict[str, Any]] = Future()
        ended = self._thread.ident is not None and not self._thread.is_alive()
        if self._stopping.is_set() or ended:  # (before the start, requests wait for it)
            answer.set_exception(VersionRefused("stopped", "the pipeline's model thread stopped"))
            return answer
        self._requests.put(_Request(reference, mode, answer))
        return answer

    def restore(self, name: str) -> Future[dict[str, Any]]:
        """Reload version ``name`` from the source and serve it from the next batch boundary
        without probation (it served well before: the serving one was judged broken, see
        :meth:`ModelVersions.judged_broken`); polling is not paused. The future as for
        :meth:`request` (a refusal is logged here too)."""
        answer: Future[dict[str, Any]] = Future()
        if self._stopping.is_set():
            answer.set_exception(VersionRefused("stopped", "the pipeline is stopping"))
            return answer
        self._requests.put(_Request(name, "swap", answer, restore=True))
        return answer

    def _run(self) -> None:
        interval = self._config.poll_interval_s or None
        while True:
            try:
                item = self._requests.get(timeout=interval)
            except queue.Empty:
                try:
                    self._poll()
                except Exception as exc:  # the thread outlives any one poll
                    log.error("model poll failed", pipeline=self.pipeline, error=repr(exc))
                continue
            if item is None:
                self._refuse_queued()
                return
            if self._stopping.is_set():
                item.answer.set_exception(VersionRefused("stopped", "the pipeline is stopping"))
                continue
            try:
                item.answer.set_result(self._serve(item))
            except Exception as exc:
                item.answer.set_exception(exc)

    def _refuse_queued(self) -> None:
        while True:
            try:
                item = self._requests.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item.answer.set_exception(VersionRefused("stopped", "the pipeline is stopping"))

    def _poll(self) -> None:
        """A new version in the source (one not resident and never refused) is loaded and
        offered in ``model.mode``; not while the operator's choice holds (:attr:`pinned`)."""
        if self.pinned is not None:
            return
        try:
            name = self._source.resolve(self._config.version)
        except ModelSourceError as exc:
            if str(exc) != self._last_error:  # one line per distinct error, not per poll
                log.warning("model source", pipeline=self.pipeline, error=str(exc))
            self._last_error = str(exc)
            return
        versions = self.versions
        if name in versions.resident() or name in versions.refused:
            self._last_error = None
            return
        try:
            self._load_and_offer(name, self._config.mode, "new")
        except VersionRefused as exc:
            if exc.reason not in TRANSIENT:
                versions.refuse(name, exc)
            elif str(exc) != self._last_error:  # tried again at the next poll: one line
                log.warning("model version not loaded yet", pipeline=self.pipeline, error=str(exc))
            self._last_error = str(exc)
            return
        self._last_error = None

    def _serve(self, request: _Request) -> dict[str, Any]:
        if request.restore:
            try:
                self._load_and_offer(request.reference, "swap", "rollback")
            except VersionRefused as exc:
                log.error("rollback version not loaded", pipeline=self.pipeline, error=str(exc))
                raise
            return {"pipeline": self.pipeline, "version": request.reference, "done": "pending"}
        answer = self._serve_request(request)
        if request.mode != "swap":
            return answer  # a shadow trial or a drop leaves the operator's pin as it is
        if request.reference == self._config.version:
            if self.pinned is not None:
                log.info("model polling resumed", pipeline=self.pipeline, version=answer["version"])
            self.pinned = None
        else:
            self.pinned = answer["version"]
            log.info(
                "model polling paused: the operator chose a version",
                pipeline=self.pipeline,
                version=answer["version"],
                resume=f"streamproc model use {self.pipeline} {self._config.version}",
            )
        return answer

    def _serve_request(self, request: _Request) -> dict[str, Any]:
        versions = self.versions
        try:
            name = self._source.resolve(request.reference)
        except ModelSourceError as exc:
            raise VersionRefused("source", str(exc)) from exc
        if request.mode == "drop":
            dropped = versions.drop_candidate(name)
            if dropped is None:
                raise VersionRefused("busy", f"version {name} is not scoring in shadow")
            return {"pipeline": self.pipeline, "version": name, "done": "dropped"}
        if request.mode == "swap":
            done = versions.use(name)
            if done is not None:
                return {"pipeline": self.pipeline, "version": name, "done": done}
        try:
            self._load_and_offer(name, request.mode, "operator")
        except VersionRefused as exc:
            if exc.reason != "busy":
                versions.refuse(name, exc)
            raise
        versions.refused.discard(name)
        done = "shadowing" if request.mode == "shadow" else "pending"
        return {"pipeline": self.pipeline, "version": name, "done": done}

    def _load_and_offer(
        self,
        name: str,
        mode: Literal["swap", "shadow"],
        reason: Literal["new", "operator", "rollback"],
    ) -> None:
        versions = self.versions
        if name in versions.resident():
            raise VersionRefused("busy", f"version {name} is resident already")
        versions.check_room(name)  # before loading: at most two versions resident
        try:
            files = self._source.fetch(name)
        except ModelSourceError as exc:
            raise VersionRefused("source", str(exc)) from exc
        log.info("loading model version", pipeline=self.pipeline, version=name, mode=mode)
        try:
            loaded = self._load(files, versions.serving_version())
        except VersionRefused:
            raise
        except Exception as exc:  # whatever loading a foreign file raises: that version's fault
            raise VersionRefused(
                "load", f"version {name} does not load: {type(exc).__name__}: {exc}"
            ) from exc
        log.info(
            "model version loaded",
            pipeline=self.pipeline,
            version=name,
            seconds=round(loaded.loaded_s, 3),
        )
        versions.offer(loaded, mode, reason)
