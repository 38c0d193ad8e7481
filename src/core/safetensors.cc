// safetensors: 8-byte little-endian header length N, N bytes of JSON header, then the data section.
// Each header entry is `"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}` with
// offsets relative to the data section; `"__metadata__"` is an optional string -> string map.
//
// The reader trusts nothing: every field is checked, and the tensors must tile the data section exactly
// (no overlap, no gap, no trailing bytes), as the reference implementation requires, so no byte of a file
// is silently ignored.
#include "dsacp/safetensors.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

#include "core/json.h"

namespace dsacp {

static_assert(std::endian::native == std::endian::little,
              "dsacp reads and writes safetensors data by memcpy: a little-endian host is required");

namespace {

// Headers larger than this are refused before any allocation (the reference implementation uses the same).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

const char kPrefix[] = "safetensors: ";

Status bad(const std::string& msg) { return data_loss(kPrefix + msg); }
Status bad_tensor(const std::string& name, const std::string& msg) {
  return data_loss(std::string(kPrefix) + "tensor " + json::quote(name) + ": " + msg);
}

// One parsed header entry, before its data is copied.
struct Entry {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t begin = 0, end = 0;
};

// Reads a non-negative JSON integer; `what` names the field for the message.
Status json_uint(const json::Value& v, const std::string& tensor, const char* what, uint64_t* out) {
  if (v.kind != json::Kind::kNumber || !v.is_integer || v.integer < 0) {
    return bad_tensor(tensor, std::string(what) + " must hold non-negative integers");
  }
  *out = static_cast<uint64_t>(v.integer);
  return Status();
}

Status parse_entry(const std::string& name, const json::Value& v, Entry* e) {
  e->name = name;
  if (name.empty()) return bad("a tensor has an empty name");
  if (v.kind != json::Kind::kObject) {
    return bad_tensor(name, std::string("entry must be an object, got ") + json::kind_name(v.kind));
  }
  for (const std::string& key : v.keys) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return bad_tensor(name, "unknown key " + json::quote(key) + " (allowed: dtype, shape, data_offsets)");
    }
  }
  const json::Value* dtype = v.find("dtype");
  const json::Value* shape = v.find("shape");
  const json::Value* offsets = v.find("data_offsets");
  if (dtype == nullptr) return bad_tensor(name, "missing \"dtype\"");
  if (shape == nullptr) return bad_tensor(name, "missing \"shape\"");
  if (offsets == nullptr) return bad_tensor(name, "missing \"data_offsets\"");

  if (dtype->kind != json::Kind::kString) return bad_tensor(name, "\"dtype\" must be a string");
  Result<DType> dt = dtype_from_name(dtype->string);
  if (!dt.ok()) {
    return bad_tensor(name, "unsupported dtype " + json::quote(dtype->string) + " (supported: F32, BF16, I32)");
  }
  e->dtype = *dt;

  if (shape->kind != json::Kind::kArray) return bad_tensor(name, "\"shape\" must be an array of integers");
  for (const json::Value& d : shape->items) {
    uint64_t dim = 0;
    DSACP_RETURN_IF_ERROR(json_uint(d, name, "\"shape\"", &dim));
    e->shape.push_back(static_cast<int64_t>(dim));
  }

  if (offsets->kind != json::Kind::kArray || offsets->items.size() != 2) {
    return bad_tensor(name, "\"data_offsets\" must be an array [begin, end]");
  }
  DSACP_RETURN_IF_ERROR(json_uint(offsets->items[0], name, "\"data_offsets\"", &e->begin));
  DSACP_RETURN_IF_ERROR(json_uint(offsets->items[1], name, "\"data_offsets\"", &e->end));
  const std::string offsets_str = "[" + std::to_string(e->begin) + ", " + std::to_string(e->end) + "]";
  if (e->begin > e->end) return bad_tensor(name, "data_offsets " + offsets_str + " have begin > end");

  // The byte count the shape needs, without overflow.
  Result<int64_t> numel = shape_numel(e->shape);
  const uint64_t elem = dtype_size(e->dtype);
  const bool fits = numel.ok() && static_cast<uint64_t>(*numel) <= std::numeric_limits<uint64_t>::max() / elem;
  const std::string need = fits ? std::to_string(static_cast<uint64_t>(*numel) * elem) : "more than 2^64";
  if (!fits || e->end - e->begin != static_cast<uint64_t>(*numel) * elem) {
    return bad_tensor(name, "data_offsets " + offsets_str + " do not match shape " + shape_to_string(e->shape) +
                                " of " + dtype_name(e->dtype) + " (" + need + " bytes)");
  }
  return Status();
}

Status parse_metadata(const json::Value& v, std::map<std::string, std::string>* out) {
  if (v.kind != json::Kind::kObject) {
    return bad(std::string("__metadata__ must be an object of strings, got ") + json::kind_name(v.kind));
  }
  for (size_t i = 0; i < v.keys.size(); ++i) {
    if (v.items[i].kind != json::Kind::kString) {
      return bad("__metadata__ " + json::quote(v.keys[i]) + " must be a string, got " +
                 json::kind_name(v.items[i].kind));
    }
    (*out)[v.keys[i]] = v.items[i].string;
  }
  return Status();
}

// The tensors must tile [0, data_size) exactly. Empty tensors take no bytes and conflict with nothing.
Status check_tiling(std::vector<const Entry*> entries, uint64_t data_size) {
  for (const Entry* e : entries) {
    if (e->end > data_size) {
      return bad_tensor(e->name, "data_offsets [" + std::to_string(e->begin) + ", " + std::to_string(e->end) +
                                     "] lie outside the data section (" + std::to_string(data_size) + " bytes)");
    }
  }
  std::erase_if(entries, [](const Entry* e) { return e->begin == e->end; });
  std::sort(entries.begin(), entries.end(), [](const Entry* a, const Entry* b) { return a->begin < b->begin; });
  uint64_t covered = 0;
  const Entry* prev = nullptr;
  for (const Entry* e : entries) {
    if (e->begin < covered) {
      return bad_tensor(e->name, "data_offsets [" + std::to_string(e->begin) + ", " + std::to_string(e->end) +
                                     "] overlap tensor " + json::quote(prev->name) + " [" +
                                     std::to_string(prev->begin) + ", " + std::to_string(prev->end) + "]");
    }
    if (e->begin > covered) {
      return bad_tensor(e->name, "data_offsets [" + std::to_string(e->begin) + ", " + std::to_string(e->end) +
                                     "] leave bytes [" + std::to_string(covered) + ", " + std::to_string(e->begin) +
                                     ") of the data section unused");
    }
    covered = e->end;
    prev = e;
  }
  if (covered != data_size) {
    return bad("data section has " + std::to_string(data_size - covered) + " trailing bytes after the last tensor (" +
               std::to_string(data_size) + " bytes, tensors end at " + std::to_string(covered) + ")");
  }
  return Status();
}

}  // namespace

Result<SafetensorsFile> safetensors_parse(std::string_view bytes) {
  if (bytes.size() < 8) {
    return bad("file is " + std::to_string(bytes.size()) + " bytes, shorter than the 8-byte header length");
  }
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  if (header_len > kMaxHeaderBytes) {
    return bad("header length " + std::to_string(header_len) + " is absurd (limit " + std::to_string(kMaxHeaderBytes) +
               " bytes)");
  }
  if (header_len > bytes.size() - 8) {
    return bad("header length " + std::to_string(header_len) + " exceeds the " + std::to_string(bytes.size() - 8) +
               " bytes that follow it (truncated file?)");
  }
  Result<json::Value> header = json::parse(bytes.substr(8, header_len));
  if (!header.ok()) return bad("header: " + header.status().message());
  if (header->kind != json::Kind::kObject) {
    return bad(std::string("header must be a JSON object, got ") + json::kind_name(header->kind));
  }

  SafetensorsFile file;
  std::vector<Entry> entries;
  entries.reserve(header->keys.size());
  for (size_t i = 0; i < header->keys.size(); ++i) {
    if (header->keys[i] == "__metadata__") {
      DSACP_RETURN_IF_ERROR(parse_metadata(header->items[i], &file.metadata));
      continue;
    }
    Entry e;
    DSACP_RETURN_IF_ERROR(parse_entry(header->keys[i], header->items[i], &e));
    entries.push_back(std::move(e));
  }

  const std::string_view data = bytes.substr(8 + header_len);
  std::vector<const Entry*> ptrs;
  for (const Entry& e : entries) ptrs.push_back(&e);
  DSACP_RETURN_IF_ERROR(check_tiling(std::move(ptrs), data.size()));

  for (Entry& e : entries) {
    Result<Tensor> t = Tensor::zeros(e.dtype, e.shape);
    if (!t.ok()) return t.status().with_context(std::string(kPrefix) + "tensor " + json::quote(e.name));
    if (t->nbytes() > 0) std::memcpy(t->data(), data.data() + e.begin, t->nbytes());
    file.tensors.emplace(std::move(e.name), std::move(t).value());
  }
  return file;
}

Result<SafetensorsFile> safetensors_read(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return io_error(path + ": cannot open: " + std::strerror(errno));
  std::string bytes;
  char buf[1 << 16];
  while (true) {
    const size_t n = std::fread(buf, 1, sizeof buf, f);
    bytes.append(buf, n);
    if (n < sizeof buf) break;
  }
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (failed) return io_error(path + ": read failed: " + std::strerror(err));
  Result<SafetensorsFile> file = safetensors_parse(bytes);
  if (!file.ok()) return file.status().with_context(path);
  return file;
}

Result<std::string> safetensors_serialize(const SafetensorsFile& file) {
  // Header: __metadata__ first, then the tensors in name order (std::map order), packed back to back.
  std::string header = "{";
  if (!file.metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : file.metadata) {
      if (!first) header += ",";
      first = false;
      header += json::quote(k) + ":" + json::quote(v);
    }
    header += "}";
  }
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    if (name.empty() || name == "__metadata__") {
      return invalid_argument(std::string(kPrefix) + "cannot write a tensor named " + json::quote(name));
    }
    if (t.data() == nullptr) {
      return invalid_argument(std::string(kPrefix) + "tensor " + json::quote(name) + " holds no data");
    }
    if (header.size() > 1) header += ",";
    header += json::quote(name) + ":{\"dtype\":\"" + dtype_name(t.dtype()) +
              "\",\"shape\":" + shape_to_string(t.shape()) + ",\"data_offsets\":[" + std::to_string(offset) + "," +
              std::to_string(offset + t.nbytes()) + "]}";
    offset += t.nbytes();
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');  // so the data section starts 8-byte aligned

  std::string out;
  out.reserve(8 + header.size() + offset);
  const uint64_t header_len = header.size();
  out.append(reinterpret_cast<const char*>(&header_len), 8);
  out += header;
  for (const auto& [name, t] : file.tensors) out.append(static_cast<const char*>(t.data()), t.nbytes());
  return out;
}

Status safetensors_write(const std::string& path, const SafetensorsFile& file) {
  DSACP_ASSIGN_OR_RETURN(std::string bytes, safetensors_serialize(file));
  // Written to a temporary name and renamed, so a reader never sees half a file.
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return io_error(tmp + ": cannot create: " + std::strerror(errno));
  const size_t n = std::fwrite(bytes.data(), 1, bytes.size(), f);
  const int write_err = errno;
  const bool close_failed = std::fclose(f) != 0;
  if (n != bytes.size() || close_failed) {
    std::remove(tmp.c_str());
    return io_error(tmp + ": write failed: " + std::strerror(write_err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return io_error(path + ": cannot rename from " + tmp + ": " + std::strerror(err));
  }
  return Status();
}

}  // namespace dsacp
