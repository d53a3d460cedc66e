"""The models the benchmarks train: a Llama-like decoder and a small CNN, in plain PyTorch (Opacus runs them too)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))


class GatedMLP(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.attn, self.mlp = Attention(d, heads), GatedMLP(d, int(d * 8 / 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LlamaLike(nn.Module):
    """Decoder: embedding, `layers` x (RMSNorm, causal attention, RMSNorm, gated MLP), RMSNorm, untied head.
    checkpointing: each block's activations are recomputed in the backward (non-reentrant checkpoint)."""

    def __init__(
        self, vocab: int = 4096, d: int = 256, layers: int = 4, heads: int = 4, checkpointing: bool = False
    ) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return self.head(self.norm(x))


class SmallCNN(nn.Module):
    """Conv2d + GroupNorm stages on 3-channel images, then a linear classifier."""

    def __init__(self, classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.GroupNorm(8, width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.GroupNorm(8, 2 * width), nn.ReLU(),
            nn.Conv2d(2 * width, 2 * width, 3, stride=2, padding=1), nn.GroupNorm(8, 2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.classifier = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class WideBlock(nn.Module):
    """Pre-activation residual block: (GroupNorm, ReLU, 3x3 conv) twice; a 1x1 conv on the shortcut where the shape
    changes."""

    def __init__(self, inputs: int, outputs: int, stride: int, groups: int = 16) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(groups, inputs), nn.GroupNorm(groups, outputs)
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        changes = stride != 1 or inputs != outputs
        self.shortcut = nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False) if changes else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(x))
        shortcut = self.shortcut(y) if self.shortcut is not None else x
        return shortcut + self.conv2(F.relu(self.norm2(self.conv1(y))))


class WideResNet(nn.Module):
    """WRN-depth-width with GroupNorm for 32x32 images, the CIFAR-10 model of the DP image-classification literature
    (De et al. 2022, "Unlocking high-accuracy differentially private image classification through scale"): a 3x3
    stem of 16 channels, three stages of (depth - 4) / 6 blocks of 16, 32, 64 channels times width."""

    def __init__(self, depth: int = 16, width: int = 4, classes: int = 10) -> None:
        super().__init__()
        blocks, channels = (depth - 4) // 6, [16, 16 * width, 32 * width, 64 * width]
        self.stem = nn.Conv2d(3, channels[0], 3, padding=1, bias=False)
        stages = []
        for stage in range(3):
            for i in range(blocks):
                inputs = channels[stage] if i == 0 else channels[stage + 1]
                stages.append(WideBlock(inputs, channels[stage + 1], 2 if i == 0 and stage > 0 else 1))
        self.blocks = nn.Sequential(*stages)
        self.norm = nn.GroupNorm(16, channels[3])
        self.classifier = nn.Linear(channels[3], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm(self.blocks(self.stem(x))))
        return self.classifier(y.mean((2, 3)))
