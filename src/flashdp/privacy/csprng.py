"""Random numbers from the OS CSPRNG (`os.urandom`), for `secure_rng=True`."""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor


def uniform(count: int) -> Tensor:
    """`[count]` float64 uniforms in (0, 1), from 53 random bits each."""
    if not count:
        return torch.zeros(0, dtype=torch.float64, device="cpu")
    bits = torch.frombuffer(bytearray(os.urandom(8 * count)), dtype=torch.int64)
    top53 = (bits >> 11) & ((1 << 53) - 1)  # int64 shifts keep the sign: mask to 53 unsigned bits
    return (top53.double() + 0.5) / 2.0**53  # never 0: log() below stays finite


def standard_normal(count: int) -> Tensor:
    """`[count]` float64 standard normals (Box-Muller)."""
    pairs = (count + 1) // 2
    u = uniform(2 * pairs).view(2, pairs)
    radius = torch.sqrt(-2.0 * torch.log(u[0]))
    angle = 2.0 * math.pi * u[1]
    return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:count]
