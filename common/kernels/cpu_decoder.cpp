/* The whole decoder stack for a small batch of tokens in one call: float32, AVX2 + FMA or AVX-512, x86 CPUs.
 *
 * Weights may be bfloat16 instead (weight_bf16; gemm_tiles.h widens them as they load): activations,
 * norms and the KV cache stay float32.
 *
 * Why: at decode batch sizes a layer's real work is one stream over its weights, but run as
 * PyTorch ops it is ~60 dispatches (norms, rope, cache writes, paged gathers, SDPA, residuals),
 * each costing 3-10 us of Python and dispatch on this class of CPU: ~1 ms of overhead per layer,
 * more than the weight stream itself for small models. Here one call runs every layer
 * of decoder.py's DecoderModel (same math, same order of operations per element) for up to a
 * few dozen tokens, on `threads` threads that share each phase's chunks (below):
 *
 *   h = rms_norm(x) -> qkv = h W_qkv^T (+b) -> q/k norm (Qwen3) -> rope(q, k) -> k, v into the cache
 *   -> paged attention straight from the block table (no gather) -> x += r * (o W_o^T (+b))
 *   -> h = rms_norm(x) -> [g | u] = h W_gu^T -> a = silu(g) * u -> x += r * (a W_d^T (+b))
 *
 * Each layer is 7 phases; a phase is cut into chunks (64 output columns of a linear layer, 16 in
 * a step of a few tokens, with rope, q/k norm and the cache write fused into the qkv head that
 * produced them and silu(g) * u into gate_up; one (token, KV head) pair of attention, or (block of
 * up to VW prompt tokens, KV head), with every query head that shares the KV head; one token row
 * of a residual + norm) that the threads claim from atomic counters, each thread its own
 * contiguous segment of the phase first (parallel()). A thread that loses its core to another
 * process (the gateway, a prefill worker) therefore holds up only the chunk it is in, not a static share:
 * the others take the rest of the phase and go on. The threads are an OpenMP team, which is
 * PyTorch's own pool where this library shares torch's libgomp (the usual case: the same soname,
 * already loaded): threads of our own (a pthread_create per call, as before) competed for the
 * cores with torch's pool, whose idle threads spin for milliseconds after every torch op of the
 * step (the sampler, the embedding); 16-sequence SmolLM2 steps ran 1.1-1.4x faster with those
 * threads told to sleep (OMP_WAIT_POLICY=PASSIVE), which slows MKL's prefill 1.36x instead.
 */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <new>

#include "gemm_tiles.h"
#include "vector_math.h"

extern "C" {
typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm;  // q_norm / k_norm: null unless Qwen3
    // The weights are float32, or bfloat16 where the model says so (weight_bf16); biases float32, may be null.
    const void *qkv_w;
    const float *qkv_b;
    const void *o_w;
    const float *o_b;
    const void *gate_up_w;
    const float *gate_up_b;
    const void *down_w;
    const float *down_b;
    float *k_cache, *v_cache;  // [num_blocks, block_size, num_kv_heads, head_dim]
} tandem_layer_t;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, residual_multiplier, attention_scale;
    const tandem_layer_t *layers;
    const float *final_norm;
    int64_t weight_bf16;  // 1: the layers' weights are bfloat16 (widened as loaded; float32 math)
    int64_t weights_cached;  // 1: every layer's weights fit in cache together (gemm_range's `streamed` off)
} tandem_model_t;

typedef struct {
    int64_t num_tokens, num_seqs, max_blocks;
    const float *cos, *sin;         // [max_positions, head_dim / 2]: the rope tables, read at each token's position
    const int64_t *slot_mapping;    // [num_tokens]: cache slot of each token's k / v
    const int32_t *query_start;     // [num_seqs + 1]
    const int32_t *seq_lens;        // [num_seqs]: context length after this step
    const int32_t *block_tables;    // [num_seqs, max_blocks]
    int64_t wide;                   // 1: the linear layers read their inputs transposed (AVX-512 builds; below)
} tandem_batch_t;
}

namespace {

constexpr int64_t COLUMNS_PER_CHUNK = 64;
// A step of at most this many tokens cuts its o, gate_up and down layers into chunks of
// SMALL_STEP_COLUMNS columns instead: there a chunk is a few microseconds of weight stream, and the
// threads wait at the end of each phase for the last one, about half a chunk on average.
constexpr int64_t SMALL_STEP_TOKENS = 4;
constexpr int64_t SMALL_STEP_COLUMNS = 16;
constexpr int64_t PHASES_PER_LAYER = 8;  // run_layer's parallel() calls (7 unless wide)
// A "wide" step (the caller's choice: many tokens, cpu_decoder.py) has its linear layers read
// their inputs transposed (gemm_tiles.h, gemm_range_wide), which each phase that writes an input
// also writes. One thread, Intel Xeon: 128 x 128 x 384 2.5x the dot-product tiles, 32 rows 1.56x,
// 16 rows 1.21x. The AVX2 build's wide tiles (Zen 2 EPYC, one thread, 48-128 rows): 1.6-1.95x.

constexpr int MAX_THREADS = 16;

// A counter on a cache line of its own: threads bumping counters that share a line would pass
// the line between their cores at every chunk.
struct alignas(64) Counter {
    std::atomic<int64_t> v{0};
};

struct Context {
    const tandem_model_t *m;
    const tandem_batch_t *b;
    float *x;        // [T, hidden] residual stream, in place
    float *out;      // [T, hidden] final normed hidden states
    float *h;        // [T, hidden]
    float *qkv;      // [T, q + 2 kv]
    float *attn;     // [T, q]
    float *tmp;      // [T, hidden]
    float *gu;       // [T, 2 I]
    float *act;      // [T, I]
    float *scores;   // [threads, attn_scratch]: each thread's attention scratch
    // Wide steps only (else null / 0): h, attn and act transposed, [n, tp] with tp >= T whole
    // vectors (tandem_decoder_forward; the lanes past T zeroed), what gemm_range_wide reads.
    float *hT, *attnT, *actT;
    int64_t tp;
    int64_t attn_scratch;  // floats of `scores` per thread
    int32_t *seq_of; // [T]: the sequence of each token
    int32_t *pos;    // [T]: the position of each token
    int32_t *blocks; // [num_blocks, 2]: attention's query blocks, [first, end) tokens of one sequence
    int64_t num_blocks;
    Counter *phases;  // each phase's counters, in the order every thread walks the phases: `done`,
    int64_t phase_counters;  // then `next` of each thread's segment (parallel()); 1 + threads a phase
    int64_t chunk_columns;  // columns of a linear layer's chunk (o, gate_up, down)
    int64_t kv_heads_per_item;  // of attention's items: 1, or every KV head (attend_group says why)
};

struct Worker {
    Context *c;
    int tid;
    int team;        // threads in the team (every worker of a call sees the same number)
    int64_t cursor;  // this thread's next phase
};

// Runs work(i) for the chunks i < total that this thread claims, then waits until every chunk of
// the phase is done (the next phase reads what this one wrote). The chunks are cut into one
// contiguous segment per thread of the team: a thread claims its own segment's chunks in order,
// then whatever is left of the others', and counts each into `done` once written. So a thread's
// chunks of a linear layer are one forward stream over the weights, which the tiles' prefetches
// (the next rows) and the hardware's follow, while a thread that lost its core still holds up only
// the chunk it is in: the others take the rest of its segment. With one counter for all, the
// threads took alternate chunks and each one's stream broke at every chunk (kernel_ab, AMD EPYC
// with AVX-512, 2 threads, SmolLM2-135M decode steps: batch 1 1.05x, batch 16 1.18x faster).
template <class Work>
inline void parallel(Worker *w, int64_t total, Work &&work) {
    Counter *done = w->c->phases + w->cursor++ * w->c->phase_counters, *next = done + 1;
    const int team = w->team;
    for (int s = 0; s < team; s++) {
        const int seg = (w->tid + s) % team;  // its own segment first, then the others'
        const int64_t begin = total * seg / team, end = total * (seg + 1) / team;
        for (;;) {
            int64_t i = begin + next[seg].v.fetch_add(1, std::memory_order_relaxed);
            if (i >= end) break;
            work(i);
            done->v.fetch_add(1, std::memory_order_release);
        }
    }
    // Spin (phases are microseconds apart), yielding once it is clear the thread holding the last
    // chunk lost its core, so a busy machine is not made busier.
    for (int spins = 0; done->v.load(std::memory_order_acquire) < total; spins++) {
        if (spins < 2000) _mm_pause();
        else sched_yield();
    }
}

inline int64_t chunks_of(const Context *c, int64_t n) { return (n + c->chunk_columns - 1) / c->chunk_columns; }

// Columns [begin, end) of y = x W^T (+ b), y's rows ldy apart: from xT (x transposed) in a wide step.
template <class W>
inline void linear_cols(const Context *c, const float *x, const float *xT, int64_t K, const W *w, const float *bias,
                        float *y, int64_t ldy, int64_t begin, int64_t end) {
    if (xT) return gemm_range_wide(xT, c->tp, x, K, w, bias, y, ldy, c->b->num_tokens, K, begin, end);
    gemm_range(x, K, w, bias, y, ldy, c->b->num_tokens, K, begin, end, !c->m->weights_cached);
}

// Columns [i * 64, (i + 1) * 64) of y = x W^T (+ b): chunk i of a linear layer.
template <class W>
inline void linear_chunk(const Context *c, int64_t i, const float *x, const float *xT, int64_t K, const W *w,
                         const float *bias, float *y, int64_t N) {
    int64_t begin = i * c->chunk_columns, end = begin + c->chunk_columns < N ? begin + c->chunk_columns : N;
    linear_cols(c, x, xT, K, w, bias, y, N, begin, end);
}

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols: 16 x 16 blocks in registers
// (AVX-512; 8 x 8 with AVX2), the edges one float at a time.
inline void transpose_block(const float *src, int64_t ld_src, float *dst, int64_t ld_dst, int64_t rows, int64_t cols) {
    int64_t c0 = 0;
#if defined(__AVX512F__)
    if (rows == 16) {
        for (; c0 + 16 <= cols; c0 += 16) {
            __m512 r[16], t[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * ld_src + c0);
            for (int i = 0; i < 8; i++) {  // t[2i] lane L: rows 2i, 2i+1 of columns 4L, 4L+1; t[2i+1]: 4L+2, 4L+3
                t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
                t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
            }
            for (int i = 0; i < 4; i++) {  // r[4i + e] lane L: rows 4i..4i+3 of column 4L + e
                r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
                r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
                r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
                r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
            }
            for (int e = 0; e < 4; e++) {  // column 4L + e: lane L of r[e], r[4 + e], r[8 + e], r[12 + e]
                __m512 a = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88), b = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xDD);
                __m512 c = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88), d = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xDD);
                float *col = dst + (c0 + e) * ld_dst;
                _mm512_storeu_ps(col, _mm512_shuffle_f32x4(a, c, 0x88));
                _mm512_storeu_ps(col + 4 * ld_dst, _mm512_shuffle_f32x4(b, d, 0x88));
                _mm512_storeu_ps(col + 8 * ld_dst, _mm512_shuffle_f32x4(a, c, 0xDD));
                _mm512_storeu_ps(col + 12 * ld_dst, _mm512_shuffle_f32x4(b, d, 0xDD));
            }
        }
    }
#else
    if (rows == 8) {
        for (; c0 + 8 <= cols; c0 += 8) {
            __m256 r[8], t[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ld_src + c0);
            for (int i = 0; i < 4; i++) {  // t[2i] lane L: rows 2i, 2i+1 of columns 4L, 4L+1; t[2i+1]: 4L+2, 4L+3
                t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
                t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
            }
            for (int i = 0; i < 2; i++) {  // r[4i + e] lane L: rows 4i..4i+3 of column 4L + e
                r[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
                r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
                r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
                r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
            }
            for (int e = 0; e < 4; e++) {  // column e: lanes 0 of r[e], r[4 + e]; column 4 + e: lanes 1
                float *col = dst + (c0 + e) * ld_dst;
                _mm256_storeu_ps(col, _mm256_permute2f128_ps(r[e], r[4 + e], 0x20));
                _mm256_storeu_ps(col + 4 * ld_dst, _mm256_permute2f128_ps(r[e], r[4 + e], 0x31));
            }
        }
    }
#endif
    for (int64_t c = c0; c < cols; c++)
        for (int64_t r = 0; r < rows; r++) dst[c * ld_dst + r] = src[r * ld_src + c];
}

// Rows [t0, t1) of src (n columns, rows ld apart) into columns [t0, t1) of dst [n, tp].
inline void transpose_rows(const float *src, int64_t ld, int64_t t0, int64_t t1, int64_t n, float *dst, int64_t tp) {
    transpose_block(src + t0 * ld, ld, dst + t0, tp, t1 - t0, n);
}

// Token rows are handed out one per chunk, or VW per chunk in a wide step (whole vectors of the
// transposed copies, so no two threads write the same cache line of them).
inline int64_t rows_per_chunk(const Context *c) { return c->tp ? VW : 1; }
inline int64_t row_chunks(const Context *c) {
    const int64_t r = rows_per_chunk(c);
    return (c->b->num_tokens + r - 1) / r;
}
// The token rows [t0, t1) of row chunk i.
inline void chunk_rows(const Context *c, int64_t i, int64_t *t0, int64_t *t1) {
    const int64_t T = c->b->num_tokens, r = rows_per_chunk(c);
    *t0 = i * r;
    *t1 = *t0 + r < T ? *t0 + r : T;
}

// HF's RMSNorm in float32: x * rsqrt(mean(x^2) + eps), then weight * that.
inline void rms_norm_row(const float *x, const float *w, float *y, int64_t n, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * inv);
}

// x += y * r, as decoder.py writes it (r == 1: a plain add, bit for bit).
inline void add_residual(float *x, const float *y, float r, int64_t n) {
    if (r != 1.0f) for (int64_t i = 0; i < n; i++) x[i] = x[i] + y[i] * r;
    else for (int64_t i = 0; i < n; i++) x[i] = x[i] + y[i];
}

inline void rope_head(float *v, const float *cos, const float *sin, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * cos[i] - x2 * sin[i];
        v[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

inline float dot(const float *a, const float *b, int64_t n) {
    vec acc = vzero();
    int64_t i = 0;
    for (; i + VW <= n; i += VW) acc = vfma(vload(a + i), vload(b + i), acc);
    float s = vsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

inline void axpy(float *y, const float *x, float a, int64_t n) {
    vec av = vset1(a);
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vstore(y + i, vfma(av, vload(x + i), vload(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

// Rows 0, 1, 2, ... of one sequence's KV head in a paged cache, walked block by block (a pointer
// step per row, a table entry per block).
struct CacheRows {
    const float *cache;
    const int32_t *table;
    int64_t bs, ld, head;  // rows per block, floats per slot (every KV head), the head's first float
    const float *row = nullptr;
    int64_t left = 0;  // rows after `row` in its block
    const float *next() {
        if (left-- > 0) return row += ld;
        left = bs - 1;
        return row = cache + (int64_t)*table++ * bs * ld + head;
    }
};

// A second walk over the same rows that runs ahead of the one in use, pulling each row's `floats`
// floats into L2 (one prefetch per 64-byte line): upto(r) prefetches every row before row r.
struct RowsAhead {
    CacheRows rows;
    int64_t floats, done = 0;
    void upto(int64_t r) {
        for (; done < r; done++) {
            const float *row = rows.next();
            for (int64_t f = 0; f < floats; f += 64 / sizeof(float)) _mm_prefetch((const char *)(row + f), _MM_HINT_T1);
        }
    }
};

// The keys or values (`cache`) of token t's sequence, KV head g.
inline CacheRows cache_rows(const Context *c, const float *cache, int64_t t, int64_t g) {
    const tandem_model_t *m = c->m;
    return CacheRows{cache, c->b->block_tables + (int64_t)c->seq_of[t] * c->b->max_blocks, m->block_size,
                     m->num_kv_heads * m->head_dim, g * m->head_dim};
}

// Token t, query head hd: softmax(q . K^T * scale) V over positions 0..pos[t] of its sequence.
void attend(const Context *c, const tandem_layer_t *L, int64_t t, int64_t hd, float *scores) {
    const tandem_model_t *m = c->m;
    const int64_t D = m->head_dim, kvh = hd / (m->num_heads / m->num_kv_heads);
    const int64_t qkv_width = (m->num_heads + 2 * m->num_kv_heads) * D;
    const float *q = c->qkv + t * qkv_width + hd * D;
    const int64_t n = (int64_t)c->pos[t] + 1;
    float best = -INFINITY;
    CacheRows keys = cache_rows(c, L->k_cache, t, kvh);
    for (int64_t j = 0; j < n; j++) {
        float s = dot(q, keys.next(), D) * m->attention_scale;
        scores[j] = s;
        if (s > best) best = s;
    }
    float total = 0.0f;
    int64_t j = 0;
    vec sum = vzero(), top = vset1(best);
    for (; j + VW <= n; j += VW) {
        vec e = vexp(vsub(vload(scores + j), top));
        vstore(scores + j, e);
        sum = vadd(sum, e);
    }
    total = vsum(sum);
    for (; j < n; j++) {
        scores[j] = exp_scalar(scores[j] - best);
        total += scores[j];
    }
    float *o = c->attn + t * m->num_heads * D + hd * D;
    memset(o, 0, D * sizeof(float));
    CacheRows values = cache_rows(c, L->v_cache, t, kvh);
    for (int64_t j = 0; j < n; j++) axpy(o, values.next(), scores[j], D);
    float inv = 1.0f / total;
    for (int64_t i = 0; i < D; i++) o[i] *= inv;
}


// Lane i of the result = the sum of v[i]'s lanes, for VW vectors at once: a transpose-and-add tree,
// ~3 instructions per sum against ~10 for one horizontal sum at a time.
#if defined(__AVX512F__)
static inline vec vsum_lanes(const vec *v) {
    vec a[8], b[4], d[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}
#else
static inline vec vsum_lanes(const vec *v) {
    vec a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44), _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}
#endif

constexpr int64_t MAX_GROUP = 8;  // query heads per KV head that attend_group takes (more: attend per head)

// Token t, KV heads [g0, g1): every query head of those groups (G = num_heads / num_kv_heads per
// KV head) at once, D = DV vectors. Each key and value is read once for its group instead of once
// per query head, keys are walked block by block (no division per key), VW scores come out of one
// transpose-and-add, and each head's output stays in registers over a group of VW values. scores:
// [NH, context rounded up to VW]: each head's row is whole vectors (the lanes past the context
// -inf, then 0), so the softmax has no scalar tail, which at prompt lengths (a few dozen keys a
// query) cost as much as the rest. A head's arithmetic is the same whichever range it is in.
//
// Every KV head of a token at once (a decode step of many sequences, ALL_HEADS_MIN_ITEMS): a cache
// slot holds the token's KV heads side by side ([block, slot, KV head, head_dim]), so one KV head
// alone reads 1 / num_kv_heads of each slot's bytes, in pieces, where a token's slots of every KV
// head are one run of memory (num_kv_heads * head_dim floats). One thread, 16 sequences x 4000 keys
// in shuffled blocks, SmolLM2's shapes: 481 us per (token, KV head) one KV head at a time, 356
// us all at once, 272 us with the prefetches below; reading the same blocks and nothing else runs
// at 8.1-8.3 GB/s, the attention now at 7.5 (a block's 16 slots are 12 KB; the hardware cannot
// follow a jump to the next block, which is why a paged cache streams slower than weights).
constexpr int64_t KEYS_AHEAD = 4 * VW;  // keys prefetched ahead of the group in use
constexpr int64_t MAX_ITEM_HEADS = 64;  // query heads one attend_group call may take
constexpr int64_t ALL_HEADS_MIN_ITEMS = 4;  // tokens a thread at least, for items of every KV head
template <int DV>
void attend_group(const Context *c, const tandem_layer_t *L, int64_t t, int64_t g0, int64_t g1, float *scores) {
    const tandem_model_t *m = c->m;
    constexpr int64_t D = DV * VW;
    const int64_t G = m->num_heads / m->num_kv_heads, nkv = m->num_kv_heads, NH = (g1 - g0) * G, KD = (g1 - g0) * D;
    const int64_t qkv_width = (m->num_heads + 2 * nkv) * D;
    const float *q = c->qkv + t * qkv_width + g0 * G * D;
    const int64_t n = (int64_t)c->pos[t] + 1, np = (n + VW - 1) / VW * VW;
    const vec scale = vset1(m->attention_scale);
    const float *kp[VW], *vp[VW];
    // Pass 1: scores, VW keys at a time (a short last group repeats its first key; not stored).
    // The cache's blocks lie anywhere, so the hardware cannot guess the next one: the keys
    // KEYS_AHEAD rows on are prefetched into L2 while this group's are used (into L1 or further
    // ahead measured no better), and the values likewise in pass 3. (Values fetched during pass 1
    // for pass 3 fell out of L2 again at long contexts before pass 3 reached them.)
    CacheRows keys = cache_rows(c, L->k_cache, t, g0);
    RowsAhead keys_ahead{keys, KD};
    for (int64_t j = 0; j < n; j += VW) {
        const int64_t cnt = n - j < VW ? n - j : VW;
        keys_ahead.upto(j + KEYS_AHEAD + VW < n ? j + KEYS_AHEAD + VW : n);
        for (int64_t i = 0; i < VW; i++) kp[i] = i < cnt ? keys.next() : kp[0];
        for (int64_t h = 0; h < NH; h++) {
            const int64_t kv = h / G * D;  // the head's KV head, within the slot's heads from g0
            vec qv[DV], part[VW];
            for (int d = 0; d < DV; d++) qv[d] = vload(q + h * D + d * VW);
            for (int i = 0; i < VW; i++) {
                vec acc = vmul(qv[0], vload(kp[i] + kv));
                for (int d = 1; d < DV; d++) acc = vfma(qv[d], vload(kp[i] + kv + d * VW), acc);
                part[i] = acc;
            }
            vstore(scores + h * np + j, vmul(vsum_lanes(part), scale));
            for (int64_t i = cnt; i < VW; i++) scores[h * np + j + i] = -INFINITY;
        }
    }
    // Pass 2: softmax numerators and sums per head.
    float inv[MAX_ITEM_HEADS];
    for (int64_t h = 0; h < NH; h++) {
        float *row = scores + h * np, lanes[VW], best = -INFINITY;
        vec top = vload(row);
        for (int64_t j = VW; j < np; j += VW) top = vmax(top, vload(row + j));
        vstore(lanes, top);
        for (int i = 0; i < VW; i++) best = lanes[i] > best ? lanes[i] : best;
        top = vset1(best);
        // The lanes past the context: exp(0), then 0. vexp(-inf) is its floor, a denormal (not quite
        // 0, and a microcode assist per vector: up to ~10% of a decode step's attention).
        for (int64_t j = n; j < np; j++) row[j] = best;
        for (int64_t j = 0; j < np; j += VW) vstore(row + j, vexp(vsub(vload(row + j), top)));
        for (int64_t j = n; j < np; j++) row[j] = 0.0f;
        vec sum = vzero();
        for (int64_t j = 0; j < np; j += VW) sum = vadd(sum, vload(row + j));
        inv[h] = 1.0f / vsum(sum);
    }
    // Pass 3: o = sum_j p_j v_j, VW values at a time, each head's D outputs in registers.
    float *o = c->attn + t * m->num_heads * D + g0 * G * D;
    for (int64_t h = 0; h < NH; h++)
        for (int64_t i = 0; i < D; i++) o[h * D + i] = 0.0f;
    CacheRows values = cache_rows(c, L->v_cache, t, g0);
    RowsAhead values_ahead{values, KD};
    for (int64_t j = 0; j < n; j += VW) {
        const int64_t cnt = n - j < VW ? n - j : VW;
        values_ahead.upto(j + KEYS_AHEAD + VW < n ? j + KEYS_AHEAD + VW : n);
        for (int64_t i = 0; i < cnt; i++) vp[i] = values.next();
        for (int64_t h = 0; h < NH; h++) {
            const int64_t kv = h / G * D;
            vec acc[DV];
            for (int d = 0; d < DV; d++) acc[d] = vload(o + h * D + d * VW);
            const float *p = scores + h * np + j;
            for (int64_t i = 0; i < cnt; i++) {
                vec pv = vset1(p[i]);
                for (int d = 0; d < DV; d++) acc[d] = vfma(pv, vload(vp[i] + kv + d * VW), acc[d]);
            }
            for (int d = 0; d < DV; d++) vstore(o + h * D + d * VW, acc[d]);
        }
    }
    for (int64_t h = 0; h < NH; h++) {
        vec iv = vset1(inv[h]);
        for (int d = 0; d < DV; d++) vstore(o + h * D + d * VW, vmul(vload(o + h * D + d * VW), iv));
    }
}

// Prompt steps. A sequence's query chunk of BLOCK_MIN_QUERY tokens or more is cut into blocks of
// up to VW consecutive tokens (blocks_of), and attend_block takes one block and one KV head at a
// time with a token per vector lane: scores are broadcast-FMA micro-GEMMs with no sum across
// lanes, the softmax runs down the lanes, and each key and value is read once per block instead
// of once per token. Shorter chunks (decode tokens, verification spans: cpu_decoder.py's
// SHORT_QUERY) keep attend_group per token, and their results bit for bit; so does a block of
// fewer than BLOCK_MIN_TOKENS (a chunk's first), whose idle lanes cost more than the block saves
// (even at ~4 tokens in both builds, Intel Xeon).
constexpr int64_t BLOCK_MIN_QUERY = 9;
constexpr int64_t BLOCK_MIN_TOKENS = 4;
// Accumulators a tile keeps in registers (of 32 zmm / 16 ymm): scores, with up to MAX_TILE_HEADS
// query heads a tile; outputs, up to PV_COLS vectors of a head's output a tile.
constexpr int SCORE_ACC = VW == 16 ? 24 : 12;
constexpr int MAX_TILE_HEADS = VW == 16 ? 3 : 2;
constexpr int PV_ACC = VW == 16 ? 16 : 8;
constexpr int PV_COLS = VW == 16 ? 4 : 2;

// The causal mask's lanes: vload(v + VW - m) is -inf in lanes < m and 0 past them,
// vload(v + 2 * VW - m) 0 in lanes < m and 1 past them.
struct CausalLanes {
    float v[3 * VW];
    CausalLanes() {
        for (int i = 0; i < VW; i++) v[i] = -INFINITY, v[VW + i] = 0.0f, v[2 * VW + i] = 1.0f;
    }
};
const CausalLanes CAUSAL;

// Scores of HV heads against keys [0, n), KR keys a tile: s[h * ld + j * VW + i] = scale * q . k_j
// for head h's query in lane i of qT ([HV][D][VW]). Each key float is broadcast against HV query
// vectors; a short last tile repeats its first key (not stored).
template <int DV, int HV>
void score_heads(CacheRows keys, int64_t n, const float *qT, vec scale, float *s, int64_t ld) {
    constexpr int64_t D = DV * VW;
    constexpr int KR = SCORE_ACC / HV < 8 ? SCORE_ACC / HV : 8;
    const float *kp[KR];
    for (int64_t j = 0; j < n; j += KR) {
        const int64_t cnt = n - j < KR ? n - j : KR;
        for (int i = 0; i < KR; i++) kp[i] = i < cnt ? keys.next() : kp[0];
        vec acc[KR][HV];
#pragma GCC unroll 8
        for (int i = 0; i < KR; i++)
#pragma GCC unroll 4
            for (int h = 0; h < HV; h++) acc[i][h] = vzero();
        for (int64_t d = 0; d < D; d++) {
            vec q[HV];
#pragma GCC unroll 4
            for (int h = 0; h < HV; h++) q[h] = vload(qT + (h * D + d) * VW);
#pragma GCC unroll 8
            for (int i = 0; i < KR; i++) {
                const vec k = vset1(kp[i][d]);
#pragma GCC unroll 4
                for (int h = 0; h < HV; h++) acc[i][h] = vfma(k, q[h], acc[i][h]);
            }
        }
        for (int i = 0; i < cnt; i++)
            for (int h = 0; h < HV; h++) vstore(s + h * ld + (j + i) * VW, vmul(acc[i][h], scale));
    }
}

// Tokens [t0, t1) of one sequence (t1 - t0 <= VW), KV head g, every query head of the group.
// scratch: [G][keys][VW] scores, then [G][D][VW] the queries transposed.
template <int DV>
void attend_block(const Context *c, const tandem_layer_t *L, int64_t t0, int64_t t1, int64_t g, float *scratch) {
    const tandem_model_t *m = c->m;
    constexpr int64_t D = DV * VW;
    const int64_t G = m->num_heads / m->num_kv_heads, nkv = m->num_kv_heads;
    const int64_t qkv_width = (m->num_heads + 2 * nkv) * D;
    // Token t0 + i sees keys [0, first + i]: key j > first is masked from lanes < j - first.
    const int64_t nt = t1 - t0, first = c->pos[t0], n = first + nt;
    float *s = scratch, *qT = scratch + G * n * VW;
    // The queries, a token per lane (lanes past nt zero: scored, never stored).
    if (nt < VW) memset(qT, 0, G * D * VW * sizeof(float));
    for (int64_t h = 0; h < G; h++)
        transpose_block(c->qkv + t0 * qkv_width + (g * G + h) * D, qkv_width, qT + h * D * VW, VW, nt, D);
    // Pass 1: scores, up to MAX_TILE_HEADS heads a tile (the group split evenly).
    const CacheRows keys = cache_rows(c, L->k_cache, t0, g);
    const vec scale = vset1(m->attention_scale);
    const int64_t tiles = (G + MAX_TILE_HEADS - 1) / MAX_TILE_HEADS;
    for (int64_t h = 0, tile = 0; tile < tiles; tile++) {
        const int64_t hv = (G - h) / (tiles - tile);
        float *sh = s + h * n * VW;
        const float *qh = qT + h * D * VW;
        if (hv == 1) score_heads<DV, 1>(keys, n, qh, scale, sh, n * VW);
        else if (hv == 2) score_heads<DV, 2>(keys, n, qh, scale, sh, n * VW);
        else score_heads<DV, MAX_TILE_HEADS>(keys, n, qh, scale, sh, n * VW);
        h += hv;
    }
    // Pass 2: softmax numerators and sums, a token per lane. The masked lanes (key j > first in
    // lanes < j - first) are -inf for the max, then exp(0) times 0: vexp(-inf) is its floor, a
    // denormal, and a microcode assist per vector (a third of this function's time).
    float inv[MAX_GROUP * VW];
    for (int64_t h = 0; h < G; h++) {
        float *row = s + h * n * VW;
        vec top = vload(row), sum = vzero();
        for (int64_t j = 1; j < n; j++) {
            vec sj = vload(row + j * VW);
            if (j > first) sj = vadd(sj, vload(CAUSAL.v + VW - (j - first)));
            top = vmax(top, sj);
        }
        for (int64_t j = 0; j < n; j++) {
            vec x = vsub(vload(row + j * VW), top), e;
            if (j > first) {
                const vec keep = vload(CAUSAL.v + 2 * VW - (j - first));
                e = vmul(vexp(vmul(x, keep)), keep);
            } else e = vexp(x);
            vstore(row + j * VW, e);
            sum = vadd(sum, e);
        }
        vstore(inv + h * VW, vdiv(vset1(1.0f), sum));
    }
    // Pass 3: o = sum_j p_j v_j, R tokens x C of the D / VW output vectors of one head a tile, in
    // registers: each value vector is loaded once per R tokens. A tile stops at its last token's keys.
    constexpr int C = DV < PV_COLS ? DV : PV_COLS, R = PV_ACC / C;
    for (int64_t h = 0; h < G; h++)
        for (int64_t i0 = 0; i0 < nt; i0 += R)
            for (int64_t d0 = 0; d0 < D; d0 += C * VW) {
                const int64_t rows = nt - i0 < R ? nt - i0 : R, end = first + i0 + rows;
                const float *p = s + h * n * VW + i0;
                CacheRows values = cache_rows(c, L->v_cache, t0, g);
                values.head += d0;
                vec acc[R][C];
#pragma GCC unroll 16
                for (int r = 0; r < R; r++)
                    for (int d = 0; d < C; d++) acc[r][d] = vzero();
                for (int64_t j = 0; j < end; j++, p += VW) {
                    const float *v = values.next();
                    vec vv[C];
                    for (int d = 0; d < C; d++) vv[d] = vload(v + d * VW);
#pragma GCC unroll 16
                    for (int r = 0; r < R; r++) {
                        const vec pr = vset1(p[r]);
                        for (int d = 0; d < C; d++) acc[r][d] = vfma(pr, vv[d], acc[r][d]);
                    }
                }
                for (int64_t r = 0; r < rows; r++) {
                    float *o = c->attn + (t0 + i0 + r) * m->num_heads * D + (g * G + h) * D + d0;
                    const vec iv = vset1(inv[h * VW + i0 + r]);
                    for (int d = 0; d < C; d++) vstore(o + d * VW, vmul(acc[r][d], iv));
                }
            }
}

// Query tokens [t0, t1) of one sequence, KV heads [g0, g1): attend_block per KV head, or
// attend_group per token.
template <int DV>
void attend_range(const Context *c, const tandem_layer_t *L, int64_t t0, int64_t t1, int64_t g0, int64_t g1,
                  float *scratch) {
    if (t1 - t0 >= BLOCK_MIN_TOKENS) {
        for (int64_t g = g0; g < g1; g++) attend_block<DV>(c, L, t0, t1, g, scratch);
        return;
    }
    for (int64_t t = t0; t < t1; t++) attend_group<DV>(c, L, t, g0, g1, scratch);
}

// attend_range's build for this model's head_dim, or null (attend per head instead).
typedef void (*attend_group_fn)(const Context *, const tandem_layer_t *, int64_t, int64_t, int64_t, int64_t,
                                float *);
inline attend_group_fn attend_group_for(const tandem_model_t *m) {
    if (m->num_heads % m->num_kv_heads != 0 || m->num_heads / m->num_kv_heads > MAX_GROUP) return nullptr;
    switch (m->head_dim) {
        case VW: return attend_range<1>;
        case 2 * VW: return attend_range<2>;
        case 4 * VW: return attend_range<4>;
        case 8 * VW: return attend_range<8>;
        default: return nullptr;
    }
}

// The query blocks of a sequence's tokens [first, last) into `out` as [begin, end) pairs; returns
// how many. A token each for a short chunk; else VW tokens each, the last ending the chunk (a short
// block is the first, the one with the fewest keys), handed out last block first: the blocks with
// the most keys start first, and the phase ends evenly on every thread.
inline int64_t blocks_of(int32_t first, int32_t last, int32_t *out) {
    int64_t n = 0;
    if (last - first < BLOCK_MIN_QUERY)
        for (int32_t t = first; t < last; t++, n++) out[2 * n] = t, out[2 * n + 1] = t + 1;
    else
        for (int32_t end = last; end > first; end -= VW, n++) {
            out[2 * n] = end - VW > first ? end - VW : first;
            out[2 * n + 1] = end;
        }
    return n;
}

// The residual stream's rows of chunk i after the previous block: x += r * tmp, then dst = norm(x)
// with `norm` (the next layer's input norm, or the model's final norm written to out), and dstT
// (when not null) = those rows transposed.
inline void residual_norm_rows(const Context *c, int64_t i, const float *norm, float *dst, float *dstT) {
    const int64_t H = c->m->hidden;
    int64_t t0, t1;
    chunk_rows(c, i, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        add_residual(c->x + t * H, c->tmp + t * H, c->m->residual_multiplier, H);
        rms_norm_row(c->x + t * H, norm, dst + t * H, H, c->m->eps);
    }
    if (dstT) transpose_rows(dst, H, t0, t1, H, dstT, c->tp);
}

template <class W>
void run_layer(Worker *w, const tandem_layer_t *L, const float *next_norm, float *next_dst, float *next_dstT) {
    Context *c = w->c;
    const tandem_model_t *m = c->m;
    const tandem_batch_t *b = c->b;
    const int64_t T = b->num_tokens, H = m->hidden, D = m->head_dim, I = m->intermediate;
    const int64_t nq = m->num_heads, nkv = m->num_kv_heads, half = D / 2;
    const int64_t qkv_width = (nq + 2 * nkv) * D;

    // qkv, one head's D columns a chunk; q / k heads are normed (Qwen3) and rotated, k / v heads
    // written to their cache slots, all while the columns are still in cache.
    parallel(w, nq + 2 * nkv, [&](int64_t hd) {
        linear_cols(c, c->h, c->hT, H, (const W *)L->qkv_w, L->qkv_b, c->qkv, qkv_width, hd * D, (hd + 1) * D);
        for (int64_t t = 0; t < T; t++) {
            float *v = c->qkv + t * qkv_width + hd * D;
            if (hd < nq + nkv) {
                if (L->q_norm) rms_norm_row(v, hd < nq ? L->q_norm : L->k_norm, v, D, m->eps);
                rope_head(v, b->cos + (int64_t)c->pos[t] * half, b->sin + (int64_t)c->pos[t] * half, half);
            }
            if (hd >= nq) {
                int64_t kv_head = (hd - nq) % nkv;
                float *cache = hd < nq + nkv ? L->k_cache : L->v_cache;
                memcpy(cache + (b->slot_mapping[t] * nkv + kv_head) * D, v, D * sizeof(float));
            }
        }
    });
    float *scores = c->scores + w->tid * c->attn_scratch;
    if (attend_group_fn group = attend_group_for(m)) {
        const int64_t per_item = c->kv_heads_per_item, groups = nkv / per_item;  // items: a query block's KV heads
        parallel(w, c->num_blocks * groups, [&](int64_t item) {
            const int32_t *block = c->blocks + item / groups * 2;
            const int64_t g0 = item % groups * per_item;
            group(c, L, block[0], block[1], g0, g0 + per_item, scores);
        });
    }
    else
        parallel(w, T * nq, [&](int64_t item) { attend(c, L, item / nq, item % nq, scores); });
    if (c->attnT) {
        parallel(w, row_chunks(c), [&](int64_t i) {
            int64_t t0, t1;
            chunk_rows(c, i, &t0, &t1);
            transpose_rows(c->attn, nq * D, t0, t1, nq * D, c->attnT, c->tp);
        });
    }
    parallel(w, chunks_of(c, H), [&](int64_t i) {
        linear_chunk(c, i, c->attn, c->attnT, nq * D, (const W *)L->o_w, L->o_b, c->tmp, H);
    });
    parallel(w, row_chunks(c), [&](int64_t i) { residual_norm_rows(c, i, L->post_norm, c->h, c->hT); });
    // [g | u] for 64 of the I intermediate columns a chunk (both halves), then silu(g) * u there.
    parallel(w, chunks_of(c, I), [&](int64_t i) {
        int64_t begin = i * c->chunk_columns, end = begin + c->chunk_columns < I ? begin + c->chunk_columns : I;
        const W *gate_up = (const W *)L->gate_up_w;
        linear_cols(c, c->h, c->hT, H, gate_up, L->gate_up_b, c->gu, 2 * I, begin, end);
        linear_cols(c, c->h, c->hT, H, gate_up, L->gate_up_b, c->gu, 2 * I, I + begin, I + end);
        for (int64_t t = 0; t < T; t++) {
            const float *g = c->gu + t * 2 * I, *u = g + I;
            float *a = c->act + t * I;
            int64_t j = begin;
            for (; j + VW <= end; j += VW) {
                vec gv = vload(g + j);
                vec e = vexp(vsub(vzero(), gv));
                vstore(a + j, vmul(vdiv(gv, vadd(vset1(1.0f), e)), vload(u + j)));
            }
            for (; j < end; j++) a[j] = g[j] / (1.0f + exp_scalar(-g[j])) * u[j];
        }
        if (c->actT)
            for (int64_t t0 = 0; t0 < T; t0 += VW)
                transpose_block(c->act + t0 * I + begin, I, c->actT + begin * c->tp + t0, c->tp,
                                T - t0 < VW ? T - t0 : VW, end - begin);
    });
    parallel(w, chunks_of(c, H), [&](int64_t i) {
        linear_chunk(c, i, c->act, c->actT, I, (const W *)L->down_w, L->down_b, c->tmp, H);
    });
    parallel(w, row_chunks(c), [&](int64_t i) { residual_norm_rows(c, i, next_norm, next_dst, next_dstT); });
}

void *run_worker(void *p) {
    Worker *w = (Worker *)p;
    Context *c = w->c;
    const tandem_model_t *m = c->m;
    const int64_t H = m->hidden;
    parallel(w, row_chunks(c), [&](int64_t i) {
        int64_t t0, t1;
        chunk_rows(c, i, &t0, &t1);
        for (int64_t t = t0; t < t1; t++) rms_norm_row(c->x + t * H, m->layers[0].input_norm, c->h + t * H, H, m->eps);
        if (c->hT) transpose_rows(c->h, H, t0, t1, H, c->hT, c->tp);
    });
    for (int64_t l = 0; l < m->num_layers; l++) {
        bool last = l + 1 == m->num_layers;
        const float *next_norm = last ? m->final_norm : m->layers[l + 1].input_norm;
        float *dst = last ? c->out : c->h, *dstT = last ? nullptr : c->hT;
        if (m->weight_bf16) run_layer<bf16_t>(w, &m->layers[l], next_norm, dst, dstT);
        else run_layer<float>(w, &m->layers[l], next_norm, dst, dstT);
    }
    return 0;
}

}  // namespace

extern "C" {
/* x: [T, hidden] embedded inputs (overwritten: the residual stream); out: [T, hidden] the final
 * norm's output. Returns 0, or -1 when scratch memory could not be had. */
int tandem_decoder_forward(const tandem_model_t *m, const tandem_batch_t *b, float *x, float *out, int threads) {
    const int64_t T = b->num_tokens, H = m->hidden, I = m->intermediate, D = m->head_dim;
    const int64_t q = m->num_heads * D, kv = m->num_kv_heads * D;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int32_t *index = (int32_t *)malloc(4 * T * sizeof(int32_t) + 1);
    if (!index) return -1;
    Context c;
    c.seq_of = index;
    c.pos = index + T;
    c.blocks = index + 2 * T;
    c.num_blocks = 0;
    int64_t max_context = 1, widest = 1;  // widest: the most tokens in a query block
    for (int64_t s = 0; s < b->num_seqs; s++) {
        int32_t first = b->query_start[s], last = b->query_start[s + 1];
        for (int32_t t = first; t < last; t++) {
            c.seq_of[t] = (int32_t)s;
            c.pos[t] = b->seq_lens[s] - (last - first) + (t - first);
        }
        int32_t *blocks = c.blocks + 2 * c.num_blocks;  // the widest first (blocks_of)
        const int64_t n = blocks_of(first, last, blocks);
        if (n && blocks[1] - blocks[0] > widest) widest = blocks[1] - blocks[0];
        c.num_blocks += n;
        if (b->seq_lens[s] > max_context) max_context = b->seq_lens[s];
    }
    max_context = (max_context + VW - 1) / VW * VW;  // attend_group's rows are whole vectors
    // Each thread's attention scratch: attend_group's scores, and attend_block's where a block takes it.
    // Attention's items: a token with every KV head where a decode step has enough tokens to keep
    // the threads busy (attend_group says why), else a token or query block and one KV head.
    const bool all_heads = T == b->num_seqs && T >= ALL_HEADS_MIN_ITEMS * threads && m->num_heads <= MAX_ITEM_HEADS;
    c.kv_heads_per_item = all_heads ? m->num_kv_heads : 1;
    int64_t attn_scratch = (all_heads && m->num_heads > MAX_GROUP ? m->num_heads : MAX_GROUP) * max_context;
    if (widest >= BLOCK_MIN_TOKENS) {
        const int64_t blocked = m->num_heads / m->num_kv_heads * VW * (max_context + D);
        if (blocked > attn_scratch) attn_scratch = blocked;
    }
    // Wide: the transposed inputs' rows tp floats apart, whole vectors, and an odd number of cache
    // lines apart, so a tile's K rows of them spread over every cache set (a power-of-two stride
    // piles them into a few: 512 x 1536 x 576 ran at half speed).
    int64_t tp = b->wide ? (T + VW - 1) / VW * VW : 0;
    if (tp && (tp * sizeof(float) / 64) % 2 == 0) tp += 64 / sizeof(float);
    size_t floats = T * H * 3 + T * (q + 2 * kv) + T * q + T * 3 * I + threads * attn_scratch + tp * (H + q + I);
    float *scratch = (float *)malloc(floats * sizeof(float));
    if (!scratch) {
        free(index);
        return -1;
    }
    c.m = m;
    c.b = b;
    c.x = x;
    c.out = out;
    c.h = scratch;
    c.tmp = c.h + T * H;
    c.qkv = c.tmp + T * H;
    c.attn = c.qkv + T * (q + 2 * kv);
    c.gu = c.attn + T * q;
    c.act = c.gu + T * 2 * I;
    c.scores = c.act + T * I;
    c.attn_scratch = attn_scratch;
    c.tp = tp;
    c.hT = tp ? c.scores + threads * attn_scratch : nullptr;
    c.attnT = tp ? c.hT + tp * H : nullptr;
    c.actT = tp ? c.attnT + tp * q : nullptr;
    if (tp)  // the lanes past T: read by the wide tiles, never stored; zeros keep them finite
        for (int64_t k = 0; k < H + q + I; k++) memset(c.hT + k * tp + T, 0, (tp - T) * sizeof(float));
    c.chunk_columns = T <= SMALL_STEP_TOKENS ? SMALL_STEP_COLUMNS : COLUMNS_PER_CHUNK;
    c.phase_counters = 1 + threads;  // the team has at most `threads` threads
    Counter *phases = new (std::nothrow) Counter[(1 + PHASES_PER_LAYER * m->num_layers) * c.phase_counters];
    if (!phases) {
        free(scratch);
        free(index);
        return -1;
    }
    c.phases = phases;
    // Any number of the team's threads may run (fewer than asked where the pool is busy): the
    // chunks go to whichever threads exist, and each walks every phase.
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        Worker w{&c, omp_get_thread_num(), omp_get_num_threads(), 0};
        run_worker(&w);
    }
    delete[] phases;
    free(scratch);
    free(index);
    return 0;
}
}
