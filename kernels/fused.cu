// Products of one row (a single-token pass) with the small launches around them folded in, so
// that a decode step has fewer launches. Each is ninfer_gemv_<enc>_b1 of gemv.cu (GemvArgs,
// accumulate included; one output row per warp; block 256, grid at most ceil(N / 8), warps
// streaming several rows when smaller) whose input row a is built first by every block in
// shared memory from the launch's own inputs, K = m.cols <= 8192 (up to 20 KiB of static
// shared memory), K % 8 == 0 on top of the encoding's multiple; some add an epilogue on each
// output. Every fused kernel gives the bits of the launches it replaces, whose
// shared pieces (rms.cuh, conv.cuh) it calls. Encodings: bf16 and q8_g32.
//
// ninfer_gemv_<enc>_norm_b1  (GemvNormArgs)
//   a = ninfer_rms_norm of the row x (zero-centred, weight norm_w, eps; norm.cu), y = a . W;
//   with a_out, block 0 also stores a there (the input of the launches after it). a_out must
//   not alias x.
//
// ninfer_gemv_<enc>_norm_conv_b1  (NormConvArgs)
//   ninfer_gemv_<enc>_norm_b1 (bf16 y), then ninfer_gdn_conv of the one token for the rows
//   lo <= r < lo + C (the qkv part of the stacked GDN projection): channel c = r - lo of the
//   sequence in state slot *slot, input bf16(y[r]), output conv_y[c], the state [slots, 3, C]
//   moved on by one input.
//
// ninfer_gemv_q8_g32_norm_bulk_b1 / _norm_conv_bulk_b1 / _gnorm_bulk_b1  (GemvNormArgs /
//   NormConvArgs / GatedArgs; K % 256 == 0)
//   ninfer_gemv_q8_g32_norm_b1 / _norm_conv_b1 / _gnorm_b1 with the weights brought into
//   shared memory by the copy engine (cp.async.bulk) and multiplied on the tensor cores
//   (mma.m16n8k16, f16 operands, f32 sums): block b owns the rows [b R, (b + 1) R) (R = ceil(N
//   / gridDim.x) rounded up to 16, at most 256), in stages of one 16-row tile (row strides K +
//   32 and K / 16 + 16 bytes), as many stages in flight as the dynamic shared memory holds (at
//   least one), every one requested before grid_wait(). Codes are exact in f16, and so is the
//   normed row while |a| < 65,504; each 32-column group's sum is scaled in f32 and the warps'
//   partials summed in warp order: not the bits of the lane-loaded kernels. Thread i of a
//   block stores (and convolves) its row i. Launch: block 256, dynamic shared memory stages *
//   16 * (K + 32 + K / 16 + 16) bytes, grid at most ceil(N / 16) (the blocks resident at
//   once). _gnorm_bulk_b1: every block builds the whole gated row (dim / 8 a power of two <=
//   32) and exchanges nothing, yet is launched in clusters of GNORM_CLUSTER (the grid a
//   multiple of it): without them its blocks became resident while the recurrence ahead ran
//   and slowed it (performance-log.md, 2026-12-07).
//
// ninfer_gemv_q8_g32_gnorm_bulk_route_b1 / _bulk_route_b1  (GatedRouteArgs / GemvRouteArgs:
//   GatedArgs / GemvArgs, then RouterFold of route_fold.cuh)
//   ninfer_gemv_q8_g32_gnorm_bulk_b1 / gemv.cu's ninfer_gemv_q8_g32_bulk_b1 added into h
//   (accumulate; a mixer's output projection, N = H), then the MoE router of the same layer on
//   the new h (model-spec.md 2.1 and 2.5 step 1): a = bf16(h / rms(h) (1 + norm_w)) into a_out
//   (ninfer_rms_norm's bits) and, for the `experts` bf16 rows of r ([experts, H], experts <=
//   512), logits[e] = bf16(inv_rms(h) * sum_d r[e, d] (1 + norm_w[d]) h[d]): the normed router
//   product without a's rounding, so not its bits (the bf16 of the same sum in another form).
//   Every block adds its rows' share of each sum into acc as an int64 of 2^-32, so the sums
//   do not depend on the blocks' order; the last block to take a ticket norms h, stores a
//   and the logits, and sets acc and the ticket back to zero: both must be zero at launch
//   (allocated zeroed), and launches sharing them run one after the other. That block then
//   routes the logits as ninfer_moe_route routes one token: of the first `routed` rows
//   (routed <= 512) the top-k (topk <= min(routed, 32)) into ids [topk] and route_w [topk],
//   and with a gate row (experts == routed + 1) its sigmoid into route_w[topk]. N % 8 == 0,
//   N <= 8192, |sum| < 2^31. Launch: as the kernel it extends.
//
// ninfer_gemv_q8_g32_norm_bulk_b8, _norm_conv_bulk_b8  (GemvNormArgs / NormConvArgs; 2-8 rows,
//   K % 256 == 0, K <= 4096)
//   ninfer_gemv_q8_g32_norm_mma_b8 / _norm_conv_mma_b8 (below) on gemv_bulk.cuh's
//   bulk_rows_product: the normed rows (their bits) at the start of the dynamic shared memory,
//   turned into f16 in place (exact while |a| < 65,504), then the weight stages of the one-row
//   bulk kernels, B's column b the row b; the sums in their order (not the bits of the mma
//   kernels). Launch: block 256, dynamic shared memory norm_smem(batch, K) rounded up to 128
//   plus the stages, grid at most ceil(N / 16) (the blocks resident at once).
//
// ninfer_gemv_q8_g32_gnorm_bulk_b8  (GatedArgs; 2-8 rows, K % 256 == 0, K <= 4096)
//   ninfer_gemv_q8_g32_gnorm_bulk_b1 for g.batch rows x[b] (row stride g.ldx) with gates z[b]
//   (row stride ldz), y [batch, g.ldy], on bulk_rows_product: the gated rows (row stride
//   NORM_LD(K), batch * NORM_LD(K) * 2 bytes rounded up to 128) at the start of the dynamic
//   shared memory, built once per cluster of GNORM_CLUSTER blocks (head i of the rows laid end
//   to end by block i % 8), then the weight stages. Launch: block 256, grid a multiple of
//   GNORM_CLUSTER, dynamic shared memory those rows plus the stages.
//
// ninfer_gemv_<enc>_gnorm_b1  (GatedArgs)
//   a = ninfer_gated_rms_norm of x as K / dim rows of dim (one token's value heads) with their
//   gates z (head i at z + i * dim) and weight norm_w [dim], then y = a . W (with accumulate:
//   added into bf16 y, the output projection's residual add). dim % 8 == 0. Launched in
//   clusters of GNORM_CLUSTER blocks (the grid a multiple of it): each block of a cluster
//   builds every GNORM_CLUSTER-th head and takes the others' from their shared memory.
//
// ninfer_gemv_<enc>_norm_mma_b8 / _b16  (GemvNormArgs; batches of 2-8 / 9-16 rows)
//   ninfer_gemv_<enc>_norm_b1 for g.batch rows x[b] (row stride g.ldx), y [batch, g.ldy], on
//   the tensor-core product of gemv.cu's ninfer_gemv_<enc>_mma_b<NB> (gemv_mma.cuh): every block
//   norms the batch's rows once into dynamic shared memory with ninfer_rms_norm's sums in its
//   order (the same bits), block 0 also storing them in a_out [batch, K], then streams 16-row
//   tiles. Rows of NORM_LD(K) = ceil(K / 64) * 64 + 32 bf16, so that the eight rows and four
//   column chunks a quarter warp reads fall on distinct banks. Dynamic shared memory (fused.rs):
//   batch * NORM_LD(K) * 2 + K * 2 + batch * K / 2 bytes. Launch: block 256, grid at most
//   ceil(N / 16) (the blocks resident at once: block b takes tiles b, b + gridDim.x, ...).
//
// ninfer_gemv_<enc>_norm_conv_mma_b8 / _b16  (NormConvArgs; a decode batch of 2-16 sequences)
//   ninfer_gemv_<enc>_norm_mma_b<NB> (bf16 y), then ninfer_gdn_conv of row b as a one-token
//   sequence in state slot slot[b], for the rows lo <= r < lo + C: conv_y [batch, C], the
//   states [slots, 3, C] moved on by one input. The thread that stores output (r, b) runs its
//   conv, with the state it loaded right after grid_wait().
#include <cooperative_groups.h>

#include "conv.cuh"
#include "gemv_bulk.cuh"
#include "rms.cuh"
#include "route_fold.cuh"

#define FUSED_MAX_K BULK_MAX_K
#define FUSED_THREADS BULK_THREADS
#define FUSED_PER (FUSED_MAX_K / 8 / FUSED_THREADS)  // 8-element chunks of the row per thread

// The product of the row that `fill` builds in shared memory, each warp taking rows
// blockIdx.x * 8 + warp + k * gridDim.x * 8 (a grid of fewer blocks than ceil(N / 8) streams
// several rows per warp, D chunk loads in flight per lane), then `epi(row, v)` by every lane
// of each row's warp after lane 0's store (v: the f32 sum times the row's multiplier, the same
// bits in every lane). No early return: the block synchronises on the row. Building the row
// once per block, not per element inside the dot product, keeps the product bound by its
// weights: the per-element norm made the GDN input projection 50 % slower (decode profile of
// commit d85f2b4, H200).
template <typename Enc, int D, typename Fill, typename Epi>
__device__ __forceinline__ void row_product(const GemvArgs& a, Fill fill, Epi epi) {
    constexpr int CH = Enc::CHUNK;
    __shared__ __align__(16) bf16 xs[FUSED_MAX_K];
    grid_release();
    const int lane = threadIdx.x & 31;
    const int row0 = blockIdx.x * 8 + (threadIdx.x >> 5);
    // A warp without rows only builds the row and waits like the others.
    RowStream<Enc, D> rs;
    rs.start(a.m, row0, gridDim.x * 8, lane);
    grid_wait();
    fill(xs);
    __syncthreads();
    float acc = 0.f;
    rs.each(
        a.m, row0,
        [&](int c, const float (&w)[CH], const float (&sc)[Enc::GROUPS]) { acc += chunk_dot<Enc, true>(w, sc, xs + (size_t)c * CH); },
        [&](int row) {
            acc = warp_sum1(acc);
            const float v = acc * row_multiplier<Enc>(a.m, 0, row);
            if (lane == 0) store_out(a.y, row, v, a.out_f32, a.accumulate);
            epi(row, v);
            acc = 0.f;
        });
}

struct GemvNormArgs {
    GemvArgs g;
    const bf16* norm_w;
    bf16* a_out;
    float eps;
    int pad;
};
static_assert(sizeof(GemvNormArgs) == 112, "mirrored in crates/ninfer-kernels/src/fused.rs");

// The zero-centred norm of x into xs (and a_out from block 0), each element as norm.cu rounds it,
// in one round trip to memory: thread i loads chunks i, i + 256, ... of x once, their sums of
// squares (sq8) meet in shared memory, and warp 0 sums them in rms.cuh's order (lane l the
// chunks l, l + 32, ..., then the warp), so the block-wide norm gives the one-warp norm's bits.
__device__ __forceinline__ void fill_norm(bf16* xs, const GemvNormArgs& na) {
    __shared__ float part[FUSED_MAX_K / 8];
    __shared__ float inv_s;
    const int k = na.g.m.cols, nch = k / 8;
    uint4 xr[FUSED_PER];
#pragma unroll
    for (int i = 0; i < FUSED_PER; ++i) {
        const int c = threadIdx.x + FUSED_THREADS * i;
        if (c < nch) {
            xr[i] = ldg16(na.g.x + c * 8);
            prefetch_l1(na.norm_w + c * 8);
        }
    }
#pragma unroll
    for (int i = 0; i < FUSED_PER; ++i) {
        const int c = threadIdx.x + FUSED_THREADS * i;
        if (c < nch) {
            float v[8];
            unpack_bf8(xr[i], v);
            part[c] = sq8(v);
        }
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        float ss = 0.f;
        for (int c = threadIdx.x; c < nch; c += NINFER_WARP) ss += part[c];
        ss = warp_sum1(ss);
        if (threadIdx.x == 0) inv_s = rsqrtf(ss / (float)k + na.eps);
    }
    __syncthreads();
    const float inv = inv_s;
    bf16* a_out = blockIdx.x == 0 ? na.a_out : nullptr;
#pragma unroll
    for (int i = 0; i < FUSED_PER; ++i) {
        const int c = threadIdx.x + FUSED_THREADS * i;
        if (c >= nch) break;
        float v[8], wv[8];
        unpack_bf8(xr[i], v);
        unpack_bf8(ldg16(na.norm_w + c * 8), wv);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = v[j] * inv * (1.0f + wv[j]);
        const uint4 p = pack_bf8(v);
        *reinterpret_cast<uint4*>(xs + c * 8) = p;
        if (a_out != nullptr) *reinterpret_cast<uint4*>(a_out + c * 8) = p;
    }
}

template <typename Enc>
__device__ __forceinline__ void gemv_norm_body(const GemvNormArgs& na) {
    // 8 of bf16's 16-byte chunks in flight per lane: a 2048-column row (the router's, one per
    // warp) is then in registers before grid_wait(), where half of it was loaded after.
    row_product<Enc, Enc::CHUNK == 8 ? 8 : 4>(na.g, [&](bf16* xs) { fill_norm(xs, na); }, [](int, float) {});
}

__device__ __forceinline__ void gemv_norm_bulk_body(const GemvNormArgs& na) {
    bulk_product(na.g, [&](bf16* xs) { fill_norm(xs, na); }, [](int, float) {});
}

struct NormConvArgs {
    GemvNormArgs n;
    const bf16* conv_w;  // [C, 4]
    bf16* state;         // [slots, 3, C]
    bf16* conv_y;        // [C] (one row), [batch, C] (a batch)
    const int* slot;     // the sequence's state slot, or each row's in a batch
    int lo;
    int channels;
};
static_assert(sizeof(NormConvArgs) == 152, "mirrored in crates/ninfer-kernels/src/fused.rs");

// Lane k of a warp convolves the warp's k-th row (rows per warp <= 32, the launcher's check):
// it loads that row's conv state right after grid_wait(), ahead of the norm, into shared memory
// (registers held across the product cost the kernel a resident block), so that no row's
// epilogue waits on memory (loaded in the epilogue, slot then state, the two round trips per
// row held up each warp's next row). BULK: the product of bulk_product, whose thread i stores
// the block's row i, which it then convolves; else of row_product.
template <typename Enc, bool BULK>
__device__ __forceinline__ void norm_conv_body(const NormConvArgs& a) {
    __shared__ float hist[3][FUSED_THREADS];
    __shared__ uint2 taps[FUSED_THREADS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, me = threadIdx.x;
    const size_t C = a.channels;
    int my_row = blockIdx.x * 8 + warp + lane * gridDim.x * 8;
    if (BULK) {
        // bulk_product's thread i stores (and here convolves) the block's row i.
        const BulkRows rows = bulk_rows(a.n.g.m.rows);
        my_row = rows.begin + me < rows.end ? rows.begin + me : -1;
    }
    const int my_c = my_row - a.lo;
    const bool mine = my_row >= 0 && my_c >= 0 && my_c < a.channels;
    if (mine) taps[me] = __ldg(reinterpret_cast<const uint2*>(a.conv_w + (size_t)my_c * 4));
    int k = 0;
    const auto fill = [&](bf16* xs) {
        if (mine) {
            const bf16* st = a.state + (size_t)*a.slot * 3 * C + my_c;
            hist[0][me] = bf2f(st[0]);
            hist[1][me] = bf2f(st[C]);
            hist[2][me] = bf2f(st[2 * C]);
        }
        fill_norm(xs, a.n);
    };
    const auto epi = [&](int, float v) {
        if ((!BULK && k++ != lane) || !mine) return;
        const float x = round_bf(v), h1 = hist[1][me], h2 = hist[2][me];
        a.conv_y[my_c] = conv4_silu(taps[me], hist[0][me], h1, h2, x);
        bf16* st = a.state + (size_t)*a.slot * 3 * C + my_c;
        st[0] = f2bf(h1);
        st[C] = f2bf(h2);
        st[2 * C] = f2bf(x);
    };
    if constexpr (BULK)
        bulk_product(a.n.g, fill, epi);
    else
        row_product<Enc, 4>(a.n.g, fill, epi);
}

struct GatedArgs {
    GemvArgs g;
    const bf16* z;
    const bf16* norm_w;
    int dim;
    float eps;
    int ldz;  // a batch's z row stride
    int pad;
};
static_assert(sizeof(GatedArgs) == 120, "mirrored in crates/ninfer-kernels/src/fused.rs");

#define GNORM_CLUSTER 8  // mirrored in crates/ninfer-kernels/src/fused.rs

// One chunk of eight elements x of a gated-normed head, scaled by its head's inv_rms, as
// norm.cu's ninfer_gated_rms_norm rounds them. Both fills below go through it, so that their
// bits are one definition's.
__device__ __forceinline__ uint4 gated8(float (&v)[8], float inv, const uint4 wv, const uint4 zv) {
    float w[8], g[8];
    unpack_bf8(wv, w);
    unpack_bf8(zv, g);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = round_bf(round_bf(v[e] * inv) * w[e]) * silu(g[e]);
    return pack_bf8(v);
}

// The gated norm of every head into xs, each element as norm.cu's ninfer_gated_rms_norm
// computes and rounds it. Block r of a cluster builds heads r, r + 8, ... (warp w the w-th of
// them, then every eighth), so a warp builds one head where it built four in turn, and each
// head's x and z are read from L2 by one block of the cluster instead of eight; then every
// block copies the heads it did not build from their builders' shared memory. (Building all
// heads in every block, whether a warp's four heads in turn, the block-wide form of fill_norm,
// or the heads' rows asked of L1 up front, cost 15.3 µs per launch on the H200, the last two
// 19 and 25 % more.) The copies are read before a cluster barrier that gnorm_body waits on
// before the block exits, so no block's shared memory goes while another reads it.
__device__ __forceinline__ void fill_gated(bf16* xs, const GatedArgs& a, int rows, int ld) {
    namespace cg = cooperative_groups;
    const cg::cluster_group cl = cg::this_cluster();
    const int rank = (int)cl.block_rank();
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5, heads = a.g.m.cols / a.dim;
    // Head i of the rows laid end to end is head i % heads of row i / heads, built by rank i % 8.
    for (int i = rank + GNORM_CLUSTER * (threadIdx.x >> 5); i < rows * heads; i += GNORM_CLUSTER * warps) {
        const int b = rows == 1 ? 0 : i / heads, hd = i - b * heads;  // rows: 1 at compile time for one row
        const bf16* x = a.g.x + (size_t)b * a.g.ldx + (size_t)hd * a.dim;
        const bf16* z = a.z + (size_t)b * a.ldz + (size_t)hd * a.dim;
        const float inv = inv_rms(x, a.dim, a.eps, lane);
        for (int c = lane; c < a.dim / 8; c += NINFER_WARP) {
            float v[8];
            unpack_bf8(ldg16(x + c * 8), v);
            *reinterpret_cast<uint4*>(xs + (size_t)b * ld + (size_t)hd * a.dim + c * 8) =
                gated8(v, inv, ldg16(a.norm_w + c * 8), ldg16(z + c * 8));
        }
    }
    cl.sync();
    const int nch = a.g.m.cols / 8;
    for (int i = threadIdx.x; i < rows * nch; i += blockDim.x) {
        const int b = rows == 1 ? 0 : i / nch, c = i - b * nch;
        const int owner = (b * heads + c * 8 / a.dim) % GNORM_CLUSTER;
        uint4* p = reinterpret_cast<uint4*>(xs + (size_t)b * ld + c * 8);
        if (owner != rank) *p = *cl.map_shared_rank(p, owner);
    }
    cl.barrier_arrive();
}

template <typename Enc>
__device__ __forceinline__ void gnorm_body(const GatedArgs& a) {
    row_product<Enc, 4>(a.g, [&](bf16* xs) { fill_gated(xs, a, 1, a.g.m.cols); }, [](int, float) {});
    cooperative_groups::this_cluster().barrier_wait();
}

// One row's gated norm into xs by the whole block, for bulk_product: thread i the chunks i, i +
// 256, ... of the row (those it turns into f16 next, as copy_row), the x, z and norm weight of
// all of them asked for at once. A head's dim / 8 chunks are consecutive lanes of one warp
// (dim / 8 a power of two <= 32), which sum their squares as inv_rms's warp does (its lanes
// past the head's chunks add zeros), so every element has fill_gated's bits without a cluster:
// one round trip to L2 where the clustered form had two, a cluster barrier and its neighbours'
// shared memory.
__device__ __forceinline__ void fill_gated_row(bf16* xs, const GatedArgs& a) {
    constexpr int PER = BULK_MAX_K / 8 / BULK_THREADS;
    const int nch = a.g.m.cols / 8, hc = a.dim / 8;
    uint4 xv[PER], zv[PER], wv[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int c = threadIdx.x + BULK_THREADS * i;
        if (c < nch) {
            xv[i] = ldg16(a.g.x + c * 8);
            zv[i] = ldg16(a.z + c * 8);
            wv[i] = ldg16(a.norm_w + (c & (hc - 1)) * 8);
        }
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        if (BULK_THREADS * i >= nch) break;  // the same for the whole block: every lane shuffles
        const int c = threadIdx.x + BULK_THREADS * i;
        float v[8];
        float ss = 0.f;
        if (c < nch) {
            unpack_bf8(xv[i], v);
            ss = sq8(v);
        }
        for (int o = hc / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (c >= nch) continue;
        *reinterpret_cast<uint4*>(xs + c * 8) = gated8(v, rsqrtf(ss / (float)a.dim + a.eps), wv[i], zv[i]);
    }
}

__device__ __forceinline__ auto gated_bulk_fill(const GatedArgs& a) {
    return [&a](bf16* xs) { fill_gated_row(xs, a); };
}

__device__ __forceinline__ void gnorm_bulk_body(const GatedArgs& a) { bulk_product(a.g, gated_bulk_fill(a), [](int, float) {}); }

struct GatedRouteArgs {
    GatedArgs g;
    RouterFold f;
};
static_assert(sizeof(GatedRouteArgs) == 200, "mirrored in crates/ninfer-kernels/src/fused.rs");

struct GemvRouteArgs {
    GemvArgs g;
    RouterFold f;
};
static_assert(sizeof(GemvRouteArgs) == 168, "mirrored in crates/ninfer-kernels/src/fused.rs");

// bulk_product adding into h (accumulate) with the router folded in (route_fold.cuh): thread i
// keeps the row it stores, read back as stored, then the block adds its share.
template <typename Fill>
__device__ __forceinline__ void bulk_route(const GemvArgs& g, const RouterFold& f, Fill fill) {
    __shared__ FoldSmem sm;
    const BulkRows rows = bulk_rows(g.m.rows);
    FoldShare s;
    s.start(f, g.m.rows, rows.begin, rows.end - rows.begin);
    const bf16* h = static_cast<const bf16*>(g.y);
    bulk_product(g, fill, [&](int row, float) { fold_keep(sm, s, row, h[row]); });
    fold_finish(f, s, sm, h, g.m.rows);
}

// The same for a batch of 2-8 rows on bulk_rows_product: its rows at the start of the dynamic
// shared memory.
__device__ __forceinline__ void gnorm_bulk_rows_body(const GatedArgs& a) {
    extern __shared__ __align__(16) bf16 xs_dyn[];
    const int ld = NORM_LD(a.g.m.cols);
    bulk_rows_product<1>(
        a.g, xs_dyn, ld, bulk_align(a.g.batch * ld * 2),
        [&] {
            fill_gated(xs_dyn, a, a.g.batch, ld);
            cooperative_groups::this_cluster().barrier_wait();
        },
        [](int) {}, [](int, int, float) {});
}

// The batch's rows normed into xs (row stride NORM_LD(K)), each element as ninfer_rms_norm
// computes it: every thread loads its chunks of x (chunk i of the rows laid end to end, i =
// thread, thread + 256, ...; four loads in flight) and of norm_w into shared memory with each
// chunk's sum of squares (sq8); warp w then sums rows w and w + 8 in rms.cuh's order (lane l
// the chunks l, l + 32, ..., then the warp), and the chunks are normed in place; block 0 also
// stores them in a_out. Dynamic shared memory after xs: norm_w [K] bf16, then the chunks' sums
// [batch, K / 8] f32 (norm_smem in fused.rs). (Every chunk copied by cp.async, all in flight
// at once, was slower: docs/performance-log.md.)
__device__ __forceinline__ void fill_norm_rows(bf16* xs, const GemvNormArgs& na) {
    __shared__ float inv_s[16];
    const int k = na.g.m.cols, nch = k / 8, total = na.g.batch * nch;
    bf16* ws = xs + (size_t)na.g.batch * NORM_LD(k);
    float* sq = reinterpret_cast<float*>(ws + k);
    for (int c = threadIdx.x; c < nch; c += FUSED_THREADS)
        *reinterpret_cast<uint4*>(ws + c * 8) = ldg16(na.norm_w + c * 8);
#pragma unroll 4
    for (int i = threadIdx.x; i < total; i += FUSED_THREADS) {
        const int b = i / nch, c = i - b * nch;
        const uint4 raw = ldg16(na.g.x + (size_t)b * na.g.ldx + c * 8);
        float v[8];
        unpack_bf8(raw, v);
        *reinterpret_cast<uint4*>(xs + (size_t)b * NORM_LD(k) + c * 8) = raw;
        sq[i] = sq8(v);
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int b = warp; b < na.g.batch; b += MMA_WARPS) {
        float ss = 0.f;
        for (int c = lane; c < nch; c += NINFER_WARP) ss += sq[b * nch + c];
        ss = warp_sum1(ss);
        if (lane == 0) inv_s[b] = rsqrtf(ss / (float)k + na.eps);
    }
    __syncthreads();
    bf16* a_out = blockIdx.x == 0 ? na.a_out : nullptr;
#pragma unroll 4
    for (int i = threadIdx.x; i < total; i += FUSED_THREADS) {
        const int b = i / nch, c = i - b * nch;
        uint4* p = reinterpret_cast<uint4*>(xs + (size_t)b * NORM_LD(k) + c * 8);
        const float inv = inv_s[b];
        float v[8], wv[8];
        unpack_bf8(*p, v);
        unpack_bf8(*reinterpret_cast<const uint4*>(ws + c * 8), wv);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = v[j] * inv * (1.0f + wv[j]);
        const uint4 out = pack_bf8(v);
        *p = out;
        if (a_out != nullptr) *reinterpret_cast<uint4*>(a_out + (size_t)b * k + c * 8) = out;
    }
}

// The dynamic shared memory fill_norm_rows takes for `batch` rows of K (norm_smem in fused.rs),
// rounded up to the 128 bytes after which bulk_rows_product's stages start.
__device__ __forceinline__ int norm_rows_bytes(int batch, int k) {
    return bulk_align(batch * NORM_LD(k) * 2 + k * 2 + batch * k / 2);
}

// A normed product of 2-16 rows: on mma_product, or with BULK (q8_g32, K % 256 == 0) on
// bulk_rows_product, its stages after the rows.
template <typename M, int NT, bool BULK, typename Fill, typename Begin, typename Epi>
__device__ __forceinline__ void normed_rows_product(const GemvArgs& g, bf16* xs, Fill fill, Begin begin, Epi epi) {
    const int k = g.m.cols;
    if constexpr (BULK)
        bulk_rows_product<NT>(g, xs, NORM_LD(k), norm_rows_bytes(g.batch, k), fill, begin, epi);
    else
        mma_product<M, NT, 4, true, true>(g, xs, NORM_LD(k), fill, begin, epi);
}

template <typename M, int NT, bool BULK>
__device__ __forceinline__ void norm_mma_body(const GemvNormArgs& na) {
    extern __shared__ __align__(16) bf16 xs_dyn[];
    normed_rows_product<M, NT, BULK>(na.g, xs_dyn, [&] { fill_norm_rows(xs_dyn, na); }, [](int) {}, [](int, int, float) {});
}

// Thread i stores output i of each of its block's tiles (16 rows x 8 * NT slots, at most one
// each with the 256 threads): its row's slot is read before the norm, and each tile's conv
// state as the tile starts, so that the epilogue waits on no memory.
template <typename M, int NT, bool BULK>
__device__ __forceinline__ void norm_conv_mma_body(const NormConvArgs& a) {
    extern __shared__ __align__(16) bf16 xs_dyn[];
    static_assert(16 * 8 * NT <= FUSED_THREADS, "one output per thread");
    const size_t C = a.channels;
    const int r = threadIdx.x / (8 * NT), b = threadIdx.x - r * 8 * NT;
    const bool live = r < 16 && b < a.n.g.batch;
    int slot = 0, c = 0;
    bool mine = false;
    uint2 taps = make_uint2(0, 0);
    float h0 = 0.f, h1 = 0.f, h2 = 0.f;
    bf16* st = nullptr;
    normed_rows_product<M, NT, BULK>(
        a.n.g, xs_dyn,
        [&] {
            if (live) slot = a.slot[b];
            fill_norm_rows(xs_dyn, a.n);
        },
        [&](int tile) {
            c = tile * 16 + r - a.lo;
            mine = live && c >= 0 && c < a.channels;
            if (!mine) return;
            taps = __ldg(reinterpret_cast<const uint2*>(a.conv_w + (size_t)c * 4));
            st = a.state + (size_t)slot * 3 * C + c;
            h0 = bf2f(st[0]);
            h1 = bf2f(st[C]);
            h2 = bf2f(st[2 * C]);
        },
        [&](int, int, float v) {
            if (!mine) return;
            const float x = round_bf(v);
            a.conv_y[(size_t)b * C + c] = conv4_silu(taps, h0, h1, h2, x);
            st[0] = f2bf(h1);
            st[C] = f2bf(h2);
            st[2 * C] = f2bf(x);
        });
}

// Held to three blocks per SM of 2-8 rows (80 registers) and two of 9-16, which the conv's
// state registers would otherwise cost (90 registers of 2-8 rows: two blocks).
#define NINFER_FUSED_MMA(name, M, NB, NT, MINB)                                                                           \
    extern "C" __global__ void __launch_bounds__(256, MINB) ninfer_gemv_##name##_norm_mma_b##NB(GemvNormArgs a) {      \
        norm_mma_body<M, NT, false>(a);                                                                                   \
    }                                                                                                                     \
    extern "C" __global__ void __launch_bounds__(256, MINB) ninfer_gemv_##name##_norm_conv_mma_b##NB(NormConvArgs a) { \
        norm_conv_mma_body<M, NT, false>(a);                                                                              \
    }
NINFER_FUSED_MMA(bf16, MmaBf16, 8, 1, 3)
NINFER_FUSED_MMA(bf16, MmaBf16, 16, 2, 2)
NINFER_FUSED_MMA(q8_g32, MmaQ8, 8, 1, 3)
NINFER_FUSED_MMA(q8_g32, MmaQ8, 16, 2, 2)

#define NINFER_FUSED(name, Enc)                                                                          \
    extern "C" __global__ void __launch_bounds__(256) ninfer_gemv_##name##_norm_b1(GemvNormArgs a) {      \
        gemv_norm_body<Enc>(a);                                                                          \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) ninfer_gemv_##name##_norm_conv_b1(NormConvArgs a) { \
        norm_conv_body<Enc, false>(a);                                                                   \
    }                                                                                                    \
    extern "C" __global__ void __cluster_dims__(GNORM_CLUSTER, 1, 1)                                        \
        __launch_bounds__(256) ninfer_gemv_##name##_gnorm_b1(GatedArgs a) {                              \
        gnorm_body<Enc>(a);                                                                              \
    }
NINFER_FUSED(bf16, EncBf16)
NINFER_FUSED(q8_g32, EncQ8)

extern "C" __global__ void __launch_bounds__(256) ninfer_gemv_q8_g32_norm_bulk_b1(GemvNormArgs a) { gemv_norm_bulk_body(a); }
extern "C" __global__ void __launch_bounds__(256) ninfer_gemv_q8_g32_norm_conv_bulk_b1(NormConvArgs a) { norm_conv_body<EncQ8, true>(a); }
extern "C" __global__ void __cluster_dims__(GNORM_CLUSTER, 1, 1) __launch_bounds__(256) ninfer_gemv_q8_g32_gnorm_bulk_b1(GatedArgs a) {
    gnorm_bulk_body(a);
}
extern "C" __global__ void __cluster_dims__(GNORM_CLUSTER, 1, 1) __launch_bounds__(256) ninfer_gemv_q8_g32_gnorm_bulk_route_b1(GatedRouteArgs a) {
    bulk_route(a.g.g, a.f, gated_bulk_fill(a.g));
}
extern "C" __global__ void __launch_bounds__(256) ninfer_gemv_q8_g32_bulk_route_b1(GemvRouteArgs a) {
    bulk_route(a.g, a.f, [&](bf16* xs) { copy_row(xs, a.g.x, a.g.m.cols); });
}
extern "C" __global__ void __cluster_dims__(GNORM_CLUSTER, 1, 1) __launch_bounds__(256) ninfer_gemv_q8_g32_gnorm_bulk_b8(GatedArgs a) {
    gnorm_bulk_rows_body(a);
}
// 2-8 rows by bulk copies (one block per SM at most, by their shared memory). Of 9-16 rows the
// same kernels (and the gated norm's) made a decode step of 16 sequences slower than the
// tensor-core kernels above (performance-log.md, 2026-12-05): they are not built.
extern "C" __global__ void __launch_bounds__(256) ninfer_gemv_q8_g32_norm_bulk_b8(GemvNormArgs a) { norm_mma_body<MmaQ8, 1, true>(a); }
extern "C" __global__ void __launch_bounds__(256) ninfer_gemv_q8_g32_norm_conv_bulk_b8(NormConvArgs a) { norm_conv_mma_body<MmaQ8, 1, true>(a); }
