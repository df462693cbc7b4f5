"""GDN dimensions of a model config (HF ``config.json`` keys; nested ``text_config`` accepted)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


@dataclasses.dataclass(frozen=True)
class GDNDims:
    name: str
    num_gdn_layers: int
    num_attn_layers: int
    hidden: int
    hk: int
    hv: int
    k: int
    v: int
    conv_width: int

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv: ``[q | k | v]``."""
        return 2 * self.hk * self.k + self.hv * self.v


def load_config(name_or_path: str) -> tuple[str, dict]:
    """A config by file path or by stem of a file in ``benchmarks/configs``."""
    path = Path(name_or_path)
    if not path.exists():
        path = CONFIG_DIR / f"{name_or_path}.json"
    if not path.exists():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
        raise ValueError(f"config: {name_or_path!r} is neither a file nor one of {known}")
    cfg = json.loads(path.read_text())
    return path.stem, cfg.get("text_config", cfg)


def gdn_dims(name_or_path: str) -> GDNDims:
    name, cfg = load_config(name_or_path)
    n = cfg["num_hidden_layers"]
    if "layer_types" in cfg:
        n_gdn = sum(t == "linear_attention" for t in cfg["layer_types"])
    else:
        interval = cfg["full_attention_interval"]
        n_gdn = sum((i + 1) % interval != 0 for i in range(n))
    return GDNDims(
        name=name,
        num_gdn_layers=n_gdn,
        num_attn_layers=n - n_gdn,
        hidden=cfg["hidden_size"],
        hk=cfg["linear_num_key_heads"],
        hv=cfg["linear_num_value_heads"],
        k=cfg["linear_key_head_dim"],
        v=cfg["linear_value_head_dim"],
        conv_width=cfg["linear_conv_kernel_dim"],
    )
