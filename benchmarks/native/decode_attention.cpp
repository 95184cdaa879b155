/* Decode attention alone (cpu_decoder.cpp's attend_group) on one thread: S sequences of `ctx`
 * keys each in a paged cache whose blocks are shuffled, SmolLM2-135M's head shapes by default.
 * Built and run by benchmarks/decode_attention.py.
 *
 *   decode_attention CTX NUM_KV_HEADS MODE   MODE: per-head | all-heads | read
 *
 * per-head: one call per (token, KV head); all-heads: one call per token for every KV head;
 * read: the same blocks summed and nothing else (the access pattern's own stream rate).
 * Prints one line: "us_per_token_kv_head GBPS". */
#include "cpu_decoder.cpp"

#include <algorithm>
#include <chrono>
#include <random>
#include <stdio.h>
#include <string.h>
#include <vector>

int main(int argc, char **argv) {
    if (argc < 4) return 2;
    const int S = 16, ctx = atoi(argv[1]), nkv = atoi(argv[2]), G = 3, nq = G * nkv, D = 64, bs = 16;
    const char *mode = argv[3];
    const int maxb = (ctx + bs - 1) / bs, nblocks = S * maxb;
    std::vector<float> kc((size_t)nblocks * bs * nkv * D), vc(kc.size());
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    for (auto &x : kc) x = nd(rng);
    for (auto &x : vc) x = nd(rng);
    std::vector<int32_t> tables(S * maxb), seq_lens(S, ctx), qs(S + 1), seq_of(S), pos(S, ctx - 1);
    std::vector<int> perm(nblocks);
    for (int i = 0; i < nblocks; i++) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);  // blocks anywhere, as in a long-running server
    for (int s = 0; s < S; s++) {
        for (int j = 0; j < maxb; j++) tables[s * maxb + j] = perm[s * maxb + j];
        qs[s] = s, seq_of[s] = s;
    }
    qs[S] = S;
    tandem_layer_t L{};
    L.k_cache = kc.data(), L.v_cache = vc.data();
    tandem_model_t m{};
    m.num_layers = 1, m.hidden = nq * D, m.num_heads = nq, m.num_kv_heads = nkv, m.head_dim = D, m.block_size = bs;
    m.attention_scale = 0.125f, m.layers = &L;
    tandem_batch_t b{};
    b.num_tokens = S, b.num_seqs = S, b.max_blocks = maxb, b.seq_lens = seq_lens.data(), b.block_tables = tables.data();
    b.query_start = qs.data();
    std::vector<float> qkv(S * (nq + 2 * nkv) * D), attn(S * nq * D), scores((size_t)nq * (ctx + VW) + 64);
    for (auto &x : qkv) x = nd(rng);
    Context c{};
    c.m = &m, c.b = &b, c.qkv = qkv.data(), c.attn = attn.data(), c.seq_of = seq_of.data(), c.pos = pos.data();
    const double bytes = 2.0 * S * ctx * nkv * D * sizeof(float);
    double best = 1e30;
    for (int rep = 0; rep < 7; rep++) {
        auto t0 = std::chrono::steady_clock::now();
        float sink = 0.0f;
        if (!strcmp(mode, "read")) {
            __m512 acc = _mm512_setzero_ps();
            for (int s = 0; s < S; s++)
                for (const float *cache : {kc.data(), vc.data()})
                    for (int j = 0; j < maxb; j++) {
                        const float *blk = cache + (size_t)tables[s * maxb + j] * bs * nkv * D;
                        for (int i = 0; i < bs * nkv * D; i += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(blk + i));
                    }
            sink = _mm512_reduce_add_ps(acc);
        } else {
            const bool all = !strcmp(mode, "all-heads");
            for (int s = 0; s < S; s++) {
                if (all) attend_group<4>(&c, &L, s, 0, nkv, scores.data());
                else for (int g = 0; g < nkv; g++) attend_group<4>(&c, &L, s, g, g + 1, scores.data());
            }
            sink = attn[0];
        }
        double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        if (sink == 12345.0f) printf(" ");  // keeps the work
        best = us < best ? us : best;
    }
    printf("%.3f %.2f\n", best / (S * nkv), bytes / best / 1e3);
    return 0;
}
