"""The instructions a thread spends decoding one value of block-format rows to bf16, counted in the PTX nvcc makes for
sm_90 (no device; this machine has no cuobjdump, so PTX, not SASS: ptxas may fuse or drop some, an upper-bound proxy)
— what bench/gemm_model.py's DECODE_PTX assumes of the two ways a prefill product decodes its rows:

- `any`: gemm_tc_any's tc_load_w (gemm_tc.cu) for a block format: a thread's 16 values a k step, a value at a time by
  tc_get (its block's scales decoded again for each value), each pair rounded (bf16x2), bounds checked;
- `vec`: gemm_tc_dequant (kernels/gemm_deq.py): a thread's 8 values by two qget4 (a block's scales once for four),
  rounded, one 16-byte store.

Each probe kernel is the same code with the format a constant; the count is its PTX instructions less an empty probe's
(the index arithmetic and stores), over the values it decodes.

    python bench/decode_ptx.py [--nvcc PATH]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile

FORMATS = {"q8_0": 3, "q4_0": 4, "q4_k": 5, "q6_k": 6, "mxfp4": 7}


def probes() -> str:
    out = []
    for fmt, code in [*FORMATS.items(), ("none", -1)]:
        pair = ("v[q] = (unsigned)c;" if code < 0 else
                f"v[q] = bf16x2(row && c < k ? tc_get({code}, w, r * k + c) : 0.f, "
                f"row && c + 1 < k ? tc_get({code}, w, r * k + c + 1) : 0.f);")
        out.append(f'''
extern "C" __global__ void probe_any_{fmt}(const void* w, uint4* out, i64 n, i64 k, i64 k0) {{
    i64 r = blockIdx.x * 128 + (threadIdx.x >> 1), c0 = k0 + (threadIdx.x & 1) * 16;
    bool row = r < n;
    unsigned v[8];
#pragma unroll
    for (int q = 0; q < 8; q++) {{ i64 c = c0 + 2 * q; {pair} }}
    out[2 * threadIdx.x] = make_uint4(v[0], v[1], v[2], v[3]);
    out[2 * threadIdx.x + 1] = make_uint4(v[4], v[5], v[6], v[7]);
}}''')
        four = (f"float4 a = qget4({code}, w, i), b = qget4({code}, w, i + 4);" if code >= 0 else
                "float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;")
        out.append(f'''
extern "C" __global__ void probe_vec_{fmt}(const void* w, unsigned char* wb, i64 count) {{
    i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) << 3;
    if (i >= count) return;
    {four}
    *(uint4*)((u16*)wb + i) = make_uint4(bf16x2(a.x, a.y), bf16x2(a.z, a.w), bf16x2(b.x, b.y), bf16x2(b.z, b.w));
}}''')
    return "\n".join(out)


def counts(ptx: str) -> dict[str, int]:
    got = {}
    for m in re.finditer(r"\.entry (probe_\w+)\((.*?)\n\}", ptx, re.S):
        got[m.group(1)] = sum(1 for line in m.group(2).split("\n")
                              if re.match(r"\s+(@!?%p\d+\s+)?[a-z]", line)
                              and not line.strip().startswith((".reg", ".param", ".loc", ".local", ".shared")))
    return got


def main() -> None:
    from lanefuse.kernels.compile import source

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda-13.0/bin/nvcc")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        cu, ptx = os.path.join(d, "probe.cu"), os.path.join(d, "probe.ptx")
        with open(cu, "w") as f:
            f.write(source(("gemm_tc",)) + probes())
        subprocess.run([args.nvcc, "-ptx", "-arch=sm_90", "-std=c++17", "-o", ptx, cu], check=True,
                       capture_output=True)
        c = counts(open(ptx).read())
    print("PTX instructions a value (nvcc sm_90; an upper-bound proxy of the SASS issued)")
    for fmt in FORMATS:
        anyv = (c[f"probe_any_{fmt}"] - c["probe_any_none"]) / 16
        vec = (c[f"probe_vec_{fmt}"] - c["probe_vec_none"]) / 8
        print(f"  {fmt:6s} any (tc_load_w, a value at a time) {anyv:5.1f}   vec (gemm_tc_dequant, qget4) {vec:5.1f}")


if __name__ == "__main__":
    main()
