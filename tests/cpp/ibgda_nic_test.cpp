// The NIC side of IBGDA that runs without an RDMA NIC: the plugin (moelink_ibgda.so, linked
// against rdma-core) loads, looks for devices and says why it cannot open one; the loader says
// why when the plugin itself is missing. On a machine with an mlx5 device these tests skip:
// what they check is the absence path.
#include <cstdlib>
#include <string>

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
