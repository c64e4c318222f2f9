// MoE experts (model-spec.md 2.5 steps 3-5): per slot for decode, every encoding; grouped by
// expert for prompt passes, NVFP4 banks on the tensor cores. (One token's down of an NVFP4
// bank runs experts_batch.cu's ninfer_moe_down_one_nvfp4, which takes this file's contract.)
//
// The per-slot kernels run one matrix-vector product per (token, expert) pair, with gemv.cu's
// row machinery (gemv.cuh), and so read an expert's rows once per token that chose it:
//
// ninfer_moe_gate_up_<enc>
//   For slot s < tokens*topk: token t = s / topk, expert e = ids[s]; for the optional shared
//   slots s = tokens*topk + t the shared matrix is used instead. Bank rows 0..I-1 are the gate,
//   I..2I-1 the up projection ([E, 2I, H] as stored), so m.rows = 2I.
//   g = bf16(x[t] . W[e][j]), u = bf16(x[t] . W[e][I + j]),
//   out[s, j] = bf16(bf16(silu(g)) * u)   (transformers' bf16 roundings), out dense [S, I].
//   An id outside [0, E) gives a zero row. Launch: block 128 (GATE_UP_WARPS warps, a row j
//   each), grid (S, ceil(I / 4)) (slots on x: a prompt pass of T tokens has T * (topk + 1) of
//   them, more than grid y's 65,535).
//
// ninfer_moe_down_<enc>
//   r[t, n] = sum_{j<topk} w[t*topk+j] * (in[t*topk+j] . W[ids[t*topk+j]][n])
//             + (shared ? w[tokens*topk + t] * (in[tokens*topk + t] . S[n]) : 0)
//   in: bf16 [S, ldx] (the gate_up output), w: f32 routing weights per slot (the shared slot's
//   weight is its sigmoid gate). y[t, n] = r (accumulate = 0) or y + r (accumulate = 1; for bf16
//   y = bf16(y + bf16(r)), the residual add in the model dtype). Each output is produced by one
//   warp (no atomics), so results are deterministic. topk <= 32: a block keeps its token's
//   routing in shared memory. Launch: block 256, grid (tokens, ceil(H / 8)).
//
// Routed from the logits (BankArgs::logits non-null, tokens == 1): both kernels take slot j's
//   expert and weight from ninfer_moe_route's picks of the one token's logits row [E (+ 1)]
//   (route.cuh: warp 0 of every block routes, the block reads its picks from shared memory;
//   the shared slot's weight is the sigmoid of logit E; gate_up takes only its slot's expert),
//   and read neither ids nor route_w.
//   Each block routing for itself spares a router launch the wait for its last block (a
//   fence, a counter and a second round trip). A router folded into the output projection
//   (fused.cu's _route_b1 kernels) has that last block anyway: it routes there, and these
//   kernels read its ids and route_w.
//
// Dependent launch (common.cuh): gate_up's routed slots wait first (their experts are data
// written by the kernel ahead), its shared slots load first; gate_up lets its dependents start
// only after its own grid_wait(), so once a down block runs the routing that gate_up waited
// for is complete, and down reads the routing (ids and weights, or the logits) and loads its
// first weights before its grid_wait() (the exception to common.cuh's rule: down's routing
// comes from the kernel two launches back, never from gate_up). Down must therefore follow
// gate_up, or a launch that is not dependent (ids copied from the host, a timing event in
// between).
//
// The grouped kernels: a block owns one expert's 16-row tile and runs it over every token that
// chose the expert, 8 tokens per MMA.
//
// Slot numbering is the per-slot kernels': routed slot s = t*topk + j uses expert ids[s] on
// token t; with has_shared, slot tokens*topk + t is token t's shared-expert slot. A block of
// expert e lists its slots in increasing order (the shared "expert" e = E lists all shared
// slots); ids outside [0, E) are in no list.
//
// Weights: a code pair of the device layout (common.cuh) decodes to E2M1 * 2^-126 in bf16, and
// one bf16x2 multiply by the E4M3 block scale times 2^118 gives E2M1 * scale * 2^-8, exact in
// bf16 (at most 6 significant bits, at least 2^-18), so the A operand holds the dequantized
// weights of format.md 3.5 times 2^-8 exactly; 2^8 and the per-row global multiply the f32
// sum. x and the gate_up output are bf16: every product is exact.
//
// ninfer_moe_gate_up_grouped_nvfp4 (BankArgs; y: bf16 [S, I])
//   For every listed slot s of expert e: g = bf16(x[t] . W[e][j]), u = bf16(x[t] . W[e][I + j]),
//   y[s, j] = bf16(bf16(silu(g)) * u): ninfer_moe_gate_up_nvfp4's output, for the slots listed.
//   Launch: block 256, grid (E + has_shared, I / 16).
//
// ninfer_moe_down_grouped_nvfp4 (BankArgs; x: bf16 [S, I], the gate_up output; y: f32 [S, H])
//   For every listed slot s: y[s, n] = route_w[s] * (x[s] . W[e][n]), the slot's weighted
//   contribution. Launch: block 256, grid (E + has_shared, H / 16).
//
// ninfer_moe_combine (CombineArgs; part: f32 [S, H], the down kernel's output; y: bf16
//   [tokens, ldy], the residual)
//   y[t, n] = bf16(y[t, n] + bf16(sum_j part[t*topk + j, n] + part[tokens*topk + t, n])), the
//   routed slots in order j, then the shared slot; slots whose id is outside [0, E) add
//   nothing. Launch: block 256, grid (tokens, ceil(dim / 256)) (or fewer on y: blocks stride).
//
// A token's topk ids are distinct (as routing makes them), so an expert lists at most `tokens`
// slots. Limits (checked by the launchers): tokens <= 1024; the MMA's K (H for gate_up, I for down)
// a multiple of 32 and at most 2048; the tiles' rows (I, H) multiples of 16.
//
// The eight warps of a block split K into 32-column groups (warp w takes groups w, w+8, ...,
// at most 8 each, kept as codes in registers across the token tiles) and sum their partials in
// shared memory in warp order, so every output is deterministic.
#include "gemv.cuh"
#include "route.cuh"

#define GROUP_WARPS 8
#define GROUP_MAX_K_GROUPS 8
#define GROUP_MAX_TOKENS 1024

// One row's share of a lane in a 32-column group: codes of columns 8t..8t+7 (4 bytes, device
// layout) and their E4M3 scale times 2^118 as a bf16x2 pair (nvfp4_scale_bf16x2).
struct Fp4Part {
    uint32_t q;
    uint32_t sc;
};

__device__ __forceinline__ Fp4Part load_part(const Mat& m, int e, int row, int grp, int t) {
    const size_t r = (size_t)e * m.rows + row;
    Fp4Part p;
    p.q = __ldg(reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(m.p0) + r * (m.cols / 2) + grp * 16 + 4 * t));
    p.sc = nvfp4_scale_bf16x2(__ldg(static_cast<const uint8_t*>(m.p1) + r * (m.cols / 16) + grp * 2 + t / 2));
    return p;
}

// The MMA k order of gemv.cu's tensor-core kernels: step st of a group takes columns
// 8t+4st..8t+4st+3 of lane t (k pairs 2t, 2t+1 and 2t+8, 2t+9), for A and B alike.
__device__ __forceinline__ void tile_mma(float (&d)[4], const Fp4Part& lo, const Fp4Part& hi, uint4 xb) {
#pragma unroll
    for (int st = 0; st < 2; ++st) {
        const uint32_t a0 = bf16x2_mul(nvfp4_pair(lo.q, 2 * st), lo.sc);
        const uint32_t a1 = bf16x2_mul(nvfp4_pair(hi.q, 2 * st), hi.sc);
        const uint32_t a2 = bf16x2_mul(nvfp4_pair(lo.q, 2 * st + 1), lo.sc);
        const uint32_t a3 = bf16x2_mul(nvfp4_pair(hi.q, 2 * st + 1), hi.sc);
        mma_bf16(d, a0, a1, a2, a3, st ? xb.z : xb.x, st ? xb.w : xb.y);
    }
}

// The block's slots, ascending, into `list`; returns how many.
__device__ __forceinline__ int list_slots(const BankArgs& a, int e, int experts, int* list) {
    __shared__ int warp_n[GROUP_WARPS];
    const int routed = a.tokens * a.topk;
    if (e == experts) {  // the shared expert: every token's shared slot
        for (int i = threadIdx.x; i < a.tokens; i += blockDim.x) list[i] = routed + i;
        __syncthreads();
        return a.tokens;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int n = 0;
    for (int base = 0; base < routed; base += blockDim.x) {
        const int s = base + threadIdx.x;
        const bool hit = s < routed && __ldg(a.ids + s) == e;
        const unsigned mask = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) warp_n[warp] = __popc(mask);
        __syncthreads();
        int before = n;
        for (int w = 0; w < warp; ++w) before += warp_n[w];
        const int pos = before + __popc(mask & ((1u << lane) - 1u));
        if (hit && pos < GROUP_MAX_TOKENS) list[pos] = s;
        for (int w = 0; w < GROUP_WARPS; ++w) n += warp_n[w];
        __syncthreads();
    }
    return min(n, GROUP_MAX_TOKENS);
}

// The expert of this block (blockIdx.x; E is the shared expert), its matrix and its slots.
struct ExpertBlock {
    Mat m;
    int e;  // the expert's index in m
    int n;  // slots listed
};

__device__ __forceinline__ ExpertBlock expert_block(const BankArgs& a, int* list) {
    const int experts = a.bank.experts;
    const bool shared = (int)blockIdx.x == experts;
    return {shared ? a.shared : a.bank, shared ? 0 : (int)blockIdx.x, list_slots(a, blockIdx.x, experts, list)};
}

// One expert's 16-row tiles (TILES of them: gate and up rows, or the down rows) over all its
// slots, 8 at a time; `emit(tile sums, row, slot)` gets each output's f32 sums (unscaled).
template <int TILES, typename Emit>
__device__ __forceinline__ void grouped_tiles(const BankArgs& a, const Mat& m, int e_mat, const int (&row0)[TILES],
                                              const int* list, int n, bool x_by_token, Emit emit) {
    __shared__ float part[GROUP_WARPS][TILES][16][8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int groups = m.cols / 32;
    // This warp's groups of the tiles' rows g and g + 8, loaded once.
    Fp4Part w[GROUP_MAX_K_GROUPS][TILES][2];
#pragma unroll
    for (int i = 0; i < GROUP_MAX_K_GROUPS; ++i) {
        const int grp = warp + GROUP_WARPS * i;
        if (grp < groups) {
#pragma unroll
            for (int k = 0; k < TILES; ++k) {
                w[i][k][0] = load_part(m, e_mat, row0[k] + g, grp, t);
                w[i][k][1] = load_part(m, e_mat, row0[k] + g + 8, grp, t);
            }
        }
    }
    for (int c0 = 0; c0 < n; c0 += 8) {
        // B column g: the activation row of slot list[c0 + g] (zero past the list).
        const int slot = c0 + g < n ? list[c0 + g] : -1;
        const int row = slot < 0 ? 0 : (x_by_token ? (slot < a.tokens * a.topk ? slot / a.topk : slot - a.tokens * a.topk) : slot);
        const bf16* xr = a.x + (size_t)row * a.ldx;
        float d[TILES][4];
#pragma unroll
        for (int k = 0; k < TILES; ++k) d[k][0] = d[k][1] = d[k][2] = d[k][3] = 0.f;
#pragma unroll
        for (int i = 0; i < GROUP_MAX_K_GROUPS; ++i) {
            const int grp = warp + GROUP_WARPS * i;
            if (grp < groups) {
                const uint4 xb = slot < 0 ? make_uint4(0, 0, 0, 0) : ldg16(xr + grp * 32 + 8 * t);
#pragma unroll
                for (int k = 0; k < TILES; ++k) tile_mma(d[k], w[i][k][0], w[i][k][1], xb);
            }
        }
#pragma unroll
        for (int k = 0; k < TILES; ++k) {
            part[warp][k][g][2 * t] = d[k][0];
            part[warp][k][g][2 * t + 1] = d[k][1];
            part[warp][k][g + 8][2 * t] = d[k][2];
            part[warp][k][g + 8][2 * t + 1] = d[k][3];
        }
        __syncthreads();
        if (threadIdx.x < 128) {
            const int r = threadIdx.x >> 3, c = threadIdx.x & 7;
            if (c0 + c < n) {
                float sum[TILES];
#pragma unroll
                for (int k = 0; k < TILES; ++k) {
                    sum[k] = 0.f;
#pragma unroll
                    for (int v = 0; v < GROUP_WARPS; ++v) sum[k] += part[v][k][r][c];
                }
                emit(sum, r, list[c0 + c]);
            }
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(256) ninfer_moe_gate_up_grouped_nvfp4(BankArgs a) {
    __shared__ int list[GROUP_MAX_TOKENS];
    grid_release();
    grid_wait();
    const ExpertBlock b = expert_block(a, list);
    if (b.n == 0) return;
    const Mat& m = b.m;
    const int e_mat = b.e, inter = m.rows / 2, j0 = blockIdx.y * 16;
    const int rows[2] = {j0, inter + j0};
    bf16* out = static_cast<bf16*>(a.y);
    grouped_tiles<2>(a, m, e_mat, rows, list, b.n, true, [&](const float (&sum)[2], int r, int slot) {
        const float gv = round_bf(sum[0] * (row_multiplier<EncNvfp4>(m, e_mat, j0 + r) * 256.f));
        const float uv = round_bf(sum[1] * (row_multiplier<EncNvfp4>(m, e_mat, inter + j0 + r) * 256.f));
        out[(size_t)slot * inter + j0 + r] = f2bf(round_bf(silu(gv)) * uv);
    });
}

extern "C" __global__ void __launch_bounds__(256) ninfer_moe_down_grouped_nvfp4(BankArgs a) {
    __shared__ int list[GROUP_MAX_TOKENS];
    grid_release();
    grid_wait();
    const ExpertBlock b = expert_block(a, list);
    if (b.n == 0) return;
    const Mat& m = b.m;
    const int e_mat = b.e, n0 = blockIdx.y * 16;
    const int rows[1] = {n0};
    float* out = static_cast<float*>(a.y);
    grouped_tiles<1>(a, m, e_mat, rows, list, b.n, false, [&](const float (&sum)[1], int r, int slot) {
        out[(size_t)slot * a.ldy + n0 + r] = __ldg(a.route_w + slot) * (row_multiplier<EncNvfp4>(m, e_mat, n0 + r) * 256.f) * sum[0];
    });
}

struct CombineArgs {
    const float* part;
    const int* ids;
    bf16* y;
    int tokens;
    int topk;
    int has_shared;
    int experts;
    int dim;
    int ldy;
};
static_assert(sizeof(CombineArgs) == 48, "mirrored in crates/ninfer-kernels/src/experts.rs");

extern "C" __global__ void __launch_bounds__(256) ninfer_moe_combine(CombineArgs a) {
    grid_release();
    grid_wait();
    const int t = blockIdx.x;
    for (int n = blockIdx.y * blockDim.x + threadIdx.x; n < a.dim; n += gridDim.y * blockDim.x) {
        float r = 0.f;
        for (int j = 0; j < a.topk; ++j) {
            const int s = t * a.topk + j;
            const int e = __ldg(a.ids + s);
            if (e >= 0 && e < a.experts) r += a.part[(size_t)s * a.dim + n];
        }
        if (a.has_shared) r += a.part[((size_t)a.tokens * a.topk + t) * a.dim + n];
        bf16* p = a.y + (size_t)t * a.ldy + n;
        *p = f2bf(bf2f(*p) + round_bf(r));
    }
}

// Slot j's expert of the one token's routing (BankArgs::logits), routed by warp 0 for the
// block: j + 1 rounds, no weights (gate_up waits on this; down routes before its wait).
__device__ __forceinline__ int block_pick(const BankArgs& a, int j) {
    __shared__ int pick;
    if (threadIdx.x < 32) {
        const RoutePick p = route_pick<false>(a.logits, a.bank.experts, j + 1, threadIdx.x);
        if ((int)threadIdx.x == j) pick = p.id;
    }
    __syncthreads();
    return pick;
}

// Four warps a gate_up block, nine blocks per SM (at most 56 registers): a decode token's nine
// slots of 512 rows are then 1,152 blocks, all resident at once on 132 SMs. With eight warps
// a block, three per SM, its 576 blocks ran in two waves, the second routing and waiting on
// its weights again.
#define GATE_UP_WARPS 4

template <typename Enc>
__device__ __forceinline__ void gate_up_body(const BankArgs& a) {
    constexpr int CH = Enc::CHUNK;
    const int lane = threadIdx.x & 31;
    const int s = blockIdx.x;
    const bool shared = s >= a.tokens * a.topk;
    const Mat m = shared ? a.shared : a.bank;
    const int inter = m.rows / 2;
    const int j = blockIdx.y * GATE_UP_WARPS + (threadIdx.x >> 5);
    const int t = shared ? s - a.tokens * a.topk : s / a.topk;
    // A routed slot's expert comes from the kernel ahead; the shared expert's rows do not, so
    // its slots load them before waiting.
    int e = 0;
    if (!shared) {
        grid_wait();
        grid_release();  // after the wait: down reads the routing before its own (header)
        e = a.logits != nullptr ? block_pick(a, s) : __ldg(a.ids + s);
    }
    if (j >= inter) return;
    bf16* out = static_cast<bf16*>(a.y) + (size_t)s * inter + j;
    if (e < 0 || e >= m.experts) {
        if (lane == 0) *out = f2bf(0.f);
        return;
    }
    const bf16* x = a.x + (size_t)t * a.ldx;
    const int nchunks = m.cols / CH;
    float acc[2] = {0.f, 0.f};
    int c = lane;
    typename Enc::Raw rg, ru;
    if (c < nchunks) {
        rg = Enc::load(m, e, j, c);
        ru = Enc::load(m, e, inter + j, c);
    }
    if (shared) {
        grid_wait();
        grid_release();
    }
    while (c < nchunks) {
        const int cn = c + 32;
        typename Enc::Raw ng = rg, nu = ru;
        if (cn < nchunks) {  // keep the next chunk's loads in flight
            ng = Enc::load(m, e, j, cn);
            nu = Enc::load(m, e, inter + j, cn);
        }
        pair_dot<Enc>(rg, ru, x + (size_t)c * CH, acc);
        rg = ng;
        ru = nu;
        c = cn;
    }
    warp_sum(acc);
    if (lane == 0) {
        const float g = round_bf(acc[0] * row_multiplier<Enc>(m, e, j));
        const float u = round_bf(acc[1] * row_multiplier<Enc>(m, e, inter + j));
        *out = f2bf(round_bf(silu(g)) * u);
    }
}

#define DOWN_BATCH 6
// One batch of a down row's (slot, chunk) pairs, lane `lane`'s pairs base, base + 32, ...:
// where they live and, loaded, their weights.
template <typename Enc>
struct DownBatch {
    typename Enc::Raw raw[DOWN_BATCH];
    int pick[DOWN_BATCH], expert[DOWN_BATCH], chunk[DOWN_BATCH];
    bool use[DOWN_BATCH];

    __device__ __forceinline__ void load(const BankArgs& a, const int* id, int n, int base, int total, int nchunks) {
#pragma unroll
        for (int k = 0; k < DOWN_BATCH; ++k) {
            const int idx = base + 32 * k;
            use[k] = false;
            if (idx < total) {
                pick[k] = idx / nchunks;
                chunk[k] = idx - pick[k] * nchunks;
                const bool shared = pick[k] >= a.topk;
                expert[k] = shared ? 0 : id[pick[k]];
                const Mat m = shared ? a.shared : a.bank;
                use[k] = expert[k] >= 0 && expert[k] < m.experts;
                if (use[k]) raw[k] = Enc::load(m, expert[k], n, chunk[k]);
            }
        }
    }

    // The batch's weighted partial dot products, added to acc in pair order.
    __device__ __forceinline__ void use_all(const BankArgs& a, const float* w, int t, int n, float& acc) const {
        constexpr int CH = Enc::CHUNK;
#pragma unroll
        for (int k = 0; k < DOWN_BATCH; ++k) {
            if (!use[k]) continue;
            const bool shared = pick[k] >= a.topk;
            const Mat m = shared ? a.shared : a.bank;
            const int slot = shared ? a.tokens * a.topk + t : t * a.topk + pick[k];
            float wv[CH], sc[Enc::GROUPS];
            Enc::dequant(raw[k], wv, sc);
            const float d = chunk_dot<Enc>(wv, sc, a.x + (size_t)slot * a.ldx + (size_t)chunk[k] * CH);
            acc += w[pick[k]] * row_multiplier<Enc>(m, expert[k], n) * d;
        }
    }
};

template <typename Enc>
__device__ __forceinline__ void down_body(const BankArgs& a) {
    __shared__ int id[DOWN_MAX_SLOTS];
    __shared__ float w[DOWN_MAX_SLOTS];
    grid_release();
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x;
    const int n = blockIdx.y * 8 + (threadIdx.x >> 5);
    token_routing(a, t, id, w);
    if (n >= a.bank.rows) return;
    const int nchunks = a.bank.cols / Enc::CHUNK;
    const int nslots = a.topk + (a.has_shared ? 1 : 0);
    // (slot, chunk) pairs are spread over the lanes so that short rows (I = 512) keep every
    // lane busy; each lane issues the loads of up to DOWN_BATCH pairs before using any of them
    // and applies each pair's routing weight to its partial dot product. The first batch (a
    // decode row's every pair at I = 512, top 8 + shared) streams in while gate_up still runs.
    const int total = nslots * nchunks;
    float acc = 0.f;
    DownBatch<Enc> b;
    b.load(a, id, n, lane, total, nchunks);
    grid_wait();
    b.use_all(a, w, t, n, acc);
    for (int base = lane + 32 * DOWN_BATCH; base < total; base += 32 * DOWN_BATCH) {
        b.load(a, id, n, base, total, nchunks);
        b.use_all(a, w, t, n, acc);
    }
    acc = warp_sum1(acc);
    if (lane == 0) store_out(a.y, (size_t)t * a.ldy + n, acc, a.out_f32, a.accumulate);
}

// Three blocks per SM for down (at most 85 registers, against 91-98 unbounded) and nine of
// four warps for gate_up (GATE_UP_WARPS; eight for q4_g32 and five for q6_g64, which spill at
// more): a decode step's experts are a few thousand short rows, so the bytes in flight per SM,
// not the instructions, bound them.
#define NINFER_BANK(name, Enc, gate_up_blocks)                                              \
    extern "C" __global__ void __launch_bounds__(GATE_UP_WARPS * 32, gate_up_blocks)        \
        ninfer_moe_gate_up_##name(BankArgs a) {                                             \
        gate_up_body<Enc>(a);                                                               \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 3) ninfer_moe_down_##name(BankArgs a) {    \
        down_body<Enc>(a);                                                                  \
    }
NINFER_BANK(bf16, EncBf16, 9)
NINFER_BANK(q8_g32, EncQ8, 9)
NINFER_BANK(q6_g64, EncQ6, 5)
NINFER_BANK(q4_g32, EncQ4, 8)
NINFER_BANK(nvfp4, EncNvfp4, 9)
