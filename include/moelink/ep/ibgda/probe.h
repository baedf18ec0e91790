// What this machine offers for IBGDA (GPU-initiated RDMA on mlx5 NICs), probed at run time
// without linking rdma-core: libibverbs and libmlx5 are loaded with dlopen when present.
//
// The IBGDA data path itself (queue pairs in GPU memory, GPU doorbells) is not part of this
// build, so `usable` is always false; `reason` says what is missing first, so that a user
// on an RDMA cluster can tell "no NIC" from "not built".
#pragma once

#include <string>
#include <vector>

namespace moelink::ep::ibgda {

struct ProbeResult {
  bool verbs_library = false;              // libibverbs.so.1 could be loaded
  std::vector<std::string> devices;        // every RDMA device libibverbs lists
  std::vector<std::string> mlx5_devices;   // those mlx5dv supports
  bool gpudirect = false;                  // the nvidia_peermem (or nv_peer_mem) module is loaded
  bool usable = false;                     // always false: the data path is not built
  std::string reason;
};

ProbeResult probe();

}  // namespace moelink::ep::ibgda
