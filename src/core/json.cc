#include "core/json.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>
#include <unordered_set>

namespace dsacp::json {

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::kNull:
      return "null";
    case Kind::kBool:
      return "boolean";
    case Kind::kNumber:
      return "number";
    case Kind::kString:
      return "string";
    case Kind::kArray:
      return "array";
    case Kind::kObject:
      return "object";
  }
  return "?";
}

const Value* Value::find(std::string_view key) const {
  if (kind != Kind::kObject) return nullptr;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i] == key) return &items[i];
  }
  return nullptr;
}

namespace {

// A recursive-descent parser over a byte range. Every method returns a Status so that the first error
// stops the parse; `pos_` is where the error was found.
class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  Status parse_document(Value* out) {
    skip_whitespace();
    DSACP_RETURN_IF_ERROR(parse_value(out, 0));
    skip_whitespace();
    if (pos_ != text_.size()) return error("unexpected " + describe_here() + " after the JSON value");
    return Status();
  }

 private:
  Status error(const std::string& what) const {
    return data_loss("invalid JSON at byte " + std::to_string(pos_) + ": " + what);
  }

  // The character at pos_, printable, for messages: "'x'", "byte 0x07" or "end of input".
  std::string describe_here() const {
    if (pos_ >= text_.size()) return "end of input";
    const unsigned char c = static_cast<unsigned char>(text_[pos_]);
    if (c >= 0x20 && c < 0x7f) return std::string("'") + static_cast<char>(c) + "'";
    char buf[16];
    std::snprintf(buf, sizeof buf, "byte 0x%02x", c);
    return buf;
  }

  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return text_[pos_]; }

  void skip_whitespace() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) ++pos_;
  }

  bool consume_literal(std::string_view lit) {
    if (text_.substr(pos_, lit.size()) != lit) return false;
    pos_ += lit.size();
    return true;
  }

  Status parse_value(Value* out, int depth) {
    if (depth >= kMaxDepth) return error("nesting deeper than " + std::to_string(kMaxDepth) + " levels");
    if (++values_ > kMaxValues) return error("more than " + std::to_string(kMaxValues) + " values in one document");
    if (at_end()) return error("unexpected end of input, expected a value");
    const char c = peek();
    if (c == '{') return parse_object(out, depth);
    if (c == '[') return parse_array(out, depth);
    if (c == '"') {
      out->kind = Kind::kString;
      return parse_string(&out->string);
    }
    if (c == '-' || (c >= '0' && c <= '9')) return parse_number(out);
    if (consume_literal("true")) {
      out->kind = Kind::kBool;
      out->boolean = true;
      return Status();
    }
    if (consume_literal("false")) {
      out->kind = Kind::kBool;
      out->boolean = false;
      return Status();
    }
    if (consume_literal("null")) {
      out->kind = Kind::kNull;
      return Status();
    }
    return error("unexpected " + describe_here() + ", expected a value");
  }

  Status parse_object(Value* out, int depth) {
    out->kind = Kind::kObject;
    ++pos_;  // '{'
    skip_whitespace();
    if (!at_end() && peek() == '}') {
      ++pos_;
      return Status();
    }
    // Keys seen so far: a hash set keeps the duplicate check O(1) per key (a scan made objects of many keys
    // quadratic).
    std::unordered_set<std::string> seen;
    while (true) {
      skip_whitespace();
      if (at_end() || peek() != '"') return error("unexpected " + describe_here() + ", expected a string key");
      const size_t key_pos = pos_;
      std::string key;
      DSACP_RETURN_IF_ERROR(parse_string(&key));
      if (!seen.insert(key).second) {
        pos_ = key_pos;
        return error("duplicate key " + quote_name(key));
      }
      skip_whitespace();
      if (at_end() || peek() != ':') return error("unexpected " + describe_here() + ", expected ':'");
      ++pos_;
      skip_whitespace();
      Value member;
      DSACP_RETURN_IF_ERROR(parse_value(&member, depth + 1));
      out->keys.push_back(std::move(key));
      out->items.push_back(std::move(member));
      skip_whitespace();
      if (at_end()) return error("unexpected end of input inside an object");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == '}') {
        ++pos_;
        return Status();
      }
      return error("unexpected " + describe_here() + ", expected ',' or '}'");
    }
  }

  Status parse_array(Value* out, int depth) {
    out->kind = Kind::kArray;
    ++pos_;  // '['
    skip_whitespace();
    if (!at_end() && peek() == ']') {
      ++pos_;
      return Status();
    }
    while (true) {
      skip_whitespace();
      Value item;
      DSACP_RETURN_IF_ERROR(parse_value(&item, depth + 1));
      out->items.push_back(std::move(item));
      skip_whitespace();
      if (at_end()) return error("unexpected end of input inside an array");
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == ']') {
        ++pos_;
        return Status();
      }
      return error("unexpected " + describe_here() + ", expected ',' or ']'");
    }
  }

  // -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
  Status parse_number(Value* out) {
    const size_t start = pos_;
    auto digits = [&] {
      size_t n = 0;
      while (!at_end() && peek() >= '0' && peek() <= '9') ++pos_, ++n;
      return n;
    };
    bool integral = true;
    if (peek() == '-') ++pos_;
    if (at_end() || !(peek() >= '0' && peek() <= '9')) return error("expected a digit in number");
    if (peek() == '0') {
      ++pos_;
      if (!at_end() && peek() >= '0' && peek() <= '9') return error("leading zero in number");
    } else {
      digits();
    }
    if (!at_end() && peek() == '.') {
      integral = false;
      ++pos_;
      if (digits() == 0) return error("expected a digit after '.' in number");
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      integral = false;
      ++pos_;
      if (!at_end() && (peek() == '+' || peek() == '-')) ++pos_;
      if (digits() == 0) return error("expected a digit in the exponent of number");
    }
    const std::string_view lit = text_.substr(start, pos_ - start);
    out->kind = Kind::kNumber;
    // from_chars rejects nothing the grammar above accepted; out-of-range doubles become +-inf, which no
    // caller of this parser accepts anyway (they want integers).
    double d = 0.0;
    auto [dp, dec] = std::from_chars(lit.data(), lit.data() + lit.size(), d);
    if (dec == std::errc::result_out_of_range) {
      d = lit[0] == '-' ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity();
    }
    out->number = d;
    if (integral) {
      int64_t v = 0;
      auto [ip, iec] = std::from_chars(lit.data(), lit.data() + lit.size(), v);
      if (iec == std::errc() && ip == lit.data() + lit.size()) {
        out->is_integer = true;
        out->integer = v;
      }
    }
    return Status();
  }

  static void append_utf8(std::string* s, uint32_t cp) {
    if (cp < 0x80) {
      s->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      s->push_back(static_cast<char>(0xc0 | (cp >> 6)));
      s->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else if (cp < 0x10000) {
      s->push_back(static_cast<char>(0xe0 | (cp >> 12)));
      s->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      s->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else {
      s->push_back(static_cast<char>(0xf0 | (cp >> 18)));
      s->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
      s->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      s->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    }
  }

  Status parse_hex4(uint32_t* out) {
    if (text_.size() - pos_ < 4) return error("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[pos_];
      v <<= 4;
      if (c >= '0' && c <= '9') {
        v |= static_cast<uint32_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        v |= static_cast<uint32_t>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        v |= static_cast<uint32_t>(c - 'A' + 10);
      } else {
        return error("invalid hex digit in \\u escape");
      }
      ++pos_;
    }
    *out = v;
    return Status();
  }

  // One UTF-8 encoded code point starting at pos_ (its first byte is >= 0x80); shortest form only, no
  // surrogates, at most U+10FFFF.
  Status copy_utf8_sequence(std::string* out) {
    const unsigned char b0 = static_cast<unsigned char>(text_[pos_]);
    int len = 0;
    uint32_t cp = 0, min = 0;
    if (b0 >= 0xc2 && b0 <= 0xdf) {
      len = 2, cp = b0 & 0x1f, min = 0x80;
    } else if (b0 >= 0xe0 && b0 <= 0xef) {
      len = 3, cp = b0 & 0x0f, min = 0x800;
    } else if (b0 >= 0xf0 && b0 <= 0xf4) {
      len = 4, cp = b0 & 0x07, min = 0x10000;
    } else {
      return error("invalid UTF-8 in string");
    }
    if (text_.size() - pos_ < static_cast<size_t>(len)) return error("truncated UTF-8 sequence in string");
    for (int i = 1; i < len; ++i) {
      const unsigned char b = static_cast<unsigned char>(text_[pos_ + i]);
      if ((b & 0xc0) != 0x80) return error("invalid UTF-8 in string");
      cp = (cp << 6) | (b & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return error("invalid UTF-8 in string");
    out->append(text_.substr(pos_, len));
    pos_ += len;
    return Status();
  }

  Status parse_string(std::string* out) {
    ++pos_;  // '"'
    out->clear();
    while (true) {
      if (at_end()) return error("unterminated string");
      const unsigned char c = static_cast<unsigned char>(peek());
      if (c == '"') {
        ++pos_;
        return Status();
      }
      if (c < 0x20) return error("control character " + describe_here() + " in string");
      if (c >= 0x80) {
        DSACP_RETURN_IF_ERROR(copy_utf8_sequence(out));
        continue;
      }
      if (c != '\\') {
        out->push_back(static_cast<char>(c));
        ++pos_;
        continue;
      }
      ++pos_;
      if (at_end()) return error("unterminated escape in string");
      const char e = peek();
      ++pos_;
      switch (e) {
        case '"':
          out->push_back('"');
          break;
        case '\\':
          out->push_back('\\');
          break;
        case '/':
          out->push_back('/');
          break;
        case 'b':
          out->push_back('\b');
          break;
        case 'f':
          out->push_back('\f');
          break;
        case 'n':
          out->push_back('\n');
          break;
        case 'r':
          out->push_back('\r');
          break;
        case 't':
          out->push_back('\t');
          break;
        case 'u': {
          uint32_t cp = 0;
          DSACP_RETURN_IF_ERROR(parse_hex4(&cp));
          if (cp >= 0xdc00 && cp <= 0xdfff) return error("unpaired low surrogate in \\u escape");
          if (cp >= 0xd800 && cp <= 0xdbff) {
            if (!consume_literal("\\u")) return error("unpaired high surrogate in \\u escape");
            uint32_t lo = 0;
            DSACP_RETURN_IF_ERROR(parse_hex4(&lo));
            if (lo < 0xdc00 || lo > 0xdfff) return error("unpaired high surrogate in \\u escape");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          }
          append_utf8(out, cp);
          break;
        }
        default:
          --pos_;
          return error("invalid escape \\" + describe_here() + " in string");
      }
    }
  }

  std::string_view text_;
  size_t pos_ = 0;
  int64_t values_ = 0;
};

}  // namespace

Result<Value> parse(std::string_view text) {
  Value v;
  Parser p(text);
  DSACP_RETURN_IF_ERROR(p.parse_document(&v));
  return v;
}

std::string quote(std::string_view s) {
  std::string out = "\"";
  for (const char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out.push_back(ch);
        }
    }
  }
  return out + "\"";
}

std::string quote_name(std::string_view s, size_t max_bytes) {
  if (s.size() <= max_bytes) return quote(s);
  size_t cut = max_bytes;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xc0) == 0x80) --cut;  // not inside a UTF-8 sequence
  std::string q = quote(s.substr(0, cut));
  q.insert(q.size() - 1, "...");
  return q + " (" + std::to_string(s.size()) + " bytes)";
}

}  // namespace dsacp::json
