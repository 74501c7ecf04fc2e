"""The admin endpoint's model routes, served by :class:`~streamproc.health.HealthServer` on the
metrics port:

* ``GET /models``: per pipeline, its versions (serving, predecessor in probation, shadow
  candidate, pending), refused ones and the recent events (JSON);
* ``POST /models/<pipeline>`` with ``{"version": "<name|latest|@alias>", "mode":
  "swap"|"shadow"|"drop"}`` and ``Authorization: Bearer <admin.token>``: load that version
  beside the serving one and switch at the next batch boundary (or score it in shadow; or stop
  scoring a shadow candidate); answers once it is loaded and warmed up (200), or refused (422,
  the reason; the serving version goes on), with no room (409: two versions resident),
  stopping (503), unknown pipeline (404), no token configured (403), a wrong or missing token
  (401), a malformed body (400). ``streamproc model use`` and ``drop`` call it.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from concurrent.futures import TimeoutError as FutureTimeout

import orjson
from pydantic import SecretStr

from streamproc.health import Answer
from streamproc.models.loading import VersionRefused
from streamproc.models.manager import ModelManager

JSON = "application/json"
MODES = ("swap", "shadow", "drop")
STATUS = {"busy": 409, "stopped": 503}
"""HTTP status of a refusal by reason; any other reason (the version's own fault) is 422."""


def _answer(status: int, body: object) -> Answer:
    return status, orjson.dumps(body, option=orjson.OPT_INDENT_2) + b"\n", JSON


class AdminApi:
    """The model routes.

    Args:
        token: ``admin.token`` (None: every POST is refused, 403).
        managers: per versioned pipeline's name, its model thread.
        timeout_s: longest a POST waits for the version to load and warm up.
    """

    def __init__(
        self,
        token: SecretStr | None,
        managers: Mapping[str, ModelManager],
        timeout_s: float = 600.0,
    ) -> None:
        self._token = None if token is None else token.get_secret_value().encode()
        self._managers = dict(managers)
        self._timeout_s = timeout_s

    def get(self, path: str) -> Answer | None:
        """``GET /models``; None for other paths."""
        if path != "/models":
            return None
        return _answer(200, {name: m.versions.state() for name, m in self._managers.items()})

    def post(self, path: str, authorization: str | None, body: bytes) -> Answer | None:
        """``POST /models/<pipeline>``; None for other paths."""
        if not path.startswith("/models/"):
            return None
        if self._token is None:
            return _answer(403, {"error": "admin.token is not set: admin calls are refused"})
        given = (authorization or "").removeprefix("Bearer ").strip().encode()
        if not hmac.compare_digest(given, self._token):
            return _answer(401, {"error": "missing or wrong bearer token"})
        pipeline = path.removeprefix("/models/")
        manager = self._managers.get(pipeline)
        if manager is None:
            return _answer(
                404,
                {
                    "error": f"no versioned pipeline {pipeline!r}",
                    "pipelines": sorted(self._managers),
                },
            )
        try:
            request = orjson.loads(body)
            version = request["version"]
            mode = request.get("mode", "swap")
            if not isinstance(version, str) or not version or mode not in MODES:
                raise ValueError(mode)
        except (ValueError, KeyError, TypeError):
            return _answer(
                400,
                {
                    "error": 'body: {"version": "<name|latest|@alias>", '
                    '"mode": "swap"|"shadow"|"drop"}'
                },
            )
        try:
            done = manager.request(version, mode).result(self._timeout_s)
        except VersionRefused as exc:
            status = STATUS.get(exc.reason, 422)
            return _answer(status, {"error": str(exc), "reason": exc.reason})
        except FutureTimeout:
            return _answer(
                504, {"error": f"version {version} not loaded within {self._timeout_s} s"}
            )
        return _answer(200, done)
