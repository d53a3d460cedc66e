"""The cost model's FLOPs (benchmarks/cost_model.py) against `FlopCounterMode` on CPU steps of the Llama-like
benchmark model: the matrix multiplies of a steady step, in every mode, with ghost and direct norms."""

import pytest
import torch
from torch import nn

import flashdp
from benchmarks.cost_model import CPU_TILE, linear_step
from benchmarks.flops import counted_flops
from benchmarks.step_time import build_model, per_sample_lm_loss
from tests.oracle import seeded

VOCAB, WIDTH, LAYERS, BATCH = 256, 64, 2, 2


def _counted_step(mode: str, t: int) -> tuple[float, nn.Module]:
    """The FLOPs of the third step of `mode` on ids `[BATCH, t]`."""
    model = build_model(VOCAB, WIDTH, LAYERS)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    ids = torch.randint(0, VOCAB, (BATCH, t), generator=seeded(0))
    if mode == "non-private":

        def step() -> None:
            per_sample_lm_loss(model, ids).mean().backward()
            optimizer.step()

    else:
        engine = flashdp.make_private(
            model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0, optimizer=optimizer, expected_batch_size=BATCH,
            sample_rate=0.1, kernels="torch",
        )  # fmt: skip

        def step() -> None:
            engine.backward(per_sample_lm_loss(model, ids))
            engine.step()

    for _ in range(2):  # (the first verifies and self-checks)
        step()
    return counted_flops(step)[0], model


@pytest.mark.parametrize("t", [8, 64], ids=["ghost norms", "direct norms"])
@pytest.mark.parametrize("mode", ["non-private", "bk", "ghost"])
def test_the_formulas_count_the_matrix_multiplies_of_a_step(mode, t):
    counted, model = _counted_step(mode, t)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    predicted = sum(linear_step(mode, BATCH, t, m.in_features, m.out_features, CPU_TILE).flops for m in linears)
    if mode == "bk":  # the normalisation weights' clipped sums: a GEMV of their kept per-sample gradients
        norms = [p for name, p in model.named_parameters() if "norm" in name]
        predicted += sum(2 * BATCH * p.numel() for p in norms)
    assert counted == pytest.approx(predicted, rel=0.05)


def test_the_formulas_tell_the_strategies_apart():
    """(not a tautology of the test above: at T=8 ghost, at T=64 direct, and the counts differ by what they cost)"""
    ghost, _ = _counted_step("bk", 8)
    direct, _ = _counted_step("bk", 64)
    assert direct > 4 * ghost


def test_a_grouped_convolution_counts_what_its_groups_run_alone_count():
    """(`benchmarks/flops.py` counts a convolution's weight gradient per group: torch's formula counts G times more,
    and flashdp's per-sample convolution gradients fold the batch into G = B groups)"""
    groups, x = 4, torch.randn(2, 4 * 3, 9, 9)
    grouped = nn.Conv2d(4 * 3, 4 * 5, 3, groups=groups)
    alone = [nn.Conv2d(3, 5, 3) for _ in range(groups)]

    def backward(convs, inputs):
        return lambda: sum(conv(i).sum() for conv, i in zip(convs, inputs, strict=True)).backward()

    total, _ = counted_flops(backward([grouped], [x.requires_grad_()]))
    parts, _ = counted_flops(backward(alone, [c.detach().requires_grad_() for c in x.chunk(groups, 1)]))
    assert total == parts > 0
