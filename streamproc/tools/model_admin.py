"""The client of a running pipeline's model admin endpoint (what ``streamproc model use`` and
``streamproc model status`` call): ``POST /models/<pipeline>`` and ``GET /models`` on its
metrics port (see :mod:`streamproc.models.admin`)."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from typing import Any

DEFAULT_URL = "http://127.0.0.1:9108"


class AdminCallFailed(Exception):
    """The endpoint answered with an error status (``status``) or could not be reached (0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _call(request: urllib.request.Request, timeout_s: float) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            body: dict[str, Any] = json.loads(answer.read())
            return body
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        with contextlib.suppress(ValueError, AttributeError):
            text = json.loads(text).get("error", text)
        raise AdminCallFailed(exc.code, f"{exc.code}: {text}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise AdminCallFailed(
            0,
            f"{request.full_url}: {exc}; is the pipeline running, and is this its metrics.port "
            "(--url or $STREAMPROC_ADMIN_URL)?",
        ) from None


def use_version(
    url: str,
    token: str,
    pipeline: str,
    version: str,
    mode: str = "swap",
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Ask the pipeline process at ``url`` to load ``version`` of ``pipeline``'s model and
    switch to it at the next batch boundary (``mode="shadow"``: score it in shadow). Returns
    the endpoint's answer once the version is loaded and warmed up.

    Raises:
        AdminCallFailed: refused (the status and the reason), or the endpoint unreachable.
    """
    request = urllib.request.Request(
        f"{url.rstrip('/')}/models/{pipeline}",
        data=json.dumps({"version": version, "mode": mode}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    return _call(request, timeout_s)


def models_state(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """``GET /models``: per versioned pipeline, its versions and recent events.

    Raises:
        AdminCallFailed: the endpoint answered an error or was unreachable.
    """
    request = urllib.request.Request(f"{url.rstrip('/')}/models")
    return _call(request, timeout_s)
