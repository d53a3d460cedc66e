"""flashdp: differentially private training at the cost of ordinary training.

Exact per-sample gradient clipping for any nn.Module (book-keeping, ghost and flash engines), noise and
accounting, under DDP, FSDP2 and FSDP1.
"""

from flashdp.data import PoissonSampler, UserPoissonSampler, micro_batches, poisson_loader
from flashdp.engine import DPEngine, make_private
from flashdp.errors import FlashDPError, FlashDPWarning
from flashdp.fixer import fix_model
from flashdp.losses import per_sample_lm_loss
from flashdp.norms import PerSampleNorms
from flashdp.privacy import get_epsilon, get_noise_multiplier
from flashdp.rules import register_rule

__version__ = "0.1.0"

__all__ = [
    "DPEngine",
    "FlashDPError",
    "FlashDPWarning",
    "PerSampleNorms",
    "PoissonSampler",
    "UserPoissonSampler",
    "__version__",
    "fix_model",
    "get_epsilon",
    "get_noise_multiplier",
    "make_private",
    "micro_batches",
    "per_sample_lm_loss",
    "poisson_loader",
    "register_rule",
]
