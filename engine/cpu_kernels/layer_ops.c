/* bf16 element-wise ops of a decoder layer, one pass each, rounding where transformers rounds.
 *
 * In PyTorch each of these is several ops (an fp32 copy, the op, a rounding copy, a scale), each
 * its own pass over memory and its own dispatch; a decode step runs hundreds of them. Here each is
 * one loop, parallel over rows, computing in fp32 and rounding to bf16 exactly where the
 * transformers formulas round (after every bf16 tensor op), so results match them except where an
 * fp32 intermediate differs in its last place (a different summation order, exp within 2 ulp).
 */
#include "simd.h"

/* VL bf16 values from p, or the first n of them (the rest zero) at a row's end. */
static inline vf load_bf16_n(const uint16_t* p, int64_t n) {
    if (n >= VL) return load_bf16(p);
    uint16_t padded[VL] = {0};
    memcpy(padded, p, (size_t)n * sizeof *p);
    return load_bf16(padded);
}

static inline void store_bf16_n(uint16_t* p, vf v, int64_t n) {
    if (n >= VL) {
        store_bf16(p, v);
        return;
    }
    uint16_t padded[VL];
    store_bf16(padded, v);
    memcpy(p, padded, (size_t)n * sizeof *p);
}

/* residual += x (when residual is given; a bf16 add), then out = weight * bf16(normalize(residual)):
 * transformers' `hidden + residual`, then LlamaRMSNorm (normalize in fp32, round, scale in bf16). */
void add_rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* weight, uint16_t* out,
                       int64_t rows, int64_t hidden, float eps, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* in = x + r * hidden;
        uint16_t* res = residual ? residual + r * hidden : NULL;
        vf squares = splat(0.0f);
        for (int64_t i = 0; i < hidden; i += VL) {
            vf value = load_bf16_n(in + i, hidden - i);
            if (res) {
                value = round_bf16(value + load_bf16_n(res + i, hidden - i));
                store_bf16_n(res + i, value, hidden - i);
            }
            squares += value * value;
        }
        const uint16_t* src = res ? res : in;
        const float inverse = 1.0f / sqrtf(hsum(squares) / (float)hidden + eps);
        uint16_t* dst = out + r * hidden;
        for (int64_t i = 0; i < hidden; i += VL) {
            const vf normalized = round_bf16(load_bf16_n(src + i, hidden - i) * inverse);
            store_bf16_n(dst + i, normalized * load_bf16_n(weight + i, hidden - i), hidden - i);
        }
    }
}

/* x[t, h, :] = x * cos + rotate_half(x) * sin for every head, in place, rounding to bf16 after
 * every product and sum as transformers' bf16 formula does. cos/sin: [T, dim / 2]. */
void rope_bf16(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t tokens, int64_t heads,
               int64_t row_stride, int64_t dim, int num_threads) {
    const int64_t half = dim / 2;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t i = 0; i < half; i += VL) {
            const int64_t n = half - i;
            const vf c = load_bf16_n(cos + t * half + i, n), s = load_bf16_n(sin + t * half + i, n);
            for (int64_t h = 0; h < heads; h++) {
                uint16_t* v = x + t * row_stride + h * dim;
                const vf x1 = load_bf16_n(v + i, n), x2 = load_bf16_n(v + half + i, n);
                store_bf16_n(v + i, round_bf16(x1 * c) - round_bf16(x2 * s), n);
                store_bf16_n(v + half + i, round_bf16(x2 * c) + round_bf16(x1 * s), n);
            }
        }
    }
}

/* out = bf16(silu(gate)) * up, rounding after each; gate_up: [rows, 2 * width] (gate | up). */
void silu_and_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t width, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* gate = gate_up + r * 2 * width;
        const uint16_t* up = gate + width;
        for (int64_t i = 0; i < width; i += VL) {
            const int64_t n = width - i;
            const vf g = load_bf16_n(gate + i, n);
            const vf e = vexp(vselect(g > 0.0f, -g, g));  /* exp(-|g|): sigmoid without overflow */
            const vf sigmoid = vselect(g >= 0.0f, splat(1.0f), e) / (1.0f + e);
            store_bf16_n(out + r * width + i, round_bf16(g * sigmoid) * load_bf16_n(up + i, n), n);
        }
    }
}
