"""The loss graph's structure reads the dims, flags and positions an op saved, never the tensors it saved."""

from __future__ import annotations

import torch

from flashdp._pipeline.loss_graph import _structure_attributes


def test_the_structure_of_an_op_whose_saved_input_was_modified_in_place_is_read():
    """(Found on an H200: naming a node's structure attributes unpacked its saved tensors, and autograd's error for
    an input modified in place since, which flashdp refuses with its own message, came out of the graph walk.)"""
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True) * 1.0
    y = torch.cumsum(x.sin(), dim=1)
    x.mul_(2.0)  # (SinBackward's saved input is stale now)
    assert _structure_attributes(y.grad_fn) == ("_saved_dim",)
    assert _structure_attributes(y.grad_fn.next_functions[0][0]) == ()


def test_naming_the_structure_attributes_unpacks_no_saved_tensor():
    """Unpacking a saved tensor copies it back from the host under `save_on_cpu`, or recomputes a checkpointed
    region: the structure needs neither."""
    unpacked = []

    def unpack(t):
        unpacked.append(t)
        return t

    x = torch.randn(3, 4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        y = torch.nn.functional.linear(x, torch.randn(5, 4)).softmax(dim=1)
    for node in (y.grad_fn, y.grad_fn.next_functions[0][0]):
        _structure_attributes(node)
    assert unpacked == []
