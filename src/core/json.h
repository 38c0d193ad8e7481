// A small, strict JSON parser and string quoting, enough for safetensors headers (internal to dsacp).
//
// Strict means RFC 8259 and nothing more: no comments, no trailing commas, no NaN/Infinity, no leading
// zeros or '+', no control characters or invalid UTF-8 in strings, unpaired surrogates refused, and
// duplicate object keys refused (a header where one key shadows another is ambiguous). Nesting is capped
// so hostile input cannot exhaust the stack. Errors are one line and give the byte offset.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dsacp/status.h"

namespace dsacp::json {

enum class Kind : uint8_t { kNull, kBool, kNumber, kString, kArray, kObject };

const char* kind_name(Kind kind);  // "null", "boolean", "number", "string", "array", "object"

struct Value {
  Kind kind = Kind::kNull;
  bool boolean = false;
  // Numbers: `number` always; `is_integer` when the literal has no fraction or exponent and fits int64,
  // in which case `integer` holds it exactly.
  double number = 0.0;
  bool is_integer = false;
  int64_t integer = 0;
  std::string string;
  // Arrays: `items`. Objects: `keys[i]` names `items[i]`, in document order, keys unique.
  std::vector<Value> items;
  std::vector<std::string> keys;

  // The member named `key` of an object, or nullptr.
  const Value* find(std::string_view key) const;
};

inline constexpr int kMaxDepth = 64;

// Parses one JSON document (surrounding whitespace allowed, nothing else after it).
Result<Value> parse(std::string_view text);

// `s` as a JSON string literal, quotes included; control characters, '"' and '\\' escaped, so the result
// is always one line. Bytes >= 0x80 are copied as they are.
std::string quote(std::string_view s);

}  // namespace dsacp::json
