// table rows row0.. = src's `count` rows (row0 = *rowp when set, else `row`); rows past the table are not written.
// A batch (slot > 0): src row s (s from seq0, `count` of them) lands in table row s * slot + rowp[s], its sequence's
// slot at its position.
extern "C" __global__ void set_row(float* table, const int* rowp, i64 row, const float* src, i64 cols, i64 count,
                                   i64 len, i64 slot, i64 seq0) { PDL_ENTER();
    i64 r0 = rowp ? (i64)rowp[0] : row, n = count * cols;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        if (slot > 0) {
            i64 s = seq0 + i / cols, r = s * slot + (i64)rowp[s];
            if (r < len) table[r * cols + i % cols] = src[s * cols + i % cols];
        } else if (r0 + i / cols < len) {
            table[r0 * cols + i] = src[i];
        }
    }
}

// The same with the table's quantized form (row_write_quant; quant.cu's blocks of 32, a warp a block, rows of whole
// blocks): lane i of block b takes value i of the table's block b — from src where the block's row is one written
// (row0.. under one sequence; a batch's row s * slot + rowp[s] of each sequence s from seq0), storing it into the
// table, else the table's own — and quantizes the block from the values the table holds after the write.
extern "C" __global__ void set_row_quant(float* table, const int* rowp, i64 row, const float* src, i64 cols,
                                         i64 count, i64 len, i64 slot, i64 seq0, signed char* qw, signed char* ql,
                                         float* qs, i64 words) { PDL_ENTER();
    int lane = threadIdx.x & 31;
    i64 b = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b * 32 >= len * cols) return;  // a whole warp: the block's lanes stay together for quant_block's shuffles
    i64 e = b * 32 + lane, r = e / cols, c = e % cols, from = -1;
    if (slot > 0) {
        i64 s = r / slot;
        if (s >= seq0 && s < seq0 + count && r == s * slot + (i64)rowp[s]) from = s * cols + c;
    } else {
        i64 r0 = rowp ? (i64)rowp[0] : row;
        if (r >= r0 && r < r0 + count) from = (r - r0) * cols + c;
    }
    float v = from >= 0 ? src[from] : table[e];
    if (from >= 0) table[e] = v;
    quant_block(v, qw, words == 2 ? ql : nullptr, qs, b, lane);
}
