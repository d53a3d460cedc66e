"""The engine's settings from make_private, checked once (the privacy arguments: `flashdp.privacy.settings`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from flashdp._checks import is_int, is_number
from flashdp._pipeline.clipping import CLIPPING_STYLES, Clipping
from flashdp._pipeline.param_grad import StrategyChoice
from flashdp.errors import FlashDPError
from flashdp.kernels import BACKENDS, Backend, triton_unavailable_reason

Mode = Literal["ghost", "flash", "bk"]
MODES: tuple[str, ...] = ("ghost", "flash", "bk")
NORM_STRATEGIES: tuple[str, ...] = ("auto", "ghost", "direct")
#: what a backward does with samples whose per-sample gradient is not finite (NaN or inf)
NonFinite = Literal["error", "skip"]
NONFINITE_POLICIES: tuple[str, ...] = ("error", "skip")
#: backward calls between two self-checks by default (the first backward is always checked)
DEFAULT_SELF_CHECK_INTERVAL = 200


@dataclass(frozen=True)
class EngineSettings:
    """How the engine clips. `kernels` is the backend requested; `backend` the one it runs."""

    mode: Mode
    max_grad_norm: float
    clipping: Clipping = "flat"
    norm_strategy: StrategyChoice = "auto"
    kernels: Backend = "auto"
    seed: int | None = None
    secure_rng: bool = False
    profile: bool = False
    #: "error": raise, naming the samples, before any gradient changes; "skip": their contribution is zero
    nonfinite: NonFinite = "error"
    #: the self-check runs on the first backward and then every `self_check` backward calls; None: never
    self_check: int | None = DEFAULT_SELF_CHECK_INTERVAL
    backend: str = field(init=False)

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, MODES)
        _check_choice("kernels", self.kernels, BACKENDS)
        object.__setattr__(self, "backend", self._resolve_backend())
        _check_choice("clipping", self.clipping, CLIPPING_STYLES)
        _check_choice("norm_strategy", self.norm_strategy, NORM_STRATEGIES)
        _check_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise FlashDPError(f"seed must be an int or None. Received {self.seed!r}.")
        if self.secure_rng and self.seed is not None:
            raise FlashDPError("secure_rng=True draws from the OS CSPRNG and cannot be seeded; pass seed=None.")
        c = self.max_grad_norm
        if not (is_number(c) and 0 < c < float("inf")):
            raise FlashDPError(f"max_grad_norm must be a positive finite number. Received {c!r}.")
        interval = self.self_check
        if interval is not None and not (is_int(interval) and interval > 0):
            raise FlashDPError(
                f"self_check is the number of backward calls between two self-checks (a positive int), or None to "
                f"turn it off. Received {interval!r}."
            )

    def _resolve_backend(self) -> str:
        """The kernels this engine runs: flash means Triton kernels; "triton" must be able to run here."""
        if self.mode == "flash" and self.kernels == "torch":
            raise FlashDPError("mode='flash' computes norms with Triton kernels; kernels='torch' contradicts it.")
        if self.mode == "flash" or self.kernels == "triton":
            reason = triton_unavailable_reason()
            if reason is not None:
                what = "mode='flash'" if self.mode == "flash" else "kernels='triton'"
                raise FlashDPError(
                    f"{what} needs Triton kernels, which cannot run here: {reason}. Use mode='bk' (one backward, "
                    "plain PyTorch) or mode='ghost'."
                )
            return "triton"
        return self.kernels

    @property
    def fills_grad_by_second_backward(self) -> bool:
        """ghost and flash fill `.grad` by a second backward, except per-layer clipping, which needs bk's sums."""
        return self.mode in ("ghost", "flash") and self.clipping != "per_layer"


def _check_choice(what: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise FlashDPError(f"{what} must be one of {', '.join(map(repr, allowed))}. Received {value!r}.")
