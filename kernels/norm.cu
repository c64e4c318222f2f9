// RMS norms of the model (model-spec.md 2.1). bf16 in/out, f32 math, one warp per row.
//
// ninfer_rms_norm: zero-centred RMSNorm
//   y[r, :] = bf16( x[r,:] / sqrt(mean(x[r,:]^2) + eps) * (1 + w) ), all math in f32, one
//   rounding at the end. x, y: bf16 rows of `dim` elements, row r at x + r*ldx, y + r*ldy
//   (ld in elements); w: bf16 [dim]. Rows with a stride cover strided views such as the query
//   halves of q_proj ([T, Hq, 2D] with ldx = 2D). y may alias x (same ld): each element is read and
//   written by the same thread, the write after every read of its row.
//
// ninfer_add_rms_norm: residual add fused before the norm (the decoder layer of 2.2)
//   h[r,:] = bf16(h[r,:] + delta[r,:])   (residual adds happen in the model dtype)
//   y[r,:] = zero-centred RMSNorm of the rounded h, as above. h is updated in place;
//   delta may not alias h or y; y may not alias h.
//
// ninfer_gated_rms_norm: the GDN output norm (plain weight, norm first, then SiLU gate)
//   n = bf16(x / sqrt(mean(x^2) + eps))  ;  m = bf16(n * w)  ;  y = bf16(m * silu(z))
//   with z upcast to f32; rows of `dim` (the value head dim, 128 in the model) and one weight
//   vector shared by all rows. z rows come in groups of `group` (a token's heads) that are
//   contiguous, groups `ldg` elements apart: z row r at z + (r / group) * ldg + (r % group) * dim
//   (a token's gate inside the stacked projection output). y may alias x, not z.
//
// Shapes: dim % 8 == 0, every row start 16-byte aligned (ld % 8 == 0, aligned bases).
// Launch: block (32, 4) = four rows per block, grid (ceil(rows / 4)).
#include "rms.cuh"

struct NormArgs {
    const bf16* x;      // input rows (h for the residual variant)
    const bf16* w;      // weight [dim]
    bf16* y;            // output rows
    bf16* h;            // residual stream (add variant only), updated in place
    const bf16* delta;  // added to h (add variant only); z gate for the gated variant
    int rows;
    int dim;
    int ldx;
    int ldy;
    int ldd;            // row stride of delta
    float eps;
    int group;          // gated variant: z rows per group, and the groups' stride
    int ldg;
};
static_assert(sizeof(NormArgs) == 72, "mirrored in crates/ninfer-kernels/src/norm.rs");

extern "C" __global__ void __launch_bounds__(128) ninfer_rms_norm(NormArgs a) {
    grid_release();
    grid_wait();
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= a.rows) return;
    const bf16* x = a.x + (size_t)row * a.ldx;
    const float inv = inv_rms(x, a.dim, a.eps, threadIdx.x);
    store_zc_norm(x, a.w, a.y + (size_t)row * a.ldy, a.dim, inv, threadIdx.x);
}

extern "C" __global__ void __launch_bounds__(128) ninfer_add_rms_norm(NormArgs a) {
    grid_release();
    grid_wait();
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= a.rows) return;
    const int lane = threadIdx.x;
    bf16* h = a.h + (size_t)row * a.ldx;
    const bf16* d = a.delta + (size_t)row * a.ldd;
    float ss = 0.f;
    for (int c = lane; c < a.dim / 8; c += NINFER_WARP) {
        float v[8], dv[8];
        unpack_bf8(*reinterpret_cast<const uint4*>(h + c * 8), v);
        unpack_bf8(ldg16(d + c * 8), dv);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = round_bf(v[i] + dv[i]);
        ss += sq8(v);
        *reinterpret_cast<uint4*>(h + c * 8) = pack_bf8(v);
    }
    const float inv = rsqrtf(warp_sum1(ss) / (float)a.dim + a.eps);
    store_zc_norm(h, a.w, a.y + (size_t)row * a.ldy, a.dim, inv, lane);
}

extern "C" __global__ void __launch_bounds__(128) ninfer_gated_rms_norm(NormArgs a) {
    grid_release();
    grid_wait();
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= a.rows) return;
    const int lane = threadIdx.x;
    const bf16* x = a.x + (size_t)row * a.ldx;
    const bf16* z = a.delta + (size_t)(row / a.group) * a.ldg + (size_t)(row % a.group) * a.dim;
    bf16* y = a.y + (size_t)row * a.ldy;
    const int chunks = a.dim / 8;
    const float inv = inv_rms(x, a.dim, a.eps, lane);
    for (int c = lane; c < chunks; c += NINFER_WARP) {
        float v[8], w[8], g[8];
        unpack_bf8(*reinterpret_cast<const uint4*>(x + c * 8), v);
        unpack_bf8(ldg16(a.w + c * 8), w);
        unpack_bf8(ldg16(z + c * 8), g);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float m = round_bf(round_bf(v[i] * inv) * w[i]);
            v[i] = m * silu(g[i]);
        }
        *reinterpret_cast<uint4*>(y + c * 8) = pack_bf8(v);
    }
}
