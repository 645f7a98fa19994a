// Token shards (format v1): writing, validating, path expansion, the seeded window permutation,
// and TokenDataset, which memory-maps contiguous shards and serves windows by global index.
#include "mpitrain/shards.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <new>
#include <optional>
#include <stdexcept>

#include "mpitrain/error.h"
#include "mpitrain/h5.h"

namespace mpitrain {

namespace fs = std::filesystem;

namespace {

// ---- hashing -----------------------------------------------------------------------------------

// splitmix64's finalizer: a cheap, well-mixed 64-bit bijection.
uint64_t fmix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Key of epoch `epoch`: every epoch gets an unrelated permutation.
uint64_t epoch_key(uint64_t seed, uint64_t epoch) {
  return fmix(seed ^ fmix(epoch + 0x9E3779B97F4A7C15ull));
}

// ---- opening a shard ---------------------------------------------------------------------------

// C-like name of an HDF5 type, for messages ("float", "int32", "uint8").
std::string type_name(hid_t t) {
  size_t size = H5Tget_size(t);
  switch (H5Tget_class(t)) {
    case H5T_INTEGER:
      return concat(H5Tget_sign(t) == H5T_SGN_NONE ? "uint" : "int", size * 8);
    case H5T_FLOAT:
      return size == 4 ? "float" : size == 8 ? "double" : concat("float", size * 8);
    case H5T_STRING: return "string";
    case H5T_COMPOUND: return "compound";
    case H5T_ENUM: return "enum";
    case H5T_ARRAY: return "array";
    default: return "non-numeric";
  }
}

// An open, validated shard: the file, its tokens dataset and the metadata.
struct OpenShard {
  h5::File file;
  h5::Dataset tokens;
  ShardInfo info;
  off_t file_size = 0;
};

OpenShard open_shard(const std::string& path) {
  OpenShard s;
  s.info.path = path;
  s.file = h5::open_read(path);
  hid_t f = s.file.get();
  auto bad = [&](const std::string& what) { return UsageError(path + ": " + what); };

  // Format and version first: a foreign HDF5 file is reported as such, not as a broken shard.
  auto format = h5::get_attr_string(f, "format");
  if (!format) throw bad("missing attribute 'format' (not an mpitrain token shard?)");
  if (*format != kShardFormat)
    throw bad(concat("attribute 'format' is '", *format, "', expected '", kShardFormat, "'"));
  auto version = h5::get_attr_int(f, "version");
  if (!version) throw bad("missing attribute 'version'");
  if (*version != kShardVersion)
    throw bad(concat("unsupported version ", *version, " (this build reads version ", kShardVersion,
                  ")"));
  auto vocab = h5::get_attr_int(f, "vocab_size");
  if (!vocab) throw bad("missing attribute 'vocab_size'");
  if (*vocab <= 0) throw bad(concat("attribute 'vocab_size' is ", *vocab, ", expected > 0"));
  s.info.meta.vocab_size = *vocab;
  s.info.meta.eot_token = h5::get_attr_int(f, "eot_token").value_or(-1);
  s.info.meta.tokenizer = h5::get_attr_string(f, "tokenizer").value_or(s.info.meta.tokenizer);
  s.info.meta.source = h5::get_attr_string(f, "source").value_or("");
  s.info.meta.tokenizer_file = h5::get_attr_string(f, "tokenizer_file").value_or("");
  s.info.meta.tokenizer_sha256 = h5::get_attr_string(f, "tokenizer_sha256").value_or("");
  s.info.meta.special_tokens = h5::get_attr_string(f, "tokenizer_special_tokens").value_or("");

  if (H5Lexists(f, "tokens", H5P_DEFAULT) <= 0) throw bad("missing dataset 'tokens'");
  hid_t d = H5Dopen2(f, "tokens", H5P_DEFAULT);
  if (d < 0) throw bad("'tokens' is not a dataset");
  s.tokens = h5::Dataset(d);
  h5::Datatype type(H5Dget_type(d), path + ": type of dataset 'tokens'");
  size_t size = H5Tget_size(type.get());
  if (H5Tget_class(type.get()) != H5T_INTEGER || H5Tget_sign(type.get()) != H5T_SGN_NONE ||
      (size != 2 && size != 4))
    throw bad(concat("dataset 'tokens' has type ", type_name(type.get()),
                  ", expected uint16 or uint32"));
  s.info.dtype_bytes = static_cast<int>(size);
  auto dims = h5::shape(d);
  if (dims.size() != 1)
    throw bad(concat("dataset 'tokens' has ", dims.size(), " dimensions, expected 1"));
  s.info.num_tokens = dims[0];
  if (auto n = h5::get_attr_int(f, "num_tokens"); n && static_cast<uint64_t>(*n) != dims[0])
    throw bad(concat("attribute 'num_tokens' is ", *n, " but dataset 'tokens' holds ", dims[0]));

  // HDF5 opens some truncated files happily; a contiguous dataset running past the end of the
  // file would otherwise surface as a read error (or SIGBUS through mmap) much later.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw bad("cannot stat");
  s.file_size = st.st_size;
  haddr_t offset = H5Dget_offset(d);
  const hsize_t stored = H5Dget_storage_size(d);
  if (offset != HADDR_UNDEF && offset + stored > static_cast<uint64_t>(s.file_size))
    throw bad("truncated file (dataset 'tokens' extends past the end)");
  // A dataset can declare any length without storing it (unallocated space, fill values):
  // reading it would allocate the declared size. Real token data is stored: a contiguous dataset
  // stores exactly its size, a chunked one every chunk its extent covers (found by fuzz_shard:
  // fuzz/regressions/fuzz_shard/unallocated-contiguous-tokens-oom and
  // chunked-tokens-mostly-unstored-oom).
  const auto dtype_bytes = static_cast<hsize_t>(s.info.dtype_bytes);
  if (s.info.num_tokens > UINT64_MAX / dtype_bytes)
    throw bad(concat("dataset 'tokens' declares ", s.info.num_tokens, " tokens, more than can exist"));
  const hsize_t raw = s.info.num_tokens * dtype_bytes;
  h5::PropList dcpl(H5Dget_create_plist(d), "dataset 'tokens' creation properties");
  const H5D_layout_t layout = H5Pget_layout(dcpl.get());
  if (raw > 0 && (stored == 0 || (layout == H5D_CONTIGUOUS && stored != raw)))
    throw bad(concat("dataset 'tokens' declares ", s.info.num_tokens, " tokens but stores ", stored,
                     " bytes (unallocated or corrupt)"));
  if (raw > 0 && layout == H5D_CHUNKED) {
    // Compressed chunks have no expected byte size, but their number is known. HDF5 counts the
    // chunks in its index (stored ones only), so this costs nothing for a declared-huge dataset.
    hsize_t chunk = 0;
    if (H5Pget_chunk(dcpl.get(), 1, &chunk) != 1 || chunk == 0)
      throw bad("dataset 'tokens': cannot read its chunk shape");
    const hsize_t needed = s.info.num_tokens / chunk + (s.info.num_tokens % chunk != 0 ? 1 : 0);
    hsize_t have = 0;
    h5::Dataspace space(H5Dget_space(d), path + ": dataspace of dataset 'tokens'");
    if (H5Dget_num_chunks(d, space.get(), &have) < 0)
      throw bad("dataset 'tokens': cannot count its stored chunks");
    if (have < needed)
      throw bad(concat("dataset 'tokens' declares ", s.info.num_tokens, " tokens but only ", have,
                       " chunks of ", needed, " are stored (unallocated or corrupt)"));
  }
  return s;
}

// Runs `read` (which allocates room for a whole shard's tokens): running out of memory on a shard
// is the file's problem to report, not a crash.
template <class F>
void read_or_refuse(const ShardInfo& info, F&& read) {
  try {
    read();
  } catch (const std::bad_alloc&) {
    throw UsageError(concat(info.path, ": dataset 'tokens' (", info.num_tokens,
                            " tokens) does not fit in memory"));
  } catch (const std::length_error&) {
    throw UsageError(concat(info.path, ": dataset 'tokens' (", info.num_tokens,
                            " tokens) does not fit in memory"));
  }
}

hid_t native_type(int bytes) { return bytes == 2 ? H5T_NATIVE_UINT16 : H5T_NATIVE_UINT32; }

// The reader's hot loops: `n` raw uint16/uint32 tokens (maybe unaligned: memcpy keeps mmap'd
// data well-defined and compiles to a plain load) copied as int32, returning the largest token
// (for the vocabulary check) from the same pass: a second pass over the copied row halved the
// reader's throughput. No aliasing, no bounds checks, no calls: vector loads, zero-extending
// unpacks and unsigned max (SSE2/SSE4.1 in a baseline x86-64 build). With GCC on x86-64 an AVX2
// clone is added too (picked once, at load time, on CPUs that have it): half the store
// instructions, ~1.2x faster per window (bench/RESULTS-data.md).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MPITRAIN_AVX2_CLONE __attribute__((target_clones("avx2", "default")))
#else
#define MPITRAIN_AVX2_CLONE
#endif
// One loop for both token widths; each width's entry point below is cloned for AVX2, and this
// body is inlined into every clone (so each is compiled for its own target).
template <typename Token>
__attribute__((always_inline)) inline uint32_t copy_as_int32(const unsigned char* __restrict src, int64_t n,
                                                             int32_t* __restrict dst) {
  Token hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    Token v;
    std::memcpy(&v, src + sizeof(Token) * i, sizeof(Token));
    dst[i] = static_cast<int32_t>(v);
    hi = std::max(hi, v);
  }
  return hi;
}
MPITRAIN_AVX2_CLONE
uint32_t widen_u16(const unsigned char* __restrict src, int64_t n, int32_t* __restrict dst) {
  return copy_as_int32<uint16_t>(src, n, dst);
}
MPITRAIN_AVX2_CLONE
uint32_t copy_u32(const unsigned char* __restrict src, int64_t n, int32_t* __restrict dst) {
  return copy_as_int32<uint32_t>(src, n, dst);
}

// `n` raw tokens of `dtype_bytes` each to int32 (uint32: the same bits); returns the largest.
inline uint32_t copy_tokens(const unsigned char* src, int dtype_bytes, int64_t n, int32_t* dst) {
  return dtype_bytes == 2 ? widen_u16(src, n, dst) : copy_u32(src, n, dst);
}

}  // namespace

// ---- writing -----------------------------------------------------------------------------------

void write_shard(const std::string& path, const std::vector<uint32_t>& tokens,
                 const std::vector<uint64_t>& doc_offsets, const ShardMeta& meta) {
  if (meta.vocab_size <= 0 || meta.vocab_size > (int64_t{1} << 32))
    throw UsageError(concat(path, ": vocab_size ", meta.vocab_size, " out of range [1, 2^32]"));
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] >= static_cast<uint64_t>(meta.vocab_size))
      throw UsageError(concat(path, ": token ", tokens[i], " at position ", i,
                           " is >= vocab_size ", meta.vocab_size));
  for (size_t i = 0; i < doc_offsets.size(); ++i)
    if (doc_offsets[i] >= tokens.size())
      throw UsageError(concat(path, ": doc_offsets[", i, "] = ", doc_offsets[i],
                           " is past the end (", tokens.size(), " tokens)"));

  const std::string tmp = path + ".tmp";
  try {
    h5::File f;
    try {
      f = h5::create(tmp);
    } catch (const UsageError&) {  // name the shard the caller asked for, not our temporary
      throw UsageError(path + ": cannot create (directory missing or not writable?)");
    }
    hid_t root = f.get();
    std::vector<hsize_t> dims{tokens.size()};
    static const uint32_t empty = 0;  // HDF5 rejects a null buffer even for zero elements
    if (meta.vocab_size <= 65536) {
      std::vector<uint16_t> narrow(tokens.begin(), tokens.end());
      h5::write(root, "tokens", H5T_NATIVE_UINT16, dims,
                narrow.empty() ? static_cast<const void*>(&empty) : narrow.data());
    } else {
      h5::write(root, "tokens", H5T_NATIVE_UINT32, dims,
                tokens.empty() ? &empty : tokens.data());
    }
    if (!doc_offsets.empty())
      h5::write(root, "doc_offsets", H5T_NATIVE_UINT64, {doc_offsets.size()}, doc_offsets.data());
    h5::set_attr(root, "format", std::string(kShardFormat));
    h5::set_attr(root, "version", kShardVersion);
    h5::set_attr(root, "vocab_size", meta.vocab_size);
    h5::set_attr(root, "eot_token", meta.eot_token);
    h5::set_attr(root, "tokenizer", meta.tokenizer);
    h5::set_attr(root, "num_tokens", static_cast<int64_t>(tokens.size()));
    h5::set_attr(root, "source", meta.source);
    if (!meta.tokenizer_file.empty()) h5::set_attr(root, "tokenizer_file", meta.tokenizer_file);
    if (!meta.tokenizer_sha256.empty()) h5::set_attr(root, "tokenizer_sha256", meta.tokenizer_sha256);
    if (!meta.special_tokens.empty()) h5::set_attr(root, "tokenizer_special_tokens", meta.special_tokens);
    if (H5Fflush(root, H5F_SCOPE_GLOBAL) < 0) throw Error(tmp + ": cannot flush (disk full?)");
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw UsageError(concat(path, ": cannot rename ", tmp, " into place: ", std::strerror(errno)));
  }
}

// ---- reading metadata and tokens ---------------------------------------------------------------

ShardInfo read_shard_info(const std::string& path) { return open_shard(path).info; }

std::vector<uint32_t> read_shard_tokens(const std::string& path) {
  OpenShard s = open_shard(path);
  std::vector<uint32_t> out;
  read_or_refuse(s.info, [&] {
    out.resize(s.info.num_tokens);
    if (!out.empty()) h5::read(s.tokens.get(), H5T_NATIVE_UINT32, out.data());
  });
  return out;
}

// ---- path expansion ----------------------------------------------------------------------------

std::vector<std::string> expand_shard_paths(const std::vector<std::string>& patterns,
                                            const std::string& key) {
  std::vector<std::string> out;
  for (const std::string& pattern : patterns) {
    size_t before = out.size();
    std::error_code ec;
    if (fs::is_directory(pattern, ec)) {
      for (const auto& e : fs::directory_iterator(pattern, ec))
        if (e.path().extension() == ".h5" && e.is_regular_file(ec)) out.push_back(e.path());
    } else if (fs::is_regular_file(pattern, ec)) {
      out.push_back(pattern);
    } else {
      glob_t g{};
      if (::glob(pattern.c_str(), GLOB_TILDE, nullptr, &g) == 0)
        for (size_t i = 0; i < g.gl_pathc; ++i)
          if (fs::is_regular_file(g.gl_pathv[i], ec)) out.emplace_back(g.gl_pathv[i]);
      globfree(&g);
    }
    if (out.size() == before) throw UsageError(concat(key, ": no shard matches '", pattern, "'"));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// ---- Permutation -------------------------------------------------------------------------------

Permutation::Permutation(uint64_t n, uint64_t seed) : n_(n) {
  // Smallest even bit count (>= 2) whose range covers n: the Feistel domain is under 4n, so
  // cycle-walking takes fewer than 4 rounds of the network on average.
  int bits = 2;
  while (bits < 64 && (uint64_t{1} << bits) < n) bits += 2;
  half_bits_ = bits / 2;
  uint64_t state = seed;
  for (uint64_t& k : keys_) k = fmix(state += 0x9E3779B97F4A7C15ull);
}

uint64_t Permutation::operator()(uint64_t i) const {
  if (i >= n_) throw Error(concat("Permutation: index ", i, " out of range [0, ", n_, ")"));
  const uint64_t mask = (uint64_t{1} << half_bits_) - 1;
  uint64_t x = i;
  // Cycle-walking: the network permutes [0, 2^bits); iterating it from a value < n must come back
  // below n (at worst to i itself), which makes the restriction a bijection on [0, n).
  do {
    uint64_t left = x >> half_bits_, right = x & mask;
    for (uint64_t key : keys_) {
      uint64_t next = left ^ (fmix(right ^ key) & mask);
      left = right;
      right = next;
    }
    x = (left << half_bits_) | right;
  } while (x >= n_);
  return x;
}

// ---- TokenDataset ------------------------------------------------------------------------------

struct TokenDataset::Shard {
  ShardInfo info;
  uint64_t windows = 0;
  const unsigned char* data = nullptr;  // num_tokens native uint16/uint32, maybe unaligned
  void* map = nullptr;                  // the mmap'd range, when mapped
  size_t map_len = 0;
  std::vector<unsigned char> owned;     // the tokens, when not mapped

  ~Shard() {
    if (map) ::munmap(map, map_len);
  }
};

namespace {

// Maps the contiguous tokens dataset of `s` read-only; false if it cannot be mapped (chunked,
// compressed, external, foreign byte order...) and must be read instead.
bool map_tokens(const OpenShard& s, bool random_access, void** map, size_t* map_len,
                const unsigned char** data) {
  hid_t d = s.tokens.get();
  const uint64_t bytes = s.info.num_tokens * static_cast<uint64_t>(s.info.dtype_bytes);
  h5::PropList dcpl(H5Dget_create_plist(d));
  if (H5Pget_layout(dcpl.get()) != H5D_CONTIGUOUS) return false;
  haddr_t offset = H5Dget_offset(d);
  if (offset == HADDR_UNDEF || H5Dget_storage_size(d) != bytes) return false;
  if (offset + bytes > static_cast<uint64_t>(s.file_size)) return false;
  h5::Datatype type(H5Dget_type(d));
  if (H5Tequal(type.get(), native_type(s.info.dtype_bytes)) <= 0) return false;

  int fd = ::open(s.info.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t base = offset / page * page;
  const size_t len = static_cast<size_t>(offset - base + bytes);
  void* p = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(base));
  ::close(fd);  // the mapping keeps the file alive
  if (p == MAP_FAILED) return false;
  // Shuffled windows jump around the file: kernel read-ahead would mostly fetch unused pages.
  if (random_access) ::madvise(p, len, MADV_RANDOM);
  const auto* start = static_cast<const unsigned char*>(p) + (offset - base);

  // Cheap guard against misreading the offset: the head of the mapping must equal what HDF5
  // itself reads.
  hsize_t head = std::min<hsize_t>(s.info.num_tokens, 64), zero = 0;
  std::vector<unsigned char> expect(head * static_cast<hsize_t>(s.info.dtype_bytes));
  h5::Dataspace file_space(H5Dget_space(d));
  h5::Dataspace mem_space(H5Screate_simple(1, &head, nullptr));
  bool ok = H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, &zero, nullptr, &head,
                                nullptr) >= 0 &&
            H5Dread(d, native_type(s.info.dtype_bytes), mem_space.get(), file_space.get(),
                    H5P_DEFAULT, expect.data()) >= 0 &&
            std::memcmp(expect.data(), start, expect.size()) == 0;
  if (!ok) {
    ::munmap(p, len);
    return false;
  }
  *map = p;
  *map_len = len;
  *data = start;
  return true;
}

}  // namespace

TokenDataset::TokenDataset(const std::vector<std::string>& paths, int64_t seq_len, uint64_t seed,
                           bool shuffle)
    : paths_(paths), seq_len_(seq_len), seed_(seed), shuffle_(shuffle) {
  if (seq_len <= 0) throw UsageError(concat("seq_len must be > 0, got ", seq_len));
  if (paths.empty()) throw UsageError("no token shards given");
  for (const std::string& path : paths) {
    OpenShard s = open_shard(path);
    if (shards_.empty()) {
      vocab_size_ = s.info.meta.vocab_size;
      eot_token_ = s.info.meta.eot_token;
      tokenizer_ = s.info.meta.tokenizer;
      tokenizer_file_ = s.info.meta.tokenizer_file;
      tokenizer_sha256_ = s.info.meta.tokenizer_sha256;
      special_tokens_ = s.info.meta.special_tokens;
    } else if (s.info.meta.vocab_size != vocab_size_) {
      throw UsageError(concat(path, ": vocab_size ", s.info.meta.vocab_size, " differs from ",
                           vocab_size_, " in ", paths.front()));
    } else if (s.info.meta.tokenizer_sha256 != tokenizer_sha256_) {
      throw UsageError(concat(path, ": packed with another tokenizer.json (SHA-256 ",
                              s.info.meta.tokenizer_sha256.empty() ? "none" : s.info.meta.tokenizer_sha256.substr(0, 12),
                              ") than ", paths.front(), " (",
                              tokenizer_sha256_.empty() ? "none" : tokenizer_sha256_.substr(0, 12), ")"));
    } else if (s.info.meta.special_tokens != special_tokens_) {
      auto mode = [](const std::string& m) { return m.empty() ? std::string("text") : m; };
      throw UsageError(concat(path, ": packed with --special-tokens ", mode(s.info.meta.special_tokens), ", ",
                              paths.front(), " with --special-tokens ", mode(special_tokens_),
                              " (the same text has other ids)"));
    }
    if (s.info.meta.vocab_size > (int64_t{1} << 31))
      throw UsageError(concat(path, ": vocab_size ", s.info.meta.vocab_size,
                              " exceeds 2^31 (training reads tokens as int32)"));
    const uint64_t window_tokens = static_cast<uint64_t>(seq_len) + 1;
    if (s.info.num_tokens < window_tokens)
      throw UsageError(concat(path, ": ", s.info.num_tokens,
                           " tokens, shorter than one window of seq_len+1 = ", window_tokens));

    auto shard = std::make_unique<Shard>();
    shard->info = s.info;
    shard->windows = (s.info.num_tokens - 1) / static_cast<uint64_t>(seq_len);
    if (!map_tokens(s, shuffle, &shard->map, &shard->map_len, &shard->data)) {
      read_or_refuse(s.info, [&] {
        shard->owned.resize(s.info.num_tokens * static_cast<uint64_t>(s.info.dtype_bytes));
        h5::read(s.tokens.get(), native_type(s.info.dtype_bytes), shard->owned.data());
      });
      shard->data = shard->owned.data();
    }
    first_window_.push_back(total_windows_);
    total_windows_ += shard->windows;
    total_tokens_ += s.info.num_tokens;
    shards_.push_back(std::move(shard));
  }
}

TokenDataset::TokenDataset(const std::vector<std::vector<std::string>>& sources, const std::vector<double>& weights,
                           const std::vector<std::string>& names, int64_t seq_len, uint64_t seed, bool shuffle,
                           const std::vector<std::pair<uint64_t, std::vector<double>>>& later)
    : seq_len_(seq_len), seed_(seed), shuffle_(shuffle) {
  MPITRAIN_CHECK(!sources.empty() && sources.size() == weights.size() && names.size() == sources.size(),
                 "TokenDataset: a weight and a name per source");
  for (size_t i = 0; i < sources.size(); ++i) {
    // Each source its own order: the run's seed mixed with the source's place.
    auto d = std::make_unique<TokenDataset>(sources[i], seq_len, seed + 0x9E3779B97F4A7C15ull * (i + 1), shuffle);
    if (i > 0) {
      const TokenDataset& first = *sources_.front();
      if (d->vocab_size() != first.vocab_size())
        throw UsageError(concat(names[i], ": vocab_size ", d->vocab_size(), " differs from ", names[0], "'s ",
                                first.vocab_size(), " (a mixture's sources share one vocabulary)"));
      if (d->tokenizer() != first.tokenizer() || d->tokenizer_sha256() != first.tokenizer_sha256() ||
          d->special_tokens_ != first.special_tokens_)
        throw UsageError(concat(names[i], ": packed with another tokenizer (", d->tokenizer(),
                                d->tokenizer_sha256().empty() ? std::string() : " " + d->tokenizer_sha256().substr(0, 12),
                                ") than ", names[0], " (", first.tokenizer(),
                                first.tokenizer_sha256().empty() ? std::string() : " " + first.tokenizer_sha256().substr(0, 12),
                                "): the same ids would mean other text"));
    }
    paths_.insert(paths_.end(), d->paths().begin(), d->paths().end());
    total_windows_ += d->num_windows();
    total_tokens_ += d->num_tokens();
    sources_.push_back(std::move(d));
  }
  const TokenDataset& first = *sources_.front();
  vocab_size_ = first.vocab_size_, eot_token_ = first.eot_token_, tokenizer_ = first.tokenizer_;
  tokenizer_file_ = first.tokenizer_file_, tokenizer_sha256_ = first.tokenizer_sha256_, special_tokens_ = first.special_tokens_;
  stages_.push_back(make_stage(weights, 0, std::vector<uint64_t>(sources.size(), 0)));
  for (const auto& [first, w] : later) {
    MPITRAIN_CHECK(w.size() == sources.size() && first > stages_.back().from, "TokenDataset: a later stage's weights, later");
    stages_.push_back(make_stage(w, first, source_windows(first)));
  }
}

// Each source's slots: its share of the period (largest remainders; one at least for a weight
// > 0), then the schedule: each slot to the source
// furthest behind its share (k + 1) slots / period (the first of equals), so that after any k slots
// each source holds its share within one window.
TokenDataset::MixStage TokenDataset::make_stage(const std::vector<double>& weights, uint64_t from, std::vector<uint64_t> base) {
  const size_t S = weights.size();
  MixStage st;
  st.from = from;
  st.base = std::move(base);
  double total = 0;
  for (double w : weights) total += w;
  MPITRAIN_CHECK(total > 0, "TokenDataset: a mixture's weights (one > 0)");
  // The period's slots by largest remainders of the exact quotas; then a weight > 0 left without
  // a slot takes one from the source with the most.
  st.slots.assign(S, 0);
  uint64_t given = 0;
  std::vector<std::pair<double, size_t>> remainders;
  for (size_t i = 0; i < S; ++i) {
    const double quota = weights[i] / total * static_cast<double>(kMixturePeriod);
    const auto whole = static_cast<uint64_t>(std::floor(quota));
    st.slots[i] = whole, given += whole;
    remainders.emplace_back(quota - static_cast<double>(whole), i);
  }
  std::stable_sort(remainders.begin(), remainders.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t r = 0; given < kMixturePeriod; ++r, ++given) ++st.slots[remainders[r % S].second];
  for (size_t i = 0; i < S; ++i)
    if (weights[i] > 0 && st.slots[i] == 0) {
      --*std::max_element(st.slots.begin(), st.slots.end());
      st.slots[i] = 1;
    }
  std::vector<uint64_t> taken(S, 0);
  st.before.assign(S, std::vector<uint32_t>(kMixturePeriod + 1, 0));
  for (uint64_t k = 0; k < kMixturePeriod; ++k) {
    size_t pick = 0;
    double most = -1e300;
    for (size_t i = 0; i < S; ++i) {
      const double behind = static_cast<double>(st.slots[i] * (k + 1)) / static_cast<double>(kMixturePeriod) -
                            static_cast<double>(taken[i]);
      if (taken[i] < st.slots[i] && behind > most) most = behind, pick = i;
    }
    st.schedule.push_back(static_cast<uint32_t>(pick));
    ++taken[pick];
    for (size_t i = 0; i < S; ++i) st.before[i][k + 1] = static_cast<uint32_t>(taken[i]);
  }
  return st;
}

const TokenDataset::MixStage& TokenDataset::stage_at(uint64_t window) const {
  size_t i = 0;
  while (i + 1 < stages_.size() && stages_[i + 1].from <= window) ++i;
  return stages_[i];
}

std::vector<uint64_t> TokenDataset::source_windows(uint64_t windows) const {
  std::vector<uint64_t> out;
  const MixStage& st = stage_at(windows);
  const uint64_t local = windows - st.from;
  for (size_t i = 0; i < sources_.size(); ++i)
    out.push_back(st.base[i] + local / kMixturePeriod * st.slots[i] + st.before[i][local % kMixturePeriod]);
  return out;
}

TokenDataset::~TokenDataset() = default;

const unsigned char* TokenDataset::locate(uint64_t k, int* dtype_bytes) const {
  size_t i = 0;
  if (shards_.size() > 1)
    i = static_cast<size_t>(std::upper_bound(first_window_.begin(), first_window_.end(), k) -
                            first_window_.begin() - 1);
  const Shard& s = *shards_[i];
  *dtype_bytes = s.info.dtype_bytes;
  const uint64_t start = (k - first_window_[i]) * static_cast<uint64_t>(seq_len_);
  return s.data + start * static_cast<uint64_t>(s.info.dtype_bytes);
}

void TokenDataset::window(uint64_t index, int32_t* dst) const { batch(index, 0, 1, dst); }

void TokenDataset::batch(uint64_t start, int rank, int64_t rows, int32_t* dst) const {
  if (rank < 0 || rows < 0)
    throw Error(concat("TokenDataset::batch: bad rank ", rank, " or rows ", rows));
  const uint64_t first = start + static_cast<uint64_t>(rank) * static_cast<uint64_t>(rows);
  const int64_t width = seq_len_ + 1;
  if (!sources_.empty()) {  // a mixture: global window g is its slot's source's next window
    for (int64_t r = 0; r < rows; ++r) {
      const uint64_t g = first + static_cast<uint64_t>(r);
      const MixStage& st = stage_at(g);
      const uint64_t local = g - st.from, slot = local % kMixturePeriod;
      const uint32_t s = st.schedule[slot];
      sources_[s]->batch(st.base[s] + local / kMixturePeriod * st.slots[s] + st.before[s][slot], 0, 1, dst + r * width);
    }
    return;
  }
  // A batch's windows almost always share one epoch: build its permutation once.
  std::optional<Permutation> perm;
  uint64_t perm_epoch = 0;
  auto source = [&](int64_t r, int* dtype_bytes) {
    const uint64_t index = first + static_cast<uint64_t>(r);
    const uint64_t epoch = index / total_windows_;
    uint64_t k = index % total_windows_;
    if (shuffle_) {
      if (!perm || perm_epoch != epoch) {
        perm.emplace(total_windows_, epoch_key(seed_, epoch));
        perm_epoch = epoch;
      }
      k = (*perm)(k);
    }
    return locate(k, dtype_bytes);
  };
  // Shuffled windows are scattered over the shards: the copy is bound by its loads' misses unless
  // the windows' cache lines are requested ahead. Two windows ahead keeps enough of them in flight.
  constexpr int64_t kAhead = 2;
  struct Src {
    const unsigned char* p = nullptr;
    int bytes = 2;
  } ring[kAhead + 1];
  auto request = [&](int64_t r) {
    Src& s = ring[r % (kAhead + 1)];
    s.p = source(r, &s.bytes);
    const int64_t len = width * s.bytes;
    for (int64_t off = 0; off < len; off += 64) __builtin_prefetch(s.p + off);
    __builtin_prefetch(s.p + len - 1);
  };
  for (int64_t r = 0; r < std::min(rows, kAhead); ++r) request(r);
  for (int64_t r = 0; r < rows; ++r) {
    if (r + kAhead < rows) request(r + kAhead);
    const Src& s = ring[r % (kAhead + 1)];
    int32_t* row = dst + r * width;
    // Every token must be in the declared vocabulary: a token past it would index past the
    // embedding (a libtorch exception, or silently wrong training). The copy returns the row's
    // largest token, unsigned, so that uint32 tokens >= 2^31 count too.
    const uint32_t hi = copy_tokens(s.p, s.bytes, width, row);
    if (hi >= static_cast<uint64_t>(vocab_size_)) report_out_of_vocabulary(s.p, row, width);
  }
}

void TokenDataset::report_out_of_vocabulary(const unsigned char* window, const int32_t* row, int64_t width) const {
  for (size_t i = 0; i < shards_.size(); ++i) {
    const Shard& s = *shards_[i];
    const uint64_t bytes = s.info.num_tokens * static_cast<uint64_t>(s.info.dtype_bytes);
    if (window < s.data || window >= s.data + bytes) continue;
    const uint64_t first = static_cast<uint64_t>(window - s.data) / static_cast<uint64_t>(s.info.dtype_bytes);
    for (int64_t j = 0; j < width; ++j)
      if (static_cast<uint32_t>(row[j]) >= static_cast<uint64_t>(vocab_size_))
        throw UsageError(concat(s.info.path, ": token ", static_cast<uint32_t>(row[j]), " at position ",
                                first + static_cast<uint64_t>(j), " of dataset 'tokens' is outside the vocabulary ",
                                "(vocab_size ", vocab_size_, ")"));
  }
  throw Error("TokenDataset: a token outside the vocabulary in a window of no shard");
}

// ---- BatchPrefetcher ---------------------------------------------------------------------------

BatchPrefetcher::BatchPrefetcher(const TokenDataset& data, int rank, int64_t rows)
    : data_(data), rank_(rank), rows_(rows) {}

BatchPrefetcher::~BatchPrefetcher() {
  if (pending_.valid()) pending_.wait();
}

std::vector<int32_t> BatchPrefetcher::read(uint64_t start) const {
  std::vector<int32_t> out(static_cast<size_t>(rows_ * (data_.seq_len() + 1)));
  data_.batch(start, rank_, rows_, out.data());
  return out;
}

const std::vector<int32_t>& BatchPrefetcher::take(uint64_t start, uint64_t next_start) {
  if (pending_.valid() && pending_start_ == start) {
    current_ = pending_.get();
  } else {
    if (pending_.valid()) pending_.wait();  // a stale prefetch: drop it
    pending_ = {};
    current_ = read(start);
  }
  pending_start_ = next_start;
  pending_ = std::async(std::launch::async, [this, next_start] { return read(next_start); });
  return current_;
}

}  // namespace mpitrain
