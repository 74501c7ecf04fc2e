"""What the local servers started for tests, demos and development share (the Schema Registry,
:mod:`~streamproc.tools.registry_local`; the MLflow server, :mod:`~streamproc.tools.mlflow_local`):
a state folder streamproc claims (a marker file; a non-empty folder it did not create is
refused), the process started in its own session on a free loopback port with its output in a
log file and its pid in a pid file, the wait for a health URL, SIGSTOP/SIGCONT (a hung server),
and the stop (SIGTERM to the process group, SIGKILL after a deadline; idempotent).

``own_lifetime=True`` (tests, demo) kills the server with the thread that started it;
``streamproc <server> start`` passes ``own_lifetime=False`` and ``stop`` finds it by the pid
file.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from streamproc.errors import BrokerError
from streamproc.tools.kafka_local import (
    alive,
    free_port,
    read_pid,
    signal_group,
    spawn_logged,
    spawn_until_ready,
    terminate_pid,
)


@dataclass
class LocalService:
    """The base of a local server (a dataclass; a subclass adds its own fields after
    ``run_dir``, sets :attr:`NAME` (file names), :attr:`LABEL` (messages), :attr:`HEALTH_PATH`
    and implements :meth:`command`, and :attr:`address` where it is not :attr:`base_url`).

    Args:
        run_dir: folder for the log (``<NAME>.log``), the pid file and the server's own files; a
            non-empty folder that streamproc did not create is refused (BrokerError), so user
            files are never touched.
        own_lifetime: (keyword) kill the server when the starting thread dies (tests, demo);
            False for ``streamproc <server> start``.
        port: (keyword) the loopback port; 0: a free one, chosen at the first :meth:`start`
            and kept by :meth:`restart`.
    """

    NAME = "service"
    LABEL = "the service"
    HEALTH_PATH = "/health"
    run_dir: Path
    own_lifetime: bool = field(default=True, kw_only=True)
    port: int = field(default=0, kw_only=True)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    def command(self) -> tuple[list[str], dict[str, str]]:
        """The server's command line and its extra environment variables."""
        raise NotImplementedError

    @property
    def address(self) -> str:
        """What :meth:`start` returns: the URL clients are given (by default :attr:`base_url`)."""
        return self.base_url

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``: the server's root."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process id while this object started it, else None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def pid_path(self) -> Path:
        return self.run_dir / f"{self.NAME}.pid"

    @property
    def log_path(self) -> Path:
        return self.run_dir / f"{self.NAME}.log"

    @property
    def running(self) -> bool:
        """True while the process started by this object runs."""
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 120.0) -> str:
        """Start on a free loopback port and wait until the health URL answers 200.

        Returns:
            :attr:`address`.

        Raises:
            BrokerError: the folder is not streamproc's, the process exited, or it did not
                answer within ``timeout_s`` seconds (the message holds the end of the log).
        """
        self._claim_run_dir()
        self.port = self.port or free_port()
        spawn_until_ready(self, timeout_s)
        return self.address

    def restart(self, timeout_s: float = 120.0) -> str:
        """:meth:`stop`, then start again on the same port."""
        self.stop()
        return self.start(timeout_s)

    def spawn(self) -> None:
        """Start the process (does not wait)."""
        args, env = self.command()
        self._proc = spawn_logged(args, self.log_path, self.own_lifetime, self.run_dir, env)
        self.pid_path.write_text(str(self._proc.pid))

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until the health URL answers 200.

        Raises:
            BrokerError: the process exited, or no answer within ``timeout_s`` seconds.
        """
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            if self._proc is not None and self._proc.poll() is not None:
                raise BrokerError(
                    f"{self.LABEL} exited with code {self._proc.returncode}; "
                    f"{self.log_path} ends with:\n{self._log_tail()}"
                )
            if self.ready():
                return
            time.sleep(0.2)
        raise BrokerError(
            f"{self.LABEL} did not answer on {self.base_url}{self.HEALTH_PATH} within "
            f"{timeout_s:.0f} s; {self.log_path} ends with:\n{self._log_tail()}"
        )

    def ready(self) -> bool:
        """True when the health URL answers 200 now."""
        url = self.base_url + self.HEALTH_PATH
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as reply:
            return bool(reply.status == 200)
        return False

    def pause(self) -> None:
        """SIGSTOP the server (a hung server: connections open, no answers) until
        :meth:`resume`."""
        signal_group(self._proc, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the server (idempotent)."""
        signal_group(self._proc, signal.SIGCONT)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the server (SIGTERM to its group, SIGKILL after ``timeout_s``); idempotent."""
        pid = self._proc.pid if self._proc is not None else read_pid(self.pid_path)
        if pid is not None:
            self.resume()  # a stopped process only dies once continued
            terminate_pid(pid, timeout_s, self._proc)
        if self._proc is not None:
            self._proc.wait()
        self._proc = None
        self.pid_path.unlink(missing_ok=True)

    def _log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def _claim_run_dir(self) -> None:
        marker = self.run_dir / f".streamproc-{self.NAME}"
        if self.run_dir.exists() and any(self.run_dir.iterdir()) and not marker.exists():
            raise BrokerError(
                f"{self.run_dir} is not empty and was not created by streamproc; "
                f"choose a new folder for {self.LABEL}"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"state folder of {self.LABEL}, started by streamproc\n")


def require_tools(*tools: str, what: str) -> None:
    """Raise BrokerError naming the first of ``tools`` not on PATH (``what`` needs it)."""
    for tool in tools:
        if shutil.which(tool) is None:
            raise BrokerError(f"`{tool}` not found on PATH: {what} needs {', '.join(tools)}")


def maven_copy(artifact: str, into: Path) -> Path:
    """Resolve ``artifact`` (``group:artifact:version[:type[:classifier]]``) from Maven Central
    with ``mvn dependency:copy`` into the folder ``into`` (emptied first); the one file copied.

    Raises:
        BrokerError: Maven or Java is missing, or the resolution failed (Maven's output is in
            the message).
    """
    require_tools("mvn", "java", what=f"fetching {artifact}")
    shutil.rmtree(into, ignore_errors=True)
    proc = subprocess.run(
        ["mvn", "-q", "-B", "dependency:copy", f"-Dartifact={artifact}",
         f"-DoutputDirectory={into}"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    copied = list(into.glob("*")) if into.is_dir() else []
    if proc.returncode != 0 or len(copied) != 1:
        raise BrokerError(
            f"could not fetch {artifact} with Maven (exit {proc.returncode}):\n"
            f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    return copied[0]


def start_recorded(
    directory: Path, name: str, address_file: str, make: Callable[[], LocalService]
) -> tuple[str, LocalService | None, int | None]:
    """``streamproc <server> start``: unless the server recorded in ``directory`` (its
    ``<name>.pid``) still runs, stop what the pid file names and start ``make()`` in the
    background, saving its address in ``directory/address_file``.

    Returns:
        The address, the started service (None when one already ran), and the pid of the one
        that already ran (None when started now).

    Raises:
        StreamprocError: the start failed (see :meth:`LocalService.start`).
    """
    pid = read_pid(directory / f"{name}.pid")
    saved = directory / address_file
    if pid is not None and alive(pid) and saved.exists():
        return saved.read_text().strip(), None, pid
    if pid is not None:
        terminate_pid(pid, 20.0)
    service = make()
    address = service.start()
    saved.write_text(address)
    return address, service, None


def stop_recorded(directory: Path, name: str) -> int | None:
    """``streamproc <server> stop``: stop the process ``directory/<name>.pid`` names (SIGTERM,
    SIGKILL after 20 s); its pid, or None when none was recorded."""
    pid_path = directory / f"{name}.pid"
    pid = read_pid(pid_path)
    if pid is not None:
        terminate_pid(pid, 20.0)
        pid_path.unlink(missing_ok=True)
    return pid
