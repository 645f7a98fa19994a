// `mpitrain pack` beyond byte-level text: nanoGPT / llm.c / npy round trips, documents and the
// split for token arrays, format detection, every bad-input message, and (the same binary under
// mpirun -np 2/4) packing over MPI_COMM_WORLD equal to packing alone, shard for shard. GPT-2 text
// packing is tested with the tokenizer, in test_bpe.cpp.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "temp_dir.h"
#include "test_data.h"
#include "mpitrain/error.h"
#include "mpitrain/h5.h"
#include "mpitrain/importers.h"
#include "mpitrain/pack.h"
#include "mpitrain/shards.h"
#include "mpi_world.h"
#include "npy_writer.h"

using namespace mpitrain;
namespace fs = std::filesystem;

namespace {

// ---- helpers -----------------------------------------------------------------------------------

const std::string kData = kTestDataDir;


// The tests of one process run only in the singleton binary; under mpirun only the MPI ones do.
#define SINGLETON_ONLY() \
  if (world_size() > 1) GTEST_SKIP() << "single-process test"

void write_text(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

void write_nanogpt(const std::string& path, const std::vector<uint32_t>& t) {
  std::vector<uint16_t> narrow(t.begin(), t.end());
  write_text(path, std::string(reinterpret_cast<const char*>(narrow.data()), narrow.size() * 2));
}

// llm.c: 256 int32 header (magic, version, count), then uint16 (v1) or uint32 (v7) tokens.
void write_llmc(const std::string& path, int version, const std::vector<uint32_t>& t,
                int32_t magic = 0, int64_t count = INT64_MIN) {
  std::vector<int32_t> header(256, 0);
  header[0] = magic ? magic : version == 1 ? kLlmcMagicV1 : kLlmcMagicV7;
  header[1] = version;
  header[2] = static_cast<int32_t>(count != INT64_MIN ? count : static_cast<int64_t>(t.size()));
  std::string bytes(reinterpret_cast<const char*>(header.data()), 1024);
  if (version == 1) {
    std::vector<uint16_t> narrow(t.begin(), t.end());
    bytes.append(reinterpret_cast<const char*>(narrow.data()), narrow.size() * 2);
  } else {
    bytes.append(reinterpret_cast<const char*>(t.data()), t.size() * 4);
  }
  write_text(path, bytes);
}

template <class T>
void write_npy(const std::string& path, const std::string& descr, const std::vector<uint32_t>& t,
               int major = 1) {
  std::vector<T> v(t.begin(), t.end());
  npy_test::write_npy_bytes(path,
                "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" +
                    std::to_string(t.size()) + ",), }",
                std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T)), major);
}

// n tokens below `vocab`, with an EOT about every `doc` tokens (none at position 0, never two in a
// row).
std::vector<uint32_t> token_corpus(size_t n, uint32_t vocab, uint32_t eot, size_t doc,
                                   uint32_t seed = 1) {
  std::mt19937 rng(seed);
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) {
    t[i] = rng() % vocab;
    if (t[i] == eot) t[i] = 0;
    if (i > 0 && t[i - 1] != eot && rng() % doc == 0) t[i] = eot;  // no EOT-only documents
  }
  return t;
}

std::vector<uint64_t> doc_offsets(const std::string& path) {
  h5::File f = h5::open_read(path);
  std::vector<uint64_t> out;
  if (!h5::exists(f.get(), "doc_offsets")) return out;
  h5::Dataset d(H5Dopen2(f.get(), "doc_offsets", H5P_DEFAULT));
  out.resize(h5::shape(d.get())[0]);
  h5::read(d.get(), H5T_NATIVE_UINT64, out.data());
  return out;
}

// All tokens of some shards, checking on the way that shards are full but the last, that the last
// of several holds between half and one and a half shards (a shorter remainder is folded into it),
// that doc_offsets are the EOT positions, and the metadata.
std::vector<uint32_t> stream(const std::vector<std::string>& paths, uint64_t limit, int64_t vocab,
                             int64_t eot) {
  std::vector<uint32_t> all;
  for (size_t s = 0; s < paths.size(); ++s) {
    auto t = read_shard_tokens(paths[s]);
    if (s + 1 < paths.size()) {
      EXPECT_EQ(t.size(), limit) << paths[s];  // only the last shard is partial
    } else {
      if (paths.size() > 1) {
        EXPECT_GE(t.size(), (limit + 1) / 2) << paths[s];
      }
      EXPECT_LT(t.size(), limit + (limit + 1) / 2) << paths[s];
    }
    std::vector<uint64_t> eots;
    for (size_t i = 0; i < t.size(); ++i)
      if (t[i] == eot) eots.push_back(i);
    EXPECT_EQ(doc_offsets(paths[s]), eots) << paths[s];
    ShardInfo info = read_shard_info(paths[s]);
    EXPECT_EQ(info.meta.vocab_size, vocab);
    EXPECT_EQ(info.meta.eot_token, eot);
    all.insert(all.end(), t.begin(), t.end());
  }
  return all;
}

// Documents of a token stream: each EOT starts one; leading tokens before the first EOT are one.
std::vector<std::vector<uint32_t>> documents(const std::vector<uint32_t>& t, uint32_t eot) {
  std::vector<std::vector<uint32_t>> docs;
  for (size_t i = 0; i < t.size(); ++i) {
    if (docs.empty() || t[i] == eot) docs.emplace_back();
    docs.back().push_back(t[i]);
  }
  return docs;
}

void expect_usage(const std::function<void()>& f, const std::string& starts,
                  const std::string& contains) {
  try {
    f();
    ADD_FAILURE() << "no UsageError; expected one starting '" << starts << "' containing '"
                  << contains << "'";
  } catch (const UsageError& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind(starts, 0), 0u) << m;
    EXPECT_NE(m.find(contains), std::string::npos) << m;
  }
}

PackOptions options(const std::vector<std::string>& inputs, const std::string& prefix,
                    uint64_t shard, double val = 0) {
  PackOptions o;
  o.inputs = inputs;
  o.output_prefix = prefix;
  o.shard_tokens = shard;
  o.val_fraction = val;
  return o;
}

}  // namespace

// ---- token-array round trips -------------------------------------------------------------------

TEST(PackTokens, NanoGptRoundTrip) {
  SINGLETON_ONLY();
  TempDir dir;
  auto t = token_corpus(5000, 50257, 50256, 200);
  write_nanogpt(dir / "train.bin", t);
  PackResult r = pack_text(options({dir / "train.bin"}, dir / "out/nano", 1024));
  EXPECT_EQ(r.train_shards.size(), 5u);
  EXPECT_TRUE(r.val_shards.empty());
  EXPECT_EQ(stream(r.train_shards, 1024, 50257, 50256), t);
  EXPECT_EQ(r.documents, documents(t, 50256).size());
  EXPECT_EQ(r.train_tokens, t.size());
  ShardInfo info = read_shard_info(r.train_shards[0]);
  EXPECT_EQ(info.meta.tokenizer, "gpt2");
  EXPECT_EQ(info.dtype_bytes, 2);
  EXPECT_NE(info.meta.source.find("1 files (1 nanogpt)"), std::string::npos) << info.meta.source;
}

TEST(PackTokens, LlmcRoundTrips) {
  SINGLETON_ONLY();
  TempDir dir;
  auto v1 = token_corpus(3000, 50257, 50256, 100, 2);
  write_llmc(dir / "fineweb_train_000001.bin", 1, v1);
  PackResult r = pack_text(options({dir / "fineweb_train_000001.bin"}, dir / "v1", 1000));
  EXPECT_EQ(stream(r.train_shards, 1000, 50257, 50256), v1);

  // Version 7: uint32 tokens of a Llama-3-sized vocabulary; the shards become uint32 too.
  auto v7 = token_corpus(3000, 128256, 128000, 100, 3);
  write_llmc(dir / "llama.bin", 7, v7);
  PackOptions o = options({dir / "llama.bin"}, dir / "v7", 1000);
  o.vocab_size = 128256;
  o.eot_token = 128000;
  r = pack_text(o);
  EXPECT_EQ(stream(r.train_shards, 1000, 128256, 128000), v7);
  ShardInfo info = read_shard_info(r.train_shards[0]);
  EXPECT_EQ(info.dtype_bytes, 4);
  EXPECT_EQ(info.meta.tokenizer, "unknown");
}

TEST(PackTokens, NpyRoundTrips) {
  SINGLETON_ONLY();
  TempDir dir;
  auto t = token_corpus(700, 120, 100, 30, 4);
  write_npy<uint16_t>(dir / "a.npy", "<u2", t);
  write_npy<int16_t>(dir / "b.npy", "<i2", t, 2);
  write_npy<uint32_t>(dir / "c.npy", "<u4", t, 3);
  write_npy<int32_t>(dir / "d.npy", "<i4", t);
  write_npy<uint64_t>(dir / "e.npy", "<u8", t);
  write_npy<int64_t>(dir / "f.npy", "<i8", t);
  write_npy<uint8_t>(dir / "g.npy", "|u1", t);
  write_npy<int8_t>(dir / "h.npy", "|i1", t);
  PackOptions o = options({dir.path}, dir / "out/np", 512);
  o.vocab_size = 128;
  o.eot_token = 100;
  PackResult r = pack_text(o);
  std::vector<uint32_t> want;
  for (int i = 0; i < 8; ++i) want.insert(want.end(), t.begin(), t.end());
  EXPECT_EQ(stream(r.train_shards, 512, 128, 100), want);
  EXPECT_NE(read_shard_info(r.train_shards[0]).meta.source.find("8 files (8 npy)"),
            std::string::npos);
}

// A remainder shorter than half a shard joins the last shard (a pack of 2 N + 1 tokens was N, N and
// 1, and training refuses a 1-token shard: shorter than any window); half a shard or more stays a
// shard of its own.
TEST(PackTokens, ShortRemainderJoinsTheLastShard) {
  SINGLETON_ONLY();
  TempDir dir;
  struct Case { size_t tokens; std::vector<size_t> shards; };
  for (const Case& c : {Case{2001, {1000, 1001}}, Case{2499, {1000, 1499}}, Case{2500, {1000, 1000, 500}},
                        Case{1001, {1001}}, Case{999, {999}}, Case{1, {1}}}) {
    auto t = token_corpus(c.tokens, 50257, 50256, 50, 11);
    const std::string name = "n" + std::to_string(c.tokens);
    write_nanogpt(dir / (name + ".bin"), t);
    PackResult r = pack_text(options({dir / (name + ".bin")}, dir / ("out/" + name), 1000));
    std::vector<size_t> sizes;
    for (const std::string& p : r.train_shards) sizes.push_back(read_shard_tokens(p).size());
    EXPECT_EQ(sizes, c.shards) << c.tokens << " tokens";
    EXPECT_EQ(stream(r.train_shards, 1000, 50257, 50256), t) << c.tokens << " tokens";
  }
}

// Documents start at EOTs and at every file's start; each goes whole to train or val.
TEST(PackTokens, SplitPerDocument) {
  SINGLETON_ONLY();
  TempDir dir;
  write_nanogpt(dir / "x.bin", {1, 2, 50256, 3});
  write_nanogpt(dir / "y.bin", {4, 50256, 5});
  PackResult r = pack_text(options({dir / "x.bin", dir / "y.bin"}, dir / "xy", 100));
  EXPECT_EQ(r.documents, 4u);  // [1 2] [EOT 3] [4] [EOT 5]
  EXPECT_EQ(stream(r.train_shards, 100, 50257, 50256),
            (std::vector<uint32_t>{1, 2, 50256, 3, 4, 50256, 5}));

  auto a = token_corpus(4000, 50257, 50256, 50, 5), b = token_corpus(3000, 50257, 50256, 80, 6);
  b[0] = 50256;  // so that every document but the very first is recognisable by its EOT below
  write_nanogpt(dir / "a.bin", a);
  write_llmc(dir / "b.bin", 1, b);
  auto all = documents(a, 50256), docs_b = documents(b, 50256);
  all.insert(all.end(), docs_b.begin(), docs_b.end());
  PackOptions o = options({dir / "a.bin", dir / "b.bin"}, dir / "s", 777, 0.3);
  o.seed = 11;
  r = pack_text(o);
  EXPECT_EQ(r.documents, all.size());
  auto train_tokens = stream(r.train_shards, 777, 50257, 50256);
  auto train = documents(train_tokens, 50256),
       val = documents(stream(r.val_shards, 777, 50257, 50256), 50256);
  // Both splits are subsequences of the documents, and together all of them.
  size_t ti = 0, vi = 0;
  for (const auto& d : all) {
    if (ti < train.size() && train[ti] == d)
      ++ti;
    else if (vi < val.size() && val[vi] == d)
      ++vi;
    else
      ADD_FAILURE() << "document " << (&d - all.data()) << " is in neither split in order";
  }
  EXPECT_EQ(ti, train.size());
  EXPECT_EQ(vi, val.size());
  EXPECT_GT(vi, all.size() / 6);
  EXPECT_LT(vi, all.size() / 2);
  // The split depends on (seed, document index) only: other shard sizes, same documents.
  o.shard_tokens = 100000;
  o.output_prefix = dir / "s2";
  EXPECT_EQ(stream(pack_text(o).train_shards, 100000, 50257, 50256), train_tokens);
}

// ---- formats and options -----------------------------------------------------------------------

TEST(PackInputs, FormatDetection) {
  SINGLETON_ONLY();
  TempDir dir;
  write_llmc(dir / "l.bin", 1, {1, 2, 3});
  write_nanogpt(dir / "n.bin", {1, 2, 3});
  write_npy<uint16_t>(dir / "x.npy", "<u2", {1, 2});
  write_text(dir / "t.txt", "hi");
  write_text(dir / "noext", "hi");
  EXPECT_EQ(detect_format(dir / "l.bin"), InputFormat::llmc);
  EXPECT_EQ(detect_format(dir / "n.bin"), InputFormat::nanogpt);
  EXPECT_EQ(detect_format(dir / "x.npy"), InputFormat::npy);
  EXPECT_EQ(detect_format(dir / "t.txt"), InputFormat::text);
  EXPECT_EQ(detect_format(dir / "noext"), InputFormat::text);
  // Text and token arrays together share the text tokenizer's vocabulary (bytes here).
  write_nanogpt(dir / "bytes.bin", {256, 'o', 'k'});
  PackResult r = pack_text(options({dir / "t.txt", dir / "bytes.bin"}, dir / "m", 100));
  EXPECT_EQ(stream(r.train_shards, 100, kByteVocab, kByteEot),
            (std::vector<uint32_t>{256, 'h', 'i', 256, 'o', 'k'}));
  // --format forces how every file is read, whatever its name.
  fs::copy_file(dir / "l.bin", dir / "l.tokens");
  PackOptions o = options({dir / "l.tokens"}, dir / "f", 100);
  o.format = "llmc";
  EXPECT_EQ(stream(pack_text(o).train_shards, 100, 50257, 50256), (std::vector<uint32_t>{1, 2, 3}));
  o.inputs = {dir / "l.bin"};  // as raw uint16, the llm.c magic is a token out of GPT-2's range
  o.format = "nanogpt";
  expect_usage([&] { pack_text(o); },
               dir / "l.bin: ", "token 55432 at position 0 is >= vocab_size 50257");
}

TEST(PackInputs, BadOptions) {
  SINGLETON_ONLY();
  TempDir dir;
  write_text(dir / "t.txt", "text");
  write_nanogpt(dir / "n.bin", {1, 2});
  auto o = options({dir / "t.txt"}, dir / "p", 100);
  auto bad = [&](const std::function<void(PackOptions&)>& f, const std::string& starts,
                 const std::string& contains) {
    PackOptions x = o;
    f(x);
    expect_usage([&] { pack_text(x); }, starts, contains);
  };
  bad([](PackOptions& x) { x.format = "csv"; }, "pack: --format 'csv'",
      "auto, text, jsonl, nanogpt, llmc, npy");
  bad([](PackOptions& x) { x.tokenizer = "llama"; }, "pack: --tokenizer 'llama'",
      "not byte, gpt2 or hf");
  bad([](PackOptions& x) { x.vocab_size = 300; }, "pack: --vocab-size 300",
      "contradicts the byte tokenizer's 257");
  bad([](PackOptions& x) { x.tokenizer = "gpt2"; }, "pack: the gpt2 tokenizer needs --bpe-dir DIR",
      "");
  bad([&](PackOptions& x) { x.tokenizer = "gpt2", x.bpe_dir = dir.path, x.bpe_vocab = "v"; },
      "pack: give --bpe-dir", "not both");
  bad([&](PackOptions& x) { x.tokenizer = "gpt2", x.bpe_dir = dir.path; },
      dir.path + ": no GPT-2 BPE files", "");
  bad([&](PackOptions& x) { x.inputs = {dir / "n.bin"}, x.eot_token = 70000; }, "pack: --eot 70000",
      "not in [0, vocab size 50257)");
  bad([&](PackOptions& x) { x.inputs = {dir / "n.bin"}, x.vocab_size = -5; },
      "pack: --vocab-size -5", "not in [1, 2^32]");
  bad([&](PackOptions& x) { x.inputs = {dir / "n.bin"}, x.tokenizer = "byte", x.eot_token = 3; },
      "pack: --eot 3", "contradicts the byte tokenizer's 256");
  bad([](PackOptions& x) { x.shard_tokens = 0; }, "pack: shard_tokens", "> 0");
  bad([](PackOptions& x) { x.val_fraction = 1.0; }, "pack: val_fraction", "not in [0, 1)");
  write_text(dir / "blocker", "a file where a directory should be");
  bad([&](PackOptions& x) { x.output_prefix = dir / "blocker/sub/p"; }, dir / "blocker/sub",
      "cannot create output directory");
}

// Every bad input file: a one-line UsageError that starts with the file's path.
TEST(PackInputs, BadFiles) {
  SINGLETON_ONLY();
  TempDir dir;
  auto expect_bad = [&](const std::string& path, const std::string& contains,
                        const std::string& format = "auto", int64_t vocab = 0) {
    PackOptions o = options({path}, dir / "out", 100);
    o.format = format;
    o.vocab_size = vocab;
    if (vocab) o.eot_token = 0;
    expect_usage([&] { pack_text(o); }, path + ": ", contains);
  };
  expect_bad(dir / "missing.bin", "no such file or directory");
  fs::create_directories(dir / "empty");
  expect_bad(dir / "empty", "empty directory");
  write_text(dir / "blank.txt", " \n\t\n");
  expect_bad(dir / "blank.txt", "no documents (every input file is empty or blank)");

  write_text(dir / "odd.bin", "abc");
  expect_bad(dir / "odd.bin", "size 3 bytes is odd (a nanoGPT .bin is a headerless uint16 array)");
  write_text(dir / "empty.bin", "");
  expect_bad(dir / "empty.bin", "no tokens (empty array)");
  write_nanogpt(dir / "big.bin", {5, 50256, 7, 50300, 9});
  expect_bad(dir / "big.bin", "token 50300 at position 3 is >= vocab_size 50257");
  write_nanogpt(dir / "small.bin", {5, 0, 300});
  expect_bad(dir / "small.bin", "token 300 at position 2 is >= vocab_size 257", "auto", 257);

  write_text(dir / "short.bin", std::string(100, 'x'));
  expect_bad(dir / "short.bin", "100 bytes, too short for the 1024-byte llm.c header", "llmc");
  auto llmc_bad = [&](const std::string& name, int version, int32_t magic, int64_t count,
                      const std::string& contains) {
    write_llmc(dir / name, version, {1, 2, 3}, magic, count);
    expect_bad(dir / name, contains, "llmc");
  };
  llmc_bad("magic.bin", 1, 12345, 3,
           "bad magic 12345 (an llm.c .bin starts with 20240520 or 20240801)");
  llmc_bad("version.bin", 7, kLlmcMagicV1, 3,
           "llm.c magic 20240520 with version 7, expected version 1");
  llmc_bad("trunc.bin", 1, 0, 10,
           "size 1030 bytes, but the llm.c header's 10 tokens need 1044 (truncated)");
  llmc_bad("trail.bin", 7, 0, 2,
           "size 1036 bytes, but the llm.c header's 2 tokens need 1032 (trailing data)");
  llmc_bad("neg.bin", 1, 0, -4, "token count -4 in the llm.c header is negative");
  write_llmc(dir / "none.bin", 1, {});
  expect_bad(dir / "none.bin", "no tokens (empty array)");
  write_text(dir / "shard.h5", "any");
  expect_bad(dir / "shard.h5", "an HDF5 file; pack reads text, .bin (nanoGPT, llm.c) and .npy");

  auto npy_bad = [&](const std::string& name, const std::string& dict, const std::string& contains,
                     int major = 1) {
    npy_test::write_npy_bytes(dir / name, "{'descr': " + dict + "}", std::string(4, '\0'), major);
    expect_bad(dir / name, contains);
  };
  write_text(dir / "magic.npy", "NUMPY? not really");
  expect_bad(dir / "magic.npy", "not a .npy file (no \\x93NUMPY magic)");
  const std::string ok = "'<u2', 'fortran_order': False, 'shape': (2,), ";
  npy_bad("v9.npy", ok, "unsupported .npy version 9.0", 9);
  npy_bad(
      "f4.npy", "'<f4', 'fortran_order': False, 'shape': (1,), ",
      "unsupported dtype '<f4', expected a little-endian integer: <u2 <i2 <u4 <i4 <u8 <i8 |u1 |i1");
  npy_bad("be.npy", "'>u2', 'fortran_order': False, 'shape': (2,), ", "unsupported dtype '>u2'");
  npy_bad("rec.npy", "[('a', '<u2')], 'fortran_order': False, 'shape': (2,), ",
          "unsupported dtype (a structured array)");
  npy_bad("2d.npy", "'<u2', 'fortran_order': False, 'shape': (1, 2), ",
          "shape (1, 2) is not 1-D (expected (N,))");
  npy_bad("0d.npy", "'<u2', 'fortran_order': False, 'shape': (), ", "shape () is not 1-D");
  npy_bad("fo.npy", "'<u2', 'fortran_order': True, 'shape': (2,), ",
          "fortran_order is True, expected False");
  npy_bad("short.npy", "'<u2', 'fortran_order': False, 'shape': (3,), ",
          "size 132 bytes, but shape (3,) needs 134 (truncated)");
  npy_bad("junk.npy", "'<u2', 'fortran_order': Maybe, 'shape': (2,), ",
          "malformed .npy header (fortran_order is not True or False)");
  write_npy<int32_t>(dir / "neg.npy", "<i4", {3, static_cast<uint32_t>(-2)});
  expect_bad(dir / "neg.npy", "token -2 at position 1 is negative");

  write_text(dir / "latin1.txt", "caf\xe9 au lait\n");
  PackOptions o = options({dir / "latin1.txt"}, dir / "out", 100);
  o.tokenizer = "gpt2";
  o.bpe_dir = kData + "/gpt2";
  expect_usage([&] { pack_text(o); }, dir / "latin1.txt: ",
               "invalid UTF-8 at byte 3 (the gpt2 tokenizer reads UTF-8 text)");
  o.inputs = {dir / "big.bin"};  // token arrays alone need no BPE files, only its vocabulary
  o.bpe_dir.clear();
  expect_usage([&] { pack_text(o); },
               dir / "big.bin: ", "token 50300 at position 3 is >= vocab_size 50257");
}

// ---- parallel packing --------------------------------------------------------------------------

namespace {

// Packs `o` over MPI_COMM_WORLD into <dir>/world, and on rank 0 alone into <dir>/self; then rank 0
// compares every shard: tokens, doc_offsets and attributes, bit for bit.
void expect_same_as_single_rank(PackOptions o, const TempDir& dir, const std::string& name) {
  o.output_prefix = dir / ("world/" + name);
  PackResult w = pack(o, mpi::world());
  if (world_rank() != 0) return;
  o.output_prefix = dir / ("self/" + name);
  PackResult s = pack(o, mpi::self());
  EXPECT_EQ(w.documents, s.documents);
  EXPECT_EQ(w.train_tokens, s.train_tokens);
  EXPECT_EQ(w.val_tokens, s.val_tokens);
  EXPECT_DOUBLE_EQ(w.train_unigram_entropy, s.train_unigram_entropy);
  ASSERT_EQ(w.train_shards.size(), s.train_shards.size());
  ASSERT_EQ(w.val_shards.size(), s.val_shards.size());
  EXPECT_GT(w.train_shards.size(), 2u) << name << ": too few shards to cross ranks";
  std::vector<std::string> ws = w.train_shards, ss = s.train_shards;
  ws.insert(ws.end(), w.val_shards.begin(), w.val_shards.end());
  ss.insert(ss.end(), s.val_shards.begin(), s.val_shards.end());
  for (size_t i = 0; i < ws.size(); ++i) {
    EXPECT_EQ(fs::path(ws[i]).filename(), fs::path(ss[i]).filename());
    EXPECT_EQ(read_shard_tokens(ws[i]), read_shard_tokens(ss[i])) << ws[i];
    EXPECT_EQ(doc_offsets(ws[i]), doc_offsets(ss[i])) << ws[i];
    h5::File a = h5::open_read(ws[i]), b = h5::open_read(ss[i]);
    for (const char* attr : {"format", "tokenizer", "source"})
      EXPECT_EQ(h5::get_attr_string(a.get(), attr), h5::get_attr_string(b.get(), attr)) << attr;
    for (const char* attr : {"version", "vocab_size", "eot_token", "num_tokens"})
      EXPECT_EQ(h5::get_attr_int(a.get(), attr), h5::get_attr_int(b.get(), attr)) << attr;
  }
  EXPECT_EQ(fs::exists(dir / ("world/" + name + "-val-00000.h5")), !w.val_shards.empty());
}

}  // namespace

TEST(PackParallel, SameShardsAsOneRank) {
  TempDir dir(/*shared=*/true);
  if (world_rank() == 0) {
    fs::create_directories(dir / "text/sub");
    std::mt19937 rng(3);
    for (int f = 0; f < 7; ++f) {  // text files of very different sizes
      std::string text;
      for (int d = 0; d < 3 + f * f; ++d)
        text += "Document " + std::to_string(d) + " of file " + std::to_string(f) + ": " +
                std::string(rng() % 90, static_cast<char>('a' + f)) + " ünïcode ✓\n%\n";
      write_text(
          dir / ("text/" + std::string(f % 2 ? "sub/" : "") + "f" + std::to_string(f) + ".txt"),
          text);
    }
    // One large token file that every rank gets a piece of, with a long stretch without EOT so that
    // a document runs through a whole rank's range; then smaller files of each format.
    auto big = token_corpus(20000, 50257, 50256, 300, 8);
    std::fill(big.begin() + 6000, big.begin() + 14000, 42);
    fs::create_directories(dir / "tok");
    write_nanogpt(dir / "tok/a_big.bin", big);
    write_llmc(dir / "tok/b_llmc.bin", 1, token_corpus(1500, 50257, 50256, 40, 9));
    write_npy<int64_t>(dir / "tok/c.npy", "<i8", token_corpus(900, 50257, 50256, 60, 10));
    write_nanogpt(dir / "tok/d_tiny.bin", {50256});
  }
  mpi::barrier(mpi::world());

  PackOptions text = options({dir / "text"}, "", 97, 0.2);
  text.doc_separator = "%";
  expect_same_as_single_rank(text, dir, "bytes");
  text.tokenizer = "gpt2";
  text.bpe_dir = kData + "/gpt2";
  text.shard_tokens = 61;
  expect_same_as_single_rank(text, dir, "gpt2");
  PackOptions tok = options({dir / "tok"}, "", 1000, 0.1);
  tok.seed = 5;
  expect_same_as_single_rank(tok, dir, "tokens");
  tok.shard_tokens = 7;  // shards much smaller than a rank's share
  tok.inputs = {dir / "tok/b_llmc.bin", dir / "text/f2.txt"};
  tok.tokenizer = "gpt2";
  tok.bpe_dir = kData + "/gpt2";
  expect_same_as_single_rank(tok, dir, "mixed");
  // The folded last shard is assembled across ranks: 20000 + 1500 + 900 + 1 tokens in shards of
  // 2000 leave a remainder of 401, which joins the shard before, from the ranks that hold it.
  PackOptions fold = options({dir / "tok"}, "", 2000, 0);
  expect_same_as_single_rank(fold, dir, "fold");

  // Bad input seen by one rank only (a bad token deep in the big file): every rank reports it.
  if (world_rank() == 0) {
    auto bad = token_corpus(20000, 50257, 50256, 300, 8);
    bad[19990] = 60000;
    write_nanogpt(dir / "bad.bin", bad);
  }
  mpi::barrier(mpi::world());
  PackOptions b = options({dir / "bad.bin"}, dir / "world/bad", 1000);
  expect_usage([&] { pack(b, mpi::world()); },
               dir / "bad.bin: ", "token 60000 at position 19990 is >= vocab_size 50257");
  mpi::barrier(mpi::world());  // rank 0 removes the directory only after everyone is done
}
