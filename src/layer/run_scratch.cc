#include "layer/run_scratch.h"

#include <algorithm>
#include <string>

namespace dsacp {

Status RunScratch::begin_run(const char* who) {
  bool expected = false;
  if (!busy_.compare_exchange_strong(expected, true)) {
    return invalid_argument(std::string(who) + ": the plan is in use by another run (runs of one plan go one " +
                               "after the other; make one plan per thread)");
  }
  next_ = 0;
  return Status();
}

Result<DeviceBuffer> RunScratch::take(Backend& backend, size_t bytes) {
  // Rounded up to 256 bytes, so every buffer starts aligned for any kernel's vector loads.
  const size_t want = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  if (next_ == blocks_.size()) blocks_.emplace_back();
  DeviceBuffer& b = blocks_[next_];
  if (b.bytes() < want) {
    bytes_ -= b.bytes();
    b.reset();
    DSACP_ASSIGN_OR_RETURN(b, backend.allocate(want));
    bytes_ += want;
    ++allocations_;
  }
  ++next_;
  return DeviceBuffer(b.get(), bytes, nullptr);
}

}  // namespace dsacp
