/* Causal prefill attention in fp32, straight from the paged cache.
 *
 * A prefill chunk of n tokens after causal_base tokens of context: token i's Q query heads of kv
 * head h see the first causal_base + i + 1 keys of the chunk's blocks (its own K/V are written
 * before attention runs). SDPA's CPU flash kernel does this at 70-120 GFLOP/s in fp32 on a 2-core
 * AVX-512 machine whose fp32 matmul runs at ~180, and needs the context gathered out of the cache
 * first. Here, per kv head, K is first transposed VL keys at a time ([key / VL][dim][lane]) so a
 * query's scores against VL keys are D broadcast-FMAs; V is read as it lies in the cache. Work
 * items of ITEM queries (token-major: the Q heads of a token are neighbours) compute only the keys
 * their last query sees: scores in blocks of ROWS queries x 4 key vectors, the last block only the
 * vectors it needs (each row's max kept on the way), an fp32 softmax in one pass (exp within 2
 * ulp), then P x V with a few queries' outputs held in registers. Items along the causal triangle
 * grow, so they are handed out one at a time.
 * With AVX-512 (32 registers, Zen 4 measured): 6-query blocks and operands pinned in registers,
 * 275-305 GFLOP/s where 4-query blocks with GCC's memory operands ran at 200-230.
 *
 * Layout: q and out [n, H, Q, D] fp32 (q's rows q_stride floats apart: it may be a view of the QKV
 * projection); cache [blocks, H, BS, D] fp32; blocks [>= L / BS]; packed holds H * Lp * D floats
 * (Lp: L rounded up to 4 * VL). Needs D in {32, 64, 96, 128} with D / VL vectors of at most 16, any BS.
 * Written with GCC vector types (simd.h): AVX-512 or AVX2.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#if VL == 16  /* 32 vector registers: bigger register blocks, operands held in registers */
#define ITEM 24      /* queries per work item */
#define ROWS 6       /* queries per score block */
#define PV_ACC 24    /* output vectors per P x V block */
#define HOLD(v) in_register(v)
#else         /* 16 registers: the compiler's choice of memory operands spills least */
#define ITEM 16
#define ROWS 4
#define PV_ACC 16
#define HOLD(v) (v)
#endif
#define KEY_STEP (4 * VL)  /* keys per score block */

static __thread void* causal_buffer = NULL;
static __thread int64_t causal_capacity = 0;

/* Where key `key` of kv head h lies, in floats: blocks[key / BS] * block + h * head + (key % BS) * row.
 * The paged cache [blocks, H, BS, D]: {H * BS * D, BS * D, D}; a projection's output (rows `stride`
 * apart, one block per sequence): {stride, D, stride}. */
typedef struct { int64_t block, head, row; } kv_layout;

static inline const float* kv_at(const float* base, const int64_t* blocks, kv_layout at, int64_t BS, int64_t h,
                                 int64_t key) {
    return base + blocks[key / BS] * at.block + h * at.head + key % BS * at.row;
}

/* Keys c * VL .. of kv head h, transposed: dst[d * VL + lane] = K[c * VL + lane][d], zero past L. */
static void pack_key_vector(const float* kc, const int64_t* blocks, kv_layout layout, int64_t h, int64_t D,
                            int64_t BS, int64_t L, int64_t c, float* dst) {
    for (int64_t lane = 0; lane < VL; lane++) {
        const int64_t key = c * VL + lane;
        const float* src = key < L ? kv_at(kc, blocks, layout, BS, h, key) : NULL;
        for (int64_t d = 0; d < D; d++) dst[d * VL + lane] = src ? src[d] : 0.0f;
    }
}

/* ROWS queries (queries: [ROWS, D]) scored against the nv key vectors at kt (keys k0 ..), scaled,
 * into rows (row j at rows + j * Lp); each query's running max over the keys it sees: whole vectors
 * in registers (best), the vector its limit cuts key by key (tail). */
static inline __attribute__((always_inline)) void score_block(
        const float* queries, const float* kt, const int64_t D, float scale, float* rows, int64_t Lp, int64_t k0,
        const int64_t* limit, vf* best, float* tail, const int nv) {
    vf acc[ROWS][4];
    for (int j = 0; j < ROWS; j++)
        for (int c = 0; c < nv; c++) acc[j][c] = splat(0.0f);
    for (int64_t d = 0; d < D; d++) {
        vf k[4];
        for (int c = 0; c < nv; c++) k[c] = HOLD(load_f32(kt + (c * D + d) * VL));
        for (int j = 0; j < ROWS; j++) {
            const vf qv = splat(queries[j * D + d]);
            for (int c = 0; c < nv; c++) acc[j][c] += qv * k[c];
        }
    }
    for (int j = 0; j < ROWS; j++) {
        float* row = rows + j * Lp;
        for (int c = 0; c < nv; c++) acc[j][c] *= scale, store_f32(row + c * VL, acc[j][c]);
        if (k0 + nv * VL <= limit[j]) {
            vf top = acc[j][0];
            for (int c = 1; c < nv; c++) top = vmax(top, acc[j][c]);
            best[j] = vmax(best[j], top);
        } else
            for (int64_t key = k0; key < limit[j]; key++)
                tail[j] = row[key - k0] > tail[j] ? row[key - k0] : tail[j];
    }
}

static inline __attribute__((always_inline)) void causal_item(
        const float* q, int64_t q_stride, const float* vc, const int64_t* blocks, kv_layout layout, int64_t h,
        int64_t m0, int64_t n,
        int64_t H, int64_t Q, const int64_t D, int64_t BS, int64_t L, int64_t Lp, int64_t causal_base, float scale,
        const float* keys, float* out, float* lse) {
    const int64_t M = n * Q;
    float* scores = (float*)thread_scratch(&causal_buffer, &causal_capacity, (ITEM * Lp + ITEM * D) * 4);
    float* queries = scores + ITEM * Lp;  /* [ITEM, D], zero for padding */
    int64_t at[ITEM], limit[ITEM], last = 0;
    for (int64_t t = 0; t < ITEM; t++) {
        const int64_t j = m0 + t;
        at[t] = j < M ? ((j / Q) * H + h) * Q + j % Q : -1;
        limit[t] = j < M ? (causal_base + j / Q + 1 < L ? causal_base + j / Q + 1 : L) : 0;
        if (at[t] >= 0) memcpy(queries + t * D, q + (j / Q) * q_stride + (h * Q + j % Q) * D, (size_t)D * 4);
        else memset(queries + t * D, 0, (size_t)D * 4);
        if (limit[t] > last) last = limit[t];
    }
    /* Keys scored: up to the vector holding the last key seen (a decode group's 400-key prefix took
       448 in whole 4-vector blocks, 12% more score work). */
    const int64_t span = (last + VL - 1) / VL * VL;  /* <= Lp */
    float top[ITEM];
    for (int64_t t0 = 0; t0 < ITEM; t0 += ROWS) {
        if (at[t0] < 0) break;  /* padding only at the end */
        vf best[ROWS];
        float tail[ROWS];
        for (int j = 0; j < ROWS; j++) best[j] = splat(-INFINITY), tail[j] = -INFINITY;
        for (int64_t k0 = 0; k0 < span; k0 += KEY_STEP) {
            const float* kt = keys + k0 * D;  /* vector c of this block at kt + c * D * VL */
            float* rows = scores + t0 * Lp + k0;
#define SCORE_BLOCK(NV) score_block(queries + t0 * D, kt, D, scale, rows, Lp, k0, limit + t0, best, tail, NV)
            switch ((span - k0) / VL) {  /* a compile-time vector count for each */
                case 1: SCORE_BLOCK(1); break;
                case 2: SCORE_BLOCK(2); break;
                case 3: SCORE_BLOCK(3); break;
                default: SCORE_BLOCK(4); break;
            }
#undef SCORE_BLOCK
        }
        for (int j = 0; j < ROWS; j++) {
            const float m = hmax(best[j]);
            top[t0 + j] = m > tail[j] ? m : tail[j];
        }
    }
    /* softmax: probabilities in place, exactly zero past each query's limit */
    float inverse[ITEM];
    for (int64_t t = 0; t < ITEM; t++) {
        if (at[t] < 0) continue;
        float* s = scores + t * Lp;
        const vf top_v = splat(top[t]);
        vf sum = splat(0.0f);
        int64_t key = 0;
        for (; key + VL <= limit[t]; key += VL) {
            const vf e = vexp(load_f32(s + key) - top_v);
            store_f32(s + key, e);
            sum += e;
        }
        float rest = 0.0f;
        for (; key < limit[t]; key++) rest += s[key] = expf(s[key] - top[t]);
        memset(s + limit[t], 0, (size_t)(span - limit[t]) * 4);
        const float total = hsum(sum) + rest;
        inverse[t] = 1.0f / total;
        if (lse) lse[at[t]] = top[t] + logf(total);  /* the scores are scaled already */
    }
    /* P x V: QB queries' D / VL output vectors in registers, V rows read from the cache */
    const int VECS = (int)(D / VL), QB = VECS >= PV_ACC ? 1 : PV_ACC / VECS;  /* QB * VECS <= PV_ACC accumulators */
    for (int64_t t0 = 0; t0 < ITEM; t0 += QB) {
        if (at[t0] < 0) break;
        int64_t keys_seen = 0;
        for (int j = 0; j < QB; j++)
            if (limit[t0 + j] > keys_seen) keys_seen = limit[t0 + j];
        vf acc[PV_ACC];
        for (int i = 0; i < QB * VECS; i++) acc[i] = splat(0.0f);
        for (int64_t first = 0; first < keys_seen; first += BS) {  /* block by block: no division a key */
            const float* block = kv_at(vc, blocks, layout, BS, h, first);
            const int64_t count = keys_seen - first < BS ? keys_seen - first : BS;
            for (int64_t i = 0; i < count; i++) {
                vf row[16];
                for (int e = 0; e < VECS; e++) row[e] = HOLD(load_f32(block + i * layout.row + e * VL));
                for (int j = 0; j < QB; j++) {
                    const vf p = splat(scores[(t0 + j) * Lp + first + i]);
                    for (int e = 0; e < VECS; e++) acc[j * VECS + e] += p * row[e];
                }
            }
        }
        for (int j = 0; j < QB; j++) {
            if (at[t0 + j] < 0) continue;
            for (int e = 0; e < VECS; e++)
                store_f32(out + at[t0 + j] * D + e * VL, acc[j * VECS + e] * inverse[t0 + j]);
        }
    }
}

#define CAUSAL_ITEM(DIM) causal_item(q, q_stride, vc, blocks, cache, h, m0, n, H, Q, DIM, BS, L, Lp, causal_base, \
                                     scale, packed + h * Lp * DIM, out, lse)

/* L keys along `blocks`; query token i sees the first min(causal_base + i + 1, L) of them (a prefill
 * chunk: L = causal_base + n; a decode group's shared prefix: causal_base = L, every query sees all).
 * lse (NULL: not written) gets each query's log-sum-exp of its scaled scores, [n, H, Q]. */
void causal_attention_f32(const float* q, const float* kc, const float* vc, const int64_t* blocks, int64_t n,
                          int64_t H, int64_t Q, int64_t D, int64_t BS, int64_t causal_base, int64_t L,
                          int64_t q_stride, float scale, float* packed, float* out, float* lse, int nt) {
    const int64_t Lp = (L + KEY_STEP - 1) / KEY_STEP * KEY_STEP;
    const int64_t tiles = (n * Q + ITEM - 1) / ITEM;
    const kv_layout cache = {H * BS * D, BS * D, D};
    const int64_t vectors = (L + VL - 1) / VL;  /* packed: the key vectors scores read, not all of Lp */
    #pragma omp parallel num_threads(nt)
    {
        #pragma omp for schedule(static)
        for (int64_t unit = 0; unit < H * vectors; unit++) {
            const int64_t h = unit / vectors, c = unit % vectors;
            pack_key_vector(kc, blocks, cache, h, D, BS, L, c, packed + (h * Lp + c * VL) * D);
        }
        /* the last tiles (the longest rows of the triangle) first, so no thread ends with one */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < H * tiles; item++) {
            const int64_t h = item % H, m0 = (tiles - 1 - item / H) * ITEM;
            switch (D) {
                case 32: CAUSAL_ITEM(32); break;
                case 64: CAUSAL_ITEM(64); break;
                case 96: CAUSAL_ITEM(96); break;
                default: CAUSAL_ITEM(128); break;
            }
        }
    }
}

#define PACKED_ITEM(DIM) causal_item(q + first * q_stride, q_stride, v, starts + s, v_layout, h, m0, L, H, Q, DIM, \
                                     L, L, Lp, causal ? 0 : L, scale, packed + packed_at[s] + h * Lp * DIM, \
                                     out + first * H * Q * DIM, NULL)

/* Packed sequences (an embedding pass): S sequences laid end to end, sequence s the tokens
 * starts[s] .. starts[s + 1] - 1, each attending only to itself, bidirectionally (causal = 0: every
 * query sees all L keys, as a decode group's prefix above) or causally (causal = 1). The items above
 * with each sequence as a chunk of its own and one block (its first token: starts[s]), its K/V read
 * where the projection wrote them (rows k_stride and v_stride floats apart). `rows` is unused. `packed_at` and
 * `item_at` (S + 1 offsets into `packed` and prefix counts of items) come from the caller.
 * q, out [T, H, Q, D] (q's rows q_stride apart). */
void packed_attention_f32(const float* q, const float* k, const float* v, const int64_t* starts,
                          const int64_t* packed_at, const int64_t* item_at, const int64_t* rows, int64_t S, int64_t H,
                          int64_t Q, int64_t D, int64_t q_stride, int64_t k_stride, int64_t v_stride, int64_t causal,
                          float scale, float* packed, float* out, int nt) {
    const kv_layout k_layout = {k_stride, D, k_stride}, v_layout = {v_stride, D, v_stride};
    #pragma omp parallel num_threads(nt)
    {
        #pragma omp for schedule(dynamic, 4)
        for (int64_t unit = 0; unit < S * H; unit++) {
            const int64_t s = unit / H, h = unit % H, first = starts[s], L = starts[s + 1] - first;
            const int64_t Lp = (L + KEY_STEP - 1) / KEY_STEP * KEY_STEP;
            for (int64_t c = 0; c < (L + VL - 1) / VL; c++)
                pack_key_vector(k, starts + s, k_layout, h, D, L, L, c, packed + packed_at[s] + (h * Lp + c * VL) * D);
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < item_at[S]; item++) {
            const int64_t s = sequence_of_item(item_at, S, item), first = starts[s], L = starts[s + 1] - first;
            const int64_t Lp = (L + KEY_STEP - 1) / KEY_STEP * KEY_STEP, tiles = (L * Q + ITEM - 1) / ITEM;
            const int64_t local = item - item_at[s], h = local / tiles, m0 = local % tiles * ITEM;
            switch (D) {
                case 32: PACKED_ITEM(32); break;
                case 64: PACKED_ITEM(64); break;
                case 96: PACKED_ITEM(96); break;
                default: PACKED_ITEM(128); break;
            }
        }
    }
}
