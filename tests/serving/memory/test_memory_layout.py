"""Layout sizes from HF-style configs (docs/design.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from serving.memory import HybridLayout, layer_types, layout_for

# The fields of Qwen/Qwen3.5-35B-A3B's text config that set the cache geometry.
QWEN35_35B = {
    "num_hidden_layers": 40,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "hidden_size": 2048,
}


def test_qwen35_sizes_match_the_formulas():
    lay = layout_for({"text_config": QWEN35_35B}, page_size=16)
    assert (lay.attn_layers, lay.gdn_layers) == (10, 30)
    assert lay.kv_bytes_per_token == 2 * 10 * 2 * 256 * 2
    assert lay.kv_page_bytes == 16 * lay.kv_bytes_per_token
    conv_dim = 2 * 16 * 128 + 32 * 128
    assert lay.state_slot_bytes == 30 * (32 * 128 * 128 * 4 + 3 * conv_dim * 2)


def test_layer_types_key_wins_and_subset_keeps_the_pattern(tmp_path):
    cfg = dict(QWEN35_35B, layer_types=["linear_attention", "full_attention"] * 2)
    assert layer_types(cfg) == ["linear_attention", "full_attention"] * 2
    (tmp_path / "config.json").write_text(json.dumps({"text_config": QWEN35_35B}))
    small = layout_for(tmp_path, page_size=8, num_layers=4)
    assert (small.attn_layers, small.gdn_layers) == (1, 3)


def test_fields_are_word_aligned_and_cover_the_unit():
    lay = HybridLayout(
        page_size=3,
        attn_layers=1,
        kv_heads=1,
        head_dim=3,
        gdn_layers=1,
        k_heads=1,
        v_heads=1,
        key_dim=3,
        value_dim=2,
        spec_nodes=1,
    )
    for kind in ("kv", "state", "stash"):
        offset = 0
        for f in lay.fields(kind):
            assert f.word_offset == offset and f.words * 4 >= f.nbytes
            offset += f.words
        assert lay.unit_words(kind) == offset
    assert lay.fields("state")[0].dtype == np.float32


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"num_hidden_layers": 4}, "layer_types"),
        ({"num_hidden_layers": 4, "full_attention_interval": 2}, "missing key"),
    ],
)
def test_bad_configs_raise_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        layout_for(bad)


def test_bad_layout_fields_are_named():
    with pytest.raises(ValueError, match="page_size"):
        layout_for(QWEN35_35B, page_size=0)
    with pytest.raises(ValueError, match="num_layers"):
        layout_for(QWEN35_35B, num_layers=41)
