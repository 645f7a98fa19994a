// Device per rank (see device.h).
#include "mpitrain/device.h"

#include <cstdlib>
#include <sstream>
#include <vector>

#include "mpitrain/error.h"

namespace mpitrain {
namespace {

std::string visible_devices_note(int index) {
  const char* env = std::getenv("CUDA_VISIBLE_DEVICES");
  if (env == nullptr) return "";
  std::vector<std::string> ids;
  std::stringstream in(env);
  for (std::string id; std::getline(in, id, ',');) ids.push_back(id);
  if (index >= 0 && index < static_cast<int>(ids.size()))
    return concat(" (CUDA_VISIBLE_DEVICES=", env, ": physical GPU ", ids[index], ")");
  return concat(" (CUDA_VISIBLE_DEVICES=", env, ")");
}

}  // namespace

DeviceChoice choose_device(const std::string& requested, const std::string& backend, int gpus,
                           int local_rank, int local_size, const std::string& host) {
  DeviceChoice c;
  if (requested == "cpu" || (requested == "auto" && gpus <= 0)) {
    c.describe = "cpu";
    return c;
  }
  if (gpus <= 0)
    throw UsageError(concat("train.device: 'cuda' but host ", host, " has no GPU this process can use",
                            visible_devices_note(-1),
                            " (or this build of mpitrain has no CUDA); use train.device: cpu or auto"));
  c.cuda = true;
  // More ranks than GPUs this process sees is sharing under the MPI backend. Under NCCL it may
  // still be one GPU per rank (srun --gpus-per-task=1 shows each task only its own GPU): the
  // pre-flight compares the GPUs' bus ids across ranks and refuses two ranks on one GPU.
  c.shared = local_size > gpus && backend == "mpi";
  c.index = local_rank % gpus;
  c.describe = concat("cuda:", c.index, visible_devices_note(c.index), c.shared ? " (shared by ranks)" : "");
  return c;
}

}  // namespace mpitrain
