/* y[M,N] = x[M,K] . w[N,K]^T (+ bias[N]) for small M, float32 (weights float32 or bfloat16), AVX2 + FMA
 * or AVX-512: one linear layer.
 *
 * Why: at decode and verification batch sizes (a few to a few dozen rows) a linear layer is a
 * stream over its weights; MKL's sgemm on this class of CPU re-reads the weights once per row for
 * M <= 3 and runs a slow path for small M >= 4, so a 5-token verification pass cost ~3x a 1-token
 * step. The tiles (gemm_tiles.h) read each weight row once for all the rows of the batch.
 */
#include <omp.h>
#include <stdint.h>

#include "gemm_tiles.h"

/* Splits the output columns over `threads` threads (the caller passes torch's thread count).
 * `streamed`: the weights come from memory (gemm_tiles.h's gemm_range), 0 where the caller knows
 * they stay in cache from one call to the next (a small model's LM head: DecoderModel). */
template <class W>
static int small_gemm(const float *x, int64_t ldx, const W *w, const float *bias, float *y, int64_t ldy,
                      int64_t M, int64_t N, int64_t K, int threads, int streamed) {
    if (threads > 16) threads = 16;
    if (threads <= 1 || N * K < (1 << 18)) {
        gemm_range(x, ldx, w, bias, y, ldy, M, K, 0, N, streamed != 0);
        return 0;
    }
    // The columns in `threads` ranges of whole 4-row groups, one per thread of an OpenMP team
    // (PyTorch's pool where libgomp is shared: cpu_decoder.cpp says why not threads of our own).
    int64_t per = ((N + threads - 1) / threads + 3) / 4 * 4;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) {
        int64_t b = t * per, e = b + per < N ? b + per : N;
        if (b < e) gemm_range(x, ldx, w, bias, y, ldy, M, K, b, e, streamed != 0);
    }
    return 0;
}

extern "C" {
int tandem_small_gemm(const float *x, int64_t ldx, const float *w, const float *bias, float *y,
                      int64_t ldy, int64_t M, int64_t N, int64_t K, int threads, int streamed) {
    return small_gemm(x, ldx, w, bias, y, ldy, M, N, K, threads, streamed);
}

/* The same with bfloat16 weights (gemm_tiles.h: widened as loaded, float32 math). */
int tandem_small_gemm_bf16(const float *x, int64_t ldx, const bf16_t *w, const float *bias, float *y,
                           int64_t ldy, int64_t M, int64_t N, int64_t K, int threads, int streamed) {
    return small_gemm(x, ldx, w, bias, y, ldy, M, N, K, threads, streamed);
}
}  // extern "C"
