// `mpitrain pack`, collective over a communicator: rank 0 plans (walks the inputs, reads headers
// and Megatron indexes, resolves the tokenizer), every rank tokenizes a contiguous share of the
// input, documents are numbered globally (an exclusive scan) and split train/val by a hash of that
// number, and each shard — cut at fixed positions of the global token order — is written by
// exactly one rank, so the output is the same on any number of ranks.
#include "mpitrain/pack.h"
#include "mpitrain/mpi_native.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <system_error>

#include "mpitrain/bpe.h"
#include "mpitrain/error.h"
#include "mpitrain/hf_tokenizer.h"
#include "mpitrain/importers.h"
#include "mpitrain/jsonl.h"
#include "mpitrain/pack_plan.h"
#include "mpitrain/shards.h"

namespace mpitrain {

namespace fs = std::filesystem;

namespace {

constexpr int64_t kMaxDenseVocab = int64_t{1} << 22;  // counted for the entropy up to this size
constexpr uint64_t kChunk = uint64_t{1} << 28;        // tokens per MPI message (< 2^31 bytes)

// ---- agreement ---------------------------------------------------------------------------------

// Runs `phase` on every rank; if any rank threw UsageError, every rank throws the message of the
// lowest such rank (its input comes first, so the report does not depend on the world size).
void all_or_none(MPI_Comm comm, const std::function<void()>& phase) {
  std::string message;
  bool failed = false;
  try {
    phase();
  } catch (const UsageError& e) {
    message = e.what();
    failed = true;
  }
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  int mine = failed ? rank : INT_MAX, first = INT_MAX;
  MPI_CHECK(MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm));
  if (first == INT_MAX) return;
  mpi::broadcast(message, first, from_mpi(comm));
  throw UsageError(message);
}

// ---- split choice ------------------------------------------------------------------------------

uint64_t fmix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A uniform [0, 1) number from (seed, document index): the same corpus and seed always give the
// same split, whatever the shard size or the number of ranks.
double unit_hash(uint64_t seed, uint64_t k) {
  uint64_t h = fmix(seed ^ fmix(k + 0x9E3779B97F4A7C15ull));
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

// One range, loaded: its tokens and the documents it owns (those that start in it).
struct Unit {
  size_t file = 0;
  std::unique_ptr<MappedFile> map;  // token arrays
  std::vector<uint16_t> u16;        // text, tokenized: EOT + tokens per document
  std::vector<uint32_t> u32;        // (u32 when the vocabulary needs it)
  TokenView view;
  std::vector<uint64_t> starts;  // where each owned document starts
  uint64_t end = 0;              // where the last owned document ends

  // Megatron: the unit's positions are its documents, each the EOT and then its sequences' tokens,
  // read from the mapped .bin (`view`) where they lie rather than copied. Piece p covers positions
  // [pieces[p].at, pieces[p + 1].at) (the last one up to `end`): view's tokens from pieces[p].from
  // on, or the EOT alone when from is kEotPiece.
  static constexpr uint64_t kEotPiece = UINT64_MAX;
  struct Piece {
    uint64_t at, from;
  };
  std::unique_ptr<MegatronDataset> megatron;
  std::vector<Piece> pieces;
  uint32_t eot = 0;

  // Positions [begin, stop) into dst.
  void copy(uint64_t begin, uint64_t stop, uint32_t* dst) const {
    visit(
        begin, stop,
        [&](uint64_t b, uint64_t e) {
          copy_tokens(view, b, e, dst);
          dst += e - b;
        },
        [&] { *dst++ = eot; });
  }
  // Adds positions [begin, stop) into counts[token].
  void count(uint64_t begin, uint64_t stop, uint64_t* counts) const {
    visit(
        begin, stop, [&](uint64_t b, uint64_t e) { count_tokens(view, b, e, counts); },
        [&] { ++counts[eot]; });
  }

 private:
  // Calls tokens(b, e) for each stretch [b, e) of view within positions [begin, stop), and eot()
  // for each EOT piece, in order.
  template <class Tokens, class Eot>
  void visit(uint64_t begin, uint64_t stop, Tokens&& tokens, Eot&& eot_piece) const {
    if (pieces.empty()) {
      tokens(begin, stop);
      return;
    }
    size_t p = std::upper_bound(pieces.begin(), pieces.end(), begin,
                                [](uint64_t x, const Piece& q) { return x < q.at; }) -
               pieces.begin() - 1;
    for (; begin < stop; ++p) {
      const uint64_t e = std::min(stop, p + 1 < pieces.size() ? pieces[p + 1].at : end);
      if (pieces[p].from == kEotPiece)
        eot_piece();
      else
        tokens(pieces[p].from + (begin - pieces[p].at), pieces[p].from + (e - pieces[p].at));
      begin = e;
    }
  }
};

// A text file (documents per --doc-separator) or a JSON Lines file (one document per line), each
// document as EOT followed by its tokens.
void load_text(Unit& u, const PackInput& f, const PackOptions& o, const ShardMeta& meta,
               TextTokenizer& tok) {
  const bool narrow = meta.vocab_size <= 65536;
  std::vector<uint32_t> ids;
  auto add = [&](std::string_view doc) {
    ids.assign(1, static_cast<uint32_t>(meta.eot_token));
    tok.encode(doc, ids);
    u.starts.push_back(narrow ? u.u16.size() : u.u32.size());
    if (narrow)
      u.u16.insert(u.u16.end(), ids.begin(), ids.end());
    else
      u.u32.insert(u.u32.end(), ids.begin(), ids.end());
  };
  if (f.format == InputFormat::jsonl) {
    // The JSON parser has checked the text is UTF-8 (escapes included): encode cannot refuse it.
    read_jsonl(f.path, o.text_key, [&](std::string_view text, uint64_t) {
      if (!is_blank(text)) add(text);
    });
  } else {
    const std::string text = read_whole_file(f.path);
    for (auto [offset, length] : split_documents(text, o.doc_separator)) {
      try {
        add(std::string_view(text.data() + offset, length));
      } catch (const InvalidUtf8& e) {
        throw UsageError(concat(f.path, ": invalid UTF-8 at byte ", offset + e.offset, " (the ",
                                meta.tokenizer, " tokenizer reads UTF-8 text)"));
      }
    }
  }
  u.view = narrow ? TokenView{reinterpret_cast<const unsigned char*>(u.u16.data()), Dtype::u16,
                              u.u16.size()}
                  : TokenView{reinterpret_cast<const unsigned char*>(u.u32.data()), Dtype::u32,
                              u.u32.size()};
  u.end = u.view.count;
}

void load_tokens(Unit& u, const PackInput& f, const PackRange& r, const ShardMeta& meta) {
  u.map = std::make_unique<MappedFile>(f.path);
  const uint64_t need = f.layout.offset + f.layout.count * dtype_bytes(f.layout.dtype);
  if (u.map->size() != need)
    throw UsageError(concat(f.path, ": changed size while packing (", u.map->size(),
                            " bytes, expected ", need, ")"));
  u.view = TokenView{u.map->data() + f.layout.offset, f.layout.dtype, f.layout.count};
  // A document starts at every EOT; the tokens before a file's first EOT are a document too.
  const std::vector<uint64_t> eots =
      scan_tokens(u.view, r.begin, r.end, meta.vocab_size, meta.eot_token, f.path);
  if (r.begin == 0 && (eots.empty() || eots[0] != 0)) u.starts.push_back(0);
  u.starts.insert(u.starts.end(), eots.begin(), eots.end());
  // The last document runs on to the next EOT, possibly through later ranks' ranges.
  u.end = u.starts.empty() ? r.end : next_eot(u.view, r.end, meta.eot_token);
}

// A Megatron dataset's documents that start in tokens [r.begin, r.end) of its token order (the
// index's documents concatenated), each as the EOT followed by its tokens, so that a document of
// the index is a document of the shards, marked in /doc_offsets like a text document. The last
// one runs past r.end as far as it goes; the next rank starts with the next document.
void load_megatron(Unit& u, const PackInput& f, const PackRange& r, const ShardMeta& meta) {
  u.megatron = std::make_unique<MegatronDataset>(f.path, f.layout);
  const MegatronDataset& m = *u.megatron;
  u.view = m.tokens();
  u.eot = static_cast<uint32_t>(meta.eot_token);
  const std::string bin = f.path + ".bin";
  uint64_t at = 0;
  for (const auto& [first, last] : m.documents_starting_in(r.begin, r.end)) {
    u.starts.push_back(at);
    u.pieces.push_back({at++, Unit::kEotPiece});
    for (uint64_t s = first; s < last; ++s) {
      const MegatronDataset::Span q = m.sequence(s);
      if (q.count == 0) continue;
      scan_tokens(u.view, q.first, q.first + q.count, meta.vocab_size, meta.eot_token, bin);
      u.pieces.push_back({at, q.first});
      at += q.count;
    }
  }
  u.end = at;
}

// ---- one split's stream on this rank -----------------------------------------------------------

// The split's tokens on this rank, in global order, as ranges of units.
struct Stream {
  struct Segment {
    const Unit* unit;
    uint64_t begin, end;
  };
  std::vector<Segment> segments;
  std::vector<uint64_t> first;  // position of each segment's first token in the stream
  uint64_t size = 0;

  void add(const Unit* u, uint64_t begin, uint64_t end) {
    if (!segments.empty() && segments.back().unit == u && segments.back().end == begin) {
      segments.back().end = end;
    } else {
      segments.push_back({u, begin, end});
      first.push_back(size);
    }
    size += end - begin;
  }

  // Stream positions [from, to) into dst.
  void read(uint64_t from, uint64_t to, uint32_t* dst) const {
    size_t i = std::upper_bound(first.begin(), first.end(), from) - first.begin() - 1;
    for (; from < to; ++i) {
      const Segment& s = segments[i];
      const uint64_t b = s.begin + (from - first[i]);
      const uint64_t e = std::min(s.end, b + (to - from));
      s.unit->copy(b, e, dst);
      dst += e - b;
      from += e - b;
    }
  }
};

std::string shard_path(const std::string& prefix, const char* split, uint64_t index) {
  char num[32];
  std::snprintf(num, sizeof num, "%05llu", static_cast<unsigned long long>(index));
  return prefix + "-" + split + "-" + num + ".h5";
}

// ---- writing -----------------------------------------------------------------------------------

// Writes the shards of one split that start on this rank. Shard k holds global stream positions
// [k*L, (k+1)*L); its writer is the rank holding position k*L, and the ranks after it send the
// rest of that shard (at most one message per rank and split, posted up front by post_send).
class SplitWriter {
 public:
  SplitWriter(const Stream& stream, const std::vector<uint64_t>& sizes, int rank, int split,
              uint64_t limit, MPI_Comm comm)
      : s_(stream), n_(sizes), rank_(rank), tag_(split), limit_(limit), comm_(comm) {
    o_.resize(n_.size() + 1, 0);
    for (size_t r = 0; r < n_.size(); ++r) o_[r + 1] = o_[r] + n_[r];
  }
  uint64_t total() const { return o_.back(); }
  // Shards hold `limit_` tokens each, except the last of the split, which holds what is left; a
  // remainder shorter than half a shard is folded into the shard before instead (a 1-token last
  // shard is shorter than any training window, and training refuses such a shard), so every shard
  // but a split's only one holds between limit_ / 2 and 1.5 limit_ tokens.
  uint64_t shards() const {
    uint64_t n = (total() + limit_ - 1) / limit_;
    if (n > 1 && total() - (n - 1) * limit_ < (limit_ + 1) / 2) --n;
    return n;
  }
  uint64_t start_of(uint64_t k) const { return k * limit_; }
  uint64_t stop_of(uint64_t k) const { return k + 1 == shards() ? total() : (k + 1) * limit_; }
  uint64_t shard_of(uint64_t position) const { return std::min(position / limit_, shards() - 1); }

  // This rank's head belongs to a shard that starts on an earlier rank: send it there.
  void post_send(std::vector<MPI_Request>& reqs) {
    const uint64_t mine = o_[rank_];
    if (n_[rank_] == 0) return;
    const uint64_t k = shard_of(mine);
    if (start_of(k) == mine) return;
    int owner = rank_ - 1;
    while (!(o_[owner] <= start_of(k) && start_of(k) < o_[owner + 1])) --owner;
    send_.resize(std::min(n_[rank_], stop_of(k) - mine));
    s_.read(0, send_.size(), send_.data());
    for (uint64_t off = 0; off < send_.size(); off += kChunk) {
      reqs.emplace_back();
      MPI_CHECK(MPI_Isend(send_.data() + off,
                          static_cast<int>(std::min(kChunk, send_.size() - off)), MPI_UINT32_T,
                          owner, tag_, comm_, &reqs.back()));
    }
  }

  // Shards are written as <shard>.partial (a name no *.h5 glob matches) and renamed only once
  // every rank has written all of its shards: a pack that fails, or is killed, leaves the
  // shards of an earlier pack into the same prefix as they were.
  static std::string partial_path(const std::string& path) { return path + ".partial"; }
  // Renames this rank's finished shards into place.
  void commit() {
    for (const std::string& path : written_)
      if (std::rename(partial_path(path).c_str(), path.c_str()) != 0)
        throw UsageError(concat(path, ": cannot rename ", partial_path(path), " to it: ", std::strerror(errno)));
    written_.clear();
  }
  // Removes what this rank wrote (a failed pack).
  void discard() {
    for (const std::string& path : written_) std::remove(partial_path(path).c_str());
    written_.clear();
  }

  // Assembles and writes this rank's shards. A failed write is remembered in `error`, and the
  // receives go on regardless, so that no sender is left waiting.
  void write(const std::string& prefix, const char* split, const ShardMeta& meta,
             std::string& error) {
    const uint64_t mine = o_[rank_], mine_end = o_[rank_ + 1];
    if (n_[rank_] == 0) return;
    std::vector<uint32_t> tokens;
    std::vector<uint64_t> offsets;
    for (uint64_t k = (mine + limit_ - 1) / limit_; k < shards() && start_of(k) < mine_end; ++k) {
      const uint64_t start = start_of(k), stop = stop_of(k);
      tokens.resize(stop - start);
      s_.read(start - mine, std::min(stop, mine_end) - mine, tokens.data());
      for (size_t q = static_cast<size_t>(rank_) + 1; q < n_.size() && o_[q] < stop; ++q) {
        const uint64_t len = std::min(stop, o_[q + 1]) - o_[q];
        for (uint64_t off = 0; off < len; off += kChunk)
          MPI_CHECK(MPI_Recv(tokens.data() + (o_[q] - start) + off,
                             static_cast<int>(std::min(kChunk, len - off)), MPI_UINT32_T,
                             static_cast<int>(q), tag_, comm_, MPI_STATUS_IGNORE));
      }
      if (!error.empty()) continue;
      offsets.clear();
      for (size_t i = 0; i < tokens.size(); ++i)
        if (tokens[i] == static_cast<uint32_t>(meta.eot_token)) offsets.push_back(i);
      try {
        const std::string path = shard_path(prefix, split, k);
        written_.push_back(path);
        write_shard(partial_path(path), tokens, offsets, meta);
      } catch (const UsageError& e) {
        error = e.what();
      }
    }
  }

 private:
  const Stream& s_;
  std::vector<uint64_t> n_, o_;  // tokens per rank, and their prefix sums
  int rank_, tag_;
  uint64_t limit_;
  MPI_Comm comm_;
  std::vector<std::string> written_;  // final paths of the shards written as .partial
  std::vector<uint32_t> send_;
};

}  // namespace

// ---- pack --------------------------------------------------------------------------------------

PackResult pack(const PackOptions& opts, MpiComm comm_handle) {
  const MPI_Comm comm = to_mpi(comm_handle);
  int rank = 0, world = 1;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_CHECK(MPI_Comm_size(comm, &world));

  PackPlan plan;
  TextTokenizer tok;
  all_or_none(comm, [&] {
    if (rank != 0) return;
    if (!opts.special_tokens.empty() && opts.special_tokens != "text" && opts.special_tokens != "match")
      throw UsageError("pack: --special-tokens '" + opts.special_tokens + "' is not text or match");
    if (!opts.special_tokens.empty() && opts.tokenizer != "hf")
      throw UsageError("pack: --special-tokens is read by --tokenizer hf only");
    plan = make_pack_plan(opts, tok);
  });
  broadcast_pack_plan(plan, comm_handle);
  const ShardMeta& meta = plan.meta;

  // ---- tokenize this rank's share ----
  std::vector<Unit> units;
  all_or_none(comm, [&] {
    for (const PackRange& r : pack_ranges(plan, rank, world)) {
      const PackInput& f = plan.files[r.file];
      units.emplace_back();
      units.back().file = r.file;
      if (f.format == InputFormat::megatron) {
        load_megatron(units.back(), f, r, meta);
        continue;
      }
      if (!is_text_like(f.format)) {
        load_tokens(units.back(), f, r, meta);
        continue;
      }
      load_text_tokenizer(opts, meta, tok);
      if (tok.hf) tok.hf->set_special_tokens(meta.special_tokens == "match" ? SpecialTokens::match : SpecialTokens::text);
      load_text(units.back(), f, opts, meta, tok);
    }
  });

  // ---- number the documents globally and choose their split ----
  uint64_t my_docs = 0, first_doc = 0, docs = 0;
  for (const Unit& u : units) my_docs += u.starts.size();
  MPI_CHECK(MPI_Exscan(&my_docs, &first_doc, 1, MPI_UINT64_T, MPI_SUM, comm));
  if (rank == 0) first_doc = 0;  // MPI_Exscan leaves rank 0's result undefined
  MPI_CHECK(MPI_Allreduce(&my_docs, &docs, 1, MPI_UINT64_T, MPI_SUM, comm));
  if (docs == 0) {
    std::string names;
    for (const std::string& in : opts.inputs) names += (names.empty() ? "" : ", ") + in;
    throw UsageError(names + ": no documents (every input file is empty or blank)");
  }
  auto hashed_val = [&](uint64_t k) { return unit_hash(opts.seed, k) < opts.val_fraction; };
  // A tiny corpus whose hashes sent nothing to val gets its last document as the val split (and
  // one whose documents all hashed to val keeps its last one for train).
  std::array<uint64_t, 2> before_last{}, before_last_all{};  // train, val among docs < last
  for (uint64_t k = first_doc; k < first_doc + my_docs && k + 1 < docs; ++k)
    ++before_last[hashed_val(k) ? 1 : 0];
  MPI_CHECK(
      MPI_Allreduce(before_last.data(), before_last_all.data(), 2, MPI_UINT64_T, MPI_SUM, comm));
  auto is_val = [&](uint64_t k) {
    if (k + 1 < docs) return hashed_val(k);
    if (before_last_all[0] == 0) return false;
    if (opts.val_fraction > 0 && before_last_all[1] == 0) return true;
    return hashed_val(k);
  };

  std::array<Stream, 2> streams;  // train, val
  uint64_t k = first_doc;
  for (const Unit& u : units)
    for (size_t d = 0; d < u.starts.size(); ++d, ++k)
      streams[is_val(k) ? 1 : 0].add(&u, u.starts[d],
                                     d + 1 < u.starts.size() ? u.starts[d + 1] : u.end);

  // ---- the train split's unigram entropy ----
  double entropy = std::numeric_limits<double>::quiet_NaN();
  if (meta.vocab_size <= kMaxDenseVocab) {
    std::vector<uint64_t> counts(static_cast<size_t>(meta.vocab_size), 0), all(counts.size());
    for (const Stream::Segment& s : streams[0].segments)
      s.unit->count(s.begin, s.end, counts.data());
    MPI_CHECK(MPI_Allreduce(counts.data(), all.data(), static_cast<int>(all.size()), MPI_UINT64_T,
                            MPI_SUM, comm));
    uint64_t n = 0;
    for (uint64_t c : all) n += c;
    entropy = 0;
    for (uint64_t c : all)
      if (c > 0) {
        const double p = static_cast<double>(c) / static_cast<double>(n);
        entropy -= p * std::log(p);
      }
  }

  // ---- write the shards ----
  std::vector<uint64_t> sizes(2 * static_cast<size_t>(world));
  const uint64_t mine[2] = {streams[0].size, streams[1].size};
  MPI_CHECK(MPI_Allgather(mine, 2, MPI_UINT64_T, sizes.data(), 2, MPI_UINT64_T, comm));
  static const char* kSplits[2] = {"train", "val"};
  std::vector<SplitWriter> writers;
  for (int s = 0; s < 2; ++s) {
    std::vector<uint64_t> n(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) n[r] = sizes[2 * static_cast<size_t>(r) + s];
    writers.emplace_back(streams[s], n, rank, s, opts.shard_tokens, comm);
  }
  std::vector<MPI_Request> sends;
  for (SplitWriter& w : writers) w.post_send(sends);
  std::string error;
  for (int s = 0; s < 2; ++s) writers[s].write(opts.output_prefix, kSplits[s], meta, error);
  MPI_CHECK(MPI_Waitall(static_cast<int>(sends.size()), sends.data(), MPI_STATUSES_IGNORE));
  try {
    all_or_none(comm, [&] {
      if (!error.empty()) throw UsageError(error);
    });
    all_or_none(comm, [&] {
      for (SplitWriter& w : writers) w.commit();
    });
  } catch (...) {
    for (SplitWriter& w : writers) w.discard();
    throw;
  }

  PackResult r;
  for (int s = 0; s < 2; ++s) {
    auto& paths = s == 0 ? r.train_shards : r.val_shards;
    for (uint64_t i = 0; i < writers[s].shards(); ++i)
      paths.push_back(shard_path(opts.output_prefix, kSplits[s], i));
    // Shards past the last one, left by an earlier, larger pack into the same prefix, would mix two
    // corpora under one glob: remove them.
    if (rank == 0)
      for (uint64_t i = paths.size();; ++i) {
        std::error_code ec;
        if (!fs::remove(shard_path(opts.output_prefix, kSplits[s], i), ec)) break;
      }
  }
  MPI_CHECK(MPI_Barrier(comm));  // the stale shards are gone when pack returns anywhere
  r.documents = docs;
  r.train_tokens = writers[0].total();
  r.val_tokens = writers[1].total();
  r.vocab_size = meta.vocab_size;
  r.eot_token = meta.eot_token;
  r.tokenizer = meta.tokenizer;
  r.train_unigram_entropy = entropy;
  return r;
}

PackResult pack_text(const PackOptions& opts) { return pack(opts, mpi::self()); }

}  // namespace mpitrain
