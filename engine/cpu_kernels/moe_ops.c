/* The element ops of a sparse MoE block (bf16 and fp32): routing, the weighted sum of each row's
 * experts, and Qwen2-MoE's gated shared expert.
 *
 * Routing and the shared expert's gate are here rather than in PyTorch because torch's CPU softmax
 * and sigmoid use SLEEF's vector exp (bits C cannot reproduce) and torch.topk breaks ties in no
 * documented order: the Python path of engine/models/moe.py calls these same kernels on CPU, so it
 * and the native decode path (decode_layers.c) give the same bits by construction. The weighted sum
 * rounds exactly where the Python path's tensor ops round (tested against it).
 */
#include "simd.h"

/* Row t of logits [rows, E]: softmax in fp32 (max, expf, a sum in expert order, a division), the
 * top k (descending; the lower expert first among equal probabilities), and with `normalize` the k
 * weights divided by their sum (in slot order). `round_bf16_weights`: each weight then rounded to
 * bf16 (Qwen multiplies by weights in the model dtype). experts [rows, k] int64, weights [rows, k]. */
static inline __attribute__((always_inline)) void moe_route(
        const void* logits, int64_t rows, int64_t E, int64_t k, int normalize, int round_bf16_weights,
        int64_t* experts, float* weights, int num_threads, int bf16) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < rows; t++) {
        float probs[E];
        float top = -INFINITY;
        for (int64_t e = 0; e < E; e++) {
            probs[e] = bf16 ? bf16_to_f32(((const uint16_t*)logits)[t * E + e]) : ((const float*)logits)[t * E + e];
            top = probs[e] > top ? probs[e] : top;
        }
        float sum = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            probs[e] = expf(probs[e] - top);
            sum += probs[e];
        }
        for (int64_t e = 0; e < E; e++) probs[e] /= sum;
        int64_t* chosen = experts + t * k;
        float* weight = weights + t * k;
        float total = 0.0f;
        for (int64_t slot = 0; slot < k; slot++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t j = 0; j < slot; j++) taken |= chosen[j] == e;
                /* NaN never wins a comparison: a row of NaNs still gets k distinct experts */
                if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
            }
            chosen[slot] = best;
            weight[slot] = probs[best];
            total += probs[best];
        }
        for (int64_t slot = 0; slot < k; slot++) {
            if (normalize) weight[slot] /= total;
            if (round_bf16_weights) weight[slot] = bf16_to_f32(f32_to_bf16(weight[slot]));
        }
    }
}

/* out[t] = sum over slots s (in order, from 0, in fp32) of round(pair_out[position[t k + s]] *
 * weights[t k + s]), rounded once to the dtype: the Python path's `outputs * weights` (one rounding
 * of the fp32 product) then `.sum(dim=1)` (an fp32 accumulator from 0, rounded at the end). */
static inline __attribute__((always_inline)) void moe_combine(
        const void* pair_out, const int64_t* position, const float* weights, void* out, int64_t rows, int64_t k,
        int64_t hidden, int num_threads, int bf16) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < rows; t++)
        for (int64_t i = 0; i < hidden; i += VL) {
            const int64_t n = hidden - i;
            vf sum = splat(0.0f);
            for (int64_t s = 0; s < k; s++) {
                /* in a register: the product rounded on its own, never fused into the sum (FMA) */
                const vf product = load_n(pair_out, position[t * k + s] * hidden + i, n, bf16) * weights[t * k + s];
                sum += in_register(rounded(product, bf16));
            }
            store_n(out, t * hidden + i, sum, n, bf16);
        }
}

/* out += sigmoid(gate[t]) * shared[t], rounding after the sigmoid, the product and the sum as the
 * tensor ops of the Python path's `out += torch.sigmoid(gate) * shared` do. gate: [rows, 1]. */
static inline __attribute__((always_inline)) void moe_shared_add(
        void* out, const void* gate, const void* shared, int64_t rows, int64_t hidden, int num_threads,
        int bf16) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < rows; t++) {
        const float g = bf16 ? bf16_to_f32(((const uint16_t*)gate)[t]) : ((const float*)gate)[t];
        float sigmoid = 1.0f / (1.0f + expf(-g));
        if (bf16) sigmoid = bf16_to_f32(f32_to_bf16(sigmoid));
        for (int64_t i = 0; i < hidden; i += VL) {
            const int64_t n = hidden - i, at = t * hidden + i;
            const vf scaled = in_register(rounded(load_n(shared, at, n, bf16) * sigmoid, bf16));  /* no FMA */
            store_n(out, at, load_n(out, at, n, bf16) + scaled, n, bf16);
        }
    }
}

void moe_route_bf16(const uint16_t* logits, int64_t rows, int64_t E, int64_t k, int64_t normalize,
                    int64_t round_bf16_weights, int64_t* experts, float* weights, int num_threads) {
    moe_route(logits, rows, E, k, (int)normalize, (int)round_bf16_weights, experts, weights, num_threads, 1);
}
void moe_route_f32(const float* logits, int64_t rows, int64_t E, int64_t k, int64_t normalize,
                   int64_t round_bf16_weights, int64_t* experts, float* weights, int num_threads) {
    moe_route(logits, rows, E, k, (int)normalize, (int)round_bf16_weights, experts, weights, num_threads, 0);
}
void moe_combine_bf16(const uint16_t* pair_out, const int64_t* position, const float* weights, uint16_t* out,
                      int64_t rows, int64_t k, int64_t hidden, int num_threads) {
    moe_combine(pair_out, position, weights, out, rows, k, hidden, num_threads, 1);
}
void moe_combine_f32(const float* pair_out, const int64_t* position, const float* weights, float* out,
                     int64_t rows, int64_t k, int64_t hidden, int num_threads) {
    moe_combine(pair_out, position, weights, out, rows, k, hidden, num_threads, 0);
}
void moe_shared_add_bf16(uint16_t* out, const uint16_t* gate, const uint16_t* shared, int64_t rows, int64_t hidden,
                         int num_threads) {
    moe_shared_add(out, gate, shared, rows, hidden, num_threads, 1);
}
void moe_shared_add_f32(float* out, const float* gate, const float* shared, int64_t rows, int64_t hidden,
                        int num_threads) {
    moe_shared_add(out, gate, shared, rows, hidden, num_threads, 0);
}
