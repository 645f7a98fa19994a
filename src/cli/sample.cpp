// `mpitrain sample`: text from a checkpoint (see sample.h).
#include <cstdio>

#include "mpitrain/checkpoint.h"
#include "mpitrain/error.h"
#include "mpitrain/log.h"
#include "mpitrain/model.h"
#include "mpitrain/sample.h"

namespace mpitrain {

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
