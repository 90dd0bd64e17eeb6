/* Element-wise ops of a decoder layer (bf16 and fp32), one pass each, rounding where transformers
 * rounds.
 *
 * In PyTorch each of these is several ops (in bf16 an fp32 copy, the op, a rounding copy, a scale;
 * in fp32 F.rms_norm alone is five), each its own pass over memory and its own dispatch; a decode
 * step runs hundreds of them. Here each is one loop, parallel over rows, computing in fp32 and (for
 * bf16) rounding exactly where the transformers formulas round (after every bf16 tensor op), so
 * results match them except where an fp32 intermediate differs in its last place (a different
 * summation order, exp within 2 ulp). Each kernel is written once over `bf16` (a compile-time
 * constant in the two exported wrappers, so each specialises to straight-line code).
 */
#include "simd.h"

/* residual += x (when residual is given), then out = weight * normalize(residual): transformers'
 * `hidden + residual`, then LlamaRMSNorm (normalize in fp32, round to the dtype, scale). */
/* One vector of `hidden` values at x[at...]: residual[at...] += x (when residual is given), then
 * out[at...] = weight * normalize(residual): transformers' `hidden + residual`, then LlamaRMSNorm
 * (normalize in fp32, round to the dtype, scale). out may be x (in place). */
static inline __attribute__((always_inline)) void rms_norm_vector(
        const void* x, void* residual, const void* weight, void* out, int64_t at, int64_t hidden, float eps,
        int bf16) {
    vf squares = splat(0.0f);
    for (int64_t i = 0; i < hidden; i += VL) {
        vf value = load_n(x, at + i, hidden - i, bf16);
        if (residual) {
            value = rounded(value + load_n(residual, at + i, hidden - i, bf16), bf16);
            store_n(residual, at + i, value, hidden - i, bf16);
        }
        squares += value * value;
    }
    const void* src = residual ? residual : x;
    const float inverse = 1.0f / sqrtf(hsum(squares) / (float)hidden + eps);
    for (int64_t i = 0; i < hidden; i += VL) {
        const vf normalized = rounded(load_n(src, at + i, hidden - i, bf16) * inverse, bf16);
        store_n(out, at + i, normalized * load_n(weight, i, hidden - i, bf16), hidden - i, bf16);
    }
}

static inline __attribute__((always_inline)) void add_rms_norm(
        const void* x, void* residual, const void* weight, void* out, int64_t rows, int64_t hidden,
        float eps, int num_threads, int bf16) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) rms_norm_vector(x, residual, weight, out, r * hidden, hidden, eps, bf16);
}

/* Qwen3's q/k norm: each head of each token normalised on its own, in place, in the rows of a fused
 * QKV output (row_stride apart): the bits RMSNorm over [tokens, heads, dim] gives. */
static inline __attribute__((always_inline)) void heads_rms_norm(
        void* x, const void* weight, int64_t tokens, int64_t heads, int64_t row_stride, int64_t dim, float eps,
        int num_threads, int bf16) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < tokens * heads; i++)
        rms_norm_vector(x, NULL, weight, x, i / heads * row_stride + i % heads * dim, dim, eps, bf16);
}

/* x[t, h, :] = x * cos + rotate_half(x) * sin for every head, in place, rounding after every
 * product and sum as transformers' formula does in that dtype. cos/sin: [T, dim / 2]. */
static inline __attribute__((always_inline)) void rope(
        void* x, const void* cos, const void* sin, int64_t tokens, int64_t heads, int64_t row_stride,
        int64_t dim, int num_threads, int bf16) {
    const int64_t half = dim / 2;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t i = 0; i < half; i += VL) {
            const int64_t n = half - i;
            const vf c = load_n(cos, t * half + i, n, bf16), s = load_n(sin, t * half + i, n, bf16);
            for (int64_t h = 0; h < heads; h++) {
                const int64_t v = t * row_stride + h * dim;
                const vf x1 = load_n(x, v + i, n, bf16), x2 = load_n(x, v + half + i, n, bf16);
                store_n(x, v + i, rounded(x1 * c, bf16) - rounded(x2 * s, bf16), n, bf16);
                store_n(x, v + half + i, rounded(x2 * c, bf16) + rounded(x1 * s, bf16), n, bf16);
            }
        }
    }
}

/* silu(g) = g * sigmoid(g), in fp32. bf16 on AVX-512: g / (1 + 2^(-g log2 e)) through exp2_ps, whose
 * error vanishes in the rounding to bf16 (over every finite bf16 g, the results that differ from
 * the correctly rounded silu are all below 1e-30, where exp2_ps flushes; vexp's clamp at -87 got
 * 15,569 of those tiny ones wrong) at 1.3-1.5x the kernel's rate: SiLU was a sixth of a bf16
 * prefill's MLP time. The exponent is kept above -150 so that silu(+inf) stays inf. */
static inline __attribute__((always_inline)) vf silu(vf g, int bf16) {
#if defined(__AVX512F__)
    if (bf16) {
        const __m512 exponent = _mm512_max_ps((__m512)(g * -1.44269504f), _mm512_set1_ps(-150.0f));
        return g / (1.0f + (vf)exp2_ps(exponent));
    }
#endif
    const vf e = vexp(vselect(g > 0.0f, -g, g));  /* exp(-|g|): sigmoid without overflow */
    return g * (vselect(g >= 0.0f, splat(1.0f), e) / (1.0f + e));
}

/* out = silu(gate) * up, rounding after each; gate_up: [rows, 2 * width] (gate | up). */
static inline __attribute__((always_inline)) void silu_and_mul(
        const void* gate_up, void* out, int64_t rows, int64_t width, int num_threads, int bf16) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t gate = r * 2 * width, up = gate + width;
        for (int64_t i = 0; i < width; i += VL) {
            const int64_t n = width - i;
            const vf g = load_n(gate_up, gate + i, n, bf16);
            store_n(out, r * width + i, rounded(silu(g, bf16), bf16) * load_n(gate_up, up + i, n, bf16), n, bf16);
        }
    }
}

void add_rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* weight, uint16_t* out,
                       int64_t rows, int64_t hidden, float eps, int num_threads) {
    add_rms_norm(x, residual, weight, out, rows, hidden, eps, num_threads, 1);
}
void add_rms_norm_f32(const float* x, float* residual, const float* weight, float* out,
                      int64_t rows, int64_t hidden, float eps, int num_threads) {
    add_rms_norm(x, residual, weight, out, rows, hidden, eps, num_threads, 0);
}
void heads_rms_norm_bf16(uint16_t* x, const uint16_t* weight, int64_t tokens, int64_t heads, int64_t row_stride,
                         int64_t dim, float eps, int num_threads) {
    heads_rms_norm(x, weight, tokens, heads, row_stride, dim, eps, num_threads, 1);
}
void heads_rms_norm_f32(float* x, const float* weight, int64_t tokens, int64_t heads, int64_t row_stride,
                        int64_t dim, float eps, int num_threads) {
    heads_rms_norm(x, weight, tokens, heads, row_stride, dim, eps, num_threads, 0);
}
void rope_bf16(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t tokens, int64_t heads,
               int64_t row_stride, int64_t dim, int num_threads) {
    rope(x, cos, sin, tokens, heads, row_stride, dim, num_threads, 1);
}
void rope_f32(float* x, const float* cos, const float* sin, int64_t tokens, int64_t heads,
              int64_t row_stride, int64_t dim, int num_threads) {
    rope(x, cos, sin, tokens, heads, row_stride, dim, num_threads, 0);
}
void silu_and_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t width, int num_threads) {
    silu_and_mul(gate_up, out, rows, width, num_threads, 1);
}
void silu_and_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t width, int num_threads) {
    silu_and_mul(gate_up, out, rows, width, num_threads, 0);
}
