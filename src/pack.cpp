// `mpitrain pack`: walks text inputs, splits them into documents, assigns each document to train
// or val by a seeded hash, and writes byte-tokenized shards of at most shard_tokens tokens.
#include "mpitrain/pack.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>

#include "mpitrain/error.h"
#include "mpitrain/shards.h"

namespace mpitrain {

namespace fs = std::filesystem;

namespace {

// ---- inputs ------------------------------------------------------------------------------------

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Every input file in a deterministic order: inputs as given, each directory's regular files
// sorted. Walks skip symlinks (no loops, no escaping the tree) and *.dat files (the strfile
// indexes that sit beside fortune files). A file named explicitly is always taken.
std::vector<std::string> collect_files(const std::vector<std::string>& inputs) {
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

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(path + ": cannot open for reading");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw UsageError(path + ": read error");
  return text;
}

bool blank(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  });
}

// Splits on lines that are exactly `sep` (a trailing '\r' is tolerated so CRLF files split too).
// Each document keeps its bytes, newlines included; blank documents are dropped.
std::vector<std::string> split_documents(const std::string& text, const std::string& sep) {
  std::vector<std::string> docs;
  auto add = [&](size_t from, size_t to) {
    std::string doc = text.substr(from, to - from);
    if (!blank(doc)) docs.push_back(std::move(doc));
  };
  if (sep.empty()) {
    add(0, text.size());
    return docs;
  }
  size_t doc_start = 0, line_start = 0;
  while (line_start < text.size()) {
    size_t nl = text.find('\n', line_start);
    size_t line_end = nl == std::string::npos ? text.size() : nl;
    size_t next = nl == std::string::npos ? text.size() : nl + 1;
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

// ---- split choice ------------------------------------------------------------------------------

uint64_t fmix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A uniform [0, 1) number from (seed, document index): the same corpus and seed always give the
// same split, whatever the shard size.
double unit_hash(uint64_t seed, uint64_t k) {
  uint64_t h = fmix(seed ^ fmix(k + 0x9E3779B97F4A7C15ull));
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

// ---- one split's shards ------------------------------------------------------------------------

class SplitWriter {
 public:
  SplitWriter(std::string prefix, std::string split, uint64_t shard_tokens, ShardMeta meta)
      : prefix_(std::move(prefix)), split_(std::move(split)), limit_(shard_tokens),
        meta_(std::move(meta)) {}

  // EOT then the document's bytes; a document longer than the room left continues in the next
  // shard (its offset is recorded where its EOT lands).
  void add(const std::string& doc) {
    if (tokens_.size() >= limit_) flush();
    offsets_.push_back(tokens_.size());
    tokens_.push_back(static_cast<uint32_t>(kByteEot));
    ++counts_[kByteEot];
    for (unsigned char c : doc) ++counts_[c];
    size_t pos = 0;
    while (pos < doc.size()) {
      if (tokens_.size() >= limit_) flush();
      size_t take = std::min<size_t>(doc.size() - pos, limit_ - tokens_.size());
      for (size_t i = 0; i < take; ++i)
        tokens_.push_back(static_cast<unsigned char>(doc[pos + i]));
      pos += take;
    }
    total_ += doc.size() + 1;
    ++docs_;
  }

  // Writes the last partial shard, then removes higher-numbered shards left by an earlier, larger
  // pack into the same prefix, so a glob over the prefix never mixes two corpora.
  void finish() {
    if (!tokens_.empty()) flush();
    for (size_t i = paths_.size();; ++i) {
      std::error_code ec;
      if (!fs::remove(path(i), ec)) break;
    }
  }

  const std::vector<std::string>& paths() const { return paths_; }
  uint64_t tokens() const { return total_; }
  uint64_t documents() const { return docs_; }

  // Entropy of the token frequencies in nats: the loss of the best model that ignores context,
  // the bar a trained model's loss has to go well below.
  double unigram_entropy() const {
    double h = 0;
    for (uint64_t c : counts_)
      if (c > 0) {
        const double p = static_cast<double>(c) / static_cast<double>(total_);
        h -= p * std::log(p);
      }
    return h;
  }

 private:
  std::string path(size_t index) const {
    char num[32];
    std::snprintf(num, sizeof num, "%05zu", index);
    return prefix_ + "-" + split_ + "-" + num + ".h5";
  }

  void flush() {
    std::string p = path(paths_.size());
    write_shard(p, tokens_, offsets_, meta_);
    paths_.push_back(std::move(p));
    tokens_.clear();
    offsets_.clear();
  }

  std::string prefix_, split_;
  uint64_t limit_;
  ShardMeta meta_;
  std::vector<uint32_t> tokens_;
  std::vector<uint64_t> offsets_;
  std::vector<std::string> paths_;
  uint64_t total_ = 0, docs_ = 0;
  std::array<uint64_t, kByteVocab> counts_{};
};

}  // namespace

// ---- pack_text ---------------------------------------------------------------------------------

PackResult pack_text(const PackOptions& opts) {
  if (opts.inputs.empty()) throw UsageError("pack: no inputs given");
  if (opts.output_prefix.empty()) throw UsageError("pack: output prefix is empty");
  if (!(opts.val_fraction >= 0.0 && opts.val_fraction < 1.0))
    throw UsageError(concat("pack: val_fraction ", opts.val_fraction, " not in [0, 1)"));
  if (opts.shard_tokens == 0) throw UsageError("pack: shard_tokens must be > 0");

  const std::vector<std::string> files = collect_files(opts.inputs);

  fs::path dir = fs::path(opts.output_prefix).parent_path();
  if (!dir.empty()) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw UsageError(concat(dir.string(), ": cannot create output directory: ", ec.message()));
  }

  ShardMeta meta;
  meta.vocab_size = kByteVocab;
  meta.eot_token = kByteEot;
  meta.tokenizer = "byte";
  meta.source = concat("pack_text: ", files.size(), " files");
  SplitWriter train(opts.output_prefix, "train", opts.shard_tokens, meta);
  SplitWriter val(opts.output_prefix, "val", opts.shard_tokens, meta);

  // Each document is routed one step late, so that the last one can still be redirected: tiny
  // corpora whose hashes sent nothing to val get the last document as their val split (and a
  // corpus whose documents all hashed to val keeps its last one for train).
  std::string pending;
  bool have_pending = false, pending_val = false;
  uint64_t k = 0;
  for (const std::string& file : files) {
    for (std::string& doc : split_documents(read_file(file), opts.doc_separator)) {
      if (have_pending) (pending_val ? val : train).add(pending);
      pending = std::move(doc);
      have_pending = true;
      pending_val = unit_hash(opts.seed, k++) < opts.val_fraction;
    }
  }
  if (!have_pending) {
    std::string names;
    for (const std::string& in : opts.inputs) names += (names.empty() ? "" : ", ") + in;
    throw UsageError(names + ": no documents (every input file is empty or blank)");
  }
  if (train.documents() == 0)
    pending_val = false;
  else if (opts.val_fraction > 0 && val.documents() == 0)
    pending_val = true;
  (pending_val ? val : train).add(pending);
  train.finish();
  val.finish();

  PackResult r;
  r.train_shards = train.paths();
  r.val_shards = val.paths();
  r.documents = k;
  r.train_tokens = train.tokens();
  r.val_tokens = val.tokens();
  r.train_unigram_entropy = train.unigram_entropy();
  return r;
}

}  // namespace mpitrain
