#!/usr/bin/env bash
# GPU check of `polar train` on a ~0.5B-class Qwen3 built locally in bf16 (no download): LoRA and
# full fine-tuning at lr 1e-6 with bf16 autocast over fp32 master weights; first-step ratios within
# 1e-3 of 1, weights that move, and a checkpoint equal to the trained policy. See bench/gpu_check.py.
#
#   bench/gpu_check.sh            # on a CUDA device (a few minutes on one GPU)
#   bench/gpu_check.sh --cpu      # the same checks on the tiny shape, on the CPU (checks the script)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python bench/gpu_check.py "$@"
