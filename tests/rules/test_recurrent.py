"""nn.LSTM, nn.GRU, nn.RNN: exact against the oracle, stacked, bidirectional, in both layouts, with projections,
initial states and every output in the loss; packed sequences and dropout between layers refused."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import flashdp
from flashdp import FlashDPError
from tests.conftest import MODES
from tests.oracle import check_against_oracle
from tests.strategies import batches, modes

IN, HIDDEN = 3, 4


class Recurrent(nn.Module):
    """Batch-first data through a recurrent layer in its own layout; the loss reads the output and final states."""

    def __init__(self, layer: nn.RNNBase, with_state: bool):
        super().__init__()
        self.layer, self.with_state = layer, with_state

    def forward(self, x, h0, c0):
        layer = self.layer
        layout = (lambda t: t) if layer.batch_first else (lambda t: t.transpose(0, 1))
        state = (h0, c0) if isinstance(layer, nn.LSTM) else h0
        out, final = layer(layout(x), state if self.with_state else None)
        loss = layout(out).tanh().square().sum((1, 2))
        for t in final if isinstance(layer, nn.LSTM) else (final,):  # [L * D, B, *]
            loss = loss + t.sin().sum((0, 2))
        return loss


@st.composite
def recurrent_layers(draw):
    kind = draw(st.sampled_from([nn.LSTM, nn.GRU, nn.RNN]))
    config = {
        "num_layers": draw(st.integers(1, 2)),
        "bidirectional": draw(st.booleans()),
        "batch_first": draw(st.booleans()),
        "bias": draw(st.booleans()),
    }
    if kind is nn.LSTM and draw(st.booleans()):
        config["proj_size"] = 2
    if kind is nn.RNN:
        config["nonlinearity"] = draw(st.sampled_from(["tanh", "relu"]))
    return kind(IN, HIDDEN, **config, dtype=torch.float64)


@given(batch=batches, steps=st.integers(1, 4), layer=recurrent_layers(), with_state=st.booleans(), mode=modes)
def test_recurrent_layers_match_oracle(batch, steps, layer, with_state, mode):
    model = Recurrent(layer, with_state)
    directions = 2 if layer.bidirectional else 1
    x = torch.randn(batch, steps, IN, dtype=torch.float64)
    h0 = torch.randn(layer.num_layers * directions, batch, layer.proj_size or HIDDEN, dtype=torch.float64)
    c0 = torch.randn(layer.num_layers * directions, batch, HIDDEN, dtype=torch.float64)
    # (a sample's states as contiguous tensors: cuDNN refuses a strided initial state)
    check_against_oracle(model, lambda s: model(x[s], h0[:, s].contiguous(), c0[:, s].contiguous()), batch, mode=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_stacked_bidirectional_time_major_in_every_mode(kind, mode):
    """T == B: the layout is the layer's, not a guess from sizes. Only the second layer is trained."""
    layer = kind(IN, HIDDEN, num_layers=2, bidirectional=True, dtype=torch.float64)
    for name, p in layer.named_parameters():
        p.requires_grad_("l1" in name)
    model = Recurrent(layer, with_state=False)
    x = torch.randn(3, 3, IN, dtype=torch.float64)
    check_against_oracle(model, lambda s: model(x[s], None, None), 3, mode=mode)
    model.zero_grad()
    with flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0) as engine:
        engine.backward(model(x, None, None))
        assert set(engine.strategies) == {n for n, p in model.named_parameters() if p.requires_grad}
        assert "generic" not in engine.strategies.values()


def test_packed_sequences_are_refused():
    lstm = nn.LSTM(IN, HIDDEN, batch_first=True)
    packed = pack_padded_sequence(torch.randn(3, 4, IN), torch.tensor([4, 2, 1], device="cpu"), batch_first=True)
    with (
        flashdp.make_private(lstm, max_grad_norm=1.0, noise_multiplier=1.0),
        pytest.raises(FlashDPError, match=r"Layer '<root>' \(LSTM\): called on a PackedSequence.*Pad the batch"),
    ):
        lstm(packed)


def test_dropout_between_layers_in_training_is_refused():
    gru = nn.GRU(IN, HIDDEN, num_layers=2, dropout=0.2, batch_first=True)
    with (
        flashdp.make_private(gru, max_grad_norm=1.0, noise_multiplier=1.0),
        pytest.raises(FlashDPError, match=r"dropout=0.2 between its layers in training mode"),
    ):
        gru(torch.randn(3, 4, IN))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's TF32 recurrent layers need a CUDA device")
@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_a_float32_recurrent_layer_on_cuda_is_taken_though_cudnn_computed_it_in_tf32(kind):
    """cuDNN runs float32 recurrent layers in TF32 by default: the step-by-step recomputation (float32) differs from
    the recorded output by about 1e-4 (seen on an H200), which the recomputation check must accept as rounding."""
    torch.manual_seed(0)
    model = Recurrent(kind(16, 32, num_layers=2, batch_first=True), with_state=False).cuda()
    x = torch.randn(6, 20, 16, device="cuda")
    check_against_oracle(model, lambda rows: model(x[rows], None, None), 6, rtol=3e-2)
