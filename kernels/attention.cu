// Gated full attention over a paged KV cache (model-spec.md 2.3 steps 5-6).
//
// Cache layout: k_cache, v_cache bf16 [pages * page_size, kv_heads, dim]; position p of
// sequence s lives in row block_table[s * bt_stride + p / page_size] * page_size + p % page_size.
// A contiguous cache is the special case of an identity block table.
//
// ninfer_kv_write: k_cache[slot[t], h, :] = k[t*k_ld + h*k_hs + :], same for v; slot < 0 skips
//   the token. Launch: block 128, grid (tokens).
//
// ninfer_attention: sequences s = 0..seqs-1 own query tokens [cu_q[s], cu_q[s+1]) and kv_len[s]
//   cache positions (the new tokens included, already written). Query i of sequence s sits at
//   position kv_len - q_len + i and attends causally to positions 0..that position. Query head
//   h uses kv head h / (q_heads / kv_heads) (GQA). Query row of token t, head h at
//   q + t*q_ld + h*q_hs; the gate row (if gate != null) at gate + t*q_ld + h*q_hs.
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
//   splits <= 128. Launch: block 256, grid (T * q_heads).
#include "common.cuh"

#define ATT_TILE 32
#define ATT_ROWS 32
#define ATT_MAX_DIM 256
#define ATT_MAX_SPLITS 128  // mirrored by ATTN_MAX_SPLITS in src/attention.rs
#define ATT_THREADS 256
#define ATT_ITEMS (ATT_ROWS * ATT_MAX_DIM / 8 / ATT_THREADS)

struct KvWriteArgs {
    const bf16* k;
    const bf16* v;
    bf16* k_cache;
    bf16* v_cache;
    const int* slot;
    int tokens;
    int kv_heads;
    int dim;
    int k_ld;
    int k_hs;
    int v_ld;
    int v_hs;
    int pad;
};
static_assert(sizeof(KvWriteArgs) == 72, "mirrored in crates/ninfer-kernels/src/attention.rs");

extern "C" __global__ void __launch_bounds__(128) ninfer_kv_write(KvWriteArgs a) {
    grid_release();
    grid_wait();
    const int t = blockIdx.x;
    const int slot = a.slot[t];
    if (slot < 0) return;
    const int chunks = a.dim / 8;
    for (int i = threadIdx.x; i < a.kv_heads * chunks; i += blockDim.x) {
        const int h = i / chunks, c = i - h * chunks;
        const size_t dst = ((size_t)slot * a.kv_heads + h) * a.dim + c * 8;
        *reinterpret_cast<uint4*>(a.k_cache + dst) =
            ldg16(a.k + (size_t)t * a.k_ld + (size_t)h * a.k_hs + c * 8);
        *reinterpret_cast<uint4*>(a.v_cache + dst) =
            ldg16(a.v + (size_t)t * a.v_ld + (size_t)h * a.v_hs + c * 8);
    }
}

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

extern "C" __global__ void __launch_bounds__(ATT_THREADS) ninfer_attention(AttnArgs a) {
    grid_release();
    grid_wait();
    extern __shared__ __align__(16) unsigned char smem_raw[];
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
    bf16* Qs = reinterpret_cast<bf16*>(smem_raw);
    bf16* Ks = Qs + ATT_ROWS * DP;
    bf16* Vs = Ks + ATT_TILE * DP;
    float* Ps = reinterpret_cast<float*>(Vs + ATT_TILE * DP);
    float* Mrow = Ps + ATT_ROWS * ATT_TILE;
    float* Lrow = Mrow + ATT_ROWS;
    float* Arow = Lrow + ATT_ROWS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    for (int i = tid; i < ATT_ROWS * chunks; i += ATT_THREADS) {
        const int r = i / chunks, c = i - r * chunks;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < R) {
            const int t = q0 + tile_tok + r / G, h = kvh * G + r % G;
            v = ldg16(a.q + (size_t)t * a.q_ld + (size_t)h * a.q_hs + c * 8);
        }
        *reinterpret_cast<uint4*>(Qs + r * DP + c * 8) = v;
    }
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
        for (int i = tid; i < ATT_TILE * chunks; i += ATT_THREADS) {
            const int p = i / chunks, c = i - p * chunks;
            const int pos = p0 + p;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
            if (pos < kv_end) {
                const int page = a.block_table[(size_t)s * a.bt_stride + pos / a.page_size];
                const size_t row = (size_t)page * a.page_size + pos % a.page_size;
                const size_t off = (row * a.kv_heads + kvh) * D + c * 8;
                kv = ldg16(a.k_cache + off);
                vv = ldg16(a.v_cache + off);
            }
            *reinterpret_cast<uint4*>(Ks + p * DP + c * 8) = kv;
            *reinterpret_cast<uint4*>(Vs + p * DP + c * 8) = vv;
        }
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
    // One thread per output dim; the split partials of a dim are read coalesced across threads.
    for (int d = tid; d < a.dim; d += 256) {
        const float* src = a.part_o + (size_t)row * a.splits * a.dim + d;
        float o = 0.f;
        for (int i = 0; i < a.splits; ++i) o = fmaf(src[(size_t)i * a.dim], weight[i], o);
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
