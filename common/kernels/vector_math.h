/* Vector arithmetic on gemm_tiles.h's `vec` (AVX2 or AVX-512, whichever the build targets) and a
 * vector exp, shared by the kernels that need more than the GEMM tiles (cpu_decoder.cpp's SiLU and
 * softmax, sample_rows.cpp's softmax). */
#pragma once
#include "gemm_tiles.h"

// exp(x) on a vector: Cephes' expf (range reduction by ln 2, a degree-5 polynomial, 2^n from the
// exponent bits), within ~2 ulp of expf; inputs clamped to [ln FLT_MIN, ln FLT_MAX], which only
// moves results that are ~0 or overflow anyway. libm's scalar expf per element made SiLU and the
// softmax a fifth of a 128-token prompt chunk (SmolLM2-135M: 56 of 268 ms in gate_up + SiLU).
#if defined(__AVX512F__)
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
static inline vec vround(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vpow2i(vec n) {  // 2^n for integral n in [-126, 127]
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#else
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
static inline vec vround(vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vpow2i(vec n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#endif

static inline vec vexp(vec x) {
    x = vmin(vmax(x, vset1(-87.3365447505531f)), vset1(88.3762626647949f));
    vec n = vround(vmul(x, vset1(1.44269504088896341f)));
    x = vsub(x, vmul(n, vset1(0.693359375f)));
    x = vsub(x, vmul(n, vset1(-2.12194440e-4f)));
    vec p = vset1(1.9875691500e-4f);
    p = vfma(p, x, vset1(1.3981999507e-3f));
    p = vfma(p, x, vset1(8.3334519073e-3f));
    p = vfma(p, x, vset1(4.1665795894e-2f));
    p = vfma(p, x, vset1(1.6666665459e-1f));
    p = vfma(p, x, vset1(5.0000001201e-1f));
    p = vfma(p, vmul(x, x), vadd(x, vset1(1.0f)));
    return vmul(p, vpow2i(n));
}

// The same for one float (tails of the vector loops), so every element gets the same function.
static inline float exp_scalar(float x) {
    float in[VW] = {x}, out[VW];
    vstore(out, vexp(vload(in)));
    return out[0];
}
