/* Projections of single-token (decode) rows: out[M, N] = a[M, K] x W^T (+ bias), W packed once.
 *
 * A decode step multiplies a few rows by every weight of the model: it is a stream of the weights
 * through the cores, and oneDNN's kernels for such shapes read them at about half the machine's
 * bandwidth (measured: 15 GB/s of 25 at 32 bf16 rows, 10 GB/s in fp32). Here the weights are packed
 * in the exact order the kernel reads them, each thread streams its own contiguous part once, and
 * every row is computed on its own: the same sums in the same order whatever the other rows are
 * (how many, which), so a row's result does not depend on its batch. That is what lets speculative
 * verification and decoding give the same bits, and a lone decode the same as a batched one.
 *
 * With batch invariance on, prefill rows come here too (oneDNN would round a row by its call's row
 * count): from 128 rows a call takes a loop order for many rows (a's rows copied into tile order in
 * bf16, larger groups of weights in fp32), the same sums in the same order, at oneDNN's speed
 * (1 thread, 4,096 rows, SmolLM2's four projections: bf16 25.5 ms vs oneDNN's 25.7, was 39.3; fp32
 * 213 vs 203, was 251).
 *
 * bf16 runs on AMX tiles (16 x 32 x 16 bf16 products into fp32, rounded once to bf16 at the end),
 * or without AMX on AVX512-BF16's vdpbf16ps (pairs of products into fp32, likewise);
 * fp32 on AVX-512 FMAs (each output a sum over k in order). Both add the bias in fp32 before the
 * final rounding, as oneDNN does.
 *
 * Packed layouts (zero columns pad N to the panel width):
 *   fp32: panels of NR = 2 * VL columns, each [K][NR] floats.
 *   bf16: panels of 32 columns, each [K / 32][2 tiles][16 pairs of k][16 columns][2] (AMX's B
 *         operand: a tile row holds, for 16 columns, the pair of weights at k = 2i, 2i + 1).
 */
#include <sys/syscall.h>
#include <unistd.h>

#include <omp.h>

#include "simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define HAVE_AMX_GEMM 1
#include <immintrin.h>
#elif defined(__AVX512BF16__) && defined(__AVX512F__)
/* No AMX (AMD Zen 4/5): the same packed panels, multiplied by vdpbf16ps (a tile row of the AMX layout
 * is one vector of 16 column pairs, exactly that instruction's second operand). */
#define HAVE_DOT_GEMM 1
#include <immintrin.h>
#endif

/* ---- fp32 ------------------------------------------------------------------------------------ */

#define NR (2 * VL)
#define PREFETCH_K 64  /* k steps (of NR floats) ahead */
/* Weights a thread works through with every block of rows before moving on: what stays in L2. */
#ifndef GROUP_BYTES
#define GROUP_BYTES (128 << 10)
#endif

/* The next group of weights, pulled into L2 at an even pace while the current group is computed,
 * so that memory streams all the time (the hardware prefetcher alone leaves it idle while a group
 * is re-read from L2 for later rows). */
typedef struct {
    const char* next;
    const char* end;
    int64_t credit, per_step;  /* lines owed, in 1/65536 of a line; lines per k step, likewise */
} group_prefetch;

static inline group_prefetch prefetch_for(const void* next, int64_t bytes, int64_t steps) {
    group_prefetch ahead = {(const char*)next, (const char*)next + bytes, 0, 0};
    if (bytes > 0 && steps > 0) ahead.per_step = ((bytes + 63) / 64 * 65536 + steps - 1) / steps;
    return ahead;
}

static inline __attribute__((always_inline)) void prefetch_step(group_prefetch* ahead) {
    ahead->credit += ahead->per_step;
    while (ahead->credit >= 65536 && ahead->next < ahead->end) {
        __builtin_prefetch(ahead->next, 0, 2);
        ahead->next += 64;
        ahead->credit -= 65536;
    }
}
#ifndef F32_PREFILL_ROWS
#define F32_PREFILL_ROWS 128
#endif
#ifndef F32_PREFILL_GROUP_BYTES
#define F32_PREFILL_GROUP_BYTES (1 << 20)
#endif
#if VL == 16
#define MR 12
#else
#define MR 6
#endif

int64_t row_gemm_panel_width_f32(void) { return NR; }

/* w [N, K] (a Linear's weight) into panels of NR columns. */
void row_gemm_pack_f32(const float* w, int64_t N, int64_t K, float* packed, int nt) {
    const int64_t panels = (N + NR - 1) / NR;
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t n = p * NR + j;
                packed[(p * K + k) * NR + j] = n < N ? w[n * K + k] : 0.0f;
            }
}

/* mr rows (a compile-time count once inlined) by one panel: each output the sum over k in order,
 * plus the bias, into c. `stream`: these are the first rows to read the panel, which comes from
 * memory: ask for it PREFETCH_K steps ahead. */
static inline __attribute__((always_inline)) void tile_f32(
        const float* a, int64_t lda, const float* panel, int64_t K, const float* bias, float* c, int64_t ldc,
        int64_t columns, int stream, group_prefetch* ahead, const int mr) {
    vf lo[MR], hi[MR];
    for (int m = 0; m < mr; m++) lo[m] = hi[m] = splat(0.0f);
    for (int64_t k = 0; k < K; k++) {
        if (stream)
            for (int line = 0; line < NR; line += 16) __builtin_prefetch(panel + (k + PREFETCH_K) * NR + line);
        prefetch_step(ahead);
        const vf b0 = load_f32(panel + k * NR), b1 = load_f32(panel + k * NR + VL);
        for (int m = 0; m < mr; m++) {
            const vf x = splat(a[m * lda + k]);
            lo[m] += x * b0;
            hi[m] += x * b1;
        }
    }
    vf bias0 = splat(0.0f), bias1 = splat(0.0f);
    if (bias) {
        float padded[NR] = {0};
        memcpy(padded, bias, (size_t)(columns < NR ? columns : NR) * sizeof(float));
        bias0 = load_f32(padded);
        bias1 = load_f32(padded + VL);
    }
    for (int m = 0; m < mr; m++) {
        const vf v0 = lo[m] + bias0, v1 = hi[m] + bias1;
        if (columns >= NR) {
            store_f32(c + m * ldc, v0);
            store_f32(c + m * ldc + VL, v1);
        } else {
            float row[NR];
            store_f32(row, v0);
            store_f32(row + VL, v1);
            memcpy(c + m * ldc, row, (size_t)columns * sizeof(float));
        }
    }
}

/* Each thread takes a contiguous run of panels, in groups of up to GROUP_BYTES of weights (they stay
 * in L2): every block of MR rows takes the whole group in turn, so the group streams from memory
 * once (with the first block) and each block writes its rows along a run of columns. */
void row_gemm_f32(const float* a, int64_t lda, const float* packed, const float* bias, float* c, int64_t ldc,
                  int64_t M, int64_t N, int64_t K, int nt) {
    const int64_t panels = (N + NR - 1) / NR, panel_bytes = K * NR * (int64_t)sizeof(float);
    /* Many rows (a prefill chunk): a larger group, so that a's rows, re-read for every group, are
     * read a few times rather than once every panel or two (each output is the same sum either way). */
    const int64_t group_bytes = M >= F32_PREFILL_ROWS ? F32_PREFILL_GROUP_BYTES : GROUP_BYTES;
    const int64_t group = group_bytes / panel_bytes > 1 ? group_bytes / panel_bytes : 1;
    #pragma omp parallel num_threads(nt)
    {
        const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t begin = panels * thread / threads, end = panels * (thread + 1) / threads;
        for (int64_t g0 = begin; g0 < end; g0 += group) {
            const int64_t g1 = g0 + group < end ? g0 + group : end, g2 = g1 + group < end ? g1 + group : end;
            group_prefetch ahead = prefetch_for(packed + g1 * K * NR, (g2 - g1) * panel_bytes,
                                                (M + MR - 1) / MR * (g1 - g0) * K);
            for (int64_t m0 = 0; m0 < M; m0 += MR) {
                const float* am = a + m0 * lda;
                for (int64_t p = g0; p < g1; p++) {
                    const float* panel = packed + p * K * NR;
                    const int64_t n0 = p * NR, columns = N - n0 < NR ? N - n0 : NR;
                    const float* b = bias ? bias + n0 : NULL;
                    float* cm = c + m0 * ldc + n0;
#define TILE(R) tile_f32(am, lda, panel, K, b, cm, ldc, columns, m0 == 0 && g0 == begin, &ahead, R)
                    switch (M - m0 < MR ? M - m0 : MR) {
                        case 1: TILE(1); break;
                        case 2: TILE(2); break;
                        case 3: TILE(3); break;
                        case 4: TILE(4); break;
                        case 5: TILE(5); break;
#if MR > 6
                        case 6: TILE(6); break;
                        case 7: TILE(7); break;
                        case 8: TILE(8); break;
                        case 9: TILE(9); break;
                        case 10: TILE(10); break;
                        case 11: TILE(11); break;
#endif
                        default: TILE(MR); break;
                    }
#undef TILE
                }
            }
        }
    }
}

/* ---- bf16 on AMX, or AVX512-BF16's dot product without it ------------------------------------ */

/* 1: bf16 on AMX (granted), 2: on AVX512-BF16's dot product, 0: none in this build. */
int row_gemm_bf16_available(void) {
#if defined(HAVE_AMX_GEMM)
    /* Linux grants AMX's tile state only on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA). */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#elif defined(HAVE_DOT_GEMM)
    return 2;
#else
    return 0;
#endif
}

/* w [N, K] bf16 into panels of 32 columns of AMX B tiles; K must be a multiple of 32. */
void row_gemm_pack_bf16(const uint16_t* w, int64_t N, int64_t K, uint16_t* packed, int nt) {
    const int64_t panels = (N + 31) / 32, kb = K / 32;
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < kb; b++)
            for (int64_t t = 0; t < 2; t++)
                for (int64_t i = 0; i < 16; i++)
                    for (int64_t j = 0; j < 16; j++)
                        for (int64_t e = 0; e < 2; e++) {
                            const int64_t n = p * 32 + t * 16 + j, k = b * 32 + 2 * i + e;
                            packed[((((p * kb + b) * 2 + t) * 16 + i) * 16 + j) * 2 + e] = n < N ? w[n * K + k] : 0;
                        }
}

#if defined(HAVE_AMX_GEMM)
typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tile_config;

/* tmm0-3: the 2 x 2 fp32 accumulators (rows of the first / second 16, columns of the first /
 * second 16); tmm4-5: the two row tiles of a; tmm6-7: the panel's two column tiles. `first` and
 * `second`: how many rows the two row tiles hold (the tail of M may hold fewer than 16). */
static void configure(int first, int second) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    const int rows[8] = {first, first, second, second, first, second, 16, 16};
    for (int t = 0; t < 8; t++) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = (uint8_t)(rows[t] > 0 ? rows[t] : 1);
    }
    _tile_loadconfig(&config);
}
#endif

#if defined(HAVE_AMX_GEMM) || defined(HAVE_DOT_GEMM)
/* The panel is read where it lies in memory: ask for the pair of tiles PREFETCH_KB steps ahead
 * (past the panel's end that is the next panel, which this thread reads next). */
#define PREFETCH_KB 4
static inline void prefetch_tiles(const uint16_t* tiles) {
    for (int line = 0; line < 1024; line += 32) __builtin_prefetch(tiles + line);
}

/* The fp32 sums of `rows` rows by 32 columns (stride 32) plus the bias, rounded once to bf16 into
 * c16, or kept in fp32 into c32 where that is given (the LM head's logits: no rounding before
 * sampling, which in bf16 makes ties out of near-ties). */
static void write_rows(const float* sums, int64_t rows, const uint16_t* bias, int64_t columns, uint16_t* c16,
                       float* c32, int64_t ldc) {
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    const __mmask16 mask0 = columns >= 16 ? 0xffff : (__mmask16)((1u << columns) - 1);
    const __mmask16 mask1 = columns >= 32 ? 0xffff : columns <= 16 ? 0 : (__mmask16)((1u << (columns - 16)) - 1);
    if (bias) {
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask0, bias)), 16));
        b1 = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask1, bias + 16)), 16));
    }
    for (int64_t r = 0; r < rows; r++) {
        const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(sums + r * 32), b0);
        const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(sums + r * 32 + 16), b1);
        if (c32) {
            _mm512_mask_storeu_ps(c32 + r * ldc, mask0, v0);
            _mm512_mask_storeu_ps(c32 + r * ldc + 16, mask1, v1);
        } else {
            _mm256_mask_storeu_epi16(c16 + r * ldc, mask0, (__m256i)_mm512_cvtneps_pbh(v0));
            _mm256_mask_storeu_epi16(c16 + r * ldc + 16, mask1, (__m256i)_mm512_cvtneps_pbh(v1));
        }
    }
}
#endif

#if defined(HAVE_DOT_GEMM)
/* Rows a dot-product block computes together: 2 x DOT_MR fp32 accumulators stay in registers. */
#ifndef DOT_MR
#define DOT_MR 8
#endif

/* The fp32 sums of `rows` (a constant where inlined) rows of a by one panel's 32 columns into sums
 * (stride 32): over k in order, a pair of products per step, as the AMX tiles take them. */
static inline __attribute__((always_inline)) void dot_panel(const uint16_t* a, int64_t lda,
                                                            const uint16_t* panel, int64_t kb, const int rows,
                                                            int stream, group_prefetch* ahead, float* sums) {
    __m512 acc[DOT_MR][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < kb; b++) {
        if (stream) prefetch_tiles(panel + (b + PREFETCH_KB) * 1024);
        prefetch_step(ahead);
        const uint16_t* tiles = panel + b * 1024;
        for (int i = 0; i < 16; i++) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(tiles + i * 32);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(tiles + 512 + i * 32);
            for (int r = 0; r < rows; r++) {
                int32_t pair;
                memcpy(&pair, a + r * lda + b * 32 + 2 * i, sizeof pair);
                const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(sums + r * 32, acc[r][0]);
        _mm512_storeu_ps(sums + r * 32 + 16, acc[r][1]);
    }
}
#endif

#if defined(HAVE_AMX_GEMM)
/* The rows of the 32-row block with `left` rows from it on, in its first and second tile (0: none),
 * the tiles configured for them where the last configuration (`*configured`) differs. */
static inline void configure_block(int64_t left, int* first, int* second, int* configured) {
    *first = left < 16 ? (int)left : 16;
    *second = left - 16 <= 0 ? 0 : (left - 16 < 16 ? (int)(left - 16) : 16);
    if (*configured != *first * 32 + *second) {
        configure(*first, *second);
        *configured = *first * 32 + *second;
    }
}

/* One 32-row block by one panel: the 2 x 2 tiles' fp32 sums over k in order, stored into `sums`
 * (stride 32). The block's first tile starts at a0 and its second at a1, rows `a_stride` bytes apart
 * and k steps `a_step` elements apart (a's own rows, or a copy in tile order). `stream`: the panel
 * comes from memory, prefetch it; `ahead`: the next group's prefetch (NULL: none). */
static inline __attribute__((always_inline)) void amx_block(const uint16_t* a0, const uint16_t* a1, int64_t a_step,
                                                            int64_t a_stride, const uint16_t* panel, int64_t kb,
                                                            int second, int stream, group_prefetch* ahead,
                                                            float* sums) {
    _tile_zero(0);
    _tile_zero(1);
    if (second) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t b = 0; b < kb; b++) {
            if (stream) prefetch_tiles(panel + (b + PREFETCH_KB) * 1024);
            if (ahead) prefetch_step(ahead);
            _tile_loadd(4, a0 + b * a_step, a_stride);
            _tile_loadd(5, a1 + b * a_step, a_stride);
            _tile_loadd(6, panel + b * 1024, 64);
            _tile_loadd(7, panel + b * 1024 + 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    } else {
        for (int64_t b = 0; b < kb; b++) {
            if (stream) prefetch_tiles(panel + (b + PREFETCH_KB) * 1024);
            if (ahead) prefetch_step(ahead);
            _tile_loadd(4, a0 + b * a_step, a_stride);
            _tile_loadd(6, panel + b * 1024, 64);
            _tile_loadd(7, panel + b * 1024 + 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    _tile_stored(0, sums, 128);
    _tile_stored(1, sums + 16, 128);
    if (second) {
        _tile_stored(2, sums + 16 * 32, 128);
        _tile_stored(3, sums + 16 * 32 + 16, 128);
    }
    TILE_MEMORY_BARRIER();
}

/* Rows from which a call takes the prefill loop order below rather than the decode one. */
#ifndef PREFILL_ROWS
#define PREFILL_ROWS 128
#endif
/* Weights a thread keeps in L2 while every 32-row block of a prefill call passes over them. */
#ifndef PREFILL_GROUP_BYTES
#define PREFILL_GROUP_BYTES (768 << 10)
#endif

/* Many rows (a prefill chunk): a is first copied into tile order (per 32-row block, per 32 k: its
 * rows' 64 bytes one after another), so a tile load reads 1 KB in a row where a's own rows, 3 KB
 * apart at K = 1536, put 16 loads into 4 L1 sets. Then each thread passes every 32-row block over a
 * group of panels that stays in L2. Each output is the same sum as in the decode order (the same
 * tile products over k in order, rounded once): the loop order moves data, not arithmetic, so a
 * row gets the same bits in a prefill call as alone. */
static void amx_prefill(const uint16_t* a, int64_t lda, const uint16_t* packed, const uint16_t* bias,
                        uint16_t* c, float* c32, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    const int64_t panels = (N + 31) / 32, kb = K / 32, panel_bytes = kb * 2048, blocks = (M + 31) / 32;
    const int64_t group = PREFILL_GROUP_BYTES / panel_bytes > 1 ? PREFILL_GROUP_BYTES / panel_bytes : 1;
    uint16_t* tiles = aligned_alloc(64, (size_t)(blocks * kb * 2048));
    if (!tiles) return;
    #pragma omp parallel num_threads(nt)
    {
        #pragma omp for schedule(static)
        for (int64_t block = 0; block < blocks; block++) {
            const int64_t rows = M - block * 32 < 32 ? M - block * 32 : 32;
            for (int64_t b = 0; b < kb; b++)
                for (int64_t r = 0; r < rows; r++)
                    memcpy(tiles + ((block * kb + b) * 32 + r) * 32, a + (block * 32 + r) * lda + b * 32, 64);
        }
        float sums[32 * 32] __attribute__((aligned(64)));
        int configured = -1;
        const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t begin = panels * thread / threads, end = panels * (thread + 1) / threads;
        for (int64_t g0 = begin; g0 < end; g0 += group) {
            const int64_t g1 = g0 + group < end ? g0 + group : end;
            for (int64_t m0 = 0; m0 < M; m0 += 32) {
                int first, second;
                configure_block(M - m0, &first, &second, &configured);
                const uint16_t* block = tiles + m0 / 32 * kb * 1024;
                for (int64_t p = g0; p < g1; p++) {
                    const int64_t n0 = p * 32, columns = N - n0 < 32 ? N - n0 : 32;
                    amx_block(block, block + 512, 1024, 64, packed + p * kb * 1024, kb, second, 0, NULL, sums);
                    write_rows(sums, first + second, bias ? bias + n0 : NULL, columns, c ? c + m0 * ldc + n0 : NULL,
                               c32 ? c32 + m0 * ldc + n0 : NULL, ldc);
                }
            }
        }
        if (configured >= 0) _tile_release();
    }
    free(tiles);
}
#endif

/* Each thread takes a contiguous run of panels, in groups of up to GROUP_BYTES of weights (they stay
 * in L2): every 32-row block takes the whole group in turn, so the group streams from memory once
 * (with the first block) and each block writes its rows' outputs along a run of columns rather
 * than a few columns of every row. A block is one pass over k of 2 x 2 tiles; each output is one
 * sum over k in order, whatever the other rows. */
static void row_gemm_bf16_into(const uint16_t* a, int64_t lda, const uint16_t* packed, const uint16_t* bias,
                               uint16_t* c, float* c32, int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
#if defined(HAVE_AMX_GEMM)
    if (M >= PREFILL_ROWS) {
        amx_prefill(a, lda, packed, bias, c, c32, ldc, M, N, K, nt);
        return;
    }
    const int64_t panels = (N + 31) / 32, kb = K / 32, panel_bytes = kb * 2048;
    const int64_t group = GROUP_BYTES / panel_bytes > 1 ? GROUP_BYTES / panel_bytes : 1;
    #pragma omp parallel num_threads(nt)
    {
        float sums[32 * 32] __attribute__((aligned(64)));
        int configured = -1;  /* the rows of the last configuration, first * 32 + second */
        const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t begin = panels * thread / threads, end = panels * (thread + 1) / threads;
        for (int64_t g0 = begin; g0 < end; g0 += group) {
            const int64_t g1 = g0 + group < end ? g0 + group : end, g2 = g1 + group < end ? g1 + group : end;
            group_prefetch ahead = prefetch_for(packed + g1 * kb * 1024, (g2 - g1) * panel_bytes,
                                                (M + 31) / 32 * (g1 - g0) * kb);
            const int stream = g0 == begin;
            for (int64_t m0 = 0; m0 < M; m0 += 32) {
                int first, second;
                configure_block(M - m0, &first, &second, &configured);
                const uint16_t* a0 = a + m0 * lda;
                for (int64_t p = g0; p < g1; p++) {
                    const int64_t n0 = p * 32, columns = N - n0 < 32 ? N - n0 : 32;
                    amx_block(a0, a0 + 16 * lda, 32, lda * 2, packed + p * kb * 1024, kb, second, stream && m0 == 0,
                              &ahead, sums);
                    write_rows(sums, first + second, bias ? bias + n0 : NULL, columns, c ? c + m0 * ldc + n0 : NULL,
                               c32 ? c32 + m0 * ldc + n0 : NULL, ldc);
                }
            }
        }
        if (configured >= 0) _tile_release();
    }
#elif defined(HAVE_DOT_GEMM)
    const int64_t panels = (N + 31) / 32, kb = K / 32, panel_bytes = kb * 2048;
    const int64_t group = GROUP_BYTES / panel_bytes > 1 ? GROUP_BYTES / panel_bytes : 1;
    #pragma omp parallel num_threads(nt)
    {
        float sums[DOT_MR * 32] __attribute__((aligned(64)));
        const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t begin = panels * thread / threads, end = panels * (thread + 1) / threads;
        for (int64_t g0 = begin; g0 < end; g0 += group) {
            const int64_t g1 = g0 + group < end ? g0 + group : end, g2 = g1 + group < end ? g1 + group : end;
            group_prefetch ahead = prefetch_for(packed + g1 * kb * 1024, (g2 - g1) * panel_bytes,
                                                (M + DOT_MR - 1) / DOT_MR * (g1 - g0) * kb);
            for (int64_t m0 = 0; m0 < M; m0 += DOT_MR) {
                const int rows = M - m0 < DOT_MR ? (int)(M - m0) : DOT_MR;
                const int stream = g0 == begin && m0 == 0;
                const uint16_t* a0 = a + m0 * lda;
                for (int64_t p = g0; p < g1; p++) {
                    const uint16_t* panel = packed + p * kb * 1024;
                    const int64_t n0 = p * 32, columns = N - n0 < 32 ? N - n0 : 32;
                    switch (rows) {  /* a constant row count each: the accumulators stay in registers */
#define DOT_ROWS(R) case R: dot_panel(a0, lda, panel, kb, R, stream, &ahead, sums); break;
                        DOT_ROWS(1) DOT_ROWS(2) DOT_ROWS(3) DOT_ROWS(4) DOT_ROWS(5) DOT_ROWS(6) DOT_ROWS(7)
                        default: dot_panel(a0, lda, panel, kb, DOT_MR, stream, &ahead, sums); break;
#undef DOT_ROWS
                    }
                    write_rows(sums, rows, bias ? bias + n0 : NULL, columns, c ? c + m0 * ldc + n0 : NULL,
                               c32 ? c32 + m0 * ldc + n0 : NULL, ldc);
                }
            }
        }
    }
#else
    (void)a; (void)lda; (void)packed; (void)bias; (void)c; (void)c32; (void)ldc; (void)M; (void)N; (void)K; (void)nt;
#endif
}

void row_gemm_bf16(const uint16_t* a, int64_t lda, const uint16_t* packed, const uint16_t* bias, uint16_t* c,
                   int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    row_gemm_bf16_into(a, lda, packed, bias, c, NULL, ldc, M, N, K, nt);
}

/* The same sums kept in fp32 (c [M, N] float): the LM head's logits of bf16 rows. */
void row_gemm_bf16_f32(const uint16_t* a, int64_t lda, const uint16_t* packed, const uint16_t* bias, float* c,
                       int64_t ldc, int64_t M, int64_t N, int64_t K, int nt) {
    row_gemm_bf16_into(a, lda, packed, bias, NULL, c, ldc, M, N, K, nt);
}
