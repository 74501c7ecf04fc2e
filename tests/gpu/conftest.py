"""The ``gpu`` tier: the CUDA backend run for real on a GPU (``make test-gpu``).

Collected only where ``torch.cuda.is_available()``. Elsewhere the tier is not collected at all
(a file of it named on the command line is collected, then deselected): nothing in it is
skipped, so nothing in it counts as passed, and the run's summary says so in one line
(``make test-gpu`` then ends with pytest's "no tests ran", exit status 5).
"""

from __future__ import annotations

import pytest
import torch

CUDA_PRESENT = torch.cuda.is_available()

collect_ignore_glob = [] if CUDA_PRESENT else ["test_*.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if CUDA_PRESENT:
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not CUDA_PRESENT:
        terminalreporter.write_line(
            "gpu tier (tests/gpu): not collected: torch.cuda.is_available() is False here"
        )
