"""Per-sample gradient norms without privacy: no clipping, no noise, no change to `.grad` (data valuation,
debugging, choosing a clipping bound)."""

from __future__ import annotations

from torch import Tensor, nn

from flashdp._pipeline.settings import DEFAULT_SELF_CHECK_INTERVAL, EngineSettings
from flashdp.engine import DPEngine
from flashdp.kernels import Backend
from flashdp.privacy.settings import PrivacyRequest


class PerSampleNorms:
    """The exact norm of each sample's gradient, from the same norm pass as DP training, for any `nn.Module`.

        norms = flashdp.PerSampleNorms(model)
        loss = F.cross_entropy(model(x), y, reduction="none")  # [B]
        norms(loss)                      # [B] float32: ||grad loss_i|| over all trainable parameters
        norms(loss, per_parameter=True)  # {name: [B]}, for the next forward
        norms.detach()                   # the model is plain PyTorch again

    The forward's graph is kept, so ordinary training (`loss.mean().backward()`) may follow on the same forward.
    Each forward is measured once. Like the engine, it checks what exactness rests on (one loss per sample, batch
    first, every trainable parameter counted) and raises FlashDPError where it cannot be exact.
    """

    def __init__(
        self, model: nn.Module, *, kernels: Backend = "auto", self_check: int | None = DEFAULT_SELF_CHECK_INTERVAL
    ) -> None:
        settings = EngineSettings(mode="bk", max_grad_norm=1.0, kernels=kernels, self_check=self_check)
        self._engine = DPEngine(model, settings, PrivacyRequest(noise_multiplier=0.0), trains=False)

    def __call__(self, loss: Tensor, *, per_parameter: bool = False) -> Tensor | dict[str, Tensor]:
        """loss: `[B]`, one loss per sample of the model's last forward. The norms `[B]`, or per parameter."""
        return self._engine.per_sample_norms(loss, per_parameter=per_parameter)

    def detach(self) -> None:
        """Remove every hook."""
        self._engine.detach()

    def __enter__(self) -> PerSampleNorms:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()
