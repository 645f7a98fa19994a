// libFuzzer target: a Hugging Face config.json as the model's shape (apply_hf_config_text, what
// model.init_from: hf:DIR reads before any weight).
//
// Input: the file's text. Expected outcomes: success, or mpitrain::UsageError naming the file.
// Anything else (another exception, a crash, a sanitizer report) is a bug, and so is an accepted
// file whose model does not validate the way a config file would: the ModelConfig it gives, as a
// config's model section, must parse (or be a UsageError from validation, e.g. n_kv_head not
// dividing n_head), and parse again from to_yaml to the same text.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "mpitrain/config.h"
#include "mpitrain/error.h"
#include "mpitrain/hf_config.h"

using namespace mpitrain;

namespace {

[[noreturn]] void bug(const std::string& what, const std::string& detail = "") {
  std::fprintf(stderr, "\nfuzz_hf_config: PROPERTY VIOLATED: %s\n%s\n", what.c_str(), detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  Config cfg;
  cfg.data.train = {"x.h5"};
  cfg.data.val = {"y.h5"};
  try {
    apply_hf_config_text(cfg.model, text, "hf/config.json", "fuzz.yaml");
  } catch (const UsageError& e) {
    if (std::string(e.what()).find("hf/config.json") == std::string::npos) bug("an error that does not name the file", e.what());
    return 0;
  } catch (const std::exception& e) {
    bug(concat("not a UsageError: ", e.what()), text);
  }
  std::string yaml;
  try {
    yaml = to_yaml(cfg);
    Config again = parse_config(yaml, "resolved.yaml");
    if (to_yaml(again) != yaml) bug("to_yaml of the resolved config changes when parsed again", yaml);
  } catch (const UsageError&) {
    return 0;  // a shape config.json allows but mpitrain's validation refuses, named there
  } catch (const std::exception& e) {
    bug(concat("not a UsageError from parse_config: ", e.what()), yaml);
  }
  return 0;
}
