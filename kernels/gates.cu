// A gated delta net's gates in one pass (gdn_gating): the write strength beta = sigmoid(br) and the forget gate
// decay = -exp(al[h]) * softplus(ar + dt[h]) (decay.cu's softplus), h = i % heads.
extern "C" __global__ void gates(const float* br, const float* ar, const float* dt, const float* al, float* beta,
                                 float* dec, i64 n, i64 heads) { PDL_ENTER();
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 h = i % heads;
        beta[i] = 1.f / (1.f + expf(-br[i]));
        dec[i] = -expf(al[h]) * softplus(ar[i] + dt[h]);
    }
}
