// What this machine offers for IBGDA (GPU-initiated RDMA on mlx5 NICs), probed at run time
// without linking rdma-core: libibverbs and libmlx5 are loaded with dlopen when present, and
// so is the IBGDA plugin (moelink_ibgda.so, see nic.h) when the EP buffer uses it.
//
// `usable` says that an mlx5 device is there and the plugin loads; whether GPU memory can be
// registered with it (dma-buf or nvidia_peermem) shows only when the EP buffer tries.
// `reason` says what is missing first, so that a user on an RDMA cluster can tell "no NIC"
// from "not built".
#pragma once

#include <string>
#include <vector>

namespace moelink::ep::ibgda {

struct ProbeResult {
  bool verbs_library = false;              // libibverbs.so.1 could be loaded
  std::vector<std::string> devices;        // every RDMA device libibverbs lists
  std::vector<std::string> mlx5_devices;   // those mlx5dv supports
  bool gpudirect = false;                  // the nvidia_peermem (or nv_peer_mem) module is loaded
  bool plugin = false;                     // moelink_ibgda.so loads (it needs libibverbs and libmlx5)
  bool usable = false;                     // an mlx5 device and the plugin
  std::string reason;
};

ProbeResult probe();

// Where the plugin is looked for: MOELINK_IBGDA_PLUGIN, else moelink_ibgda.so next to the
// module that holds this code (the Python package's folder).
std::string pluginPath();

}  // namespace moelink::ep::ibgda
