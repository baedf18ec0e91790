// The NIC side of IBGDA that runs without an RDMA NIC: the plugin (moelink_ibgda.so, linked
// against rdma-core) loads, looks for devices and says why it cannot open one; the loader says
// why when the plugin itself is missing. On a machine with an mlx5 device these tests skip:
// what they check is the absence path. The emulated NIC's queue-pair bookkeeping (a readmitted
// peer gets a new queue pair) needs a GPU for its mapped queues and skips without one.
#include <cstdlib>
#include <string>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "moelink/ep/ibgda/nic.h"
#include "moelink/ep/ibgda/probe.h"

using namespace moelink::ep::ibgda;

TEST(IbgdaNic, PluginLoadsAndReportsNoDevice) {
  const ProbeResult p = probe();
  if (!p.verbs_library) GTEST_SKIP() << "rdma-core's libibverbs is not installed";
  if (!p.devices.empty()) GTEST_SKIP() << "this machine has RDMA devices";
  setenv("MOELINK_IBGDA_PLUGIN", MOELINK_IBGDA_PLUGIN_PATH, 1);
  std::string why;
  auto nic = openVerbsNic(0, &why);
  unsetenv("MOELINK_IBGDA_PLUGIN");
  EXPECT_EQ(nic, nullptr);
  EXPECT_NE(why.find("no RDMA devices"), std::string::npos) << why;
}

TEST(IbgdaNic, MissingPluginSaysSo) {
  setenv("MOELINK_IBGDA_PLUGIN", "/nonexistent/moelink_ibgda.so", 1);
  std::string why;
  auto nic = openVerbsNic(0, &why);
  const ProbeResult p = probe();
  unsetenv("MOELINK_IBGDA_PLUGIN");
  EXPECT_EQ(nic, nullptr);
  EXPECT_NE(why.find("cannot load /nonexistent/moelink_ibgda.so"), std::string::npos) << why;
  EXPECT_FALSE(p.plugin && !p.mlx5_devices.empty()) << "the probe must not find a plugin that is not there";
}

TEST(IbgdaNic, EmulatedNicReplacesAndDestroysQueuePairs) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) GTEST_SKIP() << "no GPU";
  auto nic = makeEmulatedNic(0, 0, [](uint32_t, uint64_t, uint64_t) -> void* { return nullptr; });
  const auto first = nic->createQueuePair(1);
  const QueuePair a = nic->connect(1, first);
  const auto second = nic->createQueuePair(1);  // the peer's new process: the old queue pair goes
  EXPECT_NE(first, second);
  const QueuePair b = nic->connect(1, second);
  EXPECT_NE(a.sq.qpn, b.sq.qpn);
  nic->createQueuePair(2);
  nic->destroyQueuePair(1);
  EXPECT_THROW(nic->connect(1, second), std::exception);
  EXPECT_NO_THROW(nic->connect(2, second));  // the other peer's is untouched
  nic->destroyQueuePair(3);                  // none there: nothing happens
}
