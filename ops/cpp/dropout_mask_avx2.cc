// dropout_mask_math.h's loop compiled with -mavx2: the compiler vectorizes the uint32
// arithmetic (integer only, so the same bits as the baseline loop).
#include "dropout_mask_math.h"

namespace normgrad {

void dropout_mask_avx2(uint32_t key, float ratio, uint32_t begin, uint32_t end, bool* mask) {
  dropout_mask_loop(key, ratio, begin, end, mask);
}

}  // namespace normgrad
