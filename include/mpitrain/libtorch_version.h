// The libtorch this was compiled against, for messages ("libtorch 2.6.0"): shared by the model
// (which attention kernels exist), the optimizer (which AdamW kernels exist) and the start-up lines.
#pragma once

#include <torch/version.h>

#include <string>

#include "mpitrain/error.h"

namespace mpitrain {

inline std::string libtorch_version() {
  return concat("libtorch ", TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR, ".", TORCH_VERSION_PATCH);
}

}  // namespace mpitrain
