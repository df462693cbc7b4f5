"""Parity with HF transformers through a Python 3.11 side venv (see setup_venv.sh)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_PYTHON = HERE.parent.parent / ".venv311" / "bin" / "python"


def hf_python() -> str:
    """The side venv's interpreter: ``$GDN_HF_PYTHON`` or ``.venv311/bin/python``.

    Raises a clear error when it is missing: parity tests must fail, never skip silently.
    """
    py = os.environ.get("GDN_HF_PYTHON", str(DEFAULT_PYTHON))
    if not Path(py).exists():
        raise RuntimeError(
            f"HF reference interpreter {py} not found: run `bash tests/hf_reference/setup_venv.sh`"
            " (or set GDN_HF_PYTHON)"
        )
    return py


def run_hf(script: str, job: str, inputs: dict, tmp_path: Path, *extra: str) -> dict:
    """Runs ``HERE/script job IN OUT *extra`` in the side venv; returns the output arrays."""
    src, dst = tmp_path / f"{job}_in.npz", tmp_path / f"{job}_out.npz"
    np.savez(src, **inputs)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # never reach for hub kernels
    proc = subprocess.run(
        [hf_python(), str(HERE / script), job, str(src), str(dst), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise RuntimeError(f"{script} {job} failed with exit code {proc.returncode}")
    return dict(np.load(dst))
