"""DPEngine and make_private: per-sample clipping for any nn.Module, without wrapping it, and DP-SGD's step.

`DPEngine` is a façade: it wires the stages of `flashdp._pipeline` (whose docstring lists them in the order one
backward runs them) and threads one value through them: what the engine knows about the model (`Knowledge`),
committed when a backward succeeds. Measuring is `measurement.measure`, the clipped sums `clipped_sums`, the step
`flashdp.noisy_step.NoisyStep`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, default_collate

from flashdp._pipeline import coverage, guards
from flashdp._pipeline.attachment import Attachment
from flashdp._pipeline.clipped_sums import Keeps, Norms, NormsOnly, clipped_sums_for
from flashdp._pipeline.clipping import Clipping
from flashdp._pipeline.garbage import collection_paused
from flashdp._pipeline.knowledge import Knowledge, SelfCheckSchedule
from flashdp._pipeline.measurement import Measurement, Parts, measure
from flashdp._pipeline.param_grad import StrategyChoice
from flashdp._pipeline.plan import scan_model
from flashdp._pipeline.profiling import PhaseTimer, profiling_requested
from flashdp._pipeline.recorder import Forward
from flashdp._pipeline.settings import DEFAULT_SELF_CHECK_INTERVAL, EngineSettings, Mode, NonFinite
from flashdp._pipeline.users import UserGroups, UserLedger
from flashdp.data import LOADER_STRIDE, check_loader_rate, count_users, poisson_loader
from flashdp.distributed import Adapter, adapter_for
from flashdp.distributed.checks import check_norm_group, check_same_samples, check_same_settings, raise_on_every_rank
from flashdp.errors import FlashDPError
from flashdp.kernels import Backend
from flashdp.noisy_step import NoisyStep
from flashdp.privacy import NoiseSource, keyed
from flashdp.privacy.settings import PrivacyRequest, PrivacySettings

#: the key a clipped loss's autograd node is marked with (`Node.metadata`): a second backward on it is named as such
_CLIPPED = "flashdp: clipped"


def _of_the_step(name: str) -> property:
    """An engine attribute that is the noisy step's (`NoisyStep`): read and set there."""
    return property(
        lambda engine: getattr(engine.noisy_step, name),
        lambda engine, value: setattr(engine.noisy_step, name, value),
        doc=f"`engine.noisy_step.{name}`.",
    )


def _of_the_settings(name: str) -> property:
    """A read-only engine attribute that is its settings' (`EngineSettings`)."""
    return property(lambda engine: getattr(engine.settings, name), doc=f"`engine.settings.{name}`.")


class DPEngine:
    """Exact per-sample gradient clipping (and, with `step()`, DP-SGD) for a model it does not wrap.

    Build it with `flashdp.make_private`. All state lives here: nothing is stored on the model's modules or
    parameters beyond PyTorch hooks (forward hooks on its layers, a step pre-hook on the optimizer), which
    `detach()` removes. `engine.noisy_step` is the step, with its extension point (`NoisyStep.register_hook`).
    """

    def __init__(
        self,
        model: nn.Module,
        settings: EngineSettings,
        privacy: PrivacyRequest,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        norm_group: dist.ProcessGroup | None = None,
        trains: bool = True,
    ) -> None:
        """See `make_private`. The privacy request is resolved (sigma calibrated) after the model's checks.
        trains=False (per-sample norms only) leaves every optimizer free to step the model."""
        if not isinstance(model, nn.Module):
            raise FlashDPError(f"make_private expects an nn.Module. Received {type(model).__name__}.")
        self.model, self.settings, self.norm_group = model, settings, norm_group
        self._timer = PhaseTimer(settings.profile)
        self._adapter = adapter_for(model, self._timer, secure_rng=settings.secure_rng)  # attach() changes it
        plan = scan_model(model, self._adapter.param_views)
        self._trainable = guards.TrainableParams(model, check_identity=not self._adapter.swaps_parameters)
        if optimizer is not None:
            guards.check_optimizer(optimizer, model)
        resolved = privacy.resolve()
        check_same_settings(_compared_settings(settings, resolved), self._adapter.dp_group)
        self._norm_group_checked = _checked_norm_group(norm_group, self._adapter)
        noise = _noise_source(settings, self._adapter)  # (before the adapter changes anything on a wrapper)
        self._attachment = Attachment(self, model, plan, self._adapter, self._timer, trains)
        provenance = self._attachment.provenance
        self._sums = clipped_sums_for(settings, self._adapter, self._attachment.grad_writes)
        self._norms_only = NormsOnly(self._adapter)
        self.noisy_step = NoisyStep(settings, resolved, optimizer, self._adapter, noise, provenance, self._timer)
        # (the self-check needs a second pass over one forward, which FSDP1 cannot take)
        interval = settings.self_check if self._adapter.allows_second_pass else None
        self._known = Knowledge(plan, self_check=SelfCheckSchedule(interval))
        self._commit(self._known)
        # the same on every rank: TP ranks must weight the losses alike, FSDP ranks run the same passes
        generator, attached = torch.Generator().manual_seed(0), self._attachment
        self._parts = Parts(
            settings, self._adapter, self._timer, attached.recorder, lambda: self._adapter.named_parameters(model),
            norm_group, generator, attached.grad_writes, {},
        )  # fmt: skip
        self._backward_calls, self._skipped_samples, self._users = 0, 0, UserLedger()

    def _commit(self, known: Knowledge) -> None:
        """Trust `known` from now on: the next forward is recorded under its plan, the step noises its parameters."""
        self._known = known
        self._attachment.recorder.follow(known.plan)
        self.noisy_step.follow(known.plan)

    # -- settings and what the last backward found ----------------------------------------------------------

    mode = _of_the_settings("mode")
    max_grad_norm = _of_the_settings("max_grad_norm")
    # (the step's: read and set there)
    optimizer = _of_the_step("optimizer")
    noise_multiplier = _of_the_step("noise_multiplier")
    expected_batch_size = _of_the_step("expected_batch_size")
    sample_rate = _of_the_step("sample_rate")

    @property
    def skipped_samples(self) -> int:
        """Samples given a zero contribution so far because their gradient was not finite (nonfinite="skip")."""
        return self._skipped_samples

    @property
    def strategies(self) -> dict[str, str]:
        """Per trainable parameter reached in the last backward, how its norm was computed ("ghost", "direct",
        "per-sample", "broadcast", "generic"...): what to look at when a layer is slow. Also in the profile."""
        return dict(self._parts.strategies)

    # -- clipping -----------------------------------------------------------------------------------------

    def backward(self, loss: Tensor, *, users: Tensor | None = None) -> Tensor:
        """Add `sum_i c_i grad(loss[i])` to every trainable parameter's `.grad`; return `||g_i||` `[B]` float32.

        loss: `[B]`, one loss per sample of the last forward (e.g. `reduction="none"`). For a micro-batch with no
        samples, whose forward a model may not run, call `backward_empty()` instead.
        users: `[B]` integer ids, for user-level privacy: the clipped unit is then a user's gradient
            `g_u = sum_{i in u} g_i`, `.grad += sum_u c_u g_u`, and row i of the result is `||g_u||` of its user.
            All of a user's rows of one step must be in one backward on one rank (else refused); an engine clips
            by user from its first backward on, or never (docs/guides/user-level.md).
        """
        return self._backward(loss, users, counted=True)

    def backward_padding(self, loss: Tensor, *, users: Tensor | None = None) -> None:
        """The backward of stand-in rows a rank runs only to run the same passes as the other ranks (DDP, FSDP)
        where it has no samples for a micro-batch and the model cannot run a forward on zero rows (HF transformers):
        `loss` `[b]` their per-sample losses. Weighted by exactly 0 here, they add nothing to `.grad` and count as
        no samples; their norms are checked to be 0. users: with user-level clipping, any ids (no users of it)."""
        skipped = self._skipped_samples
        norms = self._backward(loss * 0.0, users, counted=False)
        self._skipped_samples = skipped  # (stand-ins are no samples, skipped or not)
        _check_padding_norms(norms)

    @collection_paused()
    def _backward(self, loss: Tensor, users: Tensor | None, counted: bool) -> Tensor:
        """`backward`; `counted`: whether its rows (and users) count as samples (users) of the step."""
        loss, forward, refusal, groups = self._take_forward(loss, check_provenance=True, users=users)
        batch = loss.shape[0]
        # (stand-ins join the ranks' agreement on the unit and their exchange of users, with none)
        ledger = groups if counted or groups is None else UserGroups.of(users[:0], 0, loss.device)
        clipping = self._users.check(ledger, self._adapter.dp_group)
        units = batch if groups is None else groups.count
        if batch == 0 and self._adapter.world_size == 1:
            self.noisy_step.backward_done(0)
            return torch.zeros(0, dtype=torch.float32, device=loss.device)
        # an empty batch on one rank of several still runs every pass: the wrappers' collectives must match
        measured = self._measure(loss, forward, self._sums.keeps, groups, refusal)
        clip_norms_sq = measured.clip_norms_sq
        coef, norms = self._coefficients(measured)
        again, kept, measured = measured.again, _kept(measured), None
        with self._timer.phase("second pass / bk sums"):
            self._sums.add(loss, norms, coef, groups, again, kept)
        del norms, again
        self._users.clipped(clipping)
        provenance = self._attachment.provenance
        provenance.record(self._adapter.accumulated_gradients(self._known.plan.params))
        self.noisy_step.backward_done(units if counted else 0)
        unit_norms = clip_norms_sq.sum(0).sqrt().float()
        return unit_norms if groups is None else groups.per_row(unit_norms)

    def backward_empty(self) -> None:
        """The backward of a micro-batch with no samples (Poisson sampling draws them), without a forward: many
        models (HF transformers) cannot run one on zero rows. Nothing is added to `.grad`; `step()` still adds the
        noise and accounts the step. Under DDP or FSDP, where every rank must run the same passes, run the forward
        and `backward` on the empty batch instead (`flashdp.micro_batches(batch, size, group=...)`)."""
        recorder = self._attachment.recorder_if_attached()
        if recorder.calls:
            recorder.take()
            raise FlashDPError(
                "engine.backward_empty() is for a micro-batch whose forward was not run, but a forward was recorded "
                "since the last backward: call engine.backward(loss) on its per-sample losses instead."
            )
        if self._adapter.world_size > 1:
            raise _backward_empty_on_one_rank_error(self._adapter.world_size)
        self._timer.forward_ended()
        self.noisy_step.backward_done(0)

    def per_sample_norms(self, loss: Tensor, *, per_parameter: bool = False) -> Tensor | dict[str, Tensor]:
        """The per-sample gradient norms `||grad(loss[i])||` `[B]` float32 of the last forward, without clipping,
        noise or any change to `.grad` (for data valuation and debugging): the norm over all trainable parameters,
        or with `per_parameter=True` a dict of each parameter's `[B]` norms. The forward's graph is kept, so
        `loss.mean().backward()` may follow for ordinary training."""
        loss, forward, _, _ = self._take_forward(loss, check_provenance=False)
        if loss.shape[0] == 0:
            return {} if per_parameter else torch.zeros(0, dtype=torch.float32, device=loss.device)
        measured = self._measure(loss, forward, self._norms_only.keeps)
        if per_parameter:
            return {param.name: norm.norm_sq.sqrt().float() for param, norm in measured.norms}
        return measured.clip_norms_sq.sum(0).sqrt().float()

    def _take_forward(
        self, loss: Tensor, check_provenance: bool, users: Tensor | None = None
    ) -> tuple[Tensor, Forward, FlashDPError | None, UserGroups | None]:
        """The checked loss, what its forward recorded, a refusal of the gradients it would add to (below), and the
        rows' users. A check failing on this rank is raised on every rank together (`raise_on_every_rank`)."""
        device = loss.device if isinstance(loss, Tensor) else None
        unit = [users is not None, users is None]  # (agreed in the same all-reduce: the privacy unit's flags)
        try:
            loss, forward, refusal = self._checked_forward(loss, check_provenance)
            groups = None if users is None else UserGroups.of(users, loss.shape[0], loss.device)
            error = self._users.unit_changed(groups) if check_provenance else None
            if error is not None:
                raise error
        except FlashDPError as error:
            raise_on_every_rank(error, self._adapter.dp_group, device, unit)
        some, not_all = raise_on_every_rank(None, self._adapter.dp_group, device, unit)
        if check_provenance:
            self._users.agree_unit(bool(some), bool(not_all))
        if not self._norm_group_checked:
            check_same_samples(loss, self.norm_group)
            self._norm_group_checked = True
        return loss, forward, refusal, groups

    def _checked_forward(self, loss: Tensor, check_provenance: bool) -> tuple[Tensor, Forward, FlashDPError | None]:
        recorder = self._attachment.recorder_if_attached()
        self._timer.forward_ended()
        self._trainable.check_unchanged()
        loss = guards.check_loss(loss, self._sums.take_unmatched)
        gradients = self._adapter.accumulated_gradients(self._known.plan.params) if check_provenance else []
        refusal = self._attachment.provenance.refusal_before_backward(gradients, self._adapter.dp_group is not None)
        forward = recorder.take()
        if not forward.calls:
            clipped = loss.grad_fn is not None and _CLIPPED in loss.grad_fn.metadata
            raise coverage.no_forward_error(loss, self._known.plan, self.model.named_parameters(), clipped)
        if loss.grad_fn is not None:  # (marked on the node itself: a Python id of its wrapper may be reused)
            loss.grad_fn.metadata[_CLIPPED] = True
        if check_provenance:
            self._attachment.grad_writes.check_no_gradient_hooks()
        return loss, forward, refusal

    def _measure(
        self,
        loss: Tensor,
        forward: Forward,
        keeps: Keeps,
        users: UserGroups | None = None,
        refusal: FlashDPError | None = None,
    ) -> Measurement:
        """The checked per-sample norms (`measurement.measure`), no `.grad` written meanwhile; what the backward
        learnt is committed only if it succeeds (a forward's own checks of its rules are kept either way)."""
        self._commit(self._known.with_plan(forward.plan))
        index, self._backward_calls = self._backward_calls, self._backward_calls + 1
        with self._attachment.grad_writes.refusing():
            measured, known = measure(self._parts, self._known, loss, forward.calls, index, keeps, users, refusal)
        self._commit(known)
        return measured

    def _coefficients(self, measured: Measurement) -> tuple[Tensor, Norms]:
        """`[L, B]` clipping coefficients, and the norms whose clipped sums are added: a sample skipped for a
        non-finite gradient gets none (its rows dropped from the plans: 0 * NaN is NaN)."""
        with torch.no_grad():
            coef = self.noisy_step.clip_coefficients(measured.clip_norms_sq)
            if measured.skipped is None:
                return coef, measured.norms
            self._skipped_samples += int(measured.skipped.sum())
            kept = ~measured.skipped
            return coef.masked_fill(measured.skipped, 0.0), [(p, n.dropping(kept)) for p, n in measured.norms]

    # -- DP-SGD -------------------------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """DP-SGD steps taken (and accounted for)."""
        return self.noisy_step.steps

    def step(self) -> None:
        """Noise, averaging and the optimizer step: for every trainable p,
        `p.grad = (p.grad + N(0, sigma^2 C^2 I)) / expected_batch_size`, then `optimizer.step()`,
        `optimizer.zero_grad()` and one accountant step (`NoisyStep`)."""
        self.noisy_step()
        self._users.step_taken()
        self._timer.report(self.steps, self.strategies)

    def data_loader(
        self,
        dataset: Dataset,
        *,
        collate_fn: Callable[[list], Any] = default_collate,
        steps: int | None = None,
        users: Sequence[int] | Tensor | None = None,
        examples_per_user: int | None = None,
        **loader_kwargs: Any,
    ) -> DataLoader:
        """A DataLoader of Poisson-sampled batches of `dataset` at the engine's `sample_rate`: the sampling that
        `epsilon()` assumes. From the OS CSPRNG with `secure_rng=True`; seeded by the engine's `seed` and the step
        the loader is made at (loaders made at other steps draw other batches); else from OS entropy. Under DDP or
        FSDP each rank samples its own shard of `dataset` (give every rank the whole dataset). Batch sizes vary and
        may be 0 (see `backward_empty`). steps: batches per pass over the loader, default `ceil(1 / sample_rate)`
        (an epoch in expectation).

        users, examples_per_user: user-level privacy. `users` `[N]` the user id of each example; each step samples
        USERS at the engine's rate and up to `examples_per_user` examples of each, a user's examples on one rank;
        the loader yields `(batch, users)` for `engine.backward(loss, users=users)`. The engine's
        `expected_batch_size` is then `sample_rate` times the number of users (docs/guides/user-level.md)."""
        options = {"collate_fn": collate_fn, "steps": steps, "users": users, "examples_per_user": examples_per_user}
        return _loader(self, dataset, options | loader_kwargs)

    def epsilon(self, delta: float) -> float:
        """The epsilon spent so far at this delta (PLD, or RDP when accountant="rdp")."""
        return self.noisy_step.epsilon(delta)

    def state_dict(self) -> dict:
        """What a resumed run needs to report the same epsilon: the settings it must match and the accountant's
        history. The noise generators' state only when the run was seeded (`make_private(seed=...)`): it is the
        secret that removes the noise, so an unseeded run keeps it out of checkpoints and draws fresh noise when
        resumed; a seeded run resumes bitwise. The privacy unit (rows or users), once a backward fixed it."""
        return self.noisy_step.state_dict() | {"unit": self._users.unit}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`, e.g. `engine.load_state_dict(torch.load(path))` on an engine built with the
        same noise_multiplier, sample_rate and max_grad_norm (a different one is refused: the accounting would not
        describe the run). The accountant's history is restored, so `epsilon()` continues where it stopped; a
        seeded run's noise generator and the run's privacy unit too; all is checked before anything is loaded."""
        self._users.resume(state, lambda: self.noisy_step.load_state_dict(state))

    # -- lifecycle ----------------------------------------------------------------------------------------

    def detach(self) -> None:
        """Remove every hook: the model is plain PyTorch again and the engine cannot clip. Until then it lives as long
        as the model, even unreferenced: every optimizer step over its trainable parameters is refused. `.grad` keeps
        what a backward with no step after it left (clipped sums, no noise): a plain optimizer step would apply them
        without privacy. Raises, detached, where the last backward's second pass (ghost, flash) refused sums."""
        self._attachment.detach()
        guards.check_last_sums(self._sums.take_unmatched)

    def __enter__(self) -> DPEngine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.detach() if exc_type is None else self._attachment.detach()  # (an error on its way out comes first)


def _loader(engine: DPEngine, dataset: Dataset, options: dict[str, Any]) -> DataLoader:
    """`engine.data_loader(dataset, **options)`."""
    users = options["users"]
    if users is None:
        check_loader_rate(engine.sample_rate, engine.expected_batch_size, len(dataset))
    else:
        check_loader_rate(engine.sample_rate, engine.expected_batch_size, count_users(users), "the number of users")
    group = engine._adapter.dp_group
    seed = engine.settings.seed
    loader = poisson_loader(
        dataset,
        engine.sample_rate,
        # (a seeded run's loaders differ by the step they are made at: one made every epoch would replay the
        # first's batches, which the accounting takes for fresh samples; a resumed run makes the same)
        seed=None if seed is None else (seed + engine.steps * LOADER_STRIDE) % 2**63,
        secure_rng=engine.settings.secure_rng,
        rank=dist.get_rank(group) if group is not None else 0,
        world_size=engine._adapter.world_size,
        **options,
    )
    engine.noisy_step.follow_rate(loader.batch_sampler)
    return loader


def _compared_settings(settings: EngineSettings, privacy: PrivacySettings) -> dict[str, object]:
    """The settings every data-parallel rank must share (not the seed, nor whether to profile)."""
    shared = {k: v for k, v in dataclasses.asdict(settings).items() if k not in ("seed", "profile")}
    return shared | dataclasses.asdict(privacy)


def _checked_norm_group(norm_group: dist.ProcessGroup | None, adapter: Adapter) -> bool:
    """Whether nothing is left to check of the norm group (its samples are checked at the first backward)."""
    if norm_group is None:
        return True
    if not dist.is_initialized():
        raise FlashDPError("norm_group needs torch.distributed to be initialised (dist.init_process_group).")
    check_norm_group(norm_group, adapter.dp_group)
    return False


def _noise_source(settings: EngineSettings, adapter: Adapter) -> NoiseSource:
    if settings.secure_rng:
        return NoiseSource(None, "secure")
    drawn = keyed.secret_key() if settings.seed is None else settings.seed
    return NoiseSource(adapter.noise_seed(drawn), "secret" if settings.seed is None else "seeded")


def _kept(measured: Measurement) -> Tensor | None:
    """`[B]` the units not skipped for a non-finite gradient, or None where none can be (nonfinite="error")."""
    return None if measured.skipped is None else ~measured.skipped


def _check_padding_norms(norms: Tensor) -> None:
    """The norms of stand-in rows whose loss was weighted by 0: exactly 0, else refused."""
    if bool((norms != 0).any()):  # (a padding micro-batch is rare: this sync costs nothing in a steady step)
        raise FlashDPError(
            f"engine.backward_padding: the stand-in rows' gradients of a loss weighted by 0 have norms "
            f"{norms.tolist()}, not 0: a loss that is not finite (0 * inf is NaN)? Pad with a row whose loss is "
            "finite (a copy of a real one)."
        )


def make_private(
    model: nn.Module,
    *,
    mode: Mode = "bk",
    max_grad_norm: float,
    noise_multiplier: float | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    expected_batch_size: int | None = None,
    sample_rate: float | None = None,
    clipping: Clipping = "flat",
    target_epsilon: float | None = None,
    target_delta: float | None = None,
    steps: int | None = None,
    epochs: float | None = None,
    accountant: str = "pld",
    seed: int | None = None,
    secure_rng: bool = False,
    norm_strategy: StrategyChoice = "auto",
    kernels: Backend = "auto",
    norm_group: dist.ProcessGroup | None = None,
    profile: bool | None = None,
    self_check: int | None = DEFAULT_SELF_CHECK_INTERVAL,
    nonfinite: NonFinite = "error",
) -> DPEngine:
    """Make training of `model` differentially private. The model is not wrapped: its state_dict, type and
    methods are unchanged; `engine.detach()` removes every hook.

    Args:
        mode: "bk" (one backward pass), "ghost" (two passes) or "flash" (two passes, norms from Triton kernels
            that never materialise a per-sample gradient; needs a CUDA device, or TRITON_INTERPRET=1 for tests).
        max_grad_norm: C, the per-sample clipping bound.
        noise_multiplier: sigma, the noise std in units of C. Or None, with target_epsilon, target_delta,
            sample_rate and steps (or epochs): sigma is then calibrated so the final epsilon is at most the target.
        optimizer: any torch optimizer over the model's parameters; needed by `engine.step()`.
        expected_batch_size: the GLOBAL logical batch size (all ranks, all micro-batches of one step):
            `sample_rate * len(dataset)`. The noisy sum is divided by it.
        sample_rate: Poisson sampling rate q, for accounting (and for `engine.data_loader`).
        clipping: "flat", "per_layer" (layer l clipped to C / sqrt(#layers)) or "automatic" (C / (||g|| + 0.01)).
        target_epsilon: with noise_multiplier=None, the epsilon the whole run may spend: sigma is calibrated so
            that the epsilon after `steps` steps lies in [0.99 * target, target] (`flashdp.get_noise_multiplier`).
        target_delta: the delta of that target, well below 1 / len(dataset) (e.g. 1e-5).
        steps: the number of `engine.step()` calls the run will make (with target_epsilon).
        epochs: instead of steps, passes over the data in expectation: `ceil(epochs / sample_rate)` steps.
        accountant: "pld" (tight, default) or "rdp".
        seed: makes the noise reproducible; NOT private (whoever knows it can remove the noise). Default: seeded
            from OS entropy.
        secure_rng: draw the noise, and the sampling of `engine.data_loader`, from the OS CSPRNG instead of torch's
            generator (slower, not reproducible). A loader you build yourself samples as you built it.
        norm_strategy: "auto" picks, per layer and batch shape, the cheaper exact norm of a weight; "ghost" or
            "direct" force one (for benchmarks and tests).
        kernels: "auto" (on CUDA tensors the Triton kernels measured faster than PyTorch on a GPU: ghost norms,
            clipped sums, norm-layer affine gradients; PyTorch otherwise), "triton" (every kernel, everywhere it can
            run) or "torch" (never). float64 inputs always use PyTorch.
        norm_group: a process group that splits each sample's computation (tensor parallel): squared norms are
            summed over it. Never a data-parallel group: norms are local to the rank that holds the sample.
        profile: print a per-phase time breakdown of every step to stderr (forward, norm pass, norm computation,
            communication, second pass or bk sums, noise, optimizer). Default: the FLASHDP_PROFILE environment
            variable.
        self_check: on the first backward and then every `self_check` backward calls, compare what flashdp
            counted with autograd's own per-sample gradients on the same graph (two samples), and check that every
            layer's output rows are per-sample; a disagreement raises FlashDPError naming the parameters or layers
            and the likely cause. None turns it off. It costs about three backward passes when it runs. Not run
            under FSDP1, which cannot take a second pass over one forward.
        nonfinite: what backward does with a sample whose gradient is NaN or inf (its loss finite): "error" raises
            FlashDPError naming the samples before any `.grad` changes; "skip" (any mode; bk only under FSDP2) gives
            them a zero contribution, counted in `engine.skipped_samples`, and returns their norm as NaN or inf.
            Either way no non-finite value reaches a parameter. A finite norm too large for float32 is recomputed
            in float64 and clipped like any other.

    The model may be wrapped by DistributedDataParallel or sharded with FSDP2 (`fully_shard`) or FSDP1
    (`FullyShardedDataParallel`); then expected_batch_size and sample_rate are global (all ranks), and every rank
    ends with the update one process holding the global batch would make.
    """
    settings = EngineSettings(
        mode=mode,
        max_grad_norm=max_grad_norm,
        clipping=clipping,
        norm_strategy=norm_strategy,
        kernels=kernels,
        seed=seed,
        secure_rng=secure_rng,
        profile=profiling_requested(profile),
        self_check=self_check,
        nonfinite=nonfinite,
    )
    privacy = PrivacyRequest(
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch_size,
        sample_rate=sample_rate,
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        steps=steps,
        epochs=epochs,
        accountant=accountant,
    )
    return DPEngine(model, settings, privacy, optimizer=optimizer, norm_group=norm_group)


def _backward_empty_on_one_rank_error(world_size: int) -> FlashDPError:
    return FlashDPError(
        f"engine.backward_empty() on one rank of {world_size}: every rank must run the same forward and backward "
        "passes (their collectives must match). Run the forward on the empty batch and engine.backward(loss) on "
        "its empty loss."
    )
