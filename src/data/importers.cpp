// Inputs of `mpitrain pack`: the file walk, text documents, and the token-array formats (nanoGPT,
// llm.c, npy, Megatron): header parsing, size checks, memory maps and typed scans over token ranges.
#include "mpitrain/importers.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>
#include <type_traits>

#include "mpitrain/error.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "token files are little-endian and read in place: big-endian hosts need byte swaps");

namespace mpitrain {

namespace fs = std::filesystem;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  });
}

namespace {

uint64_t file_size(const std::string& path) {
  std::error_code ec;
  const uintmax_t n = fs::file_size(path, ec);
  if (ec) throw UsageError(concat(path, ": cannot stat: ", ec.message()));
  return n;
}

// The first `n` bytes of a file (fewer if it is shorter).
std::string read_prefix(const std::string& path, size_t n) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(path + ": cannot open for reading");
  std::string buf(n, '\0');
  in.read(buf.data(), static_cast<std::streamsize>(n));
  buf.resize(static_cast<size_t>(in.gcount()));
  return buf;
}

// ---- npy header --------------------------------------------------------------------------------

// The header is a Python dict literal such as
//   {'descr': '<u2', 'fortran_order': False, 'shape': (1000,), }
// numpy writes exactly these three keys; anything else is refused rather than guessed at.
NpyHeader parse_npy_dict(const std::string& path, std::string_view s, const std::string& wanted) {
  size_t i = 0;
  auto bad = [&](const std::string& what) {
    std::string shown(s.substr(0, 120));  // one line: no padding, newline or other control bytes
    for (char& c : shown)
      if (std::iscntrl(static_cast<unsigned char>(c))) c = ' ';
    shown.erase(shown.find_last_not_of(' ') + 1);
    return UsageError(concat(path, ": malformed .npy header (", what, "): ", shown));
  };
  auto ws = [&] {
    while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  };
  auto next_is = [&](char c) {
    ws();
    return i < s.size() && s[i] == c;
  };
  auto eat = [&](char c) { return next_is(c) ? (++i, true) : false; };
  auto str = [&] {
    ws();
    if (i >= s.size() || (s[i] != '\'' && s[i] != '"')) throw bad("expected a string");
    const char q = s[i++];
    const size_t end = s.find(q, i);
    if (end == std::string_view::npos) throw bad("unterminated string");
    std::string v(s.substr(i, end - i));
    i = end + 1;
    return v;
  };
  auto integer = [&] {
    ws();
    size_t j = i;
    while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
    if (j == i || j - i > 19) throw bad("expected a non-negative integer");
    const uint64_t v = std::stoull(std::string(s.substr(i, j - i)));
    i = j;
    return v;
  };
  NpyHeader h;
  bool got_descr = false, got_order = false, got_shape = false;
  if (!eat('{')) throw bad("expected '{'");
  while (!eat('}')) {
    const std::string key = str();
    if (!eat(':')) throw bad("expected ':'");
    ws();
    if (key == "descr") {
      if (i < s.size() && s[i] != '\'' && s[i] != '"')
        throw UsageError(
            concat(path, ": unsupported dtype (a structured array), expected ", wanted));
      h.descr = str();
      got_descr = true;
    } else if (key == "fortran_order") {
      h.fortran_order = s.substr(i, 4) == "True";
      if (!h.fortran_order && s.substr(i, 5) != "False")
        throw bad("fortran_order is not True or False");
      i += h.fortran_order ? 4 : 5;
      got_order = true;
    } else if (key == "shape") {
      if (!eat('(')) throw bad("shape is not a tuple");
      while (!eat(')')) {
        h.shape.push_back(integer());
        if (!eat(',') && !next_is(')')) throw bad("expected ',' or ')'");
      }
      got_shape = true;
    } else {
      throw bad("unexpected key '" + key + "'");
    }
    if (!eat(',') && !next_is('}')) throw bad("expected ',' or '}'");
  }
  if (!got_descr || !got_order || !got_shape)
    throw bad("needs 'descr', 'fortran_order' and 'shape'");
  return h;
}

Dtype npy_dtype(const std::string& path, const std::string& descr) {
  static const std::pair<const char*, Dtype> known[] = {
      {"|u1", Dtype::u8},  {"|i1", Dtype::i8},  {"<u2", Dtype::u16}, {"<i2", Dtype::i16},
      {"<u4", Dtype::u32}, {"<i4", Dtype::i32}, {"<u8", Dtype::u64}, {"<i8", Dtype::i64}};
  for (const auto& [name, d] : known)
    if (descr == name) return d;
  throw UsageError(concat(path, ": unsupported dtype '", descr,
                          "', expected a little-endian integer: <u2 <i2 <u4 <i4 <u8 <i8 |u1 |i1"));
}

TokenLayout npy_layout(const std::string& path) {
  const NpyHeader h = read_npy_header(path, "a 1-D integer array");
  TokenLayout t;
  t.dtype = npy_dtype(path, h.descr);
  if (h.shape.size() != 1)
    throw UsageError(
        concat(path, ": shape ", npy_shape_text(h.shape), " is not 1-D (expected (N,))"));
  if (h.fortran_order) throw UsageError(path + ": fortran_order is True, expected False");
  t.offset = h.data_offset;
  t.count = h.shape[0];
  return t;
}

// ---- typed scans -------------------------------------------------------------------------------

// Calls f(T{}) with the C++ type of `d`.
template <class F>
decltype(auto) with_type(Dtype d, F&& f) {
  switch (d) {
    case Dtype::u8: return f(uint8_t{});
    case Dtype::i8: return f(int8_t{});
    case Dtype::u16: return f(uint16_t{});
    case Dtype::i16: return f(int16_t{});
    case Dtype::u32: return f(uint32_t{});
    case Dtype::i32: return f(int32_t{});
    case Dtype::u64: return f(uint64_t{});
    case Dtype::i64: break;
  }
  return f(int64_t{});
}

// Token i; memcpy keeps reads of a mapped file well-defined at any alignment.
template <class T>
T load(const unsigned char* data, uint64_t i) {
  T v;
  std::memcpy(&v, data + i * sizeof(T), sizeof(T));
  return v;
}

// ---- Megatron index ----------------------------------------------------------------------------

constexpr char kMegatronMagic[] = "MMIDIDX\0\0";  // 9 bytes (the literal adds a 10th, unused)
// A rank starts from the last mark at or before its range and walks at most one stride of
// documents to it. The marks travel in the plan, so a file has at most kMaxMarks of them: past
// kMinMarkStride * kMaxMarks documents the stride grows.
constexpr uint64_t kMinMarkStride = 1024, kMaxMarks = 65536;

// Megatron's DType codes. Its float codes exist for other data; token ids are integers.
Dtype megatron_dtype(const std::string& idx_path, unsigned code) {
  switch (code) {
    case 1: return Dtype::u8;
    case 2: return Dtype::i8;
    case 3: return Dtype::i16;
    case 4: return Dtype::i32;
    case 5: return Dtype::i64;
    case 8: return Dtype::u16;
    case 6:
    case 7:
      throw UsageError(concat(idx_path, ": dtype code ", code, " (", code == 6 ? "float64" : "float32",
                              ") is not an integer type: token ids are 1 uint8, 2 int8, 3 int16, "
                              "4 int32, 5 int64 or 8 uint16"));
  }
  throw UsageError(concat(idx_path, ": dtype code ", code,
                          " is not Megatron's (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16)"));
}

void need_megatron_file(const std::string& path, const std::string& prefix) {
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw UsageError(concat(path, ": no such file (a Megatron dataset is the pair ", prefix,
                            ".bin + ", prefix, ".idx)"));
  if (!fs::is_regular_file(path, ec)) throw UsageError(path + ": not a regular file");
}

// Rank 0's check of a whole index, read in place from its map: nothing is allocated by the
// counts it announces (they are checked against the file's size first) except the marks.
TokenLayout megatron_layout(const std::string& prefix) {
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  need_megatron_file(idx_path, prefix);
  need_megatron_file(bin_path, prefix);
  const MappedFile idx(idx_path);
  const uint64_t size = idx.size();
  if (size < kMegatronHeaderBytes)
    throw UsageError(concat(idx_path, ": ", size, " bytes, too short for the ", kMegatronHeaderBytes,
                            "-byte Megatron index header"));
  const unsigned char* p = idx.data();
  if (std::memcmp(p, kMegatronMagic, 9) != 0)
    throw UsageError(idx_path + ": bad magic (a Megatron .idx starts with MMIDIDX\\x00\\x00)");
  const auto version = load<uint64_t>(p + 9, 0);
  if (version != 1) throw UsageError(concat(idx_path, ": version ", version, ", expected 1"));
  TokenLayout t;
  t.dtype = megatron_dtype(idx_path, p[17]);
  const uint64_t item = dtype_bytes(t.dtype);
  MegatronLayout& m = t.megatron;
  const uint64_t S = m.sequences = load<uint64_t>(p + 18, 0);
  const auto D = load<uint64_t>(p + 26, 0);
  m.idx_bytes = size;

  const uint64_t room = size - kMegatronHeaderBytes;
  if (S > room / 12 || D > (room - 12 * S) / 8)
    throw UsageError(concat(idx_path, ": sequence count ", S, " and document count ", D,
                            " need more than the ", room,
                            " bytes after the header (truncated, or the counts are wrong)"));
  // Newer Megatron writes int8 sequence_modes[S] after the arrays for multimodal data.
  const uint64_t extra = room - 12 * S - 8 * D;
  if (extra != 0 && extra != S)
    throw UsageError(concat(idx_path, ": ", extra, " bytes after document_indices (trailing data: ",
                            "only sequence_modes, ", S, " bytes, may follow it)"));
  if (D == 0)
    throw UsageError(concat(idx_path, ": document count 0, but document_indices starts with 0 and "
                            "ends with the sequence count ", S));
  const unsigned char* lengths = p + kMegatronHeaderBytes;
  const unsigned char* pointers = lengths + 4 * S;
  const unsigned char* docs = pointers + 8 * S;

  // Every sequence inside the .bin, and together exactly its size: a .bin of another index, or
  // a truncated one, is refused rather than read as other tokens.
  m.bin_bytes = file_size(bin_path);
  const uint64_t bin_tokens = m.bin_bytes / item;
  uint64_t total = 0;
  for (uint64_t i = 0; i < S; ++i) {
    const auto len = load<int32_t>(lengths, i);
    const auto ptr = load<int64_t>(pointers, i);
    if (len < 0)
      throw UsageError(concat(idx_path, ": sequence_lengths[", i, "] = ", len, " is negative"));
    if (ptr < 0 || static_cast<uint64_t>(ptr) % item != 0)
      throw UsageError(concat(idx_path, ": sequence_pointers[", i, "] = ", ptr,
                              " is not a byte offset of a token (a non-negative multiple of the ",
                              "dtype's ", item, " bytes)"));
    const auto at = static_cast<uint64_t>(ptr), bytes = static_cast<uint64_t>(len) * item;
    if (at > m.bin_bytes)
      throw UsageError(concat(idx_path, ": sequence_pointers[", i, "] = ", ptr, " is past the end of ",
                              bin_path, " (", m.bin_bytes, " bytes)"));
    if (bytes > m.bin_bytes - at)
      throw UsageError(concat(idx_path, ": sequence ", i, " (sequence_pointers[", i, "] = ", ptr,
                              ", sequence_lengths[", i, "] = ", len, ") ends at byte ", at + bytes,
                              ", past the end of ", bin_path, " (", m.bin_bytes, " bytes)"));
    total += static_cast<uint64_t>(len);  // stops below 2^64: each step adds < 2^31
    if (total > bin_tokens) break;
  }
  if (total * item != m.bin_bytes)
    throw UsageError(concat(idx_path, ": sequence_lengths add up to ",
                            total > bin_tokens ? "more than " : "", total, " tokens (",
                            total * item, " bytes), but ", bin_path, " holds ", m.bin_bytes,
                            " bytes (a .bin of another index, or truncated?)"));

  // Documents: runs of sequences from the first to the last, in order.
  const auto first = load<int64_t>(docs, 0);
  if (first != 0)
    throw UsageError(concat(idx_path, ": document_indices[0] = ", first, ", expected 0"));
  for (uint64_t k = 1; k < D; ++k) {
    const auto prev = load<int64_t>(docs, k - 1), cur = load<int64_t>(docs, k);
    if (cur < prev)
      throw UsageError(concat(idx_path, ": document_indices[", k, "] = ", cur,
                              " is less than document_indices[", k - 1, "] = ", prev,
                              " (the indices never decrease)"));
  }
  const auto last = load<int64_t>(docs, D - 1);
  if (static_cast<uint64_t>(last) != S)
    throw UsageError(concat(idx_path, ": document_indices[", D - 1, "] = ", last,
                            ", expected the sequence count ", S));
  if (total == 0) throw UsageError(idx_path + ": no tokens (every sequence is empty)");

  m.documents = D - 1;
  m.mark_stride = std::max(kMinMarkStride, (m.documents + kMaxMarks - 1) / kMaxMarks);
  uint64_t before = 0, seq = 0;
  for (uint64_t k = 0; k < m.documents; ++k) {
    if (k % m.mark_stride == 0) m.marks.push_back(before);
    for (const auto next = static_cast<uint64_t>(load<int64_t>(docs, k + 1)); seq < next; ++seq)
      before += static_cast<uint64_t>(load<int32_t>(lengths, seq));
  }
  t.count = total;
  return t;
}

}  // namespace

// ---- files and text documents ------------------------------------------------------------------

std::vector<std::string> collect_input_files(const std::vector<std::string>& inputs) {
  std::vector<std::string> files;
  for (const std::string& input : inputs) {
    std::error_code ec;
    fs::file_status st = fs::status(input, ec);
    if (!fs::exists(st)) throw UsageError(input + ": no such file or directory");
    if (fs::is_regular_file(st)) {
      files.push_back(input);
      continue;
    }
    if (!fs::is_directory(st)) throw UsageError(input + ": not a regular file or directory");
    std::vector<std::string> found;
    fs::recursive_directory_iterator it(input, ec), end;
    if (ec) throw UsageError(concat(input, ": cannot list directory: ", ec.message()));
    for (; it != end; it.increment(ec)) {
      if (ec) throw UsageError(concat(input, ": cannot list directory: ", ec.message()));
      if (it->is_symlink(ec) || !it->is_regular_file(ec)) continue;
      std::string path = it->path().string();
      if (!ends_with(path, ".dat")) found.push_back(std::move(path));
    }
    if (ec) throw UsageError(concat(input, ": cannot list directory: ", ec.message()));
    if (found.empty()) throw UsageError(input + ": empty directory");
    std::sort(found.begin(), found.end());
    files.insert(files.end(), found.begin(), found.end());
  }
  return files;
}

std::string read_whole_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(path + ": cannot open for reading");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw UsageError(path + ": read error");
  return text;
}

std::vector<std::pair<size_t, size_t>> split_documents(std::string_view text,
                                                       const std::string& sep) {
  std::vector<std::pair<size_t, size_t>> docs;
  auto add = [&](size_t from, size_t to) {
    if (!is_blank(text.substr(from, to - from))) docs.emplace_back(from, to - from);
  };
  if (sep.empty()) {
    add(0, text.size());
    return docs;
  }
  size_t doc_start = 0, line_start = 0;
  while (line_start < text.size()) {
    size_t nl = text.find('\n', line_start);
    size_t line_end = nl == std::string_view::npos ? text.size() : nl;
    size_t next = nl == std::string_view::npos ? text.size() : nl + 1;
    size_t len = line_end - line_start;
    if (len > 0 && text[line_end - 1] == '\r') --len;
    if (len == sep.size() && text.compare(line_start, len, sep) == 0) {
      add(doc_start, line_start);
      doc_start = next;
    }
    line_start = next;
  }
  add(doc_start, text.size());
  return docs;
}

// ---- npy headers -------------------------------------------------------------------------------

NpyHeader read_npy_header(const std::string& path, const std::string& wanted) {
  const uint64_t size = file_size(path);
  const std::string pre = read_prefix(path, 12);
  if (pre.size() < 10 || pre.compare(0, 6, "\x93NUMPY") != 0)
    throw UsageError(path + ": not a .npy file (no \\x93NUMPY magic)");
  const int major = static_cast<unsigned char>(pre[6]), minor = static_cast<unsigned char>(pre[7]);
  if (major < 1 || major > 3)
    throw UsageError(concat(path, ": unsupported .npy version ", major, ".", minor));
  uint64_t header_len = 0, start = 10;
  if (major == 1) {
    header_len = static_cast<unsigned char>(pre[8]) | static_cast<unsigned char>(pre[9]) << 8;
  } else {
    if (pre.size() < 12) throw UsageError(path + ": truncated .npy header");
    uint32_t n32;
    std::memcpy(&n32, pre.data() + 8, 4);
    header_len = n32;
    start = 12;
  }
  if (header_len > (1u << 20) || start + header_len > size)
    throw UsageError(concat(path, ": truncated .npy header (", header_len, " bytes announced)"));
  const std::string all = read_prefix(path, start + header_len);
  NpyHeader h = parse_npy_dict(path, std::string_view(all).substr(start), wanted);
  h.data_offset = start + header_len;
  h.file_size = size;
  return h;
}

std::string npy_shape_text(const std::vector<uint64_t>& shape) {
  std::string s = "(";
  for (size_t k = 0; k < shape.size(); ++k) s += concat(k ? ", " : "", shape[k]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

// ---- formats -----------------------------------------------------------------------------------

const char* format_name(InputFormat f) {
  switch (f) {
    case InputFormat::text: return "text";
    case InputFormat::nanogpt: return "nanogpt";
    case InputFormat::llmc: return "llmc";
    case InputFormat::npy: return "npy";
    case InputFormat::jsonl: return "jsonl";
    case InputFormat::megatron: return "megatron";
  }
  return "?";
}

InputFormat parse_format(const std::string& name) {
  for (InputFormat f : {InputFormat::text, InputFormat::nanogpt, InputFormat::llmc, InputFormat::npy,
                        InputFormat::jsonl, InputFormat::megatron})
    if (name == format_name(f)) return f;
  throw UsageError("pack: --format '" + name +
                   "' is not one of auto, text, jsonl, nanogpt, llmc, npy, megatron");
}

size_t dtype_bytes(Dtype d) {
  return with_type(d, [](auto t) { return sizeof(t); });
}

InputFormat detect_format(const std::string& path) {
  // Packing a shard (or any HDF5 file) as text would quietly make bytes of it.
  if (ends_with(path, ".h5") || ends_with(path, ".hdf5"))
    throw UsageError(path + ": an HDF5 file; pack reads text, .bin (nanoGPT, llm.c) and .npy, and "
                            "Megatron .bin + .idx pairs");
  if (ends_with(path, ".npy")) return InputFormat::npy;
  if (ends_with(path, ".jsonl")) return InputFormat::jsonl;
  // An index is never text; a .bin beside one is its data, whatever its first bytes read as (a
  // uint16 Megatron .bin would otherwise pack as nanoGPT, without its documents).
  if (ends_with(path, ".idx")) return InputFormat::megatron;
  if (!ends_with(path, ".bin")) return InputFormat::text;
  std::error_code ec;
  if (fs::is_regular_file(megatron_prefix(path) + ".idx", ec)) return InputFormat::megatron;
  const std::string pre = read_prefix(path, 4);
  int32_t magic = 0;
  if (pre.size() == 4) std::memcpy(&magic, pre.data(), 4);
  return magic == kLlmcMagicV1 || magic == kLlmcMagicV7 ? InputFormat::llmc : InputFormat::nanogpt;
}

TokenLayout read_token_layout(const std::string& path, InputFormat format) {
  if (format == InputFormat::megatron) return megatron_layout(path);  // PREFIX: not a file
  const uint64_t size = file_size(path);
  TokenLayout t;
  if (format == InputFormat::nanogpt) {
    if (size % 2 != 0)
      throw UsageError(concat(path, ": size ", size,
                              " bytes is odd (a nanoGPT .bin is a headerless uint16 array)"));
    t.dtype = Dtype::u16;
    t.count = size / 2;
  } else if (format == InputFormat::llmc) {
    if (size < kLlmcHeaderBytes)
      throw UsageError(
          concat(path, ": ", size, " bytes, too short for the 1024-byte llm.c header"));
    int32_t header[3];
    std::memcpy(header, read_prefix(path, sizeof header).data(), sizeof header);
    const bool v1 = header[0] == kLlmcMagicV1;
    if (!v1 && header[0] != kLlmcMagicV7)
      throw UsageError(concat(path, ": bad magic ", header[0], " (an llm.c .bin starts with ",
                              kLlmcMagicV1, " or ", kLlmcMagicV7, ")"));
    if (header[1] != (v1 ? 1 : 7))
      throw UsageError(concat(path, ": llm.c magic ", header[0], " with version ", header[1],
                              ", expected version ", v1 ? 1 : 7));
    if (header[2] < 0)
      throw UsageError(
          concat(path, ": token count ", header[2], " in the llm.c header is negative"));
    t.dtype = v1 ? Dtype::u16 : Dtype::u32;
    t.offset = kLlmcHeaderBytes;
    t.count = static_cast<uint64_t>(header[2]);
    const uint64_t want = kLlmcHeaderBytes + t.count * dtype_bytes(t.dtype);
    if (size != want)
      throw UsageError(concat(path, ": size ", size, " bytes, but the llm.c header's ", t.count,
                              " tokens need ", want, " (",
                              size < want ? "truncated" : "trailing data", ")"));
  } else if (format == InputFormat::npy) {
    t = npy_layout(path);
    const uint64_t item = dtype_bytes(t.dtype);  // saturate: the shape is the file's claim
    const uint64_t want =
        t.count > (UINT64_MAX - t.offset) / item ? UINT64_MAX : t.offset + t.count * item;
    if (size != want)
      throw UsageError(concat(path, ": size ", size, " bytes, but shape (", t.count, ",) needs ",
                              want, " (", size < want ? "truncated" : "trailing data", ")"));
  } else {
    throw Error(path + ": read_token_layout called for a text file");
  }
  if (t.count == 0) throw UsageError(path + ": no tokens (empty array)");
  return t;
}

// ---- Megatron inputs ---------------------------------------------------------------------------

std::string megatron_prefix(const std::string& path) {
  if (ends_with(path, ".bin") || ends_with(path, ".idx")) return path.substr(0, path.size() - 4);
  return path;
}

std::string resolve_megatron_input(const std::string& input) {
  std::error_code ec;
  if (fs::exists(input, ec)) return input;
  if (fs::exists(input + ".idx", ec) || fs::exists(input + ".bin", ec)) return input + ".idx";
  return input;
}

MegatronDataset::MegatronDataset(const std::string& prefix, const TokenLayout& layout)
    : prefix_(prefix), layout_(layout), idx_(prefix + ".idx"), bin_(prefix + ".bin") {
  const MegatronLayout& m = layout_.megatron;
  if (idx_.size() != m.idx_bytes || bin_.size() != m.bin_bytes)
    changed(concat(".idx ", idx_.size(), " and .bin ", bin_.size(), " bytes, expected ", m.idx_bytes,
                   " and ", m.bin_bytes));
}

void MegatronDataset::changed(const std::string& what) const {
  throw UsageError(concat(prefix_, ".idx: changed while packing (", what, ")"));
}

TokenView MegatronDataset::tokens() const {
  return TokenView{bin_.data(), layout_.dtype, bin_.size() / dtype_bytes(layout_.dtype)};
}

uint64_t MegatronDataset::document(uint64_t k) const {
  const MegatronLayout& m = layout_.megatron;
  const auto v = load<int64_t>(idx_.data() + kMegatronHeaderBytes + 12 * m.sequences, k);
  if (v < 0 || static_cast<uint64_t>(v) > m.sequences)
    changed(concat("document_indices[", k, "] = ", v));
  return static_cast<uint64_t>(v);
}

MegatronDataset::Span MegatronDataset::sequence(uint64_t i) const {
  const MegatronLayout& m = layout_.megatron;
  const unsigned char* lengths = idx_.data() + kMegatronHeaderBytes;
  const auto len = load<int32_t>(lengths, i);
  const auto ptr = load<int64_t>(lengths + 4 * m.sequences, i);
  const uint64_t item = dtype_bytes(layout_.dtype);
  if (len < 0 || ptr < 0 || static_cast<uint64_t>(ptr) % item != 0 ||
      static_cast<uint64_t>(ptr) > m.bin_bytes ||
      static_cast<uint64_t>(len) * item > m.bin_bytes - static_cast<uint64_t>(ptr))
    changed(concat("sequence ", i, ": pointer ", ptr, ", length ", len));
  return Span{static_cast<uint64_t>(ptr) / item, static_cast<uint64_t>(len)};
}

std::vector<std::pair<uint64_t, uint64_t>> MegatronDataset::documents_starting_in(
    uint64_t begin, uint64_t end) const {
  const MegatronLayout& m = layout_.megatron;
  std::vector<std::pair<uint64_t, uint64_t>> out;
  if (m.marks.empty() || begin >= end) return out;
  // The last mark at or before `begin`: no document before it starts in the range.
  const size_t j = std::upper_bound(m.marks.begin(), m.marks.end(), begin) - m.marks.begin() - 1;
  uint64_t at = m.marks[j], k = j * m.mark_stride, seq = document(k);
  for (; k < m.documents && at < end; ++k) {
    const uint64_t first = seq, last = document(k + 1);
    if (last < first) changed(concat("document_indices[", k + 1, "] = ", last));
    uint64_t n = 0;
    for (; seq < last; ++seq) n += sequence(seq).count;
    if (n > 0 && at >= begin) out.emplace_back(first, last);
    at += n;
  }
  return out;
}

// ---- memory maps -------------------------------------------------------------------------------

MappedFile::MappedFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw UsageError(concat(path, ": cannot open for reading: ", std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    throw UsageError(path + ": cannot stat");
  }
  size_ = static_cast<uint64_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      throw UsageError(concat(path, ": cannot map: ", std::strerror(errno)));
    }
    ::madvise(p, size_, MADV_SEQUENTIAL);
    data_ = static_cast<const unsigned char*>(p);
  }
  ::close(fd);  // the mapping keeps the file
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<unsigned char*>(data_), size_);
}

// ---- scans -------------------------------------------------------------------------------------

std::vector<uint64_t> scan_tokens(const TokenView& v, uint64_t begin, uint64_t end,
                                  int64_t vocab_size, int64_t eot, const std::string& path) {
  std::vector<uint64_t> eots;
  with_type(v.dtype, [&](auto zero) {
    using T = decltype(zero);
    for (uint64_t i = begin; i < end; ++i) {
      const T t = load<T>(v.data, i);
      if constexpr (std::is_signed_v<T>) {
        if (t < 0)
          throw UsageError(
              concat(path, ": token ", int64_t{t}, " at position ", i, " is negative"));
      }
      const auto u = static_cast<uint64_t>(t);
      if (u >= static_cast<uint64_t>(vocab_size))
        throw UsageError(
            concat(path, ": token ", u, " at position ", i, " is >= vocab_size ", vocab_size));
      if (u == static_cast<uint64_t>(eot)) eots.push_back(i);
    }
  });
  return eots;
}

uint64_t next_eot(const TokenView& v, uint64_t from, int64_t eot) {
  return with_type(v.dtype, [&](auto zero) {
    using T = decltype(zero);
    for (uint64_t i = from; i < v.count; ++i)
      if (static_cast<uint64_t>(load<T>(v.data, i)) == static_cast<uint64_t>(eot)) return i;
    return v.count;
  });
}

void copy_tokens(const TokenView& v, uint64_t begin, uint64_t end, uint32_t* dst) {
  with_type(v.dtype, [&](auto zero) {
    using T = decltype(zero);
    for (uint64_t i = begin; i < end; ++i) *dst++ = static_cast<uint32_t>(load<T>(v.data, i));
  });
}

void count_tokens(const TokenView& v, uint64_t begin, uint64_t end, uint64_t* counts) {
  with_type(v.dtype, [&](auto zero) {
    using T = decltype(zero);
    for (uint64_t i = begin; i < end; ++i) ++counts[static_cast<uint64_t>(load<T>(v.data, i))];
  });
}

}  // namespace mpitrain
