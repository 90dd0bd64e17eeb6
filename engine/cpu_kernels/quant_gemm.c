/* Projections of quantized checkpoints (compressed-tensors W8A8, W8A16, W4A16; engine/quant/).
 *
 * W8A8: each row of activations is quantized to uint8 with its own scale and zero point
 * (quantize_rows_u8: symmetric int8 is stored as q + 128), multiplied with the int8 weights in
 * integers (int8_gemm: exact int32 sums; oneDNN computes the same sums where the CPU has VNNI or
 * AMX-INT8) and scaled back by int8_epilogue. int8_gemm takes a few rows (decode) in the dot-product
 * form and a prefill chunk in the broadcast form over weight panels widened once per call (on AVX2
 * vpmaddwd multiplies 16 pairs a cycle, fp32's two FMAs 16 lanes: the two peak alike, so W8A8 on
 * AVX2 saves memory, not prefill time). Integer sums do not depend on their order, so every
 * path gives a row the same bits whatever else its step holds (batch invariance for free).
 *
 * W8A16 / W4A16: weights stay 8- or 4-bit in memory and are widened to fp32 inside the product
 * (wq_gemm: (q - zero) * scale in registers, two weight rows by up to four rows a pass), or
 * dequantized for a prefill chunk's GEMM (wq_dequantize). Decode rows read 4-8x fewer weight
 * bytes than fp32's.
 *
 * Weight layout (packed by engine/quant/linear.py): 8-bit: int8 [N, Kp]; 4-bit: [N, Kp / 2] bytes,
 * each block of 2 * VL inputs in VL bytes, byte i holding input i (low nibble) and input VL + i
 * (high nibble), stored + 8. Kp: K rounded up to 2 * VL (padding weights are zero).
 *
 * No fused multiply-adds formed by the compiler here: it fuses differently in the code it specializes
 * for one row and for four, and a row's bits must not depend on how many rows came with it.
 */
#pragma GCC optimize("fp-contract=off")
#include "simd.h"
#include <omp.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* a * b + c in one rounding, spelled out (the pragma above keeps the compiler from choosing). */
static inline vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

static inline float round_even(float v) { return nearbyintf(v); }  /* default mode: half to even */

#if defined(__AVX2__)
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}
#endif

/* The row's absmax (mode 0) or its range widened to hold 0 (mode 1), eight lanes at a time: max and
 * min are exact, so the lanes' order does not change the result. */
static void row_range(const float* row, int64_t cols, float* lo_out, float* hi_out) {
    float lo = 0.0f, hi = 0.0f;
    int64_t c = 0;
#if defined(__AVX2__)
    __m256 vlo = _mm256_setzero_ps(), vhi = _mm256_setzero_ps();
    for (; c + 8 <= cols; c += 8) {
        __m256 v = _mm256_loadu_ps(row + c);
        vlo = _mm256_min_ps(vlo, v);
        vhi = _mm256_max_ps(vhi, v);
    }
    hi = hmax8(vhi);
    lo = -hmax8(_mm256_sub_ps(_mm256_setzero_ps(), vlo));
#endif
    for (; c < cols; c++) { lo = fminf(lo, row[c]); hi = fmaxf(hi, row[c]); }
    *lo_out = lo;
    *hi_out = hi;
}

/* out = clamp(round_half_even(x / scale) + zp, lo_q, 255): a true division, as PyTorch's path divides. */
static void quantize_row(const float* row, int64_t cols, float scale, float zp, int lo_q, uint8_t* out) {
    int64_t c = 0;
#if defined(__AVX2__)
    const __m256 vs = _mm256_set1_ps(scale), vz = _mm256_set1_ps(zp);
    const __m256 vlo = _mm256_set1_ps((float)lo_q), vhi = _mm256_set1_ps(255.0f);
    for (; c + 16 <= cols; c += 16) {
        __m256i q[2];
        for (int h = 0; h < 2; h++) {
            __m256 v = _mm256_div_ps(_mm256_loadu_ps(row + c + 8 * h), vs);
            v = _mm256_add_ps(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), vz);
            q[h] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, vlo), vhi));
        }
        __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(q[0], q[1]), 0xd8);  /* 16 x u16 */
        __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
        _mm_storeu_si128((__m128i*)(out + c), bytes);
    }
#endif
    for (; c < cols; c++) {
        float q = round_even(row[c] / scale) + zp;
        q = fminf(fmaxf(q, (float)lo_q), 255.0f);
        out[c] = (uint8_t)q;
    }
}

/* One row's scale and zero point (mode as quantize_rows_u8's), then its uint8 values. */
static void quantize_one_row(const float* row, int64_t cols, int64_t mode, float static_scale,
                             int64_t static_zp, uint8_t* out, float* scale_out, int32_t* zp_out) {
    float scale = static_scale;
    float zp = (float)static_zp;
    int lo_q = 0;
    if (mode == 0 || mode == 1) {
        float lo, hi;
        row_range(row, cols, &lo, &hi);
        if (mode == 0) {
            float absmax = fmaxf(hi, -lo);
            scale = absmax > 0.0f ? absmax / 127.0f : 1.0f;
            zp = 128.0f;
            lo_q = 1;  /* -127..127, as symmetric int8 quantization clamps */
        } else {
            scale = hi > lo ? (hi - lo) / 255.0f : 1.0f;
            zp = fminf(fmaxf(round_even(-lo / scale), 0.0f), 255.0f);
        }
    }
    quantize_row(row, cols, scale, zp, lo_q, out);
    *scale_out = scale;
    *zp_out = (int32_t)zp;
}

/* mode 0: dynamic symmetric per row (scale absmax / 127, zero point 128); 1: dynamic asymmetric per
 * row (range widened to hold 0, 255 levels); 2: static (static_scale, static_zp in uint8 terms). */
void quantize_rows_u8(const float* x, int64_t rows, int64_t cols, int64_t mode, float static_scale,
                      int64_t static_zp, uint8_t* out, float* scales, int32_t* zero_points, int nt) {
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++)
        quantize_one_row(x + r * cols, cols, mode, static_scale, static_zp, out + r * cols, scales + r,
                         zero_points + r);
}

/* quantize_rows_u8 of bf16 rows: each row widened to fp32 (exact) in a buffer of the thread's own,
 * so a bf16 model's activations are read once instead of copied to fp32 first. */
void quantize_rows_u8_bf16(const uint16_t* x, int64_t rows, int64_t cols, int64_t mode, float static_scale,
                           int64_t static_zp, uint8_t* out, float* scales, int32_t* zero_points, int nt) {
    #pragma omp parallel num_threads(nt)
    {
        float* row = aligned_alloc(64, (size_t)((cols * 4 + 63) / 64 * 64));
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t c = 0; c < cols; c++) {
                uint32_t bits = (uint32_t)x[r * cols + c] << 16;
                memcpy(row + c, &bits, 4);
            }
            quantize_one_row(row, cols, mode, static_scale, static_zp, out + r * cols, scales + r,
                             zero_points + r);
        }
        free(row);
    }
}

/* One output's integer sum of x (uint8, widened to int16 by the caller) and w (int8) over k. */
static inline int32_t dot_u8_s8(const int16_t* x, const int8_t* w, int64_t k) {
    int64_t i = 0;
    int32_t sum = 0;
#if defined(__AVX2__)
    __m256i acc = _mm256_setzero_si256();
    for (; i + 16 <= k; i += 16) {
        __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + i)));
        __m256i xv = _mm256_loadu_si256((const __m256i*)(x + i));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(xv, wv));  /* exact: |pair| < 2^16 */
    }
    __m128i half = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
    half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0xb1));
    sum = _mm_cvtsi128_si32(half);
#endif
    for (; i < k; i++) sum += (int32_t)x[i] * (int32_t)w[i];
    return sum;
}

#if defined(__AVX2__)
static inline int32_t hsum_epi32(__m256i v) {
    __m128i half = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
    half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0xb1));
    return _mm_cvtsi128_si32(half);
}

/* mr rows (compile-time once inlined) by two weight rows: each weight block widened once for every
 * row, eight accumulators in registers. */
static inline __attribute__((always_inline)) void dot_rows_by_two(
        const int16_t* x, int64_t k, const int8_t* w0, const int8_t* w1, int mr, float* raw, int64_t n_out) {
    __m256i acc0[4], acc1[4];
    for (int r = 0; r < mr; r++) { acc0[r] = _mm256_setzero_si256(); acc1[r] = _mm256_setzero_si256(); }
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w0 + i)));
        __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w1 + i)));
        for (int r = 0; r < mr; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i*)(x + r * k + i));
            acc0[r] = _mm256_add_epi32(acc0[r], _mm256_madd_epi16(xv, a));
            acc1[r] = _mm256_add_epi32(acc1[r], _mm256_madd_epi16(xv, b));
        }
    }
    for (int r = 0; r < mr; r++) {
        int32_t s0 = hsum_epi32(acc0[r]), s1 = hsum_epi32(acc1[r]);
        for (int64_t j = i; j < k; j++) {
            s0 += (int32_t)x[r * k + j] * (int32_t)w0[j];
            s1 += (int32_t)x[r * k + j] * (int32_t)w1[j];
        }
        raw[r * n_out] = (float)s0;
        raw[r * n_out + 1] = (float)s1;
    }
}
#endif

#if defined(__AVX2__)
/* Many rows (a prefill chunk): the broadcast form. Sixteen outputs' weights are widened once per
 * call into a panel of int16 pairs, panel[kp][o] = (w[o][2kp], w[o][2kp + 1]) as one 32-bit word,
 * and each row's pair of inputs is broadcast against it: vpmaddwd gives eight outputs' pair sums at
 * once, twelve accumulators (six rows by sixteen outputs) stay in registers, and no horizontal sums
 * are needed. Integer sums: the same values as the dot-product form above, whatever the tiling. */
#define PANEL_OUTPUTS 16
#define PANEL_ROWS 6
#define PACKED_MIN_ROWS 16

/* 8 x 8 words: rows[i] holds output i's words for 8 kp; out[j] gets kp j's words for the 8 outputs. */
static inline void transpose8(__m256i rows[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(rows[i], rows[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(rows[i], rows[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        rows[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        rows[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

/* The panel of outputs [n0, n0 + 16): kp_count words per output, zero past k and past n_out. */
static void pack_panel(const int8_t* w, int64_t k, int64_t n_out, int64_t n0, int64_t kp_count,
                       int32_t* panel) {
    for (int half = 0; half < 2; half++) {
        int64_t base = n0 + 8 * half;
        int64_t kp = 0;
        for (; 2 * kp + 16 <= k; kp += 8) {  /* eight kp (16 inputs) of eight outputs at a time */
            __m256i rows[8];
            for (int o = 0; o < 8; o++)
                rows[o] = base + o < n_out
                    ? _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + (base + o) * k + 2 * kp)))
                    : _mm256_setzero_si256();
            transpose8(rows);  /* rows[j]: kp + j's words of the eight outputs */
            for (int j = 0; j < 8; j++)
                _mm256_store_si256((__m256i*)(panel + (kp + j) * PANEL_OUTPUTS + 8 * half), rows[j]);
        }
        for (; kp < kp_count; kp++)
            for (int o = 0; o < 8; o++) {
                int64_t n = base + o;
                int16_t pair[2] = {0, 0};
                if (n < n_out) {
                    if (2 * kp < k) pair[0] = w[n * k + 2 * kp];
                    if (2 * kp + 1 < k) pair[1] = w[n * k + 2 * kp + 1];
                }
                memcpy(panel + kp * PANEL_OUTPUTS + 8 * half + o, pair, sizeof pair);
            }
    }
}

/* mr rows (compile-time once inlined) by the panel's sixteen outputs. */
static inline __attribute__((always_inline)) void panel_rows(
        const int16_t* x, int64_t stride, int64_t kp_count, const int32_t* panel, int mr, float* raw,
        int64_t n_out, int64_t valid) {
    __m256i acc[PANEL_ROWS][2];
    for (int r = 0; r < mr; r++) { acc[r][0] = _mm256_setzero_si256(); acc[r][1] = _mm256_setzero_si256(); }
    for (int64_t kp = 0; kp < kp_count; kp++) {
        __m256i w0 = _mm256_load_si256((const __m256i*)(panel + kp * PANEL_OUTPUTS));
        __m256i w1 = _mm256_load_si256((const __m256i*)(panel + kp * PANEL_OUTPUTS + 8));
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            memcpy(&pair, x + r * stride + 2 * kp, sizeof pair);
            __m256i xb = _mm256_set1_epi32(pair);
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(xb, w0));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(xb, w1));
        }
    }
    for (int r = 0; r < mr; r++) {
        float sums[PANEL_OUTPUTS];
        _mm256_storeu_ps(sums, _mm256_cvtepi32_ps(acc[r][0]));
        _mm256_storeu_ps(sums + 8, _mm256_cvtepi32_ps(acc[r][1]));
        memcpy(raw + r * n_out, sums, (size_t)valid * sizeof(float));
    }
}

/* x16: the caller's scratch of rows * k int16 (a fresh buffer where k is odd: rows take k + 1). */
static void int8_gemm_packed(const uint8_t* x, int64_t rows, int64_t k, const int8_t* w, int64_t n_out,
                             float* raw, int16_t* scratch, int nt) {
    int64_t kp_count = (k + 1) / 2, stride = 2 * kp_count;
    int16_t* x16 = stride == k ? scratch : aligned_alloc(64, (size_t)((rows * stride * 2 + 63) / 64 * 64));
    for (int64_t m = 0; m < rows; m++) {
        for (int64_t i = 0; i < k; i++) x16[m * stride + i] = x[m * k + i];
        if (stride > k) x16[m * stride + k] = 0;
    }
    int64_t panels = (n_out + PANEL_OUTPUTS - 1) / PANEL_OUTPUTS;
    #pragma omp parallel num_threads(nt)
    {
        int32_t* panel = aligned_alloc(64, (size_t)((kp_count * PANEL_OUTPUTS * 4 + 63) / 64 * 64));
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            int64_t n0 = p * PANEL_OUTPUTS;
            int64_t valid = n_out - n0 < PANEL_OUTPUTS ? n_out - n0 : PANEL_OUTPUTS;
            pack_panel(w, k, n_out, n0, kp_count, panel);
            for (int64_t m0 = 0; m0 < rows; m0 += PANEL_ROWS) {
                const int16_t* xm = x16 + m0 * stride;
                float* out = raw + m0 * n_out + n0;
                switch (rows - m0 < PANEL_ROWS ? rows - m0 : PANEL_ROWS) {
                    case 1: panel_rows(xm, stride, kp_count, panel, 1, out, n_out, valid); break;
                    case 2: panel_rows(xm, stride, kp_count, panel, 2, out, n_out, valid); break;
                    case 3: panel_rows(xm, stride, kp_count, panel, 3, out, n_out, valid); break;
                    case 4: panel_rows(xm, stride, kp_count, panel, 4, out, n_out, valid); break;
                    case 5: panel_rows(xm, stride, kp_count, panel, 5, out, n_out, valid); break;
                    default: panel_rows(xm, stride, kp_count, panel, 6, out, n_out, valid); break;
                }
            }
        }
        free(panel);
    }
    if (x16 != scratch) free(x16);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* AVX512-VNNI: vpdpbusd multiplies four uint8 inputs by four int8 weights and adds the four products
 * to a 32-bit lane without saturating (|x w| <= 255 * 128: four fit), 64 products an instruction
 * where AVX2's vpmaddwd does 16 on widened int16 values: the same exact integer sums, four times the
 * work per instruction. The weights are packed once (engine/quant/linear.py) into panels of 16
 * outputs: panel[p][kq][o] is the 32-bit word of output 16 p + o's inputs 4 kq .. 4 kq + 3, so each
 * row's four inputs are broadcast against sixteen outputs at once (the broadcast form: no
 * horizontal sums). A tile of VNNI_ROWS rows by VNNI_PANELS panels keeps 24 accumulators in
 * registers; the rows are padded to a multiple of four inputs (zeros) by the caller. */
#define VNNI_ROWS 6
#define VNNI_PANELS 4
#define VNNI_PANEL 16

typedef struct {
    const float* row_scales;  /* per row */
    const int32_t* row_zps;
    const float* col_scales;  /* per output */
    const int32_t* col_sums;
    const float* bias;        /* NULL: none */
    void* out;                /* [rows, n_out], fp32 or bf16 */
    int bf16;
} int8_epilogue_args;

/* One panel's column terms of the epilogue, loaded once for every row of a tile. */
typedef struct { __m512i col_sum; __m512 col_scale, bias; __mmask16 keep; int64_t valid; } epilogue_cols;

static inline __attribute__((always_inline)) epilogue_cols epilogue_columns(
        const int8_epilogue_args* e, int64_t n, int64_t n_out) {
    epilogue_cols c;
    c.valid = n_out - n < VNNI_PANEL ? n_out - n : VNNI_PANEL;
    c.keep = c.valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << c.valid) - 1);
    c.col_sum = _mm512_maskz_loadu_epi32(c.keep, e->col_sums + n);
    c.col_scale = _mm512_maskz_loadu_ps(c.keep, e->col_scales + n);
    c.bias = e->bias ? _mm512_maskz_loadu_ps(c.keep, e->bias + n) : _mm512_setzero_ps();
    return c;
}

/* One output vector of the epilogue: (raw - zp * col_sum) * row_scale * col_scale + bias, each
 * operation rounded as int8_epilogue's scalar code rounds it (zp * col_sum is exact in 32 bits:
 * |col_sum| <= 128 k, zp <= 255, k < 65,536). */
static inline __attribute__((always_inline)) void epilogue_store(
        __m512i sums, int64_t m, int64_t n, int64_t n_out, const int8_epilogue_args* e, const epilogue_cols* c) {
    __m512 raw = _mm512_cvtepi32_ps(sums);
    __m512 shift = _mm512_cvtepi32_ps(_mm512_mullo_epi32(c->col_sum, _mm512_set1_epi32(e->row_zps[m])));
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(raw, shift), _mm512_set1_ps(e->row_scales[m])),
                             c->col_scale);
    if (e->bias) v = _mm512_add_ps(v, c->bias);
    if (e->bf16) {
        uint16_t* out = (uint16_t*)e->out + m * n_out + n;
        if (c->valid == VNNI_PANEL) {
            store_bf16(out, (vf)v);
        } else {
            uint16_t packed[16];
            store_bf16(packed, (vf)v);
            memcpy(out, packed, (size_t)c->valid * 2);
        }
    } else {
        _mm512_mask_storeu_ps((float*)e->out + m * n_out + n, c->keep, v);
    }
}

/* A tile's sums out: raw (e NULL) or through the epilogue. */
static inline __attribute__((always_inline)) void tile_store(
        const __m512i* sums, int mr, int np, int64_t m0, int64_t n0, int64_t n_out, float* raw,
        const int8_epilogue_args* e) {
    for (int p = 0; p < np; p++) {
        int64_t n = n0 + p * VNNI_PANEL;
        if (n >= n_out) continue;
        if (e) {
            const epilogue_cols c = epilogue_columns(e, n, n_out);
            for (int r = 0; r < mr; r++) epilogue_store(sums[r * VNNI_PANELS + p], m0 + r, n, n_out, e, &c);
        } else {
            int64_t valid = n_out - n < VNNI_PANEL ? n_out - n : VNNI_PANEL;
            __mmask16 keep = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1);
            for (int r = 0; r < mr; r++)
                _mm512_mask_storeu_ps(raw + (m0 + r) * n_out + n, keep,
                                      _mm512_cvtepi32_ps(sums[r * VNNI_PANELS + p]));
        }
    }
}

/* mr rows by np panels (compile-time counts once inlined). x: rows of kq * 4 uint8 (stride xs). */
static inline __attribute__((always_inline)) void vnni_tile(
        const uint8_t* x, int64_t xs, int64_t kq, const int32_t* panels, int mr, int np, int64_t m0,
        int64_t n0, int64_t n_out, float* raw, const int8_epilogue_args* e) {
    __m512i acc[VNNI_ROWS][VNNI_PANELS];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int p = 0; p < np; p++) acc[r][p] = _mm512_setzero_si512();
    for (int64_t q = 0; q < kq; q++) {
        __m512i wv[VNNI_PANELS];
#pragma GCC unroll 4
        for (int p = 0; p < np; p++) {
            wv[p] = _mm512_loadu_si512(panels + (p * kq + q) * VNNI_PANEL);
            __asm__("" : "+v"(wv[p]));  /* one load each, not one per row's vpdpbusd (simd.h's in_register) */
        }
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            int32_t word;
            memcpy(&word, x + r * xs + 4 * q, 4);
            __m512i xb = _mm512_set1_epi32(word);
#pragma GCC unroll 4
            for (int p = 0; p < np; p++) acc[r][p] = _mm512_dpbusd_epi32(acc[r][p], xb, wv[p]);
        }
    }
    __m512i sums[VNNI_ROWS * VNNI_PANELS];
    for (int r = 0; r < mr; r++)
        for (int p = 0; p < np; p++) sums[r * VNNI_PANELS + p] = acc[r][p];
    tile_store(sums, mr, np, m0, n0, n_out, raw, e);
}

/* The full tile (VNNI_ROWS by VNNI_PANELS) with its 24 accumulators named, so they stay in registers
 * (GCC spills an array of them to the stack on every pass: 2x slower). */
#define VNNI_ZERO(R) __m512i a##R##0 = _mm512_setzero_si512(), a##R##1 = a##R##0, a##R##2 = a##R##0, a##R##3 = a##R##0
#define VNNI_ROW(R) do { \
        int32_t word; memcpy(&word, x + R * xs + 4 * q, 4); \
        const __m512i xb = _mm512_set1_epi32(word); \
        a##R##0 = _mm512_dpbusd_epi32(a##R##0, xb, w0); a##R##1 = _mm512_dpbusd_epi32(a##R##1, xb, w1); \
        a##R##2 = _mm512_dpbusd_epi32(a##R##2, xb, w2); a##R##3 = _mm512_dpbusd_epi32(a##R##3, xb, w3); \
    } while (0)
#define VNNI_SUMS(R) a##R##0, a##R##1, a##R##2, a##R##3

static inline __attribute__((always_inline)) void vnni_tile_full(
        const uint8_t* x, int64_t xs, int64_t kq, const int32_t* panels, int64_t m0, int64_t n0,
        int64_t n_out, float* raw, const int8_epilogue_args* e) {
    VNNI_ZERO(0); VNNI_ZERO(1); VNNI_ZERO(2); VNNI_ZERO(3); VNNI_ZERO(4); VNNI_ZERO(5);
    for (int64_t q = 0; q < kq; q++) {
        __m512i w0 = _mm512_loadu_si512(panels + q * VNNI_PANEL);
        __m512i w1 = _mm512_loadu_si512(panels + (kq + q) * VNNI_PANEL);
        __m512i w2 = _mm512_loadu_si512(panels + (2 * kq + q) * VNNI_PANEL);
        __m512i w3 = _mm512_loadu_si512(panels + (3 * kq + q) * VNNI_PANEL);
        __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3));  /* one load each (simd.h's in_register) */
        VNNI_ROW(0); VNNI_ROW(1); VNNI_ROW(2); VNNI_ROW(3); VNNI_ROW(4); VNNI_ROW(5);
    }
    const __m512i sums[VNNI_ROWS * VNNI_PANELS] = {VNNI_SUMS(0), VNNI_SUMS(1), VNNI_SUMS(2), VNNI_SUMS(3),
                                                   VNNI_SUMS(4), VNNI_SUMS(5)};
    tile_store(sums, VNNI_ROWS, VNNI_PANELS, m0, n0, n_out, raw, e);
}

#define VNNI_TILE(MR, NP) vnni_tile(xm, xs, kq, wp, MR, NP, m0, n0, n_out, raw, e)

/* raw (e NULL) or the epilogue's output (e) of x [rows, k] uint8 times the panels. */
static void int8_gemm_panels(const uint8_t* x, int64_t rows, int64_t k, const int32_t* w, int64_t n_out,
                             float* raw, const int8_epilogue_args* e, uint8_t* scratch, int nt) {
    int64_t kq = (k + 3) / 4, xs = 4 * kq;
    const uint8_t* xp = x;
    if (xs != k) {  /* rows padded to whole words of four inputs */
        uint8_t* padded = scratch;
        for (int64_t m = 0; m < rows; m++) {
            memcpy(padded + m * xs, x + m * k, (size_t)k);
            memset(padded + m * xs + k, 0, (size_t)(xs - k));
        }
        xp = padded;
    }
    int64_t panels = (n_out + VNNI_PANEL - 1) / VNNI_PANEL;
    int64_t groups = (panels + VNNI_PANELS - 1) / VNNI_PANELS;
    /* Work items: a group of VNNI_PANELS panels by a chunk of rows (whole tiles), so that few output
     * groups (576 outputs: 9) still spread evenly over the threads when there are many rows; each
     * group's panels stay in cache for every row tile of its chunk. */
    int64_t chunk = rows > 8 * VNNI_ROWS * nt ? 40 * VNNI_ROWS : rows;
    int64_t chunks = (rows + chunk - 1) / chunk;
    #pragma omp parallel for collapse(2) schedule(static) num_threads(nt)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t c = 0; c < chunks; c++) {
            int64_t p0 = g * VNNI_PANELS;
            int np = panels - p0 < VNNI_PANELS ? (int)(panels - p0) : VNNI_PANELS;
            int64_t n0 = p0 * VNNI_PANEL;
            const int32_t* wp = w + p0 * kq * VNNI_PANEL;
            int64_t m_end = (c + 1) * chunk < rows ? (c + 1) * chunk : rows;
            for (int64_t m0 = c * chunk; m0 < m_end; m0 += VNNI_ROWS) {
                int mr = m_end - m0 < VNNI_ROWS ? (int)(m_end - m0) : VNNI_ROWS;
                const uint8_t* xm = xp + m0 * xs;
                if (np == VNNI_PANELS) {
                    switch (mr) {
                        case 1: VNNI_TILE(1, VNNI_PANELS); break;
                        case 2: VNNI_TILE(2, VNNI_PANELS); break;
                        case 3: VNNI_TILE(3, VNNI_PANELS); break;
                        case 4: VNNI_TILE(4, VNNI_PANELS); break;
                        case 5: VNNI_TILE(5, VNNI_PANELS); break;
                        default: vnni_tile_full(xm, xs, kq, wp, m0, n0, n_out, raw, e); break;
                    }
                } else {
                    vnni_tile(xm, xs, kq, wp, mr, np, m0, n0, n_out, raw, e);
                }
            }
        }
    }
}

/* out = the epilogue of x [rows, k] times the panels, in one pass (no raw sums in memory): fp32 or
 * bf16 (bf16 != 0), the same bits int8_gemm, int8_epilogue and a rounding to bf16 give. */
void int8_gemm_epilogue(const uint8_t* x, int64_t rows, int64_t k, const int32_t* w, int64_t n_out,
                        const float* row_scales, const int32_t* row_zps, const float* col_scales,
                        const int32_t* col_sums, const float* bias, void* out, int64_t bf16,
                        uint8_t* scratch, int nt) {
    int8_epilogue_args e = {row_scales, row_zps, col_scales, col_sums, bias, out, (int)bf16};
    int8_gemm_panels(x, rows, k, w, n_out, NULL, &e, scratch, nt);
}
#endif

/* The weight layout int8_gemm takes: outputs per panel (16: AVX512-VNNI panels, above), or 0 for
 * plain rows (int8 [n_out, k]). */
int64_t int8_weight_panel(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return VNNI_PANEL;
#else
    return 0;
#endif
}

/* raw[m, n] = sum_k x[m, k] * w[n, k] in int32, stored as float (rounded as oneDNN's fp32 output is).
 * x: uint8 [rows, k]; w: int8 [n_out, k], or panels where int8_weight_panel() says so (x16: scratch of
 * rows * k int16). Columns in blocks that stay in L2, rows four at a time. */
void int8_gemm(const uint8_t* x, int64_t rows, int64_t k, const int8_t* w, int64_t n_out, float* raw,
               int16_t* x16, int nt) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    int8_gemm_panels(x, rows, k, (const int32_t*)w, n_out, raw, NULL, (uint8_t*)x16, nt);
    return;
#endif
#if defined(__AVX2__)
    if (rows >= PACKED_MIN_ROWS) {
        int8_gemm_packed(x, rows, k, w, n_out, raw, x16, nt);
        return;
    }
#endif
    for (int64_t i = 0; i < rows * k; i++) x16[i] = x[i];
    const int64_t column_block = 64;
    int64_t blocks = (n_out + column_block - 1) / column_block;
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * column_block, n_end = n0 + column_block < n_out ? n0 + column_block : n_out;
        for (int64_t m0 = 0; m0 < rows; m0 += 4) {
            int64_t mr = rows - m0 < 4 ? rows - m0 : 4;
            int64_t n = n0;
#if defined(__AVX2__)
            for (; n + 2 <= n_end; n += 2) {
                const int16_t* xm = x16 + m0 * k;
                float* out = raw + m0 * n_out + n;
                const int8_t *w0 = w + n * k, *w1 = w + (n + 1) * k;
                switch (mr) {
                    case 1: dot_rows_by_two(xm, k, w0, w1, 1, out, n_out); break;
                    case 2: dot_rows_by_two(xm, k, w0, w1, 2, out, n_out); break;
                    case 3: dot_rows_by_two(xm, k, w0, w1, 3, out, n_out); break;
                    default: dot_rows_by_two(xm, k, w0, w1, 4, out, n_out); break;
                }
            }
#endif
            for (; n < n_end; n++)
                for (int64_t r = 0; r < mr; r++)
                    raw[(m0 + r) * n_out + n] = (float)dot_u8_s8(x16 + (m0 + r) * k, w + n * k, k);
        }
    }
}

/* out[m, n] = (raw[m, n] - zp[m] * col_sum[n]) * row_scale[m] * col_scale[n] + bias[n], the same
 * float operations in the same order on every path (oneDNN's raw sums or int8_gemm's). */
void int8_epilogue(const float* raw, int64_t rows, int64_t n_out, const float* row_scale,
                   const int32_t* row_zp, const float* col_scale, const int32_t* col_sum,
                   const float* bias, float* out, int nt) {
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t m = 0; m < rows; m++) {
        float s = row_scale[m];
        int64_t zp = row_zp[m];
        for (int64_t n = 0; n < n_out; n++) {
            float corrected = raw[m * n_out + n] - (float)(zp * (int64_t)col_sum[n]);
            float scaled = corrected * s;
            float v = scaled * col_scale[n];
            out[m * n_out + n] = bias ? v + bias[n] : v;
        }
    }
}

/* VL int8 (or uint8) values widened to int32 lanes: one vpmovsxbd / vpmovzxbd (GCC's generic
 * conversion of a byte vector goes through scalar registers). */
static inline vi32 widen_s8(const int8_t* p) {
#if defined(__AVX512F__)
    return (vi32)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX2__)
    return (vi32)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p));
#else
    vi32 v; for (int i = 0; i < VL; i++) v[i] = p[i]; return v;
#endif
}
static inline vi32 widen_u8(const uint8_t* p) {
#if defined(__AVX512F__)
    return (vi32)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#elif defined(__AVX2__)
    return (vi32)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
#else
    vi32 v; for (int i = 0; i < VL; i++) v[i] = p[i]; return v;
#endif
}

/* Weight-only: one weight row's next block of 2 * VL inputs as two fp32 vectors (unscaled, zero
 * point not taken off). */
static inline __attribute__((always_inline)) void weight_block(const uint8_t* w, int64_t block, int bits,
                                                               vf* first, vf* second) {
    if (bits == 8) {
        const int8_t* p = (const int8_t*)w + block * 2 * VL;
        *first = __builtin_convertvector(widen_s8(p), vf);
        *second = __builtin_convertvector(widen_s8(p + VL), vf);
    } else {
        vi32 wide = widen_u8(w + block * VL);
        *first = __builtin_convertvector((wide & 15) - 8, vf);
        *second = __builtin_convertvector((wide >> 4) - 8, vf);
    }
}

/* One weight value (any k, for groups that do not start on a block). */
static inline float weight_at(const uint8_t* w, int64_t k, int bits) {
    if (bits == 8) return (float)((const int8_t*)w)[k];
    int64_t block = k / (2 * VL), lane = k % (2 * VL);
    uint8_t byte = w[block * VL + lane % VL];
    return (float)((lane < VL ? byte & 15 : byte >> 4) - 8);
}

#define WQ_ROWS 4
#define WQ_COLS 2

/* mr rows by nc weight rows (compile-time counts once inlined, so the sums stay in registers):
 * sums[r * nc + c] = sum_k x[r, k] * w[c, k], each weight dequantized first, (q - zero) * scale, as a
 * reference dequantizes it; a weight block is widened once for every row and an input block loaded
 * once for every weight row. Each (row, weight row) pair's FMAs run in the same order whatever mr
 * and nc are, so a row's bits do not depend on the rows or columns computed with it. */
static inline __attribute__((always_inline)) void wq_tile(
        const float* x, int64_t k_in, const uint8_t* w, int64_t row_bytes, int bits, int64_t groups,
        int64_t group, int aligned, const float* scales, const float* zeros, int mr, int nc, float* sums) {
    vf acc[WQ_ROWS][WQ_COLS];
    float tail[WQ_ROWS][WQ_COLS];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) { acc[r][c] = splat(0.0f); tail[r][c] = 0.0f; }
    for (int64_t g = 0; g < groups; g++) {
        int64_t k0 = g * group, k1 = k0 + group < k_in ? k0 + group : k_in;
        vf scale[WQ_COLS], zero[WQ_COLS];
        for (int c = 0; c < nc; c++) {
            scale[c] = splat(scales[c * groups + g]);
            zero[c] = splat(zeros ? zeros[c * groups + g] : 0.0f);
        }
        int64_t k = k0;
        if (aligned) {
            for (; k + 2 * VL <= k1; k += 2 * VL) {
                vf w0[WQ_COLS], w1[WQ_COLS];
                for (int c = 0; c < nc; c++) {
                    weight_block(w + c * row_bytes, k / (2 * VL), bits, &w0[c], &w1[c]);
                    w0[c] = (w0[c] - zero[c]) * scale[c];
                    w1[c] = (w1[c] - zero[c]) * scale[c];
                }
                for (int r = 0; r < mr; r++) {
                    const vf x0 = load_f32(x + r * k_in + k), x1 = load_f32(x + r * k_in + k + VL);
                    for (int c = 0; c < nc; c++) {
                        acc[r][c] = vfma(x0, w0[c], acc[r][c]);
                        acc[r][c] = vfma(x1, w1[c], acc[r][c]);
                    }
                }
            }
        }
        for (; k < k1; k++) {
            for (int c = 0; c < nc; c++) {
                float wk = (weight_at(w + c * row_bytes, k, bits) - zero[c][0]) * scale[c][0];
                for (int r = 0; r < mr; r++) tail[r][c] += x[r * k_in + k] * wk;
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) sums[r * WQ_COLS + c] = hsum(acc[r][c]) + tail[r][c];
}

#define WQ_TILE(MR, NC) wq_tile(xm, k_in, wn, row_bytes, (int)bits, groups, group, aligned, scale, zero, MR, NC, sums)

/* out[m, n] = sum_k x[m, k] * (q[n, k] - zero[n, g(k)]) * scale[n, g(k)], + bias. x fp32 [rows, k_in];
 * w packed (above), `row_bytes` per weight row; scales, zeros fp32 [n, groups] (zeros NULL:
 * symmetric); group: inputs per group (k_in for one scale per channel). */
void wq_gemm(const float* x, int64_t rows, int64_t k_in, const uint8_t* w, int64_t row_bytes,
             int64_t bits, int64_t n_out, int64_t group, const float* scales, const float* zeros,
             const float* bias, float* out, int nt) {
    int64_t groups = (k_in + group - 1) / group;
    int aligned = group % (2 * VL) == 0;
    int64_t pairs = (n_out + WQ_COLS - 1) / WQ_COLS;
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t p = 0; p < pairs; p++) {
        int64_t n = p * WQ_COLS;
        int nc = n_out - n < WQ_COLS ? (int)(n_out - n) : WQ_COLS;
        const uint8_t* wn = w + n * row_bytes;
        const float* scale = scales + n * groups;
        const float* zero = zeros ? zeros + n * groups : NULL;
        for (int64_t m0 = 0; m0 < rows; m0 += WQ_ROWS) {
            int64_t mr = rows - m0 < WQ_ROWS ? rows - m0 : WQ_ROWS;
            const float* xm = x + m0 * k_in;
            float sums[WQ_ROWS * WQ_COLS];
            if (nc == 2) {
                switch (mr) {
                    case 1: WQ_TILE(1, 2); break;
                    case 2: WQ_TILE(2, 2); break;
                    case 3: WQ_TILE(3, 2); break;
                    default: WQ_TILE(4, 2); break;
                }
            } else {
                switch (mr) {
                    case 1: WQ_TILE(1, 1); break;
                    case 2: WQ_TILE(2, 1); break;
                    case 3: WQ_TILE(3, 1); break;
                    default: WQ_TILE(4, 1); break;
                }
            }
            for (int r = 0; r < mr; r++)
                for (int c = 0; c < nc; c++)
                    out[(m0 + r) * n_out + n + c] = bias ? sums[r * WQ_COLS + c] + bias[n + c] : sums[r * WQ_COLS + c];
        }
    }
}

/* Whether wq_gemm_bf16 runs this projection: 4-bit weights in groups of 32 inputs or of whole 64-input
 * chunks, on a CPU with AVX512-BF16 (else the fp32 kernel above). */
int64_t wq_bf16_applies(int64_t bits, int64_t group) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && VL == 16
    return bits == 4 && (group == 2 * VL || group % (4 * VL) == 0);
#else
    (void)bits; (void)group;
    return 0;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && VL == 16
/* W4A16 for a bf16 model, where AVX512-BF16 multiplies pairs of bf16 values into fp32 sums
 * (vdpbf16ps: 32 products an instruction). Each weight becomes the bf16 value a bf16 model of the
 * dequantized checkpoint holds, bf16((q - zero) * scale) (wq_dequantize's bits), inside the kernel:
 * the 16 values of a weight row's group are computed once a group and each packed nibble picks its
 * value by one table lookup, so no weight is widened to fp32 and no sum is scaled afterwards.
 *
 * The inputs go in chunks of 64 (two packed blocks, 32 bytes): the bytes widened to 32 words once
 * (vpmovzxbw) give the low nibbles (inputs 0-15 and 32-47 of the chunk) as table indices as they are
 * and the high ones (16-31, 48-63) after one shift, each looked up by one vpermw in a table holding
 * the 16 values twice (index bit 4 is the neighbouring nibble's, so both halves agree): 4 instructions
 * for 64 weights. The rows are copied once into that order (`xp`). Groups of 32: the two halves of a
 * chunk are two groups, a table of two halves and the half's bit set in the index.
 *
 * Rows in tiles: a lone row by WQB_ONE_ROW_COLS weight rows (decode), a few rows by WQB_COLS; from
 * WQB_EXPAND_ROWS rows each block of weight rows is first expanded into the same bf16 vectors (128
 * bytes a chunk and weight row) and tiles of WQB_TILE_ROWS by WQB_TILE_COLS read them. Every
 * (row, weight row) pair sees the same products added in the same order in every tile shape and
 * either weight source, so a row's bits never depend on the rows that came with it. */
#define WQB_CHUNK 64
#define WQB_COLS 4
#define WQB_ONE_ROW_COLS 8
#define WQB_TILE_ROWS 4
#define WQB_TILE_COLS 4
#define WQB_EXPAND_ROWS 4
#define WQB_MAX_ROWS 4
#define WQB_MAX_COLS 8
#define WQB_BLOCK_ROWS 128  /* multiples of every tile's rows and weight rows */
#define WQB_BLOCK_COLS 16

typedef struct {
    const uint16_t* xp;      /* rows in the chunk order, [rows, chunks * 64], zero past k_in */
    int64_t chunks;
    const uint8_t* w;        /* packed weight rows (or NULL: read `expanded`) */
    int64_t row_bytes;
    int64_t tail_half;       /* the last chunk holds one block (k_in % 64 == 32) */
    const uint16_t* expanded;/* [weight rows from expanded_from, chunks, 64] bf16 weights, or NULL */
    int64_t expanded_from;
    int64_t group, groups;
    const float* scales;     /* [n_out, groups] */
    const float* zeros;      /* [n_out, groups] or NULL */
    const float* bias;       /* [n_out] or NULL */
    uint16_t* out;           /* [rows, n_out] */
    int64_t n_out;
} wqb_args;

/* (index - 8 - zero) * scale in fp32 for index 0..15 of one weight row's group g. */
static inline __m512 wqb_values(const float* scales, const float* zeros, int64_t g) {
    const __m512 index = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512 centred = zeros ? _mm512_sub_ps(index, _mm512_set1_ps(zeros[g])) : index;
    return _mm512_mul_ps(centred, _mm512_set1_ps(scales[g]));
}

/* The lookup table of chunk k's weights in bf16 (one conversion for both halves): group g's values
 * in both halves, or (groups of 32) the chunk's two groups' values, one a half. */
static inline __attribute__((always_inline)) __m512i wqb_table(const float* scales, const float* zeros, int64_t g,
                                                              int64_t groups, int pair) {
    const __m512 first = wqb_values(scales, zeros, g);
    const __m512 second = pair && g + 1 < groups ? wqb_values(scales, zeros, g + 1) : first;
    return (__m512i)_mm512_cvtne2ps_pbh(second, first);  /* words 0-15 from `first`, 16-31 from `second` */
}

/* Chunk c of one packed weight row as bf16: *a = inputs 0-15 and 32-47, *b = 16-31 and 48-63. */
static inline __attribute__((always_inline)) void wqb_decode(const uint8_t* row, int64_t c, int half,
                                                             __m512i table, int pair, __m512i* a, __m512i* b) {
    __m256i bytes = half ? _mm256_maskz_loadu_epi8(0xFFFF, row + c * 32)
                         : _mm256_loadu_si256((const __m256i*)(row + c * 32));
    __m512i words = _mm512_cvtepu8_epi16(bytes), high = _mm512_srli_epi16(words, 4), low = words;
    if (pair) {  /* two tables: the index's bit 4 says which half of the chunk the word is in */
        const __m512i second = _mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFFFF0000u, 16);
        low = _mm512_ternarylogic_epi32(words, _mm512_set1_epi16(15), second, 0xEA);  /* (w & 15) | bit */
        high = _mm512_or_si512(high, second);
    }
    *a = _mm512_permutexvar_epi16(low, table);
    *b = _mm512_permutexvar_epi16(high, table);
}

/* out[m0 + r, n0 + c] = bf16(sum + bias) for mr rows by nc weight rows (compile-time shape and
 * weight source once inlined, so the sums stay in registers). */
static inline __attribute__((always_inline)) void wqb_tile(const wqb_args* a, int64_t m0, int64_t n0,
                                                           int mr, int nc, int expanded, int pair) {
    __m512 acc[WQB_MAX_ROWS][WQB_MAX_COLS];
    const int64_t per_table = a->group == 32 ? 1 : a->group / WQB_CHUNK, groups = a->groups, last = a->chunks - 1;
    const int64_t stride = a->chunks * WQB_CHUNK;
    #pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
        #pragma GCC unroll 8
        for (int c = 0; c < nc; c++) acc[r][c] = _mm512_setzero_ps();
    /* the next tile's weight rows, a few lines a chunk ahead of their use: a tile reads a few cache
     * lines of each of its rows, too short a stream for the hardware prefetcher to follow */
    const int64_t next = n0 + nc, next_end = next + nc < a->n_out ? next + nc : a->n_out;
    const uint8_t* ahead = expanded ? NULL : a->w + next * a->row_bytes;
    const uint8_t* ahead_end = expanded ? NULL : a->w + next_end * a->row_bytes;
    const int64_t lines_a_chunk = (nc * a->row_bytes + 63) / 64 / a->chunks + 1;
    for (int64_t c0 = 0; c0 < a->chunks; c0 += per_table) {
        const int64_t g = a->group == 32 ? 2 * c0 : c0 / per_table;
        __m512i table[WQB_MAX_COLS];
        if (!expanded) {
            #pragma GCC unroll 8
            for (int c = 0; c < nc; c++)
                table[c] = wqb_table(a->scales + (n0 + c) * groups, a->zeros ? a->zeros + (n0 + c) * groups : NULL,
                                     g, groups, pair);
        }
        for (int64_t k = c0; k < c0 + per_table; k++) {
            const int half = !expanded && a->tail_half && k == last;
            for (int64_t i = 0; i < lines_a_chunk && ahead < ahead_end; i++, ahead += 64)
                _mm_prefetch((const char*)ahead, _MM_HINT_T0);
            __m512bh x0[WQB_MAX_ROWS], x1[WQB_MAX_ROWS];
            #pragma GCC unroll 8
            for (int r = 0; r < mr; r++) {
                /* in registers: loaded once for every weight row, not folded into each product */
                const uint16_t* xr = a->xp + (m0 + r) * stride + k * WQB_CHUNK;
                x0[r] = (__m512bh)in_register((vf)_mm512_loadu_si512(xr));
                x1[r] = (__m512bh)in_register((vf)_mm512_loadu_si512(xr + 32));
            }
            #pragma GCC unroll 8
            for (int c = 0; c < nc; c++) {
                __m512i wa, wb;
                if (expanded) {
                    const uint16_t* e = a->expanded + ((n0 + c - a->expanded_from) * a->chunks + k) * WQB_CHUNK;
                    wa = _mm512_loadu_si512(e);
                    wb = _mm512_loadu_si512(e + 32);
                } else if (half) {
                    wqb_decode(a->w + (n0 + c) * a->row_bytes, k, 1, table[c], pair, &wa, &wb);
                } else {
                    wqb_decode(a->w + (n0 + c) * a->row_bytes, k, 0, table[c], pair, &wa, &wb);
                }
                #pragma GCC unroll 8
                for (int r = 0; r < mr; r++) {
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x0[r], (__m512bh)wa);
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x1[r], (__m512bh)wb);
                }
            }
        }
    }
    /* each sum's lanes added by one tree (reduce_lanes: sixteen sums at once, unused slots zero; every
     * shape has at most 16), the same in every shape */
    vf lanes[16];
    for (int i = 0; i < 16; i++) lanes[i] = splat(0.0f);
    #pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
        #pragma GCC unroll 8
        for (int c = 0; c < nc; c++) lanes[r * nc + c] = (vf)acc[r][c];
    vf total = reduce_lanes(lanes);
    if (a->bias) {
        float bias[16] = {0};
        for (int i = 0; i < mr * nc; i++) bias[i] = a->bias[n0 + i % nc];
        total = total + load_f32(bias);
    }
    uint16_t values[16];
    _mm256_storeu_si256((__m256i*)values, (__m256i)_mm512_cvtneps_pbh((__m512)total));  /* rounded to nearest even */
    for (int r = 0; r < mr; r++) memcpy(a->out + (m0 + r) * a->n_out + n0, values + r * nc, (size_t)nc * 2);
}

/* One tile's sums, by the shape and the weights' source: the full shapes compiled apart, the edges
 * through the general one. */
static void wqb_tile_any(const wqb_args* a, int64_t m0, int64_t n0, int mr, int nc) {
    const int pair = a->group == 32;
    if (a->expanded) {
        if (mr == WQB_TILE_ROWS && nc == WQB_TILE_COLS) wqb_tile(a, m0, n0, WQB_TILE_ROWS, WQB_TILE_COLS, 1, 0);
        else wqb_tile(a, m0, n0, mr, nc, 1, 0);
    } else if (pair) {
        wqb_tile(a, m0, n0, mr, nc, 0, 1);
    } else if (mr == 1 && nc == WQB_ONE_ROW_COLS) {
        wqb_tile(a, m0, n0, 1, WQB_ONE_ROW_COLS, 0, 0);
    } else if (mr == 2 && nc == WQB_COLS) {
        wqb_tile(a, m0, n0, 2, WQB_COLS, 0, 0);
    } else if (mr == 1 && nc == WQB_COLS) {
        wqb_tile(a, m0, n0, 1, WQB_COLS, 0, 0);
    } else {
        wqb_tile(a, m0, n0, mr, nc, 0, 0);
    }
}

/* The rows in the chunk order (inputs 0-15, 32-47, 16-31, 48-63 of each chunk), zero past k_in. */
static void wqb_order_rows(const uint16_t* x, int64_t rows, int64_t k_in, int64_t chunks, uint16_t* xp, int nt) {
    static const int source[4] = {0, 32, 16, 48};
    #pragma omp parallel for schedule(static) num_threads(nt) if (rows >= 64)
    for (int64_t m = 0; m < rows; m++) {
        const uint16_t* row = x + m * k_in;
        uint16_t* to = xp + m * chunks * WQB_CHUNK;
        int64_t c = 0;
        for (; (c + 1) * WQB_CHUNK <= k_in; c++, to += WQB_CHUNK) {  /* whole chunks: four 32-byte moves */
            const uint16_t* from = row + c * WQB_CHUNK;
            _mm256_storeu_si256((__m256i*)to, _mm256_loadu_si256((const __m256i*)from));
            _mm256_storeu_si256((__m256i*)(to + 16), _mm256_loadu_si256((const __m256i*)(from + 32)));
            _mm256_storeu_si256((__m256i*)(to + 32), _mm256_loadu_si256((const __m256i*)(from + 16)));
            _mm256_storeu_si256((__m256i*)(to + 48), _mm256_loadu_si256((const __m256i*)(from + 48)));
        }
        for (; c < chunks; c++, to += WQB_CHUNK)
            for (int q = 0; q < 4; q++) {
                int64_t from = c * WQB_CHUNK + source[q];
                int64_t count = k_in - from < 16 ? (k_in - from > 0 ? k_in - from : 0) : 16;
                memcpy(to + q * 16, row + from, (size_t)count * 2);
                memset(to + q * 16 + count, 0, (size_t)(16 - count) * 2);
            }
    }
}

/* Weight rows [n0, n1) decoded once into the bf16 vectors the tiles multiply. */
static void wqb_expand(const wqb_args* a, int64_t n0, int64_t n1, uint16_t* expanded) {
    const int pair = a->group == 32;
    const int64_t per_table = pair ? 1 : a->group / WQB_CHUNK;
    for (int64_t n = n0; n < n1; n++) {
        const float* scales = a->scales + n * a->groups;
        const float* zeros = a->zeros ? a->zeros + n * a->groups : NULL;
        for (int64_t k = 0; k < a->chunks; k++) {
            __m512i wa, wb, table = wqb_table(scales, zeros, pair ? 2 * k : k / per_table, a->groups, pair);
            uint16_t* e = expanded + ((n - n0) * a->chunks + k) * WQB_CHUNK;
            wqb_decode(a->w + n * a->row_bytes, k, a->tail_half && k == a->chunks - 1, table, pair, &wa, &wb);
            _mm512_storeu_si512(e, wa);
            _mm512_storeu_si512(e + 32, wb);
        }
    }
}

/* out (bf16 [rows, n_out]) = bf16(sum_k x_k bf16((q_k - zero) * scale) + bias), x bf16 [rows, k_in];
 * weights packed as wq_gemm's (4-bit, VL = 16), groups as wq_bf16_applies says. */
void wq_gemm_bf16(const uint16_t* x, int64_t rows, int64_t k_in, const uint8_t* w, int64_t row_bytes,
                  int64_t n_out, int64_t group, const float* scales, const float* zeros, const float* bias,
                  uint16_t* out, int nt) {
    const int64_t chunks = (k_in + WQB_CHUNK - 1) / WQB_CHUNK;
    const wqb_args shared = {NULL, chunks, w, row_bytes, k_in % WQB_CHUNK != 0, NULL, 0, group, k_in / group,
                             scales, zeros, bias, out, n_out};
    uint16_t* xp = aligned_alloc(64, (size_t)(rows * chunks * WQB_CHUNK * 2));
    wqb_order_rows(x, rows, k_in, chunks, xp, nt);
    /* From WQB_EXPAND_ROWS rows each block of weight rows is expanded once for the block of rows it
     * meets (a thread's own buffer, in L1), and tiles of more rows read it; fewer rows decode as
     * they go. */
    const int expand = rows >= WQB_EXPAND_ROWS;
    const int cols = expand ? WQB_TILE_COLS : rows == 1 ? WQB_ONE_ROW_COLS : WQB_COLS;
    const int tile_rows = expand ? WQB_TILE_ROWS : 2;
    /* blocks of rows by blocks of weight rows, tiles inside: a block's weights stay in L1/L2 while
     * its rows pass by, a block's rows in L2 while the weight blocks do */
    const int64_t row_blocks = (rows + WQB_BLOCK_ROWS - 1) / WQB_BLOCK_ROWS;
    const int64_t col_blocks = (n_out + WQB_BLOCK_COLS - 1) / WQB_BLOCK_COLS;
    #pragma omp parallel num_threads(nt)
    {
        uint16_t* expanded = expand ? aligned_alloc(64, (size_t)(WQB_BLOCK_COLS * chunks * WQB_CHUNK * 2)) : NULL;
        wqb_args a = shared;
        a.xp = xp;
        #pragma omp for collapse(2) schedule(static)
        for (int64_t rb = 0; rb < row_blocks; rb++)
            for (int64_t cb = 0; cb < col_blocks; cb++) {
                const int64_t m_end = (rb + 1) * WQB_BLOCK_ROWS < rows ? (rb + 1) * WQB_BLOCK_ROWS : rows;
                const int64_t n_end = (cb + 1) * WQB_BLOCK_COLS < n_out ? (cb + 1) * WQB_BLOCK_COLS : n_out;
                if (expand) {
                    wqb_expand(&shared, cb * WQB_BLOCK_COLS, n_end, expanded);
                    a.expanded = expanded;
                    a.expanded_from = cb * WQB_BLOCK_COLS;
                }
                for (int64_t m0 = rb * WQB_BLOCK_ROWS; m0 < m_end; m0 += tile_rows)
                    for (int64_t n = cb * WQB_BLOCK_COLS; n < n_end; n += cols) {
                        const int nc = n_end - n < cols ? (int)(n_end - n) : cols;
                        const int mr = m_end - m0 < tile_rows ? (int)(m_end - m0) : tile_rows;
                        wqb_tile_any(&a, m0, n, mr, nc);
                    }
            }
        free(expanded);
    }
    free(xp);
}
#endif

/* The weights [n_out, k_in] of packed ones: (q - zero) * scale in fp32, as a reference dequantizes,
 * stored in fp32 or (bf16 != 0) rounded to bf16. */
void wq_dequantize(const uint8_t* w, int64_t row_bytes, int64_t bits, int64_t n_out, int64_t k_in,
                   int64_t group, const float* scales, const float* zeros, void* out, int64_t bf16, int nt) {
    int64_t groups = (k_in + group - 1) / group;
    #pragma omp parallel num_threads(nt)
    {
        /* each row in fp32 first (a buffer of the thread's own), then stored in fp32 or rounded to bf16:
         * bf16 weights are the fp32 ones rounded as .to(torch.bfloat16) rounds them */
        float* on = bf16 ? aligned_alloc(64, (size_t)((k_in * 4 + 63) / 64 * 64)) : NULL;
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < n_out; n++) {
            const uint8_t* wn = w + n * row_bytes;
            float* row = bf16 ? on : (float*)out + n * k_in;
            int64_t k = 0;
            for (; k + 2 * VL <= k_in; k += 2 * VL) {
                vf w0, w1;
                weight_block(wn, k / (2 * VL), (int)bits, &w0, &w1);
                store_f32(row + k, w0);
                store_f32(row + k + VL, w1);
            }
            for (; k < k_in; k++) row[k] = weight_at(wn, k, (int)bits);
            for (int64_t g = 0; g < groups; g++) {
                int64_t k1 = (g + 1) * group < k_in ? (g + 1) * group : k_in;
                float zero = zeros ? zeros[n * groups + g] : 0.0f, scale = scales[n * groups + g];
                for (int64_t j = g * group; j < k1; j++) row[j] = (row[j] - zero) * scale;
            }
            if (bf16) {
                uint16_t* dst = (uint16_t*)out + n * k_in;
                int64_t j = 0;
                for (; j + VL <= k_in; j += VL) store_bf16(dst + j, load_f32(row + j));
                for (; j < k_in; j++) dst[j] = f32_to_bf16(row[j]);
            }
        }
        free(on);
    }
}
