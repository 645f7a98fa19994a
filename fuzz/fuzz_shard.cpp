// libFuzzer target: HDF5 token shards (read_shard_info, read_shard_tokens, TokenDataset).
//
// Structure-aware: the input bytes are decoded (FuzzedDataProvider) into a DESCRIPTION of one or
// two shards -- root attributes (each absent, or an int64 / double / string / uint8-array
// attribute, with interesting or lying values), the /tokens object (dataset of uint16, uint32,
// their big-endian forms, int16, int32, uint8, uint64 or float32; scalar, 1-D or 2-D; contiguous,
// chunked, chunked+deflate or compact; fully, partly or never written; maybe a fill value; or a
// group or a dangling link instead), /doc_offsets, the order of writing, and an optional
// truncation length. The harness writes that with the HDF5 C API into a per-process temp dir and
// runs our readers on it, so the fuzzer explores OUR validation rather than HDF5's parser on
// random bytes (HDF5 1.10 has known crashes on malformed files that are not ours to fix).
//
// Oracle (docs in shards.h / src/data/shards.cpp):
//   - the only acceptable exception is mpitrain::UsageError;
//   - for an untruncated file the harness knows whether the shard is valid (format, version,
//     vocab_size > 0, /tokens an unsigned 16/32-bit 1-D dataset, num_tokens attribute absent or
//     equal to its length, its data stored: not left unallocated, and for a chunked dataset every
//     chunk written): valid shards must open, invalid ones must be refused; TokenDataset also
//     refuses vocab_size > 2^31 (it serves int32 tokens);
//   - a file cut inside the contiguous storage of /tokens must be refused (the superblock's
//     end-of-file address is sometimes patched to match, so that HDF5 opens the cut file and our
//     own check is what decides);
//   - on success, the metadata, the tokens (read_shard_tokens) and every window()/batch() row
//     equal what was written at the right offsets (shuffled epochs are a permutation of the
//     windows), except that a window holding a token >= vocab_size (or >= 2^31) is refused with a
//     UsageError naming the shard, and exactly those windows are;
//   - no HDF5 identifier (file, dataset, attribute, ...) is left open after an input.
#include <fuzzer/FuzzedDataProvider.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "mpitrain/error.h"
#include "mpitrain/h5.h"
#include "mpitrain/shards.h"
#include "harness.h"
#include "hdf5_ids.h"

using namespace mpitrain;

const char* const kFuzzTarget = "fuzz_shard";

namespace {

// ---- the per-process scratch directory -------------------------------------------------------

std::string g_dir;

void remove_scratch() {
  for (const char* name : {"a.h5", "b.h5"}) std::remove((g_dir + "/" + name).c_str());
  ::rmdir(g_dir.c_str());
}

const std::string& scratch_dir() {
  if (g_dir.empty()) {
    g_dir = make_scratch_dir();
    std::atexit(remove_scratch);
  }
  return g_dir;
}

// ---- the description of a shard --------------------------------------------------------------

struct Attr {
  enum Kind { absent, integer, number, string, bytes } kind = absent;
  int64_t i = 0;
  double d = 0;
  std::string s;
  std::vector<uint8_t> b;

  // What h5::get_attr_int / get_attr_string will see.
  std::optional<int64_t> as_int() const {
    if (kind == integer) return i;
    if (kind == bytes && b.size() == 1) return b[0];  // a 1-element uint8 array is an integer
    return std::nullopt;
  }
  std::optional<std::string> as_string() const {
    if (kind != string) return std::nullopt;
    return s.substr(0, s.find('\0'));  // fixed-length, NUL-padded: reads up to the first NUL
  }
};

struct FileType {
  const char* name;
  hid_t (*type)();
  uint64_t mask;  // values are masked so that the conversion from uint32 is exact
  bool accepted;  // the reader takes it as token ids
};

// hid_t constants are macros that call H5open(); wrap them in functions.
const FileType kTypes[] = {
    {"uint16", [] { return H5T_NATIVE_UINT16; }, 0xFFFF, true},
    {"uint32", [] { return H5T_NATIVE_UINT32; }, 0xFFFFFFFF, true},
    {"uint16be", [] { return H5T_STD_U16BE; }, 0xFFFF, true},
    {"uint32be", [] { return H5T_STD_U32BE; }, 0xFFFFFFFF, true},
    {"int32", [] { return H5T_NATIVE_INT32; }, 0x7FFFFFFF, false},
    {"int16", [] { return H5T_NATIVE_INT16; }, 0x7FFF, false},
    {"uint8", [] { return H5T_NATIVE_UINT8; }, 0xFF, false},
    {"uint64", [] { return H5T_NATIVE_UINT64; }, 0xFFFFFFFF, false},
    {"float32", [] { return H5T_NATIVE_FLOAT; }, 0xFFFFFF, false},
};

struct ShardSpec {
  Attr format, version, vocab, eot, tokenizer, num_tokens, source;
  enum Obj { dataset, none, group, dangling_link } tokens_obj = dataset;
  size_t type = 0;               // index into kTypes
  std::vector<hsize_t> dims;     // rank 0 (scalar), 1 or 2
  enum Layout { contiguous, chunked, deflate, compact } layout = contiguous;
  hsize_t chunk = 1;             // per dimension
  bool unlimited = false;        // chunked: maxdims unlimited
  enum Write { full, partial, never } write = full;
  uint64_t written = 0;          // elements written (a prefix, 1-D), == count for full
  std::vector<uint32_t> values;  // the written prefix, masked
  std::optional<uint32_t> fill;  // user fill value (masked)
  bool doc_offsets = false;
  std::vector<uint64_t> offsets;
  std::optional<uint64_t> truncate_at;  // fraction of the file size, in 1/65536ths
  bool patch_eof = false;    // after truncating, make the superblock agree with the new size
  bool attrs_first = false;  // write the attributes before the datasets (raw data then ends the file)

  uint64_t count() const {
    uint64_t n = 1;
    for (hsize_t d : dims) n *= d;
    return n;
  }
  // Token i as the reader must return it (1-D).
  uint32_t expected(uint64_t i) const { return i < written ? values[i] : fill.value_or(0); }

  // Chunked layouts (1-D): chunks the extent covers, and chunks the written prefix allocated
  // (HDF5's default for chunked datasets allocates a chunk when it is first written).
  bool is_chunked() const { return layout == chunked || layout == deflate; }
  hsize_t chunk_len() const {
    return unlimited ? chunk : std::max<hsize_t>(1, std::min(chunk, dims.empty() ? 1 : dims[0]));
  }
  bool all_chunks_stored() const {
    if (!is_chunked() || dims.size() != 1) return true;
    const hsize_t c = chunk_len();
    return (dims[0] + c - 1) / c == (written + c - 1) / c;
  }

  // Whether a correct reader must accept it (before truncation).
  bool valid() const {
    auto f = format.as_string();
    auto v = version.as_int();
    auto vs = vocab.as_int();
    auto n = num_tokens.as_int();
    return f && *f == kShardFormat && v && *v == kShardVersion && vs && *vs > 0 &&
           tokens_obj == dataset && kTypes[type].accepted && dims.size() == 1 &&
           (!n || static_cast<uint64_t>(*n) == dims[0]) &&
           // Tokens declared but never stored (late allocation: nothing written) are refused:
           // reading them would allocate the declared size (regressions/unallocated-*); so are
           // chunked tokens with chunks never written (regressions/chunked-tokens-mostly-unstored-oom).
           !(written == 0 && layout != compact && count() > 0) && all_chunks_stored();
  }
};

const int64_t kInterestingInts[] = {0,          1,          -1,         2,
                                    255,        256,        257,        65535,
                                    65536,      65537,      1LL << 31,  (1LL << 32) - 1,
                                    1LL << 32,  (1LL << 32) + 1, INT64_MAX, INT64_MIN};

const std::string kOtherFormats[] = {"mpitrain-checkpoint", "", std::string("mpitrain-tokens\0x", 17),
                                     "mpitrain-token", "MPITRAIN-TOKENS", "mpitrain-tokens "};

Attr decode_attr(FuzzedDataProvider& in, const char* usual_string, int64_t usual_int,
                 bool usual_is_string) {
  Attr a;
  // 0 (what an exhausted input decodes to) and most other values: what a good writer writes.
  switch (in.ConsumeIntegralInRange<int>(0, 15)) {
    case 8: a.kind = Attr::absent; break;
    case 9: a.kind = Attr::integer; a.i = in.PickValueInArray(kInterestingInts); break;
    case 10: a.kind = Attr::integer; a.i = in.ConsumeIntegral<int64_t>(); break;
    case 11: a.kind = Attr::number; a.d = static_cast<double>(usual_int) + in.ConsumeIntegralInRange<int>(-1, 1) * 0.5; break;
    case 12: a.kind = Attr::string; a.s = in.ConsumeRandomLengthString(64); break;
    case 13: a.kind = Attr::bytes; a.b = in.ConsumeBytes<uint8_t>(in.ConsumeIntegralInRange<size_t>(1, 3)); break;
    case 14: a.kind = Attr::string; a.s = std::to_string(usual_int); break;
    case 15: a.kind = Attr::integer; a.i = usual_int + in.ConsumeIntegralInRange<int>(-2, 2); break;
    default:
      if (usual_is_string) {
        a.kind = Attr::string;
        a.s = usual_string;
      } else {
        a.kind = Attr::integer;
        a.i = usual_int;
      }
  }
  return a;
}

ShardSpec decode_shard(FuzzedDataProvider& in, const ShardSpec* first) {
  ShardSpec s;
  s.format = decode_attr(in, kShardFormat, 0, true);
  if (s.format.kind == Attr::string && s.format.s != kShardFormat && in.ConsumeBool())
    s.format.s = kOtherFormats[in.ConsumeIntegralInRange<size_t>(0, std::size(kOtherFormats) - 1)];
  s.version = decode_attr(in, "", kShardVersion, false);
  // A second shard usually shares the first one's vocabulary; sometimes not.
  const int64_t usual_vocab =
      first && first->vocab.as_int() && in.ConsumeProbability<float>() < 0.7f
          ? *first->vocab.as_int()
          : in.PickValueInArray<int64_t>({257, 256, 50257, 8, 1, 65536, 65537, 100000});
  s.vocab = decode_attr(in, "", usual_vocab, false);
  s.eot = decode_attr(in, "", usual_vocab - 1, false);
  s.tokenizer = decode_attr(in, "byte", 0, true);
  s.source = decode_attr(in, "fuzz", 0, true);

  s.tokens_obj = in.ConsumeProbability<float>() <= 0.9f
                     ? ShardSpec::dataset
                     : in.PickValueInArray({ShardSpec::none, ShardSpec::group,
                                            ShardSpec::dangling_link});
  s.type = in.ConsumeProbability<float>() <= 0.75f
               ? in.ConsumeIntegralInRange<size_t>(0, 3)
               : in.ConsumeIntegralInRange<size_t>(0, std::size(kTypes) - 1);
  const float shape = in.ConsumeProbability<float>();
  const int rank = shape < 0.85f ? 1 : shape < 0.93f ? 2 : 0;
  s.layout = static_cast<ShardSpec::Layout>(in.ConsumeIntegralInRange<int>(0, 3));
  s.write = static_cast<ShardSpec::Write>(
      in.ConsumeProbability<float>() <= 0.8f ? 0 : in.ConsumeIntegralInRange<int>(1, 2));
  for (int r = 0; r < rank; ++r) {
    // Offset so that an exhausted input (0) still gives a usable length.
    hsize_t d = (in.ConsumeIntegralInRange<hsize_t>(0, r == 0 ? 600 : 4) + (r == 0 ? 40 : 2)) %
                (r == 0 ? 601 : 5);
    // A declared extent far beyond anything written, where that costs no space in the file:
    // nothing written at all, or (chunked) only the first chunks.
    const bool chunked = s.layout == ShardSpec::chunked || s.layout == ShardSpec::deflate;
    if (r == 0 && rank == 1 && s.write != ShardSpec::full &&
        (s.write == ShardSpec::never || chunked) && in.ConsumeProbability<float>() > 0.9f)
      d = s.layout == ShardSpec::contiguous || chunked
              ? in.PickValueInArray<hsize_t>({1u << 20, 1ull << 31, 1ull << 40})
              : hsize_t{1} << 20;
    s.dims.push_back(d);
  }
  s.chunk = in.ConsumeIntegralInRange<hsize_t>(1, 700);
  s.unlimited = in.ConsumeBool();
  if (rank == 0 && s.layout != ShardSpec::compact) s.layout = ShardSpec::contiguous;

  const uint64_t n = s.count();
  if (s.write == ShardSpec::partial && rank != 1) s.write = ShardSpec::full;
  s.written = s.write == ShardSpec::full      ? n
              : s.write == ShardSpec::partial ? in.ConsumeIntegralInRange<uint64_t>(0, std::min<uint64_t>(n, 600))
                                              : 0;
  const uint64_t mask = kTypes[s.type].mask;
  const int value_mode = in.ConsumeIntegralInRange<int>(0, 2);
  s.values.resize(s.written);
  for (uint64_t i = 0; i < s.written; ++i) {
    uint32_t v = value_mode == 0   ? in.ConsumeIntegral<uint32_t>()
                 : value_mode == 1 ? static_cast<uint32_t>(i * 7 + 3)
                                   : in.ConsumeIntegral<uint8_t>();
    s.values[i] = static_cast<uint32_t>(v & mask);
  }
  if (in.ConsumeProbability<float>() > 0.9f)
    s.fill = static_cast<uint32_t>(in.ConsumeIntegral<uint32_t>() & mask);

  s.num_tokens = decode_attr(in, "", rank >= 1 ? static_cast<int64_t>(s.dims[0]) : 1, false);
  s.doc_offsets = in.ConsumeBool();
  if (s.doc_offsets) {
    size_t k = in.ConsumeIntegralInRange<size_t>(1, 8);
    for (size_t i = 0; i < k; ++i) s.offsets.push_back(in.ConsumeIntegral<uint64_t>() % (n + 2));
  }
  if (in.ConsumeProbability<float>() > 0.92f) s.truncate_at = in.ConsumeIntegral<uint16_t>();
  s.attrs_first = in.ConsumeBool();
  s.patch_eof = s.truncate_at && in.ConsumeBool();
  return s;
}

// ---- writing it --------------------------------------------------------------------------------

void write_attr(hid_t obj, const char* name, const Attr& a) {
  switch (a.kind) {
    case Attr::absent: break;
    case Attr::integer: h5::set_attr(obj, name, a.i); break;
    case Attr::number: h5::set_attr(obj, name, a.d); break;
    case Attr::string: h5::set_attr(obj, name, a.s); break;
    case Attr::bytes: h5::set_attr(obj, name, a.b); break;
  }
}

// False when HDF5 refuses to build what the description asks for (e.g. a compact dataset over
// 64 KiB): such inputs are simply skipped.
bool write_tokens(hid_t f, const ShardSpec& s) {
  switch (s.tokens_obj) {
    case ShardSpec::none: return true;
    case ShardSpec::group: return H5Gclose(H5Gcreate2(f, "tokens", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)) >= 0;
    case ShardSpec::dangling_link:
      return H5Lcreate_soft("/nowhere", f, "tokens", H5P_DEFAULT, H5P_DEFAULT) >= 0;
    case ShardSpec::dataset: break;
  }
  const int rank = static_cast<int>(s.dims.size());
  std::vector<hsize_t> maxdims(s.dims);
  const bool chunked = s.layout == ShardSpec::chunked || s.layout == ShardSpec::deflate;
  if (chunked && s.unlimited) std::fill(maxdims.begin(), maxdims.end(), H5S_UNLIMITED);
  h5::Dataspace space(rank == 0 ? H5Screate(H5S_SCALAR)
                                : H5Screate_simple(rank, s.dims.data(), maxdims.data()));
  h5::PropList dcpl(H5Pcreate(H5P_DATASET_CREATE));
  if (chunked) {
    std::vector<hsize_t> chunk(s.dims.size());
    for (int r = 0; r < rank; ++r)
      chunk[r] = s.unlimited ? s.chunk : std::max<hsize_t>(1, std::min(s.chunk, s.dims[r]));
    if (H5Pset_chunk(dcpl.get(), rank, chunk.data()) < 0) return false;
    if (s.layout == ShardSpec::deflate && H5Pset_deflate(dcpl.get(), 1) < 0) return false;
  } else if (H5Pset_layout(dcpl.get(), s.layout == ShardSpec::compact ? H5D_COMPACT
                                                                     : H5D_CONTIGUOUS) < 0) {
    return false;
  }
  if (s.fill && H5Pset_fill_value(dcpl.get(), H5T_NATIVE_UINT32, &*s.fill) < 0) return false;
  hid_t raw = H5Dcreate2(f, "tokens", kTypes[s.type].type(), space.get(), H5P_DEFAULT, dcpl.get(),
                         H5P_DEFAULT);
  if (raw < 0) return false;
  h5::Dataset d(raw);
  if (s.written == 0) return true;
  if (s.write == ShardSpec::full)
    return H5Dwrite(d.get(), H5T_NATIVE_UINT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, s.values.data()) >= 0;
  // A prefix of a 1-D dataset.
  hsize_t start = 0, count = s.written;
  h5::Dataspace file_space(H5Dget_space(d.get()));
  h5::Dataspace mem_space(H5Screate_simple(1, &count, nullptr));
  return H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, &start, nullptr, &count, nullptr) >= 0 &&
         H5Dwrite(d.get(), H5T_NATIVE_UINT32, mem_space.get(), file_space.get(), H5P_DEFAULT,
                  s.values.data()) >= 0;
}

// The superblock (version 0, what H5Fcreate writes by default) records the end-of-file address
// at byte 40; HDF5 refuses a file shorter than that. Setting it to the truncated length makes HDF5
// open the cut file, so that OUR check for datasets running past the end is what is tested.
bool patch_superblock_eof(const std::string& path, uint64_t len) {
  std::FILE* f = std::fopen(path.c_str(), "r+b");
  if (!f) return false;
  unsigned char head[48] = {};
  bool ok = std::fread(head, 1, sizeof head, f) == sizeof head &&
            std::memcmp(head, "\x89HDF\r\n\x1a\n", 8) == 0 && head[8] == 0 && head[13] == 8;
  if (ok) {
    unsigned char le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(len >> (8 * i));
    ok = std::fseek(f, 40, SEEK_SET) == 0 && std::fwrite(le, 1, 8, f) == 8;
  }
  std::fclose(f);
  return ok;
}

// What writing did to the file beyond the description.
struct Written {
  bool truncated = false;   // cut short: HDF5 decides what is still readable
  bool tokens_cut = false;  // ... inside the contiguous storage of /tokens: must be refused
};

// Writes the shard; false if HDF5 would not build it.
bool write_shard_file(const std::string& path, const ShardSpec& s, Written* w) {
  *w = Written{};
  if (verbose()) {
    std::string dims;
    for (hsize_t d : s.dims) dims += (dims.empty() ? "" : "x") + std::to_string(d);
    std::fprintf(stderr,
                 "%s: tokens obj %d type %s dims [%s] layout %d write %d (%llu written) fill %d "
                 "valid %d truncate %d patch_eof %d\n",
                 path.c_str(), static_cast<int>(s.tokens_obj), kTypes[s.type].name, dims.c_str(),
                 static_cast<int>(s.layout), static_cast<int>(s.write),
                 static_cast<unsigned long long>(s.written), s.fill.has_value(), s.valid(),
                 s.truncate_at.has_value(), s.patch_eof);
  }
  try {
    h5::File f = h5::create(path);
    const hid_t root = f.get();
    auto attrs = [&] {
      write_attr(root, "format", s.format);
      write_attr(root, "version", s.version);
      write_attr(root, "vocab_size", s.vocab);
      write_attr(root, "eot_token", s.eot);
      write_attr(root, "tokenizer", s.tokenizer);
      write_attr(root, "num_tokens", s.num_tokens);
      write_attr(root, "source", s.source);
    };
    if (s.attrs_first) attrs();
    if (!write_tokens(root, s)) {
      if (verbose()) std::fprintf(stderr, "  not written: HDF5 refused the tokens object\n");
      return false;
    }
    if (s.doc_offsets) {
      hsize_t k = s.offsets.size();
      h5::Dataspace space(H5Screate_simple(1, &k, nullptr));
      h5::Dataset d(H5Dcreate2(root, "doc_offsets", H5T_NATIVE_UINT64, space.get(), H5P_DEFAULT,
                               H5P_DEFAULT, H5P_DEFAULT), "doc_offsets");
      if (H5Dwrite(d.get(), H5T_NATIVE_UINT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, s.offsets.data()) < 0)
        return false;
    }
    if (!s.attrs_first) attrs();
  } catch (const Error& e) {  // h5 helpers throw when HDF5 refuses (e.g. an odd attribute)
    if (verbose()) std::fprintf(stderr, "  not written: %s\n", e.what());
    return false;
  }
  if (s.truncate_at) {
    // Where the contiguous tokens lie, to know whether the cut goes through them.
    uint64_t tokens_end = 0;
    if (s.tokens_obj == ShardSpec::dataset) {
      h5::File f = h5::open_read(path);
      h5::Dataset d(H5Dopen2(f.get(), "tokens", H5P_DEFAULT), "tokens");
      const haddr_t offset = H5Dget_offset(d.get());
      if (offset != HADDR_UNDEF) tokens_end = offset + H5Dget_storage_size(d.get());
    }
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return false;
    const off_t len = static_cast<off_t>(static_cast<uint64_t>(st.st_size) * *s.truncate_at / 65536);
    if (len < st.st_size) {
      if (::truncate(path.c_str(), len) != 0) return false;
      if (s.patch_eof && !patch_superblock_eof(path, static_cast<uint64_t>(len))) return false;
      w->truncated = true;
      w->tokens_cut = tokens_end > static_cast<uint64_t>(len);
    }
  }
  return true;
}

// ---- checking the readers ----------------------------------------------------------------------

// Runs `fn`; true if it returned, false if it threw UsageError; anything else is a bug.
template <class Fn>
bool outcome(const char* what, Fn&& fn) {
  try {
    fn();
    if (verbose()) std::fprintf(stderr, "  %s: ok\n", what);
    return true;
  } catch (const UsageError& e) {
    if (verbose()) std::fprintf(stderr, "  %s: UsageError: %s\n", what, e.what());
    return false;
  } catch (const std::exception& e) {
    bug(std::string(what) + " threw a non-UsageError exception: " + e.what());
  } catch (...) {
    bug(std::string(what) + " threw a non-std exception");
  }
}

// Above this many tokens the harness does not read whole shards (read_shard_tokens is documented as
// reading everything), and above this many windows it does not list them all.
constexpr uint64_t kTokenLimit = 1 << 20;
constexpr uint64_t kWindowLimit = 1 << 16;

void check_info(const std::string& path, const ShardSpec& s, const Written& w) {
  ShardInfo info;
  const bool ok = outcome("read_shard_info", [&] { info = read_shard_info(path); });
  if (w.truncated) {  // HDF5 decides what of a cut file is readable, but a cut through the
                      // tokens' storage must be refused (open_shard checks it: no SIGBUS later)
    if (ok && w.tokens_cut) bug("read_shard_info accepted a file cut inside the tokens' storage");
    if (ok && info.num_tokens <= kTokenLimit)
      outcome("read_shard_tokens", [&] { read_shard_tokens(path); });
    return;
  }
  if (ok != s.valid())
    bug(std::string("read_shard_info ") + (ok ? "accepted an invalid" : "refused a valid") +
        " shard (" + path + ")");
  if (!ok) return;
  if (info.num_tokens != s.dims[0]) bug("read_shard_info: wrong num_tokens");
  if (info.dtype_bytes != static_cast<int>(H5Tget_size(kTypes[s.type].type())))
    bug("read_shard_info: wrong dtype_bytes");
  if (info.meta.vocab_size != *s.vocab.as_int()) bug("read_shard_info: wrong vocab_size");
  if (info.meta.eot_token != s.eot.as_int().value_or(-1)) bug("read_shard_info: wrong eot_token");
  if (info.meta.tokenizer != s.tokenizer.as_string().value_or("byte"))
    bug("read_shard_info: wrong tokenizer");
  if (info.meta.source != s.source.as_string().value_or("")) bug("read_shard_info: wrong source");

  if (s.dims[0] > kTokenLimit) return;  // reading it all is the caller's choice, not ours
  std::vector<uint32_t> tokens;
  if (!outcome("read_shard_tokens", [&] { tokens = read_shard_tokens(path); }))
    bug("read_shard_tokens refused a shard read_shard_info accepted");
  if (tokens.size() != s.dims[0]) bug("read_shard_tokens: wrong length");
  for (uint64_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] != s.expected(i))
      bug("read_shard_tokens: token " + std::to_string(i) + " is " + std::to_string(tokens[i]) +
          ", wrote " + std::to_string(s.expected(i)));
}

void check_dataset(FuzzedDataProvider& in, const std::vector<std::string>& paths,
                   const std::vector<const ShardSpec*>& specs, bool truncated, bool tokens_cut) {
  const float pick = in.ConsumeProbability<float>();
  const int64_t seq_len =
      pick < 0.8f   ? in.ConsumeIntegralInRange<int64_t>(1, 40)
      : pick < 0.9f ? static_cast<int64_t>(specs[0]->count()) - in.ConsumeIntegralInRange<int64_t>(-1, 2)
                    : in.PickValueInArray<int64_t>({0, -1, INT64_MIN, INT64_MAX, 1LL << 32});
  const uint64_t seed = in.ConsumeIntegral<uint64_t>();
  const bool shuffle = in.ConsumeBool();

  // What a correct TokenDataset does with these shards (it serves int32 tokens, so it also
  // refuses vocab_size > 2^31).
  bool should_open = seq_len > 0;
  for (const ShardSpec* s : specs) {
    should_open = should_open && s->valid() && *s->vocab.as_int() == *specs[0]->vocab.as_int() &&
                  *s->vocab.as_int() <= (int64_t{1} << 31) &&
                  s->dims[0] >= static_cast<uint64_t>(seq_len) + 1;
  }

  if (verbose())
    std::fprintf(stderr, "TokenDataset(%zu shards, seq_len %lld, shuffle %d): expect %s\n",
                 paths.size(), static_cast<long long>(seq_len), shuffle,
                 should_open ? "open" : "refusal");
  std::optional<TokenDataset> data;
  const bool ok = outcome("TokenDataset", [&] { data.emplace(paths, seq_len, seed, shuffle); });
  if (truncated) {
    if (ok && tokens_cut) bug("TokenDataset accepted a file cut inside the tokens' storage");
    if (!ok) return;
  } else if (ok != should_open) {
    bug(std::string("TokenDataset ") + (ok ? "accepted" : "refused") + " shards it should " +
        (ok ? "refuse" : "accept"));
  }
  if (!ok) return;
  for (const ShardSpec* s : specs)
    if (!s->valid()) return;  // a cut file that still opened: nothing more is known about it

  // Windows must hold the tokens written at the right offsets (untruncated files only; for a cut
  // file that HDF5 still reads, only the absence of crashes is checked).
  uint64_t total_windows = 0, total_tokens = 0;
  std::vector<std::pair<const ShardSpec*, uint64_t>> windows;  // (shard, first token), in order
  bool materialise = !truncated;
  for (const ShardSpec* s : specs) {
    const uint64_t w = (s->dims[0] - 1) / static_cast<uint64_t>(seq_len);
    total_windows += w;
    total_tokens += s->dims[0];
    if (total_windows > kWindowLimit) materialise = false;
    for (uint64_t j = 0; materialise && j < w; ++j) windows.emplace_back(s, j * seq_len);
  }
  if (!truncated) {
    if (data->num_windows() != total_windows) bug("TokenDataset: wrong num_windows");
    if (data->num_tokens() != total_tokens) bug("TokenDataset: wrong num_tokens");
    if (data->vocab_size() != *specs[0]->vocab.as_int()) bug("TokenDataset: wrong vocab_size");
    if (data->eot_token() != specs[0]->eot.as_int().value_or(-1)) bug("TokenDataset: wrong eot");
  }
  if (seq_len > (1 << 16)) return;  // windows too long to be worth copying around
  const size_t width = static_cast<size_t>(seq_len) + 1;
  // Tokens come out as int32: the stored value's bits (a value >= 2^31 is out of any accepted
  // vocabulary; its bits are still what must come back).
  auto expected_window = [&](uint64_t k) {
    std::vector<int32_t> w(width);
    for (size_t t = 0; t < width; ++t)
      w[t] = static_cast<int32_t>(windows[k].first->expected(windows[k].second + t));
    return w;
  };
  // A window holding a token past the vocabulary is refused (UsageError); `refused` says so.
  const uint64_t vocab = static_cast<uint64_t>(data->vocab_size());
  auto out_of_vocab = [&](const std::vector<int32_t>& w) {
    return std::any_of(w.begin(), w.end(), [&](int32_t t) { return static_cast<uint32_t>(t) >= vocab; });
  };
  auto get_or_refused = [&](uint64_t index, bool* refused) {
    std::vector<int32_t> w(width);
    *refused = !outcome("window", [&] { data->window(index, w.data()); });
    if (*refused) w.assign(width, -1);
    return w;
  };
  auto get = [&](uint64_t index) {
    bool refused = false;
    return get_or_refused(index, &refused);
  };

  const int calls = in.ConsumeIntegralInRange<int>(1, 6);
  bool epoch_checked = false;
  for (int c = 0; c < calls; ++c) {
    const uint64_t index = in.ConsumeBool() ? in.ConsumeIntegralInRange<uint64_t>(0, 3 * total_windows)
                                            : in.ConsumeIntegral<uint64_t>();
    bool refused = false, again = false;
    const auto got = get_or_refused(index, &refused);
    if (got != get_or_refused(index, &again) || refused != again) bug("window() is not deterministic");
    if (!materialise) continue;
    // The epoch of `index`, or the one before it if that one does not fit below 2^64 whole.
    uint64_t epoch = index / total_windows;
    if (epoch * total_windows > UINT64_MAX - (total_windows - 1)) --epoch;
    if (!shuffle) {
      const auto want = expected_window(index % total_windows);
      if (refused != out_of_vocab(want))
        bug("window(" + std::to_string(index) + ") " + (refused ? "refused without" : "served with") +
            " a token outside the vocabulary");
      if (!refused && got != want)
        bug("window(" + std::to_string(index) + ") differs from the tokens written there");
    } else if (!epoch_checked && total_windows <= 2048) {
      epoch_checked = true;
      // A shuffled epoch is a permutation of the windows.
      // Windows with a token past the vocabulary are refused; all others come back.
      std::vector<std::vector<int32_t>> want, have;
      for (uint64_t k = 0; k < total_windows; ++k) {
        auto w = expected_window(k);
        want.push_back(out_of_vocab(w) ? std::vector<int32_t>(width, -1) : w);
        have.push_back(get(epoch * total_windows + k));
      }
      std::sort(want.begin(), want.end());
      std::sort(have.begin(), have.end());
      if (want != have) bug("a shuffled epoch is not a permutation of the windows");
    }
  }

  // batch(): row r is window(start + rank*rows + r).
  const uint64_t start = in.ConsumeIntegral<uint64_t>();
  const int rank = in.ConsumeIntegralInRange<int>(0, 7);
  const int64_t rows = in.ConsumeIntegralInRange<int64_t>(0, 4);
  std::vector<int32_t> buf(static_cast<size_t>(rows) * width);
  const bool served = outcome("batch", [&] { data->batch(start, rank, rows, buf.data()); });
  bool any_refused = false;
  for (int64_t r = 0; r < rows; ++r) {
    bool refused = false;
    const auto want = get_or_refused(start + static_cast<uint64_t>(rank) * rows + r, &refused);
    any_refused = any_refused || refused;
    if (served && !std::equal(want.begin(), want.end(), buf.begin() + r * width)) bug("batch() row differs from window()");
  }
  if (served == any_refused) bug("batch() and window() disagree about a token outside the vocabulary");
}

}  // namespace

// Leaks inside HDF5 itself (its error paths on damaged files leak a few object-header blocks, e.g.
// H5Fopen -> H5G_mkroot when the root header lies past the end of the file) are HDF5's, not ours.
// Our own leaks of HDF5 handles are not hidden by this: those stay reachable through HDF5's ID
// tables and LeakSanitizer never reported them anyway.
extern "C" const char* __lsan_default_suppressions() { return "leak:libhdf5\n"; }

namespace {
Hdf5Ids g_ids;  // live HDF5 identifiers between inputs
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  h5::silence_errors();
  // Let HDF5 keep more of its freed blocks (bounded, so memory stays flat): with the default
  // 64 KiB per free list it gives the ~1 MiB metadata cache of every closed file back to the
  // allocator, and under ASan each new one is fresh pages to fault in and clear, which made file
  // opens ~70% of the run time.
  H5set_free_list_limits(64 << 20, 16 << 20, 64 << 20, 16 << 20, 64 << 20, 16 << 20);
  // One round trip first, so that whatever HDF5 registers lazily is in the baseline of live IDs.
  const std::string warm = scratch_dir() + "/a.h5";
  ShardMeta meta;
  meta.vocab_size = 8;
  write_shard(warm, {1, 2, 3, 4}, {0}, meta);
  { TokenDataset warm_up({warm}, 2, 1, true); }
  read_shard_tokens(warm);
  g_ids = Hdf5Ids::now();
  return 0;
}

namespace {

void run_one(const uint8_t* bytes, size_t size) {
  FuzzedDataProvider in(bytes, size);
  const std::string a = scratch_dir() + "/a.h5", b = scratch_dir() + "/b.h5";

  const ShardSpec first = decode_shard(in, nullptr);
  Written written_a, written_b;
  if (!write_shard_file(a, first, &written_a)) return;

  // Shard list: one shard, two, or the same one twice.
  std::optional<ShardSpec> second;
  std::vector<std::string> paths{a};
  std::vector<const ShardSpec*> specs{&first};
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 1:
    case 2:
      second = decode_shard(in, &first);
      if (!write_shard_file(b, *second, &written_b)) return;
      paths.push_back(b);
      specs.push_back(&*second);
      break;
    case 3:
      paths.push_back(a);
      specs.push_back(&first);
      break;
    default: break;
  }

  check_info(a, first, written_a);
  if (second) check_info(b, *second, written_b);
  check_dataset(in, paths, specs, written_a.truncated || written_b.truncated,
                written_a.tokens_cut || written_b.tokens_cut);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  run_one(bytes, size);
  if (std::string leaked = Hdf5Ids::now().grown_since(g_ids); !leaked.empty())
    bug("HDF5 identifiers left open after the input: " + leaked);
  return 0;
}
