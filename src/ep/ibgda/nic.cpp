// Loads moelink_ibgda.so (verbs_nic.cpp) and wraps its C entry points as a Nic.
#include <dlfcn.h>

#include <cstdlib>
#include <string>

#include "moelink/common/error.h"
#include "moelink/common/settings.h"
#include "moelink/ep/ibgda/nic.h"
#include "moelink/ep/ibgda/probe.h"

namespace moelink::ep::ibgda {

namespace {

struct Plugin {
  void* handle = nullptr;
  moelink_ibgda_open_fn open = nullptr;
  moelink_ibgda_reg_fn reg = nullptr;
  moelink_ibgda_create_qp_fn create_qp = nullptr;
  moelink_ibgda_connect_fn connect = nullptr;
  moelink_ibgda_close_fn close = nullptr;
  moelink_ibgda_drain_fn drain = nullptr;
  moelink_ibgda_destroy_qp_fn destroy_qp = nullptr;
};

class PluginNic final : public Nic {
 public:
  PluginNic(Plugin p, void* ctx, std::string name) : p_(p), ctx_(ctx), name_(std::move(name)) {}
  ~PluginNic() override {
    p_.close(ctx_);
    dlclose(p_.handle);
  }
  std::string name() const override { return name_; }

  MemoryKeys registerMemory(void* ptr, size_t bytes) override {
    char err[512] = {0};
    MemoryKeys k;
    if (p_.reg(ctx_, ptr, bytes, &k.lkey, &k.rkey, err, sizeof err) != 0)
      MOELINK_THROW("IBGDA: registering GPU memory with ", name_, " failed: ", err);
    return k;
  }

  std::vector<uint8_t> createQueuePair(int peer) override {
    char err[512] = {0};
    std::vector<uint8_t> addr(256);
    size_t len = addr.size();
    if (p_.create_qp(ctx_, peer, addr.data(), &len, err, sizeof err) != 0)
      MOELINK_THROW("IBGDA: creating the queue pair to rank ", peer, " on ", name_, " failed: ", err);
    addr.resize(len);
    return addr;
  }

  void destroyQueuePair(int peer) override { p_.destroy_qp(ctx_, peer); }

  QueuePair connect(int peer, const std::vector<uint8_t>& remote) override {
    char err[512] = {0};
    moelink_ibgda_queues q{};
    if (p_.connect(ctx_, peer, remote.data(), remote.size(), &q, err, sizeof err) != 0)
      MOELINK_THROW("IBGDA: connecting the queue pair to rank ", peer, " on ", name_, " failed: ", err);
    QueuePair qp;
    qp.sq.wqes = q.wqes;
    qp.sq.depth = q.sq_depth;
    qp.sq.qpn = q.qpn;
    qp.sq.dbr = q.sq_dbr;
    qp.sq.doorbell = q.doorbell;
    qp.cq.cqes = q.cqes;
    qp.cq.depth = q.cq_depth;
    qp.cq.dbr = q.cq_dbr;
    return qp;
  }

  bool drain(int peer, const QueueProgress& progress, int timeout_ms, std::string* why_not) override {
    char err[512] = {0};
    const moelink_ibgda_progress p{progress.posted, progress.completed, progress.cq_consumer, progress.signal_mask,
                                   progress.failed ? 1u : 0u};
    if (p_.drain(ctx_, peer, &p, timeout_ms, err, sizeof err) == 0) return true;
    *why_not = err;
    return false;
  }

 private:
  Plugin p_;
  void* ctx_;
  std::string name_;
};

}  // namespace

std::unique_ptr<Nic> openVerbsNic(int cuda_device, std::string* why_not) {
  const std::string path = pluginPath();
  Plugin p;
  p.handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (p.handle == nullptr) {
    const char* e = dlerror();
    *why_not = "cannot load " + path + " (" + (e ? e : "?") +
               "): this build has no IBGDA plugin (rdma-core headers missing at build time) or rdma-core is not "
               "installed";
    return nullptr;
  }
  p.open = reinterpret_cast<moelink_ibgda_open_fn>(dlsym(p.handle, "moelink_ibgda_open"));
  p.reg = reinterpret_cast<moelink_ibgda_reg_fn>(dlsym(p.handle, "moelink_ibgda_reg"));
  p.create_qp = reinterpret_cast<moelink_ibgda_create_qp_fn>(dlsym(p.handle, "moelink_ibgda_create_qp"));
  p.connect = reinterpret_cast<moelink_ibgda_connect_fn>(dlsym(p.handle, "moelink_ibgda_connect"));
  p.close = reinterpret_cast<moelink_ibgda_close_fn>(dlsym(p.handle, "moelink_ibgda_close"));
  p.drain = reinterpret_cast<moelink_ibgda_drain_fn>(dlsym(p.handle, "moelink_ibgda_drain"));
  p.destroy_qp = reinterpret_cast<moelink_ibgda_destroy_qp_fn>(dlsym(p.handle, "moelink_ibgda_destroy_qp"));
  if (!p.open || !p.reg || !p.create_qp || !p.connect || !p.close || !p.drain || !p.destroy_qp) {
    dlclose(p.handle);
    *why_not = path + " lacks the moelink_ibgda_* entry points";
    return nullptr;
  }
  std::string want;
  int gid_index = -1;
  try {
    want = settings::text("MOELINK_IBGDA_DEVICE");
    if (auto g = settings::numberIfSet("MOELINK_IBGDA_GID_INDEX")) gid_index = static_cast<int>(*g);
  } catch (const moelink::Error& e) {
    dlclose(p.handle);
    *why_not = e.what();
    return nullptr;
  }
  void* ctx = nullptr;
  char name[128] = {0}, err[512] = {0};
  if (p.open(want.empty() ? nullptr : want.c_str(), gid_index, cuda_device, &ctx, name, sizeof name, err, sizeof err) !=
      0) {
    dlclose(p.handle);
    *why_not = err;
    return nullptr;
  }
  return std::make_unique<PluginNic>(p, ctx, name);
}

}  // namespace moelink::ep::ibgda
