import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Triton kernels run under the interpreter on machines without a GPU; it must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flashdp.kernels.runtime import triton_importable

#: tests that need Triton kernels; the suite also runs, without them, where triton is not installed
requires_triton = pytest.mark.skipif(not triton_importable(), reason="triton is not installed")
#: the engine modes, flash only where its kernels can run
MODES = ["bk", "ghost", pytest.param("flash", marks=requires_triton)]

settings.register_profile(
    "default",
    max_examples=int(os.environ.get("FLASHDP_HYPOTHESIS_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("default")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
