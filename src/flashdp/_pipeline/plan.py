"""The gradient plan: which rule counts each trainable parameter, and which modules the engine hooks.

A *rule site* is a module whose rule counts a set of trainable parameters (its own, or a descendant's its forward
uses: "out_proj.weight"): a registered rule (a fast path) or, for any module without one, the generic rule. Every
trainable parameter is counted by exactly one site. A *scope* is an ancestor of a rule site, hooked only so that
the coverage walk knows which module's forward encloses a use. A parameter found to be used outside the site that
counts it is moved to the generic rule at the smallest module whose forward encloses every use (`promote`).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from flashdp._pipeline.params import ParamView, ParamViews, TrainableParam, local_param_views
from flashdp.errors import FlashDPError
from flashdp.rules import RuleMatch, find_rule
from flashdp.rules.embedding import RENORM_LEAK, labelled_tables
from flashdp.rules.generic import GENERIC
from flashdp.rules.normalization import RUNNING_STATS_LEAK

#: Layer types whose output for one sample depends on the other samples of the batch.
SAMPLE_MIXING = (nn.modules.batchnorm._BatchNorm,)
#: Wrappers around the user's model: never a site (their forward runs the wrapper's own machinery).
WRAPPERS = (nn.parallel.DistributedDataParallel, FullyShardedDataParallel)


@dataclass(frozen=True)
class Site:
    """A module the engine hooks: a rule site when `match` is set, else a scope."""

    path: str
    module: nn.Module
    match: RuleMatch | None = None
    #: the trainable parameters its rule counts, by name relative to the module, in a fixed order (the same on
    #: every rank, as the order of per-parameter collectives must be)
    trainable: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"'{self.path or '<root>'}' ({type(self.module).__name__})"

    @property
    def is_generic(self) -> bool:
        return self.match is not None and self.match.rule is GENERIC


@dataclass(frozen=True)
class Learnt:
    """What the engine learnt about the model's calls since the scan; the plan is rebuilt from it."""

    #: promoted parameters: key -> id of the module whose generic rule counts them
    moved: dict[Hashable, int] = field(default_factory=dict)
    #: modules whose registered rule does not fit their forward: the generic rule counts their own parameters
    forced: frozenset[int] = frozenset()
    #: modules whose forward is a constant multiple of their registered rule's (checked on their first call)
    scales: dict[int, float] = field(default_factory=dict)
    #: modules of position-wise rules called with the batch in another dim than 0 (time-major): that dim
    batch_dims: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class GradientPlan:
    #: id(module) -> its site, in the model's module order
    sites: dict[int, Site]
    params: list[TrainableParam]
    #: a name per clipping group (the path of its first site)
    clip_group_names: list[str]
    #: (id(site module), name relative to it) -> the parameter. Wrappers such as FSDP2 swap the objects
    #: registered on a module (sharded / unsharded), so a module and a name identify a parameter.
    param_of: dict[tuple[int, str], TrainableParam]
    #: how the plan was built, to rebuild it: every module's trainable parameters, every module (sites or not),
    #: and what was learnt since the scan
    views: dict[int, dict[str, ParamView]] = field(repr=False)
    all_sites: list[Site] = field(repr=False)
    learnt: Learnt = field(default_factory=Learnt, repr=False)

    @property
    def rule_sites(self) -> list[Site]:
        return [s for s in self.sites.values() if s.match is not None]

    @functools.cached_property
    def counts_generic(self) -> bool:
        """Whether some site counts trainable parameters by the generic rule."""
        return any(site.is_generic and site.trainable for site in self.sites.values())

    def site(self, module: nn.Module) -> Site:
        """A hooked module's site; a module no rule counts at any more (its parameters moved) is a scope."""
        site = self.sites.get(id(module))
        return site if site is not None else next(s for s in self.all_sites if s.module is module)

    def promote(self, module: nn.Module, keys: Iterable[Hashable]) -> GradientPlan:
        """The plan with these parameters (of `module` or its descendants) counted by the generic rule at `module`,
        with its own parameters."""
        return self._rebuilt(moved=self.learnt.moved | dict.fromkeys(keys, id(module)))

    def with_generic(self, module: nn.Module) -> GradientPlan:
        """The plan with `module`'s own parameters counted by the generic rule instead of its registered one (a
        parameter it shares with other modules stays counted by them too, each for its own calls)."""
        return self._rebuilt(forced=self.learnt.forced | {id(module)})

    def with_scale(self, module: nn.Module, scale: float) -> GradientPlan:
        """The plan with `module`'s registered rule applied to `scale` times its output gradient (its forward
        computes that multiple of the rule's). Only that site's match changes (what `_plan` would rebuild from
        `learnt.scales`): rebuilt whole, a model of N such modules paid N rebuilds of every site on its first
        forward."""
        here = id(module)
        site = self.sites[here]
        match = replace(site.match, verify_with=None, output_scale=scale)
        return replace(
            self,
            sites={**self.sites, here: replace(site, match=match)},
            learnt=replace(self.learnt, scales=self.learnt.scales | {here: scale}),
        )

    def with_batch_dims(self, dims: dict[nn.Module, int]) -> GradientPlan:
        """The plan with these modules' position-wise rules told that their calls have the batch in another dim."""
        return self._rebuilt(batch_dims=self.learnt.batch_dims | {id(m): d for m, d in dims.items()})

    def _rebuilt(self, **learnt: object) -> GradientPlan:
        return _plan([Site(s.path, s.module) for s in self.all_sites], self.views, replace(self.learnt, **learnt))


def scan_model(model: nn.Module, param_views: ParamViews = local_param_views) -> GradientPlan:
    """Find every trainable parameter's rule; fail loudly on anything that cannot be counted exactly."""
    _refuse_sample_mixing(model)
    _refuse_running_statistics(model)
    _refuse_renormalised_tables(model)
    modules = [(path, m) for path, m in model.named_modules() if not isinstance(m, WRAPPERS)]
    views = {id(m): param_views(m) for _, m in modules}
    if not any(views.values()):
        raise FlashDPError(
            "The model has no trainable parameters (none with requires_grad=True): nothing to train privately."
        )
    return _plan([Site(path, m) for path, m in modules], views, Learnt())


def _plan(modules: list[Site], views: dict[int, dict[str, ParamView]], learnt: Learnt) -> GradientPlan:
    """Assign every trainable parameter to rule sites; hook the ancestors of rule sites as scopes."""
    moved = learnt.moved
    by_id = {id(s.module): s for s in modules}
    by_path = {s.path: s for s in modules}
    descendants = _descendant_views(modules, by_path, views)
    taken: set[Hashable] = set()  # descendants' parameters a rule higher in the tree counts
    counted: dict[int, list[str]] = {}
    matches: dict[int, RuleMatch] = {}
    problems = []
    for site in modules:  # parents before children
        here = id(site.module)
        # a module's own parameters are counted by its rule (a tied parameter by every module holding it, each
        # for the calls it makes), unless a rule higher up counts them or they were moved elsewhere; one a
        # descendant also holds (BERT's LM-head bias, its decoder's bias) is counted by the descendant, whose
        # calls are inside this module's
        below = descendants[here]
        held_below = {v.key for v in below.values()}
        own = [
            n
            for n, v in views[here].items()
            if v.key not in taken and moved.get(v.key, here) == here and (v.key not in held_below or v.key in moved)
        ]
        match = None if here in moved.values() or here in learnt.forced else find_rule(site.module)
        if match is not None and here in learnt.scales:  # (the scale was found by verifying it)
            match = replace(match, verify_with=None, output_scale=learnt.scales[here])
        if match is not None and here in learnt.batch_dims:
            match = replace(match, batch_dim=learnt.batch_dims[here])
        if match is not None and (match.rule.params is None or set(own) <= set(match.rule.params)):
            listed = [n for n in match.rule.params or () if n in below and below[n].key not in moved]
            taken.update(below[n].key for n in listed)
            names = own + listed
        else:  # no rule, one that cannot count all of the module's own parameters, or a promotion target
            match = RuleMatch(GENERIC, None)
            names = _once_per_key(own + [n for n, v in below.items() if moved.get(v.key) == here], views[here], below)
        reason = match.rule.check(site.module) if names and match.rule.check else None
        if reason:
            problems.append(f"'{site.path or '<root>'}' ({type(site.module).__name__}): {reason}")
        if names:
            counted[here], matches[here] = names, match
    if problems:
        raise FlashDPError(
            "flashdp cannot compute exact per-sample gradients for these trainable parameters:\n  - "
            + "\n  - ".join(problems)
            + "\nFreeze them (p.requires_grad_(False)), or teach flashdp the layer with "
            "flashdp.register_rule(LayerType, per_sample_grads) before make_private."
        )
    scope_ids = {id(a.module) for i in counted for a in _ancestors(by_id[i].path, by_path)} - set(counted)
    sites = {}
    for s in modules:
        if id(s.module) in counted:
            order = [*views[id(s.module)], *descendants[id(s.module)]]
            trainable = tuple(sorted(counted[id(s.module)], key=order.index))
            sites[id(s.module)] = Site(s.path, s.module, matches[id(s.module)], trainable)
        elif id(s.module) in scope_ids:
            sites[id(s.module)] = s
    return _finish(sites, views, descendants, modules, learnt)


def _once_per_key(names: list[str], own: dict[str, ParamView], below: dict[str, ParamView]) -> list[str]:
    """A parameter tied under several names is counted under its first (functional_call ties the others)."""
    seen: set[Hashable] = set()
    out = []
    for name in names:
        key = (own.get(name) or below[name]).key
        if key not in seen:
            seen.add(key)
            out.append(name)
    return out


def _descendant_views(modules: list[Site], by_path: dict[str, Site], views: dict) -> dict[int, dict[str, ParamView]]:
    """Per module, the trainable parameters of its descendants by name relative to it (in module order): each
    module's parameters handed to its ancestors, modules x depth steps (a plan is rebuilt for each thing learnt)."""
    out: dict[int, dict[str, ParamView]] = {id(s.module): {} for s in modules}
    for other in modules:
        for ancestor in _ancestors(other.path, by_path):
            prefix = f"{ancestor.path}." if ancestor.path else ""
            below = out[id(ancestor.module)]
            for name, view in views[id(other.module)].items():
                below.setdefault(f"{other.path}.{name}"[len(prefix) :], view)
    return out


def _ancestors(path: str, by_path: dict[str, Site]) -> Iterator[Site]:
    """The sites strictly above the module at `path` (the root's path is "")."""
    if not path:
        return
    parts = path.split(".")
    for depth in range(len(parts)):
        above = by_path.get(".".join(parts[:depth]))
        if above is not None:
            yield above


def _finish(
    sites: dict[int, Site],
    views: dict,
    descendants: dict,
    modules: list[Site],
    learnt: Learnt,
) -> GradientPlan:
    rule_sites = [s for s in sites.values() if s.match is not None]
    owners: dict[Hashable, list[int]] = {}
    names: dict[Hashable, tuple[str, ParamView]] = {}
    key_of: dict[tuple[int, str], Hashable] = {}
    for index, site in enumerate(rule_sites):
        for name in site.trainable:
            view = views[id(site.module)].get(name) or descendants[id(site.module)][name]
            owners.setdefault(view.key, []).append(index)
            names.setdefault(view.key, (f"{site.path}.{name}" if site.path else name, view))
            key_of[(id(site.module), name)] = view.key
    clip_group_of_site = _union_groups(len(rule_sites), owners.values())
    params = {
        key: TrainableParam(name, view.tensor, clip_group_of_site[owners[key][0]], key, view.shape)
        for key, (name, view) in names.items()
    }
    clip_group_names = [""] * (max(clip_group_of_site) + 1)
    for site, clip_group in zip(rule_sites, clip_group_of_site, strict=True):
        clip_group_names[clip_group] = clip_group_names[clip_group] or site.path
    param_of = {where: params[key] for where, key in key_of.items()}
    return GradientPlan(
        sites, _in_model_order(params, views, modules), clip_group_names, param_of, views, modules, learnt
    )


def _in_model_order(params: dict[Hashable, TrainableParam], views: dict, modules: list[Site]) -> list[TrainableParam]:
    """The parameters in the model's own order (its modules', then each module's registration order), whatever
    sites count them: the same on every rank of a data-parallel group, where one flat all-reduce and one noise
    draw cover them in this order, although a rank may have learnt another plan (a parameter moved to an enclosing
    generic rule, which comes first among the sites)."""
    position: dict[Hashable, int] = {}
    for site in modules:
        for view in views[id(site.module)].values():
            position.setdefault(view.key, len(position))
    return sorted(params.values(), key=lambda param: position[param.key])


def _refuse_sample_mixing(model: nn.Module) -> None:
    mixing = [f"'{p}' ({type(m).__name__})" for p, m in model.named_modules() if isinstance(m, SAMPLE_MIXING)]
    if mixing:
        raise FlashDPError(
            f"{', '.join(mixing)}: BatchNorm mixes samples (its batch statistics make each output depend on the "
            "whole batch), so per-sample gradients, and DP-SGD's guarantee, do not exist for it. Replace it with "
            "nn.GroupNorm or nn.LayerNorm: flashdp.fix_model(model) does it (GroupNorm(gcd(C, 32), C)); build the "
            "optimizer after."
        )


def _refuse_running_statistics(model: nn.Module) -> None:
    tracking = [
        f"'{p}' ({type(m).__name__})"
        for p, m in model.named_modules()
        if isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats and m.training
    ]
    if tracking:
        raise FlashDPError(f"{', '.join(tracking)}: {RUNNING_STATS_LEAK}")


def _refuse_renormalised_tables(model: nn.Module) -> None:
    """Embedding tables with `max_norm`, frozen ones too: the forward renormalises in place the rows a batch looks up,
    so the (released) table tells which tokens the private batches held."""
    tables = [label for label, table in labelled_tables(model) if table.max_norm is not None]
    if tables:
        raise FlashDPError(f"{', '.join(tables)}: max_norm {RENORM_LEAK}.")


def _union_groups(count: int, shared: Iterable[list[int]]) -> list[int]:
    """Clipping group per site: sites that share a parameter are one group (numbered by first site)."""
    parent = list(range(count))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for indices in shared:
        for other in indices[1:]:
            parent[root(other)] = root(indices[0])
    numbering: dict[int, int] = {}
    return [numbering.setdefault(root(i), len(numbering)) for i in range(count)]
