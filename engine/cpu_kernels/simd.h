/* Vector helpers shared by the kernels: GCC vector extensions (so the code vectorizes the same on
 * AVX-512, AVX2 and other targets), bf16 <-> fp32, selects, lane reductions and exp.
 * VL: fp32 lanes per vector, 16 where AVX-512 is available, else 8. */
#ifndef BULKINFER_SIMD_H
#define BULKINFER_SIMD_H

#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint32_t vu32 __attribute__((vector_size(VL * 4)));
typedef uint16_t vu16 __attribute__((vector_size(VL * 2)));
typedef int32_t vi32 __attribute__((vector_size(VL * 4)));

/* GCC's AMX tile load/store intrinsics are asm that does not declare the memory it reads or
 * writes: without this barrier between them and plain code, stores to a buffer a tile then loads
 * can be dropped as dead, and reads of what a tile stored can move before the store. */
#define TILE_MEMORY_BARRIER() __asm__ __volatile__("" ::: "memory")

static inline vf load_f32(const float* p) { vf v; memcpy(&v, p, sizeof v); return v; }
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vf load_bf16(const uint16_t* p) {
    __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
    return (vf)_mm512_castsi512_ps(w);
}
#else
static inline vf load_bf16(const uint16_t* p) {
    vu16 h; memcpy(&h, p, sizeof h);
    vu32 w = __builtin_convertvector(h, vu32) << 16;
    vf v; memcpy(&v, &w, sizeof v); return v;
}
#endif
static inline __attribute__((always_inline)) vf load_vec(const void* base, int64_t index, int bf16) {
    return bf16 ? load_bf16((const uint16_t*)base + index) : load_f32((const float*)base + index);
}
static inline vf vselect(vi32 mask, vf a, vf b) {
    vi32 ai, bi; memcpy(&ai, &a, sizeof a); memcpy(&bi, &b, sizeof b);
    vi32 ri = (ai & mask) | (bi & ~mask);
    vf r; memcpy(&r, &ri, sizeof r); return r;
}
static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }
/* x in every lane; "x - zero vector" is one broadcast (a lane-by-lane loop compiles to VL masked
 * inserts on AVX-512), and exact for every x, -0.0 included. */
static inline vf splat(float x) { return x - (vf){0}; }
/* v, kept in a register: GCC folds a loaded vector into each FMA that uses it as a memory operand,
 * one load per FMA, which starves Zen 4's single 512-bit load per cycle when four FMAs share it. */
static inline __attribute__((always_inline)) vf in_register(vf v) { __asm__("" : "+v"(v)); return v; }

#if VL == 16
#define LO1 0,1,2,3,4,5,6,7,16,17,18,19,20,21,22,23
#define HI1 8,9,10,11,12,13,14,15,24,25,26,27,28,29,30,31
#define LO2 0,1,2,3,8,9,10,11,16,17,18,19,24,25,26,27
#define HI2 4,5,6,7,12,13,14,15,20,21,22,23,28,29,30,31
#define LO3 0,1,4,5,8,9,12,13,16,17,20,21,24,25,28,29
#define HI3 2,3,6,7,10,11,14,15,18,19,22,23,26,27,30,31
#define LO4 0,2,4,6,8,10,12,14,16,18,20,22,24,26,28,30
#define HI4 1,3,5,7,9,11,13,15,17,19,21,23,25,27,29,31
#define PAIR(a, b, LO, HI) (__builtin_shufflevector(a, b, LO) + __builtin_shufflevector(a, b, HI))
static inline vf reduce_lanes(const vf* v) {
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = PAIR(v[2 * i], v[2 * i + 1], LO1, HI1);
    for (int i = 0; i < 4; i++) b[i] = PAIR(a[2 * i], a[2 * i + 1], LO2, HI2);
    for (int i = 0; i < 2; i++) c[i] = PAIR(b[2 * i], b[2 * i + 1], LO3, HI3);
    return PAIR(c[0], c[1], LO4, HI4);
}
static inline float hmax(vf v) {
    v = vmax(v, __builtin_shufflevector(v, v, 8,9,10,11,12,13,14,15,0,1,2,3,4,5,6,7));
    v = vmax(v, __builtin_shufflevector(v, v, 4,5,6,7,0,1,2,3,12,13,14,15,8,9,10,11));
    v = vmax(v, __builtin_shufflevector(v, v, 2,3,0,1,6,7,4,5,10,11,8,9,14,15,12,13));
    v = vmax(v, __builtin_shufflevector(v, v, 1,0,3,2,5,4,7,6,9,8,11,10,13,12,15,14));
    return v[0];
}
static inline float hsum(vf v) {
    v = v + __builtin_shufflevector(v, v, 8,9,10,11,12,13,14,15,0,1,2,3,4,5,6,7);
    v = v + __builtin_shufflevector(v, v, 4,5,6,7,0,1,2,3,12,13,14,15,8,9,10,11);
    v = v + __builtin_shufflevector(v, v, 2,3,0,1,6,7,4,5,10,11,8,9,14,15,12,13);
    v = v + __builtin_shufflevector(v, v, 1,0,3,2,5,4,7,6,9,8,11,10,13,12,15,14);
    return v[0];
}
#else
#define LO1 0,1,2,3,8,9,10,11
#define HI1 4,5,6,7,12,13,14,15
#define LO2 0,1,4,5,8,9,12,13
#define HI2 2,3,6,7,10,11,14,15
#define LO3 0,2,4,6,8,10,12,14
#define HI3 1,3,5,7,9,11,13,15
#define PAIR(a, b, LO, HI) (__builtin_shufflevector(a, b, LO) + __builtin_shufflevector(a, b, HI))
static inline vf reduce_lanes(const vf* v) {
    vf a[4], b[2];
    for (int i = 0; i < 4; i++) a[i] = PAIR(v[2 * i], v[2 * i + 1], LO1, HI1);
    for (int i = 0; i < 2; i++) b[i] = PAIR(a[2 * i], a[2 * i + 1], LO2, HI2);
    return PAIR(b[0], b[1], LO3, HI3);
}
static inline float hmax(vf v) {
    v = vmax(v, __builtin_shufflevector(v, v, 4,5,6,7,0,1,2,3));
    v = vmax(v, __builtin_shufflevector(v, v, 2,3,0,1,6,7,4,5));
    v = vmax(v, __builtin_shufflevector(v, v, 1,0,3,2,5,4,7,6));
    return v[0];
}
static inline float hsum(vf v) {
    v = v + __builtin_shufflevector(v, v, 4,5,6,7,0,1,2,3);
    v = v + __builtin_shufflevector(v, v, 2,3,0,1,6,7,4,5);
    v = v + __builtin_shufflevector(v, v, 1,0,3,2,5,4,7,6);
    return v[0];
}
#endif

/* exp(x) for x <= 0: Cody-Waite reduction, Cephes' polynomial (within 2 ulp). */
static inline vf vexp(vf x) {
    x = vmax(x, splat(-87.0f));
    vi32 ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi32);
    vf nf = __builtin_convertvector(ni, vf);
    vf r = x - nf * 0.693359375f;
    r = r + nf * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vu32 bits = (vu32)((ni + 127) << 23);
    vf scale; memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX512F__)
/* 2^x to ~3e-6 relative (a degree-5 Taylor polynomial on [-0.5, 0.5], then scalef, which flushes
 * what underflows and gives inf past the range): for results rounded to bf16 (4e-3) anyway, in
 * about half vexp's instructions. */
static inline __m512 exp2_ps(__m512 x) {
#if defined(__AVX512DQ__)
    /* vreduceps gives x - round(x) in one uop where vrndscaleps takes two (both exact) */
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 whole = _mm512_sub_ps(x, f);
#else
    const __m512 whole = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, whole);
#endif
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, whole);
}
#endif


/* Each lane rounded to bf16 (nearest even; NaN stays NaN), as the bf16 bit patterns in 32 bits. */
static inline vu32 bf16_bits(vf v) {
    vu32 bits;
    memcpy(&bits, &v, sizeof bits);
    const vu32 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const vi32 nan = (vi32)((bits & 0x7fffffffu) > 0x7f800000u);
    return (vu32)(((vi32)((bits >> 16) | 0x40u) & nan) | ((vi32)rounded & ~nan));
}
#if defined(__AVX512BF16__) && VL == 16
/* AVX512-BF16 rounds 16 lanes to bf16 (nearest even, NaN kept) in one instruction. */
static inline void store_bf16(uint16_t* p, vf v) {
    const __m256bh narrow = _mm512_cvtneps_pbh((__m512)v);
    memcpy(p, &narrow, sizeof narrow);
}
/* The bf16 value nearest to each lane, as fp32: what a bf16 tensor op rounds its result to. */
static inline vf round_bf16(vf v) {
    const __m256bh narrow = _mm512_cvtneps_pbh((__m512)v);
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)narrow), 16));
}
#else
static inline void store_bf16(uint16_t* p, vf v) {
    const vu16 narrow = __builtin_convertvector(bf16_bits(v), vu16);
    memcpy(p, &narrow, sizeof narrow);
}
/* The bf16 value nearest to each lane, as fp32: what a bf16 tensor op rounds its result to. */
static inline vf round_bf16(vf v) {
    const vu32 bits = bf16_bits(v) << 16;
    vf out;
    memcpy(&out, &bits, sizeof out);
    return out;
}
#endif
static inline void store_f32(float* p, vf v) { memcpy(p, &v, sizeof v); }

/* VL values (bf16 or fp32) from base[index...], or the first n of them (the rest zero) at a row's end. */
static inline __attribute__((always_inline)) vf load_n(const void* base, int64_t index, int64_t n, int bf16) {
    if (n >= VL) return load_vec(base, index, bf16);
    if (bf16) {
        uint16_t padded[VL] = {0};
        memcpy(padded, (const uint16_t*)base + index, (size_t)n * sizeof *padded);
        return load_bf16(padded);
    }
    float padded[VL] = {0};
    memcpy(padded, (const float*)base + index, (size_t)n * sizeof *padded);
    return load_f32(padded);
}

static inline __attribute__((always_inline)) void store_n(void* base, int64_t index, vf v, int64_t n, int bf16) {
    if (bf16) {
        uint16_t* p = (uint16_t*)base + index;
        if (n >= VL) { store_bf16(p, v); return; }
        uint16_t padded[VL];
        store_bf16(padded, v);
        memcpy(p, padded, (size_t)n * sizeof *padded);
        return;
    }
    float* p = (float*)base + index;
    if (n >= VL) { store_f32(p, v); return; }
    memcpy(p, &v, (size_t)n * sizeof *p);
}

/* What a tensor op of this dtype rounds its result to: bf16's nearest value, or fp32 itself. */
static inline __attribute__((always_inline)) vf rounded(vf v, int bf16) { return bf16 ? round_bf16(v) : v; }

/* A per-thread scratch buffer of at least `bytes`, 64-byte aligned, grown (doubling) as inputs grow
 * and never freed: the kernels' threads are OpenMP's, kept for the life of the process. `buffer`
 * and `capacity` are the caller's own __thread variables. */
/* Packed sequences' work items: the sequence s holding `item`, item_at[s] <= item < item_at[s + 1]
 * (item_at: S + 1 prefix counts of items per sequence). */
static inline int64_t sequence_of_item(const int64_t* item_at, int64_t S, int64_t item) {
    int64_t lo = 0, hi = S - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (item_at[mid] <= item) lo = mid; else hi = mid - 1;
    }
    return lo;
}

static inline void* thread_scratch(void** buffer, int64_t* capacity, int64_t bytes) {
    if (bytes > *capacity) {
        free(*buffer);
        *capacity = bytes * 2;
        *buffer = aligned_alloc(64, (size_t)*capacity);
    }
    return *buffer;
}
static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}
static inline uint16_t f32_to_bf16(float value) { return (uint16_t)bf16_bits(splat(value))[0]; }

#endif
