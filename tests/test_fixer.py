"""flashdp.fix_model: a ResNet-style CNN with BatchNorm and in-place ReLUs becomes one flashdp clips exactly."""

import pytest
import torch
from torch import nn

import flashdp
from flashdp import FlashDPError
from tests.oracle import check_against_oracle


class BasicBlock(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN, plus a (projected) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet(classes: int = 5) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        BasicBlock(8, 8, 1),
        BasicBlock(8, 12, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.0, inplace=True),
        nn.Linear(12, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(inplace=True),
        nn.Linear(16, classes),
    )


def test_unfixed_resnet_is_refused_with_the_fix_named():
    with pytest.raises(FlashDPError, match="fix_model"):
        flashdp.make_private(resnet(), max_grad_norm=1.0, noise_multiplier=1.0)


def test_fixed_resnet_has_no_batch_norm_and_no_in_place_module():
    model = flashdp.fix_model(resnet())
    kinds = [type(m) for m in model.modules()]
    assert not any(issubclass(k, nn.modules.batchnorm._BatchNorm) for k in kinds)
    assert all(not getattr(m, "inplace", False) for m in model.modules())
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert [(n.num_groups, n.num_channels) for n in norms] == [
        (8, 8),
        (8, 8),
        (8, 8),
        (4, 12),
        (4, 12),
        (4, 12),
        (1, 16),
    ]


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_fixed_resnet_is_clipped_exactly(mode):
    torch.manual_seed(0)
    model = flashdp.fix_model(resnet()).double()
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randint(0, 5, (4,))

    def loss_of(rows: slice) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x[rows]), y[rows], reduction="none")

    check_against_oracle(model, loss_of, 4, mode=mode)


def test_fixed_model_keeps_dtype_affine_and_turns_running_statistics_off():
    f64 = {"dtype": torch.float64}
    model = nn.Sequential(
        nn.BatchNorm1d(6, affine=False, **f64),
        nn.InstanceNorm1d(6, affine=True, track_running_stats=True, **f64),
        nn.SyncBatchNorm(6, **f64),
    )
    assert flashdp.fix_model(model) is model
    first, instance, sync = model
    assert isinstance(first, nn.GroupNorm) and not first.affine and first.num_groups == 1
    assert isinstance(sync, nn.GroupNorm) and sync.weight.dtype == torch.float64 and sync.num_groups == 2
    assert not instance.track_running_stats and instance.running_mean is None
    assert model.train()(torch.randn(3, 6, 5, **f64)).shape == (3, 6, 5)
