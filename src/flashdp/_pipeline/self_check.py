"""The self-check: on the first backward and then at a set interval, what flashdp counted is compared with
autograd's own per-sample gradients, taken on the very graph being clipped. It catches what no rule can see:

1. batch independence (a pass that sketches each sample's rows of every recorded output's gradient, then a
   weighted pass over the graph): weighting the losses by random powers of two `r_i` must
   scale row i of every recorded output's gradient by exactly `r_i` (compared through random projections of each
   sample's rows, `RowSketch`: the unweighted gradients are not held). That holds only if row i of each layer's
   output belongs to sample i alone and `loss[i]` depends on sample i only. It fails for a layer whose dim 0 is
   not the batch (a time-major `[T, B, d]` input with T == B, relative-position ids `[q_len, k_len]`) and for
   losses that mix samples (a contrastive loss over the batch, a loss using the batch mean). With users, the
   weights are per user (`r_u` for every row of user u): rows may mix within their user (a preference pair's loss
   in one of its two rows), never across users, which is what a user's clipped gradient needs.
2. per-sample gradients (one extra backward per checked sample): autograd's gradient of `loss[i]` for every
   trainable parameter against the norm flashdp counted for it and, in bk, against the gradient it will add. Each
   gradient is reduced to its norm and random projections as autograd computes it (`unit_gradients`), before bk's
   norm pass: the check holds neither a whole per-sample gradient nor bk's kept factors next to the graph, so a
   checked step needs about the memory of an unchecked one.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from flashdp._pipeline.loss_graph import LossGraph
from flashdp._pipeline.norm_pass import stream_output_gradients
from flashdp._pipeline.param_grad import ClippedSumPlan
from flashdp._pipeline.recorder import Call
from flashdp._pipeline.users import UserGroups
from flashdp.errors import FlashDPError

#: samples whose full per-sample gradients each check compares
SAMPLES_PER_CHECK = 2

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Counted:
    """What flashdp counted for one trainable parameter in this backward."""

    name: str
    #: the parameter's key in `unit_gradients`
    key: object
    #: `[B]`
    norm_sq: Tensor
    #: the clipped-sum plan (bk), from which sample i's gradient is `plan.clipped_sum(e_i)`; None in ghost / flash
    plan: ClippedSumPlan | None
    #: `[B]` the squared bound of the true norm through rounding (`param_grad.rounding_bound_sq`), or None
    bound_sq: Tensor | None = None


def tolerance(dtypes: Sequence[torch.dtype], tf32: bool = False) -> float:
    """Relative error allowed between two exact computations of one gradient that round differently: a wrong
    assumption makes errors of order 1 (a missing contribution, another sample's rows). `tf32`: float32 work may
    have run in TF32 (CUDA's default for cuDNN convolutions and recurrent layers: 10 mantissa bits, errors near
    1e-3 where flashdp's own products are IEEE float32)."""
    if any(d in _HALF for d in dtypes):
        return 5e-2
    if all(d == torch.float64 for d in dtypes):
        return 1e-6
    return 1e-2 if tf32 else 1e-3


#: the largest power-of-two weight exponent per dtype of the loss and outputs (bfloat16 has float32's range)
_MAX_EXPONENT = {torch.float64: 30, torch.float32: 15, torch.bfloat16: 15, torch.float16: 3}


#: how far below its dtype's largest value the largest weighted row of an output must stay for the weights to scale
#: up (a layer's backward may hold values beyond its output gradient's)
OVERFLOW_HEADROOM = 2.0**4


def _weight_passes(units: int, top: int, down: bool, generator: torch.Generator, widest: int = 0) -> Tensor:
    """`[P, U]` power-of-two weights of U units for P weighted passes: unit u, numbered `n_u` by a random
    permutation, weighs `2^(digit p of n_u in base K + 1)` in pass p (`top` = K; with `down`, divided by `2^K`: at
    most 1), with P the fewest passes that number every unit apart: every two units are weighted apart in at least
    one pass (rows of two units of one weight could be swapped, or one's loss flow into the other's rows, unseen:
    with one pass, float16's 4 weights let a model mixing samples 0 and 1 of 8 through every time). Each value is
    used as evenly as possible in each pass. Scaling by a power of two is exact in floating point, so a per-sample
    gradient scales exactly, rounding noise included: the comparison needs no magnitude floor and sees layers whose
    gradients are tiny next to others'. `widest`: the most units any rank has, which sets P (every rank runs the
    same passes: under FSDP each is a backward with collectives, and a rank with one more hung the other)."""
    base, passes = top + 1, 1
    while base**passes < max(units, widest):
        passes += 1
    number = torch.randperm(units, generator=generator, device="cpu")
    digits = torch.stack([torch.div(number, base**p, rounding_mode="floor") % base for p in range(passes)])
    return 2.0 ** (digits.double() - (top if down else 0))


def _scales_down(sketches: Sequence[tuple[RowSketch | None, ...]], top: int) -> bool:
    """Whether weights up to `2^top` would bring an output's largest rows within `OVERFLOW_HEADROOM` of its dtype's
    largest value (float16 gradients above about 500): weights scaling up are exact down to the subnormal range,
    weights scaling down never overflow."""
    reach = [s.peak.double() * (2.0**top * OVERFLOW_HEADROOM / s.dtype_max) for row in sketches for s in row if s]
    return bool(reach) and bool(torch.stack(reach).max() >= 1)  # (one sync)


#: random projections of each sample's rows that the batch-independence check keeps per output
PROJECTIONS = 8


#: how far, in units of its dtype's smallest subnormal, each element of a sample's rows may be from its exact value
#: through rounding in the subnormal range (where scaling by a power of two is not exact) on the way to the layer,
#: accumulations and later amplification included
SUBNORMAL_MARGIN = 2.0**8
#: the most that allowance may be per element, whatever the dtype: far below any gradient that matters (float32's and
#: bfloat16's subnormals are within it; float16's, 6e-8 to 6e-5, are not, and get none: rows of other samples mixed
#: in at that size would pass, and a float16 model trained without loss scaling has gradients there)
SUBNORMAL_SLACK_CAP = 2.0**-120
#: a sample's rows show whose rows they are only where their norm is this many times that rounding
RESOLVED = 2.0**10
#: and, at a shared output's frontier, this many times the error the check tolerates on the sample's floor
CHECKED = 2.0**4


@dataclass(frozen=True)
class RowSketch:
    """One output gradient's rows of each sample, kept as `PROJECTIONS` random bilinear projections `u_k^T X_i v_k`
    (`X_i`: sample i's rows as an `[m, l]` matrix) and their norms, instead of the gradient itself.

    A per-sample gradient scales exactly by its power-of-two weight, and so do its projections (the same
    operations on scaled inputs round alike), down to the subnormal range of its dtype (`slack`). Rows that mix
    samples differ by an error `E_i` of their own size, and the mean square of Gaussian projections of `E_i` is
    `||E_i||^2`: the check sees it at any realistic tolerance, for `O(B)` numbers held per output rather than the
    output's gradient."""

    #: `[B, K]` float64
    projections: Tensor
    #: `[B]` float64: each sample's rows' norm (at least their largest magnitude: `_norms`)
    norms: Tensor
    #: what the directions `u_k`, `v_k` are drawn from, again for the weighted pass (not held meanwhile: `K (m + l)`
    #: numbers per output, more than the rest of the sketch on a long sequence)
    seed: int
    #: how far a sample's rows of weight 1 may be from exact scaling through subnormal rounding (a sample fit so
    #: well that its gradient is about 1e-40 in float32): `SUBNORMAL_MARGIN` subnormals per element (at most
    #: `SUBNORMAL_SLACK_CAP`), in norm
    slack: float
    #: `[]` the largest magnitude in the rows, and the largest value of their dtype (the weights must not overflow)
    peak: Tensor
    dtype_max: float

    @staticmethod
    def of(grad: Tensor, shape: torch.Size, dim: int, batch: int, seed: int) -> RowSketch:
        rows = _sample_matrices(grad, shape, dim, batch)
        info = torch.finfo(grad.dtype)
        subnormal = info.smallest_normal * 2.0 ** -_mantissa_bits(grad.dtype)
        slack = min(SUBNORMAL_MARGIN * subnormal, SUBNORMAL_SLACK_CAP) * (math.sqrt(rows[0].numel()) if batch else 0.0)
        norms, largest = _norms(rows)
        peak = largest.max() if batch else largest.new_zeros(())
        return RowSketch(_project(rows, *_directions(rows, seed)), norms, seed, slack, peak, info.max)

    def fails(self, weighted: Tensor, shape: torch.Size, dim: int, weights: Tensor, rtol: float, floor: Tensor) -> bool:
        """Whether the weighted pass's gradient of this output is not `weights[i]` times sample i's rows. `floor`
        `[B]`: each sample's own scale, below which the relative error is taken of it (`sample_floors`)."""
        rows = _sample_matrices(weighted, shape, dim, weights.shape[0])
        expected = self.projections * weights[:, None]
        error = (_project(rows, *_directions(rows, self.seed)) - expected).square().mean(1).sqrt()
        weighted_norms = _norms(rows)[0]
        scale = self.norms * weights + weighted_norms
        failed = error > rtol * (scale + floor * weights) + self.slack * weights
        # (finite rows whose weighted rows or projections overflowed fail: a NaN error passes no comparison, and
        # weights never overflow scaled rows, `_scales_down`)
        failed |= ~torch.isfinite(error) & torch.isfinite(self.norms)
        return bool(failed.any())

    def passes_with_rows(
        self, weighted: Tensor, shape: torch.Size, dim: int, weights: Tensor, rtol: float, floor: Tensor
    ) -> bool:
        """Whether the gradient has rows it resolves and passes (`fails`): evidence for this reading, where a zero
        gradient (an output the loss does not read) passes any."""
        return bool(self._resolved.any()) and not self.fails(weighted, shape, dim, weights, rtol, floor)

    def resolves_every_sample(self, rtol: float, floor: Tensor) -> bool:
        """Whether every sample's rows are `CHECKED` times what `fails` tolerates on the sample's `floor` `[B]`: rows
        of another sample mixed in, of their size, would fail. Rows far below it (a table under a gate near 0,
        1e-10 beside rows of 1) pass any comparison."""
        return bool((self.norms > CHECKED * rtol * floor.to(self.norms.device)).all())

    @property
    def every_sample_seen(self) -> bool:
        """Whether every sample's rows were resolved (`RESOLVED` times their `slack`): a sample whose rows are all
        zero, or all rounding near underflow, shows nothing about which rows are its own (rows of another sample
        mixed with zeros scale like its own)."""
        return bool(self._resolved.all())

    @property
    def _resolved(self) -> Tensor:
        return self.norms > RESOLVED * self.slack  # (slack 0: rows not all zero)


def _mantissa_bits(dtype: torch.dtype) -> int:
    """Stored mantissa bits: the subnormals of `dtype` are multiples of `smallest_normal * 2^-bits`."""
    return round(-math.log2(torch.finfo(dtype).eps))


def sketch_output_gradients(
    call: Call, grads: tuple[Tensor | None, ...], dims: tuple[int, ...], batch: int, shared: Collection[int], seed: int
) -> tuple[RowSketch | None, ...]:
    """The sketches of one call's output gradients (None where an output does not reach the loss, is shared
    across the batch (`shared`: output indices) or there is only one sample)."""
    return tuple(
        None
        if grad is None or j in shared or batch < 2
        else RowSketch.of(grad, meta.shape, dim, batch, seed * PROJECTIONS + j)
        for j, (meta, grad, dim) in enumerate(zip(call.output_meta, grads, dims, strict=True))
    )


#: another reading of an output's gradient by sample (the shape it is viewed in, its batch dim) and its sketch
OtherLayout = tuple[torch.Size, int, RowSketch]
#: per (call, output): the other readings its batch could be in
OtherLayouts = Mapping[tuple[int, int], tuple[OtherLayout, ...]]


class ComparedRows(Protocol):
    """More rows compared in each weighted pass (`frontier_rows.FrontierRows`: where shared outputs meet the
    batch)."""

    #: edges autograd must compute the gradient of for the rows to flow through (parameters' frontiers)
    reach: Sequence[GradientEdge]

    def comparing(self, weights: Tensor, rtol: float, floors: Tensor) -> contextlib.AbstractContextManager: ...


def batch_independence_failures(
    loss: Tensor,
    calls: Sequence[Call],
    sketches: Sequence[tuple[RowSketch | None, ...]],
    batch_dims: Sequence[tuple[int, ...]],
    rtol: float,
    generator: torch.Generator,
    users: UserGroups | None = None,
    other_layouts: OtherLayouts | None = None,
    widest: int = 0,
    frontiers: ComparedRows | None = None,
) -> tuple[list[int], list[int]]:
    """The calls (indices) some output of which has gradient rows that are not per-sample, or not per user where
    `users` are given (see the module docstring), from the sketches of the unweighted pass's output gradients; and
    the calls some output of which passed and passes in one of its `other_layouts` too (its rows tell no layout
    apart). `frontiers`: where shared outputs meet the batch, compared in every weighted pass too (their calls
    that fail are noted there, `FrontierRows.failing`).
    With fewer than 2 samples there is nothing to compare, but the pass still runs (FSDP ranks must run the same
    passes: `widest`, the most units any rank has, sets their number)."""
    dtypes = [loss.dtype, *(m.dtype for c in calls for m in c.output_meta)]
    top = min(_MAX_EXPONENT.get(d, 3) for d in dtypes)
    units = loss.shape[0] if users is None else users.count
    passes = _weight_passes(units, top, _scales_down(sketches, top), generator, widest).to(loss.device)
    floors = sample_floors(sketches, loss.shape[0], loss.device)
    others = (other_layouts or {}) if users is None else {}  # (rows of one user share a weight: any dim passes)
    failing: set[int] = set()
    elsewhere: set[int] | None = None
    for weights in passes:  # (a reading passes elsewhere only where it passes in every pass)
        weights = weights if users is None else users.per_row(weights)
        comparing = frontiers.comparing(weights, rtol, floors) if frontiers else contextlib.nullcontext()
        with comparing:
            failed, passed = _weighted_pass(
                loss, calls, sketches, batch_dims, (weights, rtol, floors), others, frontiers.reach if frontiers else ()
            )
        failing |= failed
        elsewhere = passed if elsewhere is None else elsewhere & passed
    return sorted(failing), sorted((elsewhere or set()) - failing)


def _weighted_pass(
    loss: Tensor,
    calls: Sequence[Call],
    sketches: Sequence[tuple[RowSketch | None, ...]],
    batch_dims: Sequence[tuple[int, ...]],
    comparing: tuple[Tensor, float, Tensor],
    others: OtherLayouts,
    reach: Sequence[GradientEdge] = (),
) -> tuple[set[int], set[int]]:
    """One weighted pass (`comparing`: the `[B]` weights, rtol, the samples' floors): the calls with an output
    failing its sketch, and those with an output that passes read in one of its other layouts too."""
    weights, rtol, floors = comparing
    with torch.enable_grad():
        weighted_loss = loss * weights.to(loss.dtype)
    failing: set[int] = set()
    passing_elsewhere: set[int] = set()

    def compare(index: int, weighted: tuple[Tensor | None, ...]) -> None:
        """One call's weighted output gradients against its sketches, as the weighted pass computes them."""
        call = calls[index]
        for j, (meta, sketch, grad, dim) in enumerate(
            zip(call.output_meta, sketches[index], weighted, batch_dims[index], strict=True)
        ):
            if sketch is None or grad is None:
                continue
            if sketch.fails(grad, meta.shape, dim, weights, rtol, floors):
                failing.add(index)
                return
            readings = others.get((index, j), ())
            if any(other.passes_with_rows(grad, shape, d, weights, rtol, floors) for shape, d, other in readings):
                passing_elsewhere.add(index)

    stream_output_gradients(LossGraph(weighted_loss), list(calls), compare, held=(), retain_graph=True, reach=reach)
    return failing, passing_elsewhere


def sample_floors(sketches: Sequence[tuple[RowSketch | None, ...]], batch: int, device: torch.device) -> Tensor:
    """`[B]` float64: `1e-3` times each sample's largest rows' norm over every sketched output: the scale below
    which a sample's rows in one layer are compared as if they were that large (rows that cancel to about 0 in one
    layer round like the sample's rows elsewhere). The sample's own, never another's: relative to the batch's
    largest sample, a breaker's sample 1e6 times the others in float32 let rows of one sample mixed into another's
    pass, and one sample added 2 C."""
    norms = [sketch.norms for row in sketches for sketch in row if sketch is not None]
    if not norms:
        return torch.zeros(batch, dtype=torch.float64, device=device)
    return 1e-3 * torch.stack(norms).amax(0).to(device)


def _sample_matrices(grad: Tensor, shape: torch.Size, dim: int, batch: int) -> Tensor:
    """`[B, m, l]`: each sample's rows of an output gradient (row i, or the k rows of a batch folded into B * k
    rows) as one matrix, split between its dims where `B * m + l` is smallest; float32 at least."""
    moved = grad.reshape(shape).movedim(dim, 0)
    sizes = [moved.shape[0] // batch, *moved.shape[1:]]
    splits = [(math.prod(sizes[:s]), math.prod(sizes[s:])) for s in range(len(sizes) + 1)]
    rows = moved.reshape(batch, *min(splits, key=lambda split: batch * split[0] + split[1]))
    return rows.float() if rows.dtype in _HALF else rows


def _directions(rows: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """`[m, K]`, `[l, K]` Gaussian directions for sample matrices `rows` `[B, m, l]`, drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(n, PROJECTIONS, generator=generator, dtype=rows.dtype, device="cpu").to(rows.device)
        for n in rows.shape[1:]
    )


def _project(rows: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """`[B, K]` float64: `left[:, k]^T X_i right[:, k]` for each sample's matrix `X_i` (`rows`: `[B, m, l]`)."""
    return ((rows @ right) * left).sum(1).double()


def _norms(rows: Tensor) -> tuple[Tensor, Tensor]:
    """`[B]` float64 norms of `[B, ...]` rows, and `[B]` their largest magnitudes; where the float32 squares of a row
    underflow (values below about 1e-19) or overflow (a norm above about 1.8e19, which made the tolerance infinite:
    a breaker's rows mixing samples passed), its norm is its largest magnitude instead, a lower bound (reductions
    only: no copy of the gradient). A row holding inf or NaN has that norm."""
    flat = rows.flatten(1)
    largest = torch.maximum(flat.amax(1), -flat.amin(1)) if flat.shape[1] else flat.new_zeros(flat.shape[0])
    norm = torch.linalg.vector_norm(flat, dim=1)
    norm = torch.where(torch.isinf(norm) & torch.isfinite(largest), largest, torch.maximum(norm, largest))
    return norm.double(), largest


def batch_independence_error(failing: Sequence[str], every: Sequence[str]) -> FlashDPError:
    """The layers whose output rows are not per-sample, and each cause the evidence cannot tell apart, with what to
    do for it; the likeliest first (every layer failing points at the loss)."""
    mixing = (
        "the per-sample losses mix samples (a contrastive loss over the batch, a loss or normalisation using batch "
        "statistics, one batch loss broadcast to every row as in loss.mean().expand(B)): make loss[i] depend on "
        "sample i only (reduction='none')"
    )
    layout = (
        "these layers run time-major ([T, B, ...], or with extra positions such as an added bias step: "
        "[T + 1, B, ...]) and that leading size happens to be a multiple of B, so it passed for a batch: give them "
        "batch-first inputs, or a batch size that does not divide that size, and flashdp finds the layout by size"
    )
    reorder = "rows are reordered inside the forward and not put back: restore the order before the loss"
    table = (
        "these layers read a table of positions given as floating-point data whose length happens to be a "
        "multiple of B (a sinusoid table [T, d] with T = k B): give it a leading dim of 1 (table[None])"
    )
    causes = [mixing, layout, reorder, table] if set(failing) == set(every) else [layout, table, reorder, mixing]
    listed = " ".join(f"({k}) {cause};" for k, cause in enumerate(causes, 1))
    return FlashDPError(
        "Self-check failed: the gradient of these layers' outputs is not separable by sample: "
        f"{', '.join(dict.fromkeys(failing))}. Row i of a layer's output must belong to sample i alone. The evidence "
        f"cannot tell these causes apart, likeliest first: {listed[:-1]}. Nothing was added to .grad. See "
        "docs/assumptions.md."
    )


class Unit(NamedTuple):
    """A clipped unit the check compares: a sample (one row of the loss) or a user (its rows together)."""

    #: its place in the counted norms `[B]` (or `[U]`)
    index: int
    rows: list[int]
    #: "sample 3", "user 1234"
    label: str


@dataclass(frozen=True)
class UnitGradient:
    """Autograd's gradient of one unit's losses, kept per checked tensor as its norm and, where the counted
    gradient will be a clipped-sum plan, its random projections (`project`): never the gradient itself."""

    unit: Unit
    #: per checked tensor's key: the norm of its gradient (0 where the loss does not reach it)
    norms: dict[object, float]
    #: per checked tensor's key: `project(gradient, seed)` with the seed it was drawn from
    projections: dict[object, tuple[int, Tensor]]


def unit_gradients(
    loss: Tensor, tensors: dict[object, Tensor], units: Sequence[Unit], projected: bool, seed: int
) -> list[UnitGradient]:
    """Autograd's gradient of each unit's summed losses for every tensor of `tensors` (the trainable parameters as
    the forward used them), one backward per unit over the kept graph; each gradient is reduced to its norm (and
    with `projected`, its projections, the k-th tensor's drawn from `seed + k`: drawn anew on each check, so that
    no entry is always seen through small directions) as autograd computes it, so no unit's whole gradient is held
    at once. An empty rank runs the passes (FSDP collectives) and returns nothing."""
    out = []
    for unit in units:
        with torch.enable_grad():
            target = loss[unit.rows].sum() if loss.shape[0] else loss.sum()
        reduced = _Reduced(tensors, projected)
        streamed_gradients(target, tensors, reduced, seed)
        if loss.shape[0]:
            out.append(UnitGradient(unit, reduced.norms(), reduced.projections))
    return out


class _Reduced:
    """`reduce(key, gradient, seed)` for `streamed_gradients`: keeps each gradient's norm (on the device until
    `norms()`: one sync per unit) and projections."""

    def __init__(self, tensors: dict[object, Tensor], projected: bool) -> None:
        self.tensors, self.projected = tensors, projected
        self._norms: dict[object, Tensor] = {}
        self.projections: dict[object, tuple[int, Tensor]] = {}

    def __call__(self, key: object, gradient: Tensor | None, seed: int) -> None:
        if gradient is not None:
            self._norms[key] = gradient.double().norm()
        if self.projected:  # (zeros where the loss does not reach the tensor: its counted gradient must be 0 too)
            zeros = torch.zeros(GRADIENT_PROJECTIONS, dtype=torch.float64, device=self.tensors[key].device)
            self.projections[key] = (seed, zeros if gradient is None else project(gradient, seed))

    def norms(self) -> dict[object, float]:
        values = torch.stack(list(self._norms.values())).tolist() if self._norms else []
        return dict.fromkeys(self.tensors, 0.0) | dict(zip(self._norms, values, strict=True))


def streamed_gradients(
    target: Tensor, tensors: dict[object, Tensor], reduce: Callable[[object, Tensor | None, int], None], seed: int = 0
) -> None:
    """`reduce(key, gradient, seed + k)` for the gradient of `target` at the k-th of `tensors` (None where it does
    not reach it), the graph kept. A leaf's gradient is reduced as autograd computes it and then not kept (its hook
    hands autograd a zero-strided stand-in to return); another tensor's (a parameter computed in the forward, whose
    hook's value would flow on to its inputs) once the pass ends."""
    keys, values = list(tensors), list(tensors.values())
    hooks = [(t, _Reducing(reduce, key, seed + k)) for k, (key, t) in enumerate(tensors.items()) if t.is_leaf]
    handles = [t.register_hook(hook) for t, hook in hooks]
    try:
        grads = torch.autograd.grad(target, values, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    for k, (key, tensor, grad) in enumerate(zip(keys, values, grads, strict=True)):
        if grad is None or not tensor.is_leaf:  # (a leaf's hook did not run: its gradient is None)
            reduce(key, grad, seed + k)


class _Reducing:
    """A leaf tensor's hook: reduces its gradient and returns a zero-strided zero of its shape in its place."""

    def __init__(self, reduce: Callable[[object, Tensor | None, int], None], key: object, seed: int) -> None:
        self.reduce, self.key, self.seed = reduce, key, seed

    def __call__(self, gradient: Tensor) -> Tensor:
        self.reduce(self.key, gradient, self.seed)
        return torch.zeros((), dtype=gradient.dtype, device=gradient.device).expand(gradient.shape)


#: random projections kept of each checked gradient that bk's clipped-sum plan is compared with
GRADIENT_PROJECTIONS = 32


def project(gradient: Tensor, seed: int) -> Tensor:
    """`[R]` float64: bilinear projections `u_k^T M v_k` of the gradient as an `[m, l]` matrix `M` (its dims split
    where `m + l` is smallest), with Gaussian `u_k`, `v_k` drawn from `seed` (the same for any tensor of its shape
    on its device, whatever its dtype). E[(u^T D v)^2] = ||D||^2 for independent Gaussian u, v: the mean square of
    two gradients' projections' difference estimates the squared norm of their difference, for R (m + l) draws
    and R numbers held. Computed in the gradient's precision, float32 at least."""
    sizes = list(gradient.shape)
    splits = [(math.prod(sizes[:s]), math.prod(sizes[s:])) for s in range(len(sizes) + 1)]
    matrix = gradient.reshape(min(splits, key=sum))
    dtype = torch.promote_types(gradient.dtype, torch.float32)
    generator = torch.Generator(device=gradient.device).manual_seed(seed)
    left, right = (  # (drawn in float32 whatever the precision: the same directions for both sides compared)
        torch.randn(n, GRADIENT_PROJECTIONS, generator=generator, device=gradient.device).to(dtype)
        for n in matrix.shape
    )
    return ((matrix.to(dtype) @ right) * left).sum(0).double()


def check_per_sample(
    gradients: Sequence[UnitGradient], counted: Sequence[Counted], rtol: float, least_bound: float
) -> None:
    """Raise if, for a checked unit, a parameter's counted gradient differs from autograd's gradient of the sum
    of the unit's losses (`unit_gradients`). The tolerance's floor is relative to the unit's gradient; for a user,
    whose rows may cancel to a gradient of about 0 that both sides round differently, at least to the batch's
    largest counted one; and it covers the underflow of the counted squares (`underflow_floor`) up to `rtol`
    times `least_bound`, the smallest norm any clipping group is clipped to."""
    largest = _largest_counted_norm(counted) if any(len(g.unit.rows) > 1 for g in gradients) else 0.0
    for true in gradients:
        (i, rows, label) = true.unit
        total = math.sqrt(sum(true.norms[c.key] ** 2 for c in counted))
        if not math.isfinite(total):  # a non-finite gradient: the nonfinite policy's, not a disagreement
            continue
        scale = total if len(rows) == 1 else max(total, largest)
        problems = [
            p
            for c in counted
            if (p := _disagreement(c, true, i, rtol, rtol * scale + min(underflow_floor(c), rtol * least_bound)))
        ]
        if problems:
            raise FlashDPError(
                f"Self-check failed for {label}: what flashdp counted differs from autograd's per-sample "
                "gradient:\n  - " + "\n  - ".join(problems) + "\nLikely causes: a parameter used outside the "
                "forward of the layer that counts it, a custom rule (register_rule) that computes another "
                "gradient, or a loss[i] that depends on other samples. See docs/assumptions.md."
            )


def _largest_counted_norm(counted: Sequence[Counted]) -> float:
    """The largest (finite) norm over all parameters that any unit of the batch was counted."""
    totals = torch.stack([c.norm_sq.double() for c in counted]).sum(0)
    totals = totals[torch.isfinite(totals)]
    return math.sqrt(max(float(totals.max()), 0.0)) if totals.numel() else 0.0


def _cancelling_slack(counted: Counted, i: int, norm: float) -> float:
    """How far autograd's norm may be from the counted one through rounding alone: where the unit's parts cancel
    (the rounding bound's margin over the norm exceeds the norm itself), anywhere within the bound; elsewhere 0,
    the tolerance's relative error covering the rounding of parts that do not cancel (a margin of a few percent
    at long sequences, granted everywhere, let a rule dropping one position of 2048 through)."""
    if counted.bound_sq is None:
        return 0.0
    margin = math.sqrt(max(float(counted.bound_sq[i]), 0.0)) - norm
    return margin if margin >= norm else 0.0


def underflow_floor(counted: Counted) -> float:
    """How far a counted norm may be from the true one where its squares (or a ghost norm's inner products) fall
    below the smallest normal number of their dtype and lose their digits (float32: elements below about 1e-19,
    such as a sample fit so well that its gradient is 1e-30): `2^20 sqrt(tiny)` (float32: 1.1e-13), which bounds
    that loss for up to 2^40 squares or large activations' inner products. No sample's clipped gradient can exceed
    C through it where C is above it (`check_per_sample` takes the smaller of it and the bound's share)."""
    return 2.0**20 * math.sqrt(torch.finfo(counted.norm_sq.dtype).tiny)


def _disagreement(counted: Counted, true: UnitGradient, i: int, rtol: float, floor: float) -> str | None:
    true_norm = true.norms[counted.key]
    norm = math.sqrt(max(float(counted.norm_sq[i]), 0.0))
    slack = _cancelling_slack(counted, i, norm)
    if abs(norm - true_norm) > rtol * (norm + true_norm) + floor + slack:
        return f"'{counted.name}': counted norm {norm:.4g}, autograd's {true_norm:.4g}"
    if counted.plan is not None and counted.key in true.projections:
        one_hot = torch.zeros_like(counted.norm_sq)
        one_hot[i] = 1
        gradient = counted.plan.clipped_sum(one_hot)
        seed, expected = true.projections[counted.key]
        error = float((project(gradient, seed) - expected).square().mean().sqrt())  # ~ ||gradient - true||
        if error > rtol * (float(gradient.double().norm()) + true_norm) + floor + 2 * slack:  # (two roundings)
            return f"'{counted.name}': the gradient it would add is {error:.4g} away from autograd's ({true_norm:.4g})"
    return None
