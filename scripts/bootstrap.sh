#!/usr/bin/env bash
# Create .venv/ from the lock file (uv.lock): the same torch/torchvision pair everywhere.
# Run by main_job.sh and test.sh (bash scripts/bootstrap.sh); safe to run again (uv only installs what changed).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

# uv installs the locked environment in seconds and, unlike pip, ignores a machine-wide pip
# configuration that prefers a CPU-only torch wheel (which cannot import PyPI's torchvision).
source scripts/find_uv.sh
echo "bootstrap: syncing .venv from uv.lock" >&2
"${uv_cmd[@]}" sync --frozen --quiet
echo "bootstrap: $(.venv/bin/python -c 'import torch, torchvision; print(f"torch {torch.__version__}, torchvision {torchvision.__version__}, CUDA available: {torch.cuda.is_available()}")')" >&2
