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
#include "route.cuh"

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
    if (t >= a.tokens) return;
    route_row(a.logits + (size_t)t * a.ld, t, a.tokens, a.experts, a.topk, a.has_shared, a.ids, a.w, threadIdx.x & 31);
}
