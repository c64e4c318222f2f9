// MoE expert gate/up of decode batches on the tensor cores (model-spec.md 2.5 steps 3-4): each
// expert the batch chose runs once, for every slot that chose it.
//
// ninfer_moe_gate_up_mma_nvfp4_b8 / _b16  (BankArgs, routed by the table: ids, logits null)
//   The contract of experts.cu's ninfer_moe_gate_up_nvfp4 for 2..8 (b8) or 2..16 (b16) tokens:
//   out[s, j] = bf16(bf16(silu(g)) * u), g = bf16(x[t] . W[e][j]), u = bf16(x[t] . W[e][I + j])
//   for slot s of token t and expert e = ids[s] (the shared expert for slots tokens*topk + t);
//   an id outside [0, E) gives a zero row. A token's ids must be distinct (as routing makes
//   them), so an expert has at most `tokens` slots: the columns of NT = NB / 8 MMA tiles.
//   Block (x, y) runs the 16-row tile pair y (gate rows 16y.., up rows I + 16y..) of an expert:
//   block x < tokens*topk is slot x, which runs its expert for every slot naming it if x is the
//   first of them and returns otherwise (its slot is a column of the first one's block); block
//   x == tokens*topk (has_shared) is the shared expert over every token's shared slot. The four
//   warps split K into blocks of 128 columns (warp w takes blocks w, w + 4, ...; lane 4g + t
//   loads columns 32t..32t+31 of a block for rows g and g + 8 of each tile, 16 bytes a row)
//   and sum their partials in shared memory in warp order. The slots are the B operand's
//   columns, 8 per MMA tile.
//   The MMA k order: the 8 columns of one code word (columns c0..c7) go into two k16 steps,
//   lane t's k pairs (2t, 2t+1) and (2t+8, 2t+9) holding columns (c0, c4), (c1, c5) in the
//   first and (c2, c6), (c3, c7) in the second, the same for A and B, so that a code word
//   shifted right by 4p gives the pair (c_p, c_p+4) without taking bytes apart.
//   Weights: a code decoded to bf16 bits with its magnitude bits on exponent bits 8-7 and
//   mantissa bit 6 and its sign on bit 15 is E2M1 * 2^-126 exactly (0.5 a subnormal); one
//   bf16x2 multiply by the E4M3 scale times 2^118 gives E2M1 * scale * 2^-8, exact in bf16
//   (at most 6 significant bits, at least 2^-18). x is bf16, so the MMA's products are exact in
//   its f32 sums; a row's sum is scaled by 2^8 and the global of its segment.
//   K (H) a multiple of 128, I a multiple of 16; every x row 16-byte aligned (ldx % 8 == 0).
//   Launch: block 128 (4 warps), grid (tokens*topk + has_shared, I / 16).
//
// Dependent launch (common.cuh): every block waits before it reads the ids (written by the
// routing launch ahead) and lets its dependents start only after that wait, as the per-slot
// gate_up does: the per-slot down after it reads the routing before its own wait (experts.cu).
#include "gemv.cuh"

#define MMA_EXPERT_WARPS 4
#define MMA_EXPERT_AHEAD 2  // column blocks of loads in flight per lane
#define MMA_EXPERT_MAX_TOKENS 16

// A lane's share of one 128-column block of a tile pair: the codes of rows g and g + 8 of the
// gate and up tiles (columns 32t..32t+31 of the block) and their two E4M3 scales.
struct PairPart {
    uint4 q[2][2];         // [gate, up][row g, g + 8]
    uint16_t s[2][2];      // the scale bytes of groups 2t, 2t + 1 of the block, by the same index
};

__device__ __forceinline__ PairPart pair_load(const Mat& m, int e, int j0, int blk, int g, int t) {
    PairPart p;
    const int inter = m.rows / 2;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const size_t r = (size_t)e * m.rows + u * inter + j0 + g + 8 * h;
            p.q[u][h] = ld_stream16(static_cast<const uint8_t*>(m.p0) + r * (m.cols / 2) + blk * 64 + 16 * t);
            p.s[u][h] = __ldg(reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(m.p1) + r * (m.cols / 16) + blk * 8 + 2 * t));
        }
    }
    return p;
}

// Codes p and p + 4 of a word as bf16x2 bits of E2M1 * 2^-126 (header).
__device__ __forceinline__ uint32_t e2m1_pair_bf16_tiny(uint32_t w, int p) {
    const uint32_t v = w >> (4 * p);
    return ((v << 6) & 0x01c001c0u) | ((v << 12) & 0x80008000u);
}

// An E4M3 scale byte times 2^118, as a bf16x2 pair (exact: 4 significant bits, 2^109..2^127).
__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t byte) {
    const uint32_t b = __bfloat16_as_ushort(f2bf(e4m3_to_f((uint8_t)byte) * 0x1p118f));
    return b | (b << 16);
}

// The MMAs of one 128-column block: for each code word i of the lane (columns 32t + 8i..), two
// k16 steps per tile and n tile; xr[n] is x at the block's columns 32t.. of column n's slot
// (null past the slot list: zeros).
template <int NT>
__device__ __forceinline__ void pair_block_mma(float (&d)[2][NT][4], const PairPart& w, const bf16* const (&xr)[NT]) {
    uint32_t sc[2][2][2];
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            sc[u][h][0] = scale_bf16x2(w.s[u][h] & 0xffu);
            sc[u][h][1] = scale_bf16x2(w.s[u][h] >> 8);
        }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint32_t bx[NT][4];  // (x0, x4), (x1, x5), (x2, x6), (x3, x7) of the word's columns
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const uint4 xv = xr[n] ? ldg16(xr[n] + 8 * i) : make_uint4(0u, 0u, 0u, 0u);
            const uint32_t x01 = xv.x, x23 = xv.y, x45 = xv.z, x67 = xv.w;
            bx[n][0] = __byte_perm(x01, x45, 0x5410);
            bx[n][1] = __byte_perm(x01, x45, 0x7632);
            bx[n][2] = __byte_perm(x23, x67, 0x5410);
            bx[n][3] = __byte_perm(x23, x67, 0x7632);
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const uint32_t w0 = u4_word(w.q[u][0], i), w1 = u4_word(w.q[u][1], i);
            const uint32_t s0 = sc[u][0][i / 2], s1 = sc[u][1][i / 2];
#pragma unroll
            for (int st = 0; st < 2; ++st) {
                const uint32_t a0 = bf16x2_mul(e2m1_pair_bf16_tiny(w0, 2 * st), s0);
                const uint32_t a1 = bf16x2_mul(e2m1_pair_bf16_tiny(w1, 2 * st), s1);
                const uint32_t a2 = bf16x2_mul(e2m1_pair_bf16_tiny(w0, 2 * st + 1), s0);
                const uint32_t a3 = bf16x2_mul(e2m1_pair_bf16_tiny(w1, 2 * st + 1), s1);
#pragma unroll
                for (int n = 0; n < NT; ++n) mma_bf16(d[u][n], a0, a1, a2, a3, bx[n][2 * st], bx[n][2 * st + 1]);
            }
        }
    }
}

// This block's expert and its slots, ascending, into `list` (the warp's own copy); returns
// how many, 0 when another block runs the expert, -1 for a slot whose id is outside [0, E).
__device__ __forceinline__ int expert_slots(const BankArgs& a, int lane, int* list, int& e) {
    const int routed = a.tokens * a.topk, x = blockIdx.x;
    if (x == routed) {  // the shared expert: every token's shared slot
        e = 0;
        if (lane < a.tokens) list[lane] = routed + lane;
        __syncwarp();
        return a.tokens;
    }
    e = __ldg(a.ids + x);
    if (e < 0 || e >= a.bank.experts) return -1;
    int n = 0;
    bool first = true;
    for (int base = 0; base < routed; base += 32) {
        const int s = base + lane;
        const bool hit = s < routed && __ldg(a.ids + s) == e;
        const unsigned mask = __ballot_sync(0xffffffffu, hit);
        first = first && __ballot_sync(0xffffffffu, hit && s < x) == 0u;
        const int pos = n + __popc(mask & ((1u << lane) - 1u));
        if (hit && pos < MMA_EXPERT_MAX_TOKENS) list[pos] = s;
        n += __popc(mask);
    }
    __syncwarp();
    return first ? min(n, MMA_EXPERT_MAX_TOKENS) : 0;
}

// The tile pair of the block over the expert's n slots (`list`), in NT MMA column tiles.
template <int NT>
__device__ __forceinline__ void gate_up_tiles(const BankArgs& a, const Mat& m, int e, const int* list, int n) {
    __shared__ float part[MMA_EXPERT_WARPS][2][NT][4][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int inter = m.rows / 2, blocks_k = m.cols / 128, j0 = 16 * blockIdx.y;
    bf16* out = static_cast<bf16*>(a.y);
    // B columns: this lane's slots 8c + g, their tokens' x rows (null past the list).
    const bf16* xr[NT];
#pragma unroll
    for (int c = 0; c < NT; ++c) {
        const int col = 8 * c + g;
        xr[c] = nullptr;
        if (col < n) {
            const int s = list[col], routed = a.tokens * a.topk;
            xr[c] = a.x + (size_t)(s < routed ? s / a.topk : s - routed) * a.ldx;
        }
    }
    // Warp w takes the column blocks w, w + 4, ...: all their loads in flight at once.
    PairPart buf[MMA_EXPERT_AHEAD];
#pragma unroll
    for (int i = 0; i < MMA_EXPERT_AHEAD; ++i) {
        const int blk = warp + MMA_EXPERT_WARPS * i;
        if (blk < blocks_k) buf[i] = pair_load(m, e, j0, blk, g, t);
    }
    float d[2][NT][4];
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int c = 0; c < NT; ++c) d[u][c][0] = d[u][c][1] = d[u][c][2] = d[u][c][3] = 0.f;
    for (int base = warp; base < blocks_k; base += MMA_EXPERT_WARPS * MMA_EXPERT_AHEAD) {
#pragma unroll
        for (int i = 0; i < MMA_EXPERT_AHEAD; ++i) {
            const int blk = base + MMA_EXPERT_WARPS * i;
            if (blk >= blocks_k) break;
            const PairPart cur = buf[i];
            const int next = blk + MMA_EXPERT_WARPS * MMA_EXPERT_AHEAD;
            if (next < blocks_k) buf[i] = pair_load(m, e, j0, next, g, t);
            const bf16* xb[NT];
#pragma unroll
            for (int c = 0; c < NT; ++c) xb[c] = xr[c] ? xr[c] + blk * 128 + 32 * t : nullptr;
            pair_block_mma<NT>(d, cur, xb);
        }
    }
    // The warps' partials summed in warp order by warp 0. C: d[u][c][0..1] are row g at
    // columns 8c + 2t, + 1; d[u][c][2..3] the same of row g + 8.
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int c = 0; c < NT; ++c)
#pragma unroll
            for (int r = 0; r < 4; ++r) part[warp][u][c][r][lane] = d[u][c][r];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int row = j0 + g + 8 * (r / 2);
        const float mg = row_multiplier<EncNvfp4>(m, e, row) * 256.f;
        const float mu = row_multiplier<EncNvfp4>(m, e, inter + row) * 256.f;
#pragma unroll
        for (int c = 0; c < NT; ++c) {
            const int col = 8 * c + 2 * t + (r & 1);
            if (col < n) {
                float gs = 0.f, us = 0.f;
#pragma unroll
                for (int w = 0; w < MMA_EXPERT_WARPS; ++w) {
                    gs += part[w][0][c][r][lane];
                    us += part[w][1][c][r][lane];
                }
                const float gv = round_bf(gs * mg), uv = round_bf(us * mu);
                out[(size_t)list[col] * inter + row] = f2bf(round_bf(silu(gv)) * uv);
            }
        }
    }
}

// MAX_NT column tiles at most; an expert of at most 8 slots runs one.
template <int MAX_NT>
__device__ __forceinline__ void gate_up_mma_body(const BankArgs& a) {
    __shared__ int lists[MMA_EXPERT_WARPS][MMA_EXPERT_MAX_TOKENS];
    grid_wait();
    grid_release();  // after the wait: down reads the routing before its own (header)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int* list = lists[warp];
    int e = 0;
    const int n = expert_slots(a, lane, list, e);
    const Mat& m = (int)blockIdx.x == a.tokens * a.topk ? a.shared : a.bank;
    if (n < 0) {  // an id outside [0, E): this slot's rows are zero
        if (threadIdx.x < 16) static_cast<bf16*>(a.y)[(size_t)blockIdx.x * (m.rows / 2) + 16 * blockIdx.y + threadIdx.x] = f2bf(0.f);
        return;
    }
    if (n == 0) return;
    if (MAX_NT == 1 || n <= 8)
        gate_up_tiles<1>(a, m, e, list, n);
    else
        gate_up_tiles<MAX_NT>(a, m, e, list, n);
}

// Four blocks per SM at 8 tokens (at most 128 registers), three at 16 (170), without spilling.
extern "C" __global__ void __launch_bounds__(MMA_EXPERT_WARPS * 32, 4) ninfer_moe_gate_up_mma_nvfp4_b8(BankArgs a) {
    gate_up_mma_body<1>(a);
}
extern "C" __global__ void __launch_bounds__(MMA_EXPERT_WARPS * 32, 3) ninfer_moe_gate_up_mma_nvfp4_b16(BankArgs a) {
    gate_up_mma_body<2>(a);
}
