// Router top-k of one token by one warp (model-spec.md 2.5 steps 1-2), shared by the route
// kernel (moe.cu) and the fused router product (gemv.cu); the contract is ninfer_moe_route's.
#pragma once
#include "common.cuh"

#define ROUTE_PER_LANE 16

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

// The top-k picks of one token's row of logits by the calling warp (ninfer_moe_route's math):
// lane j < topk returns pick j, its expert and its renormalised weight. Logits are read
// through L2 (`__ldcg`), so a kernel may route rows that other blocks of the same launch, or
// the kernel ahead, wrote. Each of the topk rounds takes the largest remaining key with one
// warp max reduction.
struct RoutePick {
    int id;
    float w;
};

__device__ __forceinline__ RoutePick route_pick(const bf16* row, int experts, int topk, int lane) {
    unsigned key[ROUTE_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        key[i] = e < experts ? route_key(__ldcg(row + e), e) : 0u;
    }
    float top = -INFINITY, sum = 0.f, my_p = 0.f;
    int my_id = 0;
    for (int j = 0; j < topk; ++j) {
        unsigned best = 0u;
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; ++i) best = max(best, key[i]);
        const unsigned win = __reduce_max_sync(0xffffffffu, best);
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; ++i)
            if (key[i] == win) key[i] = 0u;
        const float v = key_logit(win);
        if (j == 0) top = v;
        const float p = v == -INFINITY ? 0.f : expf(v - top);
        sum += p;
        if (lane == j) {
            my_p = p;
            my_id = 511 - (int)(win & 511u);
        }
    }
    return {my_id, sum > 0.f ? round_bf(my_p / sum) : 0.f};
}

// The shared expert's weight: the sigmoid of its gate logit, stored after the E router logits.
__device__ __forceinline__ float shared_gate(const bf16* row, int experts) {
    return round_bf(sigmoid(bf2f(__ldcg(row + experts))));
}

// Routes one token's row of logits (ninfer_moe_route's contract, by the calling warp): ids and
// w of token t among `tokens`.
__device__ __forceinline__ void route_row(const bf16* row, int t, int tokens, int experts, int topk, int has_shared,
                                          int* ids, float* w, int lane) {
    const RoutePick p = route_pick(row, experts, topk, lane);
    if (lane < topk) {
        ids[(size_t)t * topk + lane] = p.id;
        w[(size_t)t * topk + lane] = p.w;
    }
    if (has_shared && lane == 0) w[(size_t)tokens * topk + t] = shared_gate(row, experts);
}
