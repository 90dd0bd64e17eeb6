/* Paged decode attention for CPUs, reading K/V straight from the paged cache.
 *
 * PyTorch needs each request's blocks gathered into one tensor before its attention kernel runs,
 * and its kernels are built for long queries; a decode step has one query token per request and
 * is memory-bound. Here one work item = up to HEADS kv heads and up to QCHUNK of the queries that
 * read each: the query heads of that kv head (GQA) of one row, or of a run of consecutive rows that
 * read the same blocks (a speculative verification's positions, a prefill chunk's tokens), whose
 * K/V it then reads once for all of them. With many rows an item takes all of a row's kv heads,
 * block by block: a block's heads lie side by side and a row's blocks mostly follow each other
 * (handed out in order), so its K and V are read as two sequential streams the hardware prefetcher
 * follows, where a head at a time read 2 KB runs 6 KB apart (SmolLM2 bf16, 256 rows x 480 keys:
 * 4.70 -> 4.01 ms a layer, with the prefetches below; fp32 3-4%). With few rows, one head per
 * item, so every thread has work. It walks the blocks through the block table once, VL keys at a
 * time: their scores (a shuffle tree puts VL keys' scores in one vector: no horizontal sum per
 * key), their probabilities against each query's running max (an online softmax, as
 * flash-decoding does: sums so far are rescaled when the max grows), then their values. Each
 * key's turn also prefetches its share of a block a few on, so K and V stream in at an
 * even pace while the core computes; the earlier two passes (every score, then the values), with
 * whole blocks prefetched at once, left the memory idle during the values pass and the core
 * stalled on its line-fill buffers: the products and the stream added up instead of overlapping
 * (SmolLM2, 64 rows x 700 keys a layer: bf16 2.24 -> 2.00 ms, fp32 3.57 -> 3.14; 16 x 2,000: bf16
 * 1.62 -> 1.37, fp32 2.81 -> 2.31). It writes the output and each query's log-sum-exp. K/V are
 * stored fp32 or bf16; scores, softmax and the weighted sum are fp32, the output is rounded once
 * (to nearest even) to the storage dtype. A row may start from a partial result (init_out,
 * init_lse: its shared prefix's attention), which starts its softmax state, so the cascade's two
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

/* The most kv heads one item reads (its softmax states live on the stack: HEADS x QCHUNK queries). */
#define HEADS 4

/* How many blocks ahead of the one it reads an item fetches K and V: an item of one head 2 (1, 3
 * or 4 were 1-8% slower), an item of several 1 (its blocks are several heads long: 2-5% faster
 * than 2); and to which cache level where it reads several heads: L2 (prefetcht1) rather than L1,
 * whose few fill buffers the demand loads need (bf16 3% faster; one head: 7% slower). */
#define BLOCKS_AHEAD 2
#define HEADS_BLOCKS_AHEAD 1
#define AHEAD_LOCALITY 2

/* Blocks [from, to) (none past `end`) of kv head h of `cache` into cache; block_bytes: a head's block. */
static inline void prefetch_blocks(const void* cache, const int64_t* table, int64_t from, int64_t to,
                                   int64_t end, int64_t H, int64_t h, int64_t block_bytes) {
    for (int64_t b = from; b < to && b < end; b++) {
        const char* block = (const char*)cache + (table[b] * H + h) * block_bytes;
        for (int64_t byte = 0; byte < block_bytes; byte += 64) __builtin_prefetch(block + byte);
    }
}

/* One work item: kv heads [h0, h0 + nh), each block's one after the other, and queries [q0, q0 + nq)
 * of each, of a run of rows that read the same blocks
 * (`table`, the run's longest row's). Query i of the run is query i % Q of the run's row i / Q, and
 * sees that row's tokens [first[row], ntok[row]). NV = head_dim / VL. One pass over the blocks
 * (an online softmax, as flash-decoding does): VL keys' scores, then their probabilities against
 * each query's running max (its sums rescaled when the max grows), then their values, while later
 * blocks stream in (see the top of the file for why one pass). A token a query
 * does not see scores -inf and a group of VL it sees none of is skipped for it: its sums get exact
 * zeros or nothing, so a query's result is the same bits in a run of any length (or alone). */
#define DEFINE_ITEM(NAME, NV, MAXH)                                                                          \
static inline __attribute__((always_inline)) void NAME(                                                \
    const void* q, const void* kc, const void* vc, const int64_t* table, const int64_t* ntok,          \
    const int64_t* first, int64_t run, int64_t h0, int64_t nh, int64_t q0, int64_t nq, int64_t H, int64_t Q, \
    int64_t BS, float scale, const void* init_out, const float* init_lse, void* out, float* lse,       \
    const int bf16) {                                                                                  \
    const int64_t D = NV * VL;                                                                         \
    int64_t at[MAXH][QCHUNK], from[QCHUNK], upto[QCHUNK], t0 = INT64_MAX, n = 0;                      \
    for (int64_t g = 0; g < nq; g++) {                                                                 \
        const int64_t r = run + (q0 + g) / Q;                                                          \
        for (int64_t hh = 0; hh < nh; hh++) at[hh][g] = (r * H + h0 + hh) * Q + (q0 + g) % Q;          \
        from[g] = first[r];                                                                            \
        upto[g] = ntok[r];                                                                             \
        if (from[g] < t0) t0 = from[g];                                                                \
        if (upto[g] > n) n = upto[g];                                                                  \
    }                                                                                                  \
    /* each query's softmax state: running max m, sum lsum (per lane), weighted sum acc; a prefix */   \
    /* partial result starts it at (its lse, 1, its output) */                                         \
    vf head_qv[MAXH][QCHUNK][NV], head_acc[MAXH][QCHUNK][NV], head_lsum[MAXH][QCHUNK];              \
    float head_m[MAXH][QCHUNK];                                                                       \
    for (int64_t hh = 0; hh < nh; hh++) {                                                              \
        for (int64_t g = 0; g < nq; g++) {                                                             \
            const int64_t row = at[hh][g];                                                             \
            const int resume = init_lse != NULL && init_lse[row] > -INFINITY;                          \
            for (int c = 0; c < NV; c++) {                                                             \
                head_qv[hh][g][c] = load_vec(q, row * D + c * VL, bf16) * scale;                       \
                head_acc[hh][g][c] = resume ? load_vec(init_out, row * D + c * VL, bf16) : splat(0.0f); \
            }                                                                                          \
            head_m[hh][g] = resume ? init_lse[row] : -INFINITY;                                        \
            head_lsum[hh][g] = splat(0.0f);                                                            \
            head_lsum[hh][g][0] = resume ? 1.0f : 0.0f;                                                \
        }                                                                                              \
    }                                                                                                  \
    vf lane;                                                                                           \
    for (int i = 0; i < VL; i++) lane[i] = (float)i;                                                   \
    const int64_t end_block = (n + BS - 1) / BS, key_bytes = D * (bf16 ? 2 : 4), block_bytes = BS * key_bytes; \
    const int64_t blocks_ahead = MAXH > 1 ? HEADS_BLOCKS_AHEAD : BLOCKS_AHEAD;                         \
    for (int64_t b = t0 / BS; b < end_block; b++) {                                                    \
        if (b == t0 / BS) for (int64_t hh = 0; hh < nh; hh++) {                                        \
            prefetch_blocks(kc, table, b, b + blocks_ahead, end_block, H, h0 + hh, block_bytes);       \
            prefetch_blocks(vc, table, b, b + blocks_ahead, end_block, H, h0 + hh, block_bytes);       \
        }                                                                                              \
        for (int64_t hh = 0; hh < nh; hh++) {                                                          \
            const int64_t h = h0 + hh;                                                                 \
            vf(*restrict qv)[NV] = head_qv[hh], (*restrict acc)[NV] = head_acc[hh];                    \
            vf* restrict lsum = head_lsum[hh];                                                         \
            float* restrict m = head_m[hh];                                                            \
            const int64_t ahead = b + blocks_ahead < end_block                                         \
                ? (table[b + blocks_ahead] * H + h) * block_bytes : -1;  /* its byte offset, or none */ \
            const int64_t off = (table[b] * H + h) * BS * D;                                           \
            const int64_t lo = t0 > b * BS ? t0 - b * BS : 0, hi = n - b * BS < BS ? n - b * BS : BS;  \
            for (int64_t ts = lo / VL * VL; ts < hi; ts += VL) {                                       \
                /* scores of VL keys: a dot-product vector per key and query, then the lane tree */    \
                vf s[QCHUNK], dots[QCHUNK][VL];                                                        \
                for (int t = 0; t < VL; t++) {                                                         \
                    vf kv[NV];                                                                         \
                    for (int c = 0; c < NV; c++) kv[c] = load_vec(kc, off + (ts + t) * D + c * VL, bf16); \
                    for (int64_t g = 0; g < nq; g++) {                                                 \
                        vf a = qv[g][0] * kv[0];                                                       \
                        for (int c = 1; c < NV; c++) a += qv[g][c] * kv[c];                            \
                        dots[g][t] = a;                                                                \
                    }                                                                                  \
                }                                                                                      \
                for (int64_t g = 0; g < nq; g++) s[g] = reduce_lanes(dots[g]);                         \
                /* probabilities of these VL keys, each query against its running max */               \
                const vf pos = lane + (float)(b * BS + ts);                                            \
                float w[QCHUNK][VL];                                                                   \
                for (int64_t g = 0; g < nq; g++) {                                                     \
                    const vi32 visible = (pos >= (float)from[g]) & (pos < (float)upto[g]);             \
                    const vf sg = vselect(visible, s[g], splat(-INFINITY));                            \
                    const float top = hmax(sg);                                                        \
                    if (top == -INFINITY) {  /* sees none of them */                                   \
                        memset(w[g], 0, sizeof w[g]);                                                  \
                        continue;                                                                      \
                    }                                                                                  \
                    if (top > m[g]) {  /* a new max: what was summed so far shrinks by exp(old - new) */ \
                        const float shrink = vexp(splat(m[g] - top))[0] * (m[g] > -INFINITY);          \
                        for (int c = 0; c < NV; c++) acc[g][c] *= shrink;                              \
                        lsum[g] *= shrink;                                                             \
                        m[g] = top;                                                                    \
                    }                                                                                  \
                    const vf p = vselect(visible, vexp(sg - m[g]), splat(0.0f));                       \
                    lsum[g] += p;                                                                      \
                    store_f32(w[g], p);                                                                \
                }                                                                                      \
                /* and their values (only the keys of the block's range: slots past it hold no value) */ \
                const int64_t t_end = ts + VL < hi ? ts + VL : hi;                                     \
                for (int64_t t = ts > lo ? ts : lo; t < t_end; t++) {                                  \
                    /* this key's share of block b + blocks_ahead's K and V: a whole block's prefetches \
                     * at once would stall the core on its few line-fill buffers */                    \
                    for (int64_t byte = t * key_bytes / 64 * 64; ahead >= 0 && byte < (t + 1) * key_bytes; \
                         byte += 64) {                                                                 \
                        if (MAXH > 1) {                                                                \
                            __builtin_prefetch((const char*)kc + ahead + byte, 0, AHEAD_LOCALITY);     \
                            __builtin_prefetch((const char*)vc + ahead + byte, 0, AHEAD_LOCALITY);     \
                        } else {                                                                       \
                            __builtin_prefetch((const char*)kc + ahead + byte);                        \
                            __builtin_prefetch((const char*)vc + ahead + byte);                        \
                        }                                                                              \
                    }                                                                                  \
                    vf vv[NV];                                                                         \
                    for (int c = 0; c < NV; c++) vv[c] = load_vec(vc, off + t * D + c * VL, bf16);     \
                    for (int64_t g = 0; g < nq; g++) {                                                 \
                        const float wt = w[g][t - ts];                                                 \
                        for (int c = 0; c < NV; c++) acc[g][c] += wt * vv[c];                          \
                    }                                                                                  \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    for (int64_t hh = 0; hh < nh; hh++) {                                                              \
        for (int64_t g = 0; g < nq; g++) {                                                             \
            const int64_t row = at[hh][g];                                                             \
            const float l = hsum(head_lsum[hh][g]), inv = 1.0f / l;                                    \
            for (int c = 0; c < NV; c++) {                                                             \
                const vf o = head_acc[hh][g][c] * inv;                                                 \
                if (bf16) store_bf16((uint16_t*)out + row * D + c * VL, o);                            \
                else store_f32((float*)out + row * D + c * VL, o);                                     \
            }                                                                                          \
            lse[row] = head_m[hh][g] + logf(l);                                                        \
        }                                                                                              \
    }                                                                                                  \
}

/* per head size: items of one head (their states sized for one: 10% faster there), and of up to HEADS */
DEFINE_ITEM(item_d16, 16 / VL, 1)
DEFINE_ITEM(item_d32, 32 / VL, 1)
DEFINE_ITEM(item_d64, 64 / VL, 1)
DEFINE_ITEM(item_d80, 80 / VL, 1)
DEFINE_ITEM(item_d96, 96 / VL, 1)
DEFINE_ITEM(item_d128, 128 / VL, 1)
DEFINE_ITEM(heads_d16, 16 / VL, HEADS)
DEFINE_ITEM(heads_d32, 32 / VL, HEADS)
DEFINE_ITEM(heads_d64, 64 / VL, HEADS)
DEFINE_ITEM(heads_d80, 80 / VL, HEADS)
DEFINE_ITEM(heads_d96, 96 / VL, HEADS)
DEFINE_ITEM(heads_d128, 128 / VL, HEADS)

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

/* Work items of a call: (run, first kv head, first query of the chunk), runs in order. */
static __thread int64_t* item_buffer = NULL;
static __thread int64_t item_capacity = 0;

static inline __attribute__((always_inline)) void attend(
    const void* q, const void* kc, const void* vc, const int64_t* tables, int64_t ts,
    const int64_t* ntok, const int64_t* first, int64_t R, int64_t H, int64_t Q, int64_t D, int64_t BS,
    float scale, const void* init_out, const float* init_lse, void* out, float* lse, int nt, const int bf16) {
    int64_t* runs = (int64_t*)thread_scratch((void**)&item_buffer, &item_capacity,
                                             (2 * R + 3 * R * H * ((Q + QCHUNK - 1) / QCHUNK + 1)) * 8);
    int64_t* run_longest = runs + R;
    int64_t* items = runs + 2 * R;
    const int64_t num_runs = find_runs(tables, ts, ntok, R, BS, runs, run_longest);
    /* a row's heads together pay from a few runs per thread on (fewer would leave threads idle:
     * 2 or 4 rows were 1.5x slower) */
    const int64_t heads = num_runs >= 8 * nt ? (H < HEADS ? H : HEADS) : 1;
    int64_t num_items = 0;
    for (int64_t u = 0; u < num_runs; u++) {
        const int64_t rows = (u + 1 < num_runs ? runs[u + 1] : R) - runs[u];
        for (int64_t h = 0; h < H; h += heads)
            for (int64_t q0 = 0; q0 < rows * Q; q0 += QCHUNK) {
                items[3 * num_items] = u;
                items[3 * num_items + 1] = h;
                items[3 * num_items + 2] = q0;
                num_items++;
            }
    }
    #pragma omp parallel for schedule(dynamic, 4) num_threads(nt)
    for (int64_t item = 0; item < num_items; item++) {
        const int64_t u = items[3 * item], h = items[3 * item + 1], q0 = items[3 * item + 2];
        const int64_t rows = (u + 1 < num_runs ? runs[u + 1] : R) - runs[u];
        const int64_t nq = rows * Q - q0 < QCHUNK ? rows * Q - q0 : QCHUNK;
        const int64_t* table = tables + run_longest[u] * ts;
        const int64_t nh = H - h < heads ? H - h : heads;
#define ITEM(FN) FN(q, kc, vc, table, ntok, first, runs[u], h, nh, q0, nq, H, Q, BS, scale, init_out, init_lse, \
                    out, lse, bf16)
#define ITEMS(KIND)                                  \
        switch (D) {                                 \
            case 16: ITEM(KIND##_d16); break;        \
            case 32: ITEM(KIND##_d32); break;        \
            case 64: ITEM(KIND##_d64); break;        \
            case 80: ITEM(KIND##_d80); break;        \
            case 96: ITEM(KIND##_d96); break;        \
            default: ITEM(KIND##_d128); break;       \
        }
        if (nh == 1) ITEMS(item) else ITEMS(heads)
#undef ITEMS
#undef ITEM
    }
}

void decode_attention_f32(const void* q, const void* kc, const void* vc, const int64_t* t, int64_t ts,
                          const int64_t* n, const int64_t* f, int64_t R, int64_t H, int64_t Q, int64_t D,
                          int64_t BS, float sc, const void* init_out, const float* init_lse, void* o,
                          float* lse, int nt) {
    attend(q, kc, vc, t, ts, n, f, R, H, Q, D, BS, sc, init_out, init_lse, o, lse, nt, 0);
}
void decode_attention_bf16(const void* q, const void* kc, const void* vc, const int64_t* t, int64_t ts,
                           const int64_t* n, const int64_t* f, int64_t R, int64_t H, int64_t Q, int64_t D,
                           int64_t BS, float sc, const void* init_out, const float* init_lse, void* o,
                           float* lse, int nt) {
    attend(q, kc, vc, t, ts, n, f, R, H, Q, D, BS, sc, init_out, init_lse, o, lse, nt, 1);
}
int kernel_abi_version(void) { return 19; }
int kernel_vector_lanes(void) { return VL; }
