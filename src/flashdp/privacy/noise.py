"""Gaussian noise for DP-SGD, from the engine's own generators (one per device), or from the OS CSPRNG."""

from __future__ import annotations

import math
import secrets

import torch
from torch import Tensor

from flashdp.errors import FlashDPError
from flashdp.privacy import csprng


class NoiseSource:
    """Draws `N(0, std^2)` tensors.

    seed: None seeds from OS entropy (the private default); an int makes runs reproducible and is NOT private
        (whoever knows the seed can subtract the noise).
    secure: draw from the OS CSPRNG (`os.urandom`) with the Box-Muller transform in float64 instead of torch's
        Philox/Mersenne generators. Slower; not reproducible, so its state is not checkpointed. Like every
        floating-point Gaussian sampler it does not defend against floating-point attacks (Mironov, CCS 2012).
    """

    def __init__(self, seed: int | None = None, secure: bool = False) -> None:
        if secure and seed is not None:
            raise FlashDPError("secure_rng=True draws from the OS CSPRNG and cannot be seeded; pass seed=None.")
        self.secure = secure
        self.seed = secrets.randbits(63) if seed is None else int(seed)
        self._generators: dict[str, torch.Generator] = {}

    def gaussian(self, shape: torch.Size, std: float, device: torch.device, dtype: torch.dtype) -> Tensor:
        if self.secure:
            return (csprng.standard_normal(math.prod(shape)) * std).view(shape).to(device=device, dtype=dtype)
        noise = torch.empty(shape, device=device, dtype=torch.float32 if dtype in _HALF else dtype)
        noise.normal_(0.0, std, generator=self._generator(device))
        return noise.to(dtype)

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed + len(self._generators))
            self._generators[key] = generator
        return self._generators[key]

    def state_dict(self) -> dict:
        if self.secure:
            return {"secure": True}
        return {"seed": self.seed, "generators": {k: g.get_state() for k, g in self._generators.items()}}

    def load_state_dict(self, state: dict) -> None:
        if self.secure or state.get("secure"):
            if not (self.secure and state.get("secure")):
                raise FlashDPError("Cannot resume: the checkpoint and this engine disagree on secure_rng.")
            return
        self.seed = state["seed"]
        self._generators = {}
        for key, generator_state in state["generators"].items():
            generator = torch.Generator(device=torch.device(key))
            generator.set_state(generator_state)
            self._generators[key] = generator


_HALF = (torch.float16, torch.bfloat16)
