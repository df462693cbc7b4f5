"""The hybrid GDN / attention model configuration, parsed from an HF ``config.json``.

One frozen dataclass covers Qwen3-Next (``qwen3_next``), Qwen3.5 dense (``qwen3_5_text``) and
Qwen3.5 MoE (``qwen3_5_moe_text``); the multimodal Qwen3.5 wrappers (``qwen3_5``,
``qwen3_5_moe``) are read through their nested ``text_config`` and their weights carry the
``model.language_model.`` prefix.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

LINEAR, FULL = "linear_attention", "full_attention"

# model_type -> (text model_type, weight prefix of the decoder stack)
SUPPORTED = {
    "qwen3_next": ("qwen3_next", "model."),
    "qwen3_5_text": ("qwen3_5_text", "model."),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", "model."),
    "qwen3_5": ("qwen3_5_text", "model.language_model."),
    "qwen3_5_moe": ("qwen3_5_moe_text", "model.language_model."),
}

# HF defaults of the fields a config.json may leave out, per text model_type.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_next": dict(
        vocab_size=151936,
        intermediate_size=5632,
        num_experts=512,
        num_experts_per_tok=10,
        norm_topk_prob=True,
    ),
    "qwen3_5_text": dict(
        vocab_size=248320,
        intermediate_size=12288,
        num_experts=0,
        num_experts_per_tok=0,
        norm_topk_prob=True,
    ),
    "qwen3_5_moe_text": dict(
        vocab_size=248320,
        intermediate_size=None,
        num_experts=256,
        num_experts_per_tok=8,
        norm_topk_prob=True,
    ),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a Qwen3-Next / Qwen3.5 text model (names follow HF)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    attn_output_gate: bool = True
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    # gated delta net
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # feed-forward: dense MLP and/or MoE
    intermediate_size: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # the rest
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    weight_prefix: str = "model."

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types: expected {self.num_hidden_layers} entries, got {len(self.layer_types)}"
            )
        bad = set(self.layer_types) - {LINEAR, FULL}
        if bad:
            raise ValueError(f"layer_types: unsupported layer types {sorted(bad)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    # derived sizes -------------------------------------------------------------------------
    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv: ``[q | k | v]``."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    def is_moe_layer(self, i: int) -> bool:
        """HF's rule: MoE unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step``.

        MTP layers (``i >= num_hidden_layers``) follow the model: MoE iff ``num_experts > 0``.
        """
        if self.num_experts <= 0:
            return False
        if i >= self.num_hidden_layers:
            return True
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    # parsing -------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parses an HF config dict (top level or with a nested ``text_config``)."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED:
            raise ValueError(
                f"model_type: unsupported {model_type!r}; expected one of {sorted(SUPPORTED)}"
            )
        text_type, prefix = SUPPORTED[model_type]
        d = dict(raw.get("text_config") or raw) if prefix != "model." else dict(raw)
        if "tie_word_embeddings" not in d and "tie_word_embeddings" in raw:
            d["tie_word_embeddings"] = raw["tie_word_embeddings"]
        get = lambda k, default: d[k] if d.get(k) is not None else default
        defaults = _DEFAULTS[text_type]
        n_layers = int(get("num_hidden_layers", 48))
        layer_types = d.get("layer_types")
        if layer_types is None:
            interval = int(get("full_attention_interval", 4))
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(n_layers)]
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope", None):
            raise ValueError(f"rope_parameters: unsupported rope_type {rope_type!r}")
        if d.get("attention_bias"):
            raise ValueError("attention_bias: True is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {d['hidden_act']!r}")
        hidden = int(d["hidden_size"])
        n_heads = int(get("num_attention_heads", 16))
        return cls(
            model_type=text_type,
            vocab_size=int(get("vocab_size", defaults["vocab_size"])),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=n_heads,
            num_key_value_heads=int(get("num_key_value_heads", 2)),
            head_dim=int(get("head_dim", hidden // n_heads)),
            attn_output_gate=bool(get("attn_output_gate", True)),
            rope_theta=float(rope.get("rope_theta", get("rope_theta", 10000.0))),
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor", get("partial_rotary_factor", 0.25))
            ),
            linear_num_key_heads=int(get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
            intermediate_size=get("intermediate_size", defaults["intermediate_size"]),
            num_experts=int(get("num_experts", defaults["num_experts"])),
            num_experts_per_tok=int(get("num_experts_per_tok", defaults["num_experts_per_tok"])),
            moe_intermediate_size=int(get("moe_intermediate_size", 512)),
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 512)),
            # Qwen3.5 MoE always renormalises the top-k weights.
            norm_topk_prob=bool(get("norm_topk_prob", defaults["norm_topk_prob"]))
            if text_type == "qwen3_next"
            else True,
            decoder_sparse_step=int(get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(get("mlp_only_layers", ())),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            mtp_num_hidden_layers=int(
                get("mtp_num_hidden_layers", get("num_nextn_predict_layers", 0))
            ),
            weight_prefix=prefix,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` keys of this text config, such that
        ``ModelConfig.from_hf_dict(cfg.to_hf_dict())`` gives ``cfg`` back (with the text model's
        ``weight_prefix``, ``"model."``); the MoE keys are left out for a dense model of a type
        whose default is dense."""
        d = dict(
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            layer_types=list(self.layer_types),
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            attn_output_gate=self.attn_output_gate,
            rope_theta=self.rope_theta,
            partial_rotary_factor=self.partial_rotary_factor,
            linear_num_key_heads=self.linear_num_key_heads,
            linear_num_value_heads=self.linear_num_value_heads,
            linear_key_head_dim=self.linear_key_head_dim,
            linear_value_head_dim=self.linear_value_head_dim,
            linear_conv_kernel_dim=self.linear_conv_kernel_dim,
        )
        if self.intermediate_size is not None:
            d["intermediate_size"] = self.intermediate_size
        if self.num_experts or _DEFAULTS[self.model_type]["num_experts"]:
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        d.update(
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            mtp_num_hidden_layers=self.mtp_num_hidden_layers,
        )
        return d

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Reads ``config.json`` (a file, or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))
