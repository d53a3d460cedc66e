"""Torch generators whose whole state comes from a 256-bit secret key, for noise and sampling nobody may replay.

`torch.Generator.manual_seed` keeps 32 bits of its seed on the CPU (the Mersenne twister is seeded from a 32-bit
word): a stream seeded from OS entropy that way is one of 2^32, which an adversary who knows everything but one
record (the threat model of DP) can enumerate, subtract from a released update, and read the record's gradient.
Here the twister's 624 words (19,968 bits) are filled from SHAKE-256 of the key instead. The twister is not a
cryptographic generator (624 of its exact outputs give its state away; DP-SGD adds its outputs to gradients, it does
not release them): `secure_rng=True` draws from the OS CSPRNG for a guarantee that does not rest on that.
"""

from __future__ import annotations

import hashlib
import secrets

import torch

KEY_BITS = 256

#: torch's CPU generator state (`CPUGeneratorImplState`): the seed (8 bytes), `left` and `seeded` (4 each), `next`
#: (8), then the twister's 624 words, one per 8 bytes (low 4 used), then the cached normals
_TWISTER_WORDS = 624
_WORDS_AT = 24
_STATE_BYTES = 5056


def secret_key() -> int:
    """A fresh `KEY_BITS`-bit key from the OS CSPRNG."""
    return secrets.randbits(KEY_BITS)


def keyed_generator(key: int, index: int, device: torch.device) -> torch.Generator:
    """A generator on `device` whose state is a function of (`key`, `index`) alone: equal arguments give equal
    streams (ranks sharing a key draw alike), and on the CPU every one of the twister's 19,968 state bits depends on
    the key. On other devices torch's Philox generator holds a 64-bit seed: it gets 64 bits of the key's hash."""
    generator = torch.Generator(device=device)
    stream = hashlib.shake_256(
        b"flashdp-keyed-generator" + (key % 2**KEY_BITS).to_bytes(KEY_BITS // 8, "little") + index.to_bytes(8, "little")
    )
    if device.type != "cpu":
        generator.manual_seed(int.from_bytes(stream.digest(8), "little"))
        return generator
    state = generator.get_state()
    if state.numel() != _STATE_BYTES:
        raise RuntimeError(
            f"torch's CPU generator state is {state.numel()} bytes, not the {_STATE_BYTES} flashdp fills from a key: "
            "this torch version changed its layout. Use secure_rng=True, or a torch version flashdp supports."
        )
    words = torch.frombuffer(bytearray(stream.digest(4 * _TWISTER_WORDS)), dtype=torch.int32).to(torch.int64)
    state.view(-1)[_WORDS_AT : _WORDS_AT + 8 * _TWISTER_WORDS] = (words & 0xFFFFFFFF).view(torch.uint8)
    generator.set_state(state)  # (`left` is 1, as after a seed: the first draw twists the new words)
    return generator
