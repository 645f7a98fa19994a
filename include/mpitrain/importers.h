// `mpitrain pack`'s inputs: finding the files, cutting text into documents, and the token-array
// formats: nanoGPT .bin (headerless uint16), llm.c .bin (1024-byte header), numpy .npy (1-D
// integer arrays) and Megatron-LM's indexed datasets (PREFIX.bin + PREFIX.idx). Token arrays are
// memory-mapped, validated and copied out by token range, so a rank touches only its share of a
// large file. Every bad file is a UsageError naming it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mpitrain {

// ---- files and text documents ------------------------------------------------------------------

// Every input file in a deterministic order: inputs as given, each directory's regular files
// sorted. Walks skip symlinks and *.dat files (strfile indexes beside fortune files); a file named
// explicitly is always taken. Missing inputs and empty directories are UsageError.
std::vector<std::string> collect_input_files(const std::vector<std::string>& inputs);

std::string read_whole_file(const std::string& path);

// Only ASCII whitespace (or nothing): a blank document, which pack drops.
bool is_blank(std::string_view s);

// Documents of a text: the whole text, or the pieces between lines that are exactly `sep` (a
// trailing '\r' is tolerated). Blank documents are dropped. Each is (byte offset, length).
std::vector<std::pair<size_t, size_t>> split_documents(std::string_view text,
                                                       const std::string& sep);

// ---- token-array formats -----------------------------------------------------------------------

enum class InputFormat { text, nanogpt, llmc, npy, jsonl, megatron };
enum class Dtype { u8, i8, u16, i16, u32, i32, u64, i64 };

const char* format_name(InputFormat f);
// "auto" is not a format: see detect_format. Unknown names are a UsageError.
InputFormat parse_format(const std::string& name);
size_t dtype_bytes(Dtype d);

constexpr int32_t kLlmcMagicV1 = 20240520;   // version 1: uint16 tokens (GPT-2)
constexpr int32_t kLlmcMagicV7 = 20240801;   // version 7: uint32 tokens (Llama 3)
constexpr uint64_t kLlmcHeaderBytes = 1024;  // 256 int32; [0] magic, [1] version, [2] count

// Format by name: *.npy is npy, *.jsonl is jsonl, *.idx is Megatron, *.bin is Megatron when a
// *.idx of the same name is beside it, else llm.c when it starts with an llm.c magic and nanoGPT
// otherwise, *.h5 / *.hdf5 are refused (UsageError), anything else is text.
InputFormat detect_format(const std::string& path);

// ---- Megatron-LM indexed datasets --------------------------------------------------------------

// PREFIX.idx: magic "MMIDIDX\0\0", uint64 version 1, uint8 dtype code, uint64 sequence count S,
// uint64 document_indices count D; then int32 sequence_lengths[S], int64 sequence_pointers[S]
// (byte offsets in PREFIX.bin), int64 document_indices[D] (0, ..., S: document k is the
// sequences [doc[k], doc[k + 1])), and optionally int8 sequence_modes[S] (multimodal; ignored).
// PREFIX.bin: the tokens of every sequence at its pointer.
constexpr uint64_t kMegatronHeaderBytes = 34;

// A Megatron input's PREFIX: the path without its .bin or .idx ending.
std::string megatron_prefix(const std::string& path);
// An input named by its Megatron PREFIX ("data/x": no such file, but data/x.idx or data/x.bin is
// there) stands for PREFIX.idx; any other input is returned as it is.
std::string resolve_megatron_input(const std::string& input);

// What every rank needs of a Megatron index besides the dtype and the token count: its counts
// and the two files' sizes (re-checked when a rank maps them), and marks that let a rank find the
// first document of its token range without summing every length before it.
struct MegatronLayout {
  uint64_t sequences = 0;  // S
  uint64_t documents = 0;  // D - 1
  uint64_t idx_bytes = 0, bin_bytes = 0;
  uint64_t mark_stride = 0;     // documents between marks
  std::vector<uint64_t> marks;  // marks[j]: tokens of the documents before document j * mark_stride
};

// Where a token array's tokens are in its file.
struct TokenLayout {
  Dtype dtype = Dtype::u16;
  uint64_t offset = 0;  // header bytes before the first token
  // tokens; Megatron: of all sequences, the file's token order being the documents' concatenated
  uint64_t count = 0;
  MegatronLayout megatron;  // megatron only
};

// Reads and checks a token file's header and size (not the tokens): llm.c magic, version and
// exact size; npy magic, version, dtype, order, 1-D shape and exact size; nanoGPT even size;
// Megatron (`path` is the PREFIX) the whole index against the .bin's size. Empty arrays are
// refused ("no tokens").
TokenLayout read_token_layout(const std::string& path, InputFormat format);

// ---- numpy .npy headers (token arrays here; model.init_from's weights: checkpoint.h) -----------

// A .npy file's header: magic "\x93NUMPY", version 1.0, 2.0 or 3.0, and the dict numpy writes,
// e.g. {'descr': '<f4', 'fortran_order': False, 'shape': (48, 16), }. Other keys are refused.
struct NpyHeader {
  std::string descr;           // numpy's dtype string: '<u2', '<f4', '|u1', ...
  bool fortran_order = false;
  std::vector<uint64_t> shape;
  uint64_t data_offset = 0;    // header bytes before the first element
  uint64_t file_size = 0;
};

// Reads and checks `path`'s header, not its data: a missing magic, an unsupported version, a
// truncated or malformed header and a structured dtype ("..., expected <wanted>") are UsageError
// naming the file.
NpyHeader read_npy_header(const std::string& path, const std::string& wanted);

// A shape as numpy prints it: "(48, 16)", "(5,)", "()".
std::string npy_shape_text(const std::vector<uint64_t>& shape);

// A read-only memory map of a whole file (empty files map nothing).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const unsigned char* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  const unsigned char* data_ = nullptr;
  uint64_t size_ = 0;
};

// A typed array of tokens in memory (a mapped file or a buffer); positions index tokens.
struct TokenView {
  const unsigned char* data = nullptr;
  Dtype dtype = Dtype::u16;
  uint64_t count = 0;
};

// A Megatron dataset mapped by a rank: the index read in place, the .bin as one token array.
class MegatronDataset {
 public:
  // Maps PREFIX.idx and PREFIX.bin; sizes other than the plan's are a UsageError (changed while
  // packing).
  MegatronDataset(const std::string& prefix, const TokenLayout& layout);
  // The whole .bin, positions indexing its tokens.
  TokenView tokens() const;
  // The documents holding at least one token whose first token is at [begin, end) of the file's
  // token order, each as its sequences [first, last). Documents of no tokens are left out.
  std::vector<std::pair<uint64_t, uint64_t>> documents_starting_in(uint64_t begin,
                                                                   uint64_t end) const;
  // Sequence i's tokens: [first, first + count) of tokens(). Checked again against the .bin (a
  // file rewritten in place since the plan must not make a rank read past its map).
  struct Span {
    uint64_t first, count;
  };
  Span sequence(uint64_t i) const;

 private:
  uint64_t document(uint64_t k) const;  // document_indices[k]
  [[noreturn]] void changed(const std::string& what) const;
  std::string prefix_;
  TokenLayout layout_;
  MappedFile idx_, bin_;
};

// Checks tokens [begin, end) are in [0, vocab_size) and returns the positions holding `eot`.
// A bad token is a UsageError "<path>: token 50300 at position 17 is >= vocab_size 50257" (or
// "... is negative"); positions count from the file's first token.
std::vector<uint64_t> scan_tokens(const TokenView& v, uint64_t begin, uint64_t end,
                                  int64_t vocab_size, int64_t eot, const std::string& path);
// The first position >= from holding `eot`, or v.count.
uint64_t next_eot(const TokenView& v, uint64_t from, int64_t eot);
// Tokens [begin, end) widened to uint32 (they are known to be < vocab_size <= 2^32).
void copy_tokens(const TokenView& v, uint64_t begin, uint64_t end, uint32_t* dst);
// Adds tokens [begin, end) into counts[token] (counts holds vocab_size entries).
void count_tokens(const TokenView& v, uint64_t begin, uint64_t end, uint64_t* counts);

}  // namespace mpitrain
