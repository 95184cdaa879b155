/* One token per row of logits [N, V] (float32), and that token's log-probability under the raw
 * logits (log_softmax, what the API reports), for rows whose logits need no edits:
 *
 *   temperature 0:  the first maximal index (greedy; torch.argmax's tie-break)
 *   temperature T:  drawn from softmax(logits / T) by inverse CDF with the caller's uniform u:
 *                   the first index whose cumulative probability exceeds u * total
 *
 * Why: sampler.py's torch path makes ~10 passes over [N, V] with an allocation each (a float32
 * copy, a zeroed probability tensor, the scaled copy, softmax, cumsum, searchsorted, log_softmax,
 * a gather): 190 us of a 0.6 ms decode step at batch 1 on a 1k-vocabulary model, 7.5 ms a step
 * for 16 rows of SmolLM2's 49k. Here a row is three reads of the logits (the max; the sums of
 * exp; the search, which stops where the draw lands) and nothing is allocated.
 *
 * The sums run in double over one vector of terms at a time, in the same order in the total and
 * in the search, so the search always ends inside the row. exp is vector_math.h's; a logit of
 * -inf (or far below the row's max) has probability exactly 0 and is never drawn.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "vector_math.h"

namespace {

// exp(x), and exactly 0 where x is below ln(FLT_MIN) (vexp clamps there) or NaN.
static inline vec vexp0(vec x) {
    const vec lowest = vset1(-87.3365447505531f);
#if defined(__AVX512F__)
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lowest, _CMP_GE_OQ), vexp(x));
#else
    return _mm256_and_ps(vexp(x), _mm256_cmp_ps(x, lowest, _CMP_GE_OQ));
#endif
}

static inline float exp0_scalar(float x) { return x >= -87.3365447505531f ? exp_scalar(x) : 0.0f; }

static inline float vmax_lanes(vec v) {
    float lanes[VW];
    vstore(lanes, v);
    float m = lanes[0];
    for (int i = 1; i < VW; i++) m = lanes[i] > m ? lanes[i] : m;
    return m;
}

float row_max(const float *x, int64_t V) {
    int64_t j = 0;
    float m = -INFINITY;
    if (V >= VW) {
        vec acc = vload(x);
        for (j = VW; j + VW <= V; j += VW) acc = vmax(acc, vload(x + j));
        m = vmax_lanes(acc);
    }
    for (; j < V; j++) m = x[j] > m ? x[j] : m;
    return m;
}

// sum_j exp((x_j - top) * scale), one vector's terms at a time into a double.
double exp_sum(const float *x, int64_t V, float top, float scale) {
    const vec t = vset1(top), s = vset1(scale);
    double total = 0.0;
    int64_t j = 0;
    for (; j + VW <= V; j += VW) total += vsum(vexp0(vmul(vsub(vload(x + j), t), s)));
    for (; j < V; j++) total += exp0_scalar((x[j] - top) * scale);
    return total;
}

// The last index of the VW terms at x[j..] with a nonzero exp((x - top) * scale), or -1.
int64_t last_nonzero(const float *x, int64_t j, float top, float scale) {
    float terms[VW];
    vstore(terms, vexp0(vmul(vsub(vload(x + j), vset1(top)), vset1(scale))));
    for (int i = VW - 1; i >= 0; i--)
        if (terms[i] > 0.0f) return j + i;
    return -1;
}

// The first index whose running sum of exp((x_j - top) * scale) exceeds target (< the exp_sum
// of the same arguments, so one is found; where float rounding inside a vector says otherwise,
// the last index with a nonzero term up to there: never a token of probability 0).
int64_t search(const float *x, int64_t V, float top, float scale, double target) {
    const vec t = vset1(top), s = vset1(scale);
    double running = 0.0;
    int64_t last_block = -1;  // the last vector seen with a nonzero term
    int64_t j = 0;
    for (; j + VW <= V; j += VW) {
        vec e = vexp0(vmul(vsub(vload(x + j), t), s));
        double block = vsum(e);
        if (running + block > target) {
            float terms[VW];
            vstore(terms, e);
            int64_t last = -1;
            for (int i = 0; i < VW; i++) {
                if (terms[i] <= 0.0f) continue;
                last = j + i;
                running += terms[i];
                if (running > target) return last;
            }
            return last;
        }
        running += block;
        if (block > 0.0) last_block = j;
    }
    int64_t last = -1;
    for (; j < V; j++) {
        float e = exp0_scalar((x[j] - top) * scale);
        if (e <= 0.0f) continue;
        last = j;
        running += e;
        if (running > target) return j;
    }
    if (last < 0 && last_block >= 0) last = last_nonzero(x, last_block, top, scale);
    return last;
}

void sample_row(const float *x, int64_t V, float temperature, float u, int64_t *token, float *logprob) {
    const float top = row_max(x, V);
    const double raw_total = exp_sum(x, V, top, 1.0f);
    int64_t tok = 0;
    if (temperature == 0.0f) {
        while (tok < V - 1 && !(x[tok] == top)) tok++;
    } else {
        const float scale = 1.0f / temperature;
        const double total = scale == 1.0f ? raw_total : exp_sum(x, V, top, scale);
        tok = search(x, V, top, scale, (double)u * total);
        if (tok < 0) tok = 0;  // every term 0: only NaN logits get here
    }
    *token = tok;
    *logprob = (x[tok] - top) - (float)log(raw_total);
}

}  // namespace

extern "C" {
/* logits: [N, V] float32 with row stride ld; temperature[N] (0: greedy); u[N] in [0, 1) (read for
 * rows with temperature > 0). Writes tokens[N] and logprobs[N]. Rows go to `threads` threads. */
int tandem_sample_rows(const float *logits, int64_t ld, int64_t N, int64_t V, const float *temperature,
                       const float *u, int64_t *tokens, float *logprobs, int threads) {
    if (threads > 16) threads = 16;
    if (threads > N) threads = (int)N;
    if (threads < 1 || N * V < (1 << 16)) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < N; r++)
        sample_row(logits + r * ld, V, temperature[r], u[r], tokens + r, logprobs + r);
    return 0;
}
}  // extern "C"
