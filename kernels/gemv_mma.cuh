// The tensor-core products of 2-16 rows (gemv.cu's ninfer_gemv_<enc>_mma_b<NB> contract:
// mma.m16n8k16, bf16 operands, f32 accumulation, one 16-row tile per block of 8 warps), shared
// by gemv.cu's plain kernels and fused.cu's normed ones: the weight groups in MMA order, one
// group's MMAs, and the product with its fill and epilogue hooks.
#pragma once
#include "gemv.cuh"

// Four int8 codes (a u32) to two bf16x2 pairs, exactly: bytes 0-1 into `lo`, 2-3 into `hi`.
__device__ __forceinline__ void i8x4_bf16(uint32_t w, uint32_t& lo, uint32_t& hi) {
    const uint32_t u = w ^ 0x80808080u;  // biased to 0..255, then 2^23 + b as f32 bits
    const float f0 = byte_to_f(u, 0, MAGIC_2P23 + 128.f), f1 = byte_to_f(u, 1, MAGIC_2P23 + 128.f);
    const float f2 = byte_to_f(u, 2, MAGIC_2P23 + 128.f), f3 = byte_to_f(u, 3, MAGIC_2P23 + 128.f);
    lo = pack_bf2(f0, f1);
    hi = pack_bf2(f2, f3);
}

#define MMA_WARPS 8

// A tile's weights (`bytes` from p, both multiples of 16) asked of L2 by the calling warp, lane l
// the 32 KiB pieces l, l + 32, ...
__device__ __forceinline__ void tile_prefetch(const void* p, uint32_t bytes, int lane) {
    constexpr uint32_t PIECE = 32768;
    for (uint32_t off = lane * PIECE; off < bytes; off += 32 * PIECE) prefetch_l2_bulk(static_cast<const char*>(p) + off, min(PIECE, bytes - off));
}

// One lane's share of a 32-column group, for the rows g and g + 8 of a 16-row tile (t = lane
// % 4): 8 contiguous elements of each row (columns 8t..8t+7 of the group) and the rows' scales.
// The MMA k order: in step s (0, 1) of a group, lane t's k indices 2t, 2t+1 are columns
// 8t+4s, 8t+4s+1 and 2t+8, 2t+9 are columns 8t+4s+2, 8t+4s+3, for A and B alike, so that each
// lane reads contiguous weights and x.
struct MmaQ8 {
    static constexpr bool SCALED = true;
    struct Group { uint2 q[2]; uint16_t s[2]; };
    __device__ static Group load(const Mat& m, int row0, int g, int t, int grp) {
        Group r;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            // Rows past the matrix read its last row; their outputs are not stored.
            const size_t row = min(row0 + g + 8 * h, m.rows - 1);
            const int8_t* q = static_cast<const int8_t*>(m.p0) + row * m.cols + grp * 32 + 8 * t;
            asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.q[h].x), "=r"(r.q[h].y) : "l"(q));
            r.s[h] = __ldg(static_cast<const uint16_t*>(m.p1) + row * (m.cols / 32) + grp);
        }
        return r;
    }
    // A of step st: rows g then g + 8, k pairs (2t, 2t+1) then (2t+8, 2t+9).
    __device__ static void a_regs(const Group& w, int st, uint32_t (&a)[4]) {
        i8x4_bf16(st ? w.q[0].y : w.q[0].x, a[0], a[2]);
        i8x4_bf16(st ? w.q[1].y : w.q[1].x, a[1], a[3]);
    }
    __device__ static float scale(const Group& w, int h) { return f16_bits_to_f(w.s[h]); }
    // The tile's codes (rows are contiguous: one range) and, when whole 16-byte lines, its scales.
    __device__ static void prefetch_tile(const Mat& m, int row0, int lane) {
        const uint32_t n = min(16, m.rows - row0);
        tile_prefetch(static_cast<const int8_t*>(m.p0) + (size_t)row0 * m.cols, n * m.cols, lane);
        const uint32_t sb = n * (m.cols / 16);
        if (lane == 0 && sb % 16 == 0) prefetch_l2_bulk(static_cast<const uint16_t*>(m.p1) + (size_t)row0 * (m.cols / 32), sb);
    }
};

struct MmaBf16 {
    static constexpr bool SCALED = false;
    struct Group { uint4 d[2]; };
    __device__ static Group load(const Mat& m, int row0, int g, int t, int grp) {
        Group r;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const size_t row = min(row0 + g + 8 * h, m.rows - 1);
            r.d[h] = ld_stream16(static_cast<const bf16*>(m.p0) + row * m.cols + grp * 32 + 8 * t);
        }
        return r;
    }
    __device__ static void a_regs(const Group& w, int st, uint32_t (&a)[4]) {
        a[0] = st ? w.d[0].z : w.d[0].x;
        a[2] = st ? w.d[0].w : w.d[0].y;
        a[1] = st ? w.d[1].z : w.d[1].x;
        a[3] = st ? w.d[1].w : w.d[1].y;
    }
    __device__ static float scale(const Group&, int) { return 1.f; }
    __device__ static void prefetch_tile(const Mat& m, int row0, int lane) {
        const uint32_t n = min(16, m.rows - row0);
        tile_prefetch(static_cast<const bf16*>(m.p0) + (size_t)row0 * m.cols, n * m.cols * 2, lane);
    }
};

// A group's MMA sums d (per n tile: rows g in d[0..1], g + 8 in d[2..3]) times their rows'
// scales s0 and s1, added into acc.
template <int NT>
__device__ __forceinline__ void scale_add(float (&acc)[NT][4], const float (&d)[NT][4], float s0, float s1) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        acc[n][0] = fmaf(d[n][0], s0, acc[n][0]);
        acc[n][1] = fmaf(d[n][1], s0, acc[n][1]);
        acc[n][2] = fmaf(d[n][2], s1, acc[n][2]);
        acc[n][3] = fmaf(d[n][3], s1, acc[n][3]);
    }
}

// A warp's sums into its slice of a 16-row tile's partials (row, batch slot): acc[n][0..1] are
// row g, slots 8n + 2t and 8n + 2t + 1; acc[n][2..3] the same of row g + 8.
template <int NT>
__device__ __forceinline__ void acc_to_part(float (&p)[16][8 * NT], const float (&acc)[NT][4], int g, int t) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        p[g][8 * n + 2 * t] = acc[n][0];
        p[g][8 * n + 2 * t + 1] = acc[n][1];
        p[g + 8][8 * n + 2 * t] = acc[n][2];
        p[g + 8][8 * n + 2 * t + 1] = acc[n][3];
    }
}

// One group: its two MMA steps summed from zero per n tile, then scaled per row into acc.
template <typename M, int NT>
__device__ __forceinline__ void group_mma(float (&acc)[NT][4], const typename M::Group& w, const uint4 (&xb)[NT]) {
    float d[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) d[n][0] = d[n][1] = d[n][2] = d[n][3] = 0.f;
#pragma unroll
    for (int st = 0; st < 2; ++st) {
        uint32_t a[4];
        M::a_regs(w, st, a);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const uint32_t b0 = st ? xb[n].z : xb[n].x, b1 = st ? xb[n].w : xb[n].y;
            mma_bf16(d[n], a[0], a[1], a[2], a[3], b0, b1);
        }
    }
    const float s0 = M::scale(w, 0), s1 = M::scale(w, 1);
    scale_add<NT>(acc, d, s0, s1);
}

// The tensor-core product of gemv.cu's ninfer_gemv_<enc>_mma_b<NB> contract over 8 * NT batch
// slots: block b takes the 16-row tile b, or with STREAM the tiles b, b + gridDim.x, ... Three hooks serve the fused products of fused.cu: after grid_wait()
// `fill()` runs once (with SMEM, it builds the batch's x rows in shared memory, read after a
// block barrier); `begin(tile)` runs as each tile starts, ahead of its weights' products; and
// after each output's store `epi(row, b, v)` runs with v, the f32 sum (before its rounding to
// y). B's x rows come from `x` with row stride `ldx`: global memory (through L1) or, with
// SMEM, shared memory. Each warp keeps U weight groups in flight. A block's next tile asks
// for its first weight groups before the current tile's sums are reduced and stored; with
// STREAM every tile of the block is asked of L2 before grid_wait(). (STREAM for the plain
// products cost registers enough to lose a resident block: q8_g32 of 2-8 rows 74 -> 116.)
template <typename M, int NT, int U, bool SMEM, bool STREAM, typename Fill, typename Begin, typename Epi>
__device__ __forceinline__ void mma_product(const GemvArgs& a, const bf16* x, int ldx, Fill fill, Begin begin, Epi epi) {
    __shared__ float part[MMA_WARPS][16][8 * NT];
    grid_release();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int groups = a.m.cols / 32, tiles = (a.m.rows + 15) / 16;
    typename M::Group w[U];
    const auto first_groups = [&](int tile) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int grp = warp + MMA_WARPS * u;
            if (grp < groups) w[u] = M::load(a.m, tile * 16, g, t, grp);
        }
    };
    first_groups(blockIdx.x);
    // The normed products (STREAM) build the batch's rows in every block before its first tile
    // (fused.cu): warp 0 asks L2 for all of the block's tiles first, so that the weights stream
    // while the rows are built.
    if (STREAM && warp == 0)
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) M::prefetch_tile(a.m, tile * 16, lane);
    grid_wait();
    fill();
    if (SMEM) __syncthreads();
    const auto run_tile = [&](int tile, int next) {
        const int row0 = tile * 16;
        begin(tile);
        float acc[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
        for (int base = warp; base < groups; base += MMA_WARPS * U) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int grp = base + MMA_WARPS * u;
                if (grp >= groups) break;
                const typename M::Group cur = w[u];
                const int next = grp + MMA_WARPS * U;
                if (next < groups) w[u] = M::load(a.m, row0, g, t, next);
                // B: x rows g (and 8 + g) at this lane's 8 columns; rows past the batch are zero.
                uint4 xb[NT];
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const int b = 8 * n + g;
                    const bf16* p = x + (size_t)b * ldx + grp * 32 + 8 * t;
                    xb[n] = b >= a.batch ? make_uint4(0, 0, 0, 0) : SMEM ? *reinterpret_cast<const uint4*>(p) : ldg16(p);
                }
                group_mma<M, NT>(acc, cur, xb);
            }
        }
        if (next < tiles) first_groups(next);
        acc_to_part<NT>(part[warp], acc, g, t);
        __syncthreads();
        for (int i = threadIdx.x; i < 16 * 8 * NT; i += blockDim.x) {
            const int r = i / (8 * NT), b = i - r * 8 * NT;
            if (row0 + r >= a.m.rows || b >= a.batch) continue;
            float sum = 0.f;
#pragma unroll
            for (int v = 0; v < MMA_WARPS; ++v) sum += part[v][r][b];
            store_out(a.y, (size_t)b * a.ldy + row0 + r, sum, a.out_f32, a.accumulate);
            epi(row0 + r, b, sum);
        }
    };
    if (!STREAM) {
        run_tile(blockIdx.x, tiles);
        return;
    }
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        run_tile(tile, tile + gridDim.x);
        // part is written again by the next tile.
        if (tile + gridDim.x < tiles) __syncthreads();
    }
}
