"""Mixture-of-experts models from tiny configs, fully fine-tuned with transformers' eager experts (the loop over the
experts a batch hit, float64): exact against the oracle in bk, ghost and flash through the routed-experts rule, with
top-1 and top-2 routing, experts no token reached, routing that changes from step to step, and the auxiliary
load-balancing loss (it mixes samples) refused."""

import pytest
import torch
import transformers as tf

import flashdp
from flashdp import FlashDPError
from tests.conftest import MODES
from tests.hf.zoo import DECODER, VOCAB, causal_lm, lm_loss
from tests.oracle import check_against_oracle, seeded
from tests.steps import check_steps

#: family -> (config class, its MoE settings with 4 experts, top-2)
FAMILIES = {
    "mixtral": (tf.MixtralConfig, {"num_local_experts": 4}),
    "qwen2_moe": (
        tf.Qwen2MoeConfig,
        {"num_experts": 4, "moe_intermediate_size": 6, "shared_expert_intermediate_size": 6, "decoder_sparse_step": 1},
    ),
    "olmoe": (tf.OlmoeConfig, {"num_experts": 4}),
    "granitemoe": (tf.GraniteMoeConfig, {"num_local_experts": 4}),
    "deepseek_v2": (
        tf.DeepseekV2Config,
        {
            "n_routed_experts": 4,
            "moe_intermediate_size": 6,
            "first_k_dense_replace": 0,
            "n_shared_experts": 1,
            "kv_lora_rank": 4,
            "q_lora_rank": None,
            "qk_rope_head_dim": 2,
            "qk_nope_head_dim": 2,
            "v_head_dim": 4,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "gpt_oss": (tf.GptOssConfig, {"num_local_experts": 4, "layer_types": ["full_attention"] * 2, "head_dim": 4}),
    "jamba": (
        tf.JambaConfig,
        {
            "num_experts": 4,
            "expert_layer_period": 1,
            "expert_layer_offset": 0,
            "attn_layer_period": 1,
            "attn_layer_offset": 0,
            "use_mamba_kernels": False,
        },
    ),
}
B = 3


def _case(family: str, top_k: int = 2, **extra):
    config_class, settings = FAMILIES[family]
    return causal_lm(
        config_class, **DECODER, **settings, num_experts_per_tok=top_k, experts_implementation="eager", **extra
    )


def _model(case) -> torch.nn.Module:
    torch.manual_seed(0)
    return case.build().double().eval()


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_model_is_exact(family, mode):
    case = _case(family)
    model = _model(case)
    check_against_oracle(model, lambda s: case.loss(model, s), B, mode=mode, rtol=1e-6)
    experts = [name for name, m in model.named_modules() if name.endswith("experts") and hasattr(m, "gate_up_proj")]
    assert experts, "the model has no routed-experts module: the test would not exercise the rule"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_top_1_routing_over_8_experts_leaves_some_unreached_and_is_exact(family):
    """3 samples of 5 tokens, top-1 over 8 experts per layer: experts a sample (or the batch) never reached get a
    zero gradient (the oracle's zeros)."""
    key = "num_local_experts"
    config_class, settings = FAMILIES[family]
    case = causal_lm(
        config_class, **DECODER, **{**settings, key: 8}, num_experts_per_tok=1, experts_implementation="eager"
    )
    model = _model(case)
    check_against_oracle(model, lambda s: case.loss(model, s), B, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_routing_that_changes_from_step_to_step_stays_exact(mode):
    """Each step draws other tokens of another batch size, so other experts are hit by other samples: what the
    first step learnt about the experts' calls must not be trusted for the next."""
    model = _model(_case("mixtral"))
    sizes = [3, 1, 4, 2]
    batches = [torch.randint(2, VOCAB, (n, 5), generator=seeded(k)) for k, n in enumerate(sizes)]

    def loss_of(m, ids):
        return lm_loss(m(ids, use_cache=False).logits, ids)

    check_steps(model, batches, loss_of, lambda ids, i: ids[i : i + 1], sizes, mode=mode, rtol=1e-6)


@pytest.mark.slow
def test_the_load_balancing_loss_mixes_samples_and_is_refused():
    """transformers' auxiliary loss depends on the whole batch's routing: added to each sample's loss, a sample's
    loss depends on the others, which the first backward's checks refuse."""
    case = _case("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)
    model = _model(case)
    ids = torch.randint(2, VOCAB, (B, 5), generator=seeded(0))
    engine = flashdp.make_private(model, max_grad_norm=1.0, noise_multiplier=1.0)
    out = model(ids, use_cache=False)
    with pytest.raises(FlashDPError, match="auxiliary load-balancing loss"):
        engine.backward(lm_loss(out.logits, ids) + out.aux_loss)
