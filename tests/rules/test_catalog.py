"""docs/layers.md lists what the registry holds; the rule-writing guide runs."""

import re
from pathlib import Path

from torch import nn

from flashdp.rules.catalog import BEGIN, END, layers_table

PAGE = Path(__file__).resolve().parents[2] / "docs" / "layers.md"


def test_the_supported_layers_page_is_generated_from_the_registry():
    table = PAGE.read_text().split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert table == layers_table(), "docs/layers.md is stale: run python -m flashdp.rules.catalog docs/layers.md"


def test_every_layer_type_the_issue_names_has_a_row():
    table = layers_table()
    for layer in (nn.MultiheadAttention, nn.LSTM, nn.GRU, nn.RNN, nn.Conv3d, nn.ConvTranspose2d, nn.InstanceNorm1d,
                  nn.PReLU, nn.EmbeddingBag, nn.Bilinear, nn.Linear, nn.Embedding, nn.LayerNorm):  # fmt: skip
        assert f"`nn.{layer.__name__}`" in table


def test_the_writing_a_rule_guide_runs():
    """Its code blocks, in order, as a user would paste them (the last one asserts the rule's result)."""
    guide = (PAGE.parent / "guides" / "writing-a-rule.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, flags=re.S)
    namespace: dict = {}
    exec("\n".join(blocks), namespace)
    assert namespace["engine"].strategies["1.weight"] == "per-sample"
