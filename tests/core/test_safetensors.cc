// safetensors reader/writer and the JSON parser under it: round trips, every refusal the reader promises,
// and a mutation loop (truncations, byte flips, header edits) that must never crash.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "core/json.h"
#include "dsacp/random.h"
#include "dsacp/safetensors.h"
#include "support/scratch_dir.h"

namespace dsacp {
namespace {

Tensor make_tensor(DType dtype, Shape shape, uint64_t stream) {
  Tensor t = Tensor::zeros(dtype, std::move(shape)).value();
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dtype == DType::kI32) {
      t.data_as<int32_t>()[i] = static_cast<int32_t>(counter_hash(7, stream, i));
    } else {
      t.set_f32(i, counter_uniform(7, stream, i));
    }
  }
  return t;
}

SafetensorsFile sample_file() {
  SafetensorsFile f;
  f.tensors["b_f32"] = make_tensor(DType::kF32, {3, 5}, 1);
  f.tensors["a_bf16"] = make_tensor(DType::kBF16, {2, 3, 7}, 2);  // 84 bytes: the next offset is not 8-aligned
  f.tensors["c_i32"] = make_tensor(DType::kI32, {4}, 3);
  f.tensors["empty"] = make_tensor(DType::kF32, {0, 4}, 4);
  f.tensors["scalar"] = make_tensor(DType::kF32, {}, 5);
  f.metadata["topk"] = "64";
  f.metadata["note \"quoted\"\n"] = "ünïcode";
  return f;
}

// A file image from a raw header and a data section.
std::string raw_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

// The error message of parsing `bytes`; "" when it parsed.
std::string parse_error(std::string_view bytes) {
  Result<SafetensorsFile> r = safetensors_parse(bytes);
  return r.ok() ? "" : r.status().message();
}

void expect_refused(std::string_view bytes, const std::string& substring) {
  const std::string msg = parse_error(bytes);
  EXPECT_NE(msg.find(substring), std::string::npos) << "message: " << msg << "\nexpected: " << substring;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << "message is not one line: " << msg;
}

void expect_same(const SafetensorsFile& a, const SafetensorsFile& b) {
  EXPECT_EQ(a.metadata, b.metadata);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [name, t] : a.tensors) {
    const Tensor* u = b.find(name);
    ASSERT_NE(u, nullptr) << name;
    EXPECT_EQ(t.dtype(), u->dtype()) << name;
    EXPECT_EQ(t.shape(), u->shape()) << name;
    ASSERT_EQ(t.nbytes(), u->nbytes()) << name;
    EXPECT_EQ(std::memcmp(t.data(), u->data(), t.nbytes()), 0) << name;
  }
}

TEST(SafetensorsJson, ParsesValues) {
  auto v = json::parse(R"( {"a": [1, -2, 3.5e2, true, false, null], "b": "x\u00e9\ud83d\ude00\n", "c": {}} )");
  ASSERT_TRUE(v.ok()) << v.status().message();
  const json::Value* a = v->find("a");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->items.size(), 6u);
  EXPECT_TRUE(a->items[1].is_integer);
  EXPECT_EQ(a->items[1].integer, -2);
  EXPECT_FALSE(a->items[2].is_integer);
  EXPECT_EQ(a->items[2].number, 350.0);
  EXPECT_EQ(v->find("b")->string, "x\xc3\xa9\xf0\x9f\x98\x80\n");
  EXPECT_EQ(v->find("c")->kind, json::Kind::kObject);
  // 2^63 does not fit int64: a number, not an integer.
  auto big = json::parse("9223372036854775808");
  ASSERT_TRUE(big.ok());
  EXPECT_FALSE(big->is_integer);
}

TEST(SafetensorsJson, RefusesNonStrictJson) {
  const char* bad[] = {"",
                       "{",
                       "{\"a\":1,}",
                       "[1,]",
                       "{\"a\" 1}",
                       "01",
                       "1.",
                       "-",
                       "+1",
                       "NaN",
                       "'a'",
                       "{\"a\":1}x",
                       "\"\x01\"",
                       "\"\\x\"",
                       "\"\\ud800\"",
                       "\"\\udc00\"",
                       "\"\xff\"",
                       "\"\xc0\x80\"",
                       "tru",
                       "{\"a\":1,\"a\":2}",
                       "\"abc"};
  for (const char* s : bad) EXPECT_FALSE(json::parse(s).ok()) << s;
  EXPECT_NE(json::parse("{\"a\":1,\"a\":2}").status().message().find("duplicate key \"a\""), std::string::npos);
  EXPECT_NE(json::parse(std::string(100, '[')).status().message().find("nesting deeper"), std::string::npos);
  EXPECT_TRUE(json::parse(std::string(60, '[') + std::string(60, ']')).ok());
}

TEST(SafetensorsJson, QuoteRoundTrips) {
  const std::string s = "a\"b\\c\nd\te\x01f\x7f";
  const std::string q = json::quote(s);
  EXPECT_EQ(q.find('\n'), std::string::npos);
  auto v = json::parse(q);
  ASSERT_TRUE(v.ok()) << v.status().message();
  EXPECT_EQ(v->string, s);
}

TEST(SafetensorsFile, RoundTripInMemory) {
  const SafetensorsFile f = sample_file();
  Result<std::string> bytes = safetensors_serialize(f);
  ASSERT_TRUE(bytes.ok()) << bytes.status().message();
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes->data(), 8);
  EXPECT_EQ((8 + header_len) % 8, 0u);
  const std::string header = bytes->substr(8, header_len);
  // Metadata first, then tensors in name order.
  EXPECT_EQ(header.rfind("{\"__metadata__\":{", 0), 0u) << header;
  EXPECT_LT(header.find("\"a_bf16\""), header.find("\"b_f32\""));
  EXPECT_LT(header.find("\"b_f32\""), header.find("\"c_i32\""));
  Result<SafetensorsFile> g = safetensors_parse(*bytes);
  ASSERT_TRUE(g.ok()) << g.status().message();
  expect_same(f, *g);
  // Serializing again gives the same bytes.
  EXPECT_EQ(*safetensors_serialize(*g), *bytes);
}

TEST(SafetensorsFile, RoundTripOnDisk) {
  const std::string path = (std::filesystem::temp_directory_path() / "dsacp_test_rt.safetensors").string();
  const SafetensorsFile f = sample_file();
  ASSERT_TRUE(safetensors_write(path, f).ok());
  Result<SafetensorsFile> g = safetensors_read(path);
  ASSERT_TRUE(g.ok()) << g.status().message();
  expect_same(f, *g);
  std::filesystem::remove(path);
  Result<SafetensorsFile> missing = safetensors_read(path);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kIoError);
  EXPECT_NE(missing.status().message().find(path), std::string::npos);
  // A directory is not a file: an i/o error, not an empty parse.
  EXPECT_EQ(safetensors_read(std::filesystem::temp_directory_path().string()).status().code(),
            StatusCode::kInvalidArgument);  // a directory: not a regular file
}

TEST(SafetensorsFile, ReadsHeaderWrittenByOthers) {
  // Whitespace, key order and an absent __metadata__ as other writers produce them.
  const std::string header = "{ \"x\" : { \"shape\" : [2], \"data_offsets\" : [0, 8], \"dtype\" : \"I32\" } }      ";
  Result<SafetensorsFile> f = safetensors_parse(raw_file(header, std::string("\1\0\0\0\2\0\0\0", 8)));
  ASSERT_TRUE(f.ok()) << f.status().message();
  EXPECT_TRUE(f->metadata.empty());
  EXPECT_EQ(f->find("x")->data_as<int32_t>()[1], 2);
}

TEST(SafetensorsFile, RefusesTruncatedAndHugeHeaders) {
  expect_refused("", "shorter than the 8-byte header length");
  expect_refused("1234567", "shorter than the 8-byte header length");
  expect_refused(raw_file("{}", "").substr(0, 9), "exceeds the 1 bytes that follow it");
  std::string huge(8, '\0');
  const uint64_t n = uint64_t{1} << 62;
  std::memcpy(huge.data(), &n, 8);
  expect_refused(huge + "{}", "header length 4611686018427387904 is absurd");
  const uint64_t max = ~uint64_t{0};
  std::memcpy(huge.data(), &max, 8);
  expect_refused(huge + "{}", "is absurd");
  // A truncated data section.
  const std::string full = *safetensors_serialize(sample_file());
  expect_refused(full.substr(0, full.size() - 1), "lie outside the data section");
}

TEST(SafetensorsFile, RefusesBadHeaders) {
  expect_refused(raw_file("{\"a\":", ""), "safetensors: header: invalid JSON at byte 5");
  expect_refused(raw_file("[1, 2]", ""), "header must be a JSON object, got array");
  expect_refused(raw_file("{\"a\":1}", ""), "tensor \"a\": entry must be an object, got number");
  const std::string e = R"("dtype":"F32","shape":[2],"data_offsets":[0,8])";
  expect_refused(raw_file("{\"a\":{" + e + "},\"a\":{" + e + "}}", std::string(8, '\0')), "duplicate key \"a\"");
  expect_refused(raw_file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", ""), "tensor \"a\": missing \"dtype\"");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", ""), "tensor \"a\": missing \"shape\"");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[2]}})", ""), "tensor \"a\": missing \"data_offsets\"");
  expect_refused(raw_file("{\"a\":{" + e + ",\"extra\":1}}", std::string(8, '\0')),
                 "tensor \"a\": unknown key \"extra\"");
  expect_refused(raw_file(R"({"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})", std::string(4, '\0')),
                 "tensor \"a\": unsupported dtype \"F16\" (supported: F32, BF16, I32)");
  expect_refused(raw_file(R"({"a":{"dtype":3,"shape":[2],"data_offsets":[0,8]}})", ""), "\"dtype\" must be a string");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", ""),
                 "\"shape\" must hold non-negative integers");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", ""),
                 "\"shape\" must hold non-negative integers");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", ""), "\"shape\" must be an array");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", ""),
                 "\"data_offsets\" must be an array [begin, end]");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", ""),
                 "data_offsets [8, 0] have begin > end");
  expect_refused(raw_file(R"({"__metadata__":{"k":1}})", ""), "__metadata__ \"k\" must be a string, got number");
  expect_refused(raw_file(R"({"__metadata__":[]})", ""), "__metadata__ must be an object");
  expect_refused(raw_file(R"({"":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})", ""), "empty name");
}

TEST(SafetensorsFile, RefusesBadDataOffsets) {
  // The message the header documents.
  expect_refused(
      raw_file(R"({"q_nope":{"dtype":"F32","shape":[4,2,8],"data_offsets":[0,96]}})", std::string(96, 0)),
      "safetensors: tensor \"q_nope\": data_offsets [0, 96] do not match shape [4, 2, 8] of F32 (256 bytes)");
  // Shape whose byte count overflows.
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", ""),
                 "do not match shape");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,8]}})", ""),
                 "(more than 2^64 bytes)");
  // Outside the data section.
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", std::string(8, 0)),
                 "tensor \"a\": data_offsets [8, 16] lie outside the data section (8 bytes)");
  expect_refused(
      raw_file(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[9223372036854775807,9223372036854775807]}})", ""),
      "lie outside the data section");
  // Overlap, gap and trailing bytes.
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                          R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                          std::string(12, 0)),
                 "tensor \"b\": data_offsets [4, 12] overlap tensor \"a\" [0, 8]");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                          R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                          std::string(8, 0)),
                 "overlap tensor");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", std::string(8, 0)),
                 "tensor \"a\": data_offsets [4, 8] leave bytes [0, 4) of the data section unused");
  expect_refused(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", std::string(8, 0)),
                 "data section has 4 trailing bytes after the last tensor");
}

TEST(SafetensorsFile, WriterRefusesUnwritableTensors) {
  SafetensorsFile f;
  f.tensors["x"] = Tensor();
  EXPECT_FALSE(safetensors_serialize(f).ok());
  SafetensorsFile g;
  g.tensors["__metadata__"] = make_tensor(DType::kF32, {1}, 1);
  EXPECT_FALSE(safetensors_serialize(g).ok());
  EXPECT_FALSE(safetensors_write("/nonexistent-dir/x.safetensors", sample_file()).ok());
}

// Random truncations, byte flips and header edits of a valid file: each parse must return an error or a
// valid file (whose tensors then hold exactly the bytes their shape needs); under ASan this also proves no
// read outside the buffer.
TEST(SafetensorsFile, MutationsNeverCrash) {
  const std::string valid = *safetensors_serialize(sample_file());
  uint64_t header_len = 0;
  std::memcpy(&header_len, valid.data(), 8);
  int parsed = 0, refused = 0;
  for (uint64_t it = 0; it < 4000; ++it) {
    std::string m = valid;
    const uint64_t h = counter_hash(99, 0, it);
    switch (h % 4) {
      case 0:  // truncate anywhere
        m.resize(counter_hash(99, 1, it) % m.size());
        break;
      case 1:  // flip 1..4 random bits anywhere
        for (uint64_t k = 0; k < 1 + (h >> 8) % 4; ++k) {
          const uint64_t r = counter_hash(99, 2 + k, it);
          m[r % m.size()] = static_cast<char>(m[r % m.size()] ^ (1u << ((r >> 32) % 8)));
        }
        break;
      case 2: {  // replace a header byte with a JSON-significant character
        const char specials[] = "{}[],:\"\\0123456789-e. ";
        const uint64_t r = counter_hash(99, 7, it);
        m[8 + r % header_len] = specials[(r >> 32) % (sizeof specials - 1)];
        break;
      }
      case 3: {  // corrupt the length field
        const uint64_t r = counter_hash(99, 8, it);
        m[r % 8] = static_cast<char>(r >> 32);
        break;
      }
    }
    Result<SafetensorsFile> f = safetensors_parse(m);
    if (f.ok()) {
      ++parsed;
      for (const auto& [name, t] : f->tensors) ASSERT_LE(t.nbytes(), m.size()) << name;
    } else {
      ++refused;
      ASSERT_EQ(f.status().message().find('\n'), std::string::npos) << f.status().message();
    }
  }
  EXPECT_GT(refused, 1000);
  EXPECT_GT(parsed, 0);  // flips inside the data section still parse
}


// ---- Issue #30: bad input never crashes, hangs or destroys data --------------------------------------------------

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The writer used the fixed name PATH.tmp: a user's file of that name was overwritten and consumed.
TEST(SafetensorsWrite, NeverTouchesAnotherFileAndLeavesNoTemporary) {
  const testing::ScratchDir scratch("dsacp_st_tmpname");  // removed when the test ends, passed or failed
  const std::string dir = scratch.str();
  const std::string path = dir + "/result.safetensors";
  std::ofstream(path + ".tmp") << "the user's own file";
  ASSERT_TRUE(safetensors_write(path, sample_file()).ok());
  EXPECT_EQ(file_bytes(path + ".tmp"), "the user's own file");
  ASSERT_TRUE(safetensors_read(path).ok());
  int entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) entries += e.is_regular_file();
  EXPECT_EQ(entries, 2);  // the result and the user's file: no temporary left behind
  // A failure names the file asked for, never a temporary name.
  const Status s = safetensors_write(dir + "/missing-dir/x.safetensors", sample_file());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message().find(".tmp"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("missing-dir/x.safetensors"), std::string::npos) << s.message();
}

// Two writers of one path at once: every read in between sees one writer's whole file, never a mix.
TEST(SafetensorsWrite, ConcurrentWritersNeverMixTheirFiles) {
  const testing::ScratchDir scratch("dsacp_st_concurrent");
  const std::string path = scratch.file("out.safetensors");
  SafetensorsFile a = sample_file(), b = sample_file();
  b.tensors["b_f32"] = make_tensor(DType::kF32, {3, 5}, 77);
  b.tensors["big"] = make_tensor(DType::kF32, {4096}, 78);  // a different size as well
  a.tensors["big"] = make_tensor(DType::kF32, {1024}, 79);
  const std::string want_a = *safetensors_serialize(a), want_b = *safetensors_serialize(b);
  for (int round = 0; round < 20; ++round) {
    Status sa, sb;
    std::thread ta([&] { sa = safetensors_write(path, a); });
    std::thread tb([&] { sb = safetensors_write(path, b); });
    ta.join();
    tb.join();
    ASSERT_TRUE(sa.ok()) << sa.message();
    ASSERT_TRUE(sb.ok()) << sb.message();
    const std::string got = file_bytes(path);
    ASSERT_TRUE(got == want_a || got == want_b) << "round " << round << ": a mixed file of " << got.size() << " bytes";
  }
}

// A FIFO blocked the open forever; /dev/zero ended in std::bad_alloc.
TEST(SafetensorsRead, RefusesWhatIsNotARegularFile) {
  const testing::ScratchDir scratch("dsacp_st_fifo");
  const std::string fifo = scratch.file("case.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  Result<SafetensorsFile> f = safetensors_read(fifo);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("is a FIFO, expected a regular file"), std::string::npos) << f.status().message();
  f = safetensors_read("/dev/zero");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("is a character device"), std::string::npos) << f.status().message();
}

// A header length one byte short was reported as "1 trailing bytes"; malformed files were all "data loss".
TEST(SafetensorsRead, NamesTheRealCause) {
  std::string file = *safetensors_serialize(sample_file());
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  ASSERT_EQ(file[8 + n - 1], ' ') << "the writer pads the header with spaces";
  const uint64_t short_by_one = n - 1;
  std::memcpy(file.data(), &short_by_one, 8);
  const std::string msg = parse_error(file);
  EXPECT_NE(msg.find("header length " + std::to_string(n - 1) + " is 1 byte short"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("trailing bytes"), std::string::npos) << msg;
  EXPECT_EQ(safetensors_parse(raw_file("[1]", "")).status().code(), StatusCode::kInvalidArgument);
  const std::string valid = *safetensors_serialize(sample_file());
  EXPECT_EQ(safetensors_parse(valid.substr(0, valid.size() - 3)).status().code(), StatusCode::kDataLoss);  // cut short
  // A hostile tensor name is cut in the message: the line stays short.
  const std::string name(100000, 'n');
  const std::string long_msg =
      parse_error(raw_file("{\"" + name + "\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}", std::string(8, 0)));
  EXPECT_NE(long_msg.find("unsupported dtype"), std::string::npos) << long_msg.substr(0, 300);
  EXPECT_LT(long_msg.size(), 400u);
  EXPECT_NE(long_msg.find("...\" (100000 bytes)"), std::string::npos) << long_msg;
}

// A header of many keys: the duplicate check scanned every earlier key (300,000 keys took over 20 s).
// 150,000 keys take seconds with a quadratic check (about 5 s here) and a fraction of one with a linear one.
TEST(SafetensorsRead, HeaderParseIsLinearInTheKeyCount) {
  std::string header = "{\"__metadata__\":{";
  // 300,000 keys: a quadratic parser took over 20 s on them, a linear one takes well under a second, so the bound
  // below holds on a loaded machine and still tells the two apart.
  for (int i = 0; i < 300000; ++i) header += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":\"v\"";
  header += "},";
  std::string entries;
  for (int i = 0; i < 20000; ++i) {
    entries += (i ? ",\"t" : "\"t") + std::to_string(i) + "\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}";
  }
  const std::string file = raw_file(header + entries + "}", "");
  const auto t0 = std::chrono::steady_clock::now();
  Result<SafetensorsFile> f = safetensors_parse(file);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(f.ok()) << f.status().message();
  EXPECT_EQ(f->metadata.size(), 300000u);
  EXPECT_EQ(f->tensors.size(), 20000u);
#if defined(__SANITIZE_ADDRESS__)
  const double bound = 30.0;  // everything runs several times slower under the sanitizers
#else
  const double bound = 6.0;
#endif
  EXPECT_LT(seconds, bound) << "parsing " << file.size() << " bytes";
}

// The documented limits: nesting (json::kMaxDepth) and values per document (json::kMaxValues), each refused
// in one line, at once, and every mutation of a header at those limits refused or parsed without a crash.
TEST(SafetensorsRead, HeaderLimitsAndTheirMutations) {
  std::string deep = "{\"__metadata__\":{\"k\":\"v\"},\"x\":";
  for (int i = 0; i < json::kMaxDepth; ++i) deep += "[";
  for (int i = 0; i < json::kMaxDepth; ++i) deep += "]";
  deep += "}";
  expect_refused(raw_file(deep, ""), "nesting deeper than 64 levels");
  std::string many = "{\"a\":{\"dtype\":\"F32\",\"shape\":[";
  for (int64_t i = 0; i < json::kMaxValues; ++i) many += i ? ",1" : "1";
  many += "],\"data_offsets\":[0,4]}}";
  const auto t0 = std::chrono::steady_clock::now();
  expect_refused(raw_file(many, std::string(4, 0)), "more than 1048576 values in one document");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  // Mutations around the limits: depth 63..65 and key counts around a duplicate, truncated and flipped.
  for (uint64_t it = 0; it < 600; ++it) {
    const int depth = json::kMaxDepth - 2 + static_cast<int>(it % 3);
    std::string h = "{\"x\":";
    for (int i = 0; i < depth; ++i) h += "[";
    for (int i = 0; i < depth; ++i) h += "]";
    h += ",\"__metadata__\":{";
    for (int i = 0; i < 50; ++i) h += (i ? ",\"k" : "\"k") + std::to_string(i % (40 + it % 11)) + "\":\"v\"";
    h += "}}";
    std::string m = raw_file(h, "");
    const uint64_t r = counter_hash(31, 0, it);
    if (r % 3 == 0) m.resize(8 + (r >> 8) % (m.size() - 8));
    if (r % 3 == 1) m[8 + (r >> 8) % (m.size() - 8)] ^= static_cast<char>(1 << ((r >> 40) % 8));
    Result<SafetensorsFile> f = safetensors_parse(m);
    if (!f.ok()) {
      ASSERT_EQ(f.status().message().find('\n'), std::string::npos) << f.status().message();
    }
  }
}

}  // namespace
}  // namespace dsacp
