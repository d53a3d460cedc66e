"""DPEngine behaviour: passes, accumulation, empty batches, frozen parameters, autocast, no wrapping."""

import pytest
import torch
from hypothesis import given
from torch import nn

import flashdp
from tests.conftest import MODES
from tests.oracle import check_against_oracle, clip, grads_of, per_sample_grads
from tests.strategies import batches, clippings, modes, norm_strategies, per_sample_loss


class TwiceLinear(nn.Module):
    """One Linear called twice in a forward: its norm is that of the SUM of both contributions."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.shared = nn.Linear(d, d)
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        return self.out(self.shared(torch.tanh(self.shared(x))))


@given(batch=batches, mode=modes, clipping=clippings, strategy=norm_strategies)
def test_module_called_twice_matches_oracle(batch, mode, clipping, strategy):
    model = TwiceLinear(3).double()
    x = torch.randn(batch, 4, 3, dtype=torch.float64)
    check_against_oracle(
        model, lambda s: per_sample_loss(model(x[s])), batch, mode=mode, clipping=clipping, norm_strategy=strategy
    )


def _mlp():
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)).double()


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_no_pass_computes_a_parameter_gradient(mode, monkeypatch):
    """Autograd accumulates no parameter gradient: bk's sums, and ghost's second pass, are flashdp's own products
    of the output gradients the norms were measured from (counted by the post-accumulate hook flashdp itself puts
    on every parameter: a user's hook there is refused). (Ghost's second pass was autograd's backward of
    `sum_i c_i loss_i`, which computes the output gradients anew.)"""
    from flashdp._pipeline.grad_writes import GradWrites

    model = _mlp()
    names = {id(p): n for n, p in model.named_parameters()}
    calls = dict.fromkeys(names.values(), 0)
    after = GradWrites._after_autograd

    def counting(self, key):
        calls[names[key]] += 1
        after(self, key)

    monkeypatch.setattr(GradWrites, "_after_autograd", counting)
    with flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        engine.backward(per_sample_loss(model(torch.randn(3, 4, dtype=torch.float64))))
    assert calls == dict.fromkeys(calls, 0)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_micro_batches_accumulate_to_the_union_batch(mode):
    model = _mlp()
    x = torch.randn(7, 4, dtype=torch.float64)
    expected_norms, expected = clip(per_sample_grads(model, lambda s: per_sample_loss(model(x[s])), 7), "flat", 0.5)
    model.zero_grad(set_to_none=True)
    with flashdp.make_private(model, mode=mode, max_grad_norm=0.5, noise_multiplier=1.0) as engine:
        norms = torch.cat([engine.backward(per_sample_loss(model(x[s]))) for s in (slice(0, 3), slice(3, 7))])
    torch.testing.assert_close(norms.double(), expected_norms, rtol=1e-6, atol=0)
    for name, g in grads_of(model).items():
        torch.testing.assert_close(g, expected[name])


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_empty_batch_changes_nothing(mode):
    model = _mlp()
    with flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        x = torch.randn(3, 4, dtype=torch.float64)
        engine.backward(per_sample_loss(model(x)))
        before = [p.grad.clone() for p in model.parameters()]
        norms = engine.backward(per_sample_loss(model(torch.randn(0, 4, dtype=torch.float64))))
    assert norms.shape == (0,) and norms.dtype == torch.float32
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_only_trainable_parameters_count(mode):
    """A LoRA-like model: frozen base layers, trainable adapters and one trainable bias."""
    model = _mlp()
    for p in model.parameters():
        p.requires_grad_(False)
    model[2].bias.requires_grad_(True)
    model[4].weight.requires_grad_(True)
    x = torch.randn(5, 4, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 5, mode=mode)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_unused_layer_is_left_alone(mode):
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x):
            self.unused(x)  # called, but its output does not reach the loss
            return self.used(x)

    model = Branchy().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 4, mode=mode)
    assert model.unused.weight.grad is None


def test_forward_without_backward_does_not_disturb_the_next_step():
    """A forward with grad enabled whose loss is never clipped (e.g. a probe) holds no sway over the next one."""
    model = _mlp()
    model(torch.randn(9, 4, dtype=torch.float64))  # different batch size, never backpropagated
    x = torch.randn(3, 4, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 3)


@pytest.mark.parametrize("mode", MODES)
def test_bf16_autocast_agrees_with_float32(mode):
    """Under autocast the kernels (flash) see bf16 activations and output gradients."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Embedding(20, 16), nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 20))
    ids = torch.randint(0, 20, (4, 12))

    def run(autocast: bool):
        model.zero_grad(set_to_none=True)
        with flashdp.make_private(model, mode=mode, max_grad_norm=0.1, noise_multiplier=1.0) as engine:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(ids)
            loss = nn.functional.cross_entropy(logits.float().transpose(1, 2), ids, reduction="none").mean(1)
            norms = engine.backward(loss)
        return norms, torch.cat([p.grad.flatten() for p in model.parameters()])

    norms32, grads32 = run(False)
    norms16, grads16 = run(True)
    assert norms16.dtype == torch.float32
    torch.testing.assert_close(norms16, norms32, rtol=2e-2, atol=1e-3)
    assert (grads16 - grads32).norm() <= 3e-2 * grads32.norm()


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mha = nn.Linear(4, 8), nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.mha(h, h, h, need_weights=False)[0]


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = MixtralConfig(hidden_size=8, intermediate_size=6, num_local_experts=4, num_experts_per_tok=2)
        config._experts_implementation = "eager"
        self.inp, self.moe = nn.Linear(4, 8), MixtralSparseMoeBlock(config)
        for param in self.moe.parameters():  # (created empty: a model's from_pretrained or init fills them)
            nn.init.normal_(param, std=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(self.inp(x))


@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("build", [_Attention, _Experts])
def test_layers_whose_rules_recompute_run_under_autocast(build, mode):
    """Rules that recompute part of a layer (attention's projections, the experts' hidden activations) run as the
    forward did under CPU bfloat16 autocast, checked against autograd's per-sample gradients on every step (a bare
    dtype error before: float32 weights on bfloat16 activations)."""
    torch.manual_seed(0)
    model = build()
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0, self_check=1)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(3, 5, 4))
        assert torch.isfinite(engine.backward(out.float().square().sum((1, 2)))).all()


def test_model_is_not_wrapped_and_detach_removes_every_hook():
    model = _mlp()
    keys = list(model.state_dict())
    attributes = {name: set(vars(m)) for name, m in model.named_modules()}
    engine = flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0)
    assert isinstance(model, nn.Sequential) and list(model.state_dict()) == keys
    assert {name: set(vars(m)) for name, m in model.named_modules()} == attributes
    assert all(not hasattr(p, "grad_sample") for p in model.parameters())
    assert any(m._forward_hooks for m in model.modules())
    engine.detach()
    assert not any(m._forward_hooks for m in model.modules())


def test_context_manager_detaches():
    model = _mlp()
    with flashdp.make_private(model, mode="ghost", max_grad_norm=1.0, noise_multiplier=1.0):
        pass
    assert not any(m._forward_hooks for m in model.modules())


def test_under_no_grad_nothing_is_recorded():
    model = _mlp()
    with flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0) as engine, torch.no_grad():
        model(torch.randn(2, 4, dtype=torch.float64))
        assert engine._attachment.recorder.calls == []


def test_strategies_follow_the_cost_model_per_batch_shape():
    """The same layer is normed directly for long inputs and by ghost norm for short ones."""
    model = nn.Linear(64, 64)
    with flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        engine.backward(model(torch.randn(2, 4, 64)).sum((1, 2)))
        assert engine.strategies["weight"] == "ghost"
        engine.backward(model(torch.randn(2, 200, 64)).sum((1, 2)))
        assert engine.strategies["weight"] == "direct"


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_strategies_name_the_parameters_of_a_backward_refused_after_its_norms(mode):
    """A NaN gradient with a finite loss (sqrt at 0) is refused once the norms are in: `strategies` still shows how
    each reached parameter's norm was computed (what to look at), not the previous backward's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    x = torch.randn(3, 3)
    out = model(x)
    loss = torch.sqrt((out - out.detach()).square().sum(1))  # 0 with an infinite gradient at 0
    with pytest.raises(flashdp.FlashDPError, match="not finite"):
        engine.backward(loss)
    assert set(engine.strategies) == {"0.weight", "0.bias", "1.weight", "1.bias"}


def test_the_step_settings_can_be_changed_on_the_engine():
    """noise_multiplier, expected_batch_size, sample_rate and optimizer are the step's, read and set there."""
    torch.manual_seed(0)
    models = [nn.Linear(3, 2), nn.Linear(3, 2)]
    models[1].load_state_dict(models[0].state_dict())
    x = torch.randn(4, 3)
    engines = []
    for model, sigma in zip(models, (0.0, 5.0), strict=True):
        engine = flashdp.make_private(
            model, max_grad_norm=1.0, noise_multiplier=sigma, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            expected_batch_size=8, sample_rate=0.5, seed=0,
        )  # fmt: skip
        engines.append(engine)
    engines[1].noise_multiplier, engines[1].expected_batch_size = 0.0, 4
    engines[0].expected_batch_size = 4
    for model, engine in zip(models, engines, strict=True):
        engine.backward(model(x).sum(1))
        engine.step()
    assert engines[1].noisy_step.noise_multiplier == 0.0 and engines[1].expected_batch_size == 4
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b)
    replacement = torch.optim.SGD(models[1].parameters(), lr=0.0)
    engines[1].optimizer = replacement
    assert engines[1].noisy_step.optimizer is replacement


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_non_finite_loss_on_a_steady_step_is_refused_before_its_forward_is_taken(mode):
    """The loss is checked before anything runs on it: the same forward then takes a backward on a fixed loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.PReLU(), nn.Linear(6, 2)).double()
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    x = torch.randn(3, 4, dtype=torch.float64)
    engine.backward(model(x).square().sum(1))  # (the first backward verifies; the next is steady)
    model.zero_grad()
    out = model(x)
    with pytest.raises(flashdp.FlashDPError, match="Non-finite per-sample losses at batch indices \\[1\\]"):
        engine.backward(out.square().sum(1) * torch.tensor([1.0, float("nan"), 1.0], dtype=torch.float64))
    params = list(model.parameters())
    expected = [
        torch.cat([g.flatten() for g in torch.autograd.grad(out[i].square().sum(), params, retain_graph=True)]).norm()
        for i in range(3)
    ]
    norms = engine.backward(out.square().sum(1))
    torch.testing.assert_close(norms.double(), torch.stack(expected), rtol=1e-5, atol=1e-8)
