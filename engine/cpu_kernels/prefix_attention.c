/* Shared-prefix ("cascade") attention for decode rows on AMX, reading K/V from the paged cache.
 *
 * A decode step's rows that share an instruction attend its blocks as one block of queries: for
 * a group of n rows and one kv head that is an [n * Q, D] x [D, L] product, softmax, then x
 * [L, D] (Q: the query heads reading that kv head). SDPA's CPU flash kernel does it at ~0.5
 * TFLOP/s in bf16 at head_dim 64 (it is built for long single sequences); AMX's tile product runs
 * the two products several times faster. Per (group, kv head), K is first packed once into the
 * tile layout (the VNNI pairs of 16 keys, transposed) and V into pairs of consecutive keys; then
 * each work item takes 32 queries: scores for all L keys (fp32, with each query's max read while
 * they are still in L1), the row softmax (fp32, the probabilities rounded to bf16 for the second
 * product, as SDPA's bf16 flash does), P x V with fp32 accumulation. Both products run as 2 x 2
 * tiles. Packing and items are split statically in the same order, so the thread that packed a
 * head's K/V computes most of its items (from its own L2: 30% faster than dynamic scheduling,
 * measured). It writes each query's output (bf16) and the log-sum-exp of its scaled scores, the
 * partial result the decode kernel then continues with the row's own blocks.
 *
 * Layout: q [R, H, Q, D] bf16, its rows q_stride elements apart (it may be a view of the QKV
 * projection); cache [blocks, H, BS, D] bf16; rows [groups * n] (the decode rows, group after group);
 * blocks [groups, k] (each group's shared blocks, all full: L = k * BS keys);
 * out [R, H, Q, D] and lse [R, H, Q] are written at those rows only. Needs D in {32, 64, 96, 128}
 * and BS a multiple of 16; `packed` holds groups * H * (L + L rounded up to 32) * D bf16.
 * Causal prefill runs through the same kernel (`causal_base` >= 0): a prefill chunk's tokens are
 * the rows of one group, its blocks (context and its own, already written) the keys, and query j
 * sees the first causal_base + j / Q + 1 of them; an item stops at the keys its last query sees.
 * SDPA's flash kernel does this at 0.25-0.5 TFLOP/s in bf16.
 * Built only where the compiler targets AMX (-march=native on such a CPU); elsewhere the library
 * says so through prefix_attention_available() and the engine keeps SDPA's kernel.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define HAVE_AMX 1
#endif
#if defined(HAVE_AMX) || (defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__))
#define HAVE_PREFIX_KERNEL 1
#endif

int prefix_attention_available(void) {
#if defined(HAVE_AMX)
    /* Linux grants a process AMX's tile state only on request (ARCH_REQ_XCOMP_PERM for
     * XFEATURE_XTILEDATA); oneDNN asks too, and asking twice is harmless. */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#elif defined(HAVE_PREFIX_KERNEL)
    return 1;
#else
    return 0;
#endif
}

/* Which products the kernel runs on: 1 AMX tiles, 2 AVX512-BF16 dot products, 0 none built. */
int prefix_attention_kind(void) {
#if defined(HAVE_AMX)
    return 1;
#elif defined(HAVE_PREFIX_KERNEL)
    return 2;
#else
    return 0;
#endif
}

#ifdef HAVE_PREFIX_KERNEL
#include <immintrin.h>

#ifdef HAVE_AMX

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tile_config;

/* Every tile 16 rows of 64 bytes: tmm0-3 accumulators, tmm4-5 queries or probabilities (the A
 * operands), tmm6-7 packed K or V (the B operands). */
static void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}
#endif

/* Per-thread scores/probabilities/output of one work item, grown as prefixes grow. */
static __thread void* item_buffer = NULL;
static __thread int64_t item_capacity = 0;

static char* item_scratch(int64_t bytes) {
    return (char*)thread_scratch(&item_buffer, &item_capacity, bytes);
}

/* K of 16 keys (rows of D bf16 = D / 2 pairs, key_pairs_apart pairs apart) as the B operand of the
 * scores product, one 16 x 16 tile of pairs per 32 dims: tile d, row i, column j = the pair
 * (2i, 2i + 1) of dims 32d.. of key j (a transpose of 32-bit pairs: one gather per row). */
static void pack_keys(const uint32_t* keys, int64_t key_pairs_apart, uint32_t* tiles, int64_t D) {
    const __m512i key_starts = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32((int)key_pairs_apart));
    for (int64_t row = 0; row < D / 2; row++)  /* row = d * 16 + i: pair 16d + i of every key */
        _mm512_storeu_si512(tiles + row * 16, _mm512_i32gather_epi32(key_starts, keys + row, 4));
}

/* V of 32 keys (`present` of them real, the rest zero) as the B operand of P x V, one tile per 16
 * dims: tile e, row i = for each of its 16 dims, the pair (key 2i, key 2i + 1). */
static void pack_values(const uint16_t* const* values, int64_t present, uint16_t* tiles, int64_t D) {
    static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_loadu_si512(order);
    for (int64_t e = 0; e < D / 16; e++)
        for (int64_t i = 0; i < 16; i++) {
            const __m256i even = 2 * i < present ? _mm256_loadu_si256((const __m256i*)(values[2 * i] + e * 16))
                                                 : _mm256_setzero_si256();
            const __m256i odd = 2 * i + 1 < present
                                    ? _mm256_loadu_si256((const __m256i*)(values[2 * i + 1] + e * 16))
                                    : _mm256_setzero_si256();
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1);
            _mm512_storeu_si512(tiles + (e * 16 + i) * 32, _mm512_permutexvar_epi16(interleave, both));
        }
}

/* A work item's per-thread buffers: scores and probabilities [32, L32], queries and fp32 output
 * sums [32, D]. */
typedef struct {
    float* scores;
    uint16_t* probs;
    uint16_t* queries;
    float* acc;
} item_space;

static item_space item_buffers(int64_t L32, int64_t D) {
    item_space space;
    space.scores = (float*)item_scratch(32 * L32 * 6 + 32 * D * 6);
    space.probs = (uint16_t*)(space.scores + 32 * L32);
    space.queries = space.probs + 32 * L32;
    space.acc = (float*)(space.queries + 32 * D);
    return space;
}

/* A work item's 32 queries (m0.. of group g, kv head h) copied into `queries` [32, D], zero for
 * padding past the group's M queries; each query's (row, head, q) index in `at` (-1: padding) and
 * its visible keys in `limit`. `causal_base` < 0: every query sees all L keys; else query j (of row
 * j / Q of the group) sees the first causal_base + j / Q + 1 keys (a prefill chunk after
 * causal_base tokens of context). Returns the most keys any query sees: the item computes only
 * those (the causal triangle's empty tiles are skipped). */
static int64_t gather_item_queries(const uint16_t* q, int64_t q_stride, const int64_t* rows, int64_t g, int64_t h,
                                   int64_t m0, int64_t n, int64_t H, int64_t Q, int64_t D, int64_t L,
                                   int64_t causal_base, uint16_t* queries, int64_t* at, int64_t* limit) {
    const int64_t M = n * Q;
    int64_t last = 0;
    for (int64_t t = 0; t < 32; t++) {
        const int64_t j = m0 + t;
        const int64_t row = j < M ? rows[g * n + j / Q] : -1;
        at[t] = j < M ? (row * H + h) * Q + j % Q : -1;
        limit[t] = causal_base < 0 || j >= M ? L : (causal_base + j / Q + 1 < L ? causal_base + j / Q + 1 : L);
        if (at[t] >= 0) {
            memcpy(queries + t * D, q + row * q_stride + (h * Q + j % Q) * D, (size_t)D * 2);
            if (limit[t] > last) last = limit[t];
        } else {
            memset(queries + t * D, 0, (size_t)D * 2);
        }
    }
    return last;
}

/* softmax per query over its `span` computed scores (the keys past its limit already hold a large
 * negative score): 2^((s - max) * scale * log2 e) in one FMA and a polynomial, rounded to bf16 for
 * P x V (zero from span to the next 32); the sum stays fp32. `best` holds each query's running max
 * of its raw scores (scale > 0); `top` gets the scaled max, `total` the sum. */
static void softmax_to_probs(const float* scores, uint16_t* probs, int64_t L32, int64_t span, int64_t span32,
                             const int64_t* at, const __m512* best, float scale, float* top, float* total) {
    const __m512 to_log2 = _mm512_set1_ps(scale * 1.44269504f);
    for (int64_t t = 0; t < 32; t++) {
        const float* s = scores + t * L32;
        uint16_t* p = probs + t * L32;
        if (at[t] < 0) {  /* padding: zero probabilities (its output is not written) */
            memset(p, 0, (size_t)L32 * 2);
            continue;
        }
        top[t] = _mm512_reduce_max_ps(best[t]);
        const __m512 shift = _mm512_set1_ps(-top[t] * scale * 1.44269504f);
        __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();  /* two add chains */
        int64_t i = 0;
        for (; i + 32 <= span; i += 32) {
            const __m512 e0 = exp2_ps(_mm512_fmadd_ps(_mm512_loadu_ps(s + i), to_log2, shift));
            const __m512 e1 = exp2_ps(_mm512_fmadd_ps(_mm512_loadu_ps(s + i + 16), to_log2, shift));
            even = _mm512_add_ps(even, e0);
            odd = _mm512_add_ps(odd, e1);
            _mm512_storeu_si512(p + i, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        if (i < span) {
            const __m512 e0 = exp2_ps(_mm512_fmadd_ps(_mm512_loadu_ps(s + i), to_log2, shift));
            even = _mm512_add_ps(even, e0);
            _mm256_storeu_si256((__m256i*)(p + i), (__m256i)_mm512_cvtneps_pbh(e0));
        }
        const __m512 sum = _mm512_add_ps(even, odd);
        if (span < span32) _mm256_storeu_si256((__m256i*)(p + span), _mm256_setzero_si256());
        top[t] *= scale;
        total[t] = _mm512_reduce_add_ps(sum);
    }
}

/* Each real query's output (the fp32 P x V sums over its total, as bf16) and log-sum-exp. */
static void write_item_output(const float* acc, const int64_t* at, const float* top, const float* total,
                              int64_t D, uint16_t* out, float* lse) {
    for (int64_t t = 0; t < 32; t++) {
        if (at[t] < 0) continue;
        const __m512 inv = _mm512_set1_ps(1.0f / total[t]);
        for (int64_t i = 0; i < D; i += 16) {
            const __m512 o = _mm512_mul_ps(_mm512_loadu_ps(acc + t * D + i), inv);
            _mm256_storeu_si256((__m256i*)(out + at[t] * D + i), (__m256i)_mm512_cvtneps_pbh(o));
        }
        lse[at[t]] = top[t] + logf(total[t]);
    }
}

#ifdef HAVE_AMX
/* One work item on the tile unit: 32 queries (m0..) of group g and kv head h over their visible
 * keys (gather_item_queries), both products as 2 x 2 tiles. */
static void attend_item(const uint16_t* q, int64_t q_stride, const int64_t* rows, int64_t g, int64_t h, int64_t m0,
                        int64_t n, int64_t H, int64_t Q, int64_t D, int64_t L, int64_t L32, int64_t causal_base,
                        float scale, const uint16_t* packed, int64_t per_head, uint16_t* out, float* lse) {
    const uint16_t* keys = packed + (g * H + h) * per_head;
    const uint16_t* values = keys + (L + 15) / 16 * 16 * D;  /* K packed by whole 16-key tiles */
    const item_space space = item_buffers(L32, D);
    float* scores = space.scores;
    uint16_t* probs = space.probs;
    uint16_t* queries = space.queries;
    float* acc = space.acc;
    int64_t at[32], limit[32];
    const int64_t last = gather_item_queries(q, q_stride, rows, g, h, m0, n, H, Q, D, L, causal_base, queries, at,
                                             limit);
    const int64_t span = (last + 15) / 16 * 16, span32 = (span + 31) / 32 * 32;  /* keys computed */
    const int64_t s_row = L32 * 4, p_row = L32 * 2, q_row = D * 2;
    int64_t fewest = L;  /* the fewest keys a query sees: no masking below */
    for (int64_t t = 0; t < 32; t++) if (limit[t] < fewest) fewest = limit[t];
    __m512 best[32];  /* each query's running max, read while its scores are still in L1 */
    for (int64_t t = 0; t < 32; t++) best[t] = _mm512_set1_ps(-INFINITY);
    TILE_MEMORY_BARRIER();  /* the queries gathered above, before the tiles load them */
    for (int64_t key = 0; key < span; key += 32) {  /* tiles: 0/1 keys +0/+16 of queries 0-15, 2/3 of 16-31 */
        const int two = key + 16 < span;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t d = 0; d < D / 32; d++) {
            _tile_loadd(4, queries + d * 32, q_row);
            _tile_loadd(5, queries + 16 * D + d * 32, q_row);
            _tile_loadd(6, keys + key * D + d * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (two) {
                _tile_loadd(7, keys + (key + 16) * D + d * 512, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, scores + key, s_row);
        _tile_stored(2, scores + 16 * L32 + key, s_row);
        if (two) {
            _tile_stored(1, scores + key + 16, s_row);
            _tile_stored(3, scores + 16 * L32 + key + 16, s_row);
        }
        TILE_MEMORY_BARRIER();
        const int64_t end = key + (two ? 32 : 16);
        if (end > fewest)  /* keys past a query's limit: a large finite negative score (exp2 of -inf is NaN) */
            for (int64_t t = 0; t < 32; t++)
                for (int64_t hidden = limit[t] > key ? limit[t] : key; hidden < end; hidden++)
                    scores[t * L32 + hidden] = -1e30f;
        if (two)
            for (int64_t t = 0; t < 32; t++)
                best[t] = _mm512_max_ps(best[t], _mm512_max_ps(_mm512_loadu_ps(scores + t * L32 + key),
                                                               _mm512_loadu_ps(scores + t * L32 + key + 16)));
        else
            for (int64_t t = 0; t < 32; t++) best[t] = _mm512_max_ps(best[t], _mm512_loadu_ps(scores + t * L32 + key));
    }
    float top[32], total[32];
    softmax_to_probs(scores, probs, L32, span, span32, at, best, scale, top, total);
    TILE_MEMORY_BARRIER();
    for (int64_t e0 = 0; e0 < D; e0 += 32) {  /* tiles: 0/1 dims +0/+16 of queries 0-15, 2/3 of 16-31 */
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t c = 0; c < span32; c += 32) {
            const uint16_t* vt = values + c * D + e0 * 32;  /* dim tile e0 / 16: 512 bf16 */
            _tile_loadd(4, probs + c, p_row);
            _tile_loadd(5, probs + 16 * L32 + c, p_row);
            _tile_loadd(6, vt, 64);
            _tile_loadd(7, vt + 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, acc + e0, D * 4);
        _tile_stored(1, acc + e0 + 16, D * 4);
        _tile_stored(2, acc + 16 * D + e0, D * 4);
        _tile_stored(3, acc + 16 * D + e0 + 16, D * 4);
    }
    TILE_MEMORY_BARRIER();
    write_item_output(acc, at, top, total, D, out, lse);
}
#else
/* The same products with AVX512-BF16's dot product (vdpbf16ps: 16 lanes, each the sum of a pair of
 * bf16 products added to fp32), for CPUs without AMX (AMD Zen 4/5, Cooper Lake). The packed layouts
 * serve as they are: a 16-key K tile's row p holds pair p of each key's dims, so a query's scores
 * against 16 keys are D / 2 dot products of its broadcast pair p with row p; a V tile's row i holds,
 * per dim, the pair (key 2i, key 2i + 1), so a query's output for 16 dims accumulates its broadcast
 * probability pair i times row i. Queries are taken 8 (scores) or 16 * 16 / D (P x V) at a time so
 * their accumulators stay in registers; blocks of padding queries (only ever at the end of an
 * item) are skipped. */
#define BCAST_PAIR(p) ((__m512bh)_mm512_set1_epi32(*(const int32_t*)(p)))

/* Scores of 8 queries against 16 (`two`: 32) packed keys: `keys` at the first key's tile. */
static inline __attribute__((always_inline)) void score_8_queries(const uint16_t* queries, const uint16_t* keys,
                                                                  int two, const int64_t D, float* scores,
                                                                  int64_t L32) {
    __m512 a[8], b[8];
    for (int j = 0; j < 8; j++) a[j] = b[j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p++) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(keys + p * 32);
        if (two) {
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(keys + 16 * D + p * 32);
            #pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m512bh pair = BCAST_PAIR(queries + j * D + 2 * p);
                a[j] = _mm512_dpbf16_ps(a[j], pair, k0);
                b[j] = _mm512_dpbf16_ps(b[j], pair, k1);
            }
        } else {
            #pragma GCC unroll 8
            for (int j = 0; j < 8; j++) a[j] = _mm512_dpbf16_ps(a[j], BCAST_PAIR(queries + j * D + 2 * p), k0);
        }
    }
    for (int j = 0; j < 8; j++) {
        _mm512_storeu_ps(scores + j * L32, a[j]);
        if (two) _mm512_storeu_ps(scores + j * L32 + 16, b[j]);
    }
}

/* P x V for QB queries over span32 keys into acc [QB, D]: D / 16 accumulators per query. */
static inline __attribute__((always_inline)) void multiply_values(const uint16_t* probs, int64_t L32,
                                                                  const uint16_t* values, int64_t span32,
                                                                  const int64_t D, const int QB, float* acc) {
    __m512 sum[16];  /* QB * D / 16 <= 16 */
    for (int i = 0; i < QB * D / 16; i++) sum[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < span32; c += 32)
        for (int64_t i = 0; i < 16; i++) {
            __m512bh v[8];
            #pragma GCC unroll 8
            for (int64_t e = 0; e < D / 16; e++) v[e] = (__m512bh)_mm512_loadu_si512(values + c * D + e * 512 + i * 32);
            #pragma GCC unroll 4
            for (int j = 0; j < QB; j++) {
                const __m512bh pair = BCAST_PAIR(probs + j * L32 + c + 2 * i);
                #pragma GCC unroll 8
                for (int64_t e = 0; e < D / 16; e++) sum[j * (D / 16) + e] = _mm512_dpbf16_ps(sum[j * (D / 16) + e], pair, v[e]);
            }
        }
    for (int j = 0; j < QB; j++)
        for (int64_t e = 0; e < D / 16; e++) _mm512_storeu_ps(acc + j * D + e * 16, sum[j * (D / 16) + e]);
}

/* One work item (see the AMX version above), specialised per head size so loops unroll. */
static inline __attribute__((always_inline)) void attend_item_dims(
        const uint16_t* q, int64_t q_stride, const int64_t* rows, int64_t g, int64_t h, int64_t m0, int64_t n,
        int64_t H, int64_t Q, const int64_t D, int64_t L, int64_t L32, int64_t causal_base, float scale, const uint16_t* packed,
        int64_t per_head, uint16_t* out, float* lse) {
    const uint16_t* keys = packed + (g * H + h) * per_head;
    const uint16_t* values = keys + (L + 15) / 16 * 16 * D;  /* K packed by whole 16-key tiles */
    const item_space space = item_buffers(L32, D);
    float* scores = space.scores;
    uint16_t* probs = space.probs;
    uint16_t* queries = space.queries;
    float* acc = space.acc;
    int64_t at[32], limit[32];
    const int64_t last = gather_item_queries(q, q_stride, rows, g, h, m0, n, H, Q, D, L, causal_base, queries, at,
                                             limit);
    const int64_t span = (last + 15) / 16 * 16, span32 = (span + 31) / 32 * 32;  /* keys computed */
    __m512 best[32];
    for (int64_t t0 = 0; t0 < 32; t0 += 8) {
        if (at[t0] < 0) break;  /* padding only at the end */
        for (int64_t key = 0; key < span; key += 32)
            score_8_queries(queries + t0 * D, keys + key * D, key + 16 < span, D, scores + t0 * L32 + key, L32);
    }
    for (int64_t t = 0; t < 32; t++) {
        best[t] = _mm512_set1_ps(-INFINITY);
        if (at[t] < 0) continue;
        float* s = scores + t * L32;
        /* keys past its limit: a large finite negative score (exp2 of -inf would be NaN) */
        for (int64_t hidden = limit[t]; hidden < span; hidden++) s[hidden] = -1e30f;
        for (int64_t key = 0; key < span; key += 16) best[t] = _mm512_max_ps(best[t], _mm512_loadu_ps(s + key));
    }
    float top[32], total[32];
    softmax_to_probs(scores, probs, L32, span, span32, at, best, scale, top, total);
    const int QB = 256 / D;  /* 8, 4, 2 or 2 queries: at most 16 accumulators */
    for (int64_t t0 = 0; t0 < 32; t0 += QB)
        if (at[t0] >= 0) multiply_values(probs + t0 * L32, L32, values, span32, D, QB, acc + t0 * D);
    write_item_output(acc, at, top, total, D, out, lse);
}

static void attend_item(const uint16_t* q, int64_t q_stride, const int64_t* rows, int64_t g, int64_t h, int64_t m0,
                        int64_t n,
                        int64_t H, int64_t Q, int64_t D, int64_t L, int64_t L32, int64_t causal_base, float scale,
                        const uint16_t* packed, int64_t per_head, uint16_t* out, float* lse) {
    switch (D) {
        case 32: attend_item_dims(q, q_stride, rows, g, h, m0, n, H, Q, 32, L, L32, causal_base, scale, packed, per_head, out, lse); break;
        case 64: attend_item_dims(q, q_stride, rows, g, h, m0, n, H, Q, 64, L, L32, causal_base, scale, packed, per_head, out, lse); break;
        case 96: attend_item_dims(q, q_stride, rows, g, h, m0, n, H, Q, 96, L, L32, causal_base, scale, packed, per_head, out, lse); break;
        default: attend_item_dims(q, q_stride, rows, g, h, m0, n, H, Q, 128, L, L32, causal_base, scale, packed, per_head, out, lse); break;
    }
}
#endif

void prefix_attention_bf16(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* rows,
                           const int64_t* blocks, int64_t groups, int64_t n, int64_t k, int64_t H, int64_t Q,
                           int64_t D, int64_t BS, int64_t causal_base, int64_t q_stride, float scale, uint16_t* packed,
                           uint16_t* out, float* lse, int nt) {
    const int64_t L = k * BS, L32 = (L + 31) / 32 * 32, M = n * Q, tiles_m = (M + 31) / 32;
    const int64_t per_head = (L + L32) * D;  /* packed K (L x D) then packed V (L32 x D) */
    #pragma omp parallel num_threads(nt)
    {
#ifdef HAVE_AMX
        configure_tiles();
#endif
        /* 1. pack each (group, head)'s K by 16 keys and V by 32 */
        #pragma omp for schedule(static)
        for (int64_t unit = 0; unit < groups * H * (L32 / 32); unit++) {
            const int64_t g = unit / (H * (L32 / 32)), h = unit / (L32 / 32) % H, c = unit % (L32 / 32);
            uint16_t* head = packed + (g * H + h) * per_head;
            const uint16_t* values[32];
            int64_t present = 0;
            for (int64_t key = c * 32; key < c * 32 + 32 && key < L; key++, present++) {
                const int64_t block = blocks[g * k + key / BS];
                values[present] = vc + ((block * H + h) * BS + key % BS) * D;
            }
            pack_values(values, present, head + L * D + c * 32 * D, D);
            for (int64_t half = c * 32; half < c * 32 + 32 && half < L; half += 16) {
                const int64_t block = blocks[g * k + half / BS];
                pack_keys((const uint32_t*)(kc + ((block * H + h) * BS + half % BS) * D), D / 2,
                          (uint32_t*)(head + half * D), D);
            }
        }
        /* 2. 32 queries of one (group, head) per item: every product as 2 x 2 tiles (two query
         * tiles by two key or dim tiles), so each tile loaded serves two products and four
         * independent accumulations keep the tile unit busy. Without a causal limit every item
         * is the same work: split statically, in the packing's order. Causal items grow along a
         * chunk: handed out one at a time, so no thread ends with the long ones. */
        const int64_t items = groups * H * tiles_m;
        if (causal_base < 0) {
            #pragma omp for schedule(static)
            for (int64_t item = 0; item < items; item++)
                attend_item(q, q_stride, rows, item / (H * tiles_m), item / tiles_m % H, item % tiles_m * 32, n, H, Q, D,
                            L, L32, causal_base, scale, packed, per_head, out, lse);
        } else {
            #pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < items; item++)
                attend_item(q, q_stride, rows, item / (H * tiles_m), item / tiles_m % H, item % tiles_m * 32, n, H, Q, D,
                            L, L32, causal_base, scale, packed, per_head, out, lse);
        }
#ifdef HAVE_AMX
        _tile_release();
#endif
    }
}
/* Packed sequences (an embedding pass): S sequences laid end to end, sequence s the tokens
 * starts[s] .. starts[s + 1] - 1, each attending only to itself, bidirectionally (causal = 0) or
 * causally (causal = 1). Reuses the items above with each sequence as a group of its own: its
 * tokens are the rows, its own K/V the keys (L = its length). K/V are read from the projection's
 * output (rows k_stride / v_stride elements apart, heads and dims contiguous) and packed per (sequence,
 * head): K by 16-key tiles (a sequence's last, partial tile from a zero-padded copy: nothing is read
 * past a sequence), V by 32 keys. Work items run over every sequence's (head, 32 queries) at once,
 * handed out one at a time (sequences differ in length); `packed_at` (S + 1 offsets into `packed`)
 * and `item_at` (S + 1 prefix counts of items) come from the caller. q, out [T, H, Q, D] (q's rows
 * q_stride apart); lse [T, H, Q] scratch; rows [T] = 0 .. T - 1. */
void packed_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* starts,
                           const int64_t* packed_at, const int64_t* item_at, const int64_t* rows, int64_t S,
                           int64_t H, int64_t Q, int64_t D, int64_t q_stride, int64_t k_stride, int64_t v_stride,
                           int64_t causal, float scale, uint16_t* packed, uint16_t* out, float* lse, int nt) {
    #pragma omp parallel num_threads(nt)
    {
#ifdef HAVE_AMX
        configure_tiles();
#endif
        /* 1. pack: one unit per (sequence, head) */
        #pragma omp for schedule(dynamic, 4)
        for (int64_t unit = 0; unit < S * H; unit++) {
            const int64_t s = unit / H, h = unit % H, first = starts[s], L = starts[s + 1] - first;
            const int64_t L16 = (L + 15) / 16 * 16, L32 = (L + 31) / 32 * 32;
            uint16_t* head = packed + packed_at[s] + h * (L16 + L32) * D;
            uint16_t partial[16 * 128];
            for (int64_t c = 0; c < L32; c += 32) {
                const uint16_t* values[32];
                int64_t present = 0;
                for (int64_t key = c; key < c + 32 && key < L; key++, present++)
                    values[present] = v + (first + key) * v_stride + h * D;
                pack_values(values, present, head + L16 * D + c * D, D);
            }
            for (int64_t half = 0; half < L; half += 16) {
                const uint16_t* keys = k + (first + half) * k_stride + h * D;
                if (half + 16 <= L) {
                    pack_keys((const uint32_t*)keys, k_stride / 2, (uint32_t*)(head + half * D), D);
                } else {
                    memset(partial, 0, sizeof partial);
                    for (int64_t key = 0; key < L - half; key++)
                        memcpy(partial + key * D, keys + key * k_stride, (size_t)D * 2);
                    pack_keys((const uint32_t*)partial, D / 2, (uint32_t*)(head + half * D), D);
                }
            }
        }
        /* 2. attend: items of 32 queries of one (sequence, head), longest sequences first */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < item_at[S]; item++) {
            const int64_t s = sequence_of_item(item_at, S, item), first = starts[s], L = starts[s + 1] - first;
            const int64_t tiles_m = (L * Q + 31) / 32, local = item - item_at[s];
            const int64_t L32 = (L + 31) / 32 * 32, per_head = ((L + 15) / 16 * 16 + L32) * D;
            attend_item(q, q_stride, rows + first, 0, local / tiles_m, local % tiles_m * 32, L, H, Q, D, L, L32,
                        causal ? 0 : -1, scale, packed + packed_at[s], per_head, out, lse);
        }
#ifdef HAVE_AMX
        _tile_release();
#endif
    }
}
#endif
