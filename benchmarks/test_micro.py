"""pytest-benchmark micro-benchmarks: one layer's per-sample norms (and clipped sum), by implementation, over T.

    pytest benchmarks/test_micro.py      (benchmarks/run.py folds the results into the CSV)

On CPU the torch references run; the Triton kernels join on a GPU (under the interpreter they measure nothing).
"""

import pytest
import torch

from flashdp._pipeline import outer_products
from flashdp.kernels.clipped_sum import kernel as clipped_sum_kernel
from flashdp.kernels.clipped_sum import reference as clipped_sum_reference
from flashdp.kernels.outer_norm import kernel as outer_norm_kernel
from flashdp.kernels.outer_norm import reference as outer_norm_reference
from flashdp.per_sample import OuterGrad, TokenRows

D = P = 256
BATCH = 4
IMPLS = ["torch"] + (["triton"] if torch.cuda.is_available() else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _factors(seq: int):
    g = torch.Generator(device="cpu").manual_seed(0)
    left = torch.randn(BATCH, seq, P, generator=g).to(DEVICE)
    right = torch.randn(BATCH, seq, D, generator=g).to(DEVICE)
    return left, right


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seq", [128, 512, 2048])
@pytest.mark.benchmark(group="linear direct norm")
def test_direct_norm(benchmark, impl, seq):
    left, right = _factors(seq)
    fn = (outer_norm_kernel if impl == "triton" else outer_norm_reference).direct_norm_sq
    assert benchmark(fn, left, right).shape == (BATCH,)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seq", [128, 512, 2048])
@pytest.mark.benchmark(group="linear ghost norm")
def test_ghost_norm(benchmark, impl, seq):
    left, right = _factors(seq)
    fn = (outer_norm_kernel if impl == "triton" else outer_norm_reference).ghost_norm_sq
    assert benchmark(fn, left, right).shape == (BATCH,)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seq", [128, 512, 2048])
@pytest.mark.benchmark(group="linear clipped sum")
def test_clipped_sum(benchmark, impl, seq):
    left, right = _factors(seq)
    coef = torch.rand(BATCH, device=DEVICE)
    fn = (clipped_sum_kernel if impl == "triton" else clipped_sum_reference).clipped_sum
    assert benchmark(fn, left, right, coef).shape == (1, P, D)


@pytest.mark.parametrize("impl", ["torch"])
@pytest.mark.parametrize("seq", [128, 512, 2048])
@pytest.mark.benchmark(group="embedding segment-sum norm")
def test_embedding_norm(benchmark, impl, seq):
    ids = torch.randint(0, 4096, (BATCH, seq), device=DEVICE)
    block = OuterGrad(TokenRows(ids, 4096), torch.randn(BATCH, seq, D, device=DEVICE))
    assert benchmark(outer_products.token_norm_sq, block).shape == (BATCH,)
