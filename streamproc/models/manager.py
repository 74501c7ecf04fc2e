"""The ``models-<pipeline>`` thread: looks at the pipeline's model source every
``model.poll_interval_s`` and serves the operator's requests (the admin endpoint's
``POST /models/<pipeline>``); loads and warms a new version up beside the serving one and
offers it to :class:`~streamproc.models.versions.ModelVersions`, which switches at the next
batch boundary. A version that fails to be fetched, loaded or warmed up is refused; the
serving one never stops serving meanwhile. A refused version is remembered with its files'
fingerprint (:meth:`~streamproc.models.sources.ModelSource.fingerprint`) and tried again once
they changed and then stayed the same for a poll (a file copied in place, written in chunks:
each try of a half-written archive fails to load, the complete one serves)."""

from __future__ import annotations

import queue
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from streamproc.config.sections import ModelConfig
from streamproc.logs import get_logger
from streamproc.models.loading import Loader, VersionRefused
from streamproc.models.sources import Fingerprint, ModelSource, ModelSourceError
from streamproc.models.versions import ModelVersions

log = get_logger(__name__)

Mode = Literal["swap", "shadow", "drop"]
TRANSIENT = frozenset({"busy", "source"})
"""Refusal reasons polling tries again at every poll (no room yet; the source unreachable or a
download failed): the others (memory, load, warmup, contract) refuse the version until its
files change (:class:`_Refusal`)."""


@dataclass(frozen=True)
class _Refusal:
    """Why polling skips a refused version: its files when it was refused, and how many tries
    were refused so far (1: the first)."""

    fingerprint: Fingerprint
    tries: int


@dataclass(frozen=True)
class _Request:
    reference: str
    mode: Mode
    answer: Future[dict[str, Any]]
    restore: bool = False  # a rollback to a version that served well (not the operator's)


def without_locals(error: BaseException) -> BaseException:
    """``error`` with the local variables of the frames in its tracebacks (and its causes')
    cleared, the frames still running excepted: an answer that keeps the error (the admin
    route's future) keeps no refused version's tensors alive. Returns ``error`` itself."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        link = pending.pop()
        if id(link) in seen:
            continue
        seen.add(id(link))
        traceback.clear_frames(link.__traceback__)
        pending += [e for e in (link.__cause__, link.__context__) if e is not None]
    return error


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
        self._refusals: dict[str, _Refusal] = {}  # refused versions the manager loaded
        self._seen: tuple[str, Fingerprint] | None = None  # the last poll's version and files
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

    def refused_at_start(self, name: str, error: VersionRefused, fingerprint: Fingerprint) -> None:
        """Version ``name`` was passed over at start-up (``error``; its files were
        ``fingerprint`` before that try): refused, and tried again by polling as any version
        this thread refused. Called before :meth:`start`."""
        self._refused(name, error, fingerprint)

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
                item.answer.set_exception(without_locals(exc))

    def _refuse_queued(self) -> None:
        while True:
            try:
                item = self._requests.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item.answer.set_exception(VersionRefused("stopped", "the pipeline is stopping"))

    def _poll(self) -> None:
        """A new version in the source (one not resident, and not refused unless its files
        changed since: :meth:`_try_again`) is loaded and offered in ``model.mode``; not while
        the operator's choice holds (:attr:`pinned`)."""
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
        if name in versions.resident():
            self._last_error = None
            return
        fingerprint = self._source.fingerprint(name)
        seen, self._seen = self._seen, (name, fingerprint)
        if name in versions.refused and not self._try_again(name, fingerprint, seen):
            self._last_error = None
            return
        try:
            self._load_and_offer(name, self._config.mode, "new")
        except VersionRefused as exc:
            if exc.reason not in TRANSIENT:
                self._refused(name, exc, fingerprint)
            elif str(exc) != self._last_error:  # tried again at the next poll: one line
                log.warning("model version not loaded yet", pipeline=self.pipeline, error=str(exc))
            self._last_error = str(exc)
            return
        self._accepted(name)
        self._last_error = None

    def _try_again(
        self, name: str, fingerprint: Fingerprint, seen: tuple[str, Fingerprint] | None
    ) -> bool:
        """Whether polling tries refused version ``name`` again: the manager refused it (not
        a rollback or a drop), its files changed since, and the previous poll saw them as
        they are now (a copy still being written is not tried at every poll)."""
        refusal = self._refusals.get(name)
        return (
            refusal is not None
            and fingerprint != refusal.fingerprint
            and seen == (name, fingerprint)
        )

    def _refused(self, name: str, error: VersionRefused, fingerprint: Fingerprint) -> None:
        """Remember refused ``name`` with its files (``fingerprint``: as they were before the
        try; none then, as they are now: a remote source's download, made by the try, does
        not count as a change) and count the try."""
        fingerprint = fingerprint or self._source.fingerprint(name)
        previous = self._refusals.get(name)
        tries = 1 if previous is None else previous.tries + 1
        self._refusals[name] = _Refusal(fingerprint, tries)
        self.versions.refuse(name, error, tries)

    def _accepted(self, name: str) -> None:
        """``name`` loaded and was offered: no longer refused."""
        self._refusals.pop(name, None)
        self.versions.refused.discard(name)

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
        fingerprint = self._source.fingerprint(name)
        try:
            self._load_and_offer(name, request.mode, "operator")
        except VersionRefused as exc:
            if exc.reason != "busy":
                self._refused(name, exc, fingerprint)
            raise
        self._accepted(name)
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
