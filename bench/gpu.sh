#!/usr/bin/env bash
# On the H200 (the device tool's run, carry [".whl"]; bench/README.md "GPU (H200)"): installs the
# wheels bench/gpu_wheels.sh put in .whl/ (the device README's way, into /tmp/site) and the project
# itself (--no-deps, no build isolation: nothing can be fetched there), then runs every row of
# bench/gpu.py. Arguments go to bench/gpu.py (--budget, --rows).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
  || { echo "pip install -e . failed: the rows import the framework from this tree"; export PYTHONPATH=/tmp/site:$PWD; }
# what the rows will import (a failure here fails only the rows that need it)
python3 -c 'import torch, transformers, hydra, framework; print("torch", torch.__version__, "transformers",
transformers.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name())' || true
python3 -c 'import trl, datasets; print("trl", trl.__version__, "datasets", datasets.__version__)' || true
exec python3 bench/gpu.py "$@"
