#!/usr/bin/env bash
# Run here, before bench/gpu.sh runs on the H200 (whose registry is out of reach): fills the ignored
# .whl/ with the wheels of what the framework and bench/gpu.py's rows need that the device's image
# lacks (KINDS.md's package list), for its Python 3.12 on x86-64, one version of each, and writes
# the commit measured to .whl/COMMIT (no .git travels). The data and the random models are made
# on the device by bench/gpu.py itself, with the tokenizer its model directories hold.
#
#   bench/gpu_wheels.sh            # then the device tool's run, carry [".whl"] (bench/README.md)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
# Requires-Dist of each, checked against the image: hydra-core -> omegaconf, antlr4 4.9.*, packaging;
# omegaconf -> antlr4, PyYAML; torchdata -> urllib3, requests, torch; trl -> accelerate, datasets,
# huggingface_hub, jinja2, numpy, packaging, pandas, psutil, pyarrow, pyyaml, transformers;
# datasets -> dill, multiprocess, filelock, numpy, pyarrow, pandas, tqdm, xxhash, fsspec,
# huggingface-hub, packaging, pyyaml; multiprocess -> dill. Only these are missing there:
WHEELS=(hydra-core==1.3.8 omegaconf==2.3.1 torchdata==0.11.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1
        multiprocess==0.70.19)
rm -rf .whl
mkdir -p .whl
grep -qxF '/.whl/' .gitignore || echo '/.whl/' >>.gitignore
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
# antlr4-python3-runtime 4.9.3 (Hydra's parser pins 4.9) is published as an sdist only: built here
# (pure Python, so the wheel is py3-none-any)
"$PYTHON" -m pip wheel -q --no-deps --no-cache-dir -w .whl antlr4-python3-runtime==4.9.3
echo "$(git rev-parse --short HEAD)$(git status --porcelain --untracked-files=no | grep -q . \
  && echo ' (with uncommitted changes)')" >.whl/COMMIT
for wheel in .whl/*.whl; do
  unzip -p "$wheel" '*/METADATA' | { grep '^Requires-Dist' || true; } | { grep -v 'extra ==' || true; } \
    | sed "s|^|$(basename "$wheel"): |"
done
ls -la .whl
du -sh .whl
