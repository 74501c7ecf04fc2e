"""The source thread's control queue: what other threads ask of whichever thread owns the
consumer (:mod:`streamproc.intake.thread`)."""

from __future__ import annotations

import queue

from streamproc.intake.rings import FlowControl

STOP_FETCHING = "stop_fetching"
COMMIT_NOW = "commit_now"


class SourceControl:
    """The source thread's control queue: what other threads ask of it (thread-safe puts,
    taken by the source thread between polls). Made before the source, so the stages built
    earlier can hold it (a model version switch asks for a commit) without binding late.
    """

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[FlowControl | str] = queue.SimpleQueue()

    def apply(self, flow: FlowControl) -> None:
        """Queue a flow-control change (nothing when it changes nothing)."""
        if flow:
            self.queue.put(flow)

    def request_commit(self) -> None:
        """Commit now rather than at the next ``commit_interval_ms`` (under exactly-once this
        closes the open transaction: a model version switch asks for it)."""
        self.queue.put(COMMIT_NOW)

    def stop_fetching(self) -> None:
        """Pause every assigned partition; polling (and group membership) continues."""
        self.queue.put(STOP_FETCHING)
