// The MoE router folded into the output projection ahead of it (fused.cu's _route kernels; the
// contract is theirs). The router multiplies a = bf16(h / rms(h) (1 + w)), which needs the
// whole new row h before it can start: a launch of its own. Without a's rounding the product is
// linear in h, sum_d R[e, d] a[d] = inv_rms(h) sum_d R[e, d] (1 + w[d]) h[d], so each block of
// the projection adds its own rows' share of every sum as it stores them, and only the norm and
// the scaling wait for the last block.
#pragma once
#include "rms.cuh"

// The largest router (routed experts and the shared expert's gate), the most projection rows
// a block keeps, and the longest rows (one token's, a batch's) the fold takes.
#define FOLD_MAX_E 512
#define FOLD_BLOCK_ROWS 256
#define FOLD_MAX_K 8192
#define FOLD_BATCH_MAX_K 4096
// The sums' fixed point: an int64 of 2^-32 (sums up to 2^31 in size). Integer adds give the
// same total in every order, so the logits do not depend on which block adds first.
#define FOLD_ONE 4294967296.0

struct RouterFold {
    const bf16* r;       // [experts, K] router rows, bf16
    const bf16* norm_w;  // [K] the post-mixer norm's weight (zero-centred)
    long long* acc;      // [batch, experts] zero at launch, left zero
    unsigned* ticket;    // zero at launch, left zero
    bf16* logits;        // [batch, experts]
    bf16* a_out;         // [batch, K] the normed rows, the experts' input
    int experts;
    float eps;
};
static_assert(sizeof(RouterFold) == 56, "mirrored in crates/ninfer-kernels/src/fused.rs");

// What a block of a fold of at most B rows keeps in shared memory: its projection rows of each
// batch row as stored, then times (1 + w); a row's chunk sums and 1 / rms in the last block.
template <int B>
struct FoldSmem {
    static constexpr int MAX_K = B == 1 ? FOLD_MAX_K : FOLD_BATCH_MAX_K;
    float hx[B][FOLD_BLOCK_ROWS];
    float part[B * MAX_K / 8];
    float inv[B];
};

// p + the eight bf16 of w times x[0..8), in order.
__device__ __forceinline__ float dot8(const float (&w)[8], const float* x, float p) {
#pragma unroll
    for (int j = 0; j < 8; ++j) p = fmaf(w[j], x[j], p);
    return p;
}

// A block's share of the fold: the first two 8-column chunks of each of its router rows (e =
// thread, thread + 256) asked for before grid_wait(), and 1 + w of its row `begin + thread`.
struct FoldShare {
    uint4 w[2][2];
    float wn;
    int begin, rows;

    // Before grid_wait(): rows [begin, begin + rows) of the projection are this block's.
    __device__ __forceinline__ void start(const RouterFold& f, int k, int b, int n) {
        begin = b;
        rows = n;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int e = threadIdx.x + 256 * i;
#pragma unroll
            for (int c = 0; c < 2; ++c)
                if (e < f.experts && 8 * c < rows) w[i][c] = ldg16(f.r + (size_t)e * k + begin + 8 * c);
        }
        wn = threadIdx.x < rows ? 1.f + bf2f(f.norm_w[begin + threadIdx.x]) : 0.f;
    }
};

// Projection row `row` of batch row b, just stored as `hv`, into the block's rows.
template <int B>
__device__ __forceinline__ void fold_keep(FoldSmem<B>& sm, const FoldShare& s, int b, int row, bf16 hv) {
    sm.hx[b][row - s.begin] = bf2f(hv);
}

// After every row of the block is kept: its share of each sum into acc; then the last block of
// the grid to get here norms each row of h ([batch, ldh]; fill_norm's and fill_norm_rows' order,
// so a has ninfer_rms_norm's bits), stores a and the logits, and zeroes acc and the ticket for
// the next launch.
template <int B>
__device__ __forceinline__ void fold_finish(const RouterFold& f, const FoldShare& s, FoldSmem<B>& sm, const bf16* h, int ldh,
                                            int batch, int k) {
    __shared__ bool last;
    __syncthreads();
    if ((int)threadIdx.x < s.rows)
        for (int b = 0; b < batch; ++b) sm.hx[b][threadIdx.x] *= s.wn;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int e = threadIdx.x + 256 * i;
        if (e >= f.experts) continue;
        float p[B];
#pragma unroll
        for (int b = 0; b < B; ++b) p[b] = 0.f;
        const auto chunk = [&](uint4 raw, int c) {
            float w[8];
            unpack_bf8(raw, w);
#pragma unroll
            for (int b = 0; b < B; ++b)
                if (b < batch) p[b] = dot8(w, &sm.hx[b][8 * c], p[b]);
        };
#pragma unroll
        for (int c = 0; c < 2; ++c)
            if (8 * c < s.rows) chunk(s.w[i][c], c);
        for (int c = 2; 8 * c < s.rows; ++c) chunk(ldg16(f.r + (size_t)e * k + s.begin + 8 * c), c);
#pragma unroll
        for (int b = 0; b < B; ++b)
            if (b < batch)
                atomicAdd(reinterpret_cast<unsigned long long*>(f.acc + (size_t)b * f.experts + e),
                          (unsigned long long)__float2ll_rn(p[b] * (float)FOLD_ONE));
    }
    // The sums and the stored rows before the ticket; the last block's reads after it.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(f.ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    constexpr int PER = B * FoldSmem<B>::MAX_K / 8 / 256;
    const int nch = k / 8, total = batch * nch;
    uint4 hr[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int c = threadIdx.x + 256 * i;
        if (c < total) {
            const int b = B == 1 ? 0 : c / nch;
            hr[i] = __ldcg(reinterpret_cast<const uint4*>(h + (size_t)b * ldh) + (c - b * nch));
            float v[8];
            unpack_bf8(hr[i], v);
            sm.part[c] = sq8(v);
        }
    }
    long long sum[2][B];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int e = threadIdx.x + 256 * i;
#pragma unroll
        for (int b = 0; b < B; ++b) sum[i][b] = e < f.experts && b < batch ? __ldcg(f.acc + (size_t)b * f.experts + e) : 0;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for (int b = threadIdx.x >> 5; b < batch; b += 8) {
        float ss = 0.f;
        for (int c = lane; c < nch; c += NINFER_WARP) ss += sm.part[b * nch + c];
        ss = warp_sum1(ss);
        if (lane == 0) sm.inv[b] = rsqrtf(ss / (float)k + f.eps);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int c = threadIdx.x + 256 * i;
        if (c >= total) break;
        const int b = B == 1 ? 0 : c / nch, cc = c - b * nch;
        float v[8], wv[8];
        unpack_bf8(hr[i], v);
        unpack_bf8(ldg16(f.norm_w + cc * 8), wv);
        const float inv = sm.inv[b];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = v[j] * inv * (1.0f + wv[j]);
        *reinterpret_cast<uint4*>(f.a_out + (size_t)b * k + cc * 8) = pack_bf8(v);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int e = threadIdx.x + 256 * i;
        if (e >= f.experts) continue;
#pragma unroll
        for (int b = 0; b < B; ++b) {
            if (b >= batch) break;
            const size_t o = (size_t)b * f.experts + e;
            f.logits[o] = f2bf((float)((double)sum[i][b] * ((double)sm.inv[b] / FOLD_ONE)));
            f.acc[o] = 0;
        }
    }
    if (threadIdx.x == 0) *f.ticket = 0u;
}
