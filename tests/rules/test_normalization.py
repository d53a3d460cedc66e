import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

import flashdp
from flashdp import FlashDPError
from tests.oracle import check_against_oracle
from tests.strategies import batches, clippings, modes, odd, per_sample_loss

NORMS = {
    "layernorm": lambda d: nn.LayerNorm(d),
    "layernorm_nobias": lambda d: nn.LayerNorm(d, bias=False),
    "rmsnorm": lambda d: nn.RMSNorm(d),
    "rmsnorm_eps": lambda d: nn.RMSNorm(d, eps=1e-3),
    "llama_rms": lambda d: LlamaRMSNorm(d, eps=1e-5),
    "t5_norm": lambda d: T5LayerNorm(d, eps=1e-6),
}


def _randomise_affine(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)


@given(
    batch=batches,
    lead=st.lists(st.integers(1, 3), max_size=2),
    d=odd,
    norm=st.sampled_from(sorted(NORMS)),
    mode=modes,
    clipping=clippings,
)
def test_last_dim_norms_match_oracle(batch, lead, d, norm, mode, clipping):
    hf_float32_internals = norm in ("llama_rms", "t5_norm")
    if hf_float32_internals:
        # At d = 1, x_hat = +-1 and the input gradient is ~0: what HF's float32 arithmetic returns there is
        # rounding noise, different in every run. From d = 3 on it is a real gradient.
        d += 2
    model = nn.Sequential(nn.Linear(d, d), NORMS[norm](d), nn.Linear(d, 2)).double()
    _randomise_affine(model)
    x = torch.randn(batch, *lead, d, dtype=torch.float64)
    # HF norms compute x_hat in float32 even for float64 inputs: the oracle carries that rounding.
    rtol = 1e-6 if hf_float32_internals else 1e-9
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), batch, mode=mode, clipping=clipping, rtol=rtol)


@given(batch=batches, t=odd, mode=modes)
def test_layernorm_over_two_dims_matches_oracle(batch, t, mode):
    model = nn.Sequential(nn.LayerNorm((t, 3)), nn.Flatten(), nn.Linear(3 * t, 2)).double()
    _randomise_affine(model)
    x = torch.randn(batch, t, 3, dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), batch, mode=mode)


@given(
    batch=batches,
    groups=st.sampled_from([1, 2, 3]),
    per_group=st.integers(1, 2),
    spatial=st.lists(st.integers(2, 3), min_size=1, max_size=2),  # GroupNorm needs 2+ values per group
    mode=modes,
)
def test_groupnorm_matches_oracle(batch, groups, per_group, spatial, mode):
    channels = groups * per_group
    model = nn.Sequential(nn.GroupNorm(groups, channels), nn.Flatten(), nn.LazyLinear(2)).double()
    x = torch.randn(batch, channels, *spatial, dtype=torch.float64)
    model(torch.zeros(1, channels, *spatial, dtype=torch.float64))  # materialise the lazy layer
    _randomise_affine(model)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), batch, mode=mode)


INSTANCE_NORMS = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}


@given(batch=st.integers(1, 5), dims=st.sampled_from([1, 2, 3]), tracked_in_eval=st.booleans(), mode=modes)
def test_instance_norm_matches_oracle(batch, dims, tracked_in_eval, mode):
    """Instance statistics, or (in eval mode) running statistics. (torch's instance norm fails on an empty batch.)"""
    norm = INSTANCE_NORMS[dims](3, affine=True, track_running_stats=tracked_in_eval)
    model = nn.Sequential(nn.Conv1d(2, 3, 1) if dims == 1 else nn.Identity(), norm).double()
    _randomise_affine(model)
    if tracked_in_eval:
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
        model.eval()
    channels = 2 if dims == 1 else 3
    x = torch.randn(batch, channels, *(4, 3, 2)[:dims], dtype=torch.float64)
    check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), batch, mode=mode)


def test_instance_norm_running_statistics_in_training_are_refused():
    """They average private samples with no noise: a leak, whether the layer is trained or not."""
    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.InstanceNorm2d(3, track_running_stats=True))
    with pytest.raises(FlashDPError, match=r"'1' \(InstanceNorm2d\): track_running_stats=True in training mode"):
        flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0)
    norm = nn.InstanceNorm2d(3, affine=True, track_running_stats=True).eval()
    with flashdp.make_private(norm, max_grad_norm=1.0, noise_multiplier=1.0):
        norm.train()
        with pytest.raises(FlashDPError, match=r"track_running_stats=True in training mode.*eval\(\) the layer"):
            norm(torch.randn(2, 3, 4, 4))


class _PoweredRMSNorm(nn.Module):
    """An HF-style RMSNorm (matched by duck typing) whose plain attribute `power` changes its function:
    `w ** power * x_hat`, the rule's function only where power is 1."""

    def __init__(self, d: int, power: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d) if power == 1 else torch.ones(d))
        self.variance_epsilon = 1e-6
        self.power = power

    def forward(self, x):
        x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight**self.power * x_hat


def test_alike_norms_share_one_probe_and_a_norm_that_differs_is_probed_on_its_own(monkeypatch):
    """Four norms alike in class, plain attributes and shapes are probed once. A fifth computes `w^2 x_hat`: with
    its weight at 1 its output is the rule's on the real values, so only its own probe (random weights) can tell;
    taken on the others' verdict, its gradient would be wrong. It is probed and goes to the generic rule: exact."""
    from flashdp._pipeline import recorder

    probes = []
    original = recorder._on_probe_values
    monkeypatch.setattr(
        recorder, "_on_probe_values", lambda site, *rest: probes.append(site.label) or original(site, *rest)
    )
    norms = [_PoweredRMSNorm(6, 1) for _ in range(4)] + [_PoweredRMSNorm(6, 2)]
    model = nn.Sequential(*[m for norm in norms for m in (norm, nn.Linear(6, 6))]).double()
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    check_against_oracle(model, lambda s: model(x[s]).square().sum((1, 2)), 3)
    assert len(probes) == 2 and "'8'" in probes[1], probes
