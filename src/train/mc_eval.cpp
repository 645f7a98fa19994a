// Multiple-choice evaluation (see mc_eval.h).
#include "mpitrain/mc_eval.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <regex>

#include "mpitrain/bpe.h"
#include "mpitrain/error.h"
#include "mpitrain/hf_tokenizer.h"

namespace mpitrain {

namespace {


constexpr size_t kMaxTaskLine = 1 << 20;  // a task line longer than this is refused, never read whole

std::string mc_strip(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  const size_t a = s.find_first_not_of(ws);
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(ws) - a + 1);
}

std::string mc_replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
  return s;
}

// Python's str.capitalize on ASCII: the first character upper-cased, the rest lower-cased.
std::string mc_capitalize(std::string s) {
  for (size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    s[i] = static_cast<char>(i == 0 ? std::toupper(c) : std::tolower(c));
  }
  return s;
}

// The index of the largest value, the first of equals (numpy's argmax).
size_t mc_argmax(const std::vector<double>& v) {
  return static_cast<size_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

}  // namespace

TextEncoder byte_encoder() {
  return [](const std::string& text) {
    std::vector<int64_t> ids;
    for (const char c : text) ids.push_back(static_cast<unsigned char>(c));  // (ids are the bytes: unsigned)
    return ids;
  };
}

namespace {
// `tok`'s encode (HfTokenizer's or Gpt2Bpe's) as a TextEncoder, its vocabulary's size in *vocab.
template <class Tokenizer>
TextEncoder encoder_of(std::shared_ptr<Tokenizer> tok, int64_t* vocab) {
  if (vocab) *vocab = tok->vocab_size();
  return [tok](const std::string& text) {
    std::vector<int64_t> ids;
    for (uint32_t id : tok->encode(text)) ids.push_back(id);
    return ids;
  };
}
}  // namespace

TextEncoder tokenizer_encoder(const std::string& tokenizer_json) {
  return encoder_of(std::make_shared<HfTokenizer>(tokenizer_json), nullptr);
}

TextEncoder encoder_at(const std::string& path, int64_t* vocab) {
  if (path == "byte") {
    if (vocab) *vocab = 256;
    return byte_encoder();
  }
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return encoder_of(std::make_shared<Gpt2Bpe>(find_bpe_files(path)), vocab);
  return encoder_of(std::make_shared<HfTokenizer>(path), vocab);
}

std::string hellaswag_preprocess(const std::string& text) {
  static const std::regex tag("\\[.*?\\]");
  std::string s = mc_replace_all(mc_strip(text), " [title]", ". ");
  s = std::regex_replace(s, tag, "");
  return mc_replace_all(s, "  ", " ");
}

std::vector<McExample> read_mc_task(const std::string& path, int64_t limit) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(concat(path, ": cannot open the task file"));
  std::vector<McExample> out;
  std::string line;
  int64_t number = 0;
  while (limit <= 0 || static_cast<int64_t>(out.size()) < limit) {
    line.clear();
    int c = 0;
    while ((c = in.get()) != EOF && c != '\n') {  // one line, bounded
      if (line.size() == kMaxTaskLine) throw UsageError(concat(path, ": line ", number + 1, ": longer than 1 MiB"));
      line.push_back(static_cast<char>(c));
    }
    if (c == EOF && line.empty()) break;
    ++number;
    if (mc_strip(line).empty()) continue;
    const auto bad = [&](const std::string& what) { return UsageError(concat(path, ": line ", number, ": ", what)); };
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw bad(concat("not JSON: ", e.what()));
    }
    if (!j.is_object()) throw bad("expected a JSON object");
    const auto text = [&](const char* key) -> std::string {
      const auto it = j.find(key);
      if (it == j.end()) throw bad(concat("no key '", key, "'"));
      if (!it->is_string()) throw bad(concat("'", key, "' is not a string"));
      return it->get<std::string>();
    };
    const auto texts = [&](const char* key) {
      const auto it = j.find(key);
      if (it == j.end()) throw bad(concat("no key '", key, "'"));
      if (!it->is_array() || it->size() < 2) throw bad(concat("'", key, "' must be a list of at least 2 strings"));
      std::vector<std::string> v;
      for (const auto& e : *it) {
        if (!e.is_string()) throw bad(concat("'", key, "' must be a list of strings"));
        v.push_back(e.get<std::string>());
      }
      return v;
    };
    const auto index = [&](const char* key, size_t n) {
      const auto it = j.find(key);
      if (it == j.end()) throw bad(concat("no key '", key, "'"));
      int64_t v = -1;
      if (it->is_number_integer()) {
        v = it->get<int64_t>();
      } else if (it->is_string()) {  // HellaSwag's labels are strings: "0".."3"
        const std::string s = it->get<std::string>();
        if (s.empty() || s.size() > 9 || !std::all_of(s.begin(), s.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
          throw bad(concat("'", key, "' must be a choice's index, got '", s, "'"));
        v = std::stoll(s);
      } else {
        throw bad(concat("'", key, "' must be a choice's index"));
      }
      if (v < 0 || v >= static_cast<int64_t>(n))
        throw bad(concat("'", key, "' = ", v, " is not one of the ", n, " choices' indices"));
      return v;
    };
    McExample ex;
    if (j.contains("endings")) {  // HellaSwag
      std::string ctx = j.contains("ctx_a") ? text("ctx_a") + " " + mc_capitalize(text("ctx_b")) : text("ctx");
      if (j.contains("activity_label") && !j["activity_label"].is_null()) ctx = text("activity_label") + ": " + ctx;
      ex.context = hellaswag_preprocess(ctx);
      for (const std::string& e : texts("endings")) ex.choices.push_back(hellaswag_preprocess(e));
      ex.answer = index("label", ex.choices.size());
    } else if (j.contains("choices")) {  // the generic form
      ex.context = text("context");
      ex.choices = texts("choices");
      ex.answer = index("answer", ex.choices.size());
    } else {
      throw bad("neither a HellaSwag line (ctx, endings, label) nor a generic one (context, choices, answer)");
    }
    out.push_back(std::move(ex));
  }
  if (out.empty()) throw UsageError(concat(path, ": no examples"));
  return out;
}

McResult score_mc(GPT& model, const std::vector<McExample>& examples, const TextEncoder& encode, int64_t replica,
                  int64_t replicas, Communicator& group, const torch::Device& device, Precision precision, int64_t rows,
                  const LogProbs& log_probs, Communicator* pipeline) {
  const auto t0 = std::chrono::steady_clock::now();
  const LogProbs forward = log_probs ? log_probs : LogProbs([&](const torch::Tensor& x, const torch::Tensor& y) {
    return model->target_log_probs(x, y);
  });
  const int64_t T = model->dims().seq_len;
  // This replica's choices: (example, choice) with its tokens and how many of them are scored.
  struct Row {
    size_t example, choice;
    std::vector<int64_t> tokens;  // context + continuation, its last T + 1
    int64_t scored;               // the continuation's tokens among the targets
  };
  std::vector<Row> mine;
  size_t most_choices = 0;
  for (size_t e = 0; e < examples.size(); ++e) {
    most_choices = std::max(most_choices, examples[e].choices.size());
    if (static_cast<int64_t>(e % static_cast<size_t>(replicas)) != replica) continue;
    const std::vector<int64_t> context = encode(examples[e].context);
    for (size_t c = 0; c < examples[e].choices.size(); ++c) {
      std::vector<int64_t> tokens = context;
      const std::vector<int64_t> continuation = encode(" " + examples[e].choices[c]);
      tokens.insert(tokens.end(), continuation.begin(), continuation.end());
      if (static_cast<int64_t>(tokens.size()) > T + 1) tokens.erase(tokens.begin(), tokens.end() - (T + 1));
      const auto targets = static_cast<int64_t>(tokens.size()) - 1;
      mine.push_back({e, c, std::move(tokens), std::min<int64_t>(static_cast<int64_t>(continuation.size()), targets)});
    }
  }
  // Batches of similar lengths: the rows sorted by length, `rows` at a time.
  std::vector<size_t> order(mine.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return mine[a].tokens.size() < mine[b].tokens.size(); });
  const auto batches = static_cast<int64_t>((mine.size() + static_cast<size_t>(rows) - 1) / static_cast<size_t>(rows));
  torch::Tensor most = torch::full({1}, static_cast<double>(batches), torch::dtype(torch::kFloat64).device(device));
  group.all_reduce(most, ReduceOp::max);
  const auto forwards = static_cast<int64_t>(most.item<double>());
  torch::Tensor scores = torch::zeros({static_cast<int64_t>(examples.size()), static_cast<int64_t>(most_choices)},
                                      torch::kFloat64);
  const bool was_training = model->is_training();
  model->eval();
  {
    torch::NoGradGuard no_grad;
    for (int64_t b = 0; b < forwards; ++b) {
      if (b >= batches) {  // another rank's batch: a one-token forward of no example, for the collectives
        Autocast autocast(precision, device);
        (void)forward(torch::zeros({1, 1}, torch::kLong).to(device), torch::zeros({1, 1}, torch::kLong));
        continue;
      }
      const size_t first = static_cast<size_t>(b * rows), last = std::min(mine.size(), first + static_cast<size_t>(rows));
      int64_t width = 1;
      for (size_t i = first; i < last; ++i) width = std::max<int64_t>(width, static_cast<int64_t>(mine[order[i]].tokens.size()) - 1);
      const auto n = static_cast<int64_t>(last - first);
      torch::Tensor x = torch::zeros({n, width}, torch::kLong), y = torch::zeros({n, width}, torch::kLong),
                    mask = torch::zeros({n, width}, torch::kFloat64);
      for (int64_t r = 0; r < n; ++r) {
        const Row& row = mine[order[first + static_cast<size_t>(r)]];
        const auto len = static_cast<int64_t>(row.tokens.size()) - 1;
        for (int64_t i = 0; i < len; ++i) {
          x[r][i] = row.tokens[static_cast<size_t>(i)];
          y[r][i] = row.tokens[static_cast<size_t>(i + 1)];
        }
        mask.narrow(0, r, 1).narrow(1, len - row.scored, row.scored).fill_(1);
      }
      torch::Tensor logp;
      {
        Autocast autocast(precision, device);
        logp = forward(x.to(device), y);
      }
      if (!logp.defined()) continue;  // (a pipeline stage before the last)
      const torch::Tensor sums = (logp.to(torch::kCPU, torch::kFloat64) * mask).sum(1);
      for (int64_t r = 0; r < n; ++r) {
        const Row& row = mine[order[first + static_cast<size_t>(r)]];
        scores[static_cast<int64_t>(row.example)][static_cast<int64_t>(row.choice)] = sums[r].item<double>();
      }
    }
  }
  if (was_training) model->train();
  scores = scores.to(device);
  group.all_reduce(scores, ReduceOp::sum);  // (each example's row from its one replica; the others' zeros)
  if (pipeline) pipeline->all_reduce(scores, ReduceOp::sum);  // (the last stage's)
  scores = scores.cpu();
  McResult out;
  out.examples = static_cast<int64_t>(examples.size());
  int64_t right = 0, right_norm = 0;
  for (size_t e = 0; e < examples.size(); ++e) {
    std::vector<double> s, norm;
    for (size_t c = 0; c < examples[e].choices.size(); ++c) {
      s.push_back(scores[static_cast<int64_t>(e)][static_cast<int64_t>(c)].item<double>());
      norm.push_back(s.back() / static_cast<double>(examples[e].choices[c].size() + 1));  // (" " + choice)'s bytes
    }
    right += static_cast<int64_t>(mc_argmax(s)) == examples[e].answer;
    right_norm += static_cast<int64_t>(mc_argmax(norm)) == examples[e].answer;
    out.scores.push_back(std::move(s));
  }
  out.acc = static_cast<double>(right) / static_cast<double>(out.examples);
  out.acc_norm = static_cast<double>(right_norm) / static_cast<double>(out.examples);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace mpitrain
