"""Gaussian noise for DP-SGD, from the engine's own generators (one per device), or from the OS CSPRNG.

The generators' state is the noise secret: whoever holds it can regenerate every past and future draw and subtract
it from the model. It goes into checkpoints only when the user chose a seed (and so already gave the secret away
for reproducibility); otherwise a resumed run draws fresh noise from fresh entropy.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch
from torch import Tensor

from flashdp.errors import FlashDPError
from flashdp.privacy import csprng, keyed

#: how the noise is drawn: "seeded" (reproducible, checkpointed), "secret" (seeded from OS entropy, never
#: checkpointed) or "secure" (the OS CSPRNG, no state)
NoiseKind = Literal["seeded", "secret", "secure"]
NOISE_KINDS: tuple[str, ...] = ("seeded", "secret", "secure")


class NoiseSource:
    """Draws `N(0, std^2)` tensors.

    seed: what torch's generators (Philox/Mersenne) derive from, one per device, and on the CPU one per lane
        (`CPU_LANES`): the k-th generator made is seeded `generator_seed(seed, k)`, or for a secret source has its
        whole state from `keyed.keyed_generator(seed, k)`.
    kind: "seeded" when the user chose the seed (reproducible, NOT private against whoever knows the seed: it is
        kept in checkpoints for a bitwise resume); "secret" when it is a `keyed.KEY_BITS`-bit key from OS entropy
        (never checkpointed; a seed would keep 32 of its bits on the CPU);
        "secure" draws from the OS CSPRNG (`os.urandom`) with the Box-Muller transform in float64 instead (slower,
        not reproducible, no seed). Like every floating-point Gaussian sampler it does not defend against
        floating-point attacks (Mironov, CCS 2012).
    """

    def __init__(self, seed: int | None, kind: NoiseKind) -> None:
        if (seed is None) != (kind == "secure"):
            raise ValueError(f"NoiseSource: a {kind!r} source {'takes no' if kind == 'secure' else 'needs a'} seed.")
        self.kind = kind
        self._seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def gaussian(self, shape: torch.Size, std: float, device: torch.device, dtype: torch.dtype) -> Tensor:
        if self.kind == "secure":
            return (csprng.standard_normal(math.prod(shape)) * std).view(shape).to(device=device, dtype=dtype)
        noise = torch.empty(shape, device=device, dtype=torch.float32 if dtype in _HALF else dtype)
        if device.type == "cpu" and noise.numel() >= LANE_ELEMENTS:
            generators = [self._generator(device, k) for k in range(CPU_LANES)]  # (made here: seeds in order)
            lanes = zip(noise.view(-1).tensor_split(CPU_LANES), generators, strict=True)
            _in_parallel([functools.partial(lane.normal_, 0.0, std, generator=g) for lane, g in lanes])
        else:
            noise.normal_(0.0, std, generator=self._generator(device))
        return noise.to(dtype)

    def add_to(self, tensors: list[Tensor], std: float, share: Callable[[Tensor], Tensor] = lambda n: n) -> None:
        """`t += N(0, std^2 I)` for every tensor: one draw and one foreach add per bucket of tensors of one device
        and dtype (`buckets`), the draw passed through `share` first (equal noise on ranks holding the same
        coordinates)."""
        for bucket in buckets(tensors):
            flat = share(
                self.gaussian(torch.Size([sum(t.numel() for t in bucket)]), std, bucket[0].device, bucket[0].dtype)
            )
            torch._foreach_add_(bucket, torch._utils._unflatten_dense_tensors(flat, bucket))  # (views, made in C++)

    def _generator(self, device: torch.device, lane: int = 0) -> torch.Generator:
        key = str(device) if lane == 0 else f"{device}{_LANE}{lane}"
        if key not in self._generators:
            made = len(self._generators)
            if self.kind == "secret":
                self._generators[key] = keyed.keyed_generator(self._seed, made, device)
            else:
                self._generators[key] = torch.Generator(device=device).manual_seed(generator_seed(self._seed, made))
        return self._generators[key]

    def state_dict(self) -> dict:
        """The kind, and for a seeded source the seed and the generators' states (nothing secret otherwise)."""
        if self.kind != "seeded":
            return {"kind": self.kind}
        return {
            "kind": self.kind,
            "seed": self._seed,
            "generators": {k: g.get_state() for k, g in self._generators.items()},
        }

    def check_state(self, state: object) -> None:
        """Raise FlashDPError if `state` is not a noise state this source can resume from (nothing is changed)."""
        if not isinstance(state, dict) or state.get("kind") not in NOISE_KINDS:
            raise FlashDPError(
                f"Cannot resume: the checkpoint's noise state is not one flashdp wrote (expected a dict with 'kind' "
                f"in {NOISE_KINDS}). Received {_describe(state)}."
            )
        if (state["kind"] == "secure") != (self.kind == "secure"):
            raise FlashDPError("Cannot resume: the checkpoint and this engine disagree on secure_rng.")
        if state["kind"] == "seeded" and not (
            isinstance(state.get("seed"), int) and isinstance(state.get("generators"), dict)
        ):
            raise FlashDPError("Cannot resume: the checkpoint's seeded noise state lacks its seed or generators.")

    def load_state_dict(self, state: dict) -> None:
        """Continue a seeded checkpoint's stream when this source is seeded too; otherwise keep this source's own
        (fresh) noise: a secret stream is never restored, and a run resumed without a seed is private again."""
        self.check_state(state)
        if not (state["kind"] == "seeded" and self.kind == "seeded"):
            return
        self._seed = state["seed"]
        self._generators = {}
        for key, generator_state in state["generators"].items():
            generator = torch.Generator(device=torch.device(key.split(_LANE)[0]))
            generator.set_state(generator_state)
            self._generators[key] = generator


def _describe(state: object) -> str:
    return f"keys {sorted(state)}" if isinstance(state, dict) else type(state).__name__


_HALF = (torch.float16, torch.bfloat16)

_MASK64 = (1 << 64) - 1
#: the noise's own offset, so that its generators' seeds are not those of other streams seeded from the user's seed
_NOISE_SALT = 0x6E6F697365  # "noise"


def generator_seed(seed: int, k: int) -> int:
    """The seed of a noise source's k-th generator: SplitMix64 (Steele et al., 2014) of the source's seed, salted,
    and k, 63 bits. The Poisson sampler seeds from the same user seed (`seed + rank`, then per epoch): seeds of the
    form `seed + k` made the noise draw from the very stream that chose the batch (torch's CPU generator keeps the
    seed's low 32 bits, so any two seeds agreeing there are one stream)."""
    z = (seed + _NOISE_SALT + (k + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


#: a CPU draw of at least `LANE_ELEMENTS` is cut into `CPU_LANES` parts, each drawn from a generator of its own, in
#: parallel threads: torch's CPU Gaussian sampler runs on one thread (about 5 ns per element on x86-64: 13 ms a step
#: for a 2.7M-parameter ViT, 10% of its non-private step). The parts and their generators do not depend on how many
#: threads run them: a seeded stream is the same on every machine.
CPU_LANES = 4
LANE_ELEMENTS = 1 << 18
#: separates a device from a lane in a generator's key (`"cpu#2"`): lane 0 is the device's own key
_LANE = "#"
_threads: ThreadPoolExecutor | None = None


def _forget_threads() -> None:
    """In a forked child: the parent's pool threads do not exist there (its pool would wait on them forever)."""
    global _threads
    _threads = None


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_forget_threads)


def _in_parallel(draws: list[Callable[[], object]]) -> None:
    """Run `draws` together, the first on this thread, the others on the pool's (torch's ops release the GIL); one
    after the other where torch was told to use one thread (`torch.set_num_threads(1)`)."""
    global _threads
    if torch.get_num_threads() < 2:
        for draw in draws:
            draw()
        return
    if _threads is None:
        _threads = ThreadPoolExecutor(CPU_LANES - 1, thread_name_prefix="flashdp-noise")
    others = [_threads.submit(draw) for draw in draws[1:]]
    draws[0]()
    for other in others:
        other.result()


#: elements per noise draw beyond which a bucket is closed (a larger tensor is a bucket of its own): the draw's
#: memory stays that of the largest tensor or 16 MiB of float32, as with one draw per tensor
BUCKET_ELEMENTS = 1 << 22


def buckets(tensors: list[Tensor]) -> list[list[Tensor]]:
    """`tensors` in order, cut into runs of one device and dtype of at most `BUCKET_ELEMENTS` (or one tensor)."""
    out: list[list[Tensor]] = []
    open_bucket: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    filled: dict[tuple[torch.device, torch.dtype], int] = {}
    for t in tensors:
        kind = (t.device, t.dtype)
        if kind not in open_bucket or filled[kind] + t.numel() > BUCKET_ELEMENTS:
            open_bucket[kind], filled[kind] = [], 0
            out.append(open_bucket[kind])
        open_bucket[kind].append(t)
        filled[kind] += t.numel()
    return out
