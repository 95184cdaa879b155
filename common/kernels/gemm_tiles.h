/* Register-tiled small-M float32 GEMM (AVX2 + FMA), shared by small_gemm.cpp and cpu_decoder.cpp.
 *
 * gemm_range computes y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for every row m < M and the output
 * columns n in [n_begin, n_end): each pair (or quad) of weight rows is read from memory once and
 * stays in L1 while every tile of up to 6 input rows is multiplied against it, and the next rows
 * are prefetched while the current ones compute, so the cost stays close to one pass over the
 * weights for any small M. (Prefetching past the end of `w` is harmless: prefetches never fault.)
 */
#pragma once
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* One MR x NR tile: MR rows of x against NR weight rows, full K. Template parameters, fully
 * unrolled, so the MR * NR accumulators live in registers. */
template <int MR, int NR>
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const float *w,
                                                       int64_t K, const float *bias, float *y,
                                                       int64_t ldy) {
    __m256 acc[MR][NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        // Pull the next tile's weight rows (contiguous after these) toward L1 while this tile
        // computes: one prefetch per 64-byte line. It lets the memory stream overlap the FMAs,
        // which is what keeps a 5-row pass near the cost of a 1-row pass.
        if ((k & 15) == 0) {
#pragma GCC unroll 8
            for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(w + (NR + j) * K + k), _MM_HINT_T0);
        }
        __m256 wv[NR];
#pragma GCC unroll 8
        for (int j = 0; j < NR; j++) wv[j] = _mm256_loadu_ps(w + j * K + k);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
#pragma GCC unroll 8
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            float s = hsum(acc[i][j]);
            for (int64_t kk = k; kk < K; kk++) s += x[i * ldx + kk] * w[j * K + kk];
            y[i * ldy + j] = s + (bias ? bias[j] : 0.0f);
        }
}

/* Rows of x in tiles of up to 6 (12 accumulators with NR = 2), or 4 rows with NR = 3. */
#define ROW_TILES(NR)                                                                   \
    for (int64_t m = 0; m < M;) {                                                       \
        int64_t r = M - m;                                                              \
        const float *xm = x + m * ldx;                                                  \
        float *ym = y + m * ldy + n;                                                    \
        const float *bn = bias ? bias + n : nullptr;                                          \
        if (NR <= 2 && r >= 6) { tile<6, NR>(xm, ldx, wn, K, bn, ym, ldy); m += 6; }    \
        else if (NR <= 2 && r == 5) { tile<5, NR>(xm, ldx, wn, K, bn, ym, ldy); m += 5; }   \
        else if (r >= 4) { tile<4, NR>(xm, ldx, wn, K, bn, ym, ldy); m += 4; }          \
        else if (r == 3) { tile<3, NR>(xm, ldx, wn, K, bn, ym, ldy); m += 3; }          \
        else if (r == 2) { tile<2, NR>(xm, ldx, wn, K, bn, ym, ldy); m += 2; }          \
        else { tile<1, NR>(xm, ldx, wn, K, bn, ym, ldy); m += 1; }                      \
    }

static void gemm_range(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                       int64_t ldy, int64_t M, int64_t K, int64_t n_begin, int64_t n_end) {
    int64_t n = n_begin;
    if (M == 1) { /* one row (decode at batch 1): eight weight rows at a time keep more loads in flight */
        for (; n + 8 <= n_end; n += 8) { const float *wn = w + n * K; ROW_TILES(8) }
    }
    if (M <= 2) { /* few rows: four weight rows at a time keep more FMAs in flight */
        for (; n + 4 <= n_end; n += 4) { const float *wn = w + n * K; ROW_TILES(4) }
    } else if (M <= 4) {
        for (; n + 3 <= n_end; n += 3) { const float *wn = w + n * K; ROW_TILES(3) }
    }
    for (; n + 2 <= n_end; n += 2) { const float *wn = w + n * K; ROW_TILES(2) }
    for (; n < n_end; n++) { const float *wn = w + n * K; ROW_TILES(1) }
}
