// Router top-k of one token by one warp (model-spec.md 2.5 steps 1-2), shared by the route
// kernel (moe.cu) and the expert kernels that route for themselves (experts.cu,
// experts_batch.cu's one-token down); the contract is ninfer_moe_route's.
#pragma once
#include "quant.cuh"

#define ROUTE_PER_LANE 16
#define DOWN_MAX_SLOTS 33  // top-32 and the shared slot

// The routing order as one 25-bit key: a bf16 logit mapped to an unsigned order (NaN as -inf,
// -0 as +0), then 511 - expert, so that the larger key is the larger logit and, among equal
// logits, the lower expert id. 0 is below every key (no expert).
__device__ __forceinline__ unsigned route_key(bf16 x, int e) {
    unsigned b = __bfloat16_as_ushort(x);
    if ((b & 0x7fffu) > 0x7f80u) b = 0xff80u;
    if (b == 0x8000u) b = 0u;
    const unsigned m = (b & 0x8000u) ? (~b & 0xffffu) : (b | 0x8000u);
    return (m << 9) | (511u - (unsigned)e);
}

// The logit of a key (route_key's inverse on its top 16 bits).
__device__ __forceinline__ float key_logit(unsigned k) {
    const unsigned m = k >> 9;
    const unsigned short b = (m & 0x8000u) ? (unsigned short)(m & 0x7fffu) : (unsigned short)(~m & 0xffffu);
    return bf2f(__ushort_as_bfloat16(b));
}

// The top-k picks of one token by the calling warp (ninfer_moe_route's math): lane j < topk
// returns pick j, its expert and (with W) its renormalised weight. A kernel that needs only
// pick j runs j + 1 rounds without W: the same ids, each round's key chain alone on its
// critical path.
struct RoutePick {
    int id;
    float w;
};

// The top-k picks of a warp: key_of(e) the routing key of expert e < experts (route_key), lane
// l holding the keys of experts l + 32 i, PER a lane (experts <= 32 PER); topk rounds, each
// taking the largest remaining key with one warp max reduction.
template <int PER, bool W, typename KeyOf>
__device__ __forceinline__ RoutePick route_keys(KeyOf key_of, int experts, int topk, int lane) {
    unsigned key[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int e = lane + 32 * i;
        key[i] = e < experts ? key_of(e) : 0u;
    }
    float top = -INFINITY, sum = 0.f, my_p = 0.f;
    int my_id = 0;
    for (int j = 0; j < topk; ++j) {
        unsigned best = 0u;
#pragma unroll
        for (int i = 0; i < PER; ++i) best = max(best, key[i]);
        const unsigned win = __reduce_max_sync(0xffffffffu, best);
#pragma unroll
        for (int i = 0; i < PER; ++i)
            if (key[i] == win) key[i] = 0u;
        if (lane == j) my_id = 511 - (int)(win & 511u);
        if (W) {
            const float v = key_logit(win);
            if (j == 0) top = v;
            const float p = v == -INFINITY ? 0.f : expf(v - top);
            sum += p;
            if (lane == j) my_p = p;
        }
    }
    return {my_id, sum > 0.f ? round_bf(my_p / sum) : 0.f};
}

// route_keys with the keys a lane needs for `experts` (a warp-uniform choice).
template <bool W, typename KeyOf>
__device__ __forceinline__ RoutePick route_by(KeyOf key_of, int experts, int topk, int lane) {
    return experts <= 256 ? route_keys<8, W>(key_of, experts, topk, lane) : route_keys<ROUTE_PER_LANE, W>(key_of, experts, topk, lane);
}

// The picks of one token's row of logits, read through L2 (`__ldcg`) so that a kernel may
// route rows that the kernel ahead wrote.
template <bool W>
__device__ __forceinline__ RoutePick route_pick(const bf16* row, int experts, int topk, int lane) {
    return route_by<W>([row](int e) { return route_key(__ldcg(row + e), e); }, experts, topk, lane);
}

// The shared expert's weight: the sigmoid of its gate logit, stored after the E router logits.
__device__ __forceinline__ float gate_weight(bf16 logit) { return round_bf(sigmoid(bf2f(logit))); }
__device__ __forceinline__ float shared_gate(const bf16* row, int experts) { return gate_weight(__ldcg(row + experts)); }

// Routes one token's row of logits (ninfer_moe_route's contract, by the calling warp): ids and
// w of token t among `tokens`.
__device__ __forceinline__ void route_row(const bf16* row, int t, int tokens, int experts, int topk, int has_shared,
                                          int* ids, float* w, int lane) {
    const RoutePick p = route_pick<true>(row, experts, topk, lane);
    if (lane < topk) {
        ids[(size_t)t * topk + lane] = p.id;
        w[(size_t)t * topk + lane] = p.w;
    }
    if (has_shared && lane == 0) w[(size_t)tokens * topk + t] = shared_gate(row, experts);
}

// Token t's routing into shared memory: slot j < topk's expert id[j] and weight w[j], the
// shared slot's weight w[topk]; read from ids and route_w, or routed from the logits by warp 0
// (BankArgs::logits). Through L2 (`__ldcg`): the down kernels read them before grid_wait() (experts.cu).
__device__ __forceinline__ void token_routing(const BankArgs& a, int t, int* id, float* w) {
    const int j = threadIdx.x;
    if (a.logits != nullptr) {
        if (j < 32) {
            const RoutePick p = route_pick<true>(a.logits, a.bank.experts, a.topk, j);
            if (j < a.topk) {
                id[j] = p.id;
                w[j] = p.w;
            }
            if (a.has_shared && j == 0) w[a.topk] = shared_gate(a.logits, a.bank.experts);
        }
    } else if (j < a.topk) {
        id[j] = __ldcg(a.ids + t * a.topk + j);
        w[j] = __ldcg(a.route_w + t * a.topk + j);
    } else if (j == a.topk && a.has_shared) {
        w[j] = __ldcg(a.route_w + a.tokens * a.topk + t);
    }
    __syncthreads();
}
