"""The one exception flashdp raises for bad input or an unsupported model."""


class FlashDPError(ValueError):
    """Raised when flashdp cannot guarantee exact per-sample clipping.

    The message says what was expected, what was received and what to do.
    """
