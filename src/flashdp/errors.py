"""The exception flashdp raises for bad input or an unsupported model, and the warning for a weakened guarantee."""


class FlashDPError(ValueError):
    """Raised when flashdp cannot guarantee exact per-sample clipping.

    The message says what was expected, what was received and what to do.
    """


def another_rank_refused(what: str = "backward") -> FlashDPError:
    """The error of a rank whose `what` ("backward", "step") another data-parallel rank refused: every rank raises."""
    return FlashDPError(f"Another rank refused this {what} (its error names the cause); every rank stops together.")


class FlashDPWarning(UserWarning):
    """Warned when training runs but something undermines the privacy guarantee reported (e.g. batches that do not
    look Poisson-sampled while epsilon assumes they are)."""
