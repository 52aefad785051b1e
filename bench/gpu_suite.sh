#!/usr/bin/env bash
# The GPU suite. Three steps:
#   bench/gpu_suite.sh prepare PLANDIR        on a CPU machine with the engine (egglog): plans saved to PLANDIR, its
#                                             size printed (all of it travels to the GPU machine: at most 40 MB), and
#                                             the kernels' cubins for sm_90 (nvcc; PLANDIR/cubins, xz)
#   bench/gpu_suite.sh run PLANDIR OUTDIR     on a bare GPU machine (python3 with CuPy, numpy, pytest; no egglog, no
#                                             highspy, no gguf, no network): pytest -m gpu, the decode figures and
#                                             the batch curve, in at most 6 minutes; logs and summary.txt in OUTDIR
#   bench/gpu_suite.sh peer OUTDIR            transformers on the same device (eager, static cache): a second call
# PYTHON (default python3) names the interpreter; TESTS_S / BENCH_S / PREFILL_S (default 240 / 100 / 150) the seconds
# each part may take.
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-python3}"
cmd="${1:-}"
case "$cmd" in
  prepare)
    plans="${2:?usage: gpu_suite.sh prepare PLANDIR}"
    "$py" "$here/bench/gpu_prepare.py" "$plans" || exit $?
    # the launch model's prediction for each Qwen3-8B plan (needs nvcc here; bench/gpu_decode.py prints it beside
    # the device's figures)
    (cd "$here/bench" && "$py" launch_model.py --predict-plans "$plans") || echo "no launch-model predictions"
    # the tensor-core prefill plans (Qwen3-8B shape, 512 and 2048 rows, knob tc_rows=16) and bench/gemm_model.py's
    # PREDICTIONS for them (PLANDIR/gemm-model.json)
    "$py" "$here/bench/gpu_prefill.py" prepare "$plans" || echo "no prefill plans"
    # every kernel module compiled ahead of time for sm_90 (nvcc here), xz-compressed into PLANDIR/cubins: the GPU
    # machine would compile each in every process at its first launch, the chain module ~7 minutes of ptxas alone
    "$py" "$here/bench/gpu_cubins.py" pack "$plans" || echo "no prebuilt kernels: the GPU machine compiles them (minutes)"
    echo "to travel: $(du -sh "$plans" | cut -f1) in $plans (the GPU machine takes 64 MiB with the repository)"
    ;;
  run)
    plans="$(cd "${2:?usage: gpu_suite.sh run PLANDIR OUTDIR}" && pwd)"
    out="${3:?usage: gpu_suite.sh run PLANDIR OUTDIR}"
    mkdir -p "$out"
    out="$(cd "$out" && pwd)"
    t0=$(date +%s)
    # lanefuse without installing it: the four folders under one namespace, by symlinks
    ns="$(mktemp -d)"
    mkdir -p "$ns/lanefuse"
    for d in engine lane kernels rules; do ln -s "$here/$d" "$ns/lanefuse/$d"; done
    export PYTHONPATH="$ns${PYTHONPATH:+:$PYTHONPATH}"
    export LANEFUSE_PLANS="$plans"
    # the kernels built ahead of time (prepare), unpacked: every process loads them instead of compiling
    if "$py" "$here/bench/gpu_cubins.py" unpack "$plans" "$ns/cubins" > "$out/cubins.txt" 2>&1; then
      export LANEFUSE_CUBINS="$ns/cubins"
    fi
    cd "$here"
    nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
    {
      echo "commit $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo '?')  $(date -u '+%Y-%m-%d %H:%M UTC')"
      "$py" -c "import sys, numpy, cupy; d = cupy.cuda.runtime.getDeviceProperties(0)
print('python', sys.version.split()[0], 'numpy', numpy.__version__, 'cupy', cupy.__version__, '|',
      d['name'].decode(), d['multiProcessorCount'], 'SMs')" 2>&1 | tail -1
      echo "PLANDIR $(du -sh "$plans" | cut -f1); LANEFUSE_CUBINS ${LANEFUSE_CUBINS:-unset}: $(cat "$out/cubins.txt")"
    } > "$out/env.txt"
    # pytest-xdist and pytest-timeout where installed
    xdist=(); tmo=()
    "$py" -c "import xdist" 2>/dev/null && xdist=(-n 8)
    "$py" -c "import pytest_timeout" 2>/dev/null && tmo=(--timeout 120)
    tests_s="${TESTS_S:-240}"; bench_s="${BENCH_S:-100}"
    timeout -k 10 "$tests_s" "$py" -m pytest tests -m gpu -p no:cacheprovider -o addopts= -v -rfEs "${xdist[@]}" "${tmo[@]}" \
      --junitxml "$out/pytest-gpu.xml" > "$out/pytest-gpu.log" 2>&1
    echo $? > "$out/pytest.rc"
    t1=$(date +%s)
    # the decode figures and the batch curve: 3 rounds of 20 steps a figure (the median), so both fit the time
    timeout -k 10 "$bench_s" "$py" bench/gpu_decode.py --plans "$plans" --iters 20 --rounds 3 \
      --json "$out/gpu_decode.json" > "$out/gpu_decode.log" 2>&1
    echo $? > "$out/gpu_decode.rc"
    # the prefill figures (issue 35): 512 and 2048 tokens on the tensor cores, transformers eager and sdpa beside
    timeout -k 10 "${PREFILL_S:-150}" "$py" bench/gpu_prefill.py run --plans "$plans" --iters 5 --peer-s 60 \
      --json "$out/gpu_prefill.json" > "$out/gpu_prefill.log" 2>&1
    echo $? > "$out/gpu_prefill.rc"
    # the peer on the same device: transformers eager and with its static cache (HF_S seconds each; default 0: a
    # device command runs at most 600 s, so `gpu_suite.sh peer OUTDIR` runs them as a second call)
    hf_s="${HF_S:-0}"
    if [ "$hf_s" -gt 0 ]; then
      for mode in eager static; do
        timeout -k 10 "$hf_s" "$py" bench/peer_hf.py "$mode" "$out/peer-hf-$mode.json" > "$out/peer-hf-$mode.log" 2>&1
      done
    fi
    t2=$(date +%s)
    echo "$((t1 - t0)) $((t2 - t1))" > "$out/seconds.txt"
    "$py" - "$out" <<'EOF' > "$out/summary.txt" 2>&1
import collections, os, re, sys
import xml.etree.ElementTree as ET

out = sys.argv[1]
read = lambda n: open(os.path.join(out, n)).read() if os.path.exists(os.path.join(out, n)) else ""
rc = lambda n: {"124": "124 (timed out)", "137": "137 (killed at the time limit)"}.get(read(n).strip(), read(n).strip())
t_tests, t_bench = (read("seconds.txt").split() + ["?", "?"])[:2]
print("GPU suite:", read("env.txt").strip().replace("\n", " | "))
log = read("pytest-gpu.log").strip().splitlines()
tail = next((l for l in reversed(log) if re.search(r"passed|failed|error|no tests", l)), log[-1] if log else "no log")
print(f"pytest -m gpu: exit {rc('pytest.rc')}, {t_tests} s: {tail.strip('= ')}")
failed = collections.Counter()
first = {}
try:
    root = ET.parse(os.path.join(out, "pytest-gpu.xml")).getroot()
    s = root if root.tag == "testsuite" else root.find("testsuite")
    n, f, e, k = (int(s.get(a, 0)) for a in ("tests", "failures", "errors", "skipped"))
    print(f"  {n} tests: {n - f - e - k} passed, {f} failed, {e} errors, {k} skipped")
    for case in root.iter("testcase"):
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is not None:
            key = case.get("classname", "").split(".")[-1] + "::" + case.get("name", "").split("[")[0]
            failed[key] += 1
            first.setdefault(key, (case.get("name"), " ".join((bad.get("message") or "").split())[:90]))
except (OSError, ET.ParseError):  # stopped at the time limit: the verbose log's lines so far
    seen = collections.Counter()
    for l in log:
        m = re.search(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (tests/\S+)", l) or \
            re.search(r"(tests/\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", l)
        if m:
            word, test = (m.group(1), m.group(2)) if m.group(1).isupper() else (m.group(2), m.group(1))
            seen[word] += 1
            if word in ("FAILED", "ERROR"):
                key = test.split("[")[0].rsplit("/", 1)[-1].replace(".py", "")
                failed[key] += 1
                first.setdefault(key, (test, ""))
    print("  (no junit xml: stopped before the end) so far: " + ", ".join(f"{n} {w.lower()}" for w, n in seen.items()))
for key, n in failed.most_common(14):
    print(f"  {n:4d} x {key}  e.g. [{first[key][0].split('[', 1)[-1][:30]}: {first[key][1]}")
if len(failed) > 14:
    print(f"  ... and {len(failed) - 14} more failing tests (pytest-gpu.log)")
print(f"gpu_decode (20 steps x 3 rounds a figure) and the transformers peer: exit {rc('gpu_decode.rc')}, {t_bench} s")
for mode in ("eager", "static"):
    got = [l for l in read(f"peer-hf-{mode}.log").splitlines() if "µs/token" in l]
    print(f"  transformers {mode}: " + (got[-1] if got else "no figure (peer-hf-%s.log)" % mode))
print(f"gpu_prefill (tensor-core prefill, transformers beside): exit {rc('gpu_prefill.rc')}")
for l in read("gpu_prefill.log").splitlines():
    if l.startswith("prefill") or "Error" in l:
        print("  " + re.sub(r"\s+", " ", l)[:150])
for l in read("gpu_decode.log").splitlines():
    if l.startswith(("device-to-device", "qwen3-8b batch")) or " graph on " in l or " · lane " in l or \
            "launch model" in l or "per kind" in l:
        print("  " + re.sub(r"\s+", " ", l)[:150])
    elif "Error" in l or "Traceback" in l:
        print("  " + l[:150])
EOF
    cat "$out/summary.txt"
    ;;
  peer)
    # transformers on the same device (bench/peer_hf.py), eager and static cache, HF_S (default 200) seconds each
    out="${2:?usage: gpu_suite.sh peer OUTDIR}"
    mkdir -p "$out"
    for mode in eager static; do
      timeout -k 10 "${HF_S:-200}" "$py" "$here/bench/peer_hf.py" "$mode" "$out/peer-hf-$mode.json" \
        > "$out/peer-hf-$mode.log" 2>&1
      echo "transformers $mode: $(grep 'µs/token' "$out/peer-hf-$mode.log" | tail -1 || echo "no figure")"
    done
    ;;
  *)
    sed -n 2,10p "$0"
    exit 2
    ;;
esac
