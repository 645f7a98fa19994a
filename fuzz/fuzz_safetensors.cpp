// libFuzzer target: Hugging Face safetensors files as initial weights (load_hf_safetensors, what
// model.init_from reads from a downloaded model directory: untrusted input).
//
// Input: a flag byte, then bytes used according to it:
//   - flag even: the rest is a whole file (raw bytes: the header length, the JSON, the data);
//   - flag odd: a valid file of a tiny GPT (1 layer, 1 head, width 4, seq_len 4, vocab 8) written
//     by write_hf_model, mutated by the rest decoded with FuzzedDataProvider: up to 6 of
//     (overwrite bytes at an offset in the header or the data, truncate, append, replace the
//     header JSON by fuzz text with a correct length prefix, set the length prefix itself).
// Oracle: only mpitrain::UsageError escapes; when the load fails, no weight of the model has
// changed (every check comes before the first copy); the unmodified file loads bitwise; a load
// that succeeds gives finite weights.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "harness.h"
#include "weights.h"
#include "mpitrain/error.h"
#include "mpitrain/hf_format.h"
#include "mpitrain/model.h"

using namespace mpitrain;

const char* const kFuzzTarget = "fuzz_safetensors";

namespace {

struct World {
  std::string dir, path, original;
  std::optional<GPT> model;
  std::vector<torch::Tensor> saved;  // the exported values
};
World* g = nullptr;

void setup() {
  torch::set_num_threads(1);
  g = new World;
  g->dir = make_scratch_dir();
  torch::manual_seed(1);
  GPT source(tiny_dims());
  write_hf_model(g->dir + "/hf", source, 7);
  std::ifstream in(g->dir + "/hf/model.safetensors", std::ios::binary);
  g->original.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  g->saved = snapshot(source);
  g->path = g->dir + "/work.safetensors";
  torch::manual_seed(2);
  g->model.emplace(tiny_dims());
  // The unmodified file loads bitwise.
  std::ofstream(g->path, std::ios::binary) << g->original;
  load_hf_safetensors(g->path, *g->model);
  if (!same(snapshot(*g->model), g->saved)) bug("the unmodified file does not load bitwise");
}

std::string mutate(FuzzedDataProvider& in) {
  std::string f = g->original;
  uint64_t n = 0;
  std::memcpy(&n, f.data(), 8);
  const int steps = in.ConsumeIntegralInRange(1, 6);
  for (int s = 0; s < steps && in.remaining_bytes() > 0; ++s) {
    switch (in.ConsumeIntegralInRange(0, 4)) {
      case 0: {  // overwrite bytes in the header (JSON) or the data
        const size_t at = in.ConsumeIntegralInRange<size_t>(0, f.empty() ? 0 : f.size() - 1);
        const std::string bytes = in.ConsumeRandomLengthString(16);
        for (size_t i = 0; i < bytes.size() && at + i < f.size(); ++i) f[at + i] = bytes[i];
        note("overwrite at " + std::to_string(at));
        break;
      }
      case 1:
        f.resize(in.ConsumeIntegralInRange<size_t>(0, f.size()));
        note("truncate to " + std::to_string(f.size()));
        break;
      case 2:
        f += in.ConsumeRandomLengthString(64);
        note("append");
        break;
      case 3: {  // a new header, the length prefix kept consistent
        const std::string json = in.ConsumeRandomLengthString(512);
        const uint64_t len = json.size();
        const std::string data = f.size() >= 8 + n ? f.substr(8 + n) : std::string();
        f = std::string(reinterpret_cast<const char*>(&len), 8) + json + data;
        n = len;
        note("header: " + json);
        break;
      }
      default: {
        const uint64_t len = in.ConsumeIntegral<uint64_t>();
        if (f.size() >= 8) std::memcpy(f.data(), &len, 8);
        note("length prefix " + std::to_string(len));
        break;
      }
    }
  }
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (!g) setup();
  if (size == 0) return 0;
  FuzzedDataProvider in(data + 1, size - 1);
  const std::string file = data[0] % 2 == 0 ? in.ConsumeRemainingBytesAsString() : mutate(in);
  std::ofstream(g->path, std::ios::binary | std::ios::trunc) << file;
  const auto before = snapshot(*g->model);
  try {
    load_hf_safetensors(g->path, *g->model);
    for (const auto& t : snapshot(*g->model))
      if (!torch::isfinite(t).all().item<bool>()) bug("a load that succeeded gave non-finite weights");
    note("loaded");
  } catch (const UsageError& e) {
    note(std::string("refused: ") + e.what());
    if (!same(snapshot(*g->model), before)) bug(std::string("a refused file changed weights: ") + e.what());
  } catch (const std::exception& e) {
    bug(std::string("an exception other than UsageError: ") + e.what());
  }
  return 0;
}
