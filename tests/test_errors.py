"""Bad input fails loudly at the earliest point, naming the culprit and what to do."""

import pytest
import torch
from torch import nn

import flashdp
from flashdp import FlashDPError


def _mlp():
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


@pytest.fixture
def engine():
    model = _mlp()
    with flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0) as eng:
        yield model, eng


def test_scalar_loss_is_refused(engine):
    model, eng = engine
    with pytest.raises(FlashDPError, match=r"expected a 1-D loss of shape \(B,\).*Received a 0-dim"):
        eng.backward(model(torch.randn(3, 4)).sum())


def test_two_dim_loss_is_refused(engine):
    model, eng = engine
    with pytest.raises(FlashDPError, match=r"Received a 2-dim tensor of shape \(3, 2\).*reduction='none'"):
        eng.backward(model(torch.randn(3, 4)))


def test_non_tensor_loss_is_refused(engine):
    _, eng = engine
    with pytest.raises(FlashDPError, match="Received list"):
        eng.backward([1.0, 2.0])


def test_loss_batch_not_matching_forward_names_the_layer(engine):
    model, eng = engine
    out = model(torch.randn(3, 4))
    with pytest.raises(FlashDPError, match=r"loss has 2 per-sample values, but layer '0' \(Linear\).*batch of 3"):
        eng.backward(out[:2].sum(1))


class Folding(nn.Module):
    """[B, T, d] -> [B * T, d] rows for the Linear (OPT and Mixtral fold the batch into rows like this)."""

    def __init__(self, time_major: bool = False):
        super().__init__()
        self.time_major = time_major
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        b, t, _ = x.shape
        if self.time_major:  # rows t * B + b: not grouped by sample
            return self.lin(x.transpose(0, 1).reshape(-1, 4)).view(t, b, -1).transpose(0, 1).flatten(1)
        return self.lin(x.reshape(-1, 4)).view(b, -1)


def test_a_batch_folded_into_rows_sample_major_is_exact():
    from tests.oracle import check_against_oracle
    from tests.strategies import per_sample_loss

    model = Folding().double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 3)


def test_a_batch_folded_into_rows_not_by_sample_is_caught():
    model = Folding(time_major=True)
    with flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0) as eng:
        out = model(torch.randn(3, 5, 4))
        with pytest.raises(FlashDPError, match=r"not separable by sample: 'lin' \(Linear\)"):
            eng.backward(out.square().sum(1))


def test_backward_without_forward(engine):
    model, eng = engine
    loss = model(torch.randn(2, 4)).sum(1)
    eng.backward(loss)
    with pytest.raises(FlashDPError, match="found no forward pass"):
        eng.backward(torch.ones(2, requires_grad=True))


def test_non_finite_losses_name_the_samples(engine):
    model, eng = engine
    loss = model(torch.randn(4, 4)).sum(1) * torch.tensor([1.0, float("nan"), 1.0, float("inf")])
    with pytest.raises(FlashDPError, match=r"Non-finite per-sample losses at batch indices \[1, 3\]"):
        eng.backward(loss)


def test_loss_not_requiring_grad(engine):
    model, eng = engine
    model(torch.randn(2, 4))
    with pytest.raises(FlashDPError, match="does not require grad"):
        eng.backward(torch.ones(2))


def test_loss_independent_of_the_model(engine):
    model, eng = engine
    model(torch.randn(2, 4))
    with pytest.raises(FlashDPError, match="does not depend on any trainable layer"):
        eng.backward(torch.ones(2, requires_grad=True) * 2)


class Scale(nn.Module):
    """`x * gain`, or `x @ gain` (`mixing`: a matrix)."""

    def __init__(self, mixing: bool = False):
        super().__init__()
        self.gain, self.mixing = nn.Parameter(torch.eye(3) if mixing else torch.ones(3)), mixing

    def forward(self, x):
        return x @ self.gain if self.mixing else x * self.gain


@pytest.mark.parametrize(("mixing", "strategy"), [(True, "generic"), (False, "broadcast")])
def test_a_module_without_a_rule_gets_the_generic_one_exactly(mixing, strategy):
    """A parameter scaling the batch elementwise is counted where it meets the batch, without the generic rule."""
    from tests.oracle import check_against_oracle
    from tests.strategies import per_sample_loss

    model = nn.Sequential(nn.Linear(3, 3), Scale(mixing)).double()
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 4)
    model.zero_grad()
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        engine.backward(per_sample_loss(model(x)))
        assert engine.strategies["1.gain"] == strategy


class OnlyWholeBatches(nn.Module):
    """Runs on a batch of 4 rows only, raising an error without a message otherwise (one sample's rows too)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.eye(3))

    def forward(self, x):
        if x.dim() != 2 or x.shape[0] != 4:
            raise ValueError()
        return x @ self.gain


def test_a_module_the_generic_rule_cannot_run_per_sample_is_refused_naming_errors_without_a_message():
    """(Naming an error raised without a message read its first line: an IndexError from flashdp.)"""
    model = nn.Sequential(nn.Linear(3, 3), OnlyWholeBatches())
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        loss = model(torch.randn(4, 3)).sum(1)
        with pytest.raises(FlashDPError, match=r"cannot run its forward one sample at a time \(ValueError: \)"):
            engine.backward(loss)


def test_uncovered_parameter_may_be_frozen_instead():
    model = nn.Sequential(nn.Linear(3, 3), Scale())
    model[1].gain.requires_grad_(False)
    flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0).detach()


def test_register_rule_then_exact():
    """A user rule for a custom layer, by type; then the engine is exact on it."""
    from tests.oracle import check_against_oracle
    from tests.strategies import per_sample_loss

    class Gain(Scale):
        pass

    def gain_grads(module, inputs, grad_output, trainable):
        (x,) = inputs
        return {"gain": (x * grad_output).reshape(x.shape[0], -1, x.shape[-1]).sum(1)}

    flashdp.register_rule(Gain, gain_grads)
    model = nn.Sequential(nn.Linear(3, 3), Gain()).double()
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 4)


def test_register_rule_rejects_non_modules():
    with pytest.raises(TypeError, match=r"expected an nn\.Module subclass or a predicate"):
        flashdp.register_rule(int, lambda *a: {})
    with pytest.raises(TypeError, match=r"expected an nn\.Module subclass or a predicate"):
        flashdp.register_rule("Linear", lambda *a: {})


def test_rule_returning_a_wrong_shape_is_caught():
    class Odd(Scale):
        pass

    flashdp.register_rule(Odd, lambda module, inputs, g, trainable: {"gain": torch.zeros(7)})
    model = Odd()
    with flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0) as eng:
        out = model(torch.randn(2, 3))
        with pytest.raises(FlashDPError, match=r"shape \(7,\) for 'gain'; expected \[B, \*param.shape\] = \(2, 3\)"):
            eng.backward(out.sum(1))


def test_batchnorm_is_refused_with_a_replacement():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    with pytest.raises(FlashDPError, match=r"'1' \(BatchNorm2d\): BatchNorm mixes samples.*GroupNorm"):
        flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0)


def test_flash_mode_where_triton_cannot_run_suggests_bk(monkeypatch):
    """Here: no CUDA device; without the interpreter Triton cannot run at all."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FlashDPError, match=r"mode='flash' needs Triton kernels, which cannot run here: .*mode='bk'"):
        flashdp.make_private(_mlp(), mode="flash", max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(FlashDPError, match=r"kernels='triton' needs Triton kernels"):
        flashdp.make_private(_mlp(), mode="bk", kernels="triton", max_grad_norm=1.0, noise_multiplier=1.0)


def test_flash_mode_with_torch_kernels_is_a_contradiction():
    with pytest.raises(FlashDPError, match="kernels='torch' contradicts it"):
        flashdp.make_private(_mlp(), mode="flash", kernels="torch", max_grad_norm=1.0, noise_multiplier=1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "fast"}, r"mode must be one of 'ghost', 'flash', 'bk'\. Received 'fast'"),
        ({"clipping": "layer"}, r"clipping must be one of 'flat', 'per_layer', 'automatic'\. Received 'layer'"),
        ({"max_grad_norm": 0.0}, r"max_grad_norm must be a positive finite number\. Received 0\.0"),
        ({"max_grad_norm": float("inf")}, "max_grad_norm must be a positive finite number"),
        ({"norm_strategy": "fast"}, "norm_strategy must be one of"),
        ({"kernels": "cuda"}, "kernels must be one of 'auto', 'triton', 'torch'"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"mode": "bk", "max_grad_norm": 1.0, "noise_multiplier": 1.0} | kwargs
    with pytest.raises(FlashDPError, match=match):
        flashdp.make_private(_mlp(), **args)


def test_not_a_module():
    with pytest.raises(FlashDPError, match=r"expects an nn\.Module\. Received function"):
        flashdp.make_private(lambda x: x, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0)


def test_model_without_trainable_parameters():
    model = _mlp().requires_grad_(False)
    with pytest.raises(FlashDPError, match="no trainable parameters"):
        flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sparse": True}, "sparse=True"),
        ({"scale_grad_by_freq": True}, "scale_grad_by_freq=True .* mixes samples"),
        ({"max_norm": 1.0}, "max_norm renormalises.*in place"),
    ],
)
def test_unsupported_embedding_options(kwargs, match):
    with pytest.raises(FlashDPError, match=match):
        flashdp.make_private(nn.Embedding(5, 3, **kwargs), mode="bk", max_grad_norm=1.0)


@pytest.mark.parametrize(
    "layer, setting, match",
    [
        (lambda: nn.Embedding(6, 3), {"scale_grad_by_freq": True}, "scale_grad_by_freq=True"),
        (lambda: nn.Embedding(6, 3), {"sparse": True}, "sparse=True"),
        (lambda: nn.EmbeddingBag(6, 3, mode="sum"), {"mode": "max"}, "mode='max'"),
        (lambda: nn.Embedding(6, 3), {"max_norm": 1.0}, "max_norm=1.0 renormalises"),
        (lambda: nn.EmbeddingBag(6, 3, mode="sum"), {"max_norm": 1.0}, "which tokens the private batch held"),
    ],
)
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_setting_refused_at_make_private_is_refused_when_set_later(layer, setting, match, mode):
    """The rule's check of a layer's settings runs at every call, not at make_private only: set after a clean
    step, each of these was counted as before (EmbeddingBag's max pooling: norms 2x off, silently)."""
    layer = layer()
    model = nn.Sequential(layer, nn.Flatten(), nn.LazyLinear(1)) if isinstance(layer, nn.Embedding) else layer
    ids = torch.tensor([[1, 1, 2, 4], [3, 3, 4, 5], [1, 2, 0, 0]])
    model(ids)  # (materialises the lazy layer)
    engine = flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0)
    engine.backward(model(ids).square().sum(1))
    for name, value in setting.items():
        setattr(layer, name, value)
    with pytest.raises(FlashDPError, match=f"{layer.__class__.__name__}.*{match}"):
        engine.backward(model(ids).square().sum(1))


def test_subclass_overriding_forward_moves_to_the_generic_rule():
    """A subclass whose forward is not its rule's: checked on its first call, then counted by the generic rule."""
    from tests.oracle import check_against_oracle
    from tests.strategies import per_sample_loss

    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x) ** 2

    model = Doubled(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 4)
    model.zero_grad()
    with flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        engine.backward(per_sample_loss(model(x)))
        assert engine.strategies["weight"] == "generic"


def test_subclass_with_the_same_forward_is_accepted():
    class Renamed(nn.Linear):
        def forward(self, x):
            return nn.functional.linear(x, self.weight, self.bias)

    model = Renamed(3, 2)
    with flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0) as eng:
        eng.backward(model(torch.randn(2, 3)).sum(1))


def test_duck_typed_lookalike_moves_to_the_generic_rule():
    from tests.oracle import check_against_oracle
    from tests.strategies import per_sample_loss

    class Conv1D(nn.Module):  # HF's name and attributes, another function
        def __init__(self):
            super().__init__()
            self.nf = 2
            self.weight = nn.Parameter(torch.randn(3, 2))
            self.bias = nn.Parameter(torch.zeros(2))

        def forward(self, x):
            return (x @ self.weight).relu() + self.bias

    model = Conv1D().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 4)


def test_in_place_op_that_hides_a_gradient_is_reported():
    class Sliced(Scale):
        def forward(self, x):
            return (x * self.gain)[:, :2]  # a partial view of an internal tensor

    flashdp.register_rule(
        Sliced, lambda m, inputs, g, trainable: {"gain": nn.functional.pad(inputs[0][:, :2] * g, (0, 1))}
    )
    model = Sliced()
    with flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0) as eng:
        out = model(torch.randn(2, 3))
        out.relu_()
        with pytest.raises(FlashDPError, match=r"output of layer '<root>' \(Sliced\) was modified in place"):
            eng.backward(out.sum(1))


def test_changing_trainable_parameters_after_make_private_is_refused_with_a_way_that_keeps_epsilon():
    """The refusal's way out carries the privacy spent (a breaker's: a new engine alone counted epsilon from 0)."""
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = {"max_grad_norm": 1.0, "noise_multiplier": 1.0, "expected_batch_size": 2, "sample_rate": 0.1}
    eng = flashdp.make_private(model, optimizer=optimizer, **settings)
    for _ in range(3):
        eng.backward(model(torch.randn(2, 4)).sum(1))
        eng.step()
    model[0].weight.requires_grad_(False)
    with pytest.raises(
        FlashDPError, match=r"changed since make_private.*new_engine.load_state_dict\(engine.state_dict"
    ):
        eng.backward(model(torch.randn(2, 4)).sum(1))
    eng.detach()
    new_engine = flashdp.make_private(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **settings)
    new_engine.load_state_dict(eng.state_dict())
    assert new_engine.steps == 3 and new_engine.epsilon(1e-5) == eng.epsilon(1e-5)


def test_detached_engine_refuses_to_clip():
    model = _mlp()
    eng = flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0)
    eng.detach()
    with pytest.raises(FlashDPError, match="detached"):
        eng.backward(model(torch.randn(2, 4)).sum(1))


@pytest.mark.parametrize("table", [nn.Embedding(6, 3), nn.EmbeddingBag(6, 3, mode="sum")], ids=["Embedding", "Bag"])
def test_max_norm_set_on_a_frozen_table_after_make_private_is_refused_before_its_forward(table):
    """(Left open last session: no hook ran on a frozen table, so max_norm set after make_private renormalised the
    rows of the private batches in place, unseen.) Refused before the forward touches the table."""
    table.requires_grad_(False)
    model = (
        nn.Sequential(table, nn.Linear(3, 2))
        if isinstance(table, nn.EmbeddingBag)
        else nn.Sequential(table, nn.Flatten(), nn.Linear(9, 2))
    )
    ids = torch.tensor([[1, 2, 5], [0, 4, 4]])
    engine = flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=0.0)
    engine.backward(model(ids).square().sum(1))
    table.weight.mul_(10.0)  # (rows well above the bound: a renormalisation would change them)
    before = table.weight.clone()
    table.max_norm = 1.0
    with pytest.raises(FlashDPError, match=r"'0' \((Embedding|EmbeddingBag)\): max_norm renormalises"):
        model(ids)
    assert torch.equal(table.weight, before)
    engine.detach()
    model(ids)  # (a detached engine watches nothing)


def test_a_frozen_max_norm_embedding_is_refused_too():
    """Its forward renormalises the rows the private batch looks up, in place: the released table would tell which
    tokens the batches held, though no gradient reaches it."""
    table = nn.Embedding(6, 3, max_norm=1.0).requires_grad_(False)
    model = nn.Sequential(table, nn.Linear(3, 2))
    with pytest.raises(FlashDPError, match=r"'0' \(Embedding\): max_norm renormalises.*a frozen table too"):
        flashdp.make_private(model, mode="bk", max_grad_norm=1.0, noise_multiplier=1.0)
