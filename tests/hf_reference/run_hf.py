"""Runs HF transformers' reference functions on inputs from an .npz; writes outputs to an .npz.

Executed by the Python 3.11 side venv (see setup_venv.sh), never imported by the 3.12 suite:

    python run_hf.py JOB IN.npz OUT.npz

Jobs:
- ``gdn``: ``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule`` (outputs
  ``o_chunk, state_chunk, o_recurrent, state_recurrent``) from ``transformers.models.qwen3_next.modeling_qwen3_next`` on q, k, v, g, beta, state
  (layout ``[B, T, H, D]``; q/k with their own Hk heads, which HF repeat-interleaves to the
  value heads), with the flags ``use_qk_l2norm`` and ``chunk_size`` from the .npz.
"""

import sys

import numpy as np
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf


def gdn(job: str, a: dict) -> dict:
    t = {k: torch.from_numpy(np.ascontiguousarray(a[k])) for k in ("q", "k", "v", "g", "beta")}
    state = torch.from_numpy(a["state"]) if "state" in a else None
    l2 = bool(a["use_qk_l2norm"])
    if job == "chunk":
        o, s = hf.torch_chunk_gated_delta_rule(
            t["q"],
            t["k"],
            t["v"],
            t["g"],
            t["beta"],
            chunk_size=int(a["chunk_size"]),
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=l2,
        )
    else:
        o, s = hf.torch_recurrent_gated_delta_rule(
            t["q"],
            t["k"],
            t["v"],
            t["g"],
            t["beta"],
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=l2,
        )
    return {"o": o.float().numpy(), "state": s.float().numpy()}


def main() -> None:
    job, src, dst = sys.argv[1:4]
    torch.set_grad_enabled(False)
    a = dict(np.load(src))
    if job == "gdn":
        out = {}
        for kind in ("chunk", "recurrent"):
            res = gdn(kind, a)
            out[f"o_{kind}"], out[f"state_{kind}"] = res["o"], res["state"]
    else:
        raise SystemExit(f"run_hf.py: unknown job {job!r}")
    np.savez(dst, **out)


if __name__ == "__main__":
    main()
