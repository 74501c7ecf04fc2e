"""A batch's bound call: fallback to the predecessor, shadow comparison."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from streamproc.device.binding import BoundCall, ModelBinding


def doubling(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (x * 2,)


def raising(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    raise RuntimeError("new version fails")


def test_the_bound_version_runs_and_names_itself() -> None:
    call = BoundCall(ModelBinding("2", doubling), rows=3)
    (out,) = call(torch.ones(3, 1))
    assert out.tolist() == [[2.0]] * 3
    assert call.version == "2" and not call.raised and call.shadow_outcome() is None


def test_a_raising_version_falls_back_to_its_predecessor_for_the_whole_batch() -> None:
    calls: list[int] = []

    def old(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        calls.append(x.shape[0])
        return (x * 3,)

    call = BoundCall(ModelBinding("2", raising, fallback=ModelBinding("1", old)), rows=4)
    (out,) = call(torch.ones(4, 1))
    assert out.tolist() == [[3.0]] * 4 and call.version == "1" and call.raised
    call(torch.ones(2, 1))  # a part of the same batch: the predecessor again, not the new one
    assert calls == [4, 2]


def test_without_a_predecessor_the_error_reaches_the_part_runner() -> None:
    with pytest.raises(RuntimeError, match="new version fails"):
        BoundCall(ModelBinding("2", raising), rows=2)(torch.ones(2, 1))


def test_the_shadow_counts_agreeing_rows_and_never_changes_the_outputs() -> None:
    def almost(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = x * 2
        out[0] += 1.0  # row 0 disagrees
        return (out,)

    binding = ModelBinding("1", doubling, shadow=ModelBinding("2", almost))
    call = BoundCall(binding, rows=5)
    (out,) = call(torch.ones(5, 3))
    assert torch.equal(out, torch.full((5, 3), 2.0))
    outcome = call.shadow_outcome()
    assert outcome is not None and outcome.version == "2"
    assert (outcome.rows, outcome.agreed, outcome.error) == (5, 4, None)
    assert outcome.serving_s >= 0 and outcome.shadow_s >= 0


def test_a_raising_shadow_is_recorded_and_the_batch_goes_on() -> None:
    call = BoundCall(ModelBinding("1", doubling, shadow=ModelBinding("2", raising)), rows=2)
    (out,) = call(torch.ones(2, 1))
    assert out.tolist() == [[2.0], [2.0]]
    outcome = call.shadow_outcome()
    assert outcome is not None and outcome.agreed == 0
    assert outcome.error == "RuntimeError: new version fails"


def test_the_shadow_runs_only_on_the_whole_batch() -> None:
    call = BoundCall(ModelBinding("1", doubling, shadow=ModelBinding("2", doubling)), rows=4)
    call(torch.ones(2, 1))  # a part (a re-run after an error): no shadow
    assert call.shadow_outcome() is None


@pytest.mark.parametrize("shadow_first", [False, True])
def test_the_shadow_runs_before_or_after_the_serving_version_as_bound(shadow_first: bool) -> None:
    order: list[str] = []

    def named(name: str) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
        def run(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            order.append(name)
            return (x * 2,)

        return run

    binding = ModelBinding(
        "1", named("serving"), shadow=ModelBinding("2", named("shadow")), shadow_first=shadow_first
    )
    call = BoundCall(binding, rows=3)
    (out,) = call(torch.ones(3, 1))
    assert out.tolist() == [[2.0]] * 3
    assert order == (["shadow", "serving"] if shadow_first else ["serving", "shadow"])
    outcome = call.shadow_outcome()
    assert outcome is not None and outcome.agreed == 3
