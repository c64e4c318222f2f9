// One token of the GDN causal depthwise conv of one channel (model-spec.md 2.4 step 2), shared
// by the conv kernel (gdn.cu) and the projection that runs it in its epilogue (fused.cu), so
// that both give the same bits; the contract is ninfer_gdn_conv's.
#pragma once
#include "common.cuh"

// The conv output bf16(silu(bf16(w . [h0, h1, h2, x]))) from the channel's 4 bf16 weights (w[3]
// multiplies the current input x) and its last three inputs h0 (oldest) .. h2, summed in this
// order in f32.
__device__ __forceinline__ bf16 conv4_silu(uint2 w, float h0, float h1, float h2, float x) {
    float acc = bf_lo(w.x) * h0;
    acc = fmaf(bf_hi(w.x), h1, acc);
    acc = fmaf(bf_lo(w.y), h2, acc);
    acc = fmaf(bf_hi(w.y), x, acc);
    return f2bf(silu(round_bf(acc)));
}
