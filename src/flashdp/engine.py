"""DPEngine and make_private: per-sample clipping for any nn.Module, without wrapping it, and DP-SGD's step.

The engine runs the stages of `flashdp._pipeline` (whose docstring lists them in order) and keeps all state.
"""

from __future__ import annotations

import enum
import functools
import secrets
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, default_collate

from flashdp._checks import checked_delta
from flashdp._pipeline import coverage, guards, nonfinite, self_check, shared_outputs
from flashdp._pipeline.clipping import Clipping, clip_coefficients
from flashdp._pipeline.collector import NormCollector, no_trainable_layer_error
from flashdp._pipeline.grad_writes import GradWrites
from flashdp._pipeline.knowledge import Knowledge, SelfCheckSchedule
from flashdp._pipeline.norm_pass import batch_dims, stream_output_gradients
from flashdp._pipeline.param_grad import ParamNorm, StrategyChoice
from flashdp._pipeline.params import TrainableParam
from flashdp._pipeline.plan import GradientPlan, scan_model
from flashdp._pipeline.profiling import PhaseTimer, profiling_requested
from flashdp._pipeline.provenance import GradientProvenance
from flashdp._pipeline.recorder import Call, Recorder
from flashdp._pipeline.settings import DEFAULT_SELF_CHECK_INTERVAL, EngineSettings, Mode, NonFinite
from flashdp.data import poisson_loader
from flashdp.distributed import Adapter, adapter_for
from flashdp.distributed.checks import (
    check_global_batch,
    check_norm_group,
    check_same_samples,
    highest_on_any_rank,
)
from flashdp.errors import FlashDPError, FlashDPWarning
from flashdp.kernels import Backend
from flashdp.kernels import backend as kernels_backend
from flashdp.privacy import Accountant, NoiseSource
from flashdp.privacy.sampling import SamplingMonitor
from flashdp.privacy.settings import PrivacyRequest


class DPEngine:
    """Exact per-sample gradient clipping (and, with `step()`, DP-SGD) for a model it does not wrap.

    Build it with `flashdp.make_private`. All state lives here: nothing is stored on the model's modules or
    parameters beyond PyTorch hooks (forward hooks on its layers, a step pre-hook on the optimizer), which
    `detach()` removes.
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
        self.model = model
        self.settings = settings
        self._timer = PhaseTimer(settings.profile)
        self._adapter = adapter_for(model, self._timer, secure_rng=settings.secure_rng)  # attach() changes it
        plan = scan_model(model, self._adapter.param_views)
        self._trainable = guards.TrainableParams(model, check_identity=not self._adapter.swaps_parameters)
        self.optimizer = optimizer
        if optimizer is not None:
            guards.check_optimizer(optimizer, model)
        resolved = privacy.resolve()
        self.noise_multiplier = resolved.noise_multiplier
        self.expected_batch_size = resolved.expected_batch_size
        self.sample_rate = resolved.sample_rate
        if norm_group is not None and not dist.is_initialized():
            raise FlashDPError("norm_group needs torch.distributed to be initialised (dist.init_process_group).")
        self.norm_group = norm_group
        self._norm_group_checked = norm_group is None
        if settings.secure_rng:  # checked before the adapter changes anything on a wrapper
            self._noise = NoiseSource(None, "secure")
        else:
            seed = secrets.randbits(63) if settings.seed is None else settings.seed
            self._noise = NoiseSource(self._adapter.noise_seed(seed), "secret" if settings.seed is None else "seeded")
        if norm_group is not None:
            check_norm_group(norm_group, self._adapter.dp_group)
        self._hooked = [site.module for site in plan.sites.values()]
        guards.claim(self._hooked, self, {id(site.module): site.label for site in plan.sites.values()})
        self._adapter.attach()
        self._accountant = Accountant(resolved.accountant)
        per_rank = (self.expected_batch_size or 0) / self._adapter.world_size
        self._sampling = SamplingMonitor(per_rank)
        self._backward_since_step = False
        self._samples_since_step = 0
        self._hook_into(model, plan, trains)
        self._strategies: dict[str, str] = {}
        #: what the engine trusts about the model, and why (committed by a backward that succeeds)
        # (not under FSDP1, which cannot run a second pass over one forward)
        interval = settings.self_check if self._adapter.allows_second_pass else None
        self._known = Knowledge(plan, self_check=SelfCheckSchedule(interval))
        self._backward_calls = 0
        # the same on every rank: TP ranks must weight the losses alike, FSDP ranks run the same passes
        self._check_generator = torch.Generator().manual_seed(0)
        self._last_loss_node: int | None = None
        self._skipped_samples = 0
        #: called by step() once the clipped sums are in .grad, before the noise (the canary audit adds its own)
        self._before_noise: list[Callable[[], None]] = []

    def _hook_into(self, model: nn.Module, plan: GradientPlan, trains: bool) -> None:
        """The recorder's forward hooks, the gradient guards, and what `detach()` removes. A training engine lives
        until `detach()`: the model's hooks hold it, so dropping the returned engine (`flashdp.make_private(model,
        ...)` as a statement) never re-opens non-private training; model and engine are collected together."""
        self._recorder = Recorder(plan, self._timer.forward_started, keep_params=self._adapter.reshards_after_forward)
        self._provenance = GradientProvenance(model if trains else None)
        # (under FSDP the registered parameters are not the ones autograd accumulates into)
        watched = {} if self._adapter.reshards_after_forward else {p.name: p.param for p in plan.params}
        self._grad_writes = GradWrites(watched)
        self._detach = _Detacher(self._recorder, self._provenance, self._grad_writes, self._adapter, self._hooked)
        if trains:
            self._recorder.owner = self
        else:  # measuring only: dropping it removes its hooks
            weakref.finalize(self, self._detach)

    @property
    def _plan(self) -> GradientPlan:
        """Which rule counts each parameter (`Knowledge.plan`)."""
        return self._known.plan

    def _learn(self, known: Knowledge) -> None:
        """Trust `known` from now on (within a backward: until `_measure` drops what a failed one learnt); the
        recorder records the next forward under its plan."""
        self._known = known
        self._recorder.plan = known.plan

    @property
    def mode(self) -> Mode:
        return self.settings.mode

    @property
    def max_grad_norm(self) -> float:
        return self.settings.max_grad_norm

    @property
    def skipped_samples(self) -> int:
        """Samples given a zero contribution so far because their gradient was not finite (nonfinite="skip")."""
        return self._skipped_samples

    @property
    def strategies(self) -> dict[str, str]:
        """Per trainable parameter reached in the last backward, how its norm was computed (e.g. "ghost",
        "direct", "direct+tokens", "per-sample"): what to look at when a layer is slow. Also in the profile."""
        return dict(self._strategies)

    # -- clipping -----------------------------------------------------------------------------------------

    def backward(self, loss: Tensor) -> Tensor:
        """Add `sum_i c_i grad(loss[i])` to every trainable parameter's `.grad`; return `||g_i||` `[B]` float32.

        loss: `[B]`, one loss per sample of the last forward (e.g. `reduction="none"`). For a micro-batch with no
        samples, whose forward a model may not run, call `backward_empty()` instead.
        """
        loss, calls = self._take_forward(loss, check_provenance=True)
        self._grad_writes.check_no_gradient_hooks()
        batch = loss.shape[0]
        if batch == 0 and self._adapter.world_size == 1:
            self._backward_since_step = True
            return torch.zeros(0, dtype=torch.float32, device=loss.device)
        # an empty batch on one rank of several still runs every pass: the wrappers' collectives must match
        second_pass = self.settings.fills_grad_by_second_backward and self._adapter.allows_second_pass
        with self._grad_writes.refusing():
            measured = self._measure(loss, calls, keep_graph=second_pass, keep_for_sum=not second_pass)
        norms, clip_norms_sq = measured.norms, measured.clip_norms_sq
        with torch.no_grad():
            coef = self._clip_coefficients(clip_norms_sq)
            if measured.skipped is not None:  # (bk only: a second backward would carry their NaN into every parameter)
                coef = coef.masked_fill(measured.skipped, 0.0)
                norms = [(param, norm.dropping(~measured.skipped)) for param, norm in norms]
                self._skipped_samples += int(measured.skipped.sum())
        del measured
        with self._timer.phase("second pass / bk sums"):
            if second_pass:
                counted = [param.param for param, _ in norms]
                del norms
                with self._grad_writes.refusing(allowed=counted):
                    (loss * (coef[0] * self._adapter.second_pass_scale).to(loss.dtype)).sum().backward()
            else:
                with torch.no_grad(), kernels_backend(self.settings.backend):
                    for param, norm in norms:
                        self._adapter.accumulate(param, norm.plan.clipped_sum(coef[param.clip_group]))
                    self._adapter.accumulation_done()
        self._provenance.record(self._adapter.accumulated_gradients(self._plan.params))
        self._backward_since_step = True
        self._samples_since_step += batch
        return clip_norms_sq.sum(0).sqrt().float()

    def backward_empty(self) -> None:
        """The backward of a micro-batch with no samples (Poisson sampling draws them), without a forward: many
        models (HF transformers) cannot run one on zero rows. Nothing is added to `.grad`; `step()` still adds the
        noise and accounts the step. Under DDP or FSDP, where every rank must run the same passes, run the forward
        and `backward` on the empty batch instead (`flashdp.micro_batches(batch, size, group=...)`)."""
        recorder = self._attached_recorder()
        if recorder.calls:
            recorder.take()
            raise FlashDPError(
                "engine.backward_empty() is for a micro-batch whose forward was not run, but a forward was recorded "
                "since the last backward: call engine.backward(loss) on its per-sample losses instead."
            )
        if self._adapter.world_size > 1:
            raise FlashDPError(
                f"engine.backward_empty() on one rank of {self._adapter.world_size}: every rank must run the same "
                "forward and backward passes (their collectives must match). Run the forward on the empty batch and "
                "engine.backward(loss) on its empty loss."
            )
        self._timer.forward_ended()
        self._backward_since_step = True

    def per_sample_norms(self, loss: Tensor, *, per_parameter: bool = False) -> Tensor | dict[str, Tensor]:
        """The per-sample gradient norms `||grad(loss[i])||` `[B]` float32 of the last forward, without clipping,
        noise or any change to `.grad` (for data valuation and debugging): the norm over all trainable parameters,
        or with `per_parameter=True` a dict of each parameter's `[B]` norms. The forward's graph is kept, so
        `loss.mean().backward()` may follow for ordinary training."""
        loss, calls = self._take_forward(loss, check_provenance=False)
        batch = loss.shape[0]
        if batch == 0:
            return {} if per_parameter else torch.zeros(0, dtype=torch.float32, device=loss.device)
        with self._grad_writes.refusing():
            measured = self._measure(loss, calls, keep_graph=True, keep_for_sum=False)
        if per_parameter:
            return {param.name: norm.norm_sq.sqrt().float() for param, norm in measured.norms}
        return measured.clip_norms_sq.sum(0).sqrt().float()

    def _take_forward(self, loss: Tensor, check_provenance: bool) -> tuple[Tensor, list[Call]]:
        """The checked loss and the calls recorded by its forward."""
        recorder = self._attached_recorder()
        self._timer.forward_ended()
        self._trainable.check_unchanged()
        loss = guards.check_loss(loss)
        if check_provenance:
            self._provenance.check_before_backward(self._adapter.accumulated_gradients(self._plan.params))
        calls = recorder.take()
        if not calls:
            raise self._no_forward_error(loss)
        self._last_loss_node = id(loss.grad_fn)
        if not self._norm_group_checked:
            check_same_samples(loss, self.norm_group)
            self._norm_group_checked = True
        return loss, calls

    def _measure(self, loss: Tensor, calls: list[Call], keep_graph: bool, keep_for_sum: bool) -> _Measured:
        """The norm pass and the per-sample norms of every trainable parameter reached by the loss, checked
        (coverage on a new forward structure, the self-check when due, non-finite gradients).

        What a backward learns about the model (the plan, its layers' layouts, the forward structures it verified,
        that a self-check ran) is kept only if the backward succeeds: after a failed verification, the next backward
        must not trust a layout learnt from, say, a loss that mixed samples."""
        # the forward's own checks of its modules' rules (on values of their own) are evidence of their own
        self._learn(self._known.with_plan(self._recorder.plan))
        committed = self._known
        try:
            return self._measure_checked(loss, calls, keep_graph, keep_for_sum)
        except BaseException:
            self._learn(committed)
            raise

    def _measure_checked(self, loss: Tensor, calls: list[Call], keep_graph: bool, keep_for_sum: bool) -> _Measured:
        batch = loss.shape[0]
        checking = self._next_self_check()
        shapes = [_CallShape(call.module, call.output_meta) for call in calls]
        new_structure = self._structure(shapes, batch) not in self._known.verified
        if checking or new_structure:
            checking = self._cover_structure(loss, calls, batch, checking)
        # a new structure, and every self-check, verifies that every layer's output rows are per-sample; every rank
        # takes the same decisions (a rank with a batch of one runs the passes too: FSDP collectives)
        verify = (checking or new_structure) and self._adapter.allows_second_pass
        verify &= batch > 1 or self._adapter.world_size > 1
        unverifiable = (
            self._unverifiable(shapes, batch) if new_structure and not self._adapter.allows_second_pass else []
        )
        verify, checking, refuse = map(bool, self._on_any_rank([verify, checking, bool(unverifiable)], loss.device))
        if refuse:
            raise _unverifiable_error(unverifiable)
        recorded = list(calls) if verify else []  # (scopes too: a layer verified not batch-first is covered again)
        keep = self._overflow_keep(keep_for_sum)
        while True:
            rule_calls = self._rule_calls(calls)
            calls.clear()  # from here the norm pass owns the calls, and releases each once its gradients are in
            held = self._graph_tensors(rule_calls) if checking else {}
            dtypes = [loss.dtype, *(m.dtype for c in rule_calls for m in c.output_meta)]
            try:
                collector, decided = self._norm_pass(
                    loss, rule_calls, keep_graph or checking, keep_for_sum, verify, keep
                )
                break
            except _NotBatchFirst:  # its parameters move to an enclosing module's generic rule; verified again
                calls = list(recorded)
                checking = self._cover_structure(loss, calls, batch, checking)
                checking = bool(self._on_any_rank([checking], loss.device)[0])
        del rule_calls, recorded  # (the collector releases each call once its gradients are in)
        plan = self._plan
        with torch.no_grad(), kernels_backend(self.settings.backend), self._timer.phase("norm computation"):
            norms = collector.finish()
            self._strategies = {param.name: norm.strategy for param, norm in norms}
            clip_norms_sq = _group_norms_sq(norms, len(plan.clip_group_names), batch, loss.device)
            if not nonfinite.all_finite(clip_norms_sq):  # a float32 norm that overflowed, or a NaN/inf gradient
                norms = self._float64_norms(loss, norms, collector, keep_graph)
                clip_norms_sq = _group_norms_sq(norms, len(plan.clip_group_names), batch, loss.device)
            del collector
            if self.norm_group is not None:  # a sample's computation is split across this group (tensor parallel)
                with self._timer.phase("communication"):
                    dist.all_reduce(clip_norms_sq, op=dist.ReduceOp.SUM, group=self.norm_group)
            skipped = nonfinite.nonfinite_samples(self.settings.nonfinite, clip_norms_sq, norms, self._adapter.dp_group)
            if checking:
                self._check_per_sample(loss, norms, held, self_check.tolerance(dtypes), retain_graph=keep_graph)
        # a batch of one decides no layout: every dim fits it, its rows are all its own
        if batch > 1 and decided and (verify or new_structure):
            self._learn(self._known.verifying(self._structure(shapes, batch), self._structure(shapes, 1)))
        return _Measured(norms, clip_norms_sq, skipped)

    def _cover_structure(self, loss: Tensor, calls: list[Call], batch: int, checking: bool) -> bool:
        """Cover this forward structure (`_cover`); whether this backward runs the per-sample check: a plan changed
        here is checked at once (`_plan_changed_check`)."""
        if self._cover(loss, calls, batch):
            checking = self._plan_changed_check()
        return checking

    def _structure(self, calls: list[_CallShape], batch: int) -> tuple:
        """What a verified layout rests on: the modules called, in order, and for each output of a rule site's
        call whether its size at the batch dim is a multiple of B (a batch, or B * k rows) or not (shared across
        the batch, or mis-shaped). A step whose sizes fall the other way is a new structure, verified again. For a
        batch of one (or none) only the modules: every layout gives its one sample all rows, so only what covers each
        parameter's uses matters, and it is known once these modules were verified on a larger batch."""
        if batch < 2:
            return tuple(id(call.module) for call in calls)
        return tuple(self._call_layout(call, batch) for call in calls)

    def _call_layout(self, call: _CallShape, batch: int) -> tuple[int, tuple[bool, ...]]:
        if self._plan.site(call.module).match is None:  # a scope: only encloses rule sites
            return id(call.module), ()
        dims = self._batch_dims(call)
        return id(call.module), tuple(
            _lacks_batch(m.shape, d, batch) for m, d in zip(call.output_meta, dims, strict=True)
        )

    def _unverifiable(self, calls: list[_CallShape], batch: int) -> list[tuple[str, torch.Size, list[int]]]:
        """Under a wrapper that cannot run a verifying pass (FSDP1), where sizes alone cannot tell the batch dim: the
        calls with B in more than one dim before the features (label, output shape, those dims)."""
        found = []
        for call in calls if batch > 1 else ():
            site = self._plan.site(call.module)
            if site.match is None:
                continue
            for meta, dim in zip(call.output_meta, self._batch_dims(call), strict=True):
                dims = {d for d in range(len(meta.shape) - 1) if meta.shape[d] == batch}
                if not _lacks_batch(meta.shape, dim, batch):
                    dims.add(dim)
                if len(dims) > 1:
                    found.append((site.label, meta.shape, sorted(dims)))
        return found

    def _on_any_rank(self, flags: list[bool], device: torch.device) -> list[int]:
        """Each flag, set if it is set on any data-parallel rank: every rank takes the same decision."""
        return highest_on_any_rank([int(f) for f in flags], self._adapter.dp_group, device)

    def _rule_calls(self, calls: list[Call]) -> list[Call]:
        """The calls of rule sites (scopes only enclose them), without the outputs their rules do not read."""
        plan = self._plan
        rule_calls = [
            c if plan.site(c.module).match.rule.per_call else c.without_outputs()
            for c in calls
            if plan.site(c.module).match
        ]
        if not rule_calls:
            raise no_trainable_layer_error()
        return rule_calls

    def _norm_pass(
        self, loss: Tensor, calls: list[Call], keep_graph: bool, keep_for_sum: bool, verify: bool, keep: dict
    ) -> tuple[NormCollector, bool]:
        """The norm pass: each call's output gradients go to a collector as autograd computes them (their norms
        are part of the "norm pass" phase). With `verify`, each is also sketched, and a weighted pass compared with
        the sketches verifies batch independence; a layer found shared across the batch, or time-major, only by
        verifying is learnt, and the pass redone (a layer found not batch-first otherwise raises `_NotBatchFirst`).
        `keep`: what the collector keeps for a float64 recomputation. Also whether the pass decided the layout for
        later steps: not where a sample's rows were all zero in some layer (a sample padded out, masked), which
        shows nothing about whose rows are whose; this step's numbers are exact either way (the weights differ)."""
        batch = loss.shape[0]
        while True:
            shared = self._shared_outputs(loss, calls, batch)
            collector = NormCollector(
                self._plan,
                calls,
                batch,
                strategy=self.settings.norm_strategy,
                keep_for_sum=keep_for_sum,
                backend=self.settings.backend,
                recorder=self._recorder,
                shared=shared,
                **keep,
            )
            verifying = _Verifying(calls, [self._batch_dims(c) for c in calls], set(shared), batch) if verify else None
            receive = functools.partial(_receive, collector, verifying)
            sharing = shared_outputs.capturing_per_sample_gradients(list(shared.values()), batch)
            with self._timer.phase("norm pass"), self._adapter.norm_pass(), sharing:
                held = {i for i, _ in shared}
                # (without verifying, `calls` is handed over: it is emptied, and only the collector holds each call)
                passed = list(calls) if verify else calls
                stream_output_gradients(loss, passed, receive, held, keep_graph or verify, prepare=collector.unpack)
            if verifying is None:
                return collector, True
            with torch.no_grad():
                failing = self._batch_independence(loss, calls, verifying)
            found = self._learn_layout(loss, calls, failing, batch) if failing else _Found.VERIFIED
            if found is _Found.VERIFIED and verifying.errors:
                found = _Found.REFUSED
            agreed = _Found(max(self._on_any_rank([found], loss.device)))
            if agreed is _Found.VERIFIED:
                return collector, verifying.every_sample_seen()
            if agreed is _Found.NOT_BATCH_FIRST:
                raise _NotBatchFirst
            if agreed is _Found.REFUSED:
                raise self._verification_error(calls, failing, verifying.errors, refused_here=found is agreed)

    def _verification_error(
        self, calls: list[Call], failing: list[int], errors: list[Exception], refused_here: bool
    ) -> Exception:
        """Why a verifying pass refuses: a rule's error once the layout is verified, layers whose rows are not
        samples, or (on the other ranks: every rank stops together) another rank's refusal."""
        if not refused_here:
            return _another_rank_refused()
        if not failing:
            return errors[0]
        sites = [self._plan.site(c.module).label for c in calls]
        return self_check.batch_independence_error([sites[i] for i in failing], sites)

    def _overflow_keep(self, keep_for_sum: bool) -> dict[str, bool]:
        """What the collector keeps so that a float32 norm that overflows can be recomputed in float64: nothing in
        bk (its clipped-sum plans suffice); in ghost and flash the calls, for a second norm pass over the kept graph,
        except under FSDP, where one rank cannot run a pass alone: there each parameter's contributions."""
        if keep_for_sum:
            return {}
        return {"keep_gradients": True} if self._adapter.reshards_after_forward else {"keep_calls": True}

    def _float64_norms(
        self, loss: Tensor, norms: list[tuple[TrainableParam, ParamNorm]], collector: NormCollector, keep_graph: bool
    ) -> list[tuple[TrainableParam, ParamNorm]]:
        """`norms` with every parameter whose squared norms are not all finite recomputed in float64 (see
        `_overflow_keep`)."""
        gradients = collector.gradients
        if any(n.plan is None and p.key not in gradients for p, n in norms if not nonfinite.all_finite(n.norm_sq)):
            calls = list(collector.calls)
            redo, _ = self._norm_pass(loss, calls, keep_graph, False, verify=False, keep={"keep_gradients": True})
            redo.finish()
            gradients = redo.gradients
        return nonfinite.recompute_overflowed(norms, gradients, loss.shape[0])

    def _clip_coefficients(self, group_norms_sq: Tensor) -> Tensor:
        """`[L, B]` clipping coefficients from `[L, B]` squared norms of the clipping groups."""
        return clip_coefficients(self.settings.clipping, group_norms_sq, self.max_grad_norm)

    def _cover(self, loss: Tensor, calls: list[Call], batch: int) -> bool:
        """Make every trainable parameter's use counted: parameters used outside the site counting them, and those
        of layers whose outputs are neither batch-first nor broadcast over the batch, move to the generic rule at
        the smallest module enclosing their uses. Whether the plan changed."""
        changed = False
        for _ in range(len(self._plan.params) + 1):  # each round moves at least one parameter up the tree
            found = coverage.walk(loss, calls, self._plan, self.model.named_parameters())
            misfits = self._misfits(loss, calls, batch, found.enclosing) if not found.uses else []
            if not found.uses and not misfits:
                return changed
            time_major = {i: d for i in misfits if (d := self._time_major_dim(calls[i], batch)) is not None}
            if time_major:  # a position-wise rule is told where the batch is
                self._learn(
                    self._known.with_plan(
                        self._plan.with_batch_dims({calls[i].module: d for i, d in time_major.items()})
                    )
                )
                changed = True
                continue
            uses = found.uses
            targets = (
                coverage.promotions(uses, calls, self._plan)
                if uses
                else coverage.layout_promotions(
                    misfits, calls, self._plan, found.enclosing, batch, self._known.not_batch_first
                )
            )
            if self._adapter.reshards_after_forward:
                names = sorted(use.param.name for use in uses)
                raise FlashDPError(
                    "Under FSDP, flashdp counts a parameter used outside its own module (or a layer whose output is "
                    "neither batch-first nor broadcast) only by a rule registered for the module that encloses its "
                    f"uses; these would need the generic rule there: {', '.join(names) or 'see the layers above'}. "
                    "Tie weights by sharing the Parameter between layers, call layers rather than reading their "
                    "weights, or register a rule."
                )
            plan = self._plan
            for module, keys in targets.items():
                plan = plan.promote(module, keys)
            self._learn(self._known.with_plan(plan))
            changed = True
        coverage.refuse(coverage.walk(loss, calls, self._plan, self.model.named_parameters()).uses)
        return changed

    def _time_major_dim(self, call: Call, batch: int) -> int | None:
        """For a call of a position-wise rule whose outputs have the batch in another dim than the one it was
        told (a time-major `[T, B, d]` call), the first dim before the features where every output has size B."""
        site = self._plan.site(call.module)
        if not site.match.rule.position_wise:
            return None
        current = self._batch_dims(call)[0]
        shapes = [meta.shape for meta in call.output_meta]
        dims = [d for d in range(max(len(s) for s in shapes) - 1) if all(len(s) > d and s[d] == batch for s in shapes)]
        return next((d for d in dims if d > current), None)

    def _misfits(self, loss: Tensor, calls: list[Call], batch: int, entered: dict[int, tuple[int, ...]]) -> list[int]:
        """Rule site calls with an output that reaches the loss, has no batch dim (B * k rows are a batch) and is
        not broadcast over the batch by a later op."""
        lacking = {
            i: [
                edge
                for edge, meta, dim in zip(call.edges, call.output_meta, self._batch_dims(call), strict=True)
                if _lacks_batch(meta.shape, dim, batch) or id(call.module) in self._known.not_batch_first
            ]
            for i, call in enumerate(calls)
            if i in entered and batch > 1 and self._plan.site(call.module).match is not None
        }
        if not any(lacking.values()):
            return []
        graph = shared_outputs.parents(loss)
        return [
            i
            for i, edges in lacking.items()
            if any(e.node in graph and not shared_outputs.frontiers(e, graph, batch) for e in edges)
        ]

    # -- the self-check and what it needs -------------------------------------------------------------------

    def _plan_changed_check(self) -> bool:
        """A plan changed in this backward is checked at once, even with self_check=None: a module that has just
        become a generic rule site was recorded as a scope, without the outputs that rule's own check of its
        recomputation compares (a forward that mixes samples would go through on this step)."""
        return self._adapter.allows_second_pass

    def _next_self_check(self) -> bool:
        """Whether this backward runs the self-check (`SelfCheckSchedule`); if it does, the schedule learns so."""
        index, self._backward_calls = self._backward_calls, self._backward_calls + 1
        due = self._known.self_check.due(index)
        if due:
            self._learn(self._known.self_checked(index))
        return due

    def _batch_independence(self, loss: Tensor, calls: list[Call], verifying: _Verifying) -> list[int]:
        """The calls whose output rows are not per-sample (batch independence, the self-check's first part)."""
        rtol = self_check.tolerance([loss.dtype, *(m.dtype for c in calls for m in c.output_meta)])
        with self._adapter.norm_pass():
            return self_check.batch_independence_failures(
                loss, calls, verifying.sketches, verifying.dims, rtol, self._check_generator
            )

    def _shared_outputs(self, loss: Tensor, calls: list[Call], batch: int) -> dict:
        """(call, output) -> SharedOutput for every output shared across the batch: those without the batch dim,
        and every output of a site known to share its output (a shared output's dims may equal B by chance)."""
        if batch < 2:
            return {}
        candidates = [
            (i, j, edge, meta.shape)
            for i, call in enumerate(calls)
            for j, (edge, meta, dim) in enumerate(
                zip(call.edges, call.output_meta, self._batch_dims(call), strict=True)
            )
            if id(call.module) in self._known.shared_sites or _lacks_batch(meta.shape, dim, batch)
        ]
        if not candidates:
            return {}
        graph = shared_outputs.parents(loss)
        shared = {}
        for i, j, edge, shape in candidates:
            frontiers = shared_outputs.frontiers(edge, graph, batch)
            if frontiers:
                shared[(i, j)] = shared_outputs.SharedOutput(edge, shape, frontiers)
                self._learn(self._known.sharing([id(calls[i].module)]))
        return shared

    def _batch_dims(self, call: Call) -> tuple[int, ...]:
        return batch_dims(self._plan.site(call.module), call)

    def _learn_layout(self, loss: Tensor, calls: list[Call], failing: list[int], batch: int) -> _Found:
        """Learn why calls' output rows were found not per-sample, to be verified again: outputs shared across the
        batch (their dims equal B by chance), position-wise layers with the batch in a later dim (time-major, T
        equal to B by chance), and other layers whose dim 0 is not the batch (NOT_BATCH_FIRST: their parameters
        are to be covered again). REFUSED where that cannot explain the failure: every layer fails (the losses mix
        samples), or the layers were already known not batch-first."""
        graph = shared_outputs.parents(loss)
        shared = {i for i in failing if any(shared_outputs.frontiers(edge, graph, batch) for edge in calls[i].edges)}
        time_major = {i: d for i in failing if i not in shared and (d := self._time_major_dim(calls[i], batch))}
        others = [i for i in failing if i not in shared and i not in time_major]
        if others and len(set(failing)) == len(calls):  # every layer fails: the losses mix samples
            return _Found.REFUSED
        if others and all(id(calls[i].module) in self._known.not_batch_first for i in others):  # known, not covered
            return _Found.REFUSED
        known = self._known.sharing(id(calls[i].module) for i in shared)
        if time_major:  # (verified by the redone pass)
            known = known.with_layout(self._plan.with_batch_dims({calls[i].module: d for i, d in time_major.items()}))
        if others:  # (a time-major layer without a position-wise rule, whose T equals B)
            known = known.not_batch_first_too(id(calls[i].module) for i in others)
        self._learn(known)
        if others:
            return _Found.NOT_BATCH_FIRST
        return _Found.RELEARNT

    def _graph_tensors(self, calls: list[Call]) -> dict[object, Tensor]:
        """Each trainable parameter as the forward used it (a wrapper may have swapped in another tensor)."""
        held = {p.key: p.param for p in self._plan.params}
        for call in calls:
            for name, tensor in call.params.items():
                param = self._plan.param_of.get((id(call.module), name))
                if param is not None and tensor.requires_grad:  # not a copy kept for the generic rule
                    held[param.key] = tensor
        return held

    def _check_per_sample(
        self, loss: Tensor, norms: list[tuple[TrainableParam, ParamNorm]], held: dict, rtol: float, retain_graph: bool
    ) -> None:
        batch = loss.shape[0]
        count = self_check.SAMPLES_PER_CHECK
        picks = torch.randperm(max(batch, 1), generator=self._check_generator)[:count].tolist()
        samples = [picks[k % len(picks)] for k in range(count)]  # as many passes on every rank
        counted = [self_check.Counted(p.name, held[p.key], n.norm_sq, n.plan) for p, n in norms]
        with self._adapter.norm_pass():
            self_check.check_per_sample(loss, counted, samples, rtol, retain_graph)

    def _no_forward_error(self, loss: Tensor) -> FlashDPError:
        if id(loss.grad_fn) == self._last_loss_node:
            return FlashDPError(
                "engine.backward() was already called on this forward's loss: each forward is clipped once. Run a "
                "new forward for the next backward."
            )
        coverage.refuse(coverage.walk(loss, [], self._plan, self.model.named_parameters()).uses)
        return FlashDPError(
            "engine.backward() found no forward pass to clip since the last backward: run the model's forward with "
            "gradients enabled (not under torch.no_grad()) after make_private and before backward, once per "
            "backward. If the loss reaches no trainable layer at all, it does not depend on the model."
        )

    # -- DP-SGD -------------------------------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """DP-SGD steps taken (and accounted for)."""
        return self._accountant.steps

    def step(self) -> None:
        """Noise, averaging and the optimizer step: for every trainable p,
        `p.grad = (p.grad + N(0, sigma^2 C^2 I)) / expected_batch_size`, then `optimizer.step()`,
        `optimizer.zero_grad()` and one accountant step."""
        if self.optimizer is None:
            raise FlashDPError("engine.step() needs an optimizer: make_private(..., optimizer=opt).")
        if self.expected_batch_size is None:
            raise FlashDPError(
                "engine.step() needs expected_batch_size, the global logical batch size (sample_rate * dataset "
                "size), to average the noisy sum: make_private(..., expected_batch_size=...)."
            )
        if not self._backward_since_step:
            raise FlashDPError(
                "engine.step() called with no engine.backward() since the last step: each step must follow at "
                "least one backward (for an empty Poisson batch, engine.backward_empty())."
            )
        self._provenance.check_before_step(self._adapter.accumulated_gradients(self._plan.params))
        if self._adapter.dp_group is not None:
            check_global_batch(self.expected_batch_size, self._samples_since_step, self._adapter.dp_group)
        std = self.noise_multiplier * self.max_grad_norm
        params = self._adapter.gradient_holders(self._plan.params)
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            for add in self._before_noise:
                add()
            with self._timer.phase("communication"):
                self._adapter.reduce_gradients(params)
            with self._timer.phase("noise"):
                for p in params:
                    if std > 0:
                        local = self._adapter.local_grad(p)
                        noise = self._noise.gaussian(local.shape, std, local.device, local.dtype)
                        local.add_(self._adapter.shared_noise(noise))
                    p.grad.div_(self.expected_batch_size)
        with self._timer.phase("optimizer"), self._provenance.engine_step():
            self.optimizer.step()
            self.optimizer.zero_grad()
            self._adapter.zero_grad()
        self._provenance.stepped()
        self._accountant.step(self.noise_multiplier, self.sample_rate or 0.0)
        finding = self._sampling.record(self._samples_since_step)
        if finding is not None:
            warnings.warn(f"Batches do not look Poisson-sampled: {finding}", FlashDPWarning, stacklevel=2)
        self._backward_since_step = False
        self._samples_since_step = 0
        self._timer.report(self.steps, self._strategies)

    def data_loader(
        self,
        dataset: Dataset,
        *,
        collate_fn: Callable[[list], Any] = default_collate,
        steps: int | None = None,
        **loader_kwargs: Any,
    ) -> DataLoader:
        """A DataLoader of Poisson-sampled batches of `dataset` at the engine's `sample_rate`: the sampling that
        `epsilon()` assumes. Sampling draws from the OS CSPRNG when the engine has `secure_rng=True`, is seeded
        from the engine's `seed` when it has one, and from OS entropy otherwise. Under DDP or FSDP each rank samples
        its own shard of `dataset` (give every rank the whole dataset). Batch sizes vary and may be 0 (see
        `backward_empty`). steps: batches per pass over the loader, default `ceil(1 / sample_rate)` (an epoch in
        expectation)."""
        if self.sample_rate is None:
            raise FlashDPError("engine.data_loader() samples at the engine's rate: make_private(..., sample_rate=q).")
        expected = self.sample_rate * len(dataset)
        if self.expected_batch_size is not None and abs(expected - self.expected_batch_size) > max(
            1.0, 0.01 * self.expected_batch_size
        ):
            raise FlashDPError(
                f"sample_rate * len(dataset) = {self.sample_rate} * {len(dataset)} = {expected:.1f}, but the engine "
                f"averages by expected_batch_size={self.expected_batch_size}. Give make_private "
                f"expected_batch_size={round(expected)} (or sample_rate={self.expected_batch_size / len(dataset):.6g})."
            )
        group = self._adapter.dp_group
        return poisson_loader(
            dataset,
            self.sample_rate,
            collate_fn=collate_fn,
            steps=steps,
            seed=self.settings.seed,
            secure_rng=self.settings.secure_rng,
            rank=dist.get_rank(group) if group is not None else 0,
            world_size=self._adapter.world_size,
            **loader_kwargs,
        )

    def epsilon(self, delta: float) -> float:
        """The epsilon spent so far at this delta (PLD, or RDP when accountant="rdp")."""
        if self.sample_rate is None:
            raise FlashDPError(
                "epsilon() needs the Poisson sampling rate: make_private(..., sample_rate=q), with q = "
                "expected_batch_size / len(dataset)."
            )
        delta = checked_delta(delta)
        if self._sampling.finding is not None:
            warnings.warn(
                f"This epsilon assumes Poisson sampling at rate {self.sample_rate}, but {self._sampling.finding}",
                FlashDPWarning,
                stacklevel=2,
            )
        return self._accountant.epsilon(delta)

    def state_dict(self) -> dict:
        """What a resumed run needs to report the same epsilon: the settings it must match and the accountant's
        history. The noise generators' state only when the run was seeded (`make_private(seed=...)`): it is the
        secret that removes the noise, so an unseeded run keeps it out of checkpoints and draws fresh noise when
        resumed; a seeded run resumes bitwise."""
        return {
            **{key: getattr(self, key) for key in _RESUMED_SETTINGS},
            "accountant": self._accountant.state_dict(),
            "noise": self._noise.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`, e.g. `engine.load_state_dict(torch.load(path))` on an engine built with the
        same noise_multiplier, sample_rate and max_grad_norm (a different one is refused: the accounting would not
        describe the run). The accountant's history is restored, so `epsilon()` continues where it stopped; a
        seeded run's noise generator too. All of the state is checked before anything is loaded."""
        if not isinstance(state, dict):
            raise FlashDPError(f"load_state_dict expects engine.state_dict()'s dict. Received {type(state).__name__}.")
        missing = [key for key in (*_RESUMED_SETTINGS, "accountant", "noise") if key not in state]
        if missing:
            raise FlashDPError(
                f"Cannot resume: the checkpoint lacks {', '.join(map(repr, missing))} (it has {sorted(state)}). "
                "Pass what engine.state_dict() returned; nothing was loaded."
            )
        for key in _RESUMED_SETTINGS:
            if state[key] != getattr(self, key):
                raise FlashDPError(
                    f"Cannot resume: the checkpoint has {key}={state[key]!r}, this engine {getattr(self, key)!r}. "
                    "Build the engine with the settings of the run you resume."
                )
        self._accountant.check_state(state["accountant"])
        self._noise.check_state(state["noise"])
        self._accountant.load_state_dict(state["accountant"])
        self._noise.load_state_dict(state["noise"])

    # -- lifecycle ----------------------------------------------------------------------------------------

    def detach(self) -> None:
        """Remove every hook: the model is plain PyTorch again. The engine cannot clip after this. Until then the
        engine lives as long as the model, even where no reference to it is kept: dropping it leaves every
        optimizer step over the model's trainable parameters refused."""
        self._detach()

    def __enter__(self) -> DPEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _attached_recorder(self) -> Recorder:
        if not self._detach.alive:
            raise FlashDPError("This engine was detached; call flashdp.make_private(model, ...) again.")
        return self._recorder


class _CallShape(NamedTuple):
    """What a forward structure records of one call (not the call, whose tensors the norm pass frees)."""

    module: nn.Module
    output_meta: tuple


@dataclass
class _Measured:
    """What the norm pass found: each parameter's squared norms `[B]` and clipped-sum plan, the squared norms of the
    clipping groups `[L, B]` float64, and the samples whose gradient is not finite (nonfinite="skip") or None."""

    norms: list[tuple[TrainableParam, ParamNorm]]
    clip_norms_sq: Tensor
    skipped: Tensor | None


#: the settings a resumed run must share with the checkpointed one
_RESUMED_SETTINGS = ("noise_multiplier", "sample_rate", "max_grad_norm")


class _Found(enum.IntEnum):
    """What a verifying norm pass found, ordered so that the ranks agree on the highest any of them found."""

    VERIFIED = 0  # every layer's rows are per-sample
    RELEARNT = 1  # shared or time-major layers learnt: the pass is redone
    NOT_BATCH_FIRST = 2  # layers whose rows are not samples: their parameters are covered again
    REFUSED = 3


class _NotBatchFirst(Exception):
    """A verifying norm pass found layers whose outputs' dim 0 is not the batch although its size is B: their
    parameters are to be covered again, by the generic rule of a module that encloses them."""


@dataclass
class _Verifying:
    """What a verifying norm pass keeps until the pass ends: sketches of every call's output gradients (the
    weighted pass is compared with them), and the errors its rules raised. A rule may fail because a layer's rows
    are not samples (a time-major layer with T == B passes the size checks), so its error is raised only once the
    layout is verified."""

    calls: list[Call]
    #: each call's batch dim per output
    dims: list[tuple[int, ...]]
    #: (call, output) indices of outputs shared across the batch
    shared: set[tuple[int, int]]
    batch: int
    sketches: list[tuple[self_check.RowSketch | None, ...]] = field(init=False)
    errors: list[Exception] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sketches = [()] * len(self.calls)

    def every_sample_seen(self) -> bool:
        return all(sketch.every_sample_seen for sketches in self.sketches for sketch in sketches if sketch)

    def keep(self, index: int, grads: tuple) -> None:
        shared = {j for i, j in self.shared if i == index}
        self.sketches[index] = self_check.sketch_output_gradients(
            self.calls[index], grads, self.dims[index], self.batch, shared, seed=index
        )


def _receive(collector: NormCollector, verifying: _Verifying | None, index: int, grads: tuple) -> None:
    """Hand one call's output gradients to the collector; while verifying, sketch them and defer rule errors."""
    if verifying is None:
        collector.receive(index, grads)
        return
    verifying.keep(index, grads)
    try:
        collector.receive(index, grads)
    except Exception as error:  # raised after the pass, unless the layout explains it
        verifying.errors.append(error)


def _group_norms_sq(norms: list[tuple[TrainableParam, ParamNorm]], groups: int, batch: int, device) -> Tensor:
    """`[L, B]` float64 squared norms of the L clipping groups."""
    total = torch.zeros(groups, batch, dtype=torch.float64, device=device)
    for param, norm in norms:
        total[param.clip_group] += norm.norm_sq.to(total.dtype)
    return total


def _another_rank_refused() -> FlashDPError:
    return FlashDPError("Another rank refused this backward (its error names the cause); every rank stops together.")


def _unverifiable_error(found: list[tuple[str, torch.Size, list[int]]]) -> FlashDPError:
    if not found:
        return _another_rank_refused()
    label, shape, dims = found[0]
    more = f" (and {len(found) - 1} more layers)" if len(found) > 1 else ""
    return FlashDPError(
        f"Under FSDP1, which cannot run flashdp's verifying pass, a layer's batch dim is told by size alone, and the "
        f"output of layer {label}, of shape {tuple(shape)}, has this rank's batch size in dims {dims}{more}: the batch "
        "could be any of them (batch-first [B, T, ...], or time-major [T, B, ...] with T equal to B). Nothing was "
        "added to .grad. Use FSDP2 (fully_shard) or DDP, where flashdp verifies the layout; or give every rank a "
        "batch size that differs from these dims' sizes (e.g. pad the sequence to another length)."
    )


def _lacks_batch(shape: torch.Size, dim: int, batch: int) -> bool:
    """No batch dim: the size there is neither B nor B * k rows (k per sample)."""
    return len(shape) <= dim or shape[dim] % batch != 0


class _Detacher:
    """Removes every hook the engine added and restores what it changed on a wrapper, once (no reference to the
    engine: it also runs when an engine that only measures is garbage-collected)."""

    def __init__(
        self, recorder: Recorder, provenance: GradientProvenance, writes: GradWrites, adapter: Adapter, modules: list
    ) -> None:
        self._parts: tuple | None = (recorder, provenance, writes, adapter, modules)

    @property
    def alive(self) -> bool:
        return self._parts is not None

    def __call__(self) -> None:
        if self._parts is None:
            return
        recorder, provenance, writes, adapter, modules = self._parts
        self._parts = None
        recorder.remove()
        provenance.remove()
        writes.remove()
        adapter.detach()
        guards.release(modules)


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
        kernels: "auto" (Triton on CUDA tensors, PyTorch otherwise), "triton" (everywhere it can run) or
            "torch" (never). float64 inputs always use PyTorch.
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
            FlashDPError naming the samples before any `.grad` changes; "skip" (bk, or per_layer clipping) gives
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
