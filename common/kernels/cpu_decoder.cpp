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
 * Each layer is 7 phases; a phase is cut into chunks (64 output columns of a linear layer, with
 * rope, q/k norm and the cache write fused into the qkv head that produced them and silu(g) * u
 * into gate_up; one (token, head) pair of attention; one token row of a residual + norm) that the
 * threads claim from an atomic counter. A thread that loses its core to another process (the
 * gateway, a prefill worker) therefore holds up only the chunk it is in, not a static share:
 * the others take the rest of the phase and go on. Threads are started per call (one
 * pthread_create per extra thread per step, ~50 us), so nothing spins between steps.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <new>

#include "gemm_tiles.h"

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
} tandem_model_t;

typedef struct {
    int64_t num_tokens, num_seqs, max_blocks;
    const float *cos, *sin;         // [num_tokens, head_dim / 2]: each token's rope angles
    const int64_t *slot_mapping;    // [num_tokens]: cache slot of each token's k / v
    const int32_t *query_start;     // [num_seqs + 1]
    const int32_t *seq_lens;        // [num_seqs]: context length after this step
    const int32_t *block_tables;    // [num_seqs, max_blocks]
} tandem_batch_t;
}

namespace {

constexpr int64_t COLUMNS_PER_CHUNK = 64;
constexpr int64_t PHASES_PER_LAYER = 7;  // run_layer's parallel() calls

// One phase of the forward: chunks claimed from `next`, counted into `done` once written.
struct Phase {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
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
    float *scores;   // [threads, max context]
    int64_t max_context;
    int32_t *seq_of; // [T]: the sequence of each token
    int32_t *pos;    // [T]: the position of each token
    Phase *phases;   // every phase of the call, in the order every thread walks them
};

struct Worker {
    Context *c;
    int tid;
    int64_t cursor;  // this thread's next phase
};

// Runs work(i) for the chunks i < total that this thread claims, then waits until every chunk of
// the phase is done (the next phase reads what this one wrote).
template <class Work>
inline void parallel(Worker *w, int64_t total, Work &&work) {
    Phase &p = w->c->phases[w->cursor++];
    for (;;) {
        int64_t i = p.next.fetch_add(1, std::memory_order_relaxed);
        if (i >= total) break;
        work(i);
        p.done.fetch_add(1, std::memory_order_release);
    }
    // Spin (phases are microseconds apart), yielding once it is clear the thread holding the last
    // chunk lost its core, so a busy machine is not made busier.
    for (int spins = 0; p.done.load(std::memory_order_acquire) < total; spins++) {
        if (spins < 2000) _mm_pause();
        else sched_yield();
    }
}

inline int64_t chunks_of(int64_t n) { return (n + COLUMNS_PER_CHUNK - 1) / COLUMNS_PER_CHUNK; }

// Columns [i * 64, (i + 1) * 64) of y = x W^T (+ b): chunk i of a linear layer.
template <class W>
inline void linear_chunk(const Context *c, int64_t i, const float *x, int64_t K, const W *w, const float *bias,
                         float *y, int64_t N) {
    int64_t begin = i * COLUMNS_PER_CHUNK, end = begin + COLUMNS_PER_CHUNK < N ? begin + COLUMNS_PER_CHUNK : N;
    gemm_range(x, K, w, bias, y, N, c->b->num_tokens, K, begin, end);
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

// Token t, query head hd: softmax(q . K^T * scale) V over positions 0..pos[t] of its sequence.
void attend(const Context *c, const tandem_layer_t *L, int64_t t, int64_t hd, float *scores) {
    const tandem_model_t *m = c->m;
    const tandem_batch_t *b = c->b;
    const int64_t D = m->head_dim, kvh = hd / (m->num_heads / m->num_kv_heads), bs = m->block_size;
    const int64_t qkv_width = (m->num_heads + 2 * m->num_kv_heads) * D;
    const float *q = c->qkv + t * qkv_width + hd * D;
    const int32_t *table = b->block_tables + (int64_t)c->seq_of[t] * b->max_blocks;
    const int64_t n = (int64_t)c->pos[t] + 1;
    float best = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        int64_t slot = (int64_t)table[j / bs] * bs + j % bs;
        float s = dot(q, L->k_cache + (slot * m->num_kv_heads + kvh) * D, D) * m->attention_scale;
        scores[j] = s;
        if (s > best) best = s;
    }
    float total = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        scores[j] = expf(scores[j] - best);
        total += scores[j];
    }
    float *o = c->attn + t * m->num_heads * D + hd * D;
    memset(o, 0, D * sizeof(float));
    for (int64_t j = 0; j < n; j++) {
        int64_t slot = (int64_t)table[j / bs] * bs + j % bs;
        axpy(o, L->v_cache + (slot * m->num_kv_heads + kvh) * D, scores[j], D);
    }
    float inv = 1.0f / total;
    for (int64_t i = 0; i < D; i++) o[i] *= inv;
}

// The residual stream's row t after the previous block: x += r * tmp, then h = norm(x) with `norm`
// (the next layer's input norm, or the model's final norm written to out).
inline void residual_norm_row(const Context *c, int64_t t, const float *norm, float *dst) {
    const int64_t H = c->m->hidden;
    add_residual(c->x + t * H, c->tmp + t * H, c->m->residual_multiplier, H);
    rms_norm_row(c->x + t * H, norm, dst + t * H, H, c->m->eps);
}

template <class W>
void run_layer(Worker *w, const tandem_layer_t *L, const float *next_norm, float *next_dst) {
    Context *c = w->c;
    const tandem_model_t *m = c->m;
    const tandem_batch_t *b = c->b;
    const int64_t T = b->num_tokens, H = m->hidden, D = m->head_dim, I = m->intermediate;
    const int64_t nq = m->num_heads, nkv = m->num_kv_heads, half = D / 2;
    const int64_t qkv_width = (nq + 2 * nkv) * D;

    // qkv, one head's D columns a chunk; q / k heads are normed (Qwen3) and rotated, k / v heads
    // written to their cache slots, all while the columns are still in cache.
    parallel(w, nq + 2 * nkv, [&](int64_t hd) {
        gemm_range(c->h, H, (const W *)L->qkv_w, L->qkv_b, c->qkv, qkv_width, T, H, hd * D, (hd + 1) * D);
        for (int64_t t = 0; t < T; t++) {
            float *v = c->qkv + t * qkv_width + hd * D;
            if (hd < nq + nkv) {
                if (L->q_norm) rms_norm_row(v, hd < nq ? L->q_norm : L->k_norm, v, D, m->eps);
                rope_head(v, b->cos + t * half, b->sin + t * half, half);
            }
            if (hd >= nq) {
                int64_t kv_head = (hd - nq) % nkv;
                float *cache = hd < nq + nkv ? L->k_cache : L->v_cache;
                memcpy(cache + (b->slot_mapping[t] * nkv + kv_head) * D, v, D * sizeof(float));
            }
        }
    });
    float *scores = c->scores + w->tid * c->max_context;
    parallel(w, T * nq, [&](int64_t item) { attend(c, L, item / nq, item % nq, scores); });
    parallel(w, chunks_of(H), [&](int64_t i) { linear_chunk(c, i, c->attn, nq * D, (const W *)L->o_w, L->o_b, c->tmp, H); });
    parallel(w, T, [&](int64_t t) { residual_norm_row(c, t, L->post_norm, c->h); });
    // [g | u] for 64 of the I intermediate columns a chunk (both halves), then silu(g) * u there.
    parallel(w, chunks_of(I), [&](int64_t i) {
        int64_t begin = i * COLUMNS_PER_CHUNK, end = begin + COLUMNS_PER_CHUNK < I ? begin + COLUMNS_PER_CHUNK : I;
        const W *gate_up = (const W *)L->gate_up_w;
        gemm_range(c->h, H, gate_up, L->gate_up_b, c->gu, 2 * I, T, H, begin, end);
        gemm_range(c->h, H, gate_up, L->gate_up_b, c->gu, 2 * I, T, H, I + begin, I + end);
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = begin; j < end; j++) {
                float g = c->gu[t * 2 * I + j], u = c->gu[t * 2 * I + I + j];
                c->act[t * I + j] = g / (1.0f + expf(-g)) * u;
            }
    });
    parallel(w, chunks_of(H), [&](int64_t i) { linear_chunk(c, i, c->act, I, (const W *)L->down_w, L->down_b, c->tmp, H); });
    parallel(w, T, [&](int64_t t) { residual_norm_row(c, t, next_norm, next_dst); });
}

void *run_worker(void *p) {
    Worker *w = (Worker *)p;
    Context *c = w->c;
    const tandem_model_t *m = c->m;
    const int64_t H = m->hidden;
    parallel(w, c->b->num_tokens, [&](int64_t t) { rms_norm_row(c->x + t * H, m->layers[0].input_norm, c->h + t * H, H, m->eps); });
    for (int64_t l = 0; l < m->num_layers; l++) {
        bool last = l + 1 == m->num_layers;
        const float *next_norm = last ? m->final_norm : m->layers[l + 1].input_norm;
        if (m->weight_bf16) run_layer<bf16_t>(w, &m->layers[l], next_norm, last ? c->out : c->h);
        else run_layer<float>(w, &m->layers[l], next_norm, last ? c->out : c->h);
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
    if (threads > 16) threads = 16;
    int64_t max_context = 1;
    for (int64_t s = 0; s < b->num_seqs; s++)
        if (b->seq_lens[s] > max_context) max_context = b->seq_lens[s];
    size_t floats = T * H * 3 + T * (q + 2 * kv) + T * q + T * 3 * I + threads * max_context;
    float *scratch = (float *)malloc(floats * sizeof(float));
    int32_t *index = (int32_t *)malloc(2 * T * sizeof(int32_t) + 1);
    if (!scratch || !index) {
        free(scratch);
        free(index);
        return -1;
    }
    Context c;
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
    c.max_context = max_context;
    c.seq_of = index;
    c.pos = index + T;
    for (int64_t s = 0; s < b->num_seqs; s++) {
        int32_t first = b->query_start[s], last = b->query_start[s + 1];
        for (int32_t t = first; t < last; t++) {
            c.seq_of[t] = (int32_t)s;
            c.pos[t] = b->seq_lens[s] - (last - first) + (t - first);
        }
    }
    Phase *phases = new (std::nothrow) Phase[1 + PHASES_PER_LAYER * m->num_layers];
    if (!phases) {
        free(scratch);
        free(index);
        return -1;
    }
    c.phases = phases;
    // Any number of the threads may start: the chunks go to whichever threads exist.
    pthread_t tids[16];
    Worker workers[16];
    int started = 1;
    for (int t = 1; t < threads; t++) {
        workers[t] = Worker{&c, t, 0};
        if (pthread_create(&tids[t], 0, run_worker, &workers[t]) != 0) break;
        started++;
    }
    workers[0] = Worker{&c, 0, 0};
    run_worker(&workers[0]);
    for (int t = 1; t < started; t++) pthread_join(tids[t], 0);
    delete[] phases;
    free(scratch);
    free(index);
    return 0;
}
}
