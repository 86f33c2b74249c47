// DepthwiseConv's block on 8 AVX2 lanes with FMA: each lane one output's chain over the taps,
// as the portable block's (depthwise_conv.h). A plane's outputs are taken eight at a time
// (a row's, and across rows where a row is short), up to eight of those vectors at once: each
// chain waits on the one fused multiply-add before it, so the block keeps eight independent.
#include <vector>

#include "depthwise_conv.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace normgrad {
namespace {

constexpr int kChains = 8;

// One vector of outputs: where tap 0 reads it in the scratch, where it goes, how many lanes.
struct Position {
  const float* base;
  float* out;
  size_t count;
};

// sum over the taps (row by row of the kernel) from the bias, for kVectors positions at once.
template <int kVectors>
inline void block(const Position* at, const size_t* tap_offset, const float* w, size_t taps, float bias) {
  __m256 sum[kVectors];
  for (int v = 0; v < kVectors; ++v) sum[v] = _mm256_set1_ps(bias);
  for (size_t t = 0; t < taps; ++t) {
    const __m256 tap = _mm256_set1_ps(w[t]);
    for (int v = 0; v < kVectors; ++v) {
      sum[v] = _mm256_fmadd_ps(tap, _mm256_loadu_ps(at[v].base + tap_offset[t]), sum[v]);
    }
  }
  for (int v = 0; v < kVectors; ++v) {
    if (at[v].count == kDepthwiseLanes) {
      _mm256_storeu_ps(at[v].out, sum[v]);
    } else {  // a row's last outputs: a whole vector (the scratch's slack), the first of it kept
      alignas(32) float last[kDepthwiseLanes];
      _mm256_store_ps(last, sum[v]);
      std::copy(last, last + at[v].count, at[v].out);
    }
  }
}

}  // namespace

void depthwise_forward_plane_avx2(const DepthwiseGeometry& g, const DepthwiseScratch& s, const float* x_plane,
                                  const float* w_taps, float bias, float* y_plane) {
  thread_local std::vector<float> scratch;
  fill_depthwise_scratch(g, s, x_plane, scratch);
  const size_t* tap_offset = s.tap_offset.data();
  const size_t taps = s.tap_offset.size();
  Position group[kChains];
  int filled = 0;
  for (size_t oh = 0; oh < g.ho; ++oh) {
    const float* row = scratch.data() + oh * g.sh * s.row_stride;
    for (size_t j = 0; j < g.wo; j += kDepthwiseLanes) {
      group[filled++] = {row + j, y_plane + oh * g.wo + j, std::min(kDepthwiseLanes, g.wo - j)};
      if (filled == kChains) {
        block<kChains>(group, tap_offset, w_taps, taps, bias);
        filled = 0;
      }
    }
  }
  const Position* rest = group;
  if (filled >= 4) block<4>(rest, tap_offset, w_taps, taps, bias), rest += 4, filled -= 4;
  if (filled >= 2) block<2>(rest, tap_offset, w_taps, taps, bias), rest += 2, filled -= 2;
  if (filled >= 1) block<1>(rest, tap_offset, w_taps, taps, bias);
}

}  // namespace normgrad
#endif
