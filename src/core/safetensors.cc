// safetensors: 8-byte little-endian header length N, N bytes of JSON header, then the data section.
// Each header entry is `"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}` with
// offsets relative to the data section; `"__metadata__"` is an optional string -> string map.
//
// The reader trusts nothing: every field is checked, and the tensors must tile the data section exactly
// (no overlap, no gap, no trailing bytes), as the reference implementation requires, so no byte of a file
// is silently ignored.
#include "dsacp/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <new>

#include "core/json.h"
#include "core/memory.h"

namespace dsacp {

static_assert(std::endian::native == std::endian::little,
              "dsacp reads and writes safetensors data by memcpy: a little-endian host is required");

namespace {

// Headers larger than this are refused before any allocation (the reference implementation uses the same).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

const char kPrefix[] = "safetensors: ";

// A malformed file is the caller's bad input (invalid argument); a file cut short is data loss.
Status bad(const std::string& msg) { return invalid_argument(kPrefix + msg); }
Status truncated(const std::string& msg) { return data_loss(kPrefix + msg); }
Status bad_tensor(const std::string& name, const std::string& msg) {
  return invalid_argument(std::string(kPrefix) + "tensor " + json::quote_name(name) + ": " + msg);
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
      return bad_tensor(name, "unknown key " + json::quote_name(key) + " (allowed: dtype, shape, data_offsets)");
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
    return bad_tensor(name, "unsupported dtype " + json::quote_name(dtype->string) + " (supported: F32, BF16, I32)");
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
      return bad("__metadata__ " + json::quote_name(v.keys[i]) + " must be a string, got " +
                 json::kind_name(v.items[i].kind));
    }
    (*out)[v.keys[i]] = v.items[i].string;
  }
  return Status();
}

// The tensors must tile [0, data_size) exactly. Empty tensors take no bytes and conflict with nothing.
// `after_header` is the start of the data section, `header_len` the header length the file gave.
Status check_tiling(std::vector<const Entry*> entries, std::string_view data, uint64_t header_len) {
  const uint64_t data_size = data.size();
  for (const Entry* e : entries) {
    if (e->end > data_size) {
      if (data_size < e->end && e->begin <= data_size) {
        return truncated("tensor " + json::quote_name(e->name) + ": data_offsets [" + std::to_string(e->begin) +
                         ", " + std::to_string(e->end) + "] lie outside the data section (" +
                         std::to_string(data_size) + " bytes), past the end of the file (truncated?)");
      }
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
                                     "] overlap tensor " + json::quote_name(prev->name) + " [" +
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
    const uint64_t extra = data_size - covered;
    // A header length too short leaves the header's last bytes (its space padding, its closing brace) at the
    // start of the data section: say so rather than blame the end of the file.
    const std::string_view head = data.substr(0, std::min<uint64_t>(extra, data.size()));
    if (head.find_first_not_of(" \t\r\n}") == std::string_view::npos) {
      return bad("header length " + std::to_string(header_len) + " is " + std::to_string(extra) + " byte" +
                 (extra == 1 ? "" : "s") + " short: the data section starts with header text (" +
                 json::quote(head) + ") and holds " + std::to_string(extra) + " more byte" +
                 (extra == 1 ? "" : "s") + " than its tensors");
    }
    return bad("data section has " + std::to_string(extra) + " trailing byte" + (extra == 1 ? "" : "s") +
               " after the last tensor (" + std::to_string(data_size) + " bytes, tensors end at " +
               std::to_string(covered) + ")");
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
    return truncated("header length " + std::to_string(header_len) + " exceeds the " + std::to_string(bytes.size() - 8) +
               " bytes that follow it (truncated file?)");
  }
  Result<json::Value> header = json::parse(bytes.substr(8, header_len));
  if (!header.ok()) {
    // A header that ends early with its closing bracket right after it: the length is too short.
    const bool cut = header.status().message().find("end of input") != std::string::npos &&
                     8 + header_len < bytes.size() && (bytes[8 + header_len] == '}' || bytes[8 + header_len] == ']');
    return bad("header: " + header.status().message() +
               (cut ? " (the header length " + std::to_string(header_len) + " is too short: a '" +
                          std::string(1, bytes[8 + header_len]) + "' follows it)"
                    : ""));
  }
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
  DSACP_RETURN_IF_ERROR(check_tiling(std::move(ptrs), data, header_len));

  for (Entry& e : entries) {
    Result<Tensor> t = Tensor::zeros(e.dtype, e.shape);
    if (!t.ok()) return t.status().with_context(std::string(kPrefix) + "tensor " + json::quote_name(e.name));
    if (t->nbytes() > 0) std::memcpy(t->data(), data.data() + e.begin, t->nbytes());
    file.tensors.emplace(std::move(e.name), std::move(t).value());
  }
  return file;
}

namespace {

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "directory";
  if (S_ISFIFO(mode)) return "FIFO";
  if (S_ISCHR(mode)) return "character device";
  if (S_ISBLK(mode)) return "block device";
  if (S_ISSOCK(mode)) return "socket";
  return "not a regular file";
}

// The whole of a regular file. Opened without blocking (a FIFO would block the open until a writer came),
// refused unless regular (a FIFO, /dev/zero, a directory), sized from fstat and refused when it cannot fit in
// memory; a file that changes size while it is read is refused.
Result<std::string> read_regular_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return io_error(path + ": cannot open: " + std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return io_error(path + ": cannot stat: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) {
    return invalid_argument(path + ": is a " + std::string(file_kind(st.st_mode)) +
                            ", expected a regular file (safetensors)");
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) (void)::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (Status s = host_memory_check(size, "reading " + path); !s.ok()) return s;
  std::string bytes;
  try {
    bytes.resize(size);
  } catch (const std::bad_alloc&) {
    return resource_exhausted(path + ": out of memory holding its " + std::to_string(size) + " bytes");
  }
  uint64_t got = 0;
  while (got < size) {
    const ssize_t n = ::read(fd, bytes.data() + got, size - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return io_error(path + ": read failed: " + std::strerror(errno));
    if (n == 0) break;
    got += static_cast<uint64_t>(n);
  }
  char extra = 0;
  ssize_t more = 0;
  do {
    more = got == size ? ::read(fd, &extra, 1) : 0;
  } while (more < 0 && errno == EINTR);
  if (got != size || more > 0) {
    return io_error(path + ": the file changed size while it was read (" + std::to_string(size) + " bytes at open)");
  }
  return bytes;
}

}  // namespace

Result<SafetensorsFile> safetensors_read(const std::string& path) {
  DSACP_ASSIGN_OR_RETURN(std::string bytes, read_regular_file(path));
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
      return invalid_argument(std::string(kPrefix) + "cannot write a tensor named " + json::quote_name(name));
    }
    if (t.data() == nullptr) {
      return invalid_argument(std::string(kPrefix) + "tensor " + json::quote_name(name) + " holds no data");
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

namespace {

// A temporary name next to `path` that no other writer (thread or process) uses: the pid, a process-wide
// counter and the clock. The file is created exclusively, so an existing file of that name is never touched.
std::string temp_name_for(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  const uint64_t tick = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return dir + "." + base + ".dsacp-" + std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1)) +
         "-" + std::to_string(tick % 1000000007) + ".tmp";
}

// Every byte of `bytes` to fd: 0, or the errno of the failure (EIO when write() stopped making progress).
int write_all(int fd, std::string_view bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EIO;
    done += static_cast<size_t>(n);
  }
  return 0;
}

}  // namespace

Status safetensors_write(const std::string& path, const SafetensorsFile& file) {
  DSACP_ASSIGN_OR_RETURN(std::string bytes, safetensors_serialize(file));
  // Written to a temporary file of its own in the target's directory (created exclusively), then renamed into
  // place: a reader never sees half a file, two writers of one path each rename a whole file of their own, and
  // a failure removes the temporary file. Errors name `path`, the file the caller asked for.
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    tmp = temp_name_for(path);
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) return io_error(path + ": cannot create a file in its directory: " + std::strerror(errno));
  int err = write_all(fd, bytes);
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    const std::string why = err == EFBIG ? "the file size limit (ulimit -f) was reached"
                            : err == ENOSPC ? "no space left on the device"
                                            : std::strerror(err);
    return io_error(path + ": write failed: " + why);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno;
    ::unlink(tmp.c_str());
    return io_error(path + ": cannot put the written file in place: " + std::strerror(err));
  }
  return Status();
}

}  // namespace dsacp
