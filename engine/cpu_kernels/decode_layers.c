/* Every decoder layer of a pure decode step in one call.
 *
 * A decode step's arithmetic is small (a few rows through every weight), so in Python the cost
 * of driving it shows: each layer is a dozen kernel calls (norms, projections, rotary, the K/V
 * store, attention, the MLP), each a ctypes call with its argument checks, and a few modules'
 * worth of interpreter work around them: 5-8 ms of a 20-40 ms step for a 30-layer model, measured
 * on a model of SmolLM2's depth with tiny matrices. Here the same kernels run in the same order
 * from C, so the results are the bits the Python path gives; the Python side checks everything
 * once per step (engine/models/native_decode.py).
 *
 * Per layer (Llama family, no sliding window): residual += hidden and norm; QKV projection; each
 * head's q/k norm where the model has them (Qwen3); rotary on q and k; K/V into the paged cache; q made contiguous; each decode group's
 * shared prefix through the prefix kernel, then every row's own part through the decode kernel
 * (continuing the prefix's softmax); the output projection; residual add and norm; gate/up, SiLU x
 * up, down. A sparse MoE layer's MLP instead: the router's logits, routing (moe_ops.c), the step's
 * (row, slot) pairs sorted by expert (stably: each expert's in row order, as the Python path's
 * argsort) and each expert's rows through gate/up, SiLU x up, down as one batch (its weights stream
 * once per step), the weighted sum of each row's k outputs in slot order, and Qwen2-MoE's shared
 * expert with its sigmoid gate. The projections are the row kernel's (row_gemm.c). Where the step
 * has LoRA rows, each dense projection's output gets its rows' adapter updates (lora_ops.c) right
 * after the projection, as the Python path's Linear adds them. A quantized checkpoint's projections
 * run quant_gemm.c's kernels instead, as QuantizedLinear runs single-token rows.
 */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "simd.h"

/* The kernels of the library's other files. */
void add_rms_norm_bf16(const uint16_t*, uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, float, int);
void add_rms_norm_f32(const float*, float*, const float*, float*, int64_t, int64_t, float, int);
void rope_bf16(uint16_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t, int);
void rope_f32(float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int);
void heads_rms_norm_bf16(uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t, float, int);
void heads_rms_norm_f32(float*, const float*, int64_t, int64_t, int64_t, int64_t, float, int);
void moe_route_bf16(const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t*, float*, int);
void moe_route_f32(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t*, float*, int);
void moe_combine_bf16(const uint16_t*, const int64_t*, const float*, uint16_t*, int64_t, int64_t, int64_t, int);
void moe_combine_f32(const float*, const int64_t*, const float*, float*, int64_t, int64_t, int64_t, int);
void moe_shared_add_bf16(uint16_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, int);
void moe_shared_add_f32(float*, const float*, const float*, int64_t, int64_t, int);
void silu_and_mul_bf16(const uint16_t*, uint16_t*, int64_t, int64_t, int);
void silu_and_mul_f32(const float*, float*, int64_t, int64_t, int);
void store_kv(const char*, const char*, char*, char*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int);
void decode_attention_bf16(const void*, const void*, const void*, const int64_t*, int64_t, const int64_t*,
                           const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float, const void*,
                           const float*, void*, float*, int);
void decode_attention_f32(const void*, const void*, const void*, const int64_t*, int64_t, const int64_t*,
                          const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, float, const void*,
                          const float*, void*, float*, int);
void row_gemm_bf16(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t,
                   int64_t, int64_t, int);
void row_gemm_f32(const float*, int64_t, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                  int);
void lora_update_bf16(const uint16_t*, int64_t, uint16_t*, int64_t, const int64_t*, int64_t, const int64_t*,
                      const int64_t*, const int64_t*, int64_t, int64_t, int);
void lora_update_f32(const float*, int64_t, float*, int64_t, const int64_t*, int64_t, const int64_t*, const int64_t*,
                     const int64_t*, int64_t, int64_t, int);
void causal_attention_f32(const float*, const float*, const float*, const int64_t*, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, float, float*, float*, float*, int);
void quantize_rows_u8(const float*, int64_t, int64_t, int64_t, float, int64_t, uint8_t*, float*, int32_t*, int);
void int8_gemm(const uint8_t*, int64_t, int64_t, const int8_t*, int64_t, float*, int16_t*, int);
void int8_epilogue(const float*, int64_t, int64_t, const float*, const int32_t*, const float*, const int32_t*,
                   const float*, float*, int);
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define HAS_WQ_GEMM_BF16 1  /* quant_gemm.c builds it under the same flags */
int64_t wq_bf16_applies(int64_t, int64_t);
void wq_gemm_bf16(const uint16_t*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, const float*,
                  const float*, const float*, uint16_t*, int);
#endif
void wq_gemm(const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, int64_t, const float*,
             const float*, const float*, float*, int);
/* Built only for CPUs with AMX or AVX512-BF16 (prefix_attention.c): absent elsewhere. */
__attribute__((weak)) void prefix_attention_bf16(const uint16_t*, const uint16_t*, const uint16_t*,
                                                 const int64_t*, const int64_t*, int64_t, int64_t, int64_t,
                                                 int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, uint16_t*,
                                                 uint16_t*, float*, int);

/* A sparse layer's MLP: the row kernel's packed router [experts, hidden], each expert's packed
 * gate_up and down, and (NULL: none) the shared expert's and its gate's [1, hidden]. No biases. */
typedef struct {
    const void* router;
    const void* const* gate_up;  /* [experts] */
    const void* const* down;     /* [experts] */
    const void* shared_gate_up;
    const void* shared_down;
    const void* shared_gate;
} decode_moe;

/* One projection's LoRA slots (engine/lora/slots.py, lora_ops.c): each slot's A and B packed for the
 * row kernel (addresses), and its width (0: none). */
typedef struct {
    const int64_t* a;
    const int64_t* b;
    const int64_t* widths;
} decode_lora;

/* A quantized projection (engine/quant/linear.py, quant_gemm.c): kind 1 W8A8 (int8 weights [width, in],
 * each output's scale and weight sum, the activations' quantize_rows_u8 mode, scale and zero point),
 * kind 2 weight-only (packed 8/4-bit weights, `row_bytes` a row, fp32 scales and zero points (NULL:
 * symmetric) per `group` inputs); the bias in fp32 (NULL: none). */
typedef struct {
    int64_t kind;
    const void* weight;
    int64_t row_bytes, bits, group;
    const float* scales;
    const float* zeros;
    const int32_t* col_sums;
    const float* bias;
    int64_t act_mode;
    float act_scale;
    int64_t act_zero;
} decode_quant;

/* One layer's weights: norm weights, the row kernel's packed projections and their biases (NULL:
 * none), and the layer's K and V caches ([blocks, kv_heads, block_size, head_dim] each); q/k norm
 * weights [head_dim] (NULL: none) and the sparse MLP (NULL: a dense layer, gate_up and down). */
typedef struct {
    const void* input_norm;
    const void* post_norm;
    const void* qkv;
    const void* qkv_bias;
    const void* o;
    const void* o_bias;
    const void* gate_up;
    const void* gate_up_bias;
    const void* down;
    const void* down_bias;
    void* k_cache;
    void* v_cache;
    const void* q_norm;
    const void* k_norm;
    const decode_moe* moe;
    /* each projection's LoRA slots (NULL: no adapter targets it) */
    const decode_lora* qkv_lora;
    const decode_lora* o_lora;
    const decode_lora* gate_up_lora;
    const decode_lora* down_lora;
    /* each projection's quantization (NULL: its float weights above) */
    const decode_quant* qkv_quant;
    const decode_quant* o_quant;
    const decode_quant* gate_up_quant;
    const decode_quant* down_quant;
} decode_layer;

/* The step: shapes, the rows' rotary, cache slots and attention plan, and the buffers. */
typedef struct {
    int64_t layers, rows, hidden_size, heads, kv_heads, head_dim, intermediate, block_size, bf16;
    float eps, scale;
    const void* cos;  /* [rows, head_dim / 2] */
    const void* sin;
    const int64_t* write_rows;  /* [rows * kv_heads]: rows of a cache viewed [-1, head_dim] */
    const int64_t* tables;      /* [rows, table_stride]: each row's own part's blocks */
    int64_t table_stride;
    const int64_t* tokens;      /* [rows] tokens of each row's own part */
    const int64_t* first;       /* [rows] first visible token of it */
    /* Shared prefixes (bf16: the prefix kernel; fp32: the causal kernel, a group at a time): batch b
     * is info[5b..]: groups, rows per group, blocks per group, its first entry in prefix_rows, its
     * first entry in prefix_blocks. */
    int64_t prefix_batches;
    const int64_t* prefix_info;
    const int64_t* prefix_rows;
    const int64_t* prefix_blocks;
    void* prefix_scratch;  /* the prefix kernel's packed K/V, or the causal kernel's packed K */
    float* group_q;        /* fp32: a group's queries gathered [rows per group, heads head_dim] */
    float* group_out;      /* fp32: their output, likewise */
    float* group_lse;      /* fp32: their log-sum-exps [rows per group, heads] */
    /* Buffers: residual holds the embeddings on entry and the residual stream on return, hidden
     * the last layer's output; the rest are scratch of the sizes their names say. */
    void* residual;      /* [rows, hidden] */
    void* hidden;        /* [rows, hidden] */
    void* normed;        /* [rows, hidden] */
    void* qkv_out;       /* [rows, (heads + 2 kv_heads) head_dim] */
    void* q;             /* [rows, heads head_dim] */
    void* attn;          /* [rows, heads head_dim] */
    void* init_out;      /* [rows, heads head_dim], used with prefix batches */
    float* init_lse;     /* [rows, heads] */
    float* lse;          /* [rows, heads] */
    void* gate_up_out;   /* [rows, 2 intermediate] */
    void* act;           /* [rows, intermediate] */
    int64_t threads;
    /* Sparse layers (unused without): experts, top k, each expert's and the shared expert's width
     * (0: none), whether the top k weights are renormalised, and whether they are rounded to bf16
     * before they scale the experts' outputs (Qwen in bf16; Mixtral multiplies in fp32). */
    int64_t experts, top_k, expert_intermediate, shared_intermediate, normalize_top_k, round_weights;
    void* router_logits;       /* [rows, experts] */
    int64_t* pair_expert;      /* [rows * top_k]: the expert of each (row, slot) pair */
    float* pair_weight;        /* [rows * top_k] */
    int64_t* pair_position;    /* [rows * top_k]: where each pair lies in the pairs sorted by expert */
    void* pair_in;             /* [rows * top_k, hidden]: the pairs' rows, sorted by expert */
    void* pair_gate_up;        /* [rows * top_k, 2 expert_intermediate] */
    void* pair_act;            /* [rows * top_k, expert_intermediate] */
    void* pair_out;            /* [rows * top_k, hidden] */
    void* shared_gate_out;     /* [rows, 1] */
    void* shared_gate_up;      /* [rows, 2 shared_intermediate] */
    void* shared_act;          /* [rows, shared_intermediate] */
    void* shared_out;          /* [rows, hidden] */
    /* NULL, or seconds added up over the step's sparse layers (benchmarks/moe_profile.py): [0] routing
     * (router projection, softmax and top-k, sorting the pairs by expert), [1] the experts' compute
     * (their MLPs, the weighted sum, the shared expert). */
    double* moe_seconds;
    const int64_t* lora_slots; /* [rows]: each row's adapter slot (-1: the base); NULL: no LoRA rows */
    /* Quantized projections' scratch (unused without): fp32 rows in and out [rows, widest], the
     * activations as uint8 and int16 [rows, widest input], their scales and zero points [rows], the
     * integer sums [rows, widest output]. */
    float* quant_in;
    float* quant_out;
    uint8_t* quant_u8;
    int16_t* quant_x16;
    float* quant_row_scales;
    int32_t* quant_row_zeros;
    float* quant_raw;
} decode_step;

static void norm(const decode_step* s, const void* x, void* residual, const void* weight, void* out) {
    const int nt = (int)s->threads;
    if (s->bf16) add_rms_norm_bf16(x, residual, weight, out, s->rows, s->hidden_size, s->eps, nt);
    else add_rms_norm_f32(x, residual, weight, out, s->rows, s->hidden_size, s->eps, nt);
}

/* bf16 -> fp32 is exact; fp32 -> bf16 rounds to nearest even, as torch's .to(torch.bfloat16). */
static inline uint16_t to_bf16(float v) {
    uint32_t bits;
    memcpy(&bits, &v, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* A quantized projection of `rows` rows, as QuantizedLinear.forward computes its single-token rows:
 * the rows in fp32, quant_gemm.c's kernels, the fp32 results in the model's dtype. */
static void project_quantized(const decode_step* s, int64_t rows, const void* x, int64_t in,
                              const decode_quant* q, void* out, int64_t width) {
    const int nt = (int)s->threads;
    const float* rows_in = (const float*)x;
#ifdef HAS_WQ_GEMM_BF16
    if (s->bf16 && q->kind == 2 && wq_bf16_applies(q->bits, q->group)) {
        /* W4A16 on bf16 rows as they are (quant_gemm.c's wq_gemm_bf16, as QuantizedLinear runs them) */
        wq_gemm_bf16((const uint16_t*)x, rows, in, (const uint8_t*)q->weight, q->row_bytes, width, q->group,
                     q->scales, q->zeros, q->bias, (uint16_t*)out, nt);
        return;
    }
#endif
    if (s->bf16) {
        for (int64_t i = 0; i < rows * in; i++) {
            uint32_t bits = (uint32_t)((const uint16_t*)x)[i] << 16;
            memcpy(s->quant_in + i, &bits, 4);
        }
        rows_in = s->quant_in;
    }
    float* result = s->bf16 ? s->quant_out : (float*)out;
    if (q->kind == 1) {
        quantize_rows_u8(rows_in, rows, in, q->act_mode, q->act_scale, q->act_zero, s->quant_u8,
                         s->quant_row_scales, s->quant_row_zeros, nt);
        int8_gemm(s->quant_u8, rows, in, (const int8_t*)q->weight, width, s->quant_raw, s->quant_x16, nt);
        int8_epilogue(s->quant_raw, rows, width, s->quant_row_scales, s->quant_row_zeros, q->scales,
                      q->col_sums, q->bias, result, nt);
    } else {
        wq_gemm(rows_in, rows, in, (const uint8_t*)q->weight, q->row_bytes, q->bits, width, q->group,
                q->scales, q->zeros, q->bias, result, nt);
    }
    if (s->bf16)
        for (int64_t i = 0; i < rows * width; i++) ((uint16_t*)out)[i] = to_bf16(s->quant_out[i]);
}

/* out[rows, width] = x[rows, in] W^T (+ bias) through the row kernel (or `quant`'s kernels). */
static void project_rows(const decode_step* s, int64_t rows, const void* x, int64_t in, const void* packed,
                         const void* bias, void* out, int64_t width, const decode_quant* quant) {
    const int nt = (int)s->threads;
    if (quant != NULL) project_quantized(s, rows, x, in, quant, out, width);
    else if (s->bf16) row_gemm_bf16(x, in, packed, bias, out, width, rows, width, in, nt);
    else row_gemm_f32(x, in, packed, bias, out, width, rows, width, in, nt);
}

static void project(const decode_step* s, const void* x, int64_t in, const void* packed, const void* bias,
                    void* out, int64_t width, const decode_quant* quant) {
    project_rows(s, s->rows, x, in, packed, bias, out, width, quant);
}

/* out[rows, width] += each row's adapter update of x[rows, in], where the step has LoRA rows. */
static void add_lora(const decode_step* s, const decode_lora* l, const void* x, int64_t in, void* out,
                     int64_t width) {
    if (l == NULL || s->lora_slots == NULL) return;
    const int nt = (int)s->threads;
    if (s->bf16) lora_update_bf16(x, in, out, width, s->lora_slots, s->rows, l->a, l->b, l->widths, in, width, nt);
    else lora_update_f32(x, in, out, width, s->lora_slots, s->rows, l->a, l->b, l->widths, in, width, nt);
}

/* silu(gate) * up -> down of `rows` rows: the MLP of a dense layer, an expert or the shared expert
 * (LoRA slots only for a dense layer's, with rows the step's rows; NULL elsewhere). */
static void mlp_rows(const decode_step* s, int64_t rows, const void* x, const void* gate_up, const void* gate_up_bias,
                     const void* down, const void* down_bias, int64_t width, void* gate_up_out, void* act,
                     void* out, const decode_lora* gate_up_lora, const decode_lora* down_lora,
                     const decode_quant* gate_up_quant, const decode_quant* down_quant) {
    const int nt = (int)s->threads;
    project_rows(s, rows, x, s->hidden_size, gate_up, gate_up_bias, gate_up_out, 2 * width, gate_up_quant);
    add_lora(s, gate_up_lora, x, s->hidden_size, gate_up_out, 2 * width);
    if (s->bf16) silu_and_mul_bf16(gate_up_out, act, rows, width, nt);
    else silu_and_mul_f32(gate_up_out, act, rows, width, nt);
    project_rows(s, rows, act, width, down, down_bias, out, s->hidden_size, down_quant);
    add_lora(s, down_lora, act, width, out, s->hidden_size);
}

static double seconds_now(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

/* A sparse layer's MLP of s->normed into s->hidden (see the top of the file). */
static void sparse_mlp(const decode_step* s, const decode_moe* m) {
    const double started = s->moe_seconds ? seconds_now() : 0.0;
    const int nt = (int)s->threads;
    const int64_t E = s->experts, k = s->top_k, pairs = s->rows * k, H = s->hidden_size;
    const int64_t I = s->expert_intermediate, size = s->bf16 ? 2 : 4;
    project(s, s->normed, H, m->router, NULL, s->router_logits, E, NULL);
    if (s->bf16)
        moe_route_bf16(s->router_logits, s->rows, E, k, s->normalize_top_k, s->round_weights, s->pair_expert,
                       s->pair_weight, nt);
    else
        moe_route_f32(s->router_logits, s->rows, E, k, s->normalize_top_k, s->round_weights, s->pair_expert,
                      s->pair_weight, nt);
    /* a counting sort of the pairs by expert, stable: each expert's pairs in row order */
    int64_t start[E + 1];
    memset(start, 0, sizeof start);
    for (int64_t p = 0; p < pairs; p++) start[s->pair_expert[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    int64_t next[E];
    memcpy(next, start, sizeof next);
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t at = next[s->pair_expert[p]]++;
        s->pair_position[p] = at;
        memcpy((char*)s->pair_in + at * H * size, (const char*)s->normed + p / k * H * size, (size_t)(H * size));
    }
    const double routed = s->moe_seconds ? seconds_now() : 0.0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t rows = start[e + 1] - start[e], at = start[e];
        if (rows == 0) continue;
        mlp_rows(s, rows, (const char*)s->pair_in + at * H * size, m->gate_up[e], NULL, m->down[e], NULL, I,
                 (char*)s->pair_gate_up + at * 2 * I * size, (char*)s->pair_act + at * I * size,
                 (char*)s->pair_out + at * H * size, NULL, NULL, NULL, NULL);
    }
    if (s->bf16) moe_combine_bf16(s->pair_out, s->pair_position, s->pair_weight, s->hidden, s->rows, k, H, nt);
    else moe_combine_f32(s->pair_out, s->pair_position, s->pair_weight, s->hidden, s->rows, k, H, nt);
    if (m->shared_gate_up != NULL) {
        project(s, s->normed, H, m->shared_gate, NULL, s->shared_gate_out, 1, NULL);
        mlp_rows(s, s->rows, s->normed, m->shared_gate_up, NULL, m->shared_down, NULL, s->shared_intermediate,
                 s->shared_gate_up, s->shared_act, s->shared_out, NULL, NULL, NULL, NULL);
        if (s->bf16) moe_shared_add_bf16(s->hidden, s->shared_gate_out, s->shared_out, s->rows, H, nt);
        else moe_shared_add_f32(s->hidden, s->shared_gate_out, s->shared_out, s->rows, H, nt);
    }
    if (s->moe_seconds) {
        s->moe_seconds[0] += routed - started;
        s->moe_seconds[1] += seconds_now() - routed;
    }
}

static void attend(const decode_step* s, const decode_layer* w) {
    const int nt = (int)s->threads;
    const int64_t D = s->head_dim, Q = s->heads / s->kv_heads;
    const void* init_out = NULL;
    const float* init_lse = NULL;
    if (s->prefix_batches > 0) {
        for (int64_t i = 0; i < s->rows * s->heads; i++) s->init_lse[i] = -INFINITY;
        for (int64_t b = 0; b < s->prefix_batches; b++) {
            const int64_t* info = s->prefix_info + 5 * b;
            if (s->bf16) {
                prefix_attention_bf16(s->q, w->k_cache, w->v_cache, s->prefix_rows + info[3],
                                      s->prefix_blocks + info[4], info[0], info[1], info[2], s->kv_heads, Q, D,
                                      s->block_size, -1, s->heads * D, s->scale, s->prefix_scratch, s->init_out,
                                      s->init_lse, nt);
                continue;
            }
            /* fp32: a group's queries gathered, through the causal kernel (every query sees every
             * shared key), their outputs and log-sum-exps scattered back */
            const int64_t n = info[1], keys = info[2] * s->block_size, width = s->heads * D;
            for (int64_t g = 0; g < info[0]; g++) {
                const int64_t* rows = s->prefix_rows + info[3] + g * n;
                for (int64_t i = 0; i < n; i++)
                    memcpy(s->group_q + i * width, (const float*)s->q + rows[i] * width, (size_t)width * 4);
                causal_attention_f32(s->group_q, w->k_cache, w->v_cache, s->prefix_blocks + info[4] + g * info[2],
                                     n, s->kv_heads, Q, D, s->block_size, keys, keys, width, s->scale,
                                     s->prefix_scratch, s->group_out, s->group_lse, nt);
                for (int64_t i = 0; i < n; i++) {
                    memcpy((float*)s->init_out + rows[i] * width, s->group_out + i * width, (size_t)width * 4);
                    memcpy(s->init_lse + rows[i] * s->heads, s->group_lse + i * s->heads, (size_t)s->heads * 4);
                }
            }
        }
        init_out = s->init_out;
        init_lse = s->init_lse;
    }
    if (s->bf16)
        decode_attention_bf16(s->q, w->k_cache, w->v_cache, s->tables, s->table_stride, s->tokens, s->first,
                              s->rows, s->kv_heads, Q, D, s->block_size, s->scale, init_out, init_lse, s->attn,
                              s->lse, nt);
    else
        decode_attention_f32(s->q, w->k_cache, w->v_cache, s->tables, s->table_stride, s->tokens, s->first,
                             s->rows, s->kv_heads, Q, D, s->block_size, s->scale, init_out, init_lse, s->attn,
                             s->lse, nt);
}

int decode_layers_can_attend_prefixes(void) { return prefix_attention_bf16 != NULL; }  /* bf16 groups */

void decode_layers(const decode_layer* layers, const decode_step* s) {
    const int nt = (int)s->threads;
    const int64_t D = s->head_dim, q_size = s->heads * D, kv_size = s->kv_heads * D;
    const int64_t width = q_size + 2 * kv_size, size = s->bf16 ? 2 : 4;
    char* qkv = (char*)s->qkv_out;
    for (int64_t l = 0; l < s->layers; l++) {
        const decode_layer* w = layers + l;
        /* the residual add lives in the norm after it (vLLM's layout): layer 0 has none */
        if (l == 0) norm(s, s->residual, NULL, w->input_norm, s->normed);
        else norm(s, s->hidden, s->residual, w->input_norm, s->normed);
        project(s, s->normed, s->hidden_size, w->qkv, w->qkv_bias, qkv, width, w->qkv_quant);
        add_lora(s, w->qkv_lora, s->normed, s->hidden_size, qkv, width);
        if (w->q_norm) {  /* per head, before rotary (Qwen3) */
            if (s->bf16) {
                heads_rms_norm_bf16((uint16_t*)qkv, w->q_norm, s->rows, s->heads, width, D, s->eps, nt);
                heads_rms_norm_bf16((uint16_t*)(qkv + q_size * size), w->k_norm, s->rows, s->kv_heads, width, D,
                                    s->eps, nt);
            } else {
                heads_rms_norm_f32((float*)qkv, w->q_norm, s->rows, s->heads, width, D, s->eps, nt);
                heads_rms_norm_f32((float*)(qkv + q_size * size), w->k_norm, s->rows, s->kv_heads, width, D,
                                   s->eps, nt);
            }
        }
        if (s->bf16) {
            rope_bf16((uint16_t*)qkv, s->cos, s->sin, s->rows, s->heads, width, D, nt);
            rope_bf16((uint16_t*)(qkv + q_size * size), s->cos, s->sin, s->rows, s->kv_heads, width, D, nt);
        } else {
            rope_f32((float*)qkv, s->cos, s->sin, s->rows, s->heads, width, D, nt);
            rope_f32((float*)(qkv + q_size * size), s->cos, s->sin, s->rows, s->kv_heads, width, D, nt);
        }
        store_kv(qkv + q_size * size, qkv + (q_size + kv_size) * size, w->k_cache, w->v_cache, s->write_rows,
                 s->rows, s->kv_heads, width * size, D * size, nt);
        for (int64_t r = 0; r < s->rows; r++)
            memcpy((char*)s->q + r * q_size * size, qkv + r * width * size, (size_t)(q_size * size));
        attend(s, w);
        project(s, s->attn, q_size, w->o, w->o_bias, s->hidden, s->hidden_size, w->o_quant);
        add_lora(s, w->o_lora, s->attn, q_size, s->hidden, s->hidden_size);
        norm(s, s->hidden, s->residual, w->post_norm, s->normed);
        if (w->moe) sparse_mlp(s, w->moe);
        else mlp_rows(s, s->rows, s->normed, w->gate_up, w->gate_up_bias, w->down, w->down_bias, s->intermediate,
                      s->gate_up_out, s->act, s->hidden, w->gate_up_lora, w->down_lora, w->gate_up_quant,
                      w->down_quant);
    }
}
