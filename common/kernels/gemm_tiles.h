/* Register-tiled small-M float32 GEMM, shared by small_gemm.cpp and cpu_decoder.cpp.
 *
 * gemm_range computes y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for every row m < M and the output
 * columns n in [n_begin, n_end): each group of NR weight rows is read from memory once and stays
 * in L1 while every tile of up to MR input rows is multiplied against it, and the next rows are
 * prefetched while the current ones compute, so the cost stays close to one pass over the
 * weights for any small M. (Prefetching past the end of `w` is harmless: prefetches never fault.)
 *
 * Every kernel is compiled twice (native.py): with -mavx2 -mfma (8-wide ymm, 16 registers) and
 * with -mavx512f/bw/vl/dq (16-wide zmm, 32 registers, so larger tiles); `vec` below is whichever
 * the build targets, and the two builds differ only in summation order.
 *
 * The weights W are float32 (`float`) or bfloat16 (`bf16_t`, the upper half of a float32's bits):
 * bf16 weights are widened to float32 as they are loaded (a shift, exact) and the math stays
 * float32, so a token streams half the bytes for the same result as float32 weights holding the
 * same (bf16-rounded) values.
 */
#pragma once
#include <immintrin.h>
#include <stdint.h>

typedef uint16_t bf16_t;
static inline float to_float(float w) { return w; }
static inline float to_float(bf16_t w) {
    uint32_t bits = (uint32_t)w << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX512F__)
typedef __m512 vec;
constexpr int VW = 16;  // floats per vector
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vset1(float a) { return _mm512_set1_ps(a); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
static inline vec vload(const bf16_t *p) {  // widened: float32 bits = bf16 bits << 16
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#else
typedef __m256 vec;
constexpr int VW = 8;
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vset1(float a) { return _mm256_set1_ps(a); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
static inline vec vload(const bf16_t *p) {  // widened: float32 bits = bf16 bits << 16
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

/* Which cache the next weight rows are prefetched into: L1 (T0, 0; what the tiles were tuned with
 * on an Intel Xeon) or L2 (T1, 1; on an AMD EPYC with AVX-512, SmolLM2-135M's batch-1 forward
 * with 2 threads 25.0 -> 20.8 ms, a 30-layer GEMV on one thread 16.7 -> 22.9 GB/s). Each library
 * holds its own; native.py sets it once when it loads one (tandem_set_prefetch_l2). */
static int g_prefetch_l2 = 0;
extern "C" void tandem_set_prefetch_l2(int on) { g_prefetch_l2 = on; }

/* One MR x NR tile: MR rows of x against NR weight rows, full K. Template parameters, fully
 * unrolled, so the MR * NR accumulators live in registers. */
template <int MR, int NR, class W>
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const W *w,
                                                       int64_t K, const float *bias, float *y,
                                                       int64_t ldy) {
    vec acc[MR][NR];
#pragma GCC unroll 16
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NR; j++) acc[i][j] = vzero();
    int64_t k = 0;
    for (; k + VW <= K; k += VW) {
        // Pull the next tile's weight rows (contiguous after these) toward L1 while this tile
        // computes: one prefetch per 64-byte line. It lets the memory stream overlap the FMAs,
        // which is what keeps a 5-row pass near the cost of a 1-row pass. (16 floats or 32 bf16
        // values to a line.)
        if ((k & (64 / sizeof(W) - 1)) == 0) {
            if (g_prefetch_l2) {
#pragma GCC unroll 8
                for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(w + (NR + j) * K + k), _MM_HINT_T1);
            } else {
#pragma GCC unroll 8
                for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(w + (NR + j) * K + k), _MM_HINT_T0);
            }
        }
        vec wv[NR];
#pragma GCC unroll 8
        for (int j = 0; j < NR; j++) wv[j] = vload(w + j * K + k);
#pragma GCC unroll 16
        for (int i = 0; i < MR; i++) {
            vec xv = vload(x + i * ldx + k);
#pragma GCC unroll 8
            for (int j = 0; j < NR; j++) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            float s = vsum(acc[i][j]);
            for (int64_t kk = k; kk < K; kk++) s += x[i * ldx + kk] * to_float(w[j * K + kk]);
            y[i * ldy + j] = s + (bias ? bias[j] : 0.0f);
        }
}

#if defined(__AVX512F__)
/* The rows of x in near-equal tiles of at most MAXR rows (13 rows: 7 + 6, not 8 + 5): the
 * weight-load to FMA ratio of a tile falls with its row count, so no tile is left much smaller. */
template <int NR, int R, class W>
static inline __attribute__((always_inline)) void tile_of(int64_t r, const float *x, int64_t ldx, const W *w,
                                                          int64_t K, const float *bias, float *y, int64_t ldy) {
    if constexpr (R > 1) {
        if (r < R) return tile_of<NR, R - 1, W>(r, x, ldx, w, K, bias, y, ldy);
    }
    tile<R, NR, W>(x, ldx, w, K, bias, y, ldy);
}

template <int NR, int MAXR, class W>
static inline void row_tiles(const float *x, int64_t ldx, const W *wn, int64_t K, const float *bn, float *y,
                             int64_t ldy, int64_t M) {
    int64_t tiles = (M + MAXR - 1) / MAXR;
    for (int64_t m = 0; tiles > 0; tiles--) {
        int64_t r = (M - m + tiles - 1) / tiles;
        tile_of<NR, MAXR, W>(r, x + m * ldx, ldx, wn, K, bn, y + m * ldy, ldy);
        m += r;
    }
}

/* 32 zmm registers: MR * NR accumulators + NR weight vectors + one x vector. Each group of NR
 * weight rows re-reads all M rows of x (from L2 once they outgrow L1), so x traffic per FLOP falls
 * as 1 / NR: 6 rows x 4 weight rows measured 1.3-1.4x faster than 8 x 3 or 12 x 2 at 16-128 rows
 * (benchmarks/cpu_gemm.py shapes, one thread), as fast as 7 x 4, 5 x 5 and 4 x 6. */
template <class W>
static void gemm_range(const float *x, int64_t ldx, const W *w, const float *bias, float *y,
                       int64_t ldy, int64_t M, int64_t K, int64_t n_begin, int64_t n_end) {
    int64_t n = n_begin;
#define GROUPS(NR, MAXR)                                                                              \
    for (; n + NR <= n_end; n += NR)                                                                  \
        row_tiles<NR, MAXR, W>(x, ldx, w + n * K, K, bias ? bias + n : nullptr, y + n, ldy, M);
    if (M == 1) { GROUPS(8, 1) }  /* decode at batch 1: eight weight rows keep more loads in flight */
    else if (M <= 3) { GROUPS(6, 3) }
    else { GROUPS(4, 6) }
    GROUPS(2, 8)
    GROUPS(1, 8)
#undef GROUPS
}
#else
/* Rows of x in tiles of up to 6 (12 accumulators with NR = 2), or 4 rows with NR = 3. */
#define ROW_TILES(NR)                                                                   \
    for (int64_t m = 0; m < M;) {                                                       \
        int64_t r = M - m;                                                              \
        const float *xm = x + m * ldx;                                                  \
        float *ym = y + m * ldy + n;                                                    \
        const float *bn = bias ? bias + n : nullptr;                                          \
        if (NR <= 2 && r >= 6) { tile<6, NR, W>(xm, ldx, wn, K, bn, ym, ldy); m += 6; }    \
        else if (NR <= 2 && r == 5) { tile<5, NR, W>(xm, ldx, wn, K, bn, ym, ldy); m += 5; }   \
        else if (r >= 4) { tile<4, NR, W>(xm, ldx, wn, K, bn, ym, ldy); m += 4; }          \
        else if (r == 3) { tile<3, NR, W>(xm, ldx, wn, K, bn, ym, ldy); m += 3; }          \
        else if (r == 2) { tile<2, NR, W>(xm, ldx, wn, K, bn, ym, ldy); m += 2; }          \
        else { tile<1, NR, W>(xm, ldx, wn, K, bn, ym, ldy); m += 1; }                      \
    }

template <class W>
static void gemm_range(const float *x, int64_t ldx, const W *w, const float *bias, float *y,
                       int64_t ldy, int64_t M, int64_t K, int64_t n_begin, int64_t n_end) {
    int64_t n = n_begin;
    if (M == 1) { /* one row (decode at batch 1): eight weight rows at a time keep more loads in flight */
        for (; n + 8 <= n_end; n += 8) { const W *wn = w + n * K; ROW_TILES(8) }
    }
    if (M <= 2) { /* few rows: four weight rows at a time keep more FMAs in flight */
        for (; n + 4 <= n_end; n += 4) { const W *wn = w + n * K; ROW_TILES(4) }
    } else if (M <= 4) {
        for (; n + 3 <= n_end; n += 3) { const W *wn = w + n * K; ROW_TILES(3) }
    }
    for (; n + 2 <= n_end; n += 2) { const W *wn = w + n * K; ROW_TILES(2) }
    for (; n < n_end; n++) { const W *wn = w + n * K; ROW_TILES(1) }
}
#endif
