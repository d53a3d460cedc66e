"""How a rule describes one call's per-sample gradients of one parameter (a leaf module: it imports only torch).

Two forms:

- a plain tensor `[B, *param.shape]`: the per-sample gradients themselves, for small parameters (biases,
  norm weights) where holding them costs no more than the activations;
- `OuterGrad`: the per-sample gradient as a sum of outer products over positions,
  `g_n = sum_t left[n, t] ⊗ right[n, t]`, which is never materialised unless that is the cheapest exact way
  to get its norm (Linear, Conv, Embedding, HF Conv1D).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class TokenRows:
    """One-hot row vectors given by ids: the left factor of an embedding's gradient.

    ids: `[N, T]` integer row indices into a table of `num_rows` rows.
    """

    ids: Tensor
    num_rows: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.ids.shape, self.num_rows)


@dataclass(frozen=True)
class OuterGrad:
    """Per-sample gradient `g_n = left[n]^T right[n]`, a `[p, d]` block per row n.

    left: `[N, T, p]` dense, or `TokenRows` (one-hot rows, p = num_rows).
    right: `[N, T, d]`.
    conv_groups: the parameter is `conv_groups` disjoint `[p, d]` blocks (grouped convolution); sample b owns the
        rows `n = b * conv_groups + j`, and its gradient stacks them to `[conv_groups * p, d]`, viewed as the
        parameter's shape.
    """

    left: Tensor | TokenRows
    right: Tensor
    conv_groups: int = 1

    def __post_init__(self) -> None:
        n, t, _ = self.left.shape
        if self.right.dim() != 3 or self.right.shape[:2] != (n, t):
            raise ValueError(
                f"OuterGrad: left is [N, T, p] = {tuple(self.left.shape)} but right is "
                f"{tuple(self.right.shape)}; expected right as [N, T, d] with the same N and T."
            )
        if n % self.conv_groups:
            raise ValueError(f"OuterGrad: N = {n} rows is not a multiple of conv_groups = {self.conv_groups}.")

    @property
    def is_tokens(self) -> bool:
        return isinstance(self.left, TokenRows)

    @property
    def block_shape(self) -> tuple[int, int]:
        """(p, d) of one group's block."""
        return self.left.shape[2], self.right.shape[2]


@dataclass(frozen=True)
class DeferredOuterGrad:
    """A per-sample gradient whose form is left to the engine's norm: the `OuterGrad` factors (for a ghost norm),
    or the `[B, *param.shape]` gradients themselves (for a direct norm) from a routine cheaper than the factors'
    product, such as a convolution's per-sample weight gradients as one grouped convolution, without unfolded
    windows. The engine picks by its cost model on `positions` and `block_shape`, as it would for the factors, and
    builds only that form.

    positions: T of the factors. block_shape: (p, d) of one group's block. conv_groups: as in `OuterGrad`.
    factors: builds the `OuterGrad`. dense: builds the `[B, *param.shape]` per-sample gradients, accumulated in
        `accumulation_dtype` of the layer's tensors.
    operands: the tensors both forms are built from (the factors' dtypes and device, for the choice of a kernel:
        where the direct norm runs as a Triton kernel, as under `mode="flash"`, the factors are built for it).
    weighted_sum: optional, `sum_b w_b g_b` for row weights `w` `[B]`, shaped like the parameter, by the layer's
        own weight-gradient routine; rows of weight 0 add exactly 0 (also where their inputs are not finite).
        Book-keeping's clipped sum of a ghost-norm layer then runs it and need not keep the factors.
    parts_norm: optional, `[B]` in the dtype it is given: the sum over positions and groups of each position's
        gradient norm `||left_t|| ||right_t||`, without the factors: what `dense` sums, whatever cancels in it, so
        that its norm can be bounded through their rounding (`rounding_bound_sq`). Without it, ghost and flash keep
        `dense`'s gradients for their clipped sums (a second backward, summing the same parts in another order,
        could add a gradient its measured norm does not bound).
    """

    operands: tuple[Tensor, Tensor]
    positions: int
    block_shape: tuple[int, int]
    conv_groups: int
    factors: Callable[[], OuterGrad]
    dense: Callable[[], Tensor]
    weighted_sum: Callable[[Tensor], Tensor] | None = None
    parts_norm: Callable[[torch.dtype], Tensor] | None = None


PerSampleGrad = Tensor | OuterGrad | DeferredOuterGrad


#: floating dtypes that accumulate in float32 (checked first: this runs for every parameter of every call)
_NARROW = (torch.float32, torch.bfloat16, torch.float16)


def accumulation_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype sums are accumulated in: float32 for half and single precision inputs, float64 stays float64."""
    dtype = torch.float32
    for t in tensors:
        if t.dtype not in _NARROW and t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """`x.to(dtype)`, without the call where x has it already (a step of many tiny layers is host-bound)."""
    return x if x.dtype == dtype else x.to(dtype)


#: 16-bit dtypes whose CUDA batched products can accumulate and return float32 (`torch.bmm(..., out_dtype=)`)
_TENSOR_CORE_16BIT = (torch.bfloat16, torch.float16)
#: whether this torch has that overload (torch >= 2.8)
_BMM_OUT_DTYPE = hasattr(torch.ops.aten.bmm, "dtype")


def bmm_in(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """`[N, m, n]` batched product of `a` `[N, m, k]` and `b` `[N, k, n]`, accumulated and returned in `dtype`.

    Two 16-bit CUDA operands and float32 `dtype` stay 16-bit on the tensor cores, with float32 accumulation and
    output: the products of 16-bit numbers are exact in float32, so this equals the product of float32 copies up
    to the order of the sums, where a float32 GEMM (never tf32) runs on the scalar units, about 10x slower on an
    H200 (docs/benchmarks.md, "GPU")."""
    if _BMM_OUT_DTYPE and dtype == torch.float32 and a.dtype == b.dtype and a.dtype in _TENSOR_CORE_16BIT and a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(cast(a, dtype), cast(b, dtype))


def bfloat16_parts(x: Tensor) -> Tensor:
    """`[3, *x.shape]` bfloat16 parts of a float32 `x` that sum to `x` exactly where `|x| >= 2^-109` (float32's 24
    significant bits as 3 x 8; a clipping coefficient below that would need a norm above 10^32 C). Each part is
    the remainder so far with the low 16 bits of its float32 pattern cleared (a truncation towards zero, exact in
    bfloat16); each remainder is exact in float32. Below 2^-109 the bits under bfloat16's smallest subnormal
    (2^-133) are dropped: the parts' sum is then `x` truncated towards zero."""
    parts, rest = [], x.contiguous()
    for _ in range(3):
        parts.append((rest.view(torch.int32) & -65536).view(torch.float32))  # (-65536: 0xFFFF0000)
        rest = rest - parts[-1]
    return torch.stack(parts).to(torch.bfloat16)


def weighted_rows(coef: Tensor, rows: Tensor) -> Tensor:
    """`sum_b coef_b rows_b` `[n]` for `coef` `[B]` in `accumulation_dtype(rows)` and `rows` `[B, n]`, accumulated
    in that dtype. bfloat16 rows on CUDA are read once, as they are (a float32 copy of them would be written and
    read again): the float32 coefficients split exactly into bfloat16 parts (`bfloat16_parts`), whose products
    with the rows are exact in float32, summed on the tensor cores in float32 (`split_weighted_rows`)."""
    if rows.dtype == torch.bfloat16 and rows.is_cuda and _BMM_OUT_DTYPE and coef.dtype == torch.float32:
        return split_weighted_rows(coef, rows)
    return coef @ cast(rows, accumulation_dtype(rows))


def split_weighted_rows(coef: Tensor, rows: Tensor) -> Tensor:
    """`weighted_rows` of float32 `coef` `[B]` and bfloat16 `rows` `[B, n]` through `bfloat16_parts`: `[3, n]`
    partial sums in float32, then added."""
    partial = bmm_in(bfloat16_parts(coef)[None], rows[None], torch.float32)[0]
    return (partial[0] + partial[1]) + partial[2]


def rounding_dtype(output: Tensor) -> torch.dtype:
    """The dtype whose rounding `output` carries, for the tolerance of a check: its own, or a 16-bit one where it is
    float32 that CUDA may have computed in TF32 (10 mantissa bits, like a 16-bit float)."""
    return torch.bfloat16 if computed_in_tf32(output) else output.dtype


def computed_in_tf32(output: Tensor) -> bool:
    """Whether a float32 `output` may have been computed in TF32 (10 mantissa bits, like a 16-bit float): on CUDA
    where TF32 is allowed; cuDNN's recurrent layers and convolutions allow it by default (a GRU's output recomputed
    step by step in float32 differed by 1e-4, relative, on an H200). Its checks take a 16-bit tolerance."""
    if output.dtype != torch.float32 or not output.is_cuda:
        return False
    return any(tf32_allowed(operation) for operation in ("conv", "rnn", "matmul"))


def tf32_allowed(operation: Literal["conv", "rnn", "matmul"]) -> bool:
    """Whether float32 `operation`s on CUDA may run in TF32: cuDNN's convolutions or recurrent layers, or cuBLAS's
    matrix multiplies."""
    backends = torch.backends
    if not _FP32_PRECISION:
        return backends.cuda.matmul.allow_tf32 if operation == "matmul" else backends.cudnn.allow_tf32
    if operation == "matmul":
        return allows_tf32(backends.cuda.matmul, backends)
    return allows_tf32(getattr(backends.cudnn, operation), backends.cudnn, backends)


#: torch >= 2.9 sets TF32 per backend and operation (`fp32_precision`); reading the older `allow_tf32` flags
#: raises once the user has set cuDNN's convolutions and recurrent layers apart with it
_FP32_PRECISION = hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision")


def allows_tf32(*chain: object) -> bool:
    """Whether the first of `chain` (an operation's `fp32_precision` setting, then its parents') that is set says
    "tf32"; "none" defers to the parent."""
    for backend in chain:
        precision = backend.fp32_precision
        if precision != "none":
            return precision == "tf32"
    return False


@contextlib.contextmanager
def ieee_float32_convolutions() -> Iterator[None]:
    """Inside, cuDNN convolves float32 in IEEE float32, never TF32 (a norm is a privacy quantity)."""
    cudnn = torch.backends.cudnn
    if not _FP32_PRECISION:
        with cudnn.flags(cudnn.enabled, cudnn.benchmark, deterministic=cudnn.deterministic, allow_tf32=False):
            yield
        return
    before, cudnn.conv.fp32_precision = cudnn.conv.fp32_precision, "ieee"
    try:
        yield
    finally:
        cudnn.conv.fp32_precision = before


@dataclass(frozen=True)
class RngState:
    """The random number generators' state: the CPU one, and the one of the CUDA device a call ran on."""

    cpu: Tensor
    cuda: Tensor | None = None
    device: torch.device | None = None


def rng_state(device: torch.device | None) -> RngState:
    if device is not None and device.type == "cuda":
        return RngState(torch.get_rng_state(), torch.cuda.get_rng_state(device), device)
    return RngState(torch.get_rng_state())


@dataclass(frozen=True)
class OutputMeta:
    """Where one recorded output sits in the module's output, and what it looks like."""

    #: its index among the tensor leaves of the module's output (`torch.utils._pytree.tree_leaves`)
    slot: int
    shape: torch.Size
    dtype: torch.dtype


@dataclass(frozen=True)
class LayerCall:
    """One recorded forward call, as a per-call rule (`register_rule(..., per_call=True)`) receives it.

    outputs / grad_outputs: the call's output tensors that require grad (None where not kept) and the gradient of
    the summed per-sample losses with respect to each (None where it does not reach the loss); output_meta
    describes each.
    params: the parameters the rule counts, by name relative to the module, as it held them during the call.
    autocast: (device type, dtype) of the autocast region the call ran in, or None.
    default_device: the default device the call ran under, where not the CPU (a re-run enters it), or None.
    """

    module: nn.Module
    args: tuple
    kwargs: dict
    outputs: tuple[Tensor | None, ...]
    output_meta: tuple[OutputMeta, ...]
    grad_outputs: tuple[Tensor | None, ...]
    params: dict[str, Tensor]
    batch_size: int
    #: k when the batch is folded into B * k rows (k per sample, sample-major), else 1
    rows_per_sample: int = 1
    #: the other parameters and buffers the forward used, as held during the call, where a wrapper (FSDP) has
    #: since replaced them; empty otherwise
    frozen: dict[str, Tensor] = field(default_factory=dict)
    #: per output, whether it is shared across the batch (no batch dim, or one of size 1, broadcast later): its
    #: grad_outputs entry is then the per-sample gradient `[B, *output shape]`
    shared: tuple[bool, ...] = ()
    autocast: tuple[str, torch.dtype] | None = None
    #: the default device the forward ran under (`torch.set_default_device`) where it is not the CPU, else None
    default_device: torch.device | None = None
    #: for a rule registered with `random`, the random number generators' state as the call began
    rng_state: RngState | None = None
    #: the tensor inputs (indices in `torch.utils._pytree.tree_flatten((args, kwargs))` order) computed from
    #: outputs shared across the batch and parameters alone: not rows of samples, whatever their size
    shared_inputs: frozenset[int] = frozenset()
    label: str = field(default="", compare=False)

    def arguments(self, of: type[nn.Module] | None = None) -> dict[str, object]:
        """The call's inputs by parameter name of the module's forward, defaults included; or by those of class
        `of`'s forward, which a subclass's (of other names: `forward(self, x)`, `forward(self, *a, **k)`) was
        checked to compute on the same positional inputs."""
        forward = type(self.module).forward
        bound = inspect.signature(forward).bind(self.module, *self.args, **self.kwargs)
        bound.apply_defaults()
        if of is None or of.forward is forward:
            return dict(bound.arguments)
        base = inspect.signature(of.forward).bind(*bound.args, **bound.kwargs)
        base.apply_defaults()
        return dict(base.arguments)

    def tensor(self, name: str) -> Tensor | None:
        """A parameter or buffer by name relative to the module (`"out_proj.weight"`), as the call held it."""
        if name in self.params:
            return self.params[name]
        if name in self.frozen:
            return self.frozen[name]
        owner = self.module
        *path, leaf = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        return getattr(owner, leaf, None)

    def grad_output(self, slot: int) -> Tensor | None:
        """The output gradient of the output tensor at `slot` (its index in the output's tensor leaves), shaped
        like the output, or None where that output does not reach the loss."""
        for meta, grad in zip(self.output_meta, self.grad_outputs, strict=True):
            if meta.slot == slot and grad is not None:
                return grad.view(meta.shape)
        return None
