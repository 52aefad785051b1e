#!/usr/bin/env bash
# The GPU suite. Two steps:
#   bench/gpu_suite.sh prepare PLANDIR        on a CPU machine with the engine (egglog): plans saved to PLANDIR
#   bench/gpu_suite.sh run PLANDIR OUTDIR     on the GPU machine (CuPy, numpy, pytest; no egglog, no network):
#                                             pytest -m gpu and the GPU benchmark, logs and figures into OUTDIR
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cmd="${1:-}"
case "$cmd" in
  prepare)
    plans="${2:?usage: gpu_suite.sh prepare PLANDIR}"
    python "$here/bench/gpu_prepare.py" "$plans"
    ;;
  run)
    plans="$(cd "${2:?usage: gpu_suite.sh run PLANDIR OUTDIR}" && pwd)"
    out="${3:?usage: gpu_suite.sh run PLANDIR OUTDIR}"
    mkdir -p "$out"
    out="$(cd "$out" && pwd)"
    # lanefuse without installing it: the four folders under one namespace, by symlinks
    ns="$(mktemp -d)"
    mkdir -p "$ns/lanefuse"
    for d in engine lane kernels rules; do ln -s "$here/$d" "$ns/lanefuse/$d"; done
    export PYTHONPATH="$ns${PYTHONPATH:+:$PYTHONPATH}"
    export LANEFUSE_PLANS="$plans"
    nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
    python -c "import cupy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())" \
      > "$out/env.txt" 2>&1
    cd "$here"
    python -m pytest tests -m gpu -p no:cacheprovider -q -rs > "$out/pytest-gpu.log" 2>&1
    echo "pytest -m gpu: exit $?" | tee -a "$out/summary.txt"
    tail -3 "$out/pytest-gpu.log" | tee -a "$out/summary.txt"
    python bench/gpu_decode.py --plans "$plans" --json "$out/gpu_decode.json" > "$out/gpu_decode.log" 2>&1
    echo "gpu_decode: exit $?" | tee -a "$out/summary.txt"
    tail -20 "$out/gpu_decode.log" | tee -a "$out/summary.txt"
    ;;
  *)
    sed -n 2,6p "$0"
    exit 2
    ;;
esac
