/* Each row's LoRA update, from its own adapter's slot: out[r] += (x[r] A[s]^T) B[s]^T, s = slots[r].
 *
 * The adapters' low-rank products are small (a rank-16 A is 16 dot products a row), so through
 * PyTorch a decode step's cost was their dispatch (two matmuls per adapter per projection, ~20-30 us
 * each in bf16) and a step with adapter rows could not take the native decode path. Here one call
 * does a projection's update for every row, and decode_layers.c calls the same code, so both paths
 * give the same bits. Each run of consecutive rows with the same slot (the model runner orders rows
 * by adapter) goes through the row kernel (row_gemm.c: AMX or AVX512-BF16 in bf16, AVX-512 FMAs in
 * fp32) twice: x A^T, then that times B^T with fp32 results, added to out and rounded once. The row
 * kernel computes each row on its own, so a row's update does not depend on the other rows.
 *
 * Per slot: A packed for the row kernel as a [k, in] weight and B as an [out, k] weight, where k is
 * the adapter's width (rank x the HF modules fused into this projection), in bf16 rounded up to
 * whole 32-wide tiles with zero rows of A and zero columns of B (engine/lora/slots.py packs them);
 * widths[slot] is that k (0: the adapter leaves this projection alone). In bf16 the rank-sized
 * intermediate is rounded to bf16, as PEFT's bf16 lora_A output is.
 */
#include "simd.h"

void row_gemm_bf16(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t,
                   int64_t, int);
void row_gemm_bf16_f32(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, float*, int64_t, int64_t,
                       int64_t, int64_t, int);
void row_gemm_f32(const float*, int64_t, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                  int);

static __thread void* shrunk_scratch;
static __thread int64_t shrunk_bytes;
static __thread void* delta_scratch;
static __thread int64_t delta_bytes;

/* out[rows, out_f] (row stride out_stride) = round(out + delta) */
static inline __attribute__((always_inline)) void add_rows(void* out, int64_t out_stride, const float* delta,
                                                           int64_t rows, int64_t out_f, int num_threads, int bf16) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < out_f; o += VL)
            store_n(out, r * out_stride + o,
                    rounded(load_n(out, r * out_stride + o, out_f - o, bf16) + load_n(delta, r * out_f + o, out_f - o, 0),
                            bf16),
                    out_f - o, bf16);
}

static inline __attribute__((always_inline)) void lora_update(
        const void* x, int64_t x_stride, void* out, int64_t out_stride, const int64_t* slots, int64_t rows,
        const int64_t* a_packed, const int64_t* b_packed, const int64_t* widths, int64_t in, int64_t out_f,
        int num_threads, int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    int64_t widest = 0;
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] >= 0 && widths[slots[r]] > widest) widest = widths[slots[r]];
    if (widest == 0) return;
    void* shrunk = thread_scratch(&shrunk_scratch, &shrunk_bytes, rows * widest * size);
    float* delta = thread_scratch(&delta_scratch, &delta_bytes, rows * out_f * 4);
    for (int64_t start = 0; start < rows;) {
        const int64_t slot = slots[start];
        int64_t end = start + 1;
        while (end < rows && slots[end] == slot) end++;
        const int64_t n = end - start, k = slot >= 0 ? widths[slot] : 0;
        if (k > 0) {
            const char* xs = (const char*)x + start * x_stride * size;
            char* outs = (char*)out + start * out_stride * size;
            if (bf16) {
                row_gemm_bf16(xs, x_stride, (const uint16_t*)a_packed[slot], NULL, shrunk, k, n, k, in, num_threads);
                row_gemm_bf16_f32(shrunk, k, (const uint16_t*)b_packed[slot], NULL, delta, out_f, n, out_f, k,
                                  num_threads);
            } else {
                row_gemm_f32((const float*)xs, x_stride, (const float*)a_packed[slot], NULL, shrunk, k, n, k, in,
                             num_threads);
                row_gemm_f32(shrunk, k, (const float*)b_packed[slot], NULL, delta, out_f, n, out_f, k, num_threads);
            }
            add_rows(outs, out_stride, delta, n, out_f, num_threads, bf16);
        }
        start = end;
    }
}

void lora_update_bf16(const uint16_t* x, int64_t x_stride, uint16_t* out, int64_t out_stride, const int64_t* slots,
                      int64_t rows, const int64_t* a_packed, const int64_t* b_packed, const int64_t* widths,
                      int64_t in, int64_t out_f, int num_threads) {
    lora_update(x, x_stride, out, out_stride, slots, rows, a_packed, b_packed, widths, in, out_f, num_threads, 1);
}

void lora_update_f32(const float* x, int64_t x_stride, float* out, int64_t out_stride, const int64_t* slots,
                     int64_t rows, const int64_t* a_packed, const int64_t* b_packed, const int64_t* widths,
                     int64_t in, int64_t out_f, int num_threads) {
    lora_update(x, x_stride, out, out_stride, slots, rows, a_packed, b_packed, widths, in, out_f, num_threads, 0);
}
