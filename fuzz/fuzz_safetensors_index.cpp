// libFuzzer target: a sharded Hugging Face model directory's model.safetensors.index.json
// (load_hf_safetensors of a directory without model.safetensors: the index says which file holds
// each tensor; untrusted, as downloaded).
//
// The directory holds the 3 shards of a tiny GPT written by write_hf_model (max shard 400 bytes);
// the input replaces its index: flag byte even, the rest is the index's text; odd, the written
// index parsed and edited by the rest (FuzzedDataProvider: up to 6 of rename a weight_map entry,
// point it at another or a new file name, drop it, add one, replace metadata).
// Oracle: only UsageError escapes, naming the directory's index or a file; a refused index changes
// no weight; an accepted one loads exactly the exported weights (each tensor is in one shard only,
// so any index the loader accepts must lead to it).
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "harness.h"
#include "weights.h"
#include "mpitrain/error.h"
#include "mpitrain/hf_format.h"
#include "mpitrain/model.h"

using namespace mpitrain;
using nlohmann::json;

const char* const kFuzzTarget = "fuzz_safetensors_index";

namespace {

struct World {
  std::string dir, index_path, original;
  std::optional<GPT> model;
  std::vector<torch::Tensor> saved;
};
World* g = nullptr;

void setup() {
  torch::set_num_threads(1);
  g = new World;
  g->dir = make_scratch_dir() + "/hf";
  const GPTDims d = tiny_dims();
  torch::manual_seed(1);
  GPT source(d);
  HfWriteOptions o;
  o.max_shard_bytes = 400;
  write_hf_model(g->dir, source, 7, o);
  g->index_path = g->dir + "/model.safetensors.index.json";
  std::ifstream in(g->index_path);
  g->original.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  g->saved = snapshot(source);
  torch::manual_seed(2);
  g->model.emplace(d);
  load_hf_safetensors(g->dir, *g->model);
  if (!same(snapshot(*g->model), g->saved)) bug("the written index does not load the exported weights");
  torch::manual_seed(2);
  g->model.emplace(d);
}

std::string edit(FuzzedDataProvider& in) {
  json j = json::parse(g->original);
  json& map = j["weight_map"];
  std::vector<std::string> names;
  for (const auto& [k, v] : map.items()) names.push_back(k);
  const int steps = in.ConsumeIntegralInRange(1, 6);
  for (int s = 0; s < steps && in.remaining_bytes() > 0; ++s) {
    const std::string name = names[in.ConsumeIntegralInRange<size_t>(0, names.size() - 1)];
    switch (in.ConsumeIntegralInRange(0, 4)) {
      case 0:  // point at another shard, or any name
        map[name] = in.ConsumeBool() ? json(concat("model-0000", in.ConsumeIntegralInRange(0, 4), "-of-00003.safetensors"))
                                     : json(in.ConsumeRandomLengthString(24));
        break;
      case 1:
        map.erase(name);
        break;
      case 2:
        map[in.ConsumeRandomLengthString(24)] = map.contains(name) ? map[name] : json(1);
        break;
      case 3:
        j["metadata"] = json::parse(in.ConsumeRandomLengthString(32), nullptr, false);
        break;
      default:
        map[name] = json::parse(in.ConsumeRandomLengthString(16), nullptr, false);
        break;
    }
  }
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (!g) setup();
  if (size == 0) return 0;
  FuzzedDataProvider in(data + 1, size - 1);
  const std::string text = data[0] % 2 == 0 ? in.ConsumeRemainingBytesAsString() : edit(in);
  std::ofstream(g->index_path, std::ios::binary | std::ios::trunc) << text;
  const auto before = snapshot(*g->model);
  try {
    load_hf_safetensors(g->dir, *g->model, "model.init_from");
    if (!same(snapshot(*g->model), g->saved)) bug("an accepted index loaded other weights: " + text);
    const GPTDims d = (*g->model)->dims();  // a copy: emplace destroys the model first
    torch::manual_seed(2);
    g->model.emplace(d);  // fresh weights for the next input
  } catch (const UsageError& e) {
    const std::string m = e.what();
    if (m.rfind("model.init_from: ", 0) != 0 || m.find(g->dir) == std::string::npos)
      bug("an error that does not name the key and the directory: " + m);
    if (!same(snapshot(*g->model), before)) bug("a refused index changed weights: " + m);
  } catch (const std::exception& e) {
    bug(std::string("an exception other than UsageError: ") + e.what());
  }
  return 0;
}
