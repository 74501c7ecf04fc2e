"""The helpers of tests/k8s without a cluster: a stand-in ``kubectl`` on PATH plays two pods."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest

from tests.k8s import kube
from tests.k8s.kube import LogFollower, wait_for

# "ended" logs one line and exits (a pod deleted under the follower); "live" logs one line and
# keeps following (a pod still running when the test stops following). Every `logs -f` records
# its pid.
FAKE_KUBECTL = r"""#!/usr/bin/env bash
case "$1 $2" in
  "get pods") echo '{"items": [{"metadata": {"name": "ended"}}, {"metadata": {"name": "live"}}]}' ;;
  "get pod") exit 0 ;;
  "logs -f")
    echo $$ >>"$FAKE_KUBECTL_PIDS"
    echo '{"timestamp": "2026-01-01T00:00:00+00:00", "event": "partitions assigned",'\
      '"partitions": ["t[0]"]}'
    if [ "$5" = live ]; then exec sleep 600; fi
    ;;
  *) exit 1 ;;
esac
"""


def _running(pid: int) -> bool:
    """Whether PID exists (a zombie nobody reaped counts: it was not waited for)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_log_follower_stop_closes_every_pipe_and_reaps_every_kubectl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(FAKE_KUBECTL)
    kubectl.chmod(kubectl.stat().st_mode | stat.S_IXUSR)
    pids_file = tmp_path / "pids"
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_KUBECTL_PIDS", str(pids_file))

    def pids() -> list[int]:
        return [int(p) for p in pids_file.read_text().split()] if pids_file.exists() else []

    follower = LogFollower("ns", "app=x")
    try:
        wait_for(
            "a log line of both pods and the end of the deleted one's stream",
            lambda: (
                {"ended", "live"} <= set(follower.streams)
                and all(follower.streams[p].lines for p in ("ended", "live"))
                and follower.streams["ended"].ended is not None
            ),
            60,
            0.1,
        )
        follower.stop()
        left = [pid for pid in pids() if _running(pid)]
        assert len(pids()) == 2 and not left, f"kubectl logs -f left running or unreaped: {left}"
        assert follower.streams["live"].ended is not None
        assert follower.first_assignment("live") is not None
    finally:
        for pid in pids():  # never leave the stand-in's sleep behind, whatever failed
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_timed_out_wait_carries_the_namespace_diagnosis(monkeypatch: pytest.MonkeyPatch) -> None:
    # a Ready pod that never came said only "(None)": the pods, events and logs now come with it
    monkeypatch.setattr(kube, "diagnosis", lambda namespace: f"pods and events of {namespace}")
    with pytest.raises(
        AssertionError, match=r"waiting for one Ready pod \(None\)\npods and events"
    ):
        wait_for("one Ready pod", lambda: None, 0.0, 0.0, diagnose="streaming")


def test_the_scrape_targets_name_each_pod_behind_the_metrics_services(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prometheus' HTTP service discovery (tests/k8s/prometheus.py): one target group per pod
    and metrics port, ready or not, labelled as a ServiceMonitor labels its series."""
    from tests.k8s import prometheus

    endpoints = {
        "items": [
            {
                "metadata": {"name": "share-streamproc"},
                "subsets": [
                    {
                        "addresses": [{"ip": "10.244.0.7", "targetRef": {"name": "share-a"}}],
                        "notReadyAddresses": [{"ip": "10.244.0.8", "targetRef": {"name": "b"}}],
                        "ports": [{"name": "http-metrics", "port": 9108}, {"name": "x", "port": 1}],
                    }
                ],
            },
            {"metadata": {"name": "no-pods-yet"}},
        ]
    }
    asked: list[tuple[str, ...]] = []

    def fake_kubectl_json(*args: str) -> object:
        asked.append(args)
        return endpoints

    monkeypatch.setattr(prometheus, "kubectl_json", fake_kubectl_json)
    assert prometheus.scrape_targets("streaming") == [
        {
            "targets": ["10.244.0.7:9108"],
            "labels": {"namespace": "streaming", "service": "share-streamproc", "pod": "share-a"},
        },
        {
            "targets": ["10.244.0.8:9108"],
            "labels": {"namespace": "streaming", "service": "share-streamproc", "pod": "b"},
        },
    ]
    assert asked == [("get", "endpoints", "-n", "streaming", "-l", "streamproc.io/metrics=true")]
