// A small, strict JSON parser and string quoting, enough for safetensors headers (internal to dsacp).
//
// Strict means RFC 8259 and nothing more: no comments, no trailing commas, no NaN/Infinity, no leading
// zeros or '+', no control characters or invalid UTF-8 in strings, unpaired surrogates refused, and
// duplicate object keys refused (a header where one key shadows another is ambiguous). Nesting is capped
// (kMaxDepth) so hostile input cannot exhaust the stack, and so is the number of values in a document
// (kMaxValues) so it cannot exhaust memory. The parse takes time linear in the input (duplicate keys are
// found through a hash set). Errors are one line and give the byte offset.
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
// Values (scalars, arrays, objects; object keys not counted) in one document.
inline constexpr int64_t kMaxValues = int64_t{1} << 20;

// Parses one JSON document (surrounding whitespace allowed, nothing else after it).
Result<Value> parse(std::string_view text);

// `s` as a JSON string literal, quotes included; control characters, '"' and '\\' escaped, so the result
// is always one line. Bytes >= 0x80 are copied as they are.
std::string quote(std::string_view s);

// quote() for messages: a string longer than `max_bytes` is cut (at a UTF-8 boundary) and ends in "...", so a
// hostile name cannot make an error line unbounded.
std::string quote_name(std::string_view s, size_t max_bytes = 96);

}  // namespace dsacp::json
