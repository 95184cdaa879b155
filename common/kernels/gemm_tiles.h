/* Register-tiled small-M float32 GEMM, shared by small_gemm.cpp and cpu_decoder.cpp.
 *
 * gemm_range computes y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for every row m < M and the output
 * columns n in [n_begin, n_end). On AMD CPUs one, two or four rows (decode at batch 1, 2, 4) read the
 * weight rows one after another (rows_in_turn, the same bits as the tiles). Otherwise each group of NR weight rows is read from memory once and stays
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

/* Which cache the tiles prefetch the next weight rows into: L1 (T0, 0; what the tiles were tuned with
 * on an Intel Xeon) or L2 (T1, 1; on an AMD EPYC with AVX-512, Zen 4 class, SmolLM2-135M's
 * batch-1 forward with 2 threads 25.0 -> 20.8 ms when the tiles still ran batch 1). Each library
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

template <int MR, class W>
static inline __attribute__((always_inline)) void rows_in_turn_of(const float *x, int64_t ldx, const W *w, int64_t K,
                                                                  const float *bias, float *y, int64_t ldy,
                                                                  int64_t n_begin, int64_t n_end) {
    for (int64_t n = n_begin; n < n_end; n++) {
        const W *r = w + n * K;
        vec acc[MR];
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) acc[i] = vzero();
        int64_t k = 0;
        for (; k + VW <= K; k += VW) {
            vec wv = vload(r + k);
#pragma GCC unroll 8
            for (int i = 0; i < MR; i++) acc[i] = vfma(vload(x + i * ldx + k), wv, acc[i]);
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {  // tile()'s order exactly: vsum, the scalar tail, the bias
            float s = vsum(acc[i]);
            for (int64_t kk = k; kk < K; kk++) s += x[i * ldx + kk] * to_float(r[kk]);
            y[i * ldy + n] = s + (bias ? bias[n] : 0.0f);
        }
    }
}

/* A few rows of x (decode at batch 1, 2 or 4: rows_in_turn_for): y[m, n] = x[m] . w[n, :] for n in
 * [n_begin, n_end), each weight row read start to end before the next. The weights are then one
 * forward stream per thread, which the hardware prefetchers follow without help; NR rows side by
 * side (the tiles above) are NR streams a row apart, and their software prefetches did not make up
 * for it. AMD EPYC with AVX-512 (Zen 5 class), 2 threads over 420 MB, alternating: K = 576
 * 32.6-34.9 GB/s against 26.5-29.7 for eight-row tiles, K = 1536 26.1-54.0 against 23.3-43.8;
 * SmolLM2-135M decode steps (kernel_ab) 1.16x / 1.16x faster at batch 1 / 2 (the AVX2 build
 * 1.20x / 1.07x). Each output sums in tile()'s order (one vector accumulator, then its lanes, the
 * tail, the bias), so a row's results are the same bits whichever path its step takes: a sequence
 * decoded alone and the same sequence beside others, or resumed in a prompt, round alike. Four
 * accumulators a row (a shorter FMA chain) streamed no faster: 43.7-48.0 against 45.2-48.6 GB/s. */
// Rows of x that read the weight rows in turn (other counts run the tiles): 1, 2 and 4, on AMD. Four
// rows against the tiles, SmolLM2-135M decode steps (kernel_ab, Zen 5 class EPYC): 1.09x, 1.10x,
// 1.02x, 0.98x and 1.08x over 20 repeats (its batch-1 control 0.99x), the AVX2 build 1.08x; three
// rows 0.94x / 0.945x (their six-weight-row tiles win there). On an Intel Xeon (AVX-512, 2026-12-07)
// the tiles with their L1 prefetches win at every count: rows in turn 0.97x at batch 1, 0.87x at 2,
// 0.77x at 4. Both paths give the same bits, so the choice is speed only; native.py sets it once
// when it loads a library (tandem_set_rows_in_turn: on for AMD CPUs).
static int g_rows_in_turn = 0;
extern "C" void tandem_set_rows_in_turn(int on) { g_rows_in_turn = on; }
// Only for weights streamed from memory (gemm_range's `streamed`, the caller's knowledge): where a
// model's layers stay in cache one accumulator chain at a time is latency-bound, and the tiles, NR
// chains side by side, win (Zen 2 EPYC, one row, in cache: K = 128 1.45-1.5x, K = 384-576 1.9-2x).
static inline bool rows_in_turn_for(int64_t M) { return g_rows_in_turn && (M <= 2 || M == 4); }
template <class W>
static inline void rows_in_turn(const float *x, int64_t ldx, const W *w, int64_t K, const float *bias, float *y,
                                int64_t ldy, int64_t M, int64_t n_begin, int64_t n_end) {
    switch (M) {
        case 1: return rows_in_turn_of<1, W>(x, ldx, w, K, bias, y, ldy, n_begin, n_end);
        case 2: return rows_in_turn_of<2, W>(x, ldx, w, K, bias, y, ldy, n_begin, n_end);
        default: return rows_in_turn_of<4, W>(x, ldx, w, K, bias, y, ldy, n_begin, n_end);
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
                       int64_t ldy, int64_t M, int64_t K, int64_t n_begin, int64_t n_end, bool streamed = true) {
    int64_t n = n_begin;
#define GROUPS(NR, MAXR)                                                                              \
    for (; n + NR <= n_end; n += NR)                                                                  \
        row_tiles<NR, MAXR, W>(x, ldx, w + n * K, K, bias ? bias + n : nullptr, y + n, ldy, M);
    if (streamed && rows_in_turn_for(M)) return rows_in_turn(x, ldx, w, K, bias, y, ldy, M, n_begin, n_end);
    if (M <= 3) { GROUPS(6, 3) }
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
                       int64_t ldy, int64_t M, int64_t K, int64_t n_begin, int64_t n_end, bool streamed = true) {
    int64_t n = n_begin;
    if (streamed && rows_in_turn_for(M)) return rows_in_turn(x, ldx, w, K, bias, y, ldy, M, n_begin, n_end);
    if (M <= 4) {
        for (; n + 3 <= n_end; n += 3) { const W *wn = w + n * K; ROW_TILES(3) }
    }
    for (; n + 2 <= n_end; n += 2) { const W *wn = w + n * K; ROW_TILES(2) }
    for (; n < n_end; n++) { const W *wn = w + n * K; ROW_TILES(1) }
}
#endif

/* The wide tiles' sums (both builds, below): acc[v][j] = the v-th vector of rows of xT (xT [K, ldxT])
 * against weight row j, each output one lane's sum in k order, each weight broadcast. */
template <int MV, int NR, class W>
static inline __attribute__((always_inline)) void wide_sums(const float *xT, int64_t ldxT, const W *w, int64_t K,
                                                           vec (&acc)[MV][NR]) {
    for (int v = 0; v < MV; v++)
        for (int j = 0; j < NR; j++) acc[v][j] = vzero();
    for (int64_t k = 0; k < K; k++) {
        vec xv[MV];
        for (int v = 0; v < MV; v++) xv[v] = vload(xT + k * ldxT + v * VW);
        for (int j = 0; j < NR; j++) {
            vec wb = vset1(to_float(w[j * K + k]));
            for (int v = 0; v < MV; v++) acc[v][j] = vfma(wb, xv[v], acc[v][j]);
        }
    }
}

#if defined(__AVX512F__)
/* Many rows (prompt chunks): y[m, n] = xT[:, m] . w[n, :] with x given transposed, xT [K, ldxT]
 * (ldxT a multiple of VW; the lanes past M are read but never stored). The dot-product tiles
 * above sum each (row, column) pair across a vector's lanes at the end, which at K = 128 costs
 * about as much as the FMAs; here a vector holds VW rows of one output column, each weight is
 * broadcast, and nothing is summed across lanes: NR_W columns x MV_W vectors of rows per tile. */
constexpr int NR_W = 8, MV_W = 3;  // 24 accumulators, 3 row vectors, a broadcast weight: 28 of 32 zmm

/* acc[j] holds column j for VW rows: written as VW rows of 8 contiguous columns (+ bias). */
static inline __attribute__((always_inline)) void store_cols8(const __m512 *a, const float *bias, float *y,
                                                             int64_t ldy, int64_t rows) {
    __m512 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]);
    }
    // u[r] (r < 4): columns 0-3 of row 4L + r in 128-bit lane L; u[4 + r]: columns 4-7.
    for (int h = 0; h < 2; h++) {
        const __m512 *p = t + 4 * h;  // columns 4h..4h+3: t[4h] / t[4h+1] pairs (0,1), t[4h+2] / t[4h+3] pairs (2,3)
        u[4 * h + 0] = _mm512_shuffle_ps(p[0], p[2], 0x44);
        u[4 * h + 1] = _mm512_shuffle_ps(p[0], p[2], 0xEE);
        u[4 * h + 2] = _mm512_shuffle_ps(p[1], p[3], 0x44);
        u[4 * h + 3] = _mm512_shuffle_ps(p[1], p[3], 0xEE);
    }
    const __m256 b = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    for (int r = 0; r < 4; r++) {
        __m512 lo = _mm512_shuffle_f32x4(u[r], u[4 + r], 0x44);  // lanes: u[r].0, u[r].1, u[4+r].0, u[4+r].1
        __m512 hi = _mm512_shuffle_f32x4(u[r], u[4 + r], 0xEE);  // lanes 2, 3
        lo = _mm512_shuffle_f32x4(lo, lo, 0xD8);  // u[r].0, u[4+r].0, u[r].1, u[4+r].1
        hi = _mm512_shuffle_f32x4(hi, hi, 0xD8);
        const __m256 rows4[4] = {_mm512_castps512_ps256(lo), _mm512_extractf32x8_ps(lo, 1),
                                 _mm512_castps512_ps256(hi), _mm512_extractf32x8_ps(hi, 1)};
        for (int L = 0; L < 4; L++) {
            int64_t row = 4 * L + r;
            if (row < rows) _mm256_storeu_ps(y + row * ldy, _mm256_add_ps(rows4[L], b));
        }
    }
}

template <int MV, class W>
static inline __attribute__((always_inline)) void tile_wide(const float *xT, int64_t ldxT, const W *w, int64_t K,
                                                           const float *bias, float *y, int64_t ldy, int64_t rows) {
    __m512 acc[MV][NR_W];
    wide_sums<MV, NR_W, W>(xT, ldxT, w, K, acc);
    for (int v = 0; v < MV; v++) {
        int64_t left = rows - v * VW;
        if (left > 0) store_cols8(acc[v], bias, y + v * VW * ldy, ldy, left < VW ? left : VW);
    }
}

/* Columns [n_begin, n_end) of y for all M rows, from xT; n_end - n_begin a multiple of 8 is fast,
 * the columns left over go through the dot-product tiles on x itself. Rows outermost: one tile's
 * rows of xT (K x 48 floats) stay in L2 while the range's weight rows pass, instead of all of xT
 * passing once per 8 weight rows (at 256 rows x K = 1536 that fell out of L2: 137 -> 64 GFLOP/s). */
template <class W>
static void gemm_range_wide(const float *xT, int64_t ldxT, const float *x, int64_t ldx, const W *w, const float *bias,
                            float *y, int64_t ldy, int64_t M, int64_t K, int64_t n_begin, int64_t n_end) {
    const int64_t n_fast = n_begin + (n_end - n_begin) / NR_W * NR_W;
    for (int64_t m = 0; m < M; m += MV_W * VW) {
        const int64_t rows = M - m < MV_W * VW ? M - m : MV_W * VW;
        for (int64_t n = n_begin; n < n_fast; n += NR_W) {
            const W *wn = w + n * K;
            const float *bn = bias ? bias + n : nullptr;
            if (rows > 2 * VW) tile_wide<3, W>(xT + m, ldxT, wn, K, bn, y + m * ldy + n, ldy, rows);
            else if (rows > VW) tile_wide<2, W>(xT + m, ldxT, wn, K, bn, y + m * ldy + n, ldy, rows);
            else tile_wide<1, W>(xT + m, ldxT, wn, K, bn, y + m * ldy + n, ldy, rows);
        }
    }
    if (n_fast < n_end) gemm_range(x, ldx, w, bias, y, ldy, M, K, n_fast, n_end);
}
#else
/* The AVX2 build's wide tiles (16 ymm registers): MV_W vectors of 8 rows x NR columns, 12
 * accumulators + 2 row vectors + a broadcast weight. Each output is one lane's sum in k order
 * (then + bias), as in the AVX-512 tiles, so the two builds' wide steps round alike. Zen 2 EPYC,
 * one thread, 64-128 rows, K = 576 / 1536 (2026-12-07): 2 x 6 77-92 GFLOP/s against the dot-product
 * tiles' 46-49 (1 x 8, one row vector a broadcast: 50-59; 3 x 4 70-94; 2 x 5 as 2 x 6). */
constexpr int NR_W = 6, MV_W = 2;

template <int MV, int NR, class W>
static inline __attribute__((always_inline)) void tile_wide(const float *xT, int64_t ldxT, const W *w, int64_t K,
                                                           const float *bias, float *y, int64_t ldy, int64_t rows) {
    __m256 acc[MV][NR];
    wide_sums<MV, NR, W>(xT, ldxT, w, K, acc);
    // Out through a small buffer: a tile's K x 12 FMAs outweigh its 16 x NR scalar stores ~50 to 1.
    alignas(32) float t[MV][NR][VW];
    for (int v = 0; v < MV; v++)
        for (int j = 0; j < NR; j++) _mm256_store_ps(t[v][j], acc[v][j]);
    for (int v = 0; v < MV; v++)
        for (int r = 0; r < VW && v * VW + r < rows; r++)
            for (int j = 0; j < NR; j++) y[(v * VW + r) * ldy + j] = t[v][j][r] + (bias ? bias[j] : 0.0f);
}

template <int MV, class W>
static inline void wide_cols(const float *xT, int64_t ldxT, const W *w, int64_t K, const float *bias, float *y,
                             int64_t ldy, int64_t rows, int64_t n_begin, int64_t n_end) {
    int64_t n = n_begin;
    for (; n + NR_W <= n_end; n += NR_W)
        tile_wide<MV, NR_W, W>(xT, ldxT, w + n * K, K, bias ? bias + n : nullptr, y + n, ldy, rows);
    // The columns left over in narrower wide tiles, so every column of a step sums in the same order.
    const W *wn = w + n * K;
    const float *bn = bias ? bias + n : nullptr;
    switch (n_end - n) {
        case 5: return tile_wide<MV, 5, W>(xT, ldxT, wn, K, bn, y + n, ldy, rows);
        case 4: return tile_wide<MV, 4, W>(xT, ldxT, wn, K, bn, y + n, ldy, rows);
        case 3: return tile_wide<MV, 3, W>(xT, ldxT, wn, K, bn, y + n, ldy, rows);
        case 2: return tile_wide<MV, 2, W>(xT, ldxT, wn, K, bn, y + n, ldy, rows);
        case 1: return tile_wide<MV, 1, W>(xT, ldxT, wn, K, bn, y + n, ldy, rows);
        default: return;
    }
}

/* As the AVX-512 gemm_range_wide: rows outermost, MV_W * 8 rows of xT at a time (x unused). */
template <class W>
static void gemm_range_wide(const float *xT, int64_t ldxT, const float *, int64_t, const W *w, const float *bias,
                            float *y, int64_t ldy, int64_t M, int64_t K, int64_t n_begin, int64_t n_end) {
    for (int64_t m = 0; m < M; m += MV_W * VW) {
        const int64_t rows = M - m < MV_W * VW ? M - m : MV_W * VW;
        if (rows > VW) wide_cols<2, W>(xT + m, ldxT, w, K, bias, y + m * ldy, ldy, rows, n_begin, n_end);
        else wide_cols<1, W>(xT + m, ldxT, w, K, bias, y + m * ldy, ldy, rows, n_begin, n_end);
    }
}
#endif
