#!/usr/bin/env bash
# Install parallelisms (editable) with an optional extra: `bash scripts/install.sh` or `bash scripts/install.sh test`.
# Where no torch is installed, take torch 2.13.0 (a CPU build on this kind of machine); a torch that is already
# there (a GPU user's CUDA build, say) is kept: the package itself accepts torch >= 2.4.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".${1:+[$1]}"
