/* Paged decode attention for CPUs, reading K/V straight from the paged cache.
 *
 * PyTorch needs each request's blocks gathered into one tensor before its attention kernel runs,
 * and its kernels are built for long queries; a decode step has one query token per request and
 * is memory-bound. Here one work item = one kv head and up to QCHUNK of the queries that read it:
 * the query heads of that kv head (GQA) of one row, or of a run of consecutive rows that read the
 * same blocks (a speculative verification's positions, a prefill chunk's tokens), whose K/V it
 * then reads once for all of them. It walks the blocks through the block table twice: scores
 * first, VL tokens at a time (a shuffle tree puts VL tokens' scores in one vector: no horizontal
 * sum per token), then, with the softmax's max known, the weighted sum of V. It writes the output
 * and each query's log-sum-exp. K/V are stored fp32 or bf16; scores, softmax and the weighted sum
 * are fp32, the output is rounded once (to nearest even) to the storage dtype. On AMX (bf16 K, head
 * dims a multiple of 32) the scores of 16 keys come from tile products instead: K's rows are the A
 * operand as they lie in the cache, the item's queries (bf16, as stored) the B operand, so a block
 * costs one tile load and product per 32 dims where the vector path spent a product and a lane tree
 * per key and query: pass 1 in half the time, the kernel ~8% faster on SmolLM2's decode shapes
 * (64 rows x 700 keys: 2.26 -> 2.08 ms a layer), where the K/V stream is now most of it. A row may start
 * from a partial result (init_out, init_lse: its shared prefix's attention), so the cascade's two
 * parts merge inside the softmax instead of in a pass of their own.
 *
 * Layout: q [R, H, Q, D]; cache [blocks, H, BS, D]; block_tables [R, W]; row r reads its tokens
 * [first_token[r], num_tokens[r]) counted along its table row. Needs D in {16, 32, 64, 80, 96, 128}
 * (a multiple of VL) and BS a multiple of VL (the Python side checks, and falls back to PyTorch
 * otherwise).
 */
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define QCHUNK 8

/* Scores of one work item, per query: a buffer per thread, grown as contexts grow. */
static __thread void* score_buffer = NULL;
static __thread int64_t score_capacity = 0;

static float* scores_for(int64_t floats) {
    return (float*)thread_scratch(&score_buffer, &score_capacity, floats * (int64_t)sizeof(float));
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define DECODE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Set once the process holds AMX's tile state: Linux grants it only on request
 * (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); asking twice is harmless. */
static int amx_granted = 0;

/* want 1: score on AMX from now on, where Linux grants it; 0: on vectors. Returns what is in use. */
int decode_attention_use_amx(int want) {
    amx_granted = want && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_granted;
}

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} decode_tile_config;

/* tmm0: the 16 x 16 scores (keys x queries, fp32); tmm1-3: 16 keys x 32 dims; tmm4-7: the queries,
 * 32 dims each, as pairs (B operand). Every tile 16 rows of 64 bytes. */
static void configure_decode_tiles(void) {
    decode_tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

/* 16 keys (rows of D bf16 at `keys`) against the queries loaded in tmm4.. : tmm0 = their dot
 * products, stored to c[key][query]. The A tile alternates over tmm1-3 so a load need not wait
 * for the product reading the previous one. */
static inline __attribute__((always_inline)) void key_scores_amx(const uint16_t* keys, int64_t D, float* c) {
    _tile_zero(0);
    _tile_loadd(1, keys, D * 2);
    _tile_dpbf16ps(0, 1, 4);
    if (D > 32) { _tile_loadd(2, keys + 32, D * 2); _tile_dpbf16ps(0, 2, 5); }
    if (D > 64) { _tile_loadd(3, keys + 64, D * 2); _tile_dpbf16ps(0, 3, 6); }
    if (D > 96) { _tile_loadd(1, keys + 96, D * 2); _tile_dpbf16ps(0, 1, 7); }
    _tile_stored(0, c, 64);
}

/* Pass 1 of an item on AMX: every score of queries at[0..nq) (pointing into q) over tokens
 * [t0, n), as the vector path writes them (scaled, -inf where a query does not see the token),
 * and each query's running max in top. D a multiple of 32, at most 128; nq at most 16. */
static inline __attribute__((always_inline)) void scores_amx(
    const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table, const int64_t* at,
    const int64_t* from, const int64_t* upto, int64_t nq, int64_t h, int64_t H, int64_t BS, int64_t D,
    int64_t t0, int64_t n, int64_t base, int64_t span, float scale, float* scores, vf* top) {
    uint32_t pairs[4][256] __attribute__((aligned(64)));
    float c[256] __attribute__((aligned(64)));
    memset(pairs, 0, (size_t)(D / 32) * sizeof pairs[0]);
    for (int64_t g = 0; g < nq; g++) {  /* tile d, row i, column g = pair i of dims 32d.. of query g */
        const uint32_t* query = (const uint32_t*)(q + at[g] * D);
        for (int64_t d = 0; d < D / 32; d++)
            for (int64_t i = 0; i < 16; i++) pairs[d][i * 16 + g] = query[d * 16 + i];
    }
    _tile_loadd(4, pairs[0], 64);
    if (D > 32) _tile_loadd(5, pairs[1], 64);
    if (D > 64) _tile_loadd(6, pairs[2], 64);
    if (D > 96) _tile_loadd(7, pairs[3], 64);
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                                13, 14, 15), _mm512_set1_epi32(16));
    vf lane;
    for (int i = 0; i < 16; i++) lane[i] = (float)i;
    for (int64_t b = t0 / BS; b * BS < n; b++) {
        const int64_t off = (table[b] * H + h) * BS * D;
        /* K two blocks ahead, and V (read by pass 2, from this core's L2 then): the loads are
         * what a decode item waits on, not the products */
        for (int64_t ahead = 1; ahead <= 2 && (b + ahead) * BS < n; ahead++) {
            const int64_t next = (table[b + ahead] * H + h) * BS * D;
            for (int64_t e = 0; e < BS * D; e += 32) {
                __builtin_prefetch(kc + next + e);
                if (ahead == 2) __builtin_prefetch(vc + next + e);
            }
        }
        const int64_t lo = t0 > b * BS ? t0 - b * BS : 0, hi = n - b * BS < BS ? n - b * BS : BS;
        for (int64_t ts = lo / 16 * 16; ts < hi; ts += 16) {
            key_scores_amx(kc + off + ts * D, D, c);
            const vf pos = lane + (float)(b * BS + ts);
            for (int64_t g = 0; g < nq; g++) {
                const vf dots = (vf)_mm512_i32gather_ps(column, c + g, 4) * scale;
                const vi32 visible = (pos >= (float)from[g]) & (pos < (float)upto[g]);
                const vf s = vselect(visible, dots, splat(-INFINITY));
                top[g] = vmax(top[g], s);
                store_f32(scores + g * span + b * BS + ts - base, s);
            }
        }
    }
}
#else
int decode_attention_use_amx(int want) { (void)want; return 0; }
/* Never called without AMX (amx is 0 there): present so the item compiles the same everywhere. */
static inline void scores_amx(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                              const int64_t* at, const int64_t* from, const int64_t* upto, int64_t nq,
                              int64_t h, int64_t H, int64_t BS, int64_t D, int64_t t0, int64_t n,
                              int64_t base, int64_t span, float scale, float* scores, vf* top) {
    (void)q; (void)kc; (void)vc; (void)table; (void)at; (void)from; (void)upto; (void)nq; (void)h; (void)H;
    (void)BS; (void)D; (void)t0; (void)n; (void)base; (void)span; (void)scale; (void)scores; (void)top;
    abort();
}
#endif

/* One work item: kv head h and queries [q0, q0 + nq) of a run of rows that read the same blocks
 * (`table`, the run's longest row's). Query i of the run is query i % Q of the run's row i / Q, and
 * sees that row's tokens [first[row], ntok[row]). NV = head_dim / VL. Two passes: every score first
 * (kept in the thread's buffer), so the softmax's max is known before any exp and nothing is
 * rescaled block by block; then the weighted sum of V. A token a query does not see scores -inf:
 * it adds exact zeros to that query's sums, so a query's result is the same bits in a run of any
 * length (or alone). */
#define DEFINE_ITEM(NAME, NV)                                                                          \
static inline __attribute__((always_inline)) void NAME(                                               \
    const void* q, const void* kc, const void* vc, const int64_t* table, const int64_t* ntok,          \
    const int64_t* first, int64_t run, int64_t h, int64_t q0, int64_t nq, int64_t H, int64_t Q,       \
    int64_t BS, float scale, const void* init_out, const float* init_lse, void* out, float* lse,       \
    const int bf16, const int amx) {                                                                  \
    const int64_t D = NV * VL;                                                                        \
    int64_t at[QCHUNK], from[QCHUNK], upto[QCHUNK], t0 = INT64_MAX, n = 0;                            \
    for (int64_t g = 0; g < nq; g++) {                                                                \
        const int64_t r = run + (q0 + g) / Q;                                                         \
        at[g] = (r * H + h) * Q + (q0 + g) % Q;                                                       \
        from[g] = first[r];                                                                           \
        upto[g] = ntok[r];                                                                            \
        if (from[g] < t0) t0 = from[g];                                                               \
        if (upto[g] > n) n = upto[g];                                                                 \
    }                                                                                                 \
    const int64_t base = t0 / BS * BS, span = (n - base + VL - 1) / VL * VL;                          \
    float* scores = scores_for(nq * span);                                                            \
    vf qv[QCHUNK][NV], top[QCHUNK];                                                                   \
    for (int64_t g = 0; g < nq; g++) {                                                                \
        for (int c = 0; c < NV; c++) qv[g][c] = load_vec(q, at[g] * D + c * VL, bf16) * scale;       \
        top[g] = splat(-INFINITY);                                                                    \
        /* the whole VL-groups of the first block before the first visible token are not scored */   \
        for (int64_t i = 0; i < (t0 - base) / VL * VL; i++) scores[g * span + i] = -INFINITY;        \
    }                                                                                                 \
    vf lane;                                                                                          \
    for (int i = 0; i < VL; i++) lane[i] = (float)i;                                                  \
    /* pass 1: scores, VL tokens at a time (tile products on AMX; else one dot-product vector per */  \
    /* token, then the lane tree) */                                                                  \
    if (amx)                                                                                          \
        scores_amx((const uint16_t*)q, (const uint16_t*)kc, (const uint16_t*)vc, table, at, from, upto, \
                   nq, h, H, BS, D, t0, n, base, span, scale, scores, top);                           \
    else                                                                                              \
    for (int64_t b = t0 / BS; b * BS < n; b++) {                                                      \
        const int64_t off = (table[b] * H + h) * BS * D;                                              \
        for (int64_t ahead = 1; ahead <= 2; ahead++) {                                               \
            if ((b + ahead) * BS >= n) break;                                                         \
            const int64_t next = (table[b + ahead] * H + h) * BS * D * (bf16 ? 2 : 4);                \
            for (int64_t byte = 0; byte < BS * D * (bf16 ? 2 : 4); byte += 64) {                      \
                __builtin_prefetch((const char*)kc + next + byte);                                     \
                if (ahead == 2) __builtin_prefetch((const char*)vc + next + byte);                     \
            }                                                                                         \
        }                                                                                             \
        const int64_t lo = t0 > b * BS ? t0 - b * BS : 0, hi = n - b * BS < BS ? n - b * BS : BS;     \
        for (int64_t ts = lo / VL * VL; ts < hi; ts += VL) {                                          \
            vf dots[QCHUNK][VL];                                                                      \
            for (int t = 0; t < VL; t++) {                                                            \
                vf kv[NV];                                                                            \
                for (int c = 0; c < NV; c++) kv[c] = load_vec(kc, off + (ts + t) * D + c * VL, bf16); \
                for (int64_t g = 0; g < nq; g++) {                                                    \
                    vf a = qv[g][0] * kv[0];                                                          \
                    for (int c = 1; c < NV; c++) a += qv[g][c] * kv[c];                               \
                    dots[g][t] = a;                                                                   \
                }                                                                                     \
            }                                                                                         \
            const vf pos = lane + (float)(b * BS + ts);                                               \
            for (int64_t g = 0; g < nq; g++) {                                                        \
                const vi32 visible = (pos >= (float)from[g]) & (pos < (float)upto[g]);                \
                const vf s = vselect(visible, reduce_lanes(dots[g]), splat(-INFINITY));               \
                top[g] = vmax(top[g], s);                                                             \
                store_f32(scores + g * span + b * BS + ts - base, s);                                 \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
    /* the softmax: max (with a prefix partial's lse when continuing one), exp, sum */               \
    vf acc[QCHUNK][NV], lsum[QCHUNK];                                                                 \
    float m[QCHUNK];                                                                                  \
    for (int64_t g = 0; g < nq; g++) {                                                                \
        const int64_t row = at[g];                                                                    \
        const int resume = init_lse != NULL && init_lse[row] > -INFINITY;                             \
        m[g] = hmax(top[g]);                                                                          \
        if (resume && init_lse[row] > m[g]) m[g] = init_lse[row];                                     \
        /* a partial result's softmax state: (max = its lse, sum = 1, weighted sum = its output) */  \
        const float carry = resume ? vexp(splat(init_lse[row] - m[g]))[0] : 0.0f;                     \
        lsum[g] = splat(0.0f);                                                                        \
        lsum[g][0] = carry;                                                                           \
        for (int c = 0; c < NV; c++)                                                                  \
            acc[g][c] = resume ? load_vec(init_out, row * D + c * VL, bf16) * carry : splat(0.0f);    \
        float* sg = scores + g * span;                                                                \
        for (int64_t i = 0; i < span; i += VL) {                                                      \
            vf s;                                                                                     \
            memcpy(&s, sg + i, sizeof s);                                                             \
            const vf p = vselect(s > -INFINITY, vexp(s - m[g]), splat(0.0f));                         \
            lsum[g] += p;                                                                             \
            store_f32(sg + i, p);                                                                     \
        }                                                                                             \
    }                                                                                                 \
    /* pass 2: the weighted sum of V */                                                               \
    for (int64_t b = t0 / BS; b * BS < n; b++) {                                                      \
        const int64_t off = (table[b] * H + h) * BS * D;                                              \
        if ((b + 1) * BS < n) {                                                                       \
            const int64_t next = (table[b + 1] * H + h) * BS * D * (bf16 ? 2 : 4);                    \
            for (int64_t byte = 0; byte < BS * D * (bf16 ? 2 : 4); byte += 64)                        \
                __builtin_prefetch((const char*)vc + next + byte);                                     \
        }                                                                                             \
        const int64_t lo = t0 > b * BS ? t0 - b * BS : 0, hi = n - b * BS < BS ? n - b * BS : BS;     \
        for (int64_t t = lo; t < hi; t++) {                                                           \
            vf vv[NV];                                                                                \
            for (int c = 0; c < NV; c++) vv[c] = load_vec(vc, off + t * D + c * VL, bf16);            \
            for (int64_t g = 0; g < nq; g++) {                                                        \
                const float w = scores[g * span + b * BS + t - base];                                 \
                for (int c = 0; c < NV; c++) acc[g][c] += w * vv[c];                                  \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
    for (int64_t g = 0; g < nq; g++) {                                                                \
        const int64_t row = at[g];                                                                    \
        const float l = hsum(lsum[g]), inv = 1.0f / l;                                                \
        for (int c = 0; c < NV; c++) {                                                                \
            const vf o = acc[g][c] * inv;                                                             \
            if (bf16) store_bf16((uint16_t*)out + row * D + c * VL, o);                               \
            else store_f32((float*)out + row * D + c * VL, o);                                         \
        }                                                                                             \
        lse[row] = m[g] + logf(l);                                                                    \
    }                                                                                                 \
}

DEFINE_ITEM(item_d16, 16 / VL)
DEFINE_ITEM(item_d32, 32 / VL)
DEFINE_ITEM(item_d64, 64 / VL)
DEFINE_ITEM(item_d80, 80 / VL)
DEFINE_ITEM(item_d96, 96 / VL)
DEFINE_ITEM(item_d128, 128 / VL)

/* The blocks row r reads (up to its last token), counted along its table row. */
static inline int64_t blocks_read(const int64_t* ntok, int64_t r, int64_t BS) { return (ntok[r] + BS - 1) / BS; }

/* Runs of consecutive rows that read the same blocks: a verification's positions (one request's
 * table, one more token each), a prefill chunk's tokens. Row r joins the run when its blocks agree
 * with the run's longest row's on every block both read; the longest row's table is the run's.
 * Writes each run's first row and longest row; returns the number of runs. */
static int64_t find_runs(const int64_t* tables, int64_t ts, const int64_t* ntok, int64_t R, int64_t BS,
                         int64_t* run_first, int64_t* run_longest) {
    int64_t runs = 0;
    for (int64_t r = 0; r < R; r++) {
        if (runs > 0) {
            const int64_t longest = run_longest[runs - 1];
            const int64_t shared = blocks_read(ntok, r, BS) < blocks_read(ntok, longest, BS)
                                       ? blocks_read(ntok, r, BS) : blocks_read(ntok, longest, BS);
            if (memcmp(tables + r * ts, tables + longest * ts, (size_t)shared * sizeof *tables) == 0) {
                if (ntok[r] > ntok[longest]) run_longest[runs - 1] = r;
                continue;
            }
        }
        run_first[runs] = r;
        run_longest[runs] = r;
        runs++;
    }
    return runs;
}

/* Work items of a call: (run, kv head, first query of the chunk), runs in order. */
static __thread int64_t* item_buffer = NULL;
static __thread int64_t item_capacity = 0;

static inline __attribute__((always_inline)) void attend(
    const void* q, const void* kc, const void* vc, const int64_t* tables, int64_t ts,
    const int64_t* ntok, const int64_t* first, int64_t R, int64_t H, int64_t Q, int64_t D, int64_t BS,
    float scale, const void* init_out, const float* init_lse, void* out, float* lse, int nt, const int bf16,
    const int amx) {
    int64_t* runs = (int64_t*)thread_scratch((void**)&item_buffer, &item_capacity,
                                             (2 * R + 3 * R * H * ((Q + QCHUNK - 1) / QCHUNK + 1)) * 8);
    int64_t* run_longest = runs + R;
    int64_t* items = runs + 2 * R;
    const int64_t num_runs = find_runs(tables, ts, ntok, R, BS, runs, run_longest);
    int64_t num_items = 0;
    for (int64_t u = 0; u < num_runs; u++) {
        const int64_t rows = (u + 1 < num_runs ? runs[u + 1] : R) - runs[u];
        for (int64_t h = 0; h < H; h++)
            for (int64_t q0 = 0; q0 < rows * Q; q0 += QCHUNK) {
                items[3 * num_items] = u;
                items[3 * num_items + 1] = h;
                items[3 * num_items + 2] = q0;
                num_items++;
            }
    }
    #pragma omp parallel num_threads(nt)
    {
#ifdef DECODE_AMX
    if (amx) configure_decode_tiles();  /* each thread's tiles, released when its items are done */
#endif
    #pragma omp for schedule(dynamic, 4)
    for (int64_t item = 0; item < num_items; item++) {
        const int64_t u = items[3 * item], h = items[3 * item + 1], q0 = items[3 * item + 2];
        const int64_t rows = (u + 1 < num_runs ? runs[u + 1] : R) - runs[u];
        const int64_t nq = rows * Q - q0 < QCHUNK ? rows * Q - q0 : QCHUNK;
        const int64_t* table = tables + run_longest[u] * ts;
#define ITEM(FN) FN(q, kc, vc, table, ntok, first, runs[u], h, q0, nq, H, Q, BS, scale, init_out, init_lse, \
                    out, lse, bf16, amx)
        switch (D) {
            case 16: ITEM(item_d16); break;
            case 32: ITEM(item_d32); break;
            case 64: ITEM(item_d64); break;
            case 80: ITEM(item_d80); break;
            case 96: ITEM(item_d96); break;
            default: ITEM(item_d128); break;
        }
#undef ITEM
    }
#ifdef DECODE_AMX
    if (amx) _tile_release();
#endif
    }
}

void decode_attention_f32(const void* q, const void* kc, const void* vc, const int64_t* t, int64_t ts,
                          const int64_t* n, const int64_t* f, int64_t R, int64_t H, int64_t Q, int64_t D,
                          int64_t BS, float sc, const void* init_out, const float* init_lse, void* o,
                          float* lse, int nt) {
    attend(q, kc, vc, t, ts, n, f, R, H, Q, D, BS, sc, init_out, init_lse, o, lse, nt, 0, 0);
}
void decode_attention_bf16(const void* q, const void* kc, const void* vc, const int64_t* t, int64_t ts,
                           const int64_t* n, const int64_t* f, int64_t R, int64_t H, int64_t Q, int64_t D,
                           int64_t BS, float sc, const void* init_out, const float* init_lse, void* o,
                           float* lse, int nt) {
#ifdef DECODE_AMX
    if (amx_granted && D % 32 == 0)  /* whole 32-dim tiles */
        attend(q, kc, vc, t, ts, n, f, R, H, Q, D, BS, sc, init_out, init_lse, o, lse, nt, 1, 1);
    else
#endif
        attend(q, kc, vc, t, ts, n, f, R, H, Q, D, BS, sc, init_out, init_lse, o, lse, nt, 1, 0);
}
int kernel_abi_version(void) { return 13; }
int kernel_vector_lanes(void) { return VL; }
