// Multiple-choice evaluation (eval.tasks in training, `mpitrain eval` on its own), scored as
// lm-evaluation-harness scores loglikelihood tasks:
//  - a task file is JSON Lines, one example per line: HellaSwag's own fields (`ctx`, or `ctx_a` +
//    `ctx_b`; `endings`; `label`; optional `activity_label`), preprocessed as the harness's
//    hellaswag task does (the context `activity_label: ctx_a Ctx_b`; " [title]" to ". ", other
//    [bracketed] tags removed, double spaces made single, each text stripped), or the generic form
//    (`context`, `choices`, `answer`) that ARC, PIQA, MMLU and users' tasks convert to;
//  - each choice's score is the sum of the log-probabilities of its tokens, " " + choice tokenized
//    on its own after the context's tokens (the harness's target delimiter, no other separator),
//    the whole kept to its last seq_len + 1 tokens;
//  - acc: the argmax of the scores is the answer; acc_norm: the argmax of score / the UTF-8 bytes
//    of " " + choice. Ties go to the first choice.
// The examples are split over the data-parallel replicas (example i on replica i mod R; the ranks
// of a tp group score the same ones together), their choices batched by length; the scores are
// summed over the replicas so that every rank holds every example's.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "mpitrain/amp.h"
#include "mpitrain/comm.h"
#include "mpitrain/model.h"

namespace mpitrain {

struct McExample {
  std::string context;
  std::vector<std::string> choices;
  int64_t answer = 0;
};

// The examples of a task file (the first `limit`; 0: all). A bad line is a UsageError naming the
// file and the line: not JSON, neither form, a field of the wrong type, fewer than 2 choices, an
// answer out of range; a line over 1 MiB; no examples.
std::vector<McExample> read_mc_task(const std::string& path, int64_t limit);

// HellaSwag's preprocessing of a text (lm-evaluation-harness's hellaswag.preprocess).
std::string hellaswag_preprocess(const std::string& text);

// A text's token ids under the run's tokenizer: the byte tokenizer's (the UTF-8 bytes), or a
// Hugging Face tokenizer.json's (HfTokenizer::encode; a bad file is its UsageError).
using TextEncoder = std::function<std::vector<int64_t>(const std::string&)>;
TextEncoder byte_encoder();
TextEncoder tokenizer_encoder(const std::string& tokenizer_json);
// The encoder `path` names: "byte", a GPT-2 BPE directory (vocab.json + merges.txt or encoder.json
// + vocab.bpe: Gpt2Bpe) or a tokenizer.json; its vocabulary's size in *vocab (byte: 256). Bad or
// missing files are a UsageError naming them.
TextEncoder encoder_at(const std::string& path, int64_t* vocab = nullptr);
// Per position the log-probability of targets [B, T] after idx [B, T] (GPT::target_log_probs);
// undefined where this rank does not compute it (a pipeline's stages but the last).
using LogProbs = std::function<torch::Tensor(const torch::Tensor& idx, const torch::Tensor& targets)>;

struct McResult {
  double acc = 0, acc_norm = 0;
  int64_t examples = 0;
  double seconds = 0;                      // this rank's wall time of the scoring
  std::vector<std::vector<double>> scores;  // every example's choices' scores (fp64 sums)
};

// Scores `examples` with `model` (its forward in evaluation mode, no gradients, under `precision`'s
// autocast), this rank taking replica `replica`'s share of `replicas`; `group` sums the scores over
// the replicas (every rank of it calls this, with the same examples). Every rank of `group` runs the
// same number of forwards (padded with one-token ones), so the collectives inside the model (ZeRO-3's
// gathers, the experts' all-to-alls, tp's all-reduces) pair up. `rows`: choices per forward.
// `log_probs` (default: the model's target_log_probs) and `pipeline` (pipeline parallelism: every
// stage runs the same batches through log_probs, the last stage's scores summed over it).
McResult score_mc(GPT& model, const std::vector<McExample>& examples, const TextEncoder& encode, int64_t replica,
                  int64_t replicas, Communicator& group, const torch::Device& device, Precision precision, int64_t rows,
                  const LogProbs& log_probs = {}, Communicator* pipeline = nullptr);

}  // namespace mpitrain
