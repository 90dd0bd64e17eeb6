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
#include <omp.h>

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
                                                           int64_t rows, int64_t out_f, int bf16) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < out_f; o += VL)
            store_n(out, r * out_stride + o,
                    rounded(load_n(out, r * out_stride + o, out_f - o, bf16) + load_n(delta, r * out_f + o, out_f - o, 0),
                            bf16),
                    out_f - o, bf16);
}

/* rows [start, start + n) of one slot: x A^T, then times B^T (fp32), added to out; on this thread */
static inline __attribute__((always_inline)) void update_run(
        const void* x, int64_t x_stride, void* out, int64_t out_stride, int64_t start, int64_t n, const void* a,
        const void* b, int64_t k, int64_t in, int64_t out_f, int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    void* shrunk = thread_scratch(&shrunk_scratch, &shrunk_bytes, n * k * size);
    float* delta = thread_scratch(&delta_scratch, &delta_bytes, n * out_f * 4);
    const char* xs = (const char*)x + start * x_stride * size;
    if (bf16) {
        row_gemm_bf16((const uint16_t*)xs, x_stride, a, NULL, shrunk, k, n, k, in, 1);
        row_gemm_bf16_f32(shrunk, k, b, NULL, delta, out_f, n, out_f, k, 1);
    } else {
        row_gemm_f32((const float*)xs, x_stride, a, NULL, shrunk, k, n, k, in, 1);
        row_gemm_f32(shrunk, k, b, NULL, delta, out_f, n, out_f, k, 1);
    }
    add_rows((char*)out + start * out_stride * size, out_stride, delta, n, out_f, bf16);
}

/* The rows with an adapter are shared out evenly among the threads, each taking a contiguous part
 * and its runs (or pieces of runs) through the row kernel on one thread: one parallel region a call
 * instead of three a run (the row kernel's own, which at 8 adapters x 4 projections x 30 layers a
 * step cost more in synchronisation than in arithmetic on 2 threads). Where a run is cut makes no
 * difference to its rows' bits: the row kernel computes each row alone. */
static inline __attribute__((always_inline)) void lora_update(
        const void* x, int64_t x_stride, void* out, int64_t out_stride, const int64_t* slots, int64_t rows,
        const int64_t* a_packed, const int64_t* b_packed, const int64_t* widths, int64_t in, int64_t out_f,
        int num_threads, int bf16) {
    int64_t adapted = 0;
    for (int64_t r = 0; r < rows; r++) adapted += slots[r] >= 0 && widths[slots[r]] > 0;
    if (adapted == 0) return;
    #pragma omp parallel num_threads(num_threads)
    {
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = adapted * thread / threads, last = adapted * (thread + 1) / threads;
        int64_t seen = 0;  /* rows with an adapter before r */
        for (int64_t r = 0; r < rows && seen < last;) {
            const int64_t slot = slots[r];
            int64_t end = r + 1;
            while (end < rows && slots[end] == slot) end++;
            if (slot >= 0 && widths[slot] > 0) {
                /* this run holds adapted rows [seen, seen + end - r): take its part in [first, last) */
                const int64_t from = first > seen ? first - seen : 0;
                const int64_t to = (last < seen + end - r ? last : seen + end - r) - seen;
                if (to > from)
                    update_run(x, x_stride, out, out_stride, r + from, to - from, (const void*)a_packed[slot],
                               (const void*)b_packed[slot], widths[slot], in, out_f, bf16);
                seen += end - r;
            }
            r = end;
        }
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
