"""bk's clipped sums reach `.grad`: small per-sample rows (biases, normalisation weights) of many parameters are
summed in one product, and each parameter still gets a gradient of its own."""

import torch
from torch import nn

import flashdp
from flashdp._pipeline import clipped_sums
from tests import oracle


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3), nn.LayerNorm(3)).double()


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().flatten(1).mean(1)


def test_every_parameter_gets_a_gradient_of_its_own_storage():
    """A .grad sharing storage with another's would share its version counter: an in-place change to one would
    look like a change to all (and the provenance guard names them all)."""
    model = _model()
    engine = flashdp.make_private(model, mode="bk", max_grad_norm=1e3, noise_multiplier=0.0)
    engine.backward(_loss(model, torch.randn(5, 4, dtype=torch.float64)))
    storages = [p.grad.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(set(storages)) == len(storages)
    engine.detach()


def test_rows_summed_together_equal_the_clipped_sum_of_per_sample_gradients(monkeypatch):
    """Whatever the size limit of a row summed with others (every parameter, or none), the same gradients: the
    clipped sum of the float64 per-sample gradients."""
    x = torch.randn(5, 4, dtype=torch.float64)
    for limit in (0, 1 << 16):
        monkeypatch.setattr(clipped_sums, "SMALL_ROWS", limit)
        model = _model()
        per_sample = oracle.per_sample_grads(model, lambda rows, m=model: _loss(m, x[rows]), len(x))
        norms, sums = oracle.clip(per_sample, "flat", 0.3)
        engine = flashdp.make_private(model, mode="bk", max_grad_norm=0.3, noise_multiplier=0.0)
        torch.testing.assert_close(engine.backward(_loss(model, x)).double(), norms, rtol=1e-6, atol=1e-9)
        assert norms.max() > 0.3  # some samples clipped
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, sums[name], rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
        engine.detach()


def test_bfloat16_kept_rows_summed_together_are_the_clipped_sum():
    """A bfloat16 model on sequences: bk keeps its layers' direct per-sample gradients in bfloat16; summed with
    float32 coefficients."""
    x = torch.randn(6, 8, 4)
    model = _model().to(torch.bfloat16)
    reference = _model().to(torch.bfloat16).double()  # the same (rounded) weights in float64
    per_sample = oracle.per_sample_grads(reference, lambda rows: _loss(reference, x[rows].double()), len(x))
    _, sums = oracle.clip(per_sample, "flat", 0.3)
    engine = flashdp.make_private(model, mode="bk", max_grad_norm=0.3, noise_multiplier=0.0)
    engine.backward(_loss(model, x.to(torch.bfloat16)))
    assert set(engine.strategies.values()) == {"direct", "per-sample"}
    for name, param in model.named_parameters():
        assert param.grad.dtype == torch.bfloat16
        torch.testing.assert_close(
            param.grad.double(), sums[name], rtol=0.05, atol=0.02, msg=lambda m, n=name: f"{n}: {m}"
        )
    engine.detach()


def test_a_backward_of_no_rows_adds_nothing():
    """A rank's empty micro-batch (DDP, FSDP run every pass on every rank): per-sample rows `[0, ...]` of
    matrix-shaped parameters too."""
    model = _model()
    engine = flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=0.0)
    engine.backward(_loss(model, torch.randn(3, 8, 4, dtype=torch.float64)))
    before = {name: p.grad.clone() for name, p in model.named_parameters()}
    engine._adapter.world_size = 2  # (as a rank of two: the passes run on zero rows)
    assert engine.backward(_loss(model, torch.randn(0, 8, 4, dtype=torch.float64))).shape == (0,)
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, before[name]), name
    engine.detach()
