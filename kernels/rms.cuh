// The zero-centred RMSNorm of one row by one warp (model-spec.md 2.1), shared by the norm
// kernels (norm.cu) and the projections that norm their own input (gemv.cu), so that both give
// the same bits.
#pragma once
#include "common.cuh"

// The sum of squares of one 8-element chunk, in element order: the partial every norm of the
// model sums (rms.cuh's order), so that the one-warp norms and the block-wide ones of fused.cu
// give the same bits.
__device__ __forceinline__ float sq8(const float (&v)[8]) {
    float p = v[0] * v[0];
#pragma unroll
    for (int i = 1; i < 8; ++i) p = fmaf(v[i], v[i], p);
    return p;
}

// 1 / sqrt(mean(x^2) + eps) of a row of `dim` (a multiple of 8), over the calling warp: lane l
// sums the partials of chunks l, l + 32, ... in order, then the warp sums the lanes (warp_sum1).
__device__ __forceinline__ float inv_rms(const bf16* x, int dim, float eps, int lane) {
    float ss = 0.f;
    for (int c = lane; c < dim / 8; c += NINFER_WARP) {
        float v[8];
        unpack_bf8(ldg16(x + c * 8), v);
        ss += sq8(v);
    }
    return rsqrtf(warp_sum1(ss) / (float)dim + eps);
}

// y = bf16(x * inv * (1 + w)) over a row, by the calling warp; x is read with plain loads, after
// inv_rms read it, so y may alias x.
__device__ __forceinline__ void store_zc_norm(const bf16* x, const bf16* w, bf16* y, int dim, float inv, int lane) {
    for (int c = lane; c < dim / 8; c += NINFER_WARP) {
        float v[8], wv[8];
        unpack_bf8(*reinterpret_cast<const uint4*>(x + c * 8), v);
        unpack_bf8(ldg16(w + c * 8), wv);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = v[i] * inv * (1.0f + wv[i]);
        *reinterpret_cast<uint4*>(y + c * 8) = pack_bf8(v);
    }
}
