// libFuzzer target: the token-array files `mpitrain pack` reads (nanoGPT and llm.c .bin, numpy
// .npy: read_token_layout, then the tokens through a memory map as pack copies them) and the .npy
// headers model.init_from's weights have (read_npy_header).
//
// Input: a format byte (0: nanoGPT, 1: llm.c, 2: .npy as tokens, 3: .npy header of fp32 weights),
// then the file's bytes. Oracle: only UsageError escapes, naming the file; an accepted layout lies
// inside the file (offset + count x dtype = the file's size, count > 0), and every token it names
// is read (copy_tokens, count_tokens, scan_tokens under ASan) without touching a byte outside the
// map; scan_tokens' EOT positions are exactly those holding the EOT id; an accepted .npy header's
// data offset is within the file and its shape's element count does not overflow.
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "harness.h"
#include "mpitrain/error.h"
#include "mpitrain/importers.h"

using namespace mpitrain;

const char* const kFuzzTarget = "fuzz_token_files";

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = make_scratch_dir();
  if (size == 0) return 0;
  const int kind = data[0] % 4;
  const std::string path = dir + (kind == 0 ? "/t.bin" : kind == 1 ? "/l.bin" : "/a.npy");
  const std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  try {
    if (kind == 3) {
      const NpyHeader h = read_npy_header(path, "'<f4'");
      if (h.data_offset > h.file_size || h.file_size != bytes.size()) bug("npy header offset outside the file");
      uint64_t n = 1;
      for (uint64_t d : h.shape)
        if (d != 0 && n > UINT64_MAX / d) n = UINT64_MAX; else n *= d;
      (void)npy_shape_text(h.shape);
      return 0;
    }
    const InputFormat format = kind == 0 ? InputFormat::nanogpt : kind == 1 ? InputFormat::llmc : InputFormat::npy;
    const TokenLayout t = read_token_layout(path, format);
    if (t.count == 0 || t.offset > bytes.size() || t.count > (bytes.size() - t.offset) / dtype_bytes(t.dtype) ||
        t.offset + t.count * dtype_bytes(t.dtype) != bytes.size())
      bug(concat("layout outside the file: offset ", t.offset, " count ", t.count, " of ", bytes.size(), " bytes"));
    MappedFile map(path);
    const TokenView v{map.data() + t.offset, t.dtype, t.count};
    std::vector<uint32_t> copied(t.count);
    copy_tokens(v, 0, t.count, copied.data());
    const int64_t vocab = int64_t{1} << 32;
    std::vector<uint64_t> counts;
    try {
      const int64_t eot = copied[0];
      const std::vector<uint64_t> eots = scan_tokens(v, 0, t.count, vocab, eot, path);
      std::vector<uint64_t> want;
      for (uint64_t i = 0; i < t.count; ++i)
        if (copied[i] == static_cast<uint32_t>(eot)) want.push_back(i);
      if (eots != want) bug("scan_tokens' EOT positions differ from the copied tokens'");
      if (next_eot(v, 0, eot) != 0) bug("next_eot does not find the first token");
    } catch (const UsageError&) {
      // negative tokens of signed dtypes: refused by name
    }
    if (t.count <= 4096) {  // counts has vocab entries: bound the vocabulary to the tokens seen
      uint32_t top = 0;
      for (uint32_t x : copied) top = std::max(top, x);
      if (top < (1u << 16)) {
        counts.assign(top + 1, 0);
        try {
          (void)scan_tokens(v, 0, t.count, top + 1, -1, path);
          count_tokens(v, 0, t.count, counts.data());
          uint64_t total = 0;
          for (uint64_t c : counts) total += c;
          if (total != t.count) bug("count_tokens lost tokens");
        } catch (const UsageError&) {
        }
      }
    }
  } catch (const UsageError& e) {
    if (std::string(e.what()).rfind(path + ": ", 0) != 0) bug(concat("an error that does not name the file: ", e.what()));
  } catch (const std::exception& e) {
    bug(concat("not a UsageError: ", e.what()));
  }
  return 0;
}
