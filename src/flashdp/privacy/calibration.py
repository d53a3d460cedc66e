"""The noise multiplier that spends a target epsilon: bracketed cheaply with RDP (an upper bound on the tight PLD),
searched with a coarse PLD (pessimistic: never below the fine one), finished with the reporting accountant."""

from __future__ import annotations

from collections.abc import Callable

from flashdp.errors import FlashDPError
from flashdp.privacy.composition import PLD_DISCRETIZATION, AccountantKind, epsilon_of

#: PLD discretization while searching: 10x faster than the reported 1e-4 and pessimistic (never below it)
SEARCH_DISCRETIZATION = 1e-3
#: below this noise multiplier DP-SGD gives no meaningful guarantee; calibration refuses to go there
MIN_NOISE_MULTIPLIER = 1e-3
MAX_NOISE_MULTIPLIER = 1e6
#: the calibrated epsilon lies in [RELATIVE_ACCURACY * target, target]
RELATIVE_ACCURACY = 0.99


def calibrate_noise_multiplier(
    kind: AccountantKind, target_epsilon: float, target_delta: float, sample_rate: float, steps: int
) -> float:
    """A sigma whose epsilon after `steps` steps (with the `kind` accountant) lies in [0.99 * target, target].

    The search stage's bracket is left when the reporting accountant, finer, allows less noise (at small targets
    the coarse PLD overstates epsilon most)."""

    def epsilon(kind: AccountantKind, discretization: float = PLD_DISCRETIZATION) -> Callable[[float], float]:
        return lambda sigma: epsilon_of(kind, [(sigma, sample_rate, steps)], target_delta, discretization)

    what = f"epsilon {target_epsilon} at delta {target_delta} after {steps} steps at sample_rate {sample_rate}"
    upper = _rdp_upper_bracket(epsilon("rdp"), target_epsilon, what)
    lower = upper / 2
    for evaluate in (epsilon(kind, SEARCH_DISCRETIZATION), epsilon(kind)):
        lower, upper = _lower_bracket(evaluate, lower, upper, target_epsilon, what)
        upper = _bisect(evaluate, lower, upper, target_epsilon)
    return upper


def _rdp_upper_bracket(rdp_epsilon: Callable[[float], float], target: float, what: str) -> float:
    """The smallest power of two with RDP's epsilon at most the target (so every accountant's is too)."""
    if rdp_epsilon(MIN_NOISE_MULTIPLIER) <= target:
        raise FlashDPError(
            f"{what} is reached with almost no noise (sigma < {MIN_NOISE_MULTIPLIER}): DP-SGD at this epsilon is not "
            "meaningful. Lower the target, or give noise_multiplier."
        )
    sigma = 1.0
    while rdp_epsilon(sigma) > target:
        sigma *= 2
        if sigma > MAX_NOISE_MULTIPLIER:
            raise FlashDPError(
                f"No noise multiplier up to {MAX_NOISE_MULTIPLIER:g} reaches {what}. Raise the target, or lower the "
                "sample rate or the number of steps."
            )
    while sigma / 2 >= MIN_NOISE_MULTIPLIER and rdp_epsilon(sigma / 2) <= target:
        sigma /= 2
    return sigma


def _lower_bracket(
    epsilon: Callable[[float], float], lower: float, upper: float, target: float, what: str
) -> tuple[float, float]:
    """(lower, upper) with epsilon(lower) > target >= epsilon(upper), halving `lower` (epsilon(upper) <= target)."""
    while epsilon(lower) <= target:
        upper, lower = lower, lower / 2
        if lower < MIN_NOISE_MULTIPLIER:
            raise FlashDPError(
                f"{what} is reached with almost no noise (sigma < {MIN_NOISE_MULTIPLIER}): DP-SGD at this epsilon "
                "is not meaningful. Lower the target, or give noise_multiplier."
            )
    return lower, upper


def _bisect(epsilon: Callable[[float], float], lower: float, upper: float, target: float) -> float:
    """Shrink [lower, upper], with epsilon(lower) > target >= epsilon(upper), until epsilon(upper) >= 0.99 target."""
    value = epsilon(upper)
    for _ in range(60):
        if value >= RELATIVE_ACCURACY * target:
            break
        middle = (lower + upper) / 2
        middle_value = epsilon(middle)
        if middle_value <= target:
            upper, value = middle, middle_value
        else:
            lower = middle
    return upper
