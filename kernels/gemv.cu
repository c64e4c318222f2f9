// Matrix-vector products for decode (small batch), over every weight encoding of
// docs/format.md section 3, plus the MoE expert-bank variants (model-spec.md 2.5).
//
// ninfer_gemv_<enc>_b<NB>  (enc: bf16, q8_g32, q6_g64, q4_g32, nvfp4; NB: 1, 2, 4, 8, 16)
//   y[b, n] = sum_k x[b, k] * W[n, k]     for b < batch <= NB, n < N = m.rows, k < K = m.cols
//   x: bf16 [batch, ldx]; W: one matrix (m.experts == 1) decoded per format.md, nvfp4 including
//   its per-segment global; f32 accumulation; y [batch, ldy] written as bf16 (rounded once) or f32
//   (out_f32). Launch: block 256 = 8 warps, one output row per warp, grid ceil(N / 8).
//   K must be a multiple of 8 (bf16), 32 (q8_g32, q4_g32, nvfp4) or 64 (q6_g64): whole 16-byte
//   chunks per lane and whole scale groups. Every weight row and x row must start 16-byte
//   aligned. y must not alias x or W.
//
// ninfer_moe_gate_up_<enc>
//   For slot s < tokens*topk: token t = s / topk, expert e = ids[s]; for the optional shared
//   slots s = tokens*topk + t the shared matrix is used instead. Bank rows 0..I-1 are the gate,
//   I..2I-1 the up projection ([E, 2I, H] as stored), so m.rows = 2I.
//   g = bf16(x[t] . W[e][j]), u = bf16(x[t] . W[e][I + j]),
//   out[s, j] = bf16(bf16(silu(g)) * u)   (transformers' bf16 roundings), out dense [S, I].
//   An id outside [0, E) gives a zero row. Launch: block 256, grid (S, ceil(I / 8)) (slots on
//   x: a prompt pass of T tokens has T * (topk + 1) of them, more than grid y's 65,535).
//
// ninfer_moe_down_<enc>
//   r[t, n] = sum_{j<topk} w[t*topk+j] * (in[t*topk+j] . W[ids[t*topk+j]][n])
//             + (shared ? w[tokens*topk + t] * (in[tokens*topk + t] . S[n]) : 0)
//   in: bf16 [S, ldx] (the gate_up output), w: f32 routing weights per slot (the shared slot's
//   weight is its sigmoid gate). y[t, n] = r (accumulate = 0) or y + r (accumulate = 1; for bf16
//   y = bf16(y + bf16(r)), the residual add in the model dtype). Each output is produced by one
//   warp (no atomics), so results are deterministic. Launch: block 256,
//   grid (tokens, ceil(H / 8)).
//
// ninfer_moe_gate_up_nvfp4_mma, ninfer_moe_down_nvfp4_mma: the two NVFP4 expert kernels above on
//   the tensor cores; their contracts are beside them, below.
#include "quant.cuh"

struct GemvArgs {
    Mat m;
    const bf16* x;
    void* y;
    int batch;
    int ldx;
    int ldy;
    int out_f32;
};
static_assert(sizeof(GemvArgs) == 80, "mirrored in crates/ninfer-kernels/src/gemv.rs");

struct BankArgs {
    Mat bank;
    Mat shared;
    const bf16* x;
    const int* ids;
    const float* route_w;
    void* y;
    int tokens;
    int topk;
    int has_shared;
    int ldx;
    int ldy;
    int out_f32;
    int accumulate;
    int pad;
};
static_assert(sizeof(BankArgs) == 160, "mirrored in crates/ninfer-kernels/src/gemv.rs");

__device__ __forceinline__ void store_out(void* y, size_t idx, float v, int out_f32, int accumulate) {
    if (out_f32) {
        float* p = static_cast<float*>(y) + idx;
        *p = accumulate ? *p + v : v;
    } else {
        bf16* p = static_cast<bf16*>(y) + idx;
        *p = accumulate ? f2bf(bf2f(*p) + round_bf(v)) : f2bf(v);
    }
}

// w . x over one chunk, each group's partial sum times its scale; x read as bf16 from global
// memory (L1-resident across the warps of a block).
template <typename Enc>
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
            unpack_bf8(ldg16(x + g * PER + v * 8), xf);
#pragma unroll
            for (int i = 0; i < 8; ++i) part = fmaf(w[g * PER + v * 8 + i], xf[i], part);
        }
        acc = fmaf(part, sc[g], acc);
    }
    return acc;
}

template <typename Enc, int NB>
__device__ __forceinline__ void gemv_body(const GemvArgs& a) {
    constexpr int CH = Enc::CHUNK;
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (row >= a.m.rows) return;
    const int nchunks = a.m.cols / CH;
    float acc[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) acc[b] = 0.f;
    int c = lane;
    typename Enc::Raw raw;
    if (c < nchunks) raw = Enc::load(a.m, 0, row, c);
    while (c < nchunks) {
        const int cn = c + 32;
        typename Enc::Raw next = raw;
        if (cn < nchunks) next = Enc::load(a.m, 0, row, cn);  // keep a second load in flight
        float w[CH], sc[Enc::GROUPS];
        Enc::dequant(raw, w, sc);
#pragma unroll
        for (int b = 0; b < NB; ++b)
            if (b < a.batch) acc[b] += chunk_dot<Enc>(w, sc, a.x + (size_t)b * a.ldx + (size_t)c * CH);
        raw = next;
        c = cn;
    }
    warp_sum(acc);
    const float mul = row_multiplier<Enc>(a.m, 0, row);
#pragma unroll
    for (int b = 0; b < NB; ++b)
        if (b < a.batch && lane == b % 32)
            store_out(a.y, (size_t)b * a.ldy + row, acc[b] * mul, a.out_f32, 0);
}

template <typename Enc>
__device__ __forceinline__ void gate_up_body(const BankArgs& a) {
    constexpr int CH = Enc::CHUNK;
    const int lane = threadIdx.x & 31;
    const int s = blockIdx.x;
    const bool shared = s >= a.tokens * a.topk;
    const Mat m = shared ? a.shared : a.bank;
    const int inter = m.rows / 2;
    const int j = blockIdx.y * 8 + (threadIdx.x >> 5);
    if (j >= inter) return;
    const int t = shared ? s - a.tokens * a.topk : s / a.topk;
    const int e = shared ? 0 : __ldg(a.ids + s);
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
    while (c < nchunks) {
        const int cn = c + 32;
        typename Enc::Raw ng = rg, nu = ru;
        if (cn < nchunks) {  // keep the next chunk's loads in flight
            ng = Enc::load(m, e, j, cn);
            nu = Enc::load(m, e, inter + j, cn);
        }
        float w[CH], sc[Enc::GROUPS];
        Enc::dequant(rg, w, sc);
        acc[0] += chunk_dot<Enc>(w, sc, x + (size_t)c * CH);
        Enc::dequant(ru, w, sc);
        acc[1] += chunk_dot<Enc>(w, sc, x + (size_t)c * CH);
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

template <typename Enc>
__device__ __forceinline__ void down_body(const BankArgs& a) {
    constexpr int CH = Enc::CHUNK;
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x;
    const int n = blockIdx.y * 8 + (threadIdx.x >> 5);
    if (n >= a.bank.rows) return;
    const int nchunks = a.bank.cols / CH;
    const int routed = a.topk;
    const int nslots = routed + (a.has_shared ? 1 : 0);
    float acc = 0.f;
    // (slot, chunk) pairs are spread over the lanes so that short rows (I = 512) keep every
    // lane busy; each lane issues the loads of up to DOWN_BATCH pairs before using any of them
    // and applies each pair's routing weight to its partial dot product.
    const int total = nslots * nchunks;
    for (int base = lane; base < total; base += 32 * DOWN_BATCH) {
        typename Enc::Raw raw[DOWN_BATCH];
        int slot[DOWN_BATCH], expert[DOWN_BATCH], chunk[DOWN_BATCH];
        bool use[DOWN_BATCH], shared[DOWN_BATCH];
#pragma unroll
        for (int k = 0; k < DOWN_BATCH; ++k) {
            const int idx = base + 32 * k;
            use[k] = false;
            shared[k] = false;
            if (idx < total) {
                const int j = idx / nchunks;
                chunk[k] = idx - j * nchunks;
                shared[k] = j >= routed;
                slot[k] = shared[k] ? a.tokens * a.topk + t : t * a.topk + j;
                expert[k] = shared[k] ? 0 : __ldg(a.ids + slot[k]);
                const Mat m = shared[k] ? a.shared : a.bank;
                use[k] = expert[k] >= 0 && expert[k] < m.experts;
                if (use[k]) raw[k] = Enc::load(m, expert[k], n, chunk[k]);
            }
        }
#pragma unroll
        for (int k = 0; k < DOWN_BATCH; ++k) {
            if (!use[k]) continue;
            const Mat m = shared[k] ? a.shared : a.bank;
            float w[CH], sc[Enc::GROUPS];
            Enc::dequant(raw[k], w, sc);
            const float d = chunk_dot<Enc>(w, sc, a.x + (size_t)slot[k] * a.ldx + (size_t)chunk[k] * CH);
            acc += __ldg(a.route_w + slot[k]) * row_multiplier<Enc>(m, expert[k], n) * d;
        }
    }
    acc = warp_sum1(acc);
    if (lane == 0) store_out(a.y, (size_t)t * a.ldy + n, acc, a.out_f32, a.accumulate);
}

// ninfer_moe_gate_up_nvfp4_mma: ninfer_moe_gate_up_nvfp4's contract (same BankArgs, same
//   output, roundings and zero rows for bad ids) on the tensor cores. Each warp runs
//   mma.m16n8k16 (bf16 in, f32 accumulate) over 16 gate rows and the 16 matching up rows of one
//   slot, x in column 0 of B (the other 7 columns zero). The A operand is dequantized in
//   registers: E2M1 magnitudes to bf16 through a byte table (PRMT), the sign ORed in, times the
//   E4M3 scale in bf16; both products are exact in bf16, so A holds the exact dequantized weights
//   (format.md 3.5) and the per-row global multiplies the f32 sum. The MMA's k order is permuted
//   so that each lane reads 8 contiguous bytes (16 codes, one scale group) of a row per 64
//   columns: mma k index 2t+d maps to column 16t+4s+d, and 2t+8+d to 16t+4s+2+d, for lane t
//   (lane % 4), step s of 4 and d < 2, in A and B alike. The 8 warps of a block split K (warp w
//   takes 64-column blocks w, w+8, ...) and sum their partials in shared memory in warp order.
//   Needs I % 16 == 0 and H % 64 == 0. Launch: block 256, grid (S, I / 16).
#define MMA_WARPS 8

// Two E2M1 codes of `w` at nibbles 2p and 2p+1 (p < 4) as a bf16x2, unscaled.
__device__ __forceinline__ uint32_t e2m1x2_bf16(uint32_t w, int p) {
    // bf16 bit patterns of the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: low bytes, then high bytes.
    const uint32_t lo0 = 0xC0800000u, lo1 = 0xC0804000u, hi0 = 0x3F3F3F00u, hi1 = 0x40404040u;
    const uint32_t sel = (w >> (8 * p)) & 0x77u;  // two 3-bit magnitudes: PRMT byte indices
    const uint32_t lo = __byte_perm(lo0, lo1, sel), hi = __byte_perm(hi0, hi1, sel);
    const uint32_t mag = __byte_perm(lo, hi, 0x5140);  // lo0 hi0 lo1 hi1
    const uint32_t b = w >> (8 * p);
    return mag | ((b << 12) & 0x8000u) | ((b << 24) & 0x80000000u);
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
    __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
    return *reinterpret_cast<uint32_t*>(&r);
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One 64-column block of a lane's two rows (g and g + 8 of a 16-row tile): 8 code bytes and one
// scale byte each.
struct Nvfp4Rows {
    uint2 q[2];
    uint8_t s[2];
};

__device__ __forceinline__ Nvfp4Rows load_rows(const Mat& m, int e, int row0, int blk, int t) {
    Nvfp4Rows r;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const size_t row = (size_t)e * m.rows + row0 + 8 * h;
        const uint8_t* q = static_cast<const uint8_t*>(m.p0) + row * (m.cols / 2) + blk * 32 + t * 8;
        uint2 v;
        asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(q));
        r.q[h] = v;
        r.s[h] = __ldg(static_cast<const uint8_t*>(m.p1) + row * (m.cols / 16) + blk * 4 + t);
    }
    return r;
}

// The MMA steps of one 64-column block for one 16-row tile: a lane's codes of step s are nibbles
// 4s..4s+3 of its 16 (k index 2t, 2t+1 from the first pair, 2t+8, 2t+9 from the second).
__device__ __forceinline__ void tile_block(float (&c)[4], const Nvfp4Rows& r, const uint32_t (&xb)[8]) {
    uint32_t sc[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint32_t sb = __bfloat16_as_ushort(__float2bfloat16_rn(e4m3_to_f(r.s[h])));
        sc[h] = sb | (sb << 16);
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        const uint32_t w0 = s < 2 ? r.q[0].x : r.q[0].y, w1 = s < 2 ? r.q[1].x : r.q[1].y;
        const int p = 2 * (s & 1);
        uint32_t a[4];
        a[0] = bf16x2_mul(e2m1x2_bf16(w0, p), sc[0]);
        a[1] = bf16x2_mul(e2m1x2_bf16(w1, p), sc[1]);
        a[2] = bf16x2_mul(e2m1x2_bf16(w0, p + 1), sc[0]);
        a[3] = bf16x2_mul(e2m1x2_bf16(w1, p + 1), sc[1]);
        mma_bf16(c, a, xb[2 * s], xb[2 * s + 1]);
    }
}

extern "C" __global__ void __launch_bounds__(256) ninfer_moe_gate_up_nvfp4_mma(BankArgs a) {
    __shared__ float part[MMA_WARPS][32];
    const int s = blockIdx.x;
    const bool shared = s >= a.tokens * a.topk;
    const Mat m = shared ? a.shared : a.bank;
    const int inter = m.rows / 2;
    const int j0 = blockIdx.y * 16;
    const int t_idx = shared ? s - a.tokens * a.topk : s / a.topk;
    const int e = shared ? 0 : __ldg(a.ids + s);
    bf16* out = static_cast<bf16*>(a.y) + (size_t)s * inter + j0;
    if (e < 0 || e >= m.experts) {
        if (threadIdx.x < 16) out[threadIdx.x] = f2bf(0.f);
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const bf16* x = a.x + (size_t)t_idx * a.ldx;
    const int blocks = m.cols / 64;
    float cg[4] = {0.f, 0.f, 0.f, 0.f}, cu[4] = {0.f, 0.f, 0.f, 0.f};
    for (int blk = warp; blk < blocks; blk += MMA_WARPS) {
        const Nvfp4Rows rg = load_rows(m, e, j0 + g, blk, t), ru = load_rows(m, e, inter + j0 + g, blk, t);
        // B: x at columns 16t + 0..15 of the block in column 0 (lanes with g == 0), zeros elsewhere.
        uint32_t xb[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
        if (g == 0) {
            const uint4 x0 = ldg16(x + blk * 64 + 16 * t), x1 = ldg16(x + blk * 64 + 16 * t + 8);
            xb[0] = x0.x; xb[1] = x0.y; xb[2] = x0.z; xb[3] = x0.w;
            xb[4] = x1.x; xb[5] = x1.y; xb[6] = x1.z; xb[7] = x1.w;
        }
        tile_block(cg, rg, xb);
        tile_block(cu, ru, xb);
    }
    // Column 0 of C: c[0] is row g, c[2] row g + 8, in the lanes with t == 0.
    if (t == 0) {
        part[warp][g] = cg[0];
        part[warp][g + 8] = cg[2];
        part[warp][16 + g] = cu[0];
        part[warp][24 + g] = cu[2];
    }
    __syncthreads();
    if (threadIdx.x < 16) {
        const int j = threadIdx.x;
        float sg = 0.f, su = 0.f;
#pragma unroll
        for (int w = 0; w < MMA_WARPS; ++w) {
            sg += part[w][j];
            su += part[w][16 + j];
        }
        const float gv = round_bf(sg * row_multiplier<EncNvfp4>(m, e, j0 + j));
        const float uv = round_bf(su * row_multiplier<EncNvfp4>(m, e, inter + j0 + j));
        out[j] = f2bf(round_bf(silu(gv)) * uv);
    }
}

// ninfer_moe_down_nvfp4_mma: ninfer_moe_down_nvfp4's contract on the tensor cores, as the gate_up
//   kernel above does it: a block owns 16 output rows of one token; its 8 warps share the
//   (slot, 64-column block) items of the token's slots, each item's MMA sum scaled by the slot's
//   routing weight and row multiplier into per-warp totals, summed in warp order at the end.
//   Needs H % 16 == 0 and I % 64 == 0. Launch: block 256, grid (tokens, H / 16).
extern "C" __global__ void __launch_bounds__(256) ninfer_moe_down_nvfp4_mma(BankArgs a) {
    __shared__ float part[MMA_WARPS][16];
    const int tok = blockIdx.x;
    const int n0 = blockIdx.y * 16;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nslots = a.topk + (a.has_shared ? 1 : 0);
    const int blocks = a.bank.cols / 64;
    float tot[2] = {0.f, 0.f};  // rows n0 + g and n0 + g + 8, in the lanes with t == 0
    for (int item = warp; item < nslots * blocks; item += MMA_WARPS) {
        const int j = item / blocks, blk = item - j * blocks;
        const bool sh = j >= a.topk;
        const int slot = sh ? a.tokens * a.topk + tok : tok * a.topk + j;
        const Mat m = sh ? a.shared : a.bank;
        const int e = sh ? 0 : __ldg(a.ids + slot);
        if (e < 0 || e >= m.experts) continue;
        const Nvfp4Rows r = load_rows(m, e, n0 + g, blk, t);
        uint32_t xb[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
        if (g == 0) {
            const bf16* x = a.x + (size_t)slot * a.ldx + blk * 64 + 16 * t;
            const uint4 x0 = ldg16(x), x1 = ldg16(x + 8);
            xb[0] = x0.x; xb[1] = x0.y; xb[2] = x0.z; xb[3] = x0.w;
            xb[4] = x1.x; xb[5] = x1.y; xb[6] = x1.z; xb[7] = x1.w;
        }
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        tile_block(c, r, xb);
        if (t == 0) {
            const float w = __ldg(a.route_w + slot);
            tot[0] += w * row_multiplier<EncNvfp4>(m, e, n0 + g) * c[0];
            tot[1] += w * row_multiplier<EncNvfp4>(m, e, n0 + g + 8) * c[2];
        }
    }
    if (t == 0) {
        part[warp][g] = tot[0];
        part[warp][g + 8] = tot[1];
    }
    __syncthreads();
    if (threadIdx.x < 16) {
        float r = 0.f;
#pragma unroll
        for (int w = 0; w < MMA_WARPS; ++w) r += part[w][threadIdx.x];
        store_out(a.y, (size_t)tok * a.ldy + n0 + threadIdx.x, r, a.out_f32, a.accumulate);
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
#define NINFER_BANK(name, Enc)                                                           \
    extern "C" __global__ void __launch_bounds__(256) ninfer_moe_gate_up_##name(BankArgs a) { \
        gate_up_body<Enc>(a);                                                            \
    }                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) ninfer_moe_down_##name(BankArgs a) {    \
        down_body<Enc>(a);                                                               \
    }

NINFER_GEMV_ALL(bf16, EncBf16)
NINFER_GEMV_ALL(q8_g32, EncQ8)
NINFER_GEMV_ALL(q6_g64, EncQ6)
NINFER_GEMV_ALL(q4_g32, EncQ4)
NINFER_GEMV_ALL(nvfp4, EncNvfp4)
NINFER_BANK(bf16, EncBf16)
NINFER_BANK(q8_g32, EncQ8)
NINFER_BANK(q6_g64, EncQ6)
NINFER_BANK(q4_g32, EncQ4)
NINFER_BANK(nvfp4, EncNvfp4)
