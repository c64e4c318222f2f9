// The row machinery of the matrix-vector products (gemv.cu's contract): the argument block,
// the output store, and the streaming of one weight row per warp, shared by gemv.cu and the
// fused products of fused.cu.
#pragma once
#include "quant.cuh"

struct GemvArgs {
    Mat m;
    const bf16* x;
    void* y;
    int batch;
    int ldx;
    int ldy;
    int out_f32;
    int accumulate;  // bf16 y only: y = bf16(y + bf16(r))
    int pad;
};
static_assert(sizeof(GemvArgs) == 88, "mirrored in crates/ninfer-kernels/src/gemv.rs");

__device__ __forceinline__ void store_out(void* y, size_t idx, float v, int out_f32, int accumulate) {
    if (out_f32) {
        float* p = static_cast<float*>(y) + idx;
        *p = accumulate ? *p + v : v;
    } else {
        bf16* p = static_cast<bf16*>(y) + idx;
        *p = accumulate ? f2bf(bf2f(*p) + round_bf(v)) : f2bf(v);
    }
}

// w . x over one chunk, each group's partial sum times its scale; x read as bf16, from global
// memory (L1-resident across the warps of a block) or, with SMEM, from shared memory.
template <typename Enc, bool SMEM = false>
__device__ __forceinline__ float chunk_dot(const float (&w)[Enc::CHUNK], const float (&sc)[Enc::GROUPS],
                                           const bf16* x) {
    constexpr int PER = Enc::CHUNK / Enc::GROUPS;
    float acc = 0.f;
#pragma unroll
    for (int g = 0; g < Enc::GROUPS; ++g) {
        float part = 0.f;
#pragma unroll
        for (int v = 0; v < PER / 8; ++v) {
            float xf[8];
            const bf16* p = x + g * PER + v * 8;
            unpack_bf8(SMEM ? *reinterpret_cast<const uint4*>(p) : ldg16(p), xf);
#pragma unroll
            for (int i = 0; i < 8; ++i) part = fmaf(w[g * PER + v * 8 + i], xf[i], part);
        }
        acc = fmaf(part, sc[g], acc);
    }
    return acc;
}

// acc[0] += (row chunk r0) . x and acc[1] += (row chunk r1) . x over the same chunk of x
// (global memory): two chunk_dot calls, the same products in the same order.
template <typename Enc>
__device__ __forceinline__ void pair_dot(const typename Enc::Raw& r0, const typename Enc::Raw& r1, const bf16* x,
                                         float (&acc)[2]) {
    float w[Enc::CHUNK], sc[Enc::GROUPS];
    Enc::dequant(r0, w, sc);
    acc[0] += chunk_dot<Enc>(w, sc, x);
    Enc::dequant(r1, w, sc);
    acc[1] += chunk_dot<Enc>(w, sc, x);
}

// NVFP4: both rows decoded a word (8 weights) at a time against each 8 of x, read once: 16
// weights live instead of a chunk's 32 (and x's 32) per row, which keeps the per-slot gate_up
// within the 56 registers of nine blocks per SM (experts.cu) without spilling. The weights stay
// E2M1 * 2^-126 and x is taken times 2^64, one multiply per x shared by both rows: every
// product is E2M1 * x * 2^-62, exact and normal for |x| in [2^-63, 2^64), and the group sums
// are the unscaled ones times 2^-62 exactly, which the scale takes back.
template <>
__device__ __forceinline__ void pair_dot<EncNvfp4>(const EncNvfp4::Raw& r0, const EncNvfp4::Raw& r1, const bf16* x,
                                                   float (&acc)[2]) {
    const uint32_t q0[4] = {r0.q.x, r0.q.y, r0.q.z, r0.q.w}, q1[4] = {r1.q.x, r1.q.y, r1.q.z, r1.q.w};
    float d0 = 0.f, d1 = 0.f;
#pragma unroll
    for (int g = 0; g < EncNvfp4::GROUPS; ++g) {
        float p0 = 0.f, p1 = 0.f;
#pragma unroll
        for (int v = 0; v < 2; ++v) {
            float xf[8], w[8];
            unpack_bf8(ldg16(x + 8 * (2 * g + v)), xf);
#pragma unroll
            for (int i = 0; i < 8; ++i) xf[i] *= 0x1p64f;
            EncNvfp4::dequant_word_tiny(q0[2 * g + v], w);
#pragma unroll
            for (int i = 0; i < 8; ++i) p0 = fmaf(w[i], xf[i], p0);
            EncNvfp4::dequant_word_tiny(q1[2 * g + v], w);
#pragma unroll
            for (int i = 0; i < 8; ++i) p1 = fmaf(w[i], xf[i], p1);
        }
        d0 = fmaf(p0, EncNvfp4::scale(r0, g) * 0x1p62f, d0);
        d1 = fmaf(p1, EncNvfp4::scale(r1, g) * 0x1p62f, d1);
    }
    acc[0] += d0;
    acc[1] += d1;
}

// The weight rows a warp streams: rows row0, row0 + stride, ... below m.rows, and of each row
// the lane's chunks lane, lane + 32, ... (every lane walks ceil(nchunks / 32) chunk slots per
// row, loading only those below nchunks, so that row ends fall on the same step in every lane).
// `start` issues the first D loads and asks L2 for the rest of the first row (weights only, so
// callable before grid_wait()); `each` then hands every chunk to `use(c, w, sc)` decoded, in
// lane order, and calls `end(row)` in every lane once a row is done, keeping D loads in flight
// across the row ends: a warp that takes several rows never waits for its next row's first
// bytes. Chunk loads in flight: D = 4 at batch <= 4, 2 above, whose accumulators need the
// registers.
template <typename Enc, int D>
struct RowStream {
    typename Enc::Raw raw[D];
    int nchunks, per, stride, lane;
    int lrow, lk;  // the next load: its row and the lane's chunk slot k (chunk lane + 32 k)

    __device__ __forceinline__ void issue(const Mat& m, int i) {
        const int c = lane + 32 * lk;
        if (lrow < m.rows && c < nchunks) raw[i] = Enc::load(m, 0, lrow, c);
        if (++lk == per) {
            lk = 0;
            lrow += stride;
        }
    }

    __device__ __forceinline__ void start(const Mat& m, int row0, int stride_, int lane_) {
        nchunks = m.cols / Enc::CHUNK;
        per = (nchunks + 31) / 32;
        stride = stride_;
        lane = lane_;
        lrow = row0;
        lk = 0;
#pragma unroll
        for (int i = 0; i < D; ++i) issue(m, i);
        if (row0 < m.rows)
            for (int c = lane + 32 * D; c < nchunks; c += 32) Enc::prefetch(m, 0, row0, c);
    }

    template <typename Use, typename End>
    __device__ __forceinline__ void each(const Mat& m, int row0, Use use, End end) {
        int urow = row0, uk = 0;
        while (urow < m.rows) {
#pragma unroll
            for (int i = 0; i < D; ++i) {
                if (urow >= m.rows) break;
                const typename Enc::Raw cur = raw[i];
                issue(m, i);
                const int c = lane + 32 * uk;
                if (c < nchunks) {
                    float w[Enc::CHUNK], sc[Enc::GROUPS];
                    Enc::dequant(cur, w, sc);
                    use(c, w, sc);
                }
                if (++uk == per) {
                    uk = 0;
                    end(urow);
                    urow += stride;
                }
            }
        }
    }
};
