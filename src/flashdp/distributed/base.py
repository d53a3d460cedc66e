"""The adapter interface, implemented here for a single process: where clipped sums go and how step() reduces
and noises gradients. The data-parallel wrappers implement it in `ddp.py`, `fsdp1.py` and `fsdp2.py`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flashdp._pipeline.params import ParamView, TrainableParam, local_param_views
from flashdp._pipeline.profiling import PhaseTimer
from flashdp.errors import FlashDPError
from flashdp.per_sample import cast


class Adapter:
    """A single process: gradients are local and whole."""

    world_size = 1
    #: the data-parallel group, whose ranks hold different samples (None: one process)
    dp_group: dist.ProcessGroup | None = None
    #: whether the wrapper allows a second backward over the graph of the norm pass (ghost's and flash's clipped
    #: sums, the verifying pass, the self-check)
    allows_second_pass = True
    #: whether the wrapper registers other parameter objects during the forward (FSDP2's unsharded ones), so that
    #: only names, not identities, of the registered parameters stay the same
    swaps_parameters = False
    #: whether parameters are freed or replaced after the forward (FSDP), so that a rule needing their values
    #: keeps a copy of them from the call
    reshards_after_forward = False

    def __init__(self, timer: PhaseTimer) -> None:
        #: the engine's timer; collectives are timed as "communication"
        self.timer = timer

    def param_views(self, module: nn.Module) -> dict[str, ParamView]:
        """The module's own trainable parameters, with their full shapes and identities."""
        return local_param_views(module)

    def named_parameters(self, model: nn.Module) -> Iterator[tuple[str, Tensor]]:
        """The model's parameters as the graph of its forward may hold them (the coverage walk reads them where a
        leaf of the graph is neither the plan's nor a recorded call's)."""
        return model.named_parameters()

    def attach(self) -> None:
        """Change what the engine needs changed on the wrapper (`detach()` restores it)."""

    def norm_pass(self) -> contextlib.AbstractContextManager:
        """Around the norm pass: no gradient collective may run in it."""
        return contextlib.nullcontext()

    @property
    def second_pass_scale(self) -> float:
        """Loss factor of the ghost second pass, so that the wrapper's gradient reduction yields the SUM."""
        return 1.0

    def holds_own(self, param: TrainableParam, tensor: object) -> bool:
        """Whether `tensor`, what a module holds for `param` during its forward, is the parameter itself, not
        another tensor put in its place (`torch.func.functional_call(layer, {"weight": w * mask}, x)`); under a
        wrapper that swaps parameters in for the forward, the one it swaps in."""
        return tensor is param.param

    def rerun_error(self, module: nn.Module, label: str) -> FlashDPError | None:
        """Why a rule may not run the module's forward again in the backward (the generic rule's re-run), or None:
        under no wrapper it runs as it ran."""
        return None

    def graph_leaves(self, params: list[TrainableParam]) -> list[Tensor]:
        """The leaves a backward over the forward's graph accumulates these parameters' gradients into."""
        return [p.param for p in params]

    def accumulate(self, param: TrainableParam, clipped_sum: Tensor) -> None:
        """`grad += clipped_sum` (this rank's samples, full parameter shape) where the optimizer will read it."""
        add_to_grad(param.param, clipped_sum)

    def accumulation_order(self, param: TrainableParam) -> int:
        """Parameters reach `accumulate` sorted by this key (stably: in the forward's order where equal)."""
        return 0

    def accumulation_done(self) -> None:
        """After the last `accumulate` of one backward."""

    def gradient_holders(self, params: list[TrainableParam]) -> list[Tensor]:
        """The tensors whose `.grad` step() noises and averages: every trainable coordinate once."""
        return [p.param for p in params]

    def reduce_gradients(self, params: list[Tensor]) -> None:
        """At step(), before the noise: make every rank's gradient the sum over all ranks' samples."""

    def accumulated_gradients(self, params: list[TrainableParam]) -> list[tuple[str, Tensor | None]]:
        """This rank's accumulated gradients as step() will noise them, named: the tensors themselves, whose
        identity and version tell whether anything but engine.backward changed them."""
        with torch.no_grad():
            return [(p.name, None if p.param.grad is None else self.local_grad(p.param)) for p in params]

    def local_grad(self, param: Tensor) -> Tensor:
        """The part of `param.grad` this rank adds noise to."""
        return param.grad

    def noise_seed(self, seed: int) -> int:
        """The seed of this rank's noise generator, from this process's seed."""
        return seed

    def shared_noise(self, noise: Tensor) -> Tensor:
        """Noise that must be equal on every rank holding the same coordinates is made so here."""
        return noise

    def zero_grad(self) -> None:
        """After `optimizer.zero_grad()`: clear gradients the optimizer does not see."""

    def detach(self) -> None:
        """Undo what attaching changed on the wrapper."""


def add_to_grad(param: Tensor, value: Tensor) -> None:
    """`param.grad += value`, creating it in the parameter's dtype."""
    if param.grad is None:
        param.grad = cast(value, param.dtype)
    else:
        param.grad.add_(cast(value, param.grad.dtype))
