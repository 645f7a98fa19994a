// The plan of `mpitrain pack` (rank 0, then broadcast) and each rank's share of the input.
#include "mpitrain/pack_plan.h"
#include "mpitrain/mpi_native.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <filesystem>
#include <set>
#include <system_error>

#include <nlohmann/json.hpp>

#include "mpitrain/error.h"

namespace mpitrain {

namespace fs = std::filesystem;

namespace {

// The vocabulary: the text tokenizer's when there is text; for token arrays alone the options',
// defaulting to the named tokenizer's, else GPT-2's. An explicit option that contradicts the
// tokenizer is an error rather than a silent override.
// A tokenizer.json: the vocabulary and its SHA-256 from the file; the document separator from the
// file unless --eot names one.
void resolve_hf(const PackOptions& o, TextTokenizer& t, ShardMeta& m) {
  t.hf.emplace(o.tokenizer_file);
  m.vocab_size = t.hf->vocab_size();
  m.tokenizer_file = o.tokenizer_file;
  m.tokenizer_sha256 = t.hf->sha256();
  m.special_tokens = o.special_tokens == "match" ? "match" : "";
  if (o.eot_token != -1) {
    if (o.eot_token >= m.vocab_size)
      throw UsageError(concat("pack: --eot ", o.eot_token, " not in [0, vocab size ", m.vocab_size, ")"));
    // An ordinary token as the separator would make every occurrence of it in the text a document
    // boundary (--eot 5 is '&' in GPT-2's vocabulary): it must be one of the added tokens.
    const auto id = static_cast<uint32_t>(o.eot_token);
    if (!t.hf->is_added_token(id)) {
      const auto sep = t.hf->separator();
      // A token's bytes as a JSON string: escaped, one line, whatever bytes it holds.
      auto shown = [&](uint32_t i) {
        return nlohmann::json(t.hf->decode({i})).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      };
      throw UsageError(concat("pack: --eot ", o.eot_token, " is ", shown(id), ", an ordinary token of ", o.tokenizer_file,
                              ", not one of its added_tokens: a document separator must be a special token",
                              sep ? concat(" (its own: ", *sep, " ", shown(*sep), ", used when --eot is not given)")
                                  : std::string()));
    }
    m.eot_token = o.eot_token;
  } else if (auto sep = t.hf->separator()) {
    m.eot_token = *sep;
  } else {
    throw UsageError(o.tokenizer_file +
                     ": no document separator token (no special token first in post_processor's "
                     "TemplateProcessing, no <|begin_of_text|>, <|endoftext|> or <|end_of_text|>): "
                     "name one with --eot ID");
  }
}

void resolve_vocab(const PackOptions& o, bool has_text, TextTokenizer& t, ShardMeta& m) {
  const std::string& tok = o.tokenizer;
  if (!tok.empty() && tok != "byte" && tok != "gpt2" && tok != "hf")
    throw UsageError("pack: --tokenizer '" + tok + "' is not byte, gpt2 or hf");
  if (tok == "hf" && o.tokenizer_file.empty())
    throw UsageError("pack: the hf tokenizer needs --tokenizer-file tokenizer.json");
  if (tok != "hf" && !o.tokenizer_file.empty())
    throw UsageError("pack: --tokenizer-file is read by --tokenizer hf only");
  const bool fixed = has_text || !tok.empty();
  if (fixed) {
    m.tokenizer = tok.empty() ? "byte" : tok;
    if (m.tokenizer == "byte") {
      m.vocab_size = kByteVocab;
      m.eot_token = kByteEot;
    } else if (m.tokenizer == "hf") {
      resolve_hf(o, t, m);
    } else if (has_text) {
      t.gpt2 = load_bpe(o);
      m.vocab_size = t.gpt2->vocab_size();
      m.eot_token = t.gpt2->eot_token();
    } else {
      m.vocab_size = kGpt2Vocab;  // token arrays alone: the ids need no BPE files
      m.eot_token = kGpt2Eot;
    }
    if (o.vocab_size != 0 && o.vocab_size != m.vocab_size)
      throw UsageError(concat("pack: --vocab-size ", o.vocab_size, " contradicts the ", m.tokenizer,
                              " tokenizer's ", m.vocab_size));
    if (o.eot_token != -1 && o.eot_token != m.eot_token && m.tokenizer != "hf")
      throw UsageError(concat("pack: --eot ", o.eot_token, " contradicts the ", m.tokenizer,
                              " tokenizer's ", m.eot_token));
    return;
  }
  m.vocab_size = o.vocab_size != 0 ? o.vocab_size : kGpt2Vocab;
  m.eot_token = o.eot_token != -1 ? o.eot_token : kGpt2Eot;
  if (m.vocab_size < 1 || m.vocab_size > (int64_t{1} << 32))
    throw UsageError(concat("pack: --vocab-size ", m.vocab_size, " not in [1, 2^32]"));
  if (m.eot_token < 0 || m.eot_token >= m.vocab_size)
    throw UsageError(
        concat("pack: --eot ", m.eot_token, " not in [0, vocab size ", m.vocab_size, ")"));
  const bool gpt2 = m.vocab_size == kGpt2Vocab && m.eot_token == kGpt2Eot;
  m.tokenizer = gpt2 ? "gpt2" : "unknown";
}

}  // namespace

// ---- the plan ----------------------------------------------------------------------------------

std::optional<Gpt2Bpe> load_bpe(const PackOptions& o) {
  if (!o.bpe_dir.empty() && (!o.bpe_vocab.empty() || !o.bpe_merges.empty()))
    throw UsageError("pack: give --bpe-dir or --vocab and --merges, not both");
  if (!o.bpe_dir.empty()) return Gpt2Bpe(find_bpe_files(o.bpe_dir));
  if (o.bpe_vocab.empty() || o.bpe_merges.empty())
    throw UsageError(
        "pack: the gpt2 tokenizer needs --bpe-dir DIR or both --vocab FILE and --merges FILE");
  return Gpt2Bpe(BpeFiles{o.bpe_vocab, o.bpe_merges});
}

void TextTokenizer::encode(std::string_view text, std::vector<uint32_t>& out) {
  if (gpt2)
    gpt2->encode(text, out);
  else if (hf)
    hf->encode(text, out);
  else
    for (unsigned char c : text) out.push_back(c);
}

void load_text_tokenizer(const PackOptions& o, const ShardMeta& meta, TextTokenizer& tok) {
  if (meta.tokenizer == "gpt2" && !tok.gpt2) tok.gpt2 = load_bpe(o);
  if (meta.tokenizer == "hf" && !tok.hf) {
    tok.hf.emplace(meta.tokenizer_file);
    if (tok.hf->sha256() != meta.tokenizer_sha256)
      throw UsageError(concat(meta.tokenizer_file, ": changed while packing (SHA-256 ", tok.hf->sha256(),
                              ", rank 0 read ", meta.tokenizer_sha256, ")"));
  }
}

PackPlan make_pack_plan(const PackOptions& o, TextTokenizer& tok) {
  if (o.inputs.empty()) throw UsageError("pack: no inputs given");
  if (o.output_prefix.empty()) throw UsageError("pack: output prefix is empty");
  if (!(o.val_fraction >= 0.0 && o.val_fraction < 1.0))
    throw UsageError(concat("pack: val_fraction ", o.val_fraction, " not in [0, 1)"));
  // (an upper bound too: a negative number wrapped to 2^64 - 1 would make zero shards)
  if (o.shard_tokens == 0 || o.shard_tokens > (uint64_t{1} << 40))
    throw UsageError(concat("pack: shard_tokens must be > 0 and at most 2^40, got ", o.shard_tokens));
  const bool automatic = o.format.empty() || o.format == "auto";
  const InputFormat forced = automatic ? InputFormat::text : parse_format(o.format);

  // A Megatron dataset may be named by its PREFIX, which is no file; its .bin and .idx (both
  // found in a directory, or both named) are one input.
  std::vector<std::string> inputs = o.inputs;
  if (automatic || forced == InputFormat::megatron)
    for (std::string& in : inputs) in = resolve_megatron_input(in);
  std::set<std::string> megatron_seen;

  PackPlan plan;
  std::array<int, 6> per_format{};
  for (std::string& path : collect_input_files(inputs)) {
    PackInput f;
    f.format = automatic ? detect_format(path) : forced;
    if (f.format == InputFormat::megatron) {
      path = megatron_prefix(path);
      if (!megatron_seen.insert(path).second) continue;
    }
    if (is_text_like(f.format)) {
      std::error_code ec;
      f.bytes = fs::file_size(path, ec);
      if (ec) throw UsageError(concat(path, ": cannot stat: ", ec.message()));
    } else {
      f.layout = read_token_layout(path, f.format);
      f.bytes = f.layout.count * dtype_bytes(f.layout.dtype);
    }
    f.path = std::move(path);
    ++per_format[static_cast<int>(f.format)];
    plan.files.push_back(std::move(f));
  }
  resolve_vocab(o, per_format[0] + per_format[4] > 0, tok, plan.meta);

  std::string names, counts;
  for (const std::string& in : o.inputs) names += (names.empty() ? "" : ", ") + in;
  if (names.size() > 400) names = names.substr(0, 400) + "...";
  for (int k = 0; k < static_cast<int>(per_format.size()); ++k)
    if (per_format[k] > 0)
      counts += concat(counts.empty() ? "" : ", ", per_format[k], " ",
                       format_name(static_cast<InputFormat>(k)));
  plan.meta.source =
      concat("mpitrain pack ", names, ": ", plan.files.size(), " files (", counts, ")");

  fs::path dir = fs::path(o.output_prefix).parent_path();
  if (!dir.empty()) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec)
      throw UsageError(concat(dir.string(), ": cannot create output directory: ", ec.message()));
  }
  return plan;
}

// ---- broadcast ---------------------------------------------------------------------------------

// The plan as bytes: rank 0 serializes, the others parse.
void broadcast_pack_plan(PackPlan& plan, MpiComm comm_handle) {
  const MPI_Comm comm = to_mpi(comm_handle);
  int rank = 0;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  std::string buf;
  auto put = [&](uint64_t v) { buf.append(reinterpret_cast<const char*>(&v), sizeof v); };
  auto put_str = [&](const std::string& s) {
    put(s.size());
    buf += s;
  };
  if (rank == 0) {
    put(plan.files.size());
    for (const PackInput& f : plan.files) {
      put_str(f.path);
      for (uint64_t v : {static_cast<uint64_t>(f.format), f.bytes,
                         static_cast<uint64_t>(f.layout.dtype), f.layout.offset, f.layout.count})
        put(v);
      const MegatronLayout& m = f.layout.megatron;
      for (uint64_t v : {m.sequences, m.documents, m.idx_bytes, m.bin_bytes, m.mark_stride,
                         static_cast<uint64_t>(m.marks.size())})
        put(v);
      for (uint64_t v : m.marks) put(v);
    }
    put(static_cast<uint64_t>(plan.meta.vocab_size));
    put(static_cast<uint64_t>(plan.meta.eot_token));
    put_str(plan.meta.tokenizer);
    put_str(plan.meta.source);
    put_str(plan.meta.tokenizer_file);
    put_str(plan.meta.tokenizer_sha256);
    put_str(plan.meta.special_tokens);
  }
  uint64_t len = buf.size();
  MPI_CHECK(MPI_Bcast(&len, 1, MPI_UINT64_T, 0, comm));
  if (len > INT_MAX) throw Error("pack: the input list is too large to broadcast");
  buf.resize(len);
  MPI_CHECK(MPI_Bcast(buf.data(), static_cast<int>(len), MPI_BYTE, 0, comm));
  if (rank == 0) return;
  size_t pos = 0;
  auto get = [&] {
    uint64_t v;
    std::memcpy(&v, buf.data() + pos, sizeof v);
    pos += sizeof v;
    return v;
  };
  auto get_str = [&] {
    const uint64_t n = get();
    std::string s = buf.substr(pos, n);
    pos += n;
    return s;
  };
  plan.files.resize(get());
  for (PackInput& f : plan.files) {
    f.path = get_str();
    f.format = static_cast<InputFormat>(get());
    f.bytes = get();
    f.layout.dtype = static_cast<Dtype>(get());
    f.layout.offset = get();
    f.layout.count = get();
    MegatronLayout& m = f.layout.megatron;
    m.sequences = get();
    m.documents = get();
    m.idx_bytes = get();
    m.bin_bytes = get();
    m.mark_stride = get();
    m.marks.resize(get());
    for (uint64_t& v : m.marks) v = get();
  }
  plan.meta.vocab_size = static_cast<int64_t>(get());
  plan.meta.eot_token = static_cast<int64_t>(get());
  plan.meta.tokenizer = get_str();
  plan.meta.source = get_str();
  plan.meta.tokenizer_file = get_str();
  plan.meta.tokenizer_sha256 = get_str();
  plan.meta.special_tokens = get_str();
}

// ---- this rank's share -------------------------------------------------------------------------

std::vector<PackRange> pack_ranges(const PackPlan& plan, int rank, int world) {
  uint64_t total = 0;
  for (const PackInput& f : plan.files) total += f.bytes;
  const auto P = static_cast<unsigned __int128>(world);
  auto rank_of = [&](uint64_t x) {
    if (total == 0) return 0;
    return static_cast<int>(std::min<unsigned __int128>(P - 1, x * P / total));
  };
  auto first_byte_of = [&](int r) {  // ceil(r * total / world): the first byte of rank r
    return static_cast<uint64_t>((r * static_cast<unsigned __int128>(total) + P - 1) / P);
  };
  std::vector<PackRange> out;
  uint64_t g = 0;
  for (size_t i = 0; i < plan.files.size(); ++i) {
    const PackInput& f = plan.files[i];
    if (is_text_like(f.format)) {
      if (rank_of(g + f.bytes / 2) == rank) out.push_back({i, 0, 0});
    } else {
      const uint64_t item = dtype_bytes(f.layout.dtype);
      auto first_token_of = [&](int r) -> uint64_t {
        if (r >= world) return f.layout.count;
        const uint64_t x = first_byte_of(r);
        return x <= g ? 0 : std::min(f.layout.count, (x - g + item - 1) / item);
      };
      const uint64_t b = rank == 0 ? 0 : first_token_of(rank), e = first_token_of(rank + 1);
      if (b < e) out.push_back({i, b, e});
    }
    g += f.bytes;
  }
  return out;
}

}  // namespace mpitrain
