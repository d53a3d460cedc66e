"""The independent oracle: per-sample gradients from running each sample ALONE (float64 models), and the
clipping formulas of DESIGN.md written out again, independently of flashdp's code."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

import flashdp
from flashdp.per_sample import OuterGrad, TokenRows

#: loss_of(batch_slice) -> [b] per-sample losses of the samples in that slice.
LossOf = Callable[[slice], Tensor]


def seeded(seed: int) -> torch.Generator:
    """A generator for a test's inputs, on the default device: CUDA where the suite runs there
    (`-p benchmarks.gpu.on_cuda`), whose factories refuse a CPU generator."""
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def per_sample_grads(model: nn.Module, loss_of: LossOf, batch: int) -> dict[str, Tensor]:
    """{name: [B, *shape]} from B separate forward/backward passes of one sample each."""
    params = trainable(model)
    rows: dict[str, list[Tensor]] = {n: [] for n in params}
    for i in range(batch):
        loss = loss_of(slice(i, i + 1))
        assert loss.shape == (1,)
        grads = torch.autograd.grad(loss[0], list(params.values()), allow_unused=True)
        for (name, p), g in zip(params.items(), grads, strict=True):
            rows[name].append(torch.zeros_like(p) if g is None else g)
    return {n: torch.stack(r) if r else params[n].new_zeros(0, *params[n].shape) for n, r in rows.items()}


def module_groups(names: list[str]) -> dict[str, str]:
    """per_layer clipping groups: the owning module's path."""
    return {n: n.rpartition(".")[0] for n in names}


def clip(per_sample: dict[str, Tensor], style: str, c: float, groups: dict[str, str] | None = None):
    """(norms [B], {name: sum_i c_i g_i}) for the clipping styles of DESIGN.md."""
    flat = torch.cat([_rows(g) for g in per_sample.values()], dim=1)
    norms = flat.norm(dim=1)
    if style == "flat":
        coef = {n: torch.clamp(c / (norms + 1e-6), max=1.0) for n in per_sample}
    elif style == "automatic":
        coef = {n: c / (norms + 0.01) for n in per_sample}
    else:
        groups = groups or module_groups(list(per_sample))
        names_of: dict[str, list[str]] = {}
        for n, grp in groups.items():
            names_of.setdefault(grp, []).append(n)
        budget = c / len(names_of) ** 0.5
        coef = {}
        for members in names_of.values():
            group_norm = torch.cat([_rows(per_sample[n]) for n in members], dim=1).norm(dim=1)
            for n in members:
                coef[n] = torch.clamp(budget / (group_norm + 1e-6), max=1.0)
    sums = {n: torch.einsum("b,b...->...", coef[n], g) for n, g in per_sample.items()}
    return norms, sums


def grads_of(model: nn.Module) -> dict[str, Tensor]:
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in trainable(model).items()}


def check_against_oracle(
    model: nn.Module,
    loss_of: LossOf,
    batch: int,
    *,
    mode: str = "bk",
    clipping: str = "flat",
    norm_strategy: str = "auto",
    max_grad_norm: float | None = None,
    rtol: float = 1e-9,
    kernels: str = "auto",
    self_check: int | None = 200,
) -> Tensor:
    """Run flashdp on the whole batch and compare norms and clipped sums with the oracle; returns the norms.

    The engine's self-check runs (it must pass on every correct model), unless a test counts kernel launches.
    """
    expected_ps = per_sample_grads(model, loss_of, batch)
    all_norms = torch.cat([_rows(g) for g in expected_ps.values()], 1).norm(dim=1)
    c = max_grad_norm if max_grad_norm is not None else max(0.7 * float(all_norms.median()) if batch else 1.0, 1e-3)
    expected_norms, expected_sums = clip(expected_ps, clipping, c)
    model.zero_grad(set_to_none=True)
    with flashdp.make_private(
        model,
        mode=mode,
        max_grad_norm=c,
        noise_multiplier=1.0,
        clipping=clipping,
        norm_strategy=norm_strategy,
        kernels=kernels,
        self_check=self_check,
    ) as engine:
        norms = engine.backward(loss_of(slice(None)))
    assert norms.dtype == torch.float32 and norms.shape == (batch,) and not norms.requires_grad
    norm_tol = max(1e-6, rtol)
    torch.testing.assert_close(norms.double(), expected_norms.double(), rtol=norm_tol, atol=norm_tol)
    assert_clipped_sums(model, expected_sums, rtol)
    return norms


def assert_clipped_sums(model: nn.Module, expected_sums: dict[str, Tensor], rtol: float, where: str = "") -> None:
    """Every trainable parameter's `.grad` against the oracle's clipped sum (absolute tolerance scaled by its size);
    `where` prefixes the failure message."""
    got = grads_of(model)
    for name, expected in expected_sums.items():
        scale = float(expected.abs().max()) if expected.numel() else 0.0
        torch.testing.assert_close(
            got[name], expected, rtol=rtol, atol=rtol * (1 + scale), msg=lambda m, name=name: f"{where}{name}: {m}"
        )


def materialised(block: OuterGrad) -> Tensor:
    """`[N, p, d]` per-sample gradients of an outer-product block, explicitly (one-hot rows for token blocks)."""
    left = block.left
    if isinstance(left, TokenRows):
        left = torch.nn.functional.one_hot(left.ids, left.num_rows).double()
    return torch.einsum("ntp,ntd->npd", left.double(), block.right.double())


def _rows(g: Tensor) -> Tensor:
    """`[B, *shape]` -> `[B, numel]` (also for B = 0 and scalar parameters)."""
    return g.reshape(g.shape[0], g.shape[1:].numel())
