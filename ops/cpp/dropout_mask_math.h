// DropoutMask's generator (ops/dropout_mask.py): squares on 30-bit words, all arithmetic in
// uint32 masked to 30 bits (exactly the function body's 15-bit-limb arithmetic mod 2**30).
// Integer only, so any instruction set gives the same bits: dropout_mask.cc runs this loop
// as compiled for the baseline CPU, dropout_mask_avx2.cc as compiled with -mavx2.
#pragma once

#include <cstddef>
#include <cstdint>

namespace normgrad {

constexpr uint32_t kWordMask = (1u << 30) - 1;

inline uint32_t rotate_halves(uint32_t v) { return ((v & 0x7fffu) << 15) | (v >> 15); }

inline uint32_t squares30(uint32_t counter, uint32_t key) {
  const uint32_t y = (counter * key) & kWordMask;
  const uint32_t z = (y + key) & kWordMask;
  uint32_t x = rotate_halves((y * y + y) & kWordMask);
  x = rotate_halves((x * x + z) & kWordMask);
  x = rotate_halves((x * x + y) & kWordMask);
  return (x * x + z) & kWordMask;
}

// mask[e] for e in [begin, end) (end < 2**31): the top 24 bits of squares(e, key) / 2**24
// (exact in float32) >= ratio.
inline void dropout_mask_loop(uint32_t key, float ratio, uint32_t begin, uint32_t end, bool* mask) {
  for (uint32_t e = begin; e < end; ++e) {
    mask[e] = static_cast<float>(squares30(e & kWordMask, key) >> 6) * 0x1p-24f >= ratio;
  }
}

// The loop compiled with -mavx2 (dropout_mask_avx2.cc); run only where update_avx2() is true.
void dropout_mask_avx2(uint32_t key, float ratio, uint32_t begin, uint32_t end, bool* mask);

}  // namespace normgrad
