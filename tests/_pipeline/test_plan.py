"""The gradient plan's incremental updates against a rebuild of the whole plan from what was learnt."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from flashdp._pipeline.plan import GradientPlan, scan_model

transformers = pytest.importorskip("transformers")


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_embd=8, n_layer=2, n_head=2, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def _summary(plan: GradientPlan) -> tuple:
    """Everything a plan tells its users, comparable across two plans of one model."""
    sites = tuple((key, s.path, id(s.module), s.match, s.trainable) for key, s in plan.sites.items())
    params = tuple((p.name, p.key, p.clip_group, tuple(p.shape)) for p in plan.params)
    param_of = tuple(sorted((where, p.key) for where, p in plan.param_of.items()))
    return sites, params, tuple(plan.clip_group_names), param_of, plan.learnt


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 100), st.sampled_from([1.0, 0.5, 2.0**0.5, 8.0])), min_size=1, max_size=6))
def test_a_scale_learnt_changes_what_a_rebuild_would(steps: list[tuple[int, float]]) -> None:
    """`with_scale` replaces one site's match in place of rebuilding every site: after any sequence of scales
    learnt (of GPT-2's duck-typed Conv1D layers, verified on their first call), interleaved with a module forced to
    the generic rule, it gives what the whole rebuild gives."""
    plan = scan_model(_gpt2())
    verified = [s.module for s in plan.rule_sites if s.match.verify_with is not None]
    assert len(verified) >= 4  # (the Conv1D layers: the test has modules to learn scales of)
    forced = False
    for index, scale in steps:
        module = verified[index % len(verified)]
        if plan.site(module).match.verify_with is None:  # a scale is learnt once, on the first call
            continue
        incremental = plan.with_scale(module, scale)
        rebuilt = plan._rebuilt(scales=plan.learnt.scales | {id(module): scale})
        assert _summary(incremental) == _summary(rebuilt)
        assert incremental.site(module).match.output_scale == scale
        plan = incremental
        if not forced:
            plan, forced = plan.with_generic(verified[-1 - index % len(verified)]), True
