"""mode="flash" (and bk with kernels="triton") end to end: exact against the oracle, with the kernels running."""

import pytest

pytest.importorskip("triton")  # these tests run the kernels themselves

from collections import Counter
from unittest import mock

import torch
from hypothesis import given
from torch import nn

from flashdp.kernels.clipped_sum import kernel as clipped_sum_kernel
from flashdp.kernels.norm_affine import kernel as norm_affine_kernel
from flashdp.kernels.outer_norm import kernel as outer_norm_kernel
from tests.oracle import check_against_oracle
from tests.strategies import batches, clippings, norm_strategies, per_sample_loss
from tests.test_hf_models import VOCAB, gpt2, llama, lm_loss, positions

LAUNCHERS = {
    (outer_norm_kernel, "direct_norm_sq"),
    (outer_norm_kernel, "ghost_norm_sq"),
    (clipped_sum_kernel, "clipped_sum"),
    (norm_affine_kernel, "norm_affine_grads"),
}


class launches:
    """Counts calls of the Triton launchers while active."""

    def __enter__(self) -> Counter:
        self.counts = Counter()
        self.patches = []
        for module, name in LAUNCHERS:
            original = getattr(module, name)

            def counted(*args, _name=name, _original=original, **kwargs):
                self.counts[_name] += 1
                return _original(*args, **kwargs)

            patch = mock.patch.object(module, name, counted)
            patch.start()
            self.patches.append(patch)
        return self.counts

    def __exit__(self, *exc) -> None:
        for patch in self.patches:
            patch.stop()


def _transformer_block(d=12):
    return nn.Sequential(nn.Embedding(17, d), nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.RMSNorm(2 * d),
                         nn.Linear(2 * d, 17))  # fmt: skip


@given(batch=batches, clipping=clippings, strategy=norm_strategies)
def test_flash_matches_oracle_on_a_transformer_block(batch, clipping, strategy):
    model = _transformer_block()
    ids = torch.randint(0, 17, (batch, 9))
    with launches() as counts:
        check_against_oracle(
            model, lambda s: per_sample_loss(model(ids[s])), batch, mode="flash", clipping=clipping,
            norm_strategy=strategy, rtol=2e-4,
        )  # fmt: skip
    if batch and clipping != "per_layer":
        assert counts["norm_affine_grads"] == 2
        assert counts["direct_norm_sq"] + counts["ghost_norm_sq"] == 2


@pytest.mark.parametrize("strategy", ["ghost", "direct"])
def test_bk_with_triton_kernels_matches_oracle(strategy):
    """bk keeps per-sample grads for direct layers; ghost layers use the ghost-norm and clipped-sum kernels."""
    model = _transformer_block()
    ids = torch.randint(0, 17, (4, 9))
    with launches() as counts:
        check_against_oracle(
            model, lambda s: per_sample_loss(model(ids[s])), 4, mode="bk", norm_strategy=strategy, kernels="triton",
            rtol=2e-4, self_check=None,
        )  # fmt: skip
    assert counts["norm_affine_grads"] == 2
    if strategy == "ghost":
        assert counts["ghost_norm_sq"] == 2 and counts["clipped_sum"] == 2


@pytest.mark.parametrize(
    "build", [gpt2, lambda: llama(True), lambda: llama(False)], ids=["gpt2", "llama_tied", "llama"]
)
def test_flash_matches_oracle_on_hf_models(build):
    model = build().eval()
    ids = torch.randint(0, VOCAB, (3, 6))
    with launches() as counts:
        check_against_oracle(
            model, lambda s: lm_loss(model(ids[s], position_ids=positions(ids[s])).logits, ids[s]), 3,
            mode="flash", rtol=2e-4,
        )  # fmt: skip
    assert counts["norm_affine_grads"] > 0


def test_flash_matches_oracle_on_a_grouped_conv():
    model = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1, groups=2), nn.Tanh(), nn.Flatten(), nn.Linear(6 * 25, 3))
    x = torch.randn(3, 4, 5, 5)
    with launches() as counts:
        check_against_oracle(model, lambda s: per_sample_loss(model(x[s])), 3, mode="flash", rtol=2e-4)
    assert counts["direct_norm_sq"] + counts["ghost_norm_sq"] == 2


@given(batch=batches, strategy=norm_strategies)
def test_flash_matches_oracle_on_4d_inputs(batch, strategy):
    """[B, H, W, d] inputs: every leading dim but the batch is a position."""
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x = torch.randn(batch, 2, 3, 5)
    check_against_oracle(
        model, lambda s: per_sample_loss(model(x[s])), batch, mode="flash", norm_strategy=strategy, rtol=2e-4
    )
