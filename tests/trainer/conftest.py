"""Shared checks for the trainer's multi-rank equality tests."""

from __future__ import annotations

import torch

ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which Policy keeps
ADAM_BETA1 = 0.9


def assert_same_adam_update(
    one_weights: dict[str, torch.Tensor],
    two_weights: dict[str, torch.Tensor],
    one_moments: dict[str, torch.Tensor],
    two_moments: dict[str, torch.Tensor],
    one_start: dict[str, torch.Tensor],
    two_start: dict[str, torch.Tensor],
    lr: float,
) -> None:
    """One process and two ranks took the same first AdamW step of an optimizer.

    Gradients: the ranks add their partial sums in another order than one process; where
    partial sums cancel, the error is relative to the tensor's largest values, not to the
    element's. So the first moments (``(1 - beta1) * g`` after a first step) must agree to
    rtol 1e-4 plus 1e-3 of the tensor's largest moment (measured: up to 2e-4 of it when the
    step follows an earlier one, 1e-5 for a first one). A lost rank's share or a doubled
    average is off by far more.

    Weights: a first step moves each weight by ``lr * g / (|g| + eps)``. Its sensitivity to
    the gradient is ``lr * eps / (|g| + eps)**2``: nil where |g| is far above eps, up to
    the step itself where |g| is near eps (a gradient of ~1e-9 is mostly rounding). Each
    side's step (weights after minus that side's weights before, so a later stage does not
    inherit an earlier stage's noise) must agree to 1% of the learning rate plus what the
    two sides' measured gradient difference explains through that sensitivity.
    """
    assert one_moments and one_moments.keys() == two_moments.keys()
    for name, value in one_moments.items():
        scale = float(value.abs().max())
        torch.testing.assert_close(two_moments[name], value, rtol=1e-4, atol=1e-3 * scale)
    moved = 0.0
    for name, after in one_weights.items():
        step_one = after - one_start[name]
        step_two = two_weights[name] - two_start[name]
        moved += float(step_one.abs().max())
        key = name if name in one_moments else None
        if key is None:  # tied to a trained tensor (lm_head to the embedding)?
            key = next((n for n in one_moments if torch.equal(one_weights[n], after)), None)
        if key is None:  # not trained (frozen or a buffer): untouched on both sides
            torch.testing.assert_close(step_two, step_one, rtol=0, atol=0)
            continue
        g_one = one_moments[key] / (1 - ADAM_BETA1)
        g_two = two_moments[key] / (1 - ADAM_BETA1)
        smaller = torch.minimum(g_one.abs(), g_two.abs())
        explained = lr * ADAM_EPS * (g_two - g_one).abs() / (smaller + ADAM_EPS) ** 2
        tolerance = 0.01 * lr + explained.clamp(max=2 * lr)
        excess = (step_two - step_one).abs() - tolerance
        worst = int(excess.argmax())
        assert float(excess.max()) <= 0, (
            f"{name}: steps differ by {float((step_two - step_one).flatten()[worst]):.3g} "
            f"at flat index {worst}, tolerance {float(tolerance.flatten()[worst]):.3g}"
        )
    assert moved > 0.1 * lr  # the step did move the weights
