// libFuzzer target: the YAML run configuration (parse_config, --set overrides, resolve_for_world,
// to_yaml).
//
// Input layout: YAML text [ '\0' world-byte override-lines... ]
//   - everything before the first NUL is the config file's text;
//   - the byte after it picks the world size (1 + byte % 16); without a NUL the world size is 1;
//   - the rest, split at '\n', are --set overrides ("section.key=value"), at most 16.
//
// Expected outcomes: success, or mpitrain::UsageError from parse_config / resolve_for_world.
// Anything else (another exception, a crash, a sanitizer report) is a bug, and so is a broken
// round trip: to_yaml of the resolved config must parse again, give the same to_yaml, and resolve
// again for the same world size without changing.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "mpitrain/config.h"
#include "mpitrain/error.h"

using namespace mpitrain;

namespace {

[[noreturn]] void bug(const std::string& what, const std::string& a = "", const std::string& b = "") {
  std::fprintf(stderr, "\nfuzz_config: PROPERTY VIOLATED: %s\n", what.c_str());
  if (!a.empty()) std::fprintf(stderr, "---- first ----\n%s\n", a.c_str());
  if (!b.empty()) std::fprintf(stderr, "---- second ----\n%s\n", b.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string yaml = input.substr(0, nul);
  int world = 1;
  std::vector<std::string> overrides;
  if (nul != std::string::npos && nul + 1 < input.size()) {
    world = 1 + static_cast<unsigned char>(input[nul + 1]) % 16;
    const std::string rest = input.substr(nul + 2);
    size_t pos = 0;
    while (pos <= rest.size() && overrides.size() < 16) {
      size_t end = rest.find('\n', pos);
      if (end == std::string::npos) end = rest.size();
      overrides.push_back(rest.substr(pos, end - pos));
      pos = end + 1;
    }
  }

  Config cfg;
  try {
    cfg = parse_config(yaml, "fuzz.yaml", overrides);
    resolve_for_world(cfg, world);
  } catch (const UsageError&) {
    return 0;  // the expected answer to a bad config
  } catch (const std::exception& e) {
    bug(std::string("parse_config/resolve_for_world threw a non-UsageError: ") + e.what());
  } catch (...) {
    bug("parse_config/resolve_for_world threw a non-std exception");
  }

  // Round trip: the resolved config, written out, is a valid config that reads back the same.
  const std::string first = to_yaml(cfg);
  Config again;
  try {
    again = parse_config(first, "roundtrip.yaml");
  } catch (const std::exception& e) {
    bug(std::string("parse_config(to_yaml(cfg)) failed: ") + e.what(), first);
  }
  const std::string second = to_yaml(again);
  if (second != first) bug("to_yaml(parse_config(to_yaml(cfg))) != to_yaml(cfg)", first, second);

  // Resolving an already resolved config for the same world size is a no-op.
  try {
    resolve_for_world(again, world);
  } catch (const std::exception& e) {
    bug(std::string("resolve_for_world of the round-tripped config failed: ") + e.what(), first);
  }
  const std::string third = to_yaml(again);
  if (third != first) bug("resolve_for_world changed an already resolved config", first, third);
  return 0;
}
