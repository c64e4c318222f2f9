// The MoE router folded into the output projection ahead of it (fused.cu's _route_b1 kernels; the
// contract is theirs). The router multiplies a = bf16(h / rms(h) (1 + w)), which needs the
// whole new row h before it can start: a launch of its own. Without a's rounding the product is
// linear in h, sum_d R[e, d] a[d] = inv_rms(h) sum_d R[e, d] (1 + w[d]) h[d], so each block of
// the projection adds its own rows' share of every sum as it stores them, and only the norm and
// the scaling wait for the last block, which also routes the logits as ninfer_moe_route does, so
// that the expert kernels after it read their picks instead of routing for themselves.
#pragma once
#include "rms.cuh"
#include "route.cuh"

// The largest router (routed experts and the shared expert's gate), the most projection rows
// a block keeps, and the longest row the fold takes.
#define FOLD_MAX_E 512
#define FOLD_BLOCK_ROWS 256
#define FOLD_MAX_K 8192
// The sums' fixed point: an int64 of 2^-32 (sums up to 2^31 in size). Integer adds give the
// same total in every order, so the logits do not depend on which block adds first.
#define FOLD_ONE 4294967296.0

struct RouterFold {
    const bf16* r;       // [experts, K] router rows, bf16
    const bf16* norm_w;  // [K] the post-mixer norm's weight (zero-centred)
    long long* acc;      // [experts] zero at launch, left zero
    unsigned* ticket;    // zero at launch, left zero
    bf16* logits;        // [experts]
    bf16* a_out;         // [K] the normed row, the experts' input
    int* ids;            // [topk] ninfer_moe_route's picks of the logits (one token)
    float* route_w;      // [topk] their weights, then with the gate row the shared expert's
    int experts;         // router rows: the routed experts, then optionally the shared gate
    float eps;
    int routed;          // routed experts: experts or experts - 1 (the last row the gate)
    int topk;
};
static_assert(sizeof(RouterFold) == 80, "mirrored in crates/ninfer-kernels/src/fused.rs");

// What a block keeps in shared memory: its projection rows as stored, then times (1 + w); the
// row's chunk sums and 1 / rms in the last block.
struct FoldSmem {
    float hx[FOLD_BLOCK_ROWS];
    float part[FOLD_MAX_K / 8];
    float inv;
};
static_assert(FOLD_MAX_K / 8 >= FOLD_MAX_E, "part takes the routing keys");

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

// Projection row `row`, just stored as `hv`, into the block's rows.
__device__ __forceinline__ void fold_keep(FoldSmem& sm, const FoldShare& s, int row, bf16 hv) { sm.hx[row - s.begin] = bf2f(hv); }

// After every row of the block is kept: its share of each sum into acc; then the last block of
// the grid to get here norms h (fill_norm's order, so a has ninfer_rms_norm's bits), stores a
// and the logits, zeroes acc and the ticket for the next launch, and routes the logits.
__device__ __forceinline__ void fold_finish(const RouterFold& f, const FoldShare& s, FoldSmem& sm, const bf16* h, int k) {
    __shared__ bool last;
    __syncthreads();
    if ((int)threadIdx.x < s.rows) sm.hx[threadIdx.x] *= s.wn;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int e = threadIdx.x + 256 * i;
        if (e >= f.experts) continue;
        float p = 0.f;
        const auto chunk = [&](uint4 raw, int c) {
            float w[8];
            unpack_bf8(raw, w);
            p = dot8(w, &sm.hx[8 * c], p);
        };
#pragma unroll
        for (int c = 0; c < 2; ++c)
            if (8 * c < s.rows) chunk(s.w[i][c], c);
        for (int c = 2; 8 * c < s.rows; ++c) chunk(ldg16(f.r + (size_t)e * k + s.begin + 8 * c), c);
        atomicAdd(reinterpret_cast<unsigned long long*>(f.acc + e), (unsigned long long)__float2ll_rn(p * (float)FOLD_ONE));
    }
    // The sums and the stored rows before the ticket; the last block's reads after it.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(f.ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    constexpr int PER = FOLD_MAX_K / 8 / 256;
    const int nch = k / 8;
    uint4 hr[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int c = threadIdx.x + 256 * i;
        if (c < nch) {
            hr[i] = __ldcg(reinterpret_cast<const uint4*>(h) + c);
            float v[8];
            unpack_bf8(hr[i], v);
            sm.part[c] = sq8(v);
        }
    }
    long long sum[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int e = threadIdx.x + 256 * i;
        sum[i] = e < f.experts ? __ldcg(f.acc + e) : 0;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        float ss = 0.f;
        for (int c = threadIdx.x; c < nch; c += NINFER_WARP) ss += sm.part[c];
        ss = warp_sum1(ss);
        if (threadIdx.x == 0) sm.inv = rsqrtf(ss / (float)k + f.eps);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int c = threadIdx.x + 256 * i;
        if (c >= nch) break;
        float v[8], wv[8];
        unpack_bf8(hr[i], v);
        unpack_bf8(ldg16(f.norm_w + c * 8), wv);
        const float inv = sm.inv;
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = v[j] * inv * (1.0f + wv[j]);
        *reinterpret_cast<uint4*>(f.a_out + c * 8) = pack_bf8(v);
    }
    // part's sums are all read (the barrier after inv): it takes the routing keys.
    unsigned* keys = reinterpret_cast<unsigned*>(sm.part);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int e = threadIdx.x + 256 * i;
        if (e >= f.experts) continue;
        const bf16 logit = f2bf((float)((double)sum[i] * ((double)sm.inv / FOLD_ONE)));
        f.logits[e] = logit;
        f.acc[e] = 0;
        if (e < f.routed) keys[e] = route_key(logit, e);
        else f.route_w[f.topk] = gate_weight(logit);
    }
    if (threadIdx.x == 0) *f.ticket = 0u;
    __syncthreads();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const RoutePick p = route_by<true>([keys](int e) { return keys[e]; }, f.routed, f.topk, lane);
        if (lane < f.topk) {
            f.ids[lane] = p.id;
            f.route_w[lane] = p.w;
        }
    }
}
