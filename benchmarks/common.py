"""Helpers shared by the benchmarks: model configs and their GDN dimensions, argument parsing,
error and size formatting, Markdown tables and JSON output. Imports no jax."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


# --------------------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class GDNDims:
    """GDN dimensions of a model config."""

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


def config_names() -> list[str]:
    """Stems of the configs in ``benchmarks/configs``."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_config(name_or_path: str) -> tuple[str, dict]:
    """``(name, text config)`` of a config given by file path or by the stem of a file in
    ``benchmarks/configs`` (HF ``config.json`` keys; a nested ``text_config`` is unwrapped)."""
    path = Path(name_or_path)
    if not path.exists():
        path = CONFIG_DIR / f"{name_or_path}.json"
    if not path.exists():
        raise ValueError(f"config: {name_or_path!r} is neither a file nor one of {config_names()}")
    cfg = json.loads(path.read_text())
    return path.stem, cfg.get("text_config", cfg)


def gdn_dims(name_or_path: str) -> GDNDims:
    """The GDN dimensions and layer counts of a config (see :func:`load_config`)."""
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


# ------------------------------------------------------------------------------------- arguments


def ints(s: str) -> list[int]:
    """``'1,16,64'`` -> ``[1, 16, 64]``."""
    return [int(x) for x in s.split(",") if x]


def parse_value(val: str):
    """A blocks-spec value: ``true``/``false``, an int, or the string itself."""
    if val.lower() in ("true", "false"):
        return val.lower() == "true"
    try:
        return int(val)
    except ValueError:
        return val


def parse_blocks(specs: list[str], cls) -> list:
    """``cls`` instances from ``'field=value,...'`` specs (``''``: the defaults); no specs give
    ``[cls()]``."""
    out = []
    for spec in specs:
        kw = dict(item.split("=") for item in filter(None, spec.split(",")))
        out.append(cls(**{key: parse_value(val) for key, val in kw.items()}))
    return out or [cls()]


# ------------------------------------------------------------------------------------ formatting


def rel(a, b) -> float:
    """Relative error ``||a - b|| / ||b||`` in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def fmt_bytes(x: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024:
            return f"{int(x)} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"


def fmt_cell(val, digits: int = 3) -> str:
    """A table cell: floats to ``digits`` significant digits, anything else as ``str``."""
    return f"{val:.{digits}g}" if isinstance(val, float) else str(val)


def markdown_table(rows: list[dict], cols, digits: int = 3) -> str:
    """A Markdown table of ``rows``; ``cols`` are keys or ``(key, header)`` pairs; a missing
    key is an empty cell."""
    cols = [c if isinstance(c, tuple) else (c, c) for c in cols]
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(fmt_cell(r.get(k, ""), digits) for k, _ in cols) + " |")
    return "\n".join(lines)


class CallCapture:
    """Stands in for a callable (the engine's speculator): calls it, keeps the arguments of the
    last call in ``args`` (positional) and ``kwargs``, and forwards every other attribute."""

    def __init__(self, inner):
        self.inner, self.args, self.kwargs = inner, None, None

    def __call__(self, *a, **k):
        self.args, self.kwargs = a, k
        return self.inner(*a, **k)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@contextlib.contextmanager
def frees_deferred(manager):
    """Inside the block the memory manager's ``free`` calls are recorded, not made, so that rows
    a ``generate`` finishes keep their memory: a freed handle's table entry is cleared, and a
    kernel reading through it reads some other unit's words. Yields ``release()``, which makes
    the recorded calls; call it once the timings on those rows are done."""
    free, deferred = manager.free, []

    def release():
        for a, k in deferred:
            free(*a, **k)
        deferred.clear()

    manager.free = lambda *a, **k: deferred.append((a, k))
    try:
        yield release
    finally:
        del manager.free


def log(msg: str) -> None:
    """A time-stamped progress line on stderr."""
    print(f"# [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_json(path, doc) -> None:
    """Writes ``doc`` as indented JSON (non-JSON values as ``str``); no-op without a path."""
    if path:
        Path(path).write_text(json.dumps(doc, indent=1, default=str))


def add_decode_kernel_switches(ap) -> None:
    """``--no-attention-prep``, ``--step-norm`` and ``--moe-decode-mgpu``: the engine's
    decode-kernel switches (:mod:`serving.kernels`, :mod:`gdn_jax.pallas_routes`) for A/B runs; :func:`apply_decode_kernel_switches` sets them."""
    ap.add_argument(
        "--no-attention-prep",
        action="store_true",
        help="decode's attention layers by XLA's kernels instead of the one kernel from their "
        "projection to their queries (serving.kernels.ATTENTION_DECODE_KERNEL = False; "
        "default: the kernel, as the engine runs)",
    )
    ap.add_argument(
        "--step-norm",
        action="store_true",
        help="decode's GDN layers with their gated RMSNorm inside the step kernel "
        "(serving.kernels.DECODE_GATED_NORM = True; default: an XLA kernel after it, as the "
        "engine runs)",
    )
    ap.add_argument(
        "--moe-decode-mgpu",
        action="store_true",
        help="decode's routed experts by the Mosaic GPU kernel (gdn_jax.pallas_routes."
        "MOE_DECODE_MGPU = True; default: the Triton kernel, as the engine runs)",
    )


def apply_decode_kernel_switches(args) -> None:
    """Sets :func:`add_decode_kernel_switches`' choices, read when an engine picks its
    kernels."""
    from serving import kernels

    if args.no_attention_prep:
        kernels.ATTENTION_DECODE_KERNEL = False
    if args.step_norm:
        kernels.DECODE_GATED_NORM = True
    if args.moe_decode_mgpu:
        from gdn_jax import pallas_routes

        pallas_routes.MOE_DECODE_MGPU = True
