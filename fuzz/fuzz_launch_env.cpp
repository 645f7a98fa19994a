// libFuzzer target: the launch environment mpitrain reads before training starts, which comes
// from launchers, job scripts and users' shells: CUDA_VISIBLE_DEVICES (choose_device's message),
// the task counts of Open MPI, PMI and Slurm (check_not_a_singleton), the launcher's local rank
// variables (launcher_local_rank), the interface lists NCCL is made to follow
// (follow_mpi_interface_for_nccl: OMPI_MCA_btl_tcp_if_include with names and CIDR ranges,
// UCX_NET_DEVICES, FI_TCP_IFACE), and split_list, which they all go through.
//
// Input: NUL-separated values for those variables, in the order of kVars (a missing value leaves
// the variable unset), then world size and GPU-count bytes. Oracle: only UsageError escapes,
// naming the variable it read; split_list joined again with its separator gives its input;
// NCCL_SOCKET_IFNAME, when mpitrain sets it, is "=" and a comma list of non-empty names (those
// MPI was given; CIDR ranges become the local interfaces in them); choose_device takes a GPU index
// in [0, gpus).
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "harness.h"
#include "mpitrain/device.h"
#include "mpitrain/error.h"
#include "mpitrain/mpi_env.h"
#include "mpitrain/netcheck.h"
#include "mpitrain/preflight.h"

using namespace mpitrain;

const char* const kFuzzTarget = "fuzz_launch_env";

namespace {
const char* const kVars[] = {"CUDA_VISIBLE_DEVICES", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS",
                             "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID",
                             "OMPI_MCA_btl_tcp_if_include", "UCX_NET_DEVICES", "FI_TCP_IFACE"};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> values = split_list(in, '\0');
  std::string joined;
  for (size_t i = 0; i < values.size(); ++i) joined += (i ? std::string(1, '\0') : "") + values[i];
  if (joined != in) bug("split_list joined again differs from its input");
  const size_t w = std::size(kVars);
  const int world = values.size() > w && !values[w].empty() ? static_cast<unsigned char>(values[w][0]) % 4 + 1 : 1;
  const size_t g = std::size(kVars) + 1;
  const int gpus = values.size() > g && !values[g].empty() ? static_cast<unsigned char>(values[g][0]) % 9 : 2;
  for (size_t i = 0; i < std::size(kVars); ++i) {
    if (i < values.size()) setenv(kVars[i], values[i].c_str(), 1);
    else unsetenv(kVars[i]);
  }
  unsetenv("NCCL_SOCKET_IFNAME");
  try {
    check_not_a_singleton(world);
  } catch (const UsageError& e) {
    const std::string m = e.what();
    if (world != 1 || m.rfind("launch: ", 0) != 0) bug("the singleton guard refused a world of " + std::to_string(world) + ": " + m);
  } catch (const std::exception& e) {
    bug(concat("not a UsageError: ", e.what()));
  }
  (void)launcher_local_rank(world);
  try {
    const DeviceChoice c = choose_device("cuda", "mpi", gpus, world - 1, world, "host");
    if (c.index < 0 || c.index >= gpus) bug(concat("GPU index ", c.index, " of ", gpus));
  } catch (const UsageError& e) {
    if (gpus > 0 || std::string(e.what()).rfind("train.device: ", 0) != 0) bug(concat("choose_device: ", e.what()));
  }
  const std::string nccl = follow_mpi_interface_for_nccl();
  if (!nccl.empty()) {
    if (nccl[0] != '=') bug("NCCL_SOCKET_IFNAME without '=': " + nccl);
    for (const std::string& name : split_list(nccl.substr(1), ','))
      if (name.empty()) bug("NCCL_SOCKET_IFNAME names an empty interface: " + nccl);
    const char* set = std::getenv("NCCL_SOCKET_IFNAME");
    if (!set || set != nccl) bug("follow_mpi_interface_for_nccl returned what it did not set");
  }
  return 0;
}
