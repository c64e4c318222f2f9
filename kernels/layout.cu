// Weight layouts of the device: rewrites of uploaded weights into the form the kernels read.
//
// ninfer_nvfp4_device_layout
//   words: u32 [n], NVFP4 code words (format.md 3.5), rewritten in place: bit b of code c of
//   each word moves to bit nvfp4_device_bit(c, b) (common.cuh), a permutation of the 32 bits,
//   so every code keeps its value and only where its bits sit changes. Run once per NVFP4
//   matrix after its codes are uploaded, before any kernel reads them; every NVFP4 kernel
//   (experts.cu, experts_batch.cu, gemv.cu through quant.cuh) reads this layout.
//   words 4-byte aligned. Launch: block 256, any grid (a grid-stride loop over the words).
#include "common.cuh"

__device__ __forceinline__ uint32_t nvfp4_device_word(uint32_t w) {
    uint32_t out = 0;
#pragma unroll
    for (int c = 0; c < 8; ++c)
#pragma unroll
        for (int b = 0; b < 4; ++b) out |= ((w >> (4 * c + b)) & 1u) << nvfp4_device_bit(c, b);
    return out;
}

struct LayoutArgs {
    uint32_t* words;
    unsigned long long n;
};
static_assert(sizeof(LayoutArgs) == 16, "mirrored in crates/ninfer-kernels/src/layout.rs");

extern "C" __global__ void __launch_bounds__(256) ninfer_nvfp4_device_layout(LayoutArgs a) {
    grid_release();
    grid_wait();  // the words were written by copies ahead of this launch
    for (unsigned long long i = blockIdx.x * 256ull + threadIdx.x; i < a.n; i += (unsigned long long)gridDim.x * 256ull)
        a.words[i] = nvfp4_device_word(a.words[i]);
}
