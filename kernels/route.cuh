// Router top-k of one token by one warp (model-spec.md 2.5 steps 1-2), shared by the route
// kernel (moe.cu) and the fused router product (gemv.cu); the contract is ninfer_moe_route's.
#pragma once
#include "common.cuh"

#define ROUTE_PER_LANE 16
#define NO_EXPERT 0x7fffffff

// Routes one token's row of logits (ninfer_moe_route's contract, by the calling warp): ids and
// w of token t among `tokens`. Logits are read through L2 (`__ldcg`), so a kernel may route
// rows that other blocks of the same launch wrote (the fused router product, gemv.cu).
__device__ __forceinline__ void route_row(const bf16* row, int t, int tokens, int experts, int topk, int has_shared,
                                          int* ids, float* w, int lane) {
    float v[ROUTE_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        const float x = e < experts ? bf2f(__ldcg(row + e)) : -INFINITY;
        v[i] = isnan(x) ? -INFINITY : x;
    }
    unsigned taken = 0;  // bit i: expert lane + 32*i already selected
    float top = -INFINITY, sum = 0.f, my_p = 0.f;
    int my_id = 0;
    for (int j = 0; j < topk; ++j) {
        float best = -INFINITY;
        int best_e = NO_EXPERT;
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; ++i) {
            const int e = lane + 32 * i;
            if (e < experts && !((taken >> i) & 1u) &&
                (best_e == NO_EXPERT || v[i] > best || (v[i] == best && e < best_e))) {
                best = v[i];
                best_e = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (oe != NO_EXPERT &&
                (best_e == NO_EXPERT || ob > best || (ob == best && oe < best_e))) {
                best = ob;
                best_e = oe;
            }
        }
        if ((best_e & 31) == lane) taken |= 1u << (best_e >> 5);
        if (j == 0) top = best;
        const float p = best == -INFINITY ? 0.f : expf(best - top);
        sum += p;
        if (lane == j) {
            my_p = p;
            my_id = best_e;
        }
    }
    if (lane < topk) {
        ids[(size_t)t * topk + lane] = my_id;
        w[(size_t)t * topk + lane] = sum > 0.f ? round_bf(my_p / sum) : 0.f;
    }
    if (has_shared && lane == 0) {
        w[(size_t)tokens * topk + t] = round_bf(sigmoid(bf2f(__ldcg(row + experts))));
    }
}
