"""HF models from tiny configs, fully fine-tuned, called as their model cards call them (GPT-2 and BERT without
position_ids), and PEFT adapters: exact against the float64 oracle in bk, ghost and flash, with the engine's self-check
on. The rules they end up with (registered fast paths, the generic rule, shared outputs) are in docs/layers.md."""

import pytest
import torch

import flashdp
from tests.conftest import MODES
from tests.hf import zoo
from tests.hf.zoo import CASES, PEFT_CASES, B
from tests.oracle import check_against_oracle, seeded
from tests.steps import check_steps

ALL = CASES | {f"peft_{name}": case for name, case in PEFT_CASES.items()}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ALL))
def test_model_is_exact(name, mode):
    case = ALL[name]()
    model = case.build().to(case.dtype).eval()
    # float64, up to what HF computes in float32 inside (T5's and Llama's norms); float32: MoE routing, its kernels
    rtol = 1e-6 if case.dtype == torch.float64 else 1e-3
    check_against_oracle(model, lambda s: case.loss(model, s), B, mode=mode, rtol=rtol)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit", "gemma", "mamba", "deberta_v3", "peft_dora"])
def test_removing_one_sample_moves_the_sum_by_at_most_c_with_the_generic_rule(name):
    """The sensitivity audit on models that use the generic rule (ViT: its class token and position table, counted
    where they meet the batch now)."""
    case = ALL[name]()
    model = case.build().to(case.dtype).eval()
    c = 1e-3
    with flashdp.make_private(model, max_grad_norm=c, noise_multiplier=1.0) as engine:

        def clipped_sum(keep: list[int]) -> torch.Tensor:
            model.zero_grad()
            engine.backward(case.loss(model, keep))
            return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad and p.grad is not None])

        full = clipped_sum(list(range(B)))
        assert {"generic", "broadcast"} & set(engine.strategies.values())
        for i in range(B):
            assert (full - clipped_sum([j for j in range(B) if j != i])).norm() <= c * (1 + 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("name", ["t5", "xlnet", "whisper"])
def test_a_batch_as_long_as_the_sequence_is_exact(name, mode, monkeypatch):
    """T5 looks its relative bias up with ids `[q_len, k_len]`, XLNet runs `[T, B, d]` and Whisper's decoder
    positions are `[T, d]`: with B == T, a check of sizes alone would take their positions for samples."""
    monkeypatch.setattr(zoo, "B", zoo.T)
    monkeypatch.setattr(zoo, "LABELS", torch.arange(zoo.T) % 3)
    case = CASES[name]()
    model = case.build().to(case.dtype).eval()
    check_against_oracle(model, lambda s: case.loss(model, s), zoo.T, mode=mode, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [2, 4, 5, 6])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_model_is_exact_at_batch_sizes_that_meet_its_other_sizes(name, batch, monkeypatch):
    """B equal to the sequence (5), to a head count or a multiple of it (2, 4, 6), to a window count (Swin's 4):
    where a size alone would take a position table, a relative bias or a window mask for samples (BART at T == B,
    Swin at B == its window count, BEiT at every B > 1 were refused before 2026-11-28). About 0.2 s a case; the
    zoo's other tests run B = 3."""
    monkeypatch.setattr(zoo, "B", batch)
    monkeypatch.setattr(zoo, "LABELS", torch.arange(batch) % 3)
    case = CASES[name]()
    model = case.build().to(case.dtype).eval()
    rtol = 1e-6 if case.dtype == torch.float64 else 1e-3
    check_against_oracle(model, lambda s: case.loss(model, s), batch, mode="bk", rtol=rtol)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bk", "ghost"])
@pytest.mark.parametrize("name", ["t5", "xlnet", "whisper", "gpt2", *sorted(zoo.STEP_CASES)])
def test_a_first_batch_of_one_teaches_the_next_batches_nothing(name, mode, monkeypatch):
    """A batch of one (Poisson sampling draws them) fits every layout: nothing it shows may be trusted on the
    batches of 3 and 2 that follow (T5's relative bias, XLNet's `[T, B, d]`, parametrized convolutions), here
    with T = 6 a multiple of B = 3."""
    monkeypatch.setattr(zoo, "T", 6)
    case = (CASES | zoo.STEP_CASES)[name]()
    model = case.build().to(case.dtype).eval()
    steps = [slice(0, 1), slice(0, B), slice(1, B)]
    check_steps(
        model, steps, case.loss, lambda rows, i: slice(rows.start + i, rows.start + i + 1), [1, B, B - 1], mode=mode
    )


@pytest.mark.slow
def test_a_pooled_length_equal_to_the_batch_is_exact_or_refused_naming_that_cause(monkeypatch):
    """HF Funnel pools the sequence: with T = 8 and B = 4 its second block's relative positions have B rows, which
    the generic rule cannot tell from samples. Exact, or a refusal that names that cause among the others."""
    import transformers as tf

    monkeypatch.setattr(zoo, "T", 8)
    monkeypatch.setattr(zoo, "B", 4)
    monkeypatch.setattr(zoo, "LABELS", torch.arange(4) % 3)
    case = zoo.classifier(
        tf.FunnelConfig, tf.FunnelForSequenceClassification, d_model=8, n_head=2, d_head=4, d_inner=12,
        block_sizes=[1, 1], num_decoder_layers=1, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )  # fmt: skip
    model = case.build().double().eval()
    try:
        check_against_oracle(model, lambda s: case.loss(model, s), 4, rtol=1e-6)
    except flashdp.FlashDPError as error:
        assert "has the batch size B in its first dim by coincidence (a pooled" in str(error)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_reformers_reversible_layers_writing_their_own_gradients_are_refused(mode):
    """HF Reformer's reversible layers recompute their forward in the backward and call .backward() on it: raw,
    unclipped gradients into `.grad` that no norm counts. Refused, and nothing is left in `.grad`."""
    import transformers as tf

    config = tf.ReformerConfig(
        vocab_size=zoo.VOCAB, hidden_size=8, num_attention_heads=2, attention_head_size=4, feed_forward_size=12,
        attn_layers=["local", "local"], axial_pos_embds=False, max_position_embeddings=16, local_attn_chunk_length=4,
        is_decoder=True, hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    model = tf.ReformerModelWithLMHead(config).double()
    ids = torch.randint(2, zoo.VOCAB, (3, 8), generator=seeded(0))
    with flashdp.make_private(model, mode=mode, max_grad_norm=1.0, noise_multiplier=0.0) as engine:
        logits = model(input_ids=ids).logits
        with pytest.raises(flashdp.FlashDPError, match=r"something other than flashdp wrote to the \.grad of"):
            engine.backward(flashdp.per_sample_lm_loss(logits, ids))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_batch_as_large_as_a_stage_s_window_count_is_exact(mode, monkeypatch):
    """Swin's shifted-window attention takes `[B * nW, n, d]` windows and a mask of one row per window `[nW, n,
    n]`: with B == nW (4 here; 4, 16 and 64 for Swin-T at 224 px) a check of sizes alone would take the mask's
    rows for samples."""
    monkeypatch.setattr(zoo, "B", 4)
    monkeypatch.setattr(zoo, "LABELS", torch.arange(4) % 3)
    case = CASES["swin"]()
    model = case.build().to(case.dtype).eval()
    check_against_oracle(model, lambda s: case.loss(model, s), 4, mode=mode, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_a_batch_as_large_as_deberta_s_relative_positions_is_exact(mode, monkeypatch):
    """DeBERTa's attention takes its relative embeddings `[2 k, d]` (k position buckets, 4 here; 256 in DeBERTa-v3,
    so B = 512) as an argument: with B == 2 k a check of sizes alone would take their rows for samples."""
    monkeypatch.setattr(zoo, "B", 8)
    monkeypatch.setattr(zoo, "LABELS", torch.arange(8) % 3)
    case = CASES["deberta_v3"]()
    model = case.build().to(case.dtype).eval()
    check_against_oracle(model, lambda s: case.loss(model, s), 8, mode=mode, rtol=1e-6)
