// MoE experts of decode batches on the tensor cores (model-spec.md 2.5 steps 3-5): each expert
// the batch chose runs once, for every slot that chose it; and one token's down, every slot of
// a 16-row tile in one block.
//
// ninfer_moe_gate_up_mma_nvfp4  (BankArgs, routed by the table: ids, logits null)
//   The contract of experts.cu's ninfer_moe_gate_up_nvfp4 for 1..16 tokens:
//   out[s, j] = bf16(bf16(silu(g)) * u), g = bf16(x[t] . W[e][j]), u = bf16(x[t] . W[e][I + j])
//   for slot s of token t and expert e = ids[s] (the shared expert for slots tokens*topk + t);
//   an id outside [0, E) gives a zero row. A token's ids must be distinct (as routing makes
//   them), so an expert has at most `tokens` slots: B's columns, 8 a pass (an expert of 9-16
//   slots runs two passes, the second reading its weights from L2).
//   Block (x, y) runs the 16-row tile pair y (gate rows 16y.., up rows I + 16y..) of an expert:
//   block x < tokens*topk is slot x, which runs its expert for every slot naming it if x is the
//   first of them and returns otherwise (its slot is a column of the first one's block); block
//   x == tokens*topk (has_shared) is the shared expert over every token's shared slot. The four
//   warps split K into blocks of 128 columns (warp w takes blocks w, w + 4, ...; lane 4g + t
//   loads columns 32t..32t+31 of a block for rows g and g + 8 of each tile, 16 bytes a row)
//   and sum their partials in shared memory in warp order.
//   The MMA k order: the 8 columns of one code word (columns c0..c7) go into two k16 steps,
//   lane t's k pairs (2t, 2t+1) and (2t+8, 2t+9) holding columns (c0, c1), (c2, c3) in the
//   first and (c4, c5), (c6, c7) in the second, the same for A and B: a code pair of the
//   device layout (common.cuh) and x's bf16 pair at the same columns.
//   Weights: a code pair of the device layout decodes to two bf16 of E2M1 * 2^-126 exactly
//   (0.5 a subnormal); one bf16x2 multiply by the E4M3 scale times 2^118 gives
//   E2M1 * scale * 2^-8, exact in bf16 (at most 6 significant bits, at least 2^-18). x is
//   bf16, so the MMA's products are exact in its f32 sums; a row's sum is scaled by 2^8 and
//   the global of its segment.
//   K (H) a multiple of 128, I a multiple of 16; every x row 16-byte aligned (ldx % 8 == 0).
//   Launch: block 128 (4 warps), grid (tokens*topk + has_shared, I / 16).
//   The weights' decoding and the MMA k order below are both kernels'.
//
// ninfer_moe_down_mma_nvfp4  (BankArgs, routed by the table; x: bf16 [S, ldx], the gate_up
//   output; y: f32 [S, ldy])
//   The contract of experts.cu's ninfer_moe_down_grouped_nvfp4 for 1..16 tokens: y[s, n] =
//   route_w[s] * (x[s] . W[e][n]) for every slot s whose expert e is in [0, E) (the shared
//   slots with the shared matrix); other slots' rows are not written (ninfer_moe_combine skips
//   them). Units as above: block (x, y) runs slot x's expert (or the shared one) for all its
//   slots, warp w the 16-row tiles y * 4 + w, + 4 * gridDim.y, ... of H over all of K = I
//   (I % 512 == 0), four 128-column blocks of loads in flight. Launch: block 128, grid
//   (tokens*topk + has_shared, at most H / 64): the launcher gives every warp one tile, so a
//   block whose slot runs its expert takes 64 rows (the blocks of the other slots return).
//
// ninfer_moe_down_one_nvfp4  (BankArgs, tokens == 1, routed by the table or from the logits)
//   experts.cu's ninfer_moe_down_nvfp4 for one token on the tensor cores: y[n] (+)= r[n], r[n]
//   = sum over the slots j (the routed ones, then the shared one) of w[j] * (in[j] . W[e_j][n]),
//   the routing as that kernel takes it (ids and route_w, or the logits, read before the wait).
//   Block b takes the rows [16 b, 16 b + 16) of H; its twelve warps take the (slot, 128-column
//   block) pairs w, w + 12, ... of the slots' K = I in slot-major order, three loaded at once
//   (a token's 36 pairs at top-8 + shared and I = 512 all before the wait), the token's x row
//   B's column 0 (the other columns zero). Each pair's MMA sums are scaled by 2^8, its slot's
//   weight and its rows' globals before they join the warp's f32 sums; the warps' sums are
//   added in warp order (deterministic; not the per-slot kernel's order), then stored as
//   store_out does (accumulate: bf16(y + bf16(r))). Slots whose id is outside [0, E) add
//   nothing. I % 128 == 0, H % 16 == 0. Launch: block 384, grid H / 16.
//   With half the blocks of the per-slot down (H / 16 against H / 8), it leaves room on the SMs
//   for the next layer's first launch, whose bulk copies then start earlier (decode trace,
//   performance-log.md).
//
// Dependent launch (common.cuh): every block waits before it reads the ids (written by the
// routing launch ahead) and lets its dependents start only after that wait, as the per-slot
// gate_up does: the per-slot down after it reads the routing before its own wait (experts.cu).
// The batch down kernel reads route_w and x, both from launches ahead, after its wait too;
// the one-token down reads the routing before its wait, as the per-slot one.
#include "gemv.cuh"
#include "route.cuh"

#define MMA_EXPERT_WARPS 4
#define MMA_EXPERT_AHEAD 2  // column blocks of loads in flight per lane
#define MMA_EXPERT_MAX_TOKENS 16

// A lane's share of one 128-column block of a 16-row tile: the codes of rows g and g + 8
// (columns 32t..32t+31 of the block) and their scale bytes (groups 2t, 2t + 1 of the block).
struct TilePart {
    uint4 q[2];
    uint16_t s[2];
};

__device__ __forceinline__ TilePart tile_load(const Mat& m, int e, int row0, int blk, int g, int t) {
    TilePart p;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const size_t r = (size_t)e * m.rows + row0 + g + 8 * h;
        p.q[h] = ld_stream16(static_cast<const uint8_t*>(m.p0) + r * (m.cols / 2) + blk * 64 + 16 * t);
        p.s[h] = __ldg(reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(m.p1) + r * (m.cols / 16) + blk * 8 + 2 * t));
    }
    return p;
}

// The MMAs of one 128-column block of U tiles over the same B: for each code word i of the
// lane (columns 32t + 8i..), two k16 steps per tile; xr is x at the block's columns 32t.. of
// the lane's B column (null past the slot list: zeros).
template <int U>
__device__ __forceinline__ void block_mma(float (&d)[U][4], const TilePart (&w)[U], const bf16* xr) {
    uint32_t sc[U][2][2];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            sc[u][h][0] = nvfp4_scale_bf16x2(w[u].s[h] & 0xffu);
            sc[u][h][1] = nvfp4_scale_bf16x2(w[u].s[h] >> 8);
        }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        // x's columns c0..c7 of the word: (x0, x1), (x2, x3), (x4, x5), (x6, x7).
        const uint4 xv = xr ? ldg16(xr + 8 * i) : make_uint4(0u, 0u, 0u, 0u);
        const uint32_t bx[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const uint32_t w0 = u4_word(w[u].q[0], i), w1 = u4_word(w[u].q[1], i);
            const uint32_t s0 = sc[u][0][i / 2], s1 = sc[u][1][i / 2];
#pragma unroll
            for (int st = 0; st < 2; ++st) {
                const uint32_t a0 = bf16x2_mul(nvfp4_pair(w0, 2 * st), s0);
                const uint32_t a1 = bf16x2_mul(nvfp4_pair(w1, 2 * st), s1);
                const uint32_t a2 = bf16x2_mul(nvfp4_pair(w0, 2 * st + 1), s0);
                const uint32_t a3 = bf16x2_mul(nvfp4_pair(w1, 2 * st + 1), s1);
                mma_bf16(d[u], a0, a1, a2, a3, bx[2 * st], bx[2 * st + 1]);
            }
        }
    }
}

#define SLOT_ID_LOADS 4  // ids a lane loads at once while listing an expert's slots

// This block's expert: 0 for the shared block, -1 for a slot whose id is outside [0, E).
__device__ __forceinline__ int block_expert(const BankArgs& a) {
    const int routed = a.tokens * a.topk, x = blockIdx.x;
    if (x == routed) return 0;
    const int e = __ldg(a.ids + x);
    return e < 0 || e >= a.bank.experts ? -1 : e;
}

// The slots of this block's expert e, ascending, into `list` (the warp's own copy); returns
// how many, 0 when an earlier slot's block runs the expert. The ids are loaded SLOT_ID_LOADS
// a lane at a time, so a list of up to 32 * SLOT_ID_LOADS slots costs one round trip.
__device__ __forceinline__ int expert_slots(const BankArgs& a, int e, int lane, int* list) {
    const int routed = a.tokens * a.topk, x = blockIdx.x;
    if (x == routed) {  // the shared expert: every token's shared slot
        if (lane < a.tokens) list[lane] = routed + lane;
        __syncwarp();
        return a.tokens;
    }
    int n = 0;
    bool first = true;
    for (int base = 0; base < routed; base += 32 * SLOT_ID_LOADS) {
        int id[SLOT_ID_LOADS];
#pragma unroll
        for (int k = 0; k < SLOT_ID_LOADS; ++k) {
            const int s = base + 32 * k + lane;
            id[k] = s < routed ? __ldg(a.ids + s) : -1;
        }
#pragma unroll
        for (int k = 0; k < SLOT_ID_LOADS; ++k) {
            const int s = base + 32 * k + lane;
            const bool hit = id[k] == e;
            const unsigned mask = __ballot_sync(0xffffffffu, hit);
            first = first && __ballot_sync(0xffffffffu, hit && s < x) == 0u;
            const int pos = n + __popc(mask & ((1u << lane) - 1u));
            if (hit && pos < MMA_EXPERT_MAX_TOKENS) list[pos] = s;
            n += __popc(mask);
        }
    }
    __syncwarp();
    return first ? min(n, MMA_EXPERT_MAX_TOKENS) : 0;
}

// The first MMA_EXPERT_AHEAD column blocks of the warp's loads of the block's tile pair.
struct GateUpLoads {
    TilePart buf[MMA_EXPERT_AHEAD][2];
    __device__ __forceinline__ void load(const Mat& m, int e, int i, int blk) {
        const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3, j0 = 16 * blockIdx.y;
        buf[i][0] = tile_load(m, e, j0, blk, g, t);
        buf[i][1] = tile_load(m, e, m.rows / 2 + j0, blk, g, t);
    }
    __device__ __forceinline__ void start(const Mat& m, int e) {
        const int warp = threadIdx.x >> 5;
#pragma unroll
        for (int i = 0; i < MMA_EXPERT_AHEAD; ++i) {
            const int blk = warp + MMA_EXPERT_WARPS * i;
            if (blk < m.cols / 128) load(m, e, i, blk);
        }
    }
};

// The tile pair of the block over n <= 8 of the expert's slots (`list`), one MMA column each,
// its first loads issued by `ld.start`.
__device__ __forceinline__ void gate_up_tiles(const BankArgs& a, const Mat& m, int e, const int* list, int n, GateUpLoads& ld) {
    __shared__ float part[MMA_EXPERT_WARPS][2][4][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int inter = m.rows / 2, blocks_k = m.cols / 128, j0 = 16 * blockIdx.y;
    bf16* out = static_cast<bf16*>(a.y);
    // B column g: its slot's token's x row (null past the list).
    const int routed = a.tokens * a.topk;
    const bf16* xr = nullptr;
    if (g < n) {
        const int s = list[g];
        xr = a.x + (size_t)(s < routed ? s / a.topk : s - routed) * a.ldx;
    }
    // Warp w takes the column blocks w, w + 4, ..., MMA_EXPERT_AHEAD of them in flight.
    float d[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    for (int base = warp; base < blocks_k; base += MMA_EXPERT_WARPS * MMA_EXPERT_AHEAD) {
#pragma unroll
        for (int i = 0; i < MMA_EXPERT_AHEAD; ++i) {
            const int blk = base + MMA_EXPERT_WARPS * i;
            if (blk >= blocks_k) break;
            // Used, then reloaded: no copy of the block held beside the loads in flight.
            block_mma<2>(d, ld.buf[i], xr ? xr + blk * 128 + 32 * t : nullptr);
            const int next = blk + MMA_EXPERT_WARPS * MMA_EXPERT_AHEAD;
            if (next < blocks_k) ld.load(m, e, i, next);
        }
    }
    // The warps' partials summed in warp order by warp 0. C: d[u][0..1] are row g at columns
    // 2t, 2t + 1; d[u][2..3] the same of row g + 8.
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int r = 0; r < 4; ++r) part[warp][u][r][lane] = d[u][r];
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = j0 + g + 8 * (r / 2), col = 2 * t + (r & 1);
            if (col < n) {
                float gs = 0.f, us = 0.f;
#pragma unroll
                for (int w = 0; w < MMA_EXPERT_WARPS; ++w) {
                    gs += part[w][0][r][lane];
                    us += part[w][1][r][lane];
                }
                const float gv = round_bf(gs * row_multiplier<EncNvfp4>(m, e, row) * 256.f);
                const float uv = round_bf(us * row_multiplier<EncNvfp4>(m, e, inter + row) * 256.f);
                out[(size_t)list[col] * inter + row] = f2bf(round_bf(silu(gv)) * uv);
            }
        }
    }
    __syncthreads();  // `part` is the next call's
}

// After the wait, this block's expert (block_expert), its first weights (`ld.start(m, e)`),
// then its slots (expert_slots), and `pass(m, e, list, count)` over them 8 at a time (an
// expert's second pass reads its weights from L2); returns the slot count, -1 for a slot whose
// id is outside [0, E). Both kernels' blocks start here. The weights are asked for before the
// slots are listed, so the list's round trip overlaps theirs; a block whose expert an earlier
// slot's block runs has asked for the same weights as that block, mostly at the same time.
template <typename Loads, typename Pass>
__device__ __forceinline__ int expert_passes(const BankArgs& a, Loads& ld, Pass pass) {
    __shared__ int lists[MMA_EXPERT_WARPS][MMA_EXPERT_MAX_TOKENS];
    grid_wait();
    grid_release();  // after the wait: the per-slot down reads the routing before its own (header)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int* list = lists[warp];
    const int e = block_expert(a);
    if (e < 0) return -1;
    const Mat& m = (int)blockIdx.x == a.tokens * a.topk ? a.shared : a.bank;
    ld.start(m, e);
    const int n = expert_slots(a, e, lane, list);
    for (int c0 = 0; c0 < n; c0 += 8) {
        if (c0 > 0) ld.start(m, e);
        pass(m, e, list + c0, min(n - c0, 8));
    }
    return n;
}

__device__ __forceinline__ void gate_up_mma_body(const BankArgs& a) {
    GateUpLoads ld;
    const int n = expert_passes(a, ld, [&](const Mat& m, int e, const int* list, int count) { gate_up_tiles(a, m, e, list, count, ld); });
    // An id outside [0, E): this slot's rows are zero.
    if (n < 0 && threadIdx.x < 16)
        static_cast<bf16*>(a.y)[(size_t)blockIdx.x * (a.bank.rows / 2) + 16 * blockIdx.y + threadIdx.x] = f2bf(0.f);
}

// Four 128-column blocks of loads of one of the warp's down tiles; `start` asks for the first.
struct DownLoads {
    TilePart w[4][1];
    __device__ __forceinline__ void load(const Mat& m, int e, int p, int b0) {
        const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i][0] = tile_load(m, e, 16 * p, b0 + i, g, t);
    }
    __device__ __forceinline__ void start(const Mat& m, int e) {
        const int p = blockIdx.y * MMA_EXPERT_WARPS + (threadIdx.x >> 5);
        if (p < m.rows / 16) load(m, e, p, 0);
    }
};

// The down bank's 16-row tiles of this warp (tiles blockIdx.y * 4 + warp, + 4 * gridDim.y, ...)
// over n <= 8 of the expert's slots (`list`), one MMA column each, all of K = I (a multiple of
// 512) in blocks of 128 columns, four of them in flight, the first four asked for by
// `ld.start`: part[slot, row] = route_w[slot] * (x[slot] . W[e][row]).
__device__ __forceinline__ void down_tiles(const BankArgs& a, const Mat& m, int e, const int* list, int n, DownLoads& ld) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tiles = m.rows / 16, blocks_k = m.cols / 128;
    float* out = static_cast<float*>(a.y);
    const bf16* xr = g < n ? a.x + (size_t)list[g] * a.ldx + 32 * t : nullptr;
    bool preloaded = true;  // the warp's first four blocks, by ld.start
    for (int p = blockIdx.y * MMA_EXPERT_WARPS + warp; p < tiles; p += MMA_EXPERT_WARPS * gridDim.y) {
        float d[1][4] = {{0.f, 0.f, 0.f, 0.f}};
        for (int b0 = 0; b0 < blocks_k; b0 += 4) {
            if (!preloaded) ld.load(m, e, p, b0);
            preloaded = false;
#pragma unroll
            for (int i = 0; i < 4; ++i) block_mma<1>(d, ld.w[i], xr ? xr + (b0 + i) * 128 : nullptr);
        }
        // C: d[0][0..1] are row g at columns 2t, 2t + 1; d[0][2..3] the same of row g + 8.
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = 16 * p + g + 8 * (r / 2), col = 2 * t + (r & 1);
            if (col < n) {
                const int slot = list[col];
                out[(size_t)slot * a.ldy + row] = __ldg(a.route_w + slot) * (row_multiplier<EncNvfp4>(m, e, row) * 256.f) * d[0][r];
            }
        }
    }
}

__device__ __forceinline__ void down_mma_body(const BankArgs& a) {
    DownLoads ld;
    expert_passes(a, ld, [&](const Mat& m, int e, const int* list, int count) { down_tiles(a, m, e, list, count, ld); });
}

// Five blocks per SM (at most 102 registers; 94 used, no spill).
extern "C" __global__ void __launch_bounds__(MMA_EXPERT_WARPS * 32, 5) ninfer_moe_gate_up_mma_nvfp4(BankArgs a) {
    gate_up_mma_body(a);
}
// Six blocks per SM (at most 80 registers, no spill). At 16 tokens the running
// blocks (one per chosen expert and 64 rows) take more than one wave; fewer blocks of two or
// four tiles a warp, in one wave, were slower (launcher, experts.rs).
extern "C" __global__ void __launch_bounds__(MMA_EXPERT_WARPS * 32, 6) ninfer_moe_down_mma_nvfp4(BankArgs a) {
    down_mma_body(a);
}

#define ONE_DOWN_WARPS 12  // a token's 9 x 4 (slot, column block) pairs at I = 512: 3 a warp
#define ONE_PAIRS 3        // pairs a down warp loads at once

// Rows [16 blockIdx.x, + 16) of one token's down over every slot (header).
__device__ __forceinline__ void down_one_body(const BankArgs& a) {
    __shared__ int id[DOWN_MAX_SLOTS];
    __shared__ float w[DOWN_MAX_SLOTS];
    __shared__ float part[ONE_DOWN_WARPS][16];
    grid_release();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = 16 * blockIdx.x;
    token_routing(a, 0, id, w);
    const int kb = a.bank.cols / 128, total = (a.topk + (a.has_shared ? 1 : 0)) * kb;
    // Pair idx's slot, its expert (0 for the shared slot) and whether it runs.
    auto pair = [&](int idx, int& slot, int& e) {
        slot = idx / kb;
        e = slot >= a.topk ? 0 : id[slot];
        return idx < total && e >= 0 && e < (slot >= a.topk ? a.shared : a.bank).experts;
    };
    TilePart p[ONE_PAIRS];
    auto load = [&](int base) {
#pragma unroll
        for (int k = 0; k < ONE_PAIRS; ++k) {
            const int idx = base + ONE_DOWN_WARPS * k;
            int slot, e;
            if (pair(idx, slot, e)) p[k] = tile_load(slot >= a.topk ? a.shared : a.bank, e, row0, idx - slot * kb, g, t);
        }
    };
    float acc_lo = 0.f, acc_hi = 0.f;  // rows g and g + 8 at B column 2t (column 0: the token)
    load(warp);
    grid_wait();
    for (int base = warp;;) {
#pragma unroll
        for (int k = 0; k < ONE_PAIRS; ++k) {
            const int idx = base + ONE_DOWN_WARPS * k;
            int slot, e;
            if (!pair(idx, slot, e)) continue;
            const Mat& m = slot >= a.topk ? a.shared : a.bank;
            const int blk = idx - slot * kb;
            const bf16* xr = g == 0 ? a.x + (size_t)slot * a.ldx + blk * 128 + 32 * t : nullptr;
            float d[1][4] = {{0.f, 0.f, 0.f, 0.f}};
            const TilePart tp[1] = {p[k]};
            block_mma<1>(d, tp, xr);
            const float ws = w[slot] * 256.f;
            acc_lo += d[0][0] * (ws * row_multiplier<EncNvfp4>(m, e, row0 + g));
            acc_hi += d[0][2] * (ws * row_multiplier<EncNvfp4>(m, e, row0 + g + 8));
        }
        base += ONE_DOWN_WARPS * ONE_PAIRS;
        if (base >= total) break;
        load(base);
    }
    if (t == 0) {
        part[warp][g] = acc_lo;
        part[warp][g + 8] = acc_hi;
    }
    __syncthreads();
    if (threadIdx.x < 16) {
        float r = 0.f;
#pragma unroll
        for (int v = 0; v < ONE_DOWN_WARPS; ++v) r += part[v][threadIdx.x];
        store_out(a.y, row0 + threadIdx.x, r, a.out_f32, a.accumulate);
    }
}

// Two blocks per SM (at most 85 registers; 80 used, no spill).
extern "C" __global__ void __launch_bounds__(ONE_DOWN_WARPS * 32, 2) ninfer_moe_down_one_nvfp4(BankArgs a) { down_one_body(a); }
