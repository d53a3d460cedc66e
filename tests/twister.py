"""What a torch CPU generator's state says about how it was seeded."""

import torch


def is_a_seeds_expansion(generator: torch.Generator) -> bool:
    """Whether a fresh CPU generator's 624 Mersenne-twister words follow the twister's seeding recurrence
    (Matsumoto and Nishimura, 1998: `w[i] = 1812433253 * (w[i-1] ^ (w[i-1] >> 30)) + i mod 2^32`): then the
    whole state is a function of its first word, 32 bits."""
    state = generator.get_state().numpy().tobytes()
    words = [int.from_bytes(state[24 + 8 * i : 24 + 8 * i + 4], "little") for i in range(624)]
    return all(words[i] == (1812433253 * (words[i - 1] ^ (words[i - 1] >> 30)) + i) & 0xFFFFFFFF for i in range(1, 624))
