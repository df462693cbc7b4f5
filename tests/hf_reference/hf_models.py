"""Tiny random Qwen3-Next / Qwen3.5 models in HF transformers, saved for the JAX parity tests.

Executed by the Python 3.11 side venv (see setup_venv.sh), never imported by the 3.12 suite:

    python hf_models.py model IN.npz OUT.npz CHECKPOINT_DIR

``IN.npz``: ``kind`` (``qwen3_next`` | ``qwen3_5_text`` | ``qwen3_5_moe_text``), ``seed``,
``ids [B, T]`` (prefill), ``prompt_len`` P, ``tree_tokens [B, N]``, ``parents [N]``,
``with_mtp`` (bool), ``bf16`` (bool: also save a bfloat16 copy in CHECKPOINT_DIR/bf16).

Writes the checkpoint (``save_pretrained``, float32 safetensors; with ``with_mtp`` an extra
``mtp.safetensors`` holding an MTP head built from HF modules, and ``mtp_num_hidden_layers: 1``
in config.json) and ``OUT.npz`` with:
- ``logits [B, T, V]``: the full forward of ``ids``;
- ``decode_logits [B, T - P, V]``: HF's own cache: prefill ``ids[:, :P]`` then one token at a
  time (the logits that predict tokens ``P+1 .. T``; the first row is the prefill's last);
- ``path_logits [B, N, V]``: for each tree node, the last logits of ``ids[:, :P] + path(node)``;
- ``mtp_logits [B, T, V]`` (with ``with_mtp``): MTP logits from the final hidden state at ``t``
  and token ``ids[:, t + 1]`` (the last position uses token 0).
"""

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as m35
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m35moe
from transformers.models.qwen3_next import modeling_qwen3_next as mnext

COMMON = dict(
    vocab_size=101,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    tie_word_embeddings=False,
)
MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
)
KINDS = {
    # attention last; layer 1 uses the dense MLP (mlp_only_layers)
    "qwen3_next": (
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
        mnext,
        "Qwen3Next",
        dict(MOE, intermediate_size=40, mlp_only_layers=[1], full_attention_interval=4),
    ),
    # attention at layers 1 and 3
    "qwen3_5_text": (
        Qwen3_5TextConfig,
        Qwen3_5ForCausalLM,
        m35,
        "Qwen3_5",
        dict(intermediate_size=40, full_attention_interval=2),
    ),
    "qwen3_5_moe_text": (
        Qwen3_5MoeTextConfig,
        Qwen3_5MoeForCausalLM,
        m35moe,
        "Qwen3_5Moe",
        dict(MOE, full_attention_interval=4),
    ),
}


def randomize(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Every parameter random and O(1)-scaled, so no part of the model is an identity."""
    for name, p in module.named_parameters():
        shape = p.shape
        if name.endswith("A_log"):
            val = torch.rand(shape, generator=gen) * 7 + 1
            p.data.copy_(val.log())
        elif name.endswith("dt_bias"):
            p.data.copy_(torch.randn(shape, generator=gen) * 0.5)
        elif name.endswith("linear_attn.norm.weight"):
            p.data.copy_(1 + 0.2 * torch.randn(shape, generator=gen))
        elif p.ndim == 1:  # zero-centred RMSNorm weights
            p.data.copy_(0.2 * torch.randn(shape, generator=gen))
        elif name.endswith("conv1d.weight"):
            p.data.copy_(0.4 * torch.randn(shape, generator=gen))
        else:
            p.data.copy_(torch.randn(shape, generator=gen) / math.sqrt(shape[-1]))


def causal_mask(t: int) -> torch.Tensor:
    return torch.full((t, t), float("-inf")).triu(1)[None, None]


def build_mtp(cfg, mod, prefix: str, gen: torch.Generator) -> torch.nn.Module:
    full = cfg.layer_types.index("full_attention")
    mtp = torch.nn.Module()
    mtp.fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
    norm_cls = getattr(mod, f"{prefix}RMSNorm")
    mtp.pre_fc_norm_embedding = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps)
    mtp.pre_fc_norm_hidden = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps)
    mtp.norm = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps)
    mtp.layers = torch.nn.ModuleList([getattr(mod, f"{prefix}DecoderLayer")(cfg, full)])
    randomize(mtp, gen)
    return mtp.eval()


def mtp_forward(model, mtp, ids: torch.Tensor) -> torch.Tensor:
    hidden = model.model(input_ids=ids).last_hidden_state
    nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    emb = model.model.embed_tokens(nxt)
    x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(emb), mtp.pre_fc_norm_hidden(hidden)], -1))
    t = ids.shape[1]
    pos = torch.arange(t)[None].expand(ids.shape[0], -1)
    cos_sin = model.model.rotary_emb(x, pos)
    for layer in mtp.layers:
        x = layer(x, position_embeddings=cos_sin, attention_mask=causal_mask(t), position_ids=pos)
    return model.lm_head(mtp.norm(x))


def make(a: dict, out_dir: Path) -> dict:
    kind = str(a["kind"])
    config_cls, model_cls, mod, prefix, extra = KINDS[kind]
    cfg = config_cls(**COMMON, **extra)
    cfg._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(int(a["seed"]))
    model = model_cls(cfg).eval()
    randomize(model, gen)
    model.save_pretrained(out_dir)
    if bool(a["bf16"]):
        bf = model_cls(cfg).eval()
        bf.load_state_dict(model.state_dict())
        bf.to(torch.bfloat16).save_pretrained(out_dir / "bf16")

    ids = torch.from_numpy(a["ids"]).long()
    p = int(a["prompt_len"])
    out = {"logits": model(input_ids=ids).logits.float().numpy()}

    res = model(input_ids=ids[:, :p], use_cache=True)
    steps, cache = [res.logits[:, -1]], res.cache
    for t in range(p, ids.shape[1] - 1):
        res = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
        steps.append(res.logits[:, -1])
        cache = res.cache
    out["decode_logits"] = torch.stack(steps, 1).float().numpy()

    tokens = torch.from_numpy(a["tree_tokens"]).long()
    parents = [int(x) for x in a["parents"]]
    rows = []
    for n in range(len(parents)):
        path, cur = [], n
        while cur >= 0:
            path.append(cur)
            cur = parents[cur]
        seq = torch.cat([ids[:, :p], tokens[:, path[::-1]]], dim=1)
        rows.append(model(input_ids=seq).logits[:, -1])
    out["path_logits"] = torch.stack(rows, 1).float().numpy()

    if bool(a["with_mtp"]):
        mtp = build_mtp(cfg, mod, prefix, gen)
        save_file(
            {f"mtp.{k}": v.contiguous() for k, v in mtp.state_dict().items()},
            str(out_dir / "mtp.safetensors"),
        )
        conf = json.loads((out_dir / "config.json").read_text())
        conf["mtp_num_hidden_layers"] = 1
        (out_dir / "config.json").write_text(json.dumps(conf, indent=2))
        out["mtp_logits"] = mtp_forward(model, mtp, ids).float().numpy()
    return out


def main() -> None:
    job, src, dst = sys.argv[1:4]
    torch.set_grad_enabled(False)
    a = dict(np.load(src))
    if job != "model":
        raise SystemExit(f"hf_models.py: unknown job {job!r}")
    np.savez(dst, **make(a, Path(sys.argv[4])))


if __name__ == "__main__":
    main()
