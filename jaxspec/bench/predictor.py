"""The speculative speedup model (Leviathan et al., 2023).

With i.i.d. per-token acceptance probability α, draft length γ and draft/target step cost ratio c, one
round emits E[τ] = (1 − α^(γ+1)) / (1 − α) tokens for the cost of γ draft steps and one target step:

    speedup(α, γ, c) = (1 − α^(γ+1)) / ((1 − α)(γc + 1))
"""

from __future__ import annotations


def expected_accepted_length(alpha: float, gamma: int) -> float:
    """E[τ] = (1 − α^(γ+1)) / (1 − α): tokens per round (γ + 1 at α = 1)."""
    _check(alpha, gamma)
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, gamma: int, c: float) -> float:
    """(1 − α^(γ+1)) / ((1 − α)(γc + 1)); c >= 0 is the draft step time over the target step time."""
    if c < 0:
        raise ValueError(f"cost ratio c must be >= 0, got {c}")
    return expected_accepted_length(alpha, gamma) / (gamma * c + 1.0)


def alpha_from_tau(tau: float, gamma: int, tol: float = 1e-10) -> float:
    """The α for which E[τ](α, γ) equals the measured τ (bisection; E[τ] increases with α).

    τ <= 1 gives 0.0, τ >= γ + 1 gives 1.0.
    """
    _check(0.0, gamma)
    if tau <= 1.0:
        return 0.0
    if tau >= gamma + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if expected_accepted_length(mid, gamma) < tau:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def best_draft_length(alpha: float, c: float, max_gamma: int = 32) -> tuple[int, float]:
    """(γ, speedup) maximizing predicted_speedup over γ in 1..max_gamma (smallest γ on ties)."""
    best = (1, predicted_speedup(alpha, 1, c))
    for gamma in range(2, max_gamma + 1):
        value = predicted_speedup(alpha, gamma, c)
        if value > best[1] + 1e-12:
            best = (gamma, value)
    return best


def _check(alpha: float, gamma: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate α must be in [0, 1], got {alpha}")
    if gamma < 1:
        raise ValueError(f"draft length γ must be >= 1, got {gamma}")
