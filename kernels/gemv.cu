// Matrix-vector products for decode (small batch), over every weight encoding of
// docs/format.md section 3 (the MoE expert banks' per-slot products are in experts.cu).
//
// ninfer_gemv_<enc>_b<NB>  (enc: bf16, q8_g32, q4_g32, nvfp4; NB: 1, 2, 4, 8, 16)
//   y[b, n] = sum_k x[b, k] * W[n, k]     for b < batch <= NB, n < N = m.rows, k < K = m.cols
//   x: bf16 [batch, ldx]; W: one matrix (m.experts == 1) decoded per format.md, nvfp4 including
//   its per-segment global; f32 accumulation; y [batch, ldy] written as bf16 (rounded once) or f32
//   (out_f32); with accumulate (bf16 y), the sum r is added instead: y = bf16(y + bf16(r)), the
//   residual add in the model dtype. Launch: block 256 = 8 warps, one output row per warp at a
//   time, grid ceil(N / 8) or fewer blocks: warp w of block b takes rows 8b + w + 8k * gridDim.x
//   (gemv.cuh's RowStream), so a grid of the device's resident blocks streams a long matrix.
//   K must be a multiple of 8 (bf16), 32 (q8_g32, q4_g32, nvfp4) or 64 (q6_g64): whole 16-byte
//   chunks per lane and whole scale groups. Every weight row and x row must start 16-byte
//   aligned. y must not alias x or W.
//
//   bf16, q8_g32 and q6_g64 have no SIMT kernels of 2-16 rows, and q6_g64 none of one row:
//   those batches take the tensor-core kernels below.
//
// ninfer_gemv_<enc>_mma_b<NB>  (enc: bf16, q8_g32; NB: 8, 16)
//   The contract above for batches of 2-8 (b8) and 9-16 (b16) rows, on the tensor cores:
//   mma.m16n8k16 with bf16 operands and f32 accumulation. bf16 weights and int8 codes are
//   exact in bf16 and x is bf16, so each product is exact; the two MMAs of a 32-column group
//   are summed from zero and scaled by the group's f16 scale in f32. K must be a multiple of
//   32. Launch: block 256 = 8 warps on one 16-row tile, warp w taking the 32-column groups w,
//   w+8, ... and the warps' partials summed in shared memory in warp order; grid ceil(N / 16).
//   The body is gemv_mma.cuh's, which fused.cu's normed products of 2-16 rows share.
//
// ninfer_gemv_q8_g32_bulk_b1  (one row; K % 256 == 0, K <= 8192)
//   The contract above for one q8_g32 row on gemv_bulk.cuh's product: the weights by bulk
//   copies into shared memory, every stage that fits asked for before grid_wait(), int8 codes
//   and x as f16 on the tensor cores (exact while |x| < 65,504; each 32-column group's sum
//   scaled in f32, the eight warps' partials summed in warp order: not the bits of
//   ninfer_gemv_q8_g32_b1). Launch: block 256, dynamic shared memory stages * 16 * (K + 32 + K
//   / 16 + 16) bytes, grid at most ceil(N / 16) (gemv.rs's bulk_launch).
//
// ninfer_gemv_q8_g32_bulk_b8 / _b16  (2-8 and 9-16 rows; K % 256 == 0, K <= 4096)
//   The same for a batch (gemv_bulk.cuh's bulk_rows_product): the batch's x rows are copied
//   into the start of the dynamic shared memory (row stride NORM_LD(K) = ceil(K / 64) * 64 + 32
//   elements, batch * NORM_LD(K) * 2 bytes rounded up to 128) and turned into f16, the weight
//   stages follow; B's column b is row b. Launch: block 256, dynamic shared memory those rows
//   plus the stages (gemv.rs's bulk_launch), grid at most ceil(N / 16).
//
// ninfer_gemv_q6_g64_mma_b2 / _b4  (batches of 1-2 and 3-4 rows; K % 64 == 0, NB * K <= 32768)
//   The contract above on the tensor cores (mma.m16n8k16, bf16 operands, f32 accumulation).
//   Each code is exact in bf16 as code - 32 and x is bf16, so every product is exact; a row's
//   64-column group is summed from zero and scaled by its f16 scale in f32. A warp owns 16-row
//   tiles (tile w of the grid's warps, then every 8 * gridDim.x-th), walking K in blocks of 256
//   columns: lane 4g + t holds group t of the block for rows g and g + 8 (16-byte loads), and
//   in MMA column tile c (NB / 2 of them) B's column 4r + q holds x row 2c + r at group q's
//   columns (zero at the others), so that the accumulator's column 4r + q is group q's sum for
//   that row. x sits in shared memory, every row in MMA order (dynamic: 16 * (8 + NB *
//   ceil(K / 256) * 32) bytes). The decoding takes about half the instructions per weight of
//   the SIMT kernels, which bounded the head (docs/performance.md).
//
// ninfer_gemv_q6_g64_mma_b8 / _b16  (batches of 5-8 and 9-16 rows; K % 64 == 0)
//   The same on the tensor cores with the batch rows as B's columns (8 per MMA tile), where the
//   b2 and b4 layout would take NB / 2 tiles per step: every k16 step stays within one group
//   (lane 4g + t holds columns 16t..16t+15 of rows g and g + 8, 8-byte loads), four groups of
//   loads in flight per lane, x read from L1.
//
//   All four: launch block 256, grid ceil(ceil(N / 16) / 8) or fewer blocks. The launcher gives
//   every warp one tile: a grid of the blocks resident at once (each warp streaming about seven
//   tiles) made the head's launch in the decode step take 206 µs against 140 (H100, 2026-12-07,
//   docs/performance-log.md).
//
// Dependent launch (common.cuh): the dense kernels load their first weight chunks and ask L2
// for the rest of their rows before grid_wait(), so a projection's weights stream in while the
// kernel ahead of it (a norm, the recurrence) finishes.
#include "gemv_bulk.cuh"

template <typename Enc, int NB>
__device__ __forceinline__ void gemv_body(const GemvArgs& a) {
    constexpr int CH = Enc::CHUNK;
    grid_release();
    const int lane = threadIdx.x & 31;
    const int row0 = blockIdx.x * 8 + (threadIdx.x >> 5);
    // The weights are ready before the kernel ahead has finished: start the rows, then wait for x.
    RowStream<Enc, NB <= 4 ? 4 : 2> rs;
    rs.start(a.m, row0, gridDim.x * 8, lane);
    grid_wait();
    float acc[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) acc[b] = 0.f;
    rs.each(
        a.m, row0,
        [&](int c, const float (&w)[CH], const float (&sc)[Enc::GROUPS]) {
#pragma unroll
            for (int b = 0; b < NB; ++b)
                if (b < a.batch) acc[b] += chunk_dot<Enc>(w, sc, a.x + (size_t)b * a.ldx + (size_t)c * CH);
        },
        [&](int row) {
            warp_sum(acc);
            const float mul = row_multiplier<Enc>(a.m, 0, row);
#pragma unroll
            for (int b = 0; b < NB; ++b) {
                if (b < a.batch && lane == b % 32)
                    store_out(a.y, (size_t)b * a.ldy + row, acc[b] * mul, a.out_f32, a.accumulate);
                acc[b] = 0.f;
            }
        });
}

__device__ __forceinline__ uint32_t bf16x2_sub(uint32_t a, uint32_t b) {
    const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
}

// q6 codes in bytes 0-1 (`upper` false) or 2-3 of `b` as a bf16x2 pair of code - 32, exactly:
// 0x43 above a code c < 128 is the bf16 of 128 + c; minus 160 leaves c - 32.
__device__ __forceinline__ uint32_t q6_bf16x2(uint32_t b, bool upper) {
    return bf16x2_sub(__byte_perm(b, 0x43434343u, upper ? 0x4342 : 0x4140), 0x43204320u);
}

#define Q6_BLOCK 256  // columns a warp's lanes take per step of a tile: four groups of 64
#define Q6_AHEAD 2     // column blocks of loads in flight per lane

// Eight q6 codes (q6_code_bytes' arguments) as bf16x2 pairs of code - 32 (q6_bf16x2): (e0, e2),
// (e1, e3), (e4, e6), (e5, e7). About 2.3 instructions a weight (SASS), where the SIMT
// decoding (EncQ6) and products take about 6 (our estimate).
__device__ __forceinline__ void q6_pairs(uint32_t w, uint32_t hw, bool up, uint32_t (&p)[4]) {
    uint32_t ce, co;
    q6_code_bytes(w, hw, up, ce, co);
    p[0] = q6_bf16x2(ce, false);
    p[1] = q6_bf16x2(co, false);
    p[2] = q6_bf16x2(ce, true);
    p[3] = q6_bf16x2(co, true);
}

// Eight bf16 of x (columns c0..c7) in the q6 kernels' MMA k order: (x0, x2), (x1, x3), (x4, x6),
// (x5, x7), the order of q6_pairs.
__device__ __forceinline__ uint4 x8_mma_order(uint4 v) {
    return make_uint4(__byte_perm(v.x, v.y, 0x5410), __byte_perm(v.x, v.y, 0x7632), __byte_perm(v.z, v.w, 0x5410),
                      __byte_perm(v.z, v.w, 0x7632));
}

// A lane's share of one 256-column block of a tile: group t of the block for rows g and g + 8
// (codes, high bits, and the scales of groups 2(t % 2), 2(t % 2) + 1, which lanes t < 2 apply).
struct Q6Part {
    uint4 ql[2][2];
    uint4 qh[2];
    uint16_t s[2][2];
};

__device__ __forceinline__ Q6Part q6_load(const Mat& m, int tile, int blk, int g, int t) {
    Q6Part p;
    const int groups = m.cols / 64, grp = blk * 4 + t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        // Rows past the matrix read its last row, groups past K its last group (both unused).
        const size_t row = min(tile * 16 + g + 8 * h, m.rows - 1);
        const int gl = min(grp, groups - 1), gs = blk * 4 + 2 * (t & 1);
        const uint8_t* ql = static_cast<const uint8_t*>(m.p0) + row * (m.cols / 2) + gl * 32;
        p.ql[h][0] = ld_stream16(ql);
        p.ql[h][1] = ld_stream16(ql + 16);
        p.qh[h] = ld_stream16(static_cast<const uint8_t*>(m.p1) + row * (m.cols / 4) + gl * 16);
        const uint16_t* sc = static_cast<const uint16_t*>(m.p2) + row * groups;
        p.s[h][0] = __ldg(sc + min(gs, groups - 1));
        p.s[h][1] = __ldg(sc + min(gs + 1, groups - 1));
    }
    return p;
}

// The q6_g64 kernels' body for batches of up to 2 * NT rows (header, b2 and b4): B's column n = 4r + q
// holds batch row 2c + r (n tile c) at the columns of the block's group q, zero at the others.
template <int NT>
__device__ __forceinline__ void gemv_q6_mma_rows(const GemvArgs& a) {
    // x in MMA order (x8_mma_order), row after row, unit u of a row its columns 8u .. 8u + 7;
    // zero past K (those columns' codes are a clamped group's: finite, times zero) and in the
    // rows past the batch; `zero` is what the lanes off the B operand's diagonal read instead.
    extern __shared__ uint4 q6_smem[];
    uint4* zero = q6_smem;
    uint4* xs = q6_smem + 8;
    grid_release();
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tiles = (a.m.rows + 15) / 16, blocks_k = (a.m.cols + Q6_BLOCK - 1) / Q6_BLOCK;
    const int units = blocks_k * (Q6_BLOCK / 8);
    const int stride = gridDim.x * 8;
    const int tile0 = blockIdx.x * 8 + (threadIdx.x >> 5);
    Q6Part buf[Q6_AHEAD];
    int ltile = tile0, lblk = 0;  // the next load
    auto issue = [&](int i) {
        if (ltile < tiles) buf[i] = q6_load(a.m, ltile, lblk, g, t);
        if (++lblk == blocks_k) {
            lblk = 0;
            ltile += stride;
        }
    };
#pragma unroll
    for (int i = 0; i < Q6_AHEAD; ++i) issue(i);
    grid_wait();
    if (threadIdx.x < 8) zero[threadIdx.x] = make_uint4(0u, 0u, 0u, 0u);
    for (int c = threadIdx.x; c < 2 * NT * units; c += blockDim.x) {
        const int b = c / units, u = c - b * units;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (b < a.batch && u < a.m.cols / 8) v = ldg16(a.x + (size_t)b * a.ldx + (size_t)u * 8);
        xs[c] = x8_mma_order(v);
    }
    __syncthreads();
    // acc[c][h]: row g + 8h of batch row 2c + t / 2, this lane's two groups of each block.
    float acc[NT][2];
#pragma unroll
    for (int c = 0; c < NT; ++c) acc[c][0] = acc[c][1] = 0.f;
    for (int utile = tile0, ublk = 0; utile < tiles;) {
#pragma unroll
        for (int i = 0; i < Q6_AHEAD; ++i) {
            if (utile >= tiles) break;
            const Q6Part cur = buf[i];
            issue(i);
            // B: x row 2c + g / 4 at this lane's group if the lane is on the diagonal (g % 4 == t).
            const uint4* xb = (g & 3) == t ? xs + (g >> 2) * units + (ublk * 4 + t) * 8 : zero;
            const int step = (g & 3) == t ? 2 * units : 0;
            float d[NT][4];
#pragma unroll
            for (int c = 0; c < NT; ++c) d[c][0] = d[c][1] = d[c][2] = d[c][3] = 0.f;
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                uint32_t p0[4], p1[4];
                q6_pairs(u4_word(cur.ql[0][u / 4], u % 4), u4_word(cur.qh[0], u / 2), u % 2, p0);
                q6_pairs(u4_word(cur.ql[1][u / 4], u % 4), u4_word(cur.qh[1], u / 2), u % 2, p1);
#pragma unroll
                for (int c = 0; c < NT; ++c) {
                    const uint4 xv = xb[c * step + u];
                    mma_bf16(d[c], p0[0], p1[0], p0[1], p1[1], xv.x, xv.y);
                    mma_bf16(d[c], p0[2], p1[2], p0[3], p1[3], xv.z, xv.w);
                }
            }
            // d[c]: rows g (d0, d1) and g + 8 (d2, d3) at columns 2t, 2t + 1: batch row
            // 2c + t / 2, groups 2(t % 2), 2(t % 2) + 1 of the block (a group past K sums to
            // zero, times its neighbour's finite scale).
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float s0 = f16_bits_to_f(cur.s[h][0]), s1 = f16_bits_to_f(cur.s[h][1]);
#pragma unroll
                for (int c = 0; c < NT; ++c) acc[c][h] = fmaf(d[c][2 * h + 1], s1, fmaf(d[c][2 * h], s0, acc[c][h]));
            }
            if (++ublk == blocks_k) {
                // Lanes t and t ^ 1 hold a row's even and odd groups: their sum goes to the even one.
#pragma unroll
                for (int c = 0; c < NT; ++c)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const float v = acc[c][h] + __shfl_xor_sync(0xffffffffu, acc[c][h], 1);
                        const int row = utile * 16 + g + 8 * h, b = 2 * c + t / 2;
                        if ((t & 1) == 0 && row < a.m.rows && b < a.batch)
                            store_out(a.y, (size_t)b * a.ldy + row, v, a.out_f32, a.accumulate);
                        acc[c][h] = 0.f;
                    }
                ublk = 0;
                utile += stride;
            }
        }
    }
}

#define Q6B_AHEAD 4  // 64-column groups of loads in flight per lane

// A lane's share of one 64-column group of a 16-row tile: columns 16t..16t+15 of rows g and
// g + 8 (8 bytes of low nibbles, 32 high bits, the group's scale).
struct Q6Slice {
    uint2 ql[2];
    uint32_t qh[2];
    uint16_t s[2];
};

__device__ __forceinline__ Q6Slice q6_slice_load(const Mat& m, int tile, int grp, int g, int t) {
    Q6Slice p;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        // Rows past the matrix read its last row; their outputs are not stored.
        const size_t row = min(tile * 16 + g + 8 * h, m.rows - 1);
        const uint8_t* ql = static_cast<const uint8_t*>(m.p0) + row * (m.cols / 2) + grp * 32 + 8 * t;
        asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(p.ql[h].x), "=r"(p.ql[h].y) : "l"(ql));
        p.qh[h] = __ldg(reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(m.p1) + row * (m.cols / 4) + grp * 16 + 4 * t));
        p.s[h] = __ldg(static_cast<const uint16_t*>(m.p2) + row * (m.cols / 64) + grp);
    }
    return p;
}

// The q6_g64 kernels' body for batches of up to 8 * NT rows (header): the batch rows are B's
// columns, 8 per MMA tile, and every k16 step stays within one group.
template <int NT>
__device__ __forceinline__ void gemv_q6_mma_cols(const GemvArgs& a) {
    grid_release();
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tiles = (a.m.rows + 15) / 16, groups = a.m.cols / 64;
    const int stride = gridDim.x * 8;
    const int tile0 = blockIdx.x * 8 + (threadIdx.x >> 5);
    Q6Slice buf[Q6B_AHEAD];
    int ltile = tile0, lgrp = 0;  // the next load
    auto issue = [&](int i) {
        if (ltile < tiles) buf[i] = q6_slice_load(a.m, ltile, lgrp, g, t);
        if (++lgrp == groups) {
            lgrp = 0;
            ltile += stride;
        }
    };
#pragma unroll
    for (int i = 0; i < Q6B_AHEAD; ++i) issue(i);
    grid_wait();
    // B columns: x rows 8c + g (none past the batch: zeros).
    const bf16* xr[NT];
#pragma unroll
    for (int c = 0; c < NT; ++c) xr[c] = 8 * c + g < a.batch ? a.x + (size_t)(8 * c + g) * a.ldx + 16 * t : nullptr;
    float acc[NT][4];
#pragma unroll
    for (int c = 0; c < NT; ++c) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.f;
    for (int utile = tile0, ugrp = 0; utile < tiles;) {
#pragma unroll
        for (int i = 0; i < Q6B_AHEAD; ++i) {
            if (utile >= tiles) break;
            const Q6Slice cur = buf[i];
            issue(i);
            float d[NT][4];
#pragma unroll
            for (int c = 0; c < NT; ++c) d[c][0] = d[c][1] = d[c][2] = d[c][3] = 0.f;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                // Word j: columns 16t + 8j .. + 7 as (e0, e2), (e1, e3), (e4, e6), (e5, e7), two
                // k16 steps in the k order of the kernels above, x in the same order.
                uint32_t p0[4], p1[4];
                q6_pairs(j ? cur.ql[0].y : cur.ql[0].x, cur.qh[0], j, p0);
                q6_pairs(j ? cur.ql[1].y : cur.ql[1].x, cur.qh[1], j, p1);
#pragma unroll
                for (int c = 0; c < NT; ++c) {
                    const uint4 v = x8_mma_order(xr[c] ? ldg16(xr[c] + ugrp * 64 + 8 * j) : make_uint4(0u, 0u, 0u, 0u));
                    mma_bf16(d[c], p0[0], p1[0], p0[1], p1[1], v.x, v.y);
                    mma_bf16(d[c], p0[2], p1[2], p0[3], p1[3], v.z, v.w);
                }
            }
            // d: rows g (d0, d1) and g + 8 (d2, d3) of batch columns 8c + 2t, + 1: the group's sum.
            const float s0 = f16_bits_to_f(cur.s[0]), s1 = f16_bits_to_f(cur.s[1]);
            scale_add<NT>(acc, d, s0, s1);
            if (++ugrp == groups) {
#pragma unroll
                for (int c = 0; c < NT; ++c)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int row = utile * 16 + g + 8 * (r / 2), b = 8 * c + 2 * t + (r & 1);
                        if (row < a.m.rows && b < a.batch) store_out(a.y, (size_t)b * a.ldy + row, acc[c][r], a.out_f32, a.accumulate);
                        acc[c][r] = 0.f;
                    }
                ugrp = 0;
                utile += stride;
            }
        }
    }
}

#define NINFER_GEMV(name, Enc, NB)                                                   \
    extern "C" __global__ void __launch_bounds__(256) ninfer_gemv_##name##_b##NB(GemvArgs a) { \
        gemv_body<Enc, NB>(a);                                                       \
    }
#define NINFER_GEMV_ALL(name, Enc) \
    NINFER_GEMV(name, Enc, 1)      \
    NINFER_GEMV(name, Enc, 2)      \
    NINFER_GEMV(name, Enc, 4)      \
    NINFER_GEMV(name, Enc, 8)      \
    NINFER_GEMV(name, Enc, 16)
NINFER_GEMV(bf16, EncBf16, 1)
// U8: weight groups in flight per warp of 2-8 rows. Eight for q8_g32, where four left the
// 2,048-row output projections of a batched decode step (128 blocks: one per SM) far from the
// bandwidth (104 registers, two blocks per SM); four for bf16 (eight take 154 registers). Four
// of 9-16 rows: six (two blocks per SM still) was no faster (docs/performance-log.md).
#define NINFER_GEMV_MMA(name, M, U8)                                                                  \
    extern "C" __global__ void __launch_bounds__(256) ninfer_gemv_##name##_mma_b8(GemvArgs a) {    \
        mma_product<M, 1, U8, false, false>(a, a.x, a.ldx, [] {}, [](int) {}, [](int, int, float) {}); \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) ninfer_gemv_##name##_mma_b16(GemvArgs a) {   \
        mma_product<M, 2, 4, false, false>(a, a.x, a.ldx, [] {}, [](int) {}, [](int, int, float) {});  \
    }
NINFER_GEMV_MMA(bf16, MmaBf16, 4)
NINFER_GEMV_MMA(q8_g32, MmaQ8, 8)
NINFER_GEMV(q8_g32, EncQ8, 1)
// Two blocks per SM (at most 128 registers).
extern "C" __global__ void __launch_bounds__(256, 2) ninfer_gemv_q6_g64_mma_b2(GemvArgs a) { gemv_q6_mma_rows<1>(a); }
extern "C" __global__ void __launch_bounds__(256, 2) ninfer_gemv_q6_g64_mma_b4(GemvArgs a) { gemv_q6_mma_rows<2>(a); }
extern "C" __global__ void __launch_bounds__(256) ninfer_gemv_q6_g64_mma_b8(GemvArgs a) { gemv_q6_mma_cols<1>(a); }
extern "C" __global__ void __launch_bounds__(256) ninfer_gemv_q6_g64_mma_b16(GemvArgs a) { gemv_q6_mma_cols<2>(a); }
NINFER_GEMV_ALL(q4_g32, EncQ4)
NINFER_GEMV_ALL(nvfp4, EncNvfp4)

extern "C" __global__ void __launch_bounds__(BULK_THREADS) ninfer_gemv_q8_g32_bulk_b1(GemvArgs a) {
    bulk_product(a, [&](bf16* xs) { copy_row(xs, a.x, a.m.cols); }, [](int, float) {});
}

// A batch's x rows copied into the block's shared memory at NORM_LD(K) (thread i the chunks i,
// i + 256, ... of the rows laid end to end; a loop per row, as rows_to_f16 runs, spilled here).
template <int NT>
__device__ __forceinline__ void gemv_bulk_rows(const GemvArgs& a) {
    extern __shared__ __align__(16) bf16 xs_dyn[];
    const int k = a.m.cols, ld = NORM_LD(k), nch = k / 8;
    bulk_rows_product<NT>(
        a, xs_dyn, ld, bulk_align(a.batch * ld * 2),
        [&] {
            for (int i = threadIdx.x; i < a.batch * nch; i += BULK_THREADS) {
                const int b = i / nch, c = i - b * nch;
                *reinterpret_cast<uint4*>(xs_dyn + (size_t)b * ld + c * 8) = ldg16(a.x + (size_t)b * a.ldx + c * 8);
            }
        },
        [](int) {}, [](int, int, float) {});
}
extern "C" __global__ void __launch_bounds__(BULK_THREADS) ninfer_gemv_q8_g32_bulk_b8(GemvArgs a) { gemv_bulk_rows<1>(a); }
extern "C" __global__ void __launch_bounds__(BULK_THREADS) ninfer_gemv_q8_g32_bulk_b16(GemvArgs a) { gemv_bulk_rows<2>(a); }
