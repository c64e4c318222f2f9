// Gated full attention over a paged KV cache (model-spec.md 2.3 steps 5-6).
//
// Cache layout: k_cache, v_cache bf16 [pages * page_size, kv_heads, dim]; position p of
// sequence s lives in row block_table[s * bt_stride + p / page_size] * page_size + p % page_size.
// A contiguous cache is the special case of an identity block table.
//
// ninfer_attention: sequences s = 0..seqs-1 own query tokens [cu_q[s], cu_q[s+1]) and kv_len[s]
//   cache positions (the new tokens included, already written: ninfer_qk_norm_rope writes
//   them). Query i of sequence s sits at position kv_len - q_len + i and attends causally to
//   positions 0..that position. Query head h uses kv head h / (q_heads / kv_heads) (GQA). Query
//   row of token t, head h at q + t*q_ld + h*q_hs; the gate row (if gate != null) at
//   gate + t*q_ld + h*q_hs.
//   o = softmax(q . K^T * scale) V, f32 math and accumulation, exp2-based online softmax.
//   splits == 1: out[t, h, :] = bf16(bf16(o) * bf16(sigmoid(gate))) (or bf16(o) without gate),
//   out dense bf16 [T, q_heads, dim].
//   splits > 1 (split-KV): kv positions are cut in ranges of split_len; block (.., split) writes
//   its unnormalised partial part_o[((t*q_heads + h)*splits + split)*dim + d] and
//   part_ml[((t*q_heads + h)*splits + split)*2 + {0,1}] = (running max in log2 units, sum);
//   ninfer_attention_combine merges them and applies the gate.
//   A block handles `qt` query tokens x G = q_heads/kv_heads heads (qt*G <= 32 rows) against
//   tiles of 32 cache positions held in shared memory.
//   Limits: dim % 8 == 0, dim <= 256, G <= 32, 16-byte aligned rows.
//   Launch: block 256, grid (ceil(max_q_len / qt), kv_heads * splits, seqs), dynamic shared
//   memory attn_smem_bytes(qt*G, dim).
//
// ninfer_attention_combine: per (token, head): M = max m_i, L = sum l_i 2^(m_i - M),
//   o = sum part_o_i 2^(m_i - M) / L, then the same gate and rounding as above.
//   splits <= 256. Warp w sums the splits w, w + 8, ... of every dim, lane l dims l, l + 32,
//   ..., and the eight warps' sums are added in warp order. Launch: block 256, grid
//   (T * q_heads).
#include "common.cuh"

#define ATT_TILE 32
#define ATT_ROWS 32
#define ATT_MAX_DIM 256
#define ATT_MAX_SPLITS 256  // mirrored by ATTN_MAX_SPLITS in src/attention.rs
#define ATT_THREADS 256
#define ATT_ITEMS (ATT_ROWS * ATT_MAX_DIM / 8 / ATT_THREADS)

struct AttnArgs {
    const bf16* q;
    const bf16* gate;
    const bf16* k_cache;
    const bf16* v_cache;
    const int* block_table;
    const int* cu_q;
    const int* kv_len;
    bf16* out;
    float* part_o;
    float* part_ml;
    int seqs;
    int q_heads;
    int kv_heads;
    int dim;
    int page_size;
    int bt_stride;
    int q_ld;
    int q_hs;
    int splits;
    int split_len;
    int qt;
    float scale_log2;  // softmax scale * log2(e)
};
static_assert(sizeof(AttnArgs) == 128, "mirrored in crates/ninfer-kernels/src/attention.rs");

__device__ __forceinline__ void gate_store(bf16* out, const bf16* gate, const float o[8]) {
    float r[8];
    if (gate != nullptr) {
        float g[8];
        unpack_bf8(ldg16(gate), g);
#pragma unroll
        for (int i = 0; i < 8; ++i) r[i] = round_bf(o[i]) * round_bf(sigmoid(g[i]));
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) r[i] = o[i];
    }
    *reinterpret_cast<uint4*>(out) = pack_bf8(r);
}

// The block's query rows into shared memory, `rows` of dim + 8 elements: row r < R is token
// t0 + r / G, head kvh * G + r % G; rows R..rows - 1 are zero.
__device__ __forceinline__ void load_q_tile(const AttnArgs& a, bf16* Qs, int rows, int R, int t0, int kvh, int G) {
    const int chunks = a.dim / 8, DP = a.dim + 8;
    for (int i = threadIdx.x; i < rows * chunks; i += blockDim.x) {
        const int r = i / chunks, c = i - r * chunks;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < R) {
            const int t = t0 + r / G, h = kvh * G + r % G;
            v = ldg16(a.q + (size_t)t * a.q_ld + (size_t)h * a.q_hs + c * 8);
        }
        *reinterpret_cast<uint4*>(Qs + r * DP + c * 8) = v;
    }
}

// Cache positions p0 .. p0 + 31 of sequence s, kv head kvh, into the K and V tiles (32 rows
// of dim + 8 elements each) by loads and stores; positions from kv_end on are zero. A thread's
// items are unrolled, so its block-table reads are issued together instead of one round trip
// each before its copies.
__device__ __forceinline__ void load_kv_tile(const AttnArgs& a, int s, int kvh, int p0, int kv_end, bf16* Ks, bf16* Vs) {
    constexpr int ITEMS = ATT_TILE * (ATT_MAX_DIM / 8) / ATT_THREADS;
    const int D = a.dim, chunks = D / 8, DP = D + 8;
    int page[ITEMS];
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const int i = threadIdx.x + k * ATT_THREADS;
        const int pos = p0 + i / chunks;
        page[k] = i < ATT_TILE * chunks && pos < kv_end ? a.block_table[(size_t)s * a.bt_stride + pos / a.page_size] : -1;
    }
#pragma unroll
    for (int k = 0; k < ITEMS; ++k) {
        const int i = threadIdx.x + k * ATT_THREADS;
        if (i >= ATT_TILE * chunks) break;
        const int p = i / chunks, c = i - p * chunks;
        const int pos = p0 + p;
        const bool valid = page[k] >= 0;
        size_t off = 0;
        if (valid) {
            const size_t row = (size_t)page[k] * a.page_size + pos % a.page_size;
            off = (row * a.kv_heads + kvh) * D + c * 8;
        }
        const uint4 zero = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(Ks + p * DP + c * 8) = valid ? ldg16(a.k_cache + off) : zero;
        *reinterpret_cast<uint4*>(Vs + p * DP + c * 8) = valid ? ldg16(a.v_cache + off) : zero;
    }
}

// The dynamic shared memory of both attention kernels, declared once: a block-scope
// declaration in the extern "C" kernel and another in the template clashed in linkage (nvcc
// warning 1556).
extern __shared__ __align__(16) unsigned char att_smem[];

extern "C" __global__ void __launch_bounds__(ATT_THREADS) ninfer_attention(AttnArgs a) {
    grid_release();
    grid_wait();
    const int s = blockIdx.z;
    const int kvh = blockIdx.y / a.splits;
    const int split = blockIdx.y - kvh * a.splits;
    const int q0 = a.cu_q[s], q_len = a.cu_q[s + 1] - q0;
    const int tile_tok = blockIdx.x * a.qt;
    if (tile_tok >= q_len) return;
    const int kv_len = a.kv_len[s];
    const int G = a.q_heads / a.kv_heads;
    const int ntok = min(a.qt, q_len - tile_tok);
    const int R = ntok * G;
    const int D = a.dim;
    const int DP = D + 8;  // padded row (bf16 elements): 16 bytes of skew per row
    const int chunks = D / 8;
    bf16* Qs = reinterpret_cast<bf16*>(att_smem);
    bf16* Ks = Qs + ATT_ROWS * DP;
    bf16* Vs = Ks + ATT_TILE * DP;
    float* Ps = reinterpret_cast<float*>(Vs + ATT_TILE * DP);
    float* Mrow = Ps + ATT_ROWS * ATT_TILE;
    float* Lrow = Mrow + ATT_ROWS;
    float* Arow = Lrow + ATT_ROWS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    load_q_tile(a, Qs, ATT_ROWS, R, q0 + tile_tok, kvh, G);
    if (tid < ATT_ROWS) {
        Mrow[tid] = -INFINITY;
        Lrow[tid] = 0.f;
    }
    const int first_pos = kv_len - q_len + tile_tok;  // causal limit of the tile's first token
    const int last_pos = first_pos + ntok - 1;
    const int kv_begin = split * a.split_len;
    const int kv_end = min(min(kv_len, kv_begin + a.split_len), last_pos + 1);

    float acc[ATT_ITEMS][8];
#pragma unroll
    for (int it = 0; it < ATT_ITEMS; ++it)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[it][i] = 0.f;

    for (int p0 = kv_begin; p0 < kv_end; p0 += ATT_TILE) {
        __syncthreads();  // previous tile fully consumed (and Q/M/L initialised)
        load_kv_tile(a, s, kvh, p0, kv_end, Ks, Vs);
        __syncthreads();
        // Scores: lane = cache position within the tile, warp w takes rows w, w+8, w+16, w+24.
        {
            float sc[ATT_ROWS / 8];
#pragma unroll
            for (int k = 0; k < ATT_ROWS / 8; ++k) sc[k] = 0.f;
            for (int c = 0; c < chunks; ++c) {
                float kf[8];
                unpack_bf8(*reinterpret_cast<const uint4*>(Ks + lane * DP + c * 8), kf);
#pragma unroll
                for (int k = 0; k < ATT_ROWS / 8; ++k) {
                    const int r = warp + 8 * k;
                    if (r < R) {
                        float qf[8];
                        unpack_bf8(*reinterpret_cast<const uint4*>(Qs + r * DP + c * 8), qf);
#pragma unroll
                        for (int i = 0; i < 8; ++i) sc[k] = fmaf(qf[i], kf[i], sc[k]);
                    }
                }
            }
            const int pos = p0 + lane;
#pragma unroll
            for (int k = 0; k < ATT_ROWS / 8; ++k) {
                const int r = warp + 8 * k;
                if (r < R) {
                    const int lim = first_pos + r / G;
                    const float v = (pos < kv_end && pos <= lim) ? sc[k] * a.scale_log2 : -INFINITY;
                    const float tmax = warp_max1(v);
                    const float m_old = Mrow[r];
                    const float m_new = fmaxf(m_old, tmax);
                    const float p = v == -INFINITY ? 0.f : exp2f(v - m_new);
                    const float alpha = m_old == -INFINITY ? 0.f : exp2f(m_old - m_new);
                    const float psum = warp_sum1(p);
                    Ps[r * ATT_TILE + lane] = p;
                    __syncwarp();
                    if (lane == 0) {
                        Mrow[r] = m_new;
                        Lrow[r] = Lrow[r] * alpha + psum;
                        Arow[r] = alpha;
                    }
                }
            }
        }
        __syncthreads();
        // O update: item = (row, 8-dim chunk).
#pragma unroll
        for (int it = 0; it < ATT_ITEMS; ++it) {
            const int idx = tid + it * ATT_THREADS;
            const int r = idx / chunks, c = idx - r * chunks;
            if (r < R) {
                const float al = Arow[r];
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[it][i] *= al;
                const float* pr = Ps + r * ATT_TILE;
                for (int p = 0; p < ATT_TILE; ++p) {
                    const float w = pr[p];
                    float vf[8];
                    unpack_bf8(*reinterpret_cast<const uint4*>(Vs + p * DP + c * 8), vf);
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[it][i] = fmaf(w, vf[i], acc[it][i]);
                }
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int it = 0; it < ATT_ITEMS; ++it) {
        const int idx = tid + it * ATT_THREADS;
        const int r = idx / chunks, c = idx - r * chunks;
        if (r >= R) continue;
        const int t = q0 + tile_tok + r / G, h = kvh * G + r % G;
        const float l = Lrow[r];
        if (a.splits == 1) {
            float o[8];
            const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = acc[it][i] * inv;
            const bf16* g = a.gate ? a.gate + (size_t)t * a.q_ld + (size_t)h * a.q_hs + c * 8 : nullptr;
            gate_store(a.out + ((size_t)t * a.q_heads + h) * D + c * 8, g, o);
        } else {
            const size_t base = ((size_t)t * a.q_heads + h) * a.splits + split;
            float4* dst = reinterpret_cast<float4*>(a.part_o + base * D + c * 8);
            dst[0] = make_float4(acc[it][0], acc[it][1], acc[it][2], acc[it][3]);
            dst[1] = make_float4(acc[it][4], acc[it][5], acc[it][6], acc[it][7]);
            if (c == 0) {
                a.part_ml[base * 2] = Mrow[r];
                a.part_ml[base * 2 + 1] = l;
            }
        }
    }
}

struct CombineArgs {
    const float* part_o;
    const float* part_ml;
    const bf16* gate;
    bf16* out;
    int rows;  // tokens * q_heads
    int q_heads;
    int dim;
    int splits;
    int q_ld;
    int q_hs;
};
static_assert(sizeof(CombineArgs) == 56, "mirrored in crates/ninfer-kernels/src/attention.rs");

extern "C" __global__ void __launch_bounds__(256) ninfer_attention_combine(CombineArgs a) {
    grid_release();
    grid_wait();
    __shared__ float weight[ATT_MAX_SPLITS];  // 2^(m_i - M) per split
    __shared__ float part[8][ATT_MAX_DIM];     // each warp's sum over its splits
    __shared__ float o_row[ATT_MAX_DIM];
    __shared__ float red[8];
    const int row = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int t = row / a.q_heads, h = row - t * a.q_heads;
    const float* ml = a.part_ml + (size_t)row * a.splits * 2;
    float m = -INFINITY;
    for (int i = tid; i < a.splits; i += 256) m = fmaxf(m, ml[2 * i]);
    m = warp_max1(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < 8; ++w) M = fmaxf(M, red[w]);
    __syncthreads();
    float l = 0.f;
    for (int i = tid; i < a.splits; i += 256) {
        const float mi = ml[2 * i];
        const float f = mi == -INFINITY ? 0.f : exp2f(mi - M);
        weight[i] = f;
        l += ml[2 * i + 1] * f;
    }
    l = warp_sum1(l);
    if (lane == 0) red[warp] = l;
    __syncthreads();
    float L = 0.f;
    for (int w = 0; w < 8; ++w) L += red[w];
    const float inv = L > 0.f ? 1.f / L : 0.f;
    // The eight warps read eight splits' partials at once, each a split's row coalesced (a thread
    // per dim walking every split in turn took one round trip per split).
    float acc[ATT_MAX_DIM / 32];
#pragma unroll
    for (int k = 0; k < ATT_MAX_DIM / 32; ++k) acc[k] = 0.f;
    for (int i = warp; i < a.splits; i += 8) {
        const float wi = weight[i];
        const float* src = a.part_o + ((size_t)row * a.splits + i) * a.dim;
#pragma unroll
        for (int k = 0; k < ATT_MAX_DIM / 32; ++k)
            if (lane + 32 * k < a.dim) acc[k] = fmaf(src[lane + 32 * k], wi, acc[k]);
    }
#pragma unroll
    for (int k = 0; k < ATT_MAX_DIM / 32; ++k)
        if (lane + 32 * k < a.dim) part[warp][lane + 32 * k] = acc[k];
    __syncthreads();
    for (int d = tid; d < a.dim; d += 256) {
        float o = 0.f;
        for (int w = 0; w < 8; ++w) o += part[w][d];
        o_row[d] = o * inv;
    }
    __syncthreads();
    for (int c = tid; c < a.dim / 8; c += 256) {
        float o[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = o_row[c * 8 + i];
        const bf16* g = a.gate ? a.gate + (size_t)t * a.q_ld + (size_t)h * a.q_hs + c * 8 : nullptr;
        gate_store(a.out + (size_t)row * a.dim + c * 8, g, o);
    }
}

// ninfer_attention_mma: ninfer_attention on the tensor cores: the same arguments and contract
//   (splits and their partials included), except: dim % 16 == 0, and a block takes qt query
//   tokens x G heads (qt*G <= 64 rows, 16 rows per warp) against tiles of 32 cache positions,
//   the next tile's K and V copied by the copy engine (a bulk copy per row, an mbarrier per
//   buffer) while the current one is used. Scores and P.V run on mma.m16n8k16 (bf16 operands,
//   f32 accumulation); P is rounded to bf16 as the operand of P.V (as flash attention does)
//   while the row sums add the f32 P, so the result differs from ninfer_attention's by about
//   one bf16 rounding of P. The running max m is rounded up
//   to a whole number (log2 units; part_ml then holds that integer): P, its bf16 rounding and
//   every rescaling change by exact powers of two when m moves, so a row cut into splits (a
//   decode step) rounds P as the unsplit row of a prompt does, and the two differ only by the
//   order of the f32 sums (with a real max they differed by a bf16 rounding of most of P, and
//   the tiny-b golden model's decode row read 0.10 from its prompt row, every other row equal:
//   as a flipped expert choice downstream would, not measured further).
//   Launch: block 128, grid (ceil(max_q_len / qt), kv_heads * splits, seqs), dynamic shared
//   memory (64 + 4 * 32) * (dim + 8) * 2 bytes: Q, then two K and V tile pairs, rows padded
//   by 16 bytes (cache rows and the caches 16-byte aligned, as the launcher checks).
//   Dependent launch (common.cuh): a block reads cu_q, kv_len and the block table and copies
//   its first tile's rows of positions before kv_len - q_len before its wait: the metadata
//   must come from the host ahead of the pass's first launch, and those rows from passes
//   finished before it (the engine's passes are), never from a launch of the same pass.
//
// ninfer_attention_mma_decode: ninfer_attention_mma for blocks of qt * G <= 16 query rows
//   (a decode step, a short draft), dim % 64 == 0: every warp takes the 16 rows (the scores
//   and their softmax four times over, the same bits in each warp) and warp w the output dims
//   [w dim / 4, (w + 1) dim / 4) of P.V. A decode block of the 64-row kernel left three warps
//   idle while one did every product, at 218 registers and 2 blocks per SM; this one holds a
//   quarter of the output per warp (96 registers, 3 blocks per SM at dim 256, bound by its
//   shared memory). Each output element's arithmetic is the 64-row kernel's. Launch: as
//   ninfer_attention_mma with (16 + 4 * 32) * (dim + 8) * 2 bytes of shared memory.
#define MMA_ROWS 64
#define MMA_TILE ATT_TILE  // the SIMT kernel's tile of cache positions
#define MMA_THREADS 128
#define MMA_MAX_NT (ATT_MAX_DIM / 8)

__device__ __forceinline__ uint32_t lds32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// Four 8x8 bf16 matrices from shared memory, transposed: lane l gives the row address of
// matrix l / 8; register i receives matrix i as the B operand of mma.m16n8k16 wants it.
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const bf16* p) {
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Two output values of a row with the gate of ninfer_attention's gate_store.
__device__ __forceinline__ uint32_t gate_pair(float o0, float o1, const bf16* gate) {
    if (gate == nullptr) return pack_bf2(o0, o1);
    return pack_bf2(round_bf(o0) * round_bf(sigmoid(bf2f(gate[0]))), round_bf(o1) * round_bf(sigmoid(bf2f(gate[1]))));
}

// Online softmax of one row's 8 scores held by a lane quad (this lane: 2 per tile of 8):
// masks positions past `lim` or the cache, moves the running max (a whole number, see the
// contract), turns the scores into exp2(s - m) in place and returns the factor that rescales
// the row's earlier output and sum.
__device__ __forceinline__ float softmax_step(float (&sc)[4][4], int half, int p0, int tq, int lim, int kv_end,
                                              float scale_log2, float& m, float& l) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int pos = p0 + j * 8 + 2 * tq + e;
            float& v = sc[j][2 * half + e];
            v = (pos < kv_end && pos <= lim) ? v * scale_log2 : -INFINITY;
            mx = fmaxf(mx, v);
        }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, ceilf(mx));
    const float alpha = m == -INFINITY ? 0.f : exp2f(m - m_new);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            float& v = sc[j][2 * half + e];
            v = v == -INFINITY ? 0.f : exp2f(v - m_new);
            sum += v;
        }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    m = m_new;
    l = l * alpha + sum;
    return alpha;
}

// The tensor-core kernels' K/V tiles come by the copy engine (PTX ISA cp.async.bulk, sm_90):
// one bulk copy per cache row, counted against a shared-memory mbarrier per tile buffer that
// every thread waits on (common.cuh's mbarrier helpers). With 16-byte copies per thread
// (cp.async) a block read ~6 GB/s: 2,860 µs for 512 tiles of 32 KB each in the kernel bench
// at 32k positions and 2 splits, and ~970 GB/s for a whole decode step over 32k positions.
//
// By warp 0 only, before any of a tile's rows is copied: its bytes expected on `bar`.
__device__ __forceinline__ void kv_tile_expect(const AttnArgs& a, uint64_t* bar) {
    if ((threadIdx.x & 31) == 0) mbar_expect(bar, 2 * ATT_TILE * a.dim * 2);
    __syncwarp();
}

// By warp 0 only: lane p copies the K and V rows of position p0 + p into row p of the tiles,
// landing on `bar`, if that position lies in [lo, hi) (a tile's rows may come in two calls:
// those written before this pass, then the pass's own). A position from kv_end on copies the
// last one before it instead: its score is masked, so its P is exactly 0, and its rows are
// finite (zeros need stores of the other proxy into the same buffer).
__device__ __forceinline__ void kv_rows_bulk(const AttnArgs& a, int s, int kvh, int p0, int kv_end, bf16* Ks, bf16* Vs, uint64_t* bar,
                                             int lo, int hi) {
    const int lane = threadIdx.x & 31, D = a.dim, DP = D + 8;
    // Shared-memory reads of this buffer's last tile are done (the caller's barrier); order
    // them before the copy engine's writes.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const int pos = min(p0 + lane, kv_end - 1);
    if (pos < lo || pos >= hi) return;
    const int page = a.block_table[(size_t)s * a.bt_stride + pos / a.page_size];
    const size_t off = (((size_t)page * a.page_size + pos % a.page_size) * a.kv_heads + kvh) * D;
    bulk_copy(Ks + lane * DP, a.k_cache + off, D * 2, bar);
    bulk_copy(Vs + lane * DP, a.v_cache + off, D * 2, bar);
}

// The tensor-core kernels' body. DEC (ninfer_attention_mma_decode): 16 query rows, which
// every warp takes, warp w holding output dims [w D / 4, (w + 1) D / 4); else 64 rows, 16 per
// warp, each warp holding every dim.
template <bool DEC>
__device__ __forceinline__ void attention_mma(const AttnArgs& a) {
    constexpr int QR = DEC ? 16 : MMA_ROWS;
    constexpr int NT = DEC ? MMA_MAX_NT / 4 : MMA_MAX_NT;
    grid_release();
    // Before the wait: the pass's metadata (copied from the host ahead of its first launch) and
    // the first tile's cache rows of positions from before this pass; after it, Q and the rows
    // of the pass's own tokens (written by ninfer_qk_norm_rope ahead).
    const int s = blockIdx.z, kvh = blockIdx.y / a.splits, split = blockIdx.y - kvh * a.splits;
    const int q0 = a.cu_q[s], q_len = a.cu_q[s + 1] - q0;
    const int tile_tok = blockIdx.x * a.qt;
    if (tile_tok >= q_len) {
        grid_wait();
        return;
    }
    const int kv_len = a.kv_len[s];
    const int G = a.q_heads / a.kv_heads;
    const int R = min(a.qt, q_len - tile_tok) * G;
    const int D = a.dim, DP = D + 8, nt = D / 8;
    bf16* Qs = reinterpret_cast<bf16*>(att_smem);
    bf16* Kb = Qs + QR * DP;  // tile pair b: K at Kb + 2b * 32 * DP, V right after it
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tq = lane & 3;
    // This warp's first row, and its output dim tiles of 8: n0 .. n0 + ntw - 1.
    const int row0 = DEC ? 0 : warp * 16, ntw = DEC ? nt / 4 : nt, n0 = DEC ? warp * ntw : 0;

    // This lane's rows: row0 + g and 8 below it; each row's last visible position.
    const int first_pos = kv_len - q_len + tile_tok;
    const int r_lo = row0 + g, r_hi = r_lo + 8;
    const int lim_lo = r_lo < R ? first_pos + r_lo / G : -1;
    const int lim_hi = r_hi < R ? first_pos + r_hi / G : -1;
    const int warp_rows = min(R - row0, 16);
    const int warp_lim = warp_rows > 0 ? first_pos + (row0 + warp_rows - 1) / G : -1;
    const int kv_begin = split * a.split_len;
    const int kv_end = min(min(kv_len, kv_begin + a.split_len), first_pos + (R - 1) / G + 1);

    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;

    __shared__ uint64_t kv_bar[2];  // one per tile buffer; bit b of `parity` its next phase
    if (tid == 0) {
        mbar_init(&kv_bar[0]);
        mbar_init(&kv_bar[1]);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    uint32_t parity = 0;
    const int old_end = kv_len - q_len;  // positions cached before this pass
    if (kv_begin < kv_end && warp == 0) {
        kv_tile_expect(a, &kv_bar[0]);
        kv_rows_bulk(a, s, kvh, kv_begin, kv_end, Kb, Kb + MMA_TILE * DP, &kv_bar[0], 0, old_end);
    }
    grid_wait();
    load_q_tile(a, Qs, QR, R, q0 + tile_tok, kvh, G);
    if (kv_begin < kv_end && warp == 0) kv_rows_bulk(a, s, kvh, kv_begin, kv_end, Kb, Kb + MMA_TILE * DP, &kv_bar[0], old_end, kv_end);
    for (int p0 = kv_begin, buf = 0; p0 < kv_end; p0 += MMA_TILE, buf ^= 1) {
        __syncthreads();  // the other pair is consumed (and Q is stored)
        if (p0 + MMA_TILE < kv_end && warp == 0) {
            bf16* nk = Kb + (buf ^ 1) * 2 * MMA_TILE * DP;
            kv_tile_expect(a, &kv_bar[buf ^ 1]);
            kv_rows_bulk(a, s, kvh, p0 + MMA_TILE, kv_end, nk, nk + MMA_TILE * DP, &kv_bar[buf ^ 1], 0, kv_end);
        }
        mbar_wait(&kv_bar[buf], (parity >> buf) & 1u);  // every thread: this tile has landed
        parity ^= 1u << buf;
        if (warp_lim < p0) continue;  // every row of this warp lies before the tile
        const bf16* Ks = Kb + buf * 2 * MMA_TILE * DP;
        const bf16* Vs = Ks + MMA_TILE * DP;
        // S = Q K^T: this warp's 16 rows x the tile's 32 positions (4 tiles of 8).
        float sc[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
        for (int k0 = 0; k0 < D; k0 += 16) {
            const bf16* qa = Qs + r_lo * DP + k0 + 2 * tq;
            const uint32_t a0 = lds32(qa), a1 = lds32(qa + 8 * DP), a2 = lds32(qa + 8), a3 = lds32(qa + 8 * DP + 8);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const bf16* kb = Ks + (j * 8 + g) * DP + k0 + 2 * tq;
                mma_bf16(sc[j], a0, a1, a2, a3, lds32(kb), lds32(kb + 8));
            }
        }
        const float al_lo = softmax_step(sc, 0, p0, tq, lim_lo, kv_end, a.scale_log2, m_lo, l_lo);
        const float al_hi = softmax_step(sc, 1, p0, tq, lim_hi, kv_end, a.scale_log2, m_hi, l_hi);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            o[n][0] *= al_lo;
            o[n][1] *= al_lo;
            o[n][2] *= al_hi;
            o[n][3] *= al_hi;
        }
        // O += P V: P from the score registers as the A operand, two steps of 16 positions.
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            const uint32_t a0 = pack_bf2(sc[2 * kk][0], sc[2 * kk][1]), a1 = pack_bf2(sc[2 * kk][2], sc[2 * kk][3]);
            const uint32_t a2 = pack_bf2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            const uint32_t a3 = pack_bf2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
            // Lane l addresses row kk*16 + (l / 8 odd ? 8 : 0) + l % 8 of V at dims of tile n + l / 16.
            const bf16* vrow = Vs + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * DP + (lane >> 4) * 8;
#pragma unroll
            for (int n = 0; n < NT; n += 2) {
                if (n < ntw) {
                    uint32_t b[4];
                    ldsm_x4_trans(b, vrow + (n0 + n) * 8);
                    mma_bf16(o[n], a0, a1, a2, a3, b[0], b[1]);
                    mma_bf16(o[n + 1], a0, a1, a2, a3, b[2], b[3]);
                }
            }
        }
    }
    // Without splits out = o / l, times the gate; with them the partials. This lane writes dims
    // 8n + 2tq, +1 of its two rows.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = half ? r_hi : r_lo;
        if (r >= R) continue;
        const float l = half ? l_hi : l_lo;
        const int t = q0 + tile_tok + r / G, h = kvh * G + r % G;
        if (a.splits > 1) {
            const size_t base = ((size_t)t * a.q_heads + h) * a.splits + split;
#pragma unroll
            for (int n = 0; n < NT; ++n)
                if (n < ntw)
                    *reinterpret_cast<float2*>(a.part_o + base * D + (n0 + n) * 8 + 2 * tq) = make_float2(o[n][2 * half], o[n][2 * half + 1]);
            if (tq == 0 && n0 == 0) {
                a.part_ml[base * 2] = half ? m_hi : m_lo;
                a.part_ml[base * 2 + 1] = l;
            }
            continue;
        }
        const float inv = l > 0.f ? 1.f / l : 0.f;
        bf16* orow = a.out + ((size_t)t * a.q_heads + h) * D;
        const bf16* grow = a.gate ? a.gate + (size_t)t * a.q_ld + (size_t)h * a.q_hs : nullptr;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            if (n < ntw) {
                const int d = (n0 + n) * 8 + 2 * tq;
                const uint32_t v = gate_pair(o[n][2 * half] * inv, o[n][2 * half + 1] * inv, grow ? grow + d : nullptr);
                *reinterpret_cast<uint32_t*>(orow + d) = v;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(MMA_THREADS) ninfer_attention_mma(AttnArgs a) { attention_mma<false>(a); }
extern "C" __global__ void __launch_bounds__(MMA_THREADS) ninfer_attention_mma_decode(AttnArgs a) { attention_mma<true>(a); }
