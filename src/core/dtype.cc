#include "dsacp/dtype.h"

#include <string>

namespace dsacp {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kI32: return "I32";
    case DType::kF8E4M3: return "F8_E4M3";
  }
  return "?";
}

Result<DType> dtype_from_name(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "BF16") return DType::kBF16;
  if (name == "I32") return DType::kI32;
  if (name == "F8_E4M3") return DType::kF8E4M3;
  return invalid_argument("unsupported dtype \"" + std::string(name) + "\" (supported: F32, BF16, I32, F8_E4M3)");
}

}  // namespace dsacp
