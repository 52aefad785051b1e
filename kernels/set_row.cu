// table rows row0.. = src's `count` rows (row0 = *rowp when set, else `row`); rows past the table are not written.
// A batch (slot > 0): src row s (s from seq0, `count` of them) lands in table row s * slot + rowp[s], its sequence's
// slot at its position.
extern "C" __global__ void set_row(float* table, const int* rowp, i64 row, const float* src, i64 cols, i64 count,
                                   i64 len, i64 slot, i64 seq0) {
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
