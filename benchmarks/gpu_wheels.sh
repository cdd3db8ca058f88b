#!/usr/bin/env bash
# The wheels the GPU machine's Python lacks (it has jax, flax, optax, orbax, transformers,
# torch, pyarrow, ... but not Hydra's stack), downloaded here, where the package registry is
# reachable, for Python 3.12 on x86-64, into a folder git ignores (default .whl/):
#
#     bash benchmarks/gpu_wheels.sh [DIR]
#
# Then carry DIR to the GPU machine and run `bash benchmarks/gpu_suite.sh OUT --wheels DIR`.
set -euo pipefail
dest="${1:-.whl}"
py="${PYTHON:-python3}"
mkdir -p "$dest"
rm -f "$dest"/*.whl  # one version of each: two would stop the install there
# Pure-Python wheels, pinned to what pyproject.toml accepts.
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_17_x86_64 --platform any -d "$dest" \
  "omegaconf==2.3.1" "hydra-core==1.3.8" "tensorboardX==2.6.4"
# Omegaconf's and Hydra's parser runtime is published as a source archive only: build its
# (pure-Python) wheel here.
"$py" -m pip wheel -q --no-deps -w "$dest" "antlr4-python3-runtime==4.9.3"
ls -1 "$dest"
