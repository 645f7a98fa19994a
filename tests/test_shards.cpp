// Shards, the window order and pack_text, in one process: round trips, every bad-file message,
// chunked storage, the permutation, window contents and order, path expansion, packing.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <set>

#include "temp_dir.h"
#include "mpitrain/error.h"
#include "mpitrain/h5.h"
#include "mpitrain/pack.h"
#include "mpitrain/shards.h"

using namespace mpitrain;
namespace fs = std::filesystem;

namespace {

// ---- helpers -----------------------------------------------------------------------------------

ShardMeta meta(int64_t vocab, int64_t eot = -1) {
  ShardMeta m;
  m.vocab_size = vocab;
  m.eot_token = eot;
  m.tokenizer = "test";
  m.source = "unit test";
  return m;
}

// Tokens first, first+1, ... (mod vocab): windows are recognisable by their first token.
std::vector<uint32_t> ramp(size_t n, uint32_t first = 0, uint32_t vocab = 70000) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint32_t>((first + i) % vocab);
  return t;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Runs `fn`, expecting a UsageError that starts with `prefix` and contains `needle`.
void expect_usage(const std::function<void()>& fn, const std::string& prefix,
                  const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no UsageError; expected '" << prefix << "... " << needle << "'";
  } catch (const UsageError& e) {
    std::string msg = e.what();
    EXPECT_EQ(msg.rfind(prefix, 0), 0u) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  }
}

// Both entry points must reject a bad shard with the same kind of message.
void expect_bad_shard(const std::string& path, const std::string& needle) {
  expect_usage([&] { read_shard_info(path); }, path + ": ", needle);
  expect_usage([&] { TokenDataset({path}, 4, 0, true); }, path + ": ", needle);
}

// A hand-made shard: `type` tokens from `data`, optional chunking, the given root attributes.
void write_custom(const std::string& path, hid_t type, const void* data, hsize_t n,
                  const std::string& format = kShardFormat, int64_t version = kShardVersion,
                  bool with_tokens = true, hsize_t chunk = 0) {
  h5::File f = h5::create(path);
  if (with_tokens) {
    h5::Dataspace space(H5Screate_simple(1, &n, nullptr));
    h5::PropList dcpl(H5Pcreate(H5P_DATASET_CREATE));
    if (chunk) {
      H5Pset_chunk(dcpl.get(), 1, &chunk);
      if (H5Zfilter_avail(H5Z_FILTER_DEFLATE) > 0) H5Pset_deflate(dcpl.get(), 4);
    }
    h5::Dataset d(H5Dcreate2(f.get(), "tokens", type, space.get(), H5P_DEFAULT, dcpl.get(),
                             H5P_DEFAULT));
    ASSERT_GE(H5Dwrite(d.get(), type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), 0);
  }
  h5::set_attr(f.get(), "format", format);
  h5::set_attr(f.get(), "version", version);
  h5::set_attr(f.get(), "vocab_size", int64_t{257});
}

// Whether this process has `path` memory-mapped (Linux).
bool mapped(const std::string& path) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.size() >= path.size() &&
        line.compare(line.size() - path.size(), path.size(), path) == 0)
      return true;
  return false;
}

std::vector<int32_t> expected_window(const std::vector<uint32_t>& t, uint64_t j, int64_t seq) {
  auto from = t.begin() + static_cast<int64_t>(j) * seq;
  return std::vector<int32_t>(from, from + seq + 1);
}

std::vector<int32_t> get_window(const TokenDataset& ds, uint64_t g) {
  std::vector<int32_t> w(static_cast<size_t>(ds.seq_len() + 1));
  ds.window(g, w.data());
  return w;
}

}  // namespace

// ---- writing and reading -----------------------------------------------------------------------

TEST(Shards, RoundTripUint16WithAttributes) {
  TempDir dir;
  std::string p = dir / "a-train-00000.h5";
  auto tokens = ramp(1000, 0, 257);
  write_shard(p, tokens, {0, 10, 500}, meta(257, 256));
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  ShardInfo info = read_shard_info(p);
  EXPECT_EQ(info.path, p);
  EXPECT_EQ(info.num_tokens, 1000u);
  EXPECT_EQ(info.dtype_bytes, 2);
  EXPECT_EQ(info.meta.vocab_size, 257);
  EXPECT_EQ(info.meta.eot_token, 256);
  EXPECT_EQ(info.meta.tokenizer, "test");
  EXPECT_EQ(info.meta.source, "unit test");
  EXPECT_EQ(read_shard_tokens(p), tokens);

  h5::File f = h5::open_read(p);
  EXPECT_EQ(h5::get_attr_string(f.get(), "format"), std::string("mpitrain-tokens"));
  EXPECT_EQ(h5::get_attr_int(f.get(), "version"), 1);
  EXPECT_EQ(h5::get_attr_int(f.get(), "num_tokens"), 1000);
  h5::Dataset d(H5Dopen2(f.get(), "tokens", H5P_DEFAULT));
  h5::Datatype t(H5Dget_type(d.get()));
  EXPECT_GT(H5Tequal(t.get(), H5T_NATIVE_UINT16), 0);
  h5::PropList dcpl(H5Dget_create_plist(d.get()));
  EXPECT_EQ(H5Pget_layout(dcpl.get()), H5D_CONTIGUOUS);
  h5::Dataset off(H5Dopen2(f.get(), "doc_offsets", H5P_DEFAULT));
  std::vector<uint64_t> offsets(3);
  h5::read(off.get(), H5T_NATIVE_UINT64, offsets.data());
  EXPECT_EQ(offsets, (std::vector<uint64_t>{0, 10, 500}));
}

TEST(Shards, RoundTripUint32) {
  TempDir dir;
  std::string p = dir / "big.h5";
  auto tokens = ramp(3000, 67000, 70000);  // crosses 65535 and wraps to 0
  write_shard(p, tokens, {}, meta(70000));
  ShardInfo info = read_shard_info(p);
  EXPECT_EQ(info.dtype_bytes, 4);
  EXPECT_EQ(info.meta.vocab_size, 70000);
  EXPECT_EQ(read_shard_tokens(p), tokens);
  h5::File f = h5::open_read(p);
  EXPECT_FALSE(h5::exists(f.get(), "doc_offsets"));  // omitted when empty

  TokenDataset ds({p}, 7, 0, false);
  for (uint64_t j = 0; j < ds.num_windows(); ++j)
    ASSERT_EQ(get_window(ds, j), expected_window(tokens, j, 7)) << j;
}

TEST(Shards, TokenOutsideVocabRefused) {
  TempDir dir;
  std::string p = dir / "bad.h5";
  expect_usage([&] { write_shard(p, {1, 2, 257, 3}, {}, meta(257)); }, p + ": ",
               "token 257 at position 2");
  EXPECT_FALSE(fs::exists(p));
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  std::string nodir = dir / "nodir/x.h5";
  expect_usage([&] { write_shard(nodir, {1}, {}, meta(257)); }, nodir + ": ", "cannot create");
}

// A shard written by another tool can hold tokens past its declared vocabulary (write_shard
// refuses them): reading a window that holds one is a UsageError naming the shard and the
// position, mapped or read into memory, uint16 or uint32, whichever window hits it first.
TEST(Shards, TokenOutsideVocabInAnotherToolsShardNamedWhenRead) {
  TempDir dir;
  for (bool wide : {false, true}) {
    for (bool shuffle : {false, true}) {
      const std::string p = dir / concat("other-tool-", wide, shuffle, ".h5");
      std::vector<uint32_t> tokens(200);
      for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i % 200);
      write_shard(p, tokens, {}, meta(wide ? 70000 : 257));
      {  // overwrite token 123 behind the writer's back, as h5py could
        h5::silence_errors();
        hid_t f = H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
        ASSERT_GE(f, 0);
        hid_t ds = H5Dopen2(f, "tokens", H5P_DEFAULT);
        hid_t space = H5Dget_space(ds);
        const hsize_t at = 123, one = 1;
        H5Sselect_hyperslab(space, H5S_SELECT_SET, &at, nullptr, &one, nullptr);
        hid_t mem = H5Screate_simple(1, &one, nullptr);
        const uint32_t bad = wide ? 70001u : 300u;
        H5Dwrite(ds, H5T_NATIVE_UINT32, mem, space, H5P_DEFAULT, &bad);
        H5Sclose(mem);
        H5Sclose(space);
        H5Dclose(ds);
        H5Fclose(f);
      }
      TokenDataset data({p}, 9, 0, shuffle);
      std::vector<int32_t> batch(static_cast<size_t>(data.num_windows() * 10));
      expect_usage([&] { data.batch(0, 0, static_cast<int64_t>(data.num_windows()), batch.data()); }, p + ": ",
                   concat("token ", wide ? 70001 : 300, " at position 123 of dataset 'tokens' is outside the vocabulary "
                          "(vocab_size ", wide ? 70000 : 257, ")"));
    }
  }
}

// h5py writes a Python str attribute as a variable-length UTF-8 string (and numpy bytes as a
// fixed-length ASCII one): a shard written that way (docs/formats.md shows the Python) reads
// like one of ours. The same attributes are made here with the C API.
namespace {
void set_vlen_utf8_attr(hid_t obj, const std::string& name, const std::string& value) {
  if (H5Aexists(obj, name.c_str()) > 0) H5Adelete(obj, name.c_str());
  hid_t type = H5Tcopy(H5T_C_S1);
  H5Tset_size(type, H5T_VARIABLE);
  H5Tset_cset(type, H5T_CSET_UTF8);
  hid_t space = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(obj, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT);
  const char* p = value.c_str();
  H5Awrite(a, type, &p);
  H5Aclose(a);
  H5Sclose(space);
  H5Tclose(type);
}
}  // namespace

TEST(Shards, H5pyStyleVariableLengthUtf8AttributesRead) {
  TempDir dir;
  const std::string p = dir / "h5py.h5";
  std::vector<uint32_t> tokens(100);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i % 50);
  write_shard(p, tokens, {}, meta(257, 256));
  {
    h5::silence_errors();
    hid_t f = H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    set_vlen_utf8_attr(f, "format", "mpitrain-tokens");
    set_vlen_utf8_attr(f, "tokenizer", "byte");
    set_vlen_utf8_attr(f, "source", "written by h5py \xc3\xa9");  // non-ASCII survives
    H5Fclose(f);
  }
  const ShardInfo info = read_shard_info(p);
  EXPECT_EQ(info.meta.tokenizer, "byte");
  EXPECT_EQ(info.meta.source, "written by h5py \xc3\xa9");
  EXPECT_EQ(info.meta.vocab_size, 257);
  TokenDataset data({p}, 9, 0, false);
  EXPECT_EQ(get_window(data, 1), expected_window(tokens, 1, 9));
}

// ---- bad files ---------------------------------------------------------------------------------

TEST(Shards, BadFilesNameTheFile) {
  TempDir dir;
  std::vector<uint16_t> tok(100, 7);

  expect_bad_shard(dir / "missing.h5", "no such file");

  std::string text = dir / "text.h5";
  write_text(text, "these are not the tokens you are looking for\n");
  expect_bad_shard(text, "not an HDF5 file");

  std::string trunc = dir / "trunc.h5";
  write_shard(trunc, ramp(5000, 0, 257), {}, meta(257));
  ASSERT_EQ(::truncate(trunc.c_str(), static_cast<off_t>(fs::file_size(trunc) / 2)), 0);
  expect_bad_shard(trunc, "");

  std::string no_tokens = dir / "no_tokens.h5";
  write_custom(no_tokens, H5T_NATIVE_UINT16, nullptr, 0, kShardFormat, 1, false);
  expect_bad_shard(no_tokens, "missing dataset 'tokens'");

  std::string format = dir / "format.h5";
  write_custom(format, H5T_NATIVE_UINT16, tok.data(), tok.size(), "x");
  expect_bad_shard(format, "attribute 'format' is 'x', expected 'mpitrain-tokens'");

  std::string version = dir / "version.h5";
  write_custom(version, H5T_NATIVE_UINT16, tok.data(), tok.size(), kShardFormat, 2);
  expect_bad_shard(version, "unsupported version 2");

  std::string floats = dir / "float.h5";
  std::vector<float> ftok(100, 1.0f);
  write_custom(floats, H5T_NATIVE_FLOAT, ftok.data(), ftok.size());
  expect_bad_shard(floats, "dataset 'tokens' has type float, expected uint16 or uint32");
}

TEST(Shards, ShorterThanOneWindow) {
  TempDir dir;
  std::string p = dir / "short.h5";
  write_shard(p, ramp(100, 0, 257), {}, meta(257));
  expect_usage([&] { TokenDataset({p}, 256, 0, true); }, "",
               p + ": 100 tokens, shorter than one window of seq_len+1 = 257");
  TokenDataset ok({p}, 99, 0, true);  // exactly one window fits
  EXPECT_EQ(ok.num_windows(), 1u);
}

TEST(Shards, MixedVocabRefused) {
  TempDir dir;
  std::string a = dir / "a.h5", b = dir / "b.h5";
  write_shard(a, ramp(100, 0, 257), {}, meta(257));
  write_shard(b, ramp(100, 0, 257), {}, meta(50257));
  expect_usage([&] { TokenDataset({a, b}, 8, 0, true); }, "",
               b + ": vocab_size 50257 differs from 257 in " + a);
}

TEST(Shards, ChunkedReadsLikeContiguous) {
  TempDir dir;
  std::string contiguous = dir / "c.h5", chunked = dir / "k.h5";
  auto tokens = ramp(777, 3, 257);
  write_shard(contiguous, tokens, {}, meta(257));
  std::vector<uint16_t> narrow(tokens.begin(), tokens.end());
  write_custom(chunked, H5T_NATIVE_UINT16, narrow.data(), narrow.size(), kShardFormat, 1, true,
               64);
  EXPECT_EQ(read_shard_tokens(chunked), tokens);
  TokenDataset a({contiguous}, 16, 5, true), b({chunked}, 16, 5, true);
  // The contiguous shard is served from a mapping of the file; the chunked one from memory.
  EXPECT_TRUE(mapped(contiguous));
  EXPECT_FALSE(mapped(chunked));
  ASSERT_EQ(a.num_windows(), b.num_windows());
  for (uint64_t g = 0; g < 2 * a.num_windows(); ++g) ASSERT_EQ(get_window(a, g), get_window(b, g));
}

namespace {

// /tokens of `declared` uint16 tokens, of which only the first `written` are written (chunked
// with `chunk` tokens a chunk, deflate when available; or contiguous when chunk is 0). Returns
// the path.
std::string write_partial(const TempDir& dir, const std::string& name, hsize_t declared,
                          hsize_t written, hsize_t chunk) {
  const std::string path = dir / name;
  h5::File f = h5::create(path);
  h5::Dataspace space(H5Screate_simple(1, &declared, nullptr));
  h5::PropList dcpl(H5Pcreate(H5P_DATASET_CREATE));
  if (chunk) {
    EXPECT_GE(H5Pset_chunk(dcpl.get(), 1, &chunk), 0);
    if (H5Zfilter_avail(H5Z_FILTER_DEFLATE) > 0) H5Pset_deflate(dcpl.get(), 1);
  }
  h5::Dataset d(H5Dcreate2(f.get(), "tokens", H5T_STD_U16LE, space.get(), H5P_DEFAULT, dcpl.get(),
                           H5P_DEFAULT));
  if (written > 0) {
    std::vector<uint16_t> tok(written);
    for (hsize_t i = 0; i < written; ++i) tok[i] = static_cast<uint16_t>(i % 257);
    hsize_t zero = 0;
    h5::Dataspace file_space(H5Dget_space(d.get()));
    h5::Dataspace mem_space(H5Screate_simple(1, &written, nullptr));
    EXPECT_GE(H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, &zero, nullptr, &written,
                                  nullptr), 0);
    EXPECT_GE(H5Dwrite(d.get(), H5T_NATIVE_UINT16, mem_space.get(), file_space.get(), H5P_DEFAULT,
                       tok.data()), 0);
  }
  h5::set_attr(f.get(), "format", std::string(kShardFormat));
  h5::set_attr(f.get(), "version", kShardVersion);
  h5::set_attr(f.get(), "vocab_size", int64_t{257});
  return path;
}

}  // namespace

// Tokens a dataset declares but does not store would be allocated (and zero-filled) in full on
// reading: refused up front (fuzz/regressions/fuzz_shard/chunked-tokens-mostly-unstored-oom and
// unallocated-contiguous-tokens-oom).
TEST(Shards, DeclaredButUnstoredTokensRefused) {
  TempDir dir;
  // 2^40 tokens declared, one chunk of 2^34 stored: no allocation may be attempted.
  const std::string huge = write_partial(dir, "huge.h5", hsize_t{1} << 40, 64, 64);
  expect_bad_shard(huge, "dataset 'tokens' declares 1099511627776 tokens but only 1 chunks of "
                         "17179869184 are stored");
  expect_usage([&] { read_shard_tokens(huge); }, huge + ": ", "are stored");

  // One chunk of two missing.
  const std::string half = write_partial(dir, "half.h5", 128, 64, 64);
  expect_bad_shard(half, "declares 128 tokens but only 1 chunks of 2 are stored");

  // Nothing stored at all, chunked or contiguous.
  expect_bad_shard(write_partial(dir, "none-chunked.h5", 1000, 0, 64),
                   "declares 1000 tokens but stores 0 bytes");
  expect_bad_shard(write_partial(dir, "none-contiguous.h5", hsize_t{1} << 40, 0, 0),
                   "declares 1099511627776 tokens but stores 0 bytes");

  // Every chunk stored, the last one only partly written: a valid shard (the rest is fill).
  const std::string full = write_partial(dir, "full.h5", 100, 70, 64);
  EXPECT_EQ(read_shard_info(full).num_tokens, 100u);
  auto tokens = read_shard_tokens(full);
  ASSERT_EQ(tokens.size(), 100u);
  EXPECT_EQ(tokens[69], 69u);
  EXPECT_EQ(tokens[99], 0u);
  TokenDataset ds({full}, 9, 0, false);
  EXPECT_EQ(ds.num_windows(), 11u);
}

TEST(Shards, VocabBeyondInt32Refused) {
  TempDir dir;
  const std::string p = dir / "big-vocab.h5";
  write_shard(p, ramp(100, 0, 257), {}, meta((int64_t{1} << 31) + 1));
  EXPECT_EQ(read_shard_info(p).meta.vocab_size, (int64_t{1} << 31) + 1);  // a valid shard ...
  expect_usage([&] { TokenDataset({p}, 8, 0, true); }, p + ": ",
               "vocab_size 2147483649 exceeds 2^31");  // ... that training cannot read as int32
  const std::string q = dir / "max-vocab.h5";
  write_shard(q, {0, 1, 2, 0x7FFFFFFF, 4}, {}, meta(int64_t{1} << 31));
  TokenDataset ok({q}, 4, 0, false);
  std::vector<int32_t> w(5);
  ok.window(0, w.data());
  EXPECT_EQ(w, (std::vector<int32_t>{0, 1, 2, 0x7FFFFFFF, 4}));
}

// ---- Permutation -------------------------------------------------------------------------------

TEST(Permutation, BijectionForManySizesAndSeeds) {
  for (uint64_t n : {1ull, 2ull, 3ull, 5ull, 1000ull, 4097ull}) {
    for (uint64_t seed : {0ull, 1ull, 12345ull}) {
      Permutation p(n, seed);
      EXPECT_EQ(p.size(), n);
      std::vector<uint64_t> out(n);
      for (uint64_t i = 0; i < n; ++i) out[i] = p(i);
      std::sort(out.begin(), out.end());
      for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], i) << "n=" << n << " seed=" << seed;
    }
  }
  // Huge n: O(1) memory, values in range and deterministic.
  const uint64_t big = (1ull << 40) + 3;
  Permutation p(big, 9), q(big, 9);
  for (uint64_t i : {uint64_t{0}, uint64_t{1}, big / 2, big - 1}) {
    EXPECT_LT(p(i), big);
    EXPECT_EQ(p(i), q(i));
  }
}

TEST(Permutation, SeedsGiveDifferentOrders) {
  for (uint64_t n : {1000ull, 4097ull}) {
    Permutation a(n, 1), b(n, 2), a2(n, 1);
    size_t same = 0, fixed = 0;
    for (uint64_t i = 0; i < n; ++i) {
      EXPECT_EQ(a(i), a2(i));
      same += a(i) == b(i);
      fixed += a(i) == i;
    }
    EXPECT_LT(same, n / 50) << n;  // ~1 expected for independent orders
    EXPECT_LT(fixed, n / 50) << n;
  }
}

// ---- windows -----------------------------------------------------------------------------------

TEST(TokenDataset, WindowContentsAndOrder) {
  TempDir dir;
  // Three shards of distinct tokens: a window's first token says which window it is.
  std::vector<std::vector<uint32_t>> shards = {ramp(101, 0), ramp(57, 1000), ramp(230, 2000)};
  std::vector<std::string> paths;
  for (size_t i = 0; i < shards.size(); ++i) {
    paths.push_back(dir / ("s-train-0000" + std::to_string(i) + ".h5"));
    write_shard(paths.back(), shards[i], {}, meta(70000));
  }
  const int64_t seq = 10;
  TokenDataset plain(paths, seq, 1, false);
  EXPECT_EQ(plain.num_windows(), 10u + 5u + 22u);
  EXPECT_EQ(plain.num_tokens(), 101u + 57u + 230u);
  EXPECT_EQ(plain.vocab_size(), 70000);
  EXPECT_EQ(plain.paths(), paths);

  // Unshuffled: shard by shard, window j at token j*seq; epochs repeat.
  std::map<int64_t, std::vector<int32_t>> by_first;
  uint64_t g = 0;
  for (const auto& t : shards)
    for (uint64_t j = 0; j < (t.size() - 1) / seq; ++j, ++g) {
      auto w = get_window(plain, g);
      ASSERT_EQ(w, expected_window(t, j, seq)) << g;
      EXPECT_EQ(get_window(plain, g + 3 * plain.num_windows()), w);
      by_first[w[0]] = w;
    }

  // Shuffled: every epoch visits each window once, in an order fixed by the seed.
  TokenDataset a(paths, seq, 42, true), a2(paths, seq, 42, true), b(paths, seq, 43, true);
  const uint64_t n = a.num_windows();
  std::vector<int64_t> epoch0, epoch1, other;
  for (uint64_t i = 0; i < n; ++i) {
    auto w = get_window(a, i);
    ASSERT_EQ(w, by_first.at(w[0]));
    ASSERT_EQ(w, get_window(a2, i));
    epoch0.push_back(w[0]);
    epoch1.push_back(get_window(a, n + i)[0]);
    other.push_back(get_window(b, i)[0]);
  }
  for (auto* order : {&epoch0, &epoch1, &other}) {
    std::vector<int64_t> sorted = *order;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> all;
    for (auto& [first, w] : by_first) all.push_back(first);
    EXPECT_EQ(sorted, all);
  }
  EXPECT_NE(epoch0, epoch1);  // each epoch reshuffles
  EXPECT_NE(epoch0, other);   // the seed matters

  // batch(): rows consecutive windows of one rank's slice.
  const int64_t rows = 3;
  std::vector<int32_t> buf(rows * (seq + 1));
  a.batch(20, 2, rows, buf.data());
  for (int64_t r = 0; r < rows; ++r) {
    auto w = get_window(a, 20 + 2 * rows + static_cast<uint64_t>(r));
    EXPECT_TRUE(std::equal(w.begin(), w.end(), buf.begin() + r * (seq + 1)));
  }
}

// ---- path expansion ----------------------------------------------------------------------------

// A weighted mixture (data.weights): every prefix of the global order holds each source's windows
// within one of its share of the period (for weights of every kind: uneven, equal, a tiny one, four
// sources), each source's windows in its own order (its shards' seeded permutation, wrapping on its
// own), and the windows counted per source (metrics' tokens per source) are those served. Sources
// of another vocabulary or tokenizer are refused, naming the entry.
TEST(TokenDataset, MixtureKeepsEveryPrefixWithinOneWindowOfItsShare) {
  TempDir dir;
  std::vector<std::vector<std::string>> sources;
  const uint32_t bases[4] = {0, 10000, 20000, 30000};
  for (size_t i = 0; i < 4; ++i) {
    sources.push_back({dir / ("m" + std::to_string(i) + "-train-00000.h5")});
    write_shard(sources.back()[0], ramp(50 + 40 * i, bases[i]), {}, meta(70000));  // a window's first token: its source
  }
  const int64_t seq = 4;
  const uint64_t P = TokenDataset::kMixturePeriod;
  for (const std::vector<double>& weights : std::vector<std::vector<double>>{{0.7, 0.3}, {1, 1}, {0.999, 0.001}, {3, 1, 1, 0.5}}) {
    SCOPED_TRACE(concat("weights ", weights.size(), " first ", weights[0]));
    const std::vector<std::vector<std::string>> mine(sources.begin(), sources.begin() + static_cast<long>(weights.size()));
    std::vector<std::string> names;
    for (size_t i = 0; i < weights.size(); ++i) names.push_back(concat("data.train[", i, "]"));
    TokenDataset mix(mine, weights, names, seq, 7, true);
    ASSERT_EQ(mix.sources(), weights.size());
    double total = 0;
    for (double w : weights) total += w;
    uint64_t slots = 0;
    for (size_t i = 0; i < weights.size(); ++i) {
      slots += mix.source_slots()[i];
      EXPECT_GE(mix.source_slots()[i], 1u);
      EXPECT_NEAR(static_cast<double>(mix.source_slots()[i]) / P, weights[i] / total, 1.0 / static_cast<double>(P) + weights.size() / static_cast<double>(P));
    }
    EXPECT_EQ(slots, P);
    std::vector<std::unique_ptr<TokenDataset>> alone;  // each source's own order
    for (size_t i = 0; i < weights.size(); ++i)
      alone.push_back(std::make_unique<TokenDataset>(mine[i], seq, 7 + 0x9E3779B97F4A7C15ull * (i + 1), true));
    std::vector<uint64_t> seen(weights.size(), 0);
    for (uint64_t g = 0; g < 3 * P + 17; ++g) {
      const auto w = get_window(mix, g);
      const auto i = static_cast<size_t>(w[0] / 10000);
      ASSERT_LT(i, weights.size());
      ASSERT_EQ(w, get_window(*alone[i], seen[i])) << "window " << g;
      ++seen[i];
      const auto counted = mix.source_windows(g + 1);
      for (size_t s = 0; s < weights.size(); ++s) {
        ASSERT_EQ(counted[s], seen[s]) << "after " << g + 1;
        const double share = static_cast<double>(mix.source_slots()[s]) / static_cast<double>(P) * static_cast<double>(g + 1);
        ASSERT_LT(std::abs(static_cast<double>(seen[s]) - share), 1.0) << "source " << s << " after " << g + 1 << " windows";
      }
    }
  }
  // data.stages: from window 1234 other weights (one source dropped): each source goes on with its
  // own next windows, the new shares held within one window from there on.
  {
    const std::vector<std::vector<std::string>> three(sources.begin(), sources.begin() + 3);
    TokenDataset mix(three, {0.5, 0.3, 0.2}, {"a", "b", "c"}, seq, 7, true, {{1234, {0.1, 0, 0.9}}});
    std::vector<std::unique_ptr<TokenDataset>> alone;
    for (size_t i = 0; i < 3; ++i)
      alone.push_back(std::make_unique<TokenDataset>(three[i], seq, 7 + 0x9E3779B97F4A7C15ull * (i + 1), true));
    std::vector<uint64_t> seen(3, 0), at_switch;
    for (uint64_t g = 0; g < 1234 + 2 * P + 5; ++g) {
      if (g == 1234) at_switch = seen;
      const auto w = get_window(mix, g);
      const auto i = static_cast<size_t>(w[0] / 10000);
      ASSERT_EQ(w, get_window(*alone[i], seen[i])) << "window " << g;
      ++seen[i];
      ASSERT_EQ(mix.source_windows(g + 1), seen) << "after " << g + 1;
      if (g < 1234) continue;
      for (size_t s2 = 0; s2 < 3; ++s2) {
        const double share = static_cast<double>(mix.source_slots(1)[s2]) / static_cast<double>(P) * static_cast<double>(g + 1 - 1234);
        ASSERT_LT(std::abs(static_cast<double>(seen[s2] - at_switch[s2]) - share), 1.0) << "source " << s2 << " after " << g + 1;
      }
    }
    EXPECT_EQ(mix.source_slots(1), (std::vector<uint64_t>{100, 0, 900}));
  }
  // Another vocabulary, another tokenizer: refused by name.
  const std::string other = dir / "o-train-00000.h5", named = dir / "n-train-00000.h5";
  write_shard(other, ramp(50), {}, meta(80000));
  ShardMeta hf = meta(70000);
  hf.tokenizer = "hf", hf.tokenizer_sha256 = std::string(64, 'a');
  write_shard(named, ramp(50), {}, hf);
  expect_usage([&] { TokenDataset({sources[0], {other}}, {1, 1}, {"data.train[0]", "data.train[1]"}, seq, 1, true); },
               "data.train[1]: ", "vocab_size 80000 differs from data.train[0]'s 70000");
  expect_usage([&] { TokenDataset({sources[0], {named}}, {1, 1}, {"data.train[0]", "data.train[1]"}, seq, 1, true); },
               "data.train[1]: ", "packed with another tokenizer");
}

TEST(ExpandShardPaths, DirGlobFileAndNothing) {
  TempDir dir;
  fs::create_directory(dir / "d");
  for (const char* name : {"d/b.h5", "d/a.h5", "d/notes.txt", "d/c.h5.tmp", "x.h5"})
    write_text(dir / name, "");
  fs::create_directory(dir / "empty");

  EXPECT_EQ(expand_shard_paths({dir / "d"}, "k"),
            (std::vector<std::string>{dir / "d/a.h5", dir / "d/b.h5"}));
  EXPECT_EQ(expand_shard_paths({dir / "d/*.h5"}, "k"),
            (std::vector<std::string>{dir / "d/a.h5", dir / "d/b.h5"}));
  EXPECT_EQ(expand_shard_paths({dir / "x.h5"}, "k"), (std::vector<std::string>{dir / "x.h5"}));
  // Sorted and de-duplicated across patterns.
  EXPECT_EQ(expand_shard_paths({dir / "x.h5", dir / "d/b.h5", dir / "d/?.h5"}, "k"),
            (std::vector<std::string>{dir / "d/a.h5", dir / "d/b.h5", dir / "x.h5"}));

  std::string none = dir / "nope-*.h5";
  expect_usage([&] { expand_shard_paths({dir / "x.h5", none}, "data.train"); }, "",
               "data.train: no shard matches '" + none + "'");
  expect_usage([&] { expand_shard_paths({dir / "empty"}, "data.val"); }, "data.val: ",
               "no shard matches");
}

// ---- pack_text ---------------------------------------------------------------------------------

namespace {

// Splits the concatenated tokens of `paths` at EOT into documents; checks doc_offsets on the way.
std::vector<std::string> unpack(const std::vector<std::string>& paths, uint64_t limit) {
  std::vector<std::string> docs;
  for (size_t s = 0; s < paths.size(); ++s) {
    auto t = read_shard_tokens(paths[s]);
    EXPECT_LT(t.size(), limit + (limit + 1) / 2);  // a short remainder joins the last shard
    if (s + 1 < paths.size()) {
      EXPECT_EQ(t.size(), limit);  // only the last shard is partial
    }
    std::vector<uint64_t> eots;
    for (size_t i = 0; i < t.size(); ++i) {
      if (t[i] == kByteEot) {
        eots.push_back(i);
        docs.emplace_back();
      } else {
        EXPECT_FALSE(docs.empty()) << "bytes before the first EOT";
        if (!docs.empty()) docs.back().push_back(static_cast<char>(t[i]));
      }
    }
    h5::File f = h5::open_read(paths[s]);
    std::vector<uint64_t> offsets;
    if (h5::exists(f.get(), "doc_offsets")) {
      h5::Dataset d(H5Dopen2(f.get(), "doc_offsets", H5P_DEFAULT));
      offsets.resize(h5::shape(d.get())[0]);
      h5::read(d.get(), H5T_NATIVE_UINT64, offsets.data());
    }
    EXPECT_EQ(offsets, eots) << paths[s];
    ShardInfo info = read_shard_info(paths[s]);
    EXPECT_EQ(info.meta.vocab_size, kByteVocab);
    EXPECT_EQ(info.meta.eot_token, kByteEot);
    EXPECT_EQ(info.meta.tokenizer, "byte");
  }
  return docs;
}

bool is_subsequence(const std::vector<std::string>& sub, const std::vector<std::string>& all) {
  size_t i = 0;
  for (const auto& d : all)
    if (i < sub.size() && sub[i] == d) ++i;
  return i == sub.size();
}

}  // namespace

TEST(PackText, FortuneCorpus) {
  TempDir dir;
  // Corpus: a/ (two fortune files, one nested), an index file and a symlink that must be skipped.
  std::vector<std::string> docs;
  std::string text;
  for (int i = 0; i < 30; ++i) {
    std::string d =
        "Fortune " + std::to_string(i) + ":\nsome wisdom, " + std::string(i % 7, '!') + "\n";
    text += d + "%\n";
    if (i == 10) text += "   \n%\n";  // blank document: dropped
    docs.push_back(d);
  }
  fs::create_directories(dir / "corpus/sub");
  write_text(dir / "corpus/sub/z.txt", text);
  write_text(dir / "corpus/a", "%\nfirst\n%\nsecond\r\n%\r\nthird, no final newline");
  write_text(dir / "corpus/a.dat", std::string("\x01\x02\x00\xff", 4));
  fs::create_symlink(dir / "corpus/a", dir / "corpus/link");
  std::vector<std::string> all = {"first\n", "second\r\n", "third, no final newline"};
  all.insert(all.end(), docs.begin(), docs.end());  // "a" sorts before "sub/z.txt"

  PackOptions o;
  o.inputs = {dir / "corpus"};
  o.output_prefix = dir / "out/fortunes";  // out/ does not exist yet
  o.doc_separator = "%";
  o.val_fraction = 0.3;
  o.shard_tokens = 64;
  o.seed = 7;
  PackResult r = pack_text(o);
  EXPECT_EQ(r.documents, all.size());
  ASSERT_FALSE(r.train_shards.empty());
  ASSERT_FALSE(r.val_shards.empty());
  EXPECT_EQ(r.train_shards[0], dir / "out/fortunes-train-00000.h5");
  EXPECT_EQ(r.val_shards[0], dir / "out/fortunes-val-00000.h5");

  auto train = unpack(r.train_shards, 64), val = unpack(r.val_shards, 64);
  EXPECT_EQ(train.size() + val.size(), all.size());
  EXPECT_TRUE(is_subsequence(train, all));
  EXPECT_TRUE(is_subsequence(val, all));
  std::multiset<std::string> got(train.begin(), train.end()), want(all.begin(), all.end());
  got.insert(val.begin(), val.end());
  EXPECT_EQ(got, want);
  uint64_t total = 0;
  for (const auto& d : all) total += d.size() + 1;
  EXPECT_EQ(r.train_tokens + r.val_tokens, total);

  // Deterministic: the same inputs and seed give the same shards, token for token.
  PackOptions o2 = o;
  o2.output_prefix = dir / "again";
  PackResult r2 = pack_text(o2);
  ASSERT_EQ(r2.train_shards.size(), r.train_shards.size());
  for (size_t i = 0; i < r.train_shards.size(); ++i)
    EXPECT_EQ(read_shard_tokens(r.train_shards[i]), read_shard_tokens(r2.train_shards[i]));

  // Repacking into the same prefix with bigger shards removes the now-stale higher indices.
  o.shard_tokens = 1 << 20;
  PackResult r3 = pack_text(o);
  EXPECT_EQ(r3.train_shards.size(), 1u);
  EXPECT_EQ(expand_shard_paths({dir / "out/fortunes-train-*.h5"}, "k"), r3.train_shards);
  EXPECT_EQ(unpack(r3.train_shards, 1 << 20), train);
}

TEST(PackText, WholeFilesAndTinySplits) {
  TempDir dir;
  write_text(dir / "one.txt", "hello\n");
  write_text(dir / "two.txt", "world\n");
  PackOptions o;
  o.inputs = {dir / "one.txt", dir / "two.txt"};
  o.output_prefix = dir / "p";
  o.val_fraction = 1e-9;  // no hash lands in val: the last document is moved there
  PackResult r = pack_text(o);
  EXPECT_EQ(r.documents, 2u);
  EXPECT_EQ(unpack(r.train_shards, o.shard_tokens), (std::vector<std::string>{"hello\n"}));
  EXPECT_EQ(unpack(r.val_shards, o.shard_tokens), (std::vector<std::string>{"world\n"}));
  EXPECT_EQ(r.train_tokens, 7u);

  o.val_fraction = 0;
  r = pack_text(o);
  EXPECT_TRUE(r.val_shards.empty());
  EXPECT_FALSE(fs::exists(dir / "p-val-00000.h5"));  // the earlier val shard is stale
  EXPECT_EQ(unpack(r.train_shards, o.shard_tokens),
            (std::vector<std::string>{"hello\n", "world\n"}));
}

TEST(PackText, BadInputs) {
  TempDir dir;
  PackOptions o;
  o.output_prefix = dir / "p";
  o.inputs = {dir / "missing"};
  expect_usage([&] { pack_text(o); }, "", dir / "missing: no such file or directory");

  fs::create_directories(dir / "empty/sub");
  write_text(dir / "empty/index.dat", "x");
  o.inputs = {dir / "empty"};
  expect_usage([&] { pack_text(o); }, "", dir / "empty: empty directory");

  write_text(dir / "blank.txt", " \n\n%\n\t\n");
  o.inputs = {dir / "blank.txt"};
  o.doc_separator = "%";
  expect_usage([&] { pack_text(o); }, dir / "blank.txt", "no documents");

  o.val_fraction = 1.0;
  expect_usage([&] { pack_text(o); }, "pack: ", "val_fraction");
}
