"""GPU check and benchmark of flashdp's Triton kernels (needs a CUDA device).

    python benchmarks/gpu/kernels.py              # correctness, kernel timings
    python benchmarks/gpu/kernels.py --quick      # fewer shapes

1. Correctness: every kernel against float64, in float32 and bfloat16 (error at most 2x plain PyTorch's).
2. Per-layer timings at Llama-8B shapes (d = 4096, p in {4096, 14336}, T in {512, ..., 8192}, B in {1, 2, 4},
   bf16) with triton.testing.do_bench: each kernel (direct norm, ghost norm, clipped sum) against the PyTorch
   reference the engine runs with kernels="torch" (per-sample gradients by a 16-bit bmm with float32 output; Gram
   matrices tiled along T; a float32 GEMM of the scaled factor), and the layer's own non-private backward (dX and dW
   GEMMs); TFLOP/s of the direct kernel vs the dW GEMM. An OOM shows as nan.
A full training step, side by side per mode, is `benchmarks/gpu/step.py`.
Prints markdown tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys

import torch


def check_kernels() -> None:
    from flashdp.kernels.clipped_sum import kernel as clipped_sum_kernel
    from flashdp.kernels.clipped_sum import reference as clipped_sum_reference
    from flashdp.kernels.norm_affine import kernel as norm_affine_kernel
    from flashdp.kernels.norm_affine import reference as norm_affine_reference
    from flashdp.kernels.outer_norm import kernel as outer_norm_kernel
    from flashdp.kernels.outer_norm import reference as outer_norm_reference

    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        left = torch.randn(3, 777, 300, device="cuda").to(dtype)
        right = torch.randn(3, 777, 211, device="cuda").to(dtype)
        coef = torch.rand(3, device="cuda")
        exact = outer_norm_reference.direct_norm_sq(left.double(), right.double())
        for name, kernel, reference in [
            ("direct norm", outer_norm_kernel.direct_norm_sq, outer_norm_reference.direct_norm_sq),
            ("ghost norm", outer_norm_kernel.ghost_norm_sq, outer_norm_reference.ghost_norm_sq),
        ]:
            rows.append((name, dtype, _rel(kernel(left, right), exact), _rel(reference(left, right), exact)))
        exact_sum = clipped_sum_reference.clipped_sum(left.double(), right.double(), coef.double())
        rows.append(
            ("clipped sum", dtype, _rel(clipped_sum_kernel.clipped_sum(left, right, coef), exact_sum),
             _rel(clipped_sum_reference.clipped_sum(left, right, coef), exact_sum))
        )  # fmt: skip
        x, g = left[:, :, :256] * 3 + 1, right[:, :, :1].expand(-1, -1, 256).contiguous()
        exact_w, _ = norm_affine_reference.norm_affine_grads(x.double(), g.double(), 1e-5, False, True)
        got_w, _ = norm_affine_kernel.norm_affine_grads(x, g, 1e-5, False, True)
        ref_w, _ = norm_affine_reference.norm_affine_grads(x, g, 1e-5, False, True)
        rows.append(("layernorm affine", dtype, _rel(got_w, exact_w), _rel(ref_w, exact_w)))
    print("| kernel | dtype | rel. error vs float64 | PyTorch's | ok (<= 2x + 1e-6) |\n|---|---|---|---|---|")
    for name, dtype, err, ref in rows:
        print(f"| {name} | {str(dtype)[6:]} | {err:.2e} | {ref:.2e} | {err <= 2 * ref + 1e-6} |")


def _rel(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact).norm() / exact.norm()).item()


def time_layers(quick: bool) -> None:
    d = 4096
    ps = (4096, 14336)
    ts = (1024, 2048, 8192) if quick else (512, 1024, 2048, 4096, 8192)
    bs = (1, 4) if quick else (1, 2, 4)
    print(
        "\n| p | T | B | direct kernel | direct reference | ghost kernel | ghost reference | clipped-sum kernel "
        "| clipped-sum reference | non-private bwd (dX+dW) | direct TFLOP/s | dW GEMM TFLOP/s |"
        "\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for p in ps:
        for t in ts:
            for b in bs:
                print(_time_layer(b, t, p, d), flush=True)


def _time_layer(b: int, t: int, p: int, d: int) -> str:
    """Each op of `kernels="auto"`'s choice timed both ways: the Triton kernel and the PyTorch reference the
    engine would run instead (`kernels="torch"`), at one layer shape in bf16."""
    from triton.testing import do_bench

    from flashdp.kernels.clipped_sum import kernel as clipped_sum_kernel
    from flashdp.kernels.clipped_sum import reference as clipped_sum_reference
    from flashdp.kernels.outer_norm import kernel as outer_norm_kernel
    from flashdp.kernels.outer_norm import reference as outer_norm_reference

    weight = torch.randn(p, d, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(b, t, d, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(b, t, p, device="cuda", dtype=torch.bfloat16)
    coef = torch.rand(b, device="cuda")
    g2, a2 = g.view(-1, p), a.view(-1, d)
    ops = [
        lambda: outer_norm_kernel.direct_norm_sq(g, a),
        lambda: outer_norm_reference.direct_norm_sq(g, a),
        lambda: outer_norm_kernel.ghost_norm_sq(g, a),
        lambda: outer_norm_reference.ghost_norm_sq(g, a),
        lambda: clipped_sum_kernel.clipped_sum(g, a, coef),
        lambda: clipped_sum_reference.clipped_sum(g, a, coef),
        lambda: (g2 @ weight, g2.T @ a2),
    ]
    times = [_maybe(lambda op=op: do_bench(op)) for op in ops]
    direct, dw = times[0], do_bench(lambda: g2.T @ a2)
    flops = 2 * b * t * p * d
    cells = " | ".join(f"{ms:.2f} ms" for ms in times)
    return f"| {p} | {t} | {b} | {cells} | {flops / direct / 1e9:.0f} | {flops / dw / 1e9:.0f} |"


def _maybe(run) -> float:
    try:
        return run()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu/kernels.py needs a CUDA device; the kernels are tested on CPU by `make test`.")
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    check_kernels()
    time_layers(args.quick)


if __name__ == "__main__":
    main()
