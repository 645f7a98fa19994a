// `mpitrain sample`: text from a checkpoint, and byte-token decoding (see sample.h).
#include <cstdio>

#include "mpitrain/checkpoint.h"
#include "mpitrain/error.h"
#include "mpitrain/log.h"
#include "mpitrain/model.h"
#include "mpitrain/sample.h"

namespace mpitrain {

std::string decode_bytes(const std::vector<int64_t>& tokens, int64_t eot) {
  std::string out;
  for (int64_t t : tokens) {
    if (t == eot) out += "\n<|endoftext|>\n";
    else if (t == '\n' || t == '\t' || (t >= 32 && t < 256)) out += static_cast<char>(t);
    else out += concat("\\x", std::hex, t);
  }
  return out;
}

std::string run_sample(const SampleArgs& args) {
  GPTDims dims = checkpoint_dims(args.checkpoint);
  GPT model(dims);
  TrainState st;
  load_checkpoint(args.checkpoint, model, static_cast<FullOptimState*>(nullptr), st);
  if (st.tokenizer != "byte")
    throw UsageError(concat(args.checkpoint, ": sampling text needs the byte tokenizer, this checkpoint uses '",
                         st.tokenizer, "'"));
  std::vector<int64_t> prompt{st.eot_token};
  for (unsigned char c : args.prompt) prompt.push_back(c);
  auto out = generate(model, prompt, args.tokens, args.temperature, args.top_k, args.seed);
  return decode_bytes(std::vector<int64_t>(out.begin() + 1, out.end()), st.eot_token);
}

}  // namespace mpitrain
