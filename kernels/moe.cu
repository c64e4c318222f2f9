// MoE routing (model-spec.md 2.5 steps 1-2 and the shared-expert gate of step 4).
//
// ninfer_moe_route
//   logits: bf16 [tokens, ld] (the router output; with has_shared, column E holds the
//   shared_expert_gate logit, so one gemv over the router and gate rows feeds this kernel).
//   Per token: p = softmax(logits[0..E)) in f32; the topk largest p are selected in descending
//   order (ties to the lower expert id; NaN logits rank as -inf); their weights are
//   renormalised to sum to 1 (always, model-spec.md 2.5) and rounded to bf16.
//   ids[t*topk + j] = expert id (i32), w[t*topk + j] = weight (f32 holding a bf16 value);
//   with has_shared: w[tokens*topk + t] = bf16(sigmoid(logits[t, E])).
//   The renormalised weights equal a softmax over the selected logits, which is how they are
//   computed (the full denominator cancels). A token whose logits are all NaN gets weights 0.
//   Limits: E <= 512, 1 <= topk <= min(E, 32).
//   Launch: block 128 = 4 warps, one token per warp, grid ceil(tokens / 4).
#include "common.cuh"

#define ROUTE_PER_LANE 16
#define NO_EXPERT 0x7fffffff

struct RouteArgs {
    const bf16* logits;
    int* ids;
    float* w;
    int tokens;
    int ld;
    int experts;
    int topk;
    int has_shared;
    int pad;
};
static_assert(sizeof(RouteArgs) == 48, "mirrored in crates/ninfer-kernels/src/moe.rs");

extern "C" __global__ void __launch_bounds__(128) ninfer_moe_route(RouteArgs a) {
    grid_release();
    grid_wait();
    const int t = blockIdx.x * 4 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (t >= a.tokens) return;
    const bf16* row = a.logits + (size_t)t * a.ld;
    float v[ROUTE_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        const float x = e < a.experts ? bf2f(row[e]) : -INFINITY;
        v[i] = isnan(x) ? -INFINITY : x;
    }
    unsigned taken = 0;  // bit i: expert lane + 32*i already selected
    float top = -INFINITY, sum = 0.f, my_p = 0.f;
    int my_id = 0;
    for (int j = 0; j < a.topk; ++j) {
        float best = -INFINITY;
        int best_e = NO_EXPERT;
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; ++i) {
            const int e = lane + 32 * i;
            if (e < a.experts && !((taken >> i) & 1u) &&
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
    if (lane < a.topk) {
        a.ids[(size_t)t * a.topk + lane] = my_id;
        a.w[(size_t)t * a.topk + lane] = sum > 0.f ? round_bf(my_p / sum) : 0.f;
    }
    if (a.has_shared && lane == 0) {
        a.w[(size_t)a.tokens * a.topk + t] = round_bf(sigmoid(bf2f(row[a.experts])));
    }
}
