// safetensors reader and writer. The reader validates everything it reads: header length, JSON syntax,
// dtypes, shapes against byte ranges, offsets outside the data section or overlapping each other.
// `__metadata__` (a string -> string map) is kept.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "dsacp/status.h"
#include "dsacp/tensor.h"

namespace dsacp {

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;         // by name
  std::map<std::string, std::string> metadata;   // __metadata__
  const Tensor* find(const std::string& name) const {
    auto it = tensors.find(name);
    return it == tensors.end() ? nullptr : &it->second;
  }
};

// Parses a whole file image. Errors are one line: "safetensors: tensor \"q_nope\": data_offsets [0, 96]
// do not match shape [4, 2, 8] of F32 (256 bytes)".
Result<SafetensorsFile> safetensors_parse(std::string_view bytes);
Result<SafetensorsFile> safetensors_read(const std::string& path);

// Serializes tensors (in name order) with the metadata; the header is padded with spaces to 8 bytes.
Result<std::string> safetensors_serialize(const SafetensorsFile& file);
Status safetensors_write(const std::string& path, const SafetensorsFile& file);

}  // namespace dsacp
