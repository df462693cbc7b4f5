"""Trains the shipped tiny models (a Qwen3.5-layout hybrid target with an MTP head, and a small
hybrid draft model) on the Python standard library's own sources, byte-level, with optax.

    python -m serving train-tiny --out serving/assets/tiny --minutes 12

The target's loss is next-byte cross-entropy plus the MTP head's loss on the byte after next,
the MTP head seeing one position at a time (as the MTP drafter calls it). Both models are saved
in HF format (``config.json`` + ``model.safetensors``, bf16) under ``out/target`` and
``out/draft``; ``out/train_log.json`` records the losses.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from gdn_jax.models import ModelConfig, init_random
from gdn_jax.models.config import FULL, LINEAR
from gdn_jax.models.model import HybridLM, param_count
from serving.checkpoint import save_pretrained
from serving.tokenizer import BOS, VOCAB_SIZE


def target_config() -> ModelConfig:
    """About 5M parameters: two periods of (GDN, GDN, GDN, attention), hidden 256, MTP head."""
    return ModelConfig(
        model_type="qwen3_5_text",
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        num_hidden_layers=8,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL) * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        intermediate_size=512,
        tie_word_embeddings=True,
        mtp_num_hidden_layers=1,
    )


def draft_config() -> ModelConfig:
    """About 0.5M parameters: one (GDN, GDN, GDN, attention) period, hidden 128."""
    return dataclasses.replace(
        target_config(),
        hidden_size=128,
        num_hidden_layers=4,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        intermediate_size=256,
        mtp_num_hidden_layers=0,
    )


def corpus(max_bytes: int = 4 << 20) -> np.ndarray:
    """The standard library's ``.py`` files in sorted order, each preceded by ``BOS``, as int32
    token ids (at most ``max_bytes`` tokens)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts[-2:][0] or path.name.startswith("test"):
            continue
        data = np.frombuffer(path.read_bytes(), np.uint8).astype(np.int32)
        out.append(np.concatenate([[BOS], data]).astype(np.int32))
        total += len(data) + 1
        if total >= max_bytes:
            break
    if not out:
        raise FileNotFoundError(f"no .py files under {root}")
    return np.concatenate(out)[:max_bytes]


def _loss(model: HybridLM, ids: jax.Array, mtp_weight: float) -> jax.Array:
    hidden = model.hidden_states(ids[:, :-1])
    logits = model.logits(hidden).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()
    if model.mtp is not None:
        b, t, h = hidden.shape
        # one position at a time, as the drafter runs it: h_t and token t+1 -> token t+2
        mh = model.mtp(model.embed(ids[:, 1:-1].reshape(-1, 1)), hidden[:, :-1].reshape(-1, 1, h))
        ml = model.logits(mh).astype(jnp.float32).reshape(b, t - 1, -1)
        loss = (
            loss
            + mtp_weight * optax.softmax_cross_entropy_with_integer_labels(ml, ids[:, 2:]).mean()
        )
    return loss


def train(
    cfg: ModelConfig,
    data: np.ndarray,
    *,
    steps: int,
    batch: int,
    seq: int,
    lr: float,
    seed: int,
    log=print,
) -> tuple[HybridLM, list[float]]:
    """AdamW with warmup and cosine decay over ``steps`` steps of ``batch`` random windows."""
    model = init_random(cfg, jnp.float32, seed=seed)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(100, steps // 10), steps, lr / 10)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, ids):
        def f(p):
            return _loss(nnx.merge(graphdef, p, rest), ids, 0.5)

        loss, grads = jax.value_and_grad(f)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    losses, t0 = [], time.time()
    for i in range(steps):
        starts = rng.integers(0, len(data) - seq - 1, batch)
        ids = np.stack([data[s : s + seq + 1] for s in starts])
        params, opt_state, loss = step(params, opt_state, jnp.asarray(ids))
        losses.append(float(loss))
        if i % 20 == 0 or i == steps - 1:
            log(f"step {i:5d}/{steps}  loss {np.mean(losses[-20:]):.3f}  {time.time() - t0:7.1f}s")
    return nnx.merge(graphdef, params, rest), losses


def main(
    out: str | Path,
    *,
    target_steps: int = 320,
    draft_steps: int = 200,
    batch: int = 16,
    seq: int = 128,
    seed: int = 0,
    only: str | None = None,
) -> Path:
    """Trains and saves both models (or ``only`` one: ``"target"`` or ``"draft"``)."""
    if only not in (None, "target", "draft"):
        raise ValueError(f"only must be None, 'target' or 'draft', got {only!r}")
    out = Path(out)
    data = corpus()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    log(f"corpus: {len(data)} tokens from the standard library")
    log_path = out / "train_log.json"
    record = json.loads(log_path.read_text()) if log_path.exists() else {}
    for name, cfg, steps, lr in (
        ("target", target_config(), target_steps, 3e-3),
        ("draft", draft_config(), draft_steps, 3e-3),
    ):
        if only is not None and name != only:
            continue
        t0 = time.time()
        log(f"training {name}: {param_count(init_random(cfg, jnp.float32))} parameters")
        model, losses = train(
            cfg, data, steps=steps, batch=batch, seq=seq, lr=lr, seed=seed, log=log
        )
        save_pretrained(model, out / name, tokenizer="bytes")
        record[name] = dict(
            params=param_count(model),
            steps=steps,
            batch=batch,
            seq=seq,
            seconds=round(time.time() - t0, 1),
            first_loss=losses[0],
            final_loss=float(np.mean(losses[-20:])),
        )
        log(f"saved {out / name}: {record[name]}")
        with open(log_path, "w") as f:
            json.dump(record, f, indent=2)
    return out
