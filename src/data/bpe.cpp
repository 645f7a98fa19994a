// GPT-2 byte-level BPE (OpenAI's encoder.py): file loading and validation, the pre-tokenizer
// regex, encoding and decoding. Merging and the byte alphabet are shared with the Hugging Face
// tokenizer (bpe_merge.h).
#include "mpitrain/bpe.h"

#include <cctype>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "mpitrain/bpe_merge.h"

namespace mpitrain {

namespace fs = std::filesystem;

// ---- locating the files ------------------------------------------------------------------------

BpeFiles find_bpe_files(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw UsageError(dir + ": not a directory (--bpe-dir)");
  for (auto [v, m] :
       {std::pair{"vocab.json", "merges.txt"}, std::pair{"encoder.json", "vocab.bpe"}}) {
    fs::path vocab = fs::path(dir) / v, merges = fs::path(dir) / m;
    if (fs::exists(vocab, ec) && fs::exists(merges, ec)) return {vocab.string(), merges.string()};
  }
  throw UsageError(dir +
                   ": no GPT-2 BPE files (expected vocab.json + merges.txt or encoder.json + "
                   "vocab.bpe)");
}

// ---- state -------------------------------------------------------------------------------------

struct Gpt2Bpe::Impl {
  std::vector<std::string> token_bytes;  // id -> the bytes it stands for
  bpe::Merger merger{bpe::Merger::Order::rounds};
  bpe::Pattern re{bpe::gpt2_pattern(), "GPT-2 pattern"};
  int64_t vocab_size = 0, eot = -1;

  void load_vocab(const std::string& path, std::unordered_map<std::string, uint32_t>& ids);
  void load_merges(const std::string& path, const std::unordered_map<std::string, uint32_t>& ids);
};

// ---- loading -----------------------------------------------------------------------------------

void Gpt2Bpe::Impl::load_vocab(const std::string& path,
                               std::unordered_map<std::string, uint32_t>& ids) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(bpe::read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw UsageError(concat(path, ": malformed JSON: ", e.what()));
  }
  if (!j.is_object() || j.empty())
    throw UsageError(path + ": expected a JSON object {\"token\": id, ...}");
  std::vector<std::string> by_id;
  for (auto& [token, value] : j.items()) {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() >= (1 << 30))
      throw UsageError(concat(path, ": id of token '", token, "' is ", value.dump(),
                              ", expected an integer in [0, 2^30)"));
    const auto id = value.get<uint32_t>();
    if (id >= by_id.size()) by_id.resize(id + 1);
    if (!by_id[id].empty())
      throw UsageError(
          concat(path, ": id ", id, " given to both '", by_id[id], "' and '", token, "'"));
    if (token.empty()) throw UsageError(path + ": empty token string");
    by_id[id] = token;
    ids.emplace(token, id);
  }
  vocab_size = static_cast<int64_t>(by_id.size());
  auto eot_it = ids.find("<|endoftext|>");
  if (eot_it == ids.end()) throw UsageError(path + ": no '<|endoftext|>' token");
  eot = eot_it->second;

  // The bytes of each token, to decode ids; characters outside the byte alphabet (added tokens of
  // other vocabularies) stay as they are.
  token_bytes.resize(by_id.size());
  for (size_t id = 0; id < by_id.size(); ++id) token_bytes[id] = bpe::symbol_bytes(by_id[id]);

  // Symbols 0..255 are the single bytes: a piece starts as its bytes' symbol ids.
  for (int b = 0; b < 256; ++b) {
    const std::string s = bpe::byte_symbol(static_cast<unsigned char>(b));
    auto it = ids.find(s);
    if (it == ids.end())
      throw UsageError(concat(path, ": the symbol for byte ", b, " ('", s, "') is missing"));
    merger.set_token(static_cast<uint32_t>(b), it->second);
  }
}

void Gpt2Bpe::Impl::load_merges(const std::string& path,
                                const std::unordered_map<std::string, uint32_t>& ids) {
  const std::string text = bpe::read_file(path);
  size_t line_start = 0, line_no = 0;
  uint32_t rank = 0;
  while (line_start < text.size()) {
    size_t nl = text.find('\n', line_start);
    if (nl == std::string::npos) nl = text.size();
    std::string line = text.substr(line_start, nl - line_start);
    line_start = nl + 1;
    ++line_no;
    if (line_no == 1 && line.rfind("#version", 0) == 0) continue;
    // Fields split on whitespace like Python's str.split() (a CRLF file works too).
    std::vector<std::string> f;
    for (size_t i = 0; i < line.size();) {
      while (i < line.size() && std::isspace(static_cast<unsigned char>(line[i]))) ++i;
      size_t j = i;
      while (j < line.size() && !std::isspace(static_cast<unsigned char>(line[j]))) ++j;
      if (j > i) f.push_back(line.substr(i, j - i));
      i = j;
    }
    if (f.empty()) continue;
    if (f.size() != 2)
      throw UsageError(concat(path, ": line ", line_no,
                              ": expected two symbols separated by a "
                              "space, got '",
                              line, "'"));
    const uint32_t left = merger.symbol(f[0]), right = merger.symbol(f[1]);
    const std::string joined = f[0] + f[1];
    const uint32_t result = merger.symbol(joined);
    auto it = ids.find(joined);
    if (it == ids.end())
      throw UsageError(concat(path, ": line ", line_no, ": merged symbol '", joined,
                              "' is not in the vocabulary"));
    merger.set_token(result, it->second);
    merger.add_merge(left, right, result, rank++);  // a repeat wins, as dict(zip())
  }
  if (rank == 0) throw UsageError(path + ": no merges");
}

Gpt2Bpe::Gpt2Bpe(const BpeFiles& files) : impl_(std::make_unique<Impl>()) {
  std::unordered_map<std::string, uint32_t> ids;
  impl_->load_vocab(files.vocab, ids);
  impl_->load_merges(files.merges, ids);
}

Gpt2Bpe::~Gpt2Bpe() = default;
Gpt2Bpe::Gpt2Bpe(Gpt2Bpe&&) noexcept = default;
Gpt2Bpe& Gpt2Bpe::operator=(Gpt2Bpe&&) noexcept = default;

int64_t Gpt2Bpe::vocab_size() const { return impl_->vocab_size; }
int64_t Gpt2Bpe::eot_token() const { return impl_->eot; }

// ---- encode / decode ---------------------------------------------------------------------------

std::vector<uint32_t> Gpt2Bpe::encode(std::string_view text) {
  std::vector<uint32_t> out;
  encode(text, out);
  return out;
}

void require_utf8(std::string_view text) {
  if (const size_t bad = bpe::find_invalid_utf8(text); bad != std::string_view::npos)
    throw InvalidUtf8(bad, concat("invalid UTF-8 at byte ", bad));
}

void Gpt2Bpe::encode(std::string_view text, std::vector<uint32_t>& out) {
  require_utf8(text);
  size_t begin = 0, end = 0;
  for (size_t pos = 0; pos < text.size(); pos = end) {
    // The alternatives cover every character, so there is always a non-empty match at pos.
    if (!impl_->re.find(text, pos, begin, end) || end <= pos)
      throw Error("GPT-2 pre-tokenizer: no match");
    impl_->merger.encode_piece(text.substr(begin, end - begin), out);
  }
}

std::string Gpt2Bpe::decode(const std::vector<uint32_t>& ids) const {
  std::string text;
  for (uint32_t id : ids) {
    if (id >= impl_->token_bytes.size())
      throw UsageError(concat("token ", id, " is >= vocab_size ", impl_->vocab_size));
    text += impl_->token_bytes[id];
  }
  return text;
}

}  // namespace mpitrain
