#include "moelink/ep/ibgda/probe.h"

#include "moelink/common/settings.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <cstdlib>

namespace moelink::ep::ibgda {

namespace {

// Opaque to us: only pointers are passed back to the library that made them.
struct ibv_device;
using GetDeviceList = ibv_device** (*)(int*);
using FreeDeviceList = void (*)(ibv_device**);
using GetDeviceName = const char* (*)(ibv_device*);
using IsSupported = bool (*)(ibv_device*);

bool exists(const char* path) {
  struct stat st;
  return stat(path, &st) == 0;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

}  // namespace

std::string pluginPath() {
  if (std::string env = settings::text("MOELINK_IBGDA_PLUGIN"); !env.empty()) return env;
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&pluginPath), &info) == 0 || info.dli_fname == nullptr) return "moelink_ibgda.so";
  std::string self = info.dli_fname;
  const auto slash = self.rfind('/');
  return (slash == std::string::npos ? std::string(".") : self.substr(0, slash)) + "/moelink_ibgda.so";
}

ProbeResult probe() {
  ProbeResult r;
  r.gpudirect = exists("/sys/module/nvidia_peermem") || exists("/sys/module/nv_peer_mem");
  void* verbs = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
  if (verbs == nullptr) {
    r.reason = "libibverbs.so.1 (rdma-core) is not installed";
    return r;
  }
  r.verbs_library = true;
  auto get_list = reinterpret_cast<GetDeviceList>(dlsym(verbs, "ibv_get_device_list"));
  auto free_list = reinterpret_cast<FreeDeviceList>(dlsym(verbs, "ibv_free_device_list"));
  auto get_name = reinterpret_cast<GetDeviceName>(dlsym(verbs, "ibv_get_device_name"));
  void* mlx5 = dlopen("libmlx5.so.1", RTLD_NOW | RTLD_LOCAL);
  auto is_mlx5 = mlx5 ? reinterpret_cast<IsSupported>(dlsym(mlx5, "mlx5dv_is_supported")) : nullptr;
  if (get_list && free_list && get_name) {
    int n = 0;
    ibv_device** list = get_list(&n);
    for (int i = 0; list != nullptr && i < n; ++i) {
      const char* name = get_name(list[i]);
      r.devices.emplace_back(name ? name : "?");
      if (is_mlx5 != nullptr && is_mlx5(list[i])) r.mlx5_devices.emplace_back(name ? name : "?");
    }
    if (list != nullptr) free_list(list);
  }
  if (mlx5) dlclose(mlx5);
  dlclose(verbs);
  if (!get_list || !free_list || !get_name)
    r.reason = "libibverbs.so.1 lacks the device-list functions";
  else if (r.devices.empty())
    r.reason = "no RDMA devices (ibv_get_device_list lists none)";
  else if (r.mlx5_devices.empty())
    r.reason = "no mlx5 device among " + join(r.devices) + (mlx5 ? "" : " (libmlx5.so.1 not installed)");
  else {
    const std::string path = pluginPath();
    void* plugin = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    const char* why = plugin ? nullptr : dlerror();
    r.plugin = plugin != nullptr;
    if (plugin) dlclose(plugin);
    r.usable = r.plugin;
    const std::string devs = "mlx5 devices " + join(r.mlx5_devices) +
                             (r.gpudirect ? " (nvidia_peermem loaded)" : " (nvidia_peermem not loaded: GPU memory "
                                                                       "is registered through dma-buf)");
    if (r.plugin)
      r.reason = devs + ": the EP buffer uses IBGDA for peers on other hosts (MOELINK_EP_IBGDA=off: the CPU proxy)";
    else
      r.reason = devs + ", but the IBGDA plugin does not load (" + path + ": " + (why ? why : "?") +
                 "; built without rdma-core headers?): peers on other hosts use the CPU proxy";
  }
  return r;
}

}  // namespace moelink::ep::ibgda
