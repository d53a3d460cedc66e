"""DP-SGD's step over the clipped sums that `engine.backward` left in `.grad`, one stage per method:
hooks (`register_hook`), the wrapper's reduction, the noise, 1 / expected_batch_size, the optimizer, the
accountant and the sampling monitor; and the state a resumed run needs."""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from flashdp._checks import checked_delta
from flashdp._pipeline.clipping import clip_coefficients
from flashdp._pipeline.params import TrainableParam
from flashdp._pipeline.plan import GradientPlan
from flashdp._pipeline.profiling import PhaseTimer
from flashdp._pipeline.provenance import GradientProvenance
from flashdp._pipeline.settings import EngineSettings
from flashdp.distributed import Adapter
from flashdp.distributed.checks import check_global_batch
from flashdp.errors import FlashDPError, FlashDPWarning
from flashdp.privacy import Accountant, NoiseSource
from flashdp.privacy.sampling import SamplingMonitor
from flashdp.privacy.settings import PrivacySettings

#: the settings a resumed run must share with the checkpointed one
RESUMED_SETTINGS = ("noise_multiplier", "sample_rate", "max_grad_norm")


def _privacy_setting(name: str) -> property:
    """A privacy setting of the step (`PrivacySettings`), checked when set as at make_private."""

    def assign(step: NoisyStep, value: object) -> None:
        step._privacy = dataclasses.replace(step._privacy, **{name: value})
        step._settings_changed()

    return property(lambda step: getattr(step._privacy, name), assign, doc=f"`PrivacySettings.{name}`.")


class NoisyStep:
    """`step()`: for every trainable p, `p.grad = (p.grad + N(0, sigma^2 C^2 I)) / expected_batch_size`, then
    `optimizer.step()`, `optimizer.zero_grad()` and one accountant step. `engine.noisy_step` is the engine's.

    Extension point: `register_hook(hook)` runs `hook()` at every step once the clipped sums are in `.grad` (each
    rank's own, before the wrapper's reduction) and before the noise: what a hook adds to `parameters()`' `.grad`
    is noised and averaged like a sample's clipped gradient (the canary audit adds its canaries there)."""

    def __init__(
        self,
        settings: EngineSettings,
        privacy: PrivacySettings,
        optimizer: torch.optim.Optimizer | None,
        adapter: Adapter,
        noise: NoiseSource,
        provenance: GradientProvenance,
        timer: PhaseTimer,
    ) -> None:
        self._privacy = privacy
        self._max_grad_norm = settings.max_grad_norm
        self.optimizer = optimizer
        self.noise = noise
        self._clipping = settings.clipping
        self._adapter, self._provenance, self._timer = adapter, provenance, timer
        self._params: list[TrainableParam] = []
        self._clip_group_count = 0
        self._accountant = Accountant(privacy.accountant)
        self._sampling = SamplingMonitor((self.expected_batch_size or 0) / adapter.world_size, self.sample_rate)
        self._hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()  # (a RemovableHandle holds a weakref)
        self._samplers: weakref.WeakSet = weakref.WeakSet()
        self._backward_since_step = False
        self._samples_since_step = 0

    # -- the privacy settings: checked when set (a NaN or negative sigma would add no noise) -----------------

    noise_multiplier = _privacy_setting("noise_multiplier")
    sample_rate = _privacy_setting("sample_rate")
    expected_batch_size = _privacy_setting("expected_batch_size")

    def follow_rate(self, sampler: object) -> None:
        """Have `sampler` (of a loader `engine.data_loader` made) sample at the rate set on the engine from now on."""
        self._samplers.add(sampler)

    def _settings_changed(self) -> None:
        """The sampling monitor expects, and the engine's loaders sample at, the settings now set."""
        self._sampling.expect((self.expected_batch_size or 0) / self._adapter.world_size, self.sample_rate)
        for sampler in self._samplers:  # (at the rate the accountant composes)
            sampler.sample_rate = self.sample_rate

    @property
    def max_grad_norm(self) -> float:
        """C: fixed at make_private (the clipping reads it too)."""
        return self._max_grad_norm

    def follow(self, plan: GradientPlan) -> None:
        """Step the trainable parameters of `plan` (the engine's, once a backward committed it)."""
        self._params = plan.params
        self._clip_group_count = len(plan.clip_group_names)

    # -- what a hook may use ------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """The data-parallel ranks the step's sum is reduced over."""
        return self._adapter.world_size

    def parameters(self) -> list[Tensor]:
        """The tensors whose `.grad` this rank's step noises (each trainable parameter, or its local shard)."""
        return self._adapter.gradient_holders(self._params)

    def clip_groups(self) -> tuple[int, list[int]]:
        """The number L of clipping groups, and the group of each of `parameters()` (per-layer clipping clips each
        group to `C / sqrt(L)`; the other styles clip their sum)."""
        return self._clip_group_count, [param.clip_group for param in self._params]

    def clip_coefficients(self, group_norms_sq: Tensor) -> Tensor:
        """`[L, B]` clipping coefficients, as the engine computes them, from `[L, B]` squared norms of the L
        clipping groups (see `clip_groups`)."""
        return clip_coefficients(self._clipping, group_norms_sq, self.max_grad_norm)

    def register_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Run `hook()` at every step before the noise (see the class); `.remove()` on the handle stops it."""
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    # -- the step -----------------------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """DP-SGD steps taken (and accounted for)."""
        return self._accountant.steps

    def backward_done(self, samples: int) -> None:
        """A backward (of `samples` samples, maybe 0) added its clipped sums: a step may follow."""
        self._backward_since_step = True
        self._samples_since_step += samples

    def __call__(self) -> None:
        self._check_ready()
        params = self.parameters()
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            for hook in list(self._hooks.values()):
                hook()
            with self._timer.phase("communication"):
                self._adapter.reduce_gradients(params)
            with self._timer.phase("noise"):
                self._add_noise(params)
        with self._timer.phase("optimizer"), self._provenance.engine_step():
            self.optimizer.step()
            self.optimizer.zero_grad()
            self._adapter.zero_grad()
        self._provenance.stepped()
        self._account()

    def _check_ready(self) -> None:
        if self.optimizer is None:
            raise FlashDPError("engine.step() needs an optimizer: make_private(..., optimizer=opt).")
        if self.expected_batch_size is None:
            raise FlashDPError(
                "engine.step() needs expected_batch_size, the global logical batch size (sample_rate * dataset "
                "size), to average the noisy sum: make_private(..., expected_batch_size=...)."
            )
        if not self._backward_since_step:
            raise FlashDPError(
                "engine.step() called with no engine.backward() since the last step: each step must follow at "
                "least one backward (for an empty Poisson batch, engine.backward_empty())."
            )
        group = self._adapter.dp_group
        gradients = self._adapter.accumulated_gradients(self._params)
        refusal = self._provenance.refusal_before_step(gradients, collective=group is not None)
        if group is not None:
            check_global_batch(self.expected_batch_size, self._samples_since_step, group, refusal)

    def _add_noise(self, params: list[Tensor]) -> None:
        """`(sum + N(0, sigma^2 C^2 I)) / expected_batch_size`, each coordinate noised once over the ranks."""
        std = self.noise_multiplier * self.max_grad_norm
        grads = [self._adapter.local_grad(p) for p in params]
        if std > 0:
            self.noise.add_to(grads, std, share=self._adapter.shared_noise)
        torch._foreach_div_(grads, self.expected_batch_size)

    def _account(self) -> None:
        self._accountant.step(self.noise_multiplier, self.sample_rate or 0.0)
        finding = self._sampling.record(self._samples_since_step)
        if finding is not None:
            warnings.warn(f"Batches do not look Poisson-sampled: {finding}", FlashDPWarning, stacklevel=4)
        self._backward_since_step = False
        self._samples_since_step = 0

    # -- privacy spent, and resuming ----------------------------------------------------------------------

    def epsilon(self, delta: float) -> float:
        """The epsilon spent so far at this delta (see `DPEngine.epsilon`)."""
        if self.sample_rate is None:
            raise FlashDPError(
                "epsilon() needs the Poisson sampling rate: make_private(..., sample_rate=q), with q = "
                "expected_batch_size / len(dataset)."
            )
        delta = checked_delta(delta)
        if self._sampling.finding is not None:
            warnings.warn(
                f"This epsilon assumes Poisson sampling at rate {self.sample_rate}, but {self._sampling.finding}",
                FlashDPWarning,
                stacklevel=3,
            )
        return self._accountant.epsilon(delta)

    def state_dict(self) -> dict:
        """See `DPEngine.state_dict`."""
        return {
            **{key: getattr(self, key) for key in RESUMED_SETTINGS},
            "accountant": self._accountant.state_dict(),
            "noise": self.noise.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """See `DPEngine.load_state_dict`: everything is checked before anything is loaded."""
        if not isinstance(state, dict):
            raise FlashDPError(f"load_state_dict expects engine.state_dict()'s dict. Received {type(state).__name__}.")
        missing = [key for key in (*RESUMED_SETTINGS, "accountant", "noise") if key not in state]
        if missing:
            raise FlashDPError(
                f"Cannot resume: the checkpoint lacks {', '.join(map(repr, missing))} (it has {sorted(state)}). "
                "Pass what engine.state_dict() returned; nothing was loaded."
            )
        for key in RESUMED_SETTINGS:
            if state[key] != getattr(self, key):
                raise FlashDPError(
                    f"Cannot resume: the checkpoint has {key}={state[key]!r}, this engine {getattr(self, key)!r}. "
                    "Build the engine with the settings of the run you resume."
                )
        self._accountant.check_state(state["accountant"])
        self.noise.check_state(state["noise"])
        self._accountant.load_state_dict(state["accountant"])
        self.noise.load_state_dict(state["noise"])
