#!/usr/bin/env bash
# Creates the Python 3.11 side venv (CPU torch + transformers) that the HF parity tests call to
# regenerate their reference outputs. Usage: bash tests/hf_reference/setup_venv.sh [VENV_DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${1:-$here/../../.venv311}
py=${HF_REF_BASE_PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3
"$py" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || { echo "setup_venv.sh: need Python 3.11 for the CPU torch wheel (set HF_REF_BASE_PYTHON)"; exit 1; }
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check -r "$here/requirements.txt"
"$venv/bin/python" -c 'import torch, transformers; print("hf reference venv:", torch.__version__, transformers.__version__)'
