#!/usr/bin/env bash
# One prepared run of every check that needs a CUDA GPU: the gpu-marked tests, where TrainLoop synchronises the
# host with the GPU, and the mixed-precision modes on a ViT large enough for the GPU's work to dominate.
# Run from the repository root on a machine with a GPU; writes its logs into $OUT (default: ./gpu_session_out).
# Each step has its own time limit, so one slow step cannot take the others' time.
set -u
OUT="${OUT:-gpu_session_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
  python -c "import pytest; print('pytest', pytest.__version__)"
} > "$OUT/env.txt" 2>&1
GPU_TEST_FILES=$(grep -rl "pytest.mark.gpu\|mark\.gpu" tests --include='test_*.py' | sort)
timeout "${GPU_TESTS_S:-240}" python -m pytest -m gpu -q -p no:cacheprovider -rs $GPU_TEST_FILES \
  > "$OUT/gpu_tests.txt" 2>&1; echo "exit $?" >> "$OUT/gpu_tests.txt"
timeout "${SYNCS_S:-90}" python benchmarks/cuda_syncs.py > "$OUT/cuda_syncs.txt" 2>&1; echo "exit $?" >> "$OUT/cuda_syncs.txt"
# The same with ThroughputMonitor on: it must add no host synchronisation per batch (issue 24).
timeout "${SYNCS_S:-90}" python benchmarks/cuda_syncs.py --monitor > "$OUT/cuda_syncs_monitor.txt" 2>&1
echo "exit $?" >> "$OUT/cuda_syncs_monitor.txt"
timeout "${AMP_S:-180}" python benchmarks/amp_modes.py --model vit --iters 100 --warmup 10 --repeats 3 \
  --batch-size 256 --dim 384 --depth 6 --heads 6 --threads 4 > "$OUT/amp_modes_vit_large.txt" 2>&1
echo "exit $?" >> "$OUT/amp_modes_vit_large.txt"
