"""The launchers' CUDA path, without a GPU: what each launcher hands to `triton.autotune` (its candidates, its key,
the tiles of `flashdp.kernels.configs` for the inputs' precision), intercepted before anything runs."""

import pytest

pytest.importorskip("triton")

import torch
from triton.runtime.autotuner import Autotuner
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from flashdp.kernels import configs, tiles
from flashdp.kernels.clipped_sum import kernel as clipped_sum
from flashdp.kernels.norm_affine import kernel as norm_affine
from flashdp.kernels.outer_norm import kernel as outer_norm


@pytest.fixture
def launches(monkeypatch):
    """Launches as on CUDA (the interpreter off for the configurations), recorded instead of run."""
    seen = []
    monkeypatch.setattr(configs, "interpreter", lambda: False)
    monkeypatch.setattr(tiles, "interpreter", lambda: False)

    def autotuned(self, *args, grid, **kwargs):
        seen.append(("autotune", self, grid, kwargs))

    def plain(self, *args, grid, warmup=False, **kwargs):
        seen.append(("jit", self, grid, kwargs))

    monkeypatch.setattr(Autotuner, "run", autotuned)
    monkeypatch.setattr(JITFunction, "run", plain)  # (with TRITON_INTERPRET=1 the kernels are interpreted ones)
    monkeypatch.setattr(InterpretedFunction, "run", plain)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_launcher_autotunes_over_its_configurations_spill_free_candidates(launches, dtype):
    left, right = torch.randn(2, 300, 96).to(dtype), torch.randn(2, 300, 80).to(dtype)
    outer_norm.direct_norm_sq(left, right)
    outer_norm.ghost_norm_sq(left, right)
    clipped_sum.clipped_sum(left, right, torch.rand(2))
    norm_affine.norm_affine_grads(left, right[:, :, :1].expand(-1, -1, 96), 1e-5, False, True)
    names = ["direct_norm", "ghost_norm", "clipped_sum", "norm_affine"]
    assert len(launches) == len(names)
    for name, (how, runner, _, kwargs) in zip(names, launches, strict=True):
        config = configs.launch_config(name, dtype, on_gpu=True)
        if len(config.warps_and_stages) > 1:
            assert how == "autotune"
            chosen = {(c.num_warps, c.num_stages) for c in runner.configs}
            assert chosen == set(config.warps_and_stages)
            assert runner.keys, "autotuned once per layer shape"
        else:
            assert how == "jit" and (kwargs["num_warps"], kwargs["num_stages"]) == config.warps_and_stages[0]
        tiles = {k: v for k, v in kwargs.items() if k in ("BT", "BP", "BD", "BK")}
        limit = config.tile
        if name != "norm_affine":
            assert max(tiles.values()) == limit, (name, tiles)  # (every dim here is at least the tile)
        assert kwargs.get("UPCAST", False) is False
