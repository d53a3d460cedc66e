import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Triton kernels run under the interpreter on machines without a GPU; it must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flashdp.kernels.runtime import triton_importable
from flashdp.rules import registry

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


@pytest.fixture(autouse=True)
def _rule_registry():
    """Rules a test registers for its own layer classes are gone after it (the supported-layers page is generated
    from the registry, whichever tests ran before in the same process)."""
    types, predicates = dict(registry._TYPE_RULES), list(registry._PREDICATE_RULES)
    yield
    registry._TYPE_RULES.clear()
    registry._TYPE_RULES.update(types)
    registry._PREDICATE_RULES[:] = predicates
