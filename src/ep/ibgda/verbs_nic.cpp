// moelink_ibgda.so: the mlx5 NIC for IBGDA through rdma-core (the C entry points of nic.h).
//
// - The device: MOELINK_IBGDA_DEVICE ("mlx5_0" or "mlx5_0:1"), else the first device mlx5dv
//   supports with an active port.
// - Queue memory: a parent domain whose allocator hands the mlx5 provider page-aligned host
//   memory registered with CUDA as mapped memory, so that the send queue, the completion queue
//   and both doorbell records, as the provider lays them out for the kernel driver, are
//   reachable by GPU threads. The doorbell register (the queue pair's BlueFlame register in
//   its UAR page) is registered as CUDA I/O memory. mlx5dv_init_obj() gives their addresses.
// - GPU memory: registered through a dma-buf (cuMemGetHandleForAddressRange +
//   ibv_reg_dmabuf_mr), else with ibv_reg_mr (needs nvidia_peermem).
// - Queue pairs: RC, one per peer, each with its own completion queue (64-byte CQEs);
//   connected through RESET -> INIT -> RTR -> RTS with the peer's QPN, PSN, LID and GID
//   (RoCE: a RoCE v2 GID, preferring an IPv4-mapped one; MOELINK_IBGDA_GID_INDEX overrides).
//
// No machine this project was developed on has an RDMA NIC: this file is compiled and its
// device discovery runs (it reports "no RDMA devices"), but nothing past ibv_open_device has
// run on hardware (docs/EP.md).
#include <infiniband/mlx5dv.h>
#include <infiniband/verbs.h>

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "moelink/ep/ibgda/nic.h"

namespace {

constexpr uint32_t kSqDepth = 2048;  // WQEs asked for; the provider may round up
constexpr uint32_t kCqDepth = 256;   // > kSqDepth / 64 + 2 (queue.h, selective signaling)

void fail(char* err, size_t errlen, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(err, errlen, fmt, ap);
  va_end(ap);
}

struct Qp {
  int peer = -1;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
  uint32_t psn = 0;
};

// What a queue pair's end tells its peer.
struct Address {
  uint32_t qpn;
  uint32_t psn;
  uint16_t lid;
  uint8_t mtu;  // enum ibv_mtu
  uint8_t pad;
  uint8_t gid[16];
};

struct Ctx {
  int cuda_device = 0;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_pd* parent = nullptr;
  uint8_t port = 1;
  ibv_port_attr port_attr{};
  int gid_index = -1;  // -1: InfiniBand, addressed by LID
  ibv_gid gid{};
  std::vector<ibv_mr*> mrs;
  std::vector<Qp> qps;
  std::map<uintptr_t, size_t> allocs;  // the provider's queue memory: host address -> bytes
  std::vector<void*> uar_pages;        // registered with CUDA as I/O memory
};

size_t pageSize() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// The parent domain's allocator: queue buffers and doorbell records in host memory that GPU
// threads can reach (the provider writes the CQ's initial owner bytes itself).
void* pdAlloc(ibv_pd*, void* pd_context, size_t size, size_t alignment, uint64_t) {
  auto* c = static_cast<Ctx*>(pd_context);
  const size_t page = pageSize();
  const size_t bytes = (size + page - 1) / page * page;
  void* p = nullptr;
  if (posix_memalign(&p, alignment > page ? alignment : page, bytes) != 0) return nullptr;
  std::memset(p, 0, bytes);
  if (cudaSetDevice(c->cuda_device) != cudaSuccess ||
      cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable) != cudaSuccess) {
    std::free(p);
    return nullptr;
  }
  c->allocs[reinterpret_cast<uintptr_t>(p)] = bytes;
  return p;
}

void pdFree(ibv_pd*, void* pd_context, void* ptr, uint64_t) {
  auto* c = static_cast<Ctx*>(pd_context);
  c->allocs.erase(reinterpret_cast<uintptr_t>(ptr));
  cudaHostUnregister(ptr);
  std::free(ptr);
}

// The GPU's address of host memory from pdAlloc (nullptr if it is not from there).
template <typename T>
T* deviceOf(Ctx* c, const void* host) {
  const auto h = reinterpret_cast<uintptr_t>(host);
  auto it = c->allocs.upper_bound(h);
  if (it == c->allocs.begin()) return nullptr;
  --it;
  if (h >= it->first + it->second) return nullptr;
  void* dev = nullptr;
  if (cudaHostGetDevicePointer(&dev, reinterpret_cast<void*>(it->first), 0) != cudaSuccess) return nullptr;
  return reinterpret_cast<T*>(static_cast<char*>(dev) + (h - it->first));
}

bool activePort(ibv_context* ctx, uint8_t port, ibv_port_attr* attr) {
  std::memset(attr, 0, sizeof *attr);
  return ibv_query_port(ctx, port, attr) == 0 && attr->state == IBV_PORT_ACTIVE;
}

// RoCE: the GID to address from (`wanted` >= 0: MOELINK_IBGDA_GID_INDEX, read by the loader;
// else a RoCE v2 GID, an IPv4-mapped one first). Returns the index or -1.
int pickGid(ibv_context* ctx, uint8_t port, int table_len, int wanted) {
  if (wanted >= 0) return wanted;
  int v2 = -1;
  for (int i = 0; i < table_len; ++i) {
    ibv_gid_entry e{};
    if (ibv_query_gid_ex(ctx, port, i, &e, 0) != 0 || e.gid_type != IBV_GID_TYPE_ROCE_V2) continue;
    const uint8_t* g = e.gid.raw;
    bool v4 = g[10] == 0xff && g[11] == 0xff;
    for (int b = 0; b < 10; ++b) v4 = v4 && g[b] == 0;
    if (v4) return i;
    if (v2 < 0) v2 = i;
  }
  return v2;
}

void closeCtx(Ctx* c) {
  for (Qp& q : c->qps) {
    if (q.qp) ibv_destroy_qp(q.qp);
    if (q.cq) ibv_destroy_cq(q.cq);
  }
  for (ibv_mr* mr : c->mrs) ibv_dereg_mr(mr);
  for (void* p : c->uar_pages) cudaHostUnregister(p);
  if (c->parent) ibv_dealloc_pd(c->parent);
  if (c->pd) ibv_dealloc_pd(c->pd);
  if (c->ctx) ibv_close_device(c->ctx);
  delete c;
}

// The provider's layout of a queue pair's send queue and its CQ (host addresses).
bool queuesOf(Qp* q, mlx5dv_qp* dq, mlx5dv_cq* dc, char* err, size_t errlen) {
  mlx5dv_obj obj{};
  obj.qp.in = q->qp;
  obj.qp.out = dq;
  obj.cq.in = q->cq;
  obj.cq.out = dc;
  if (mlx5dv_init_obj(&obj, MLX5DV_OBJ_QP | MLX5DV_OBJ_CQ) == 0) return true;
  fail(err, errlen, "mlx5dv_init_obj failed");
  return false;
}

// A CQ and an RC queue pair on the parent domain (queue memory from pdAlloc).
bool makeQp(Ctx* c, Qp* q, char* err, size_t errlen) {
  ibv_cq_init_attr_ex ca{};
  ca.cqe = kCqDepth;
  ca.comp_mask = IBV_CQ_INIT_ATTR_MASK_PD;
  ca.parent_domain = c->parent;
  ibv_cq_ex* cq = ibv_create_cq_ex(c->ctx, &ca);
  if (cq == nullptr) {
    fail(err, errlen, "ibv_create_cq_ex failed (errno %d: %s)", errno, std::strerror(errno));
    return false;
  }
  q->cq = ibv_cq_ex_to_cq(cq);
  ibv_qp_init_attr_ex qa{};
  qa.qp_type = IBV_QPT_RC;
  qa.send_cq = q->cq;
  qa.recv_cq = q->cq;
  qa.cap.max_send_wr = kSqDepth;
  qa.cap.max_recv_wr = 1;
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  qa.cap.max_inline_data = 16;
  qa.comp_mask = IBV_QP_INIT_ATTR_PD;
  qa.pd = c->parent;
  q->qp = ibv_create_qp_ex(c->ctx, &qa);
  if (q->qp == nullptr) {
    ibv_destroy_cq(q->cq);
    q->cq = nullptr;
    fail(err, errlen, "ibv_create_qp_ex failed (errno %d: %s)", errno, std::strerror(errno));
    return false;
  }
  return true;
}

// Maps the page of a doorbell register into the GPU (once per page) and returns the
// register's GPU address, or nullptr. An unprivileged process needs the NVIDIA driver's
// PeerMappingOverride=1 for this (the GPU writes to the NIC's BAR), as NVSHMEM's IBGDA does.
uint64_t* mapDoorbell(Ctx* c, void* reg, char* err, size_t errlen) {
  const size_t page = pageSize();
  void* uar = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(reg) & ~(page - 1));
  bool mapped = false;
  for (void* p : c->uar_pages) mapped = mapped || p == uar;
  if (!mapped) {
    const cudaError_t e = cudaHostRegister(uar, page, cudaHostRegisterIoMemory | cudaHostRegisterMapped);
    if (e != cudaSuccess && e != cudaErrorHostMemoryAlreadyRegistered) {
      cudaGetLastError();
      fail(err, errlen,
           "the GPU cannot map the NIC's doorbell page (cudaHostRegister as I/O memory: %s; unprivileged "
           "processes need the NVIDIA driver option NVreg_RegistryDwords=\"PeerMappingOverride=1;\")",
           cudaGetErrorString(e));
      return nullptr;
    }
    c->uar_pages.push_back(uar);
  }
  void* uar_dev = nullptr;
  if (cudaHostGetDevicePointer(&uar_dev, uar, 0) != cudaSuccess) {
    cudaGetLastError();
    fail(err, errlen, "cudaHostGetDevicePointer(doorbell page) failed");
    return nullptr;
  }
  return reinterpret_cast<uint64_t*>(static_cast<char*>(uar_dev) +
                                     (reinterpret_cast<uintptr_t>(reg) - reinterpret_cast<uintptr_t>(uar)));
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int moelink_ibgda_open(const char* want, int gid_index, int cuda_device,
                                                              void** out, char* name, size_t namelen, char* err,
                                                              size_t errlen) {
  std::string want_dev, want_port;
  if (want) {
    want_dev = want;
    const auto colon = want_dev.find(':');
    if (colon != std::string::npos) {
      want_port = want_dev.substr(colon + 1);
      want_dev.resize(colon);
    }
  }
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr || n == 0) {
    if (list) ibv_free_device_list(list);
    fail(err, errlen, "no RDMA devices (ibv_get_device_list lists none)");
    return -1;
  }
  auto* c = new Ctx;
  c->cuda_device = cuda_device;
  std::string seen;
  for (int i = 0; i < n && c->ctx == nullptr; ++i) {
    const char* dev_name = ibv_get_device_name(list[i]);
    seen += std::string(seen.empty() ? "" : ", ") + dev_name;
    if (!want_dev.empty() && want_dev != dev_name) continue;
    if (!mlx5dv_is_supported(list[i])) continue;
    ibv_context* ctx = ibv_open_device(list[i]);
    if (ctx == nullptr) continue;
    ibv_device_attr dattr{};
    if (ibv_query_device(ctx, &dattr) != 0) {
      ibv_close_device(ctx);
      continue;
    }
    for (uint8_t p = 1; p <= dattr.phys_port_cnt; ++p) {
      if (!want_port.empty() && std::atoi(want_port.c_str()) != p) continue;
      if (!activePort(ctx, p, &c->port_attr)) continue;
      c->ctx = ctx;
      c->port = p;
      std::snprintf(name, namelen, "%s:%u", dev_name, p);
      break;
    }
    if (c->ctx == nullptr) ibv_close_device(ctx);
  }
  ibv_free_device_list(list);
  if (c->ctx == nullptr) {
    fail(err, errlen, "no mlx5 device with an active port%s%s among %s", want ? " matching " : "", want ? want : "",
         seen.c_str());
    closeCtx(c);
    return -1;
  }
  if (c->port_attr.link_layer == IBV_LINK_LAYER_ETHERNET) {
    c->gid_index = pickGid(c->ctx, c->port, c->port_attr.gid_tbl_len, gid_index);
    if (c->gid_index < 0 || ibv_query_gid(c->ctx, c->port, c->gid_index, &c->gid) != 0) {
      fail(err, errlen, "%s: no usable RoCE v2 GID (set MOELINK_IBGDA_GID_INDEX)", name);
      closeCtx(c);
      return -1;
    }
  }
  c->pd = ibv_alloc_pd(c->ctx);
  if (c->pd == nullptr) {
    fail(err, errlen, "%s: ibv_alloc_pd failed", name);
    closeCtx(c);
    return -1;
  }
  ibv_parent_domain_init_attr pa{};
  pa.pd = c->pd;
  pa.comp_mask = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS | IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT;
  pa.alloc = pdAlloc;
  pa.free = pdFree;
  pa.pd_context = c;
  c->parent = ibv_alloc_parent_domain(c->ctx, &pa);
  if (c->parent == nullptr) {
    fail(err, errlen, "%s: ibv_alloc_parent_domain with allocators failed (rdma-core too old?)", name);
    closeCtx(c);
    return -1;
  }
  // What the ranks agree on must hold: a queue pair whose queues the GPU reaches and whose
  // doorbell page it can map. Try one now (and drop it), so that a host where that fails
  // falls back to the proxy instead of failing the buffer.
  {
    Qp probe;
    char why[400] = {0};
    bool ok = makeQp(c, &probe, why, sizeof why);
    if (ok) {
      mlx5dv_qp dq{};
      mlx5dv_obj obj{};
      obj.qp.in = probe.qp;
      obj.qp.out = &dq;
      ok = mlx5dv_init_obj(&obj, MLX5DV_OBJ_QP) == 0 && deviceOf<unsigned char>(c, dq.sq.buf) != nullptr &&
           deviceOf<uint32_t>(c, dq.dbrec) != nullptr;
      if (!ok) std::snprintf(why, sizeof why, "the provider did not place the queues in the parent domain's memory");
      ok = ok && mapDoorbell(c, dq.bf.reg, why, sizeof why) != nullptr;
      ibv_destroy_qp(probe.qp);
      ibv_destroy_cq(probe.cq);
    }
    if (!ok) {
      fail(err, errlen, "%s: %s", name, why);
      closeCtx(c);
      return -1;
    }
  }
  *out = c;
  return 0;
}

__attribute__((visibility("default"))) int moelink_ibgda_reg(void* ctx, void* ptr, size_t bytes, uint32_t* lkey,
                                                             uint32_t* rkey, char* err, size_t errlen) {
  auto* c = static_cast<Ctx*>(ctx);
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  ibv_mr* mr = nullptr;
  // dma-buf: the range must be aligned to the host page size (cudaMalloc's allocations are).
  using GetHandle = CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  const size_t page = pageSize();
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  const bool have_fn = cudaGetDriverEntryPointByVersion("cuMemGetHandleForAddressRange", &fn, 11070,
                                                       cudaEnableDefault, &q) == cudaSuccess &&
                       fn != nullptr && q == cudaDriverEntryPointSuccess;
  if (addr % page == 0 && have_fn) {
    int fd = -1;
    const size_t len = (bytes + page - 1) / page * page;
    if (reinterpret_cast<GetHandle>(fn)(&fd, static_cast<CUdeviceptr>(addr), len,
                                        CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0) == CUDA_SUCCESS &&
        fd >= 0) {
      mr = ibv_reg_dmabuf_mr(c->pd, 0, len, addr, fd, access);
      close(fd);  // the registration holds its own reference
    }
  }
  if (mr == nullptr) mr = ibv_reg_mr(c->pd, ptr, bytes, access);  // nvidia_peermem
  if (mr == nullptr) {
    fail(err, errlen, "neither ibv_reg_dmabuf_mr nor ibv_reg_mr could register %zu bytes of GPU memory (errno %d: %s)",
         bytes, errno, std::strerror(errno));
    return -1;
  }
  c->mrs.push_back(mr);
  *lkey = mr->lkey;
  *rkey = mr->rkey;
  return 0;
}

// The queue pair to `peer` (and its CQ) goes; the GPU posts on it no more.
__attribute__((visibility("default"))) void moelink_ibgda_destroy_qp(void* ctx, int peer) {
  auto* c = static_cast<Ctx*>(ctx);
  for (auto it = c->qps.begin(); it != c->qps.end();) {
    if (it->peer != peer) {
      ++it;
      continue;
    }
    if (it->qp) ibv_destroy_qp(it->qp);
    if (it->cq) ibv_destroy_cq(it->cq);
    it = c->qps.erase(it);
  }
}

__attribute__((visibility("default"))) int moelink_ibgda_create_qp(void* ctx, int peer, unsigned char* addr,
                                                                   size_t* addrlen, char* err, size_t errlen) {
  auto* c = static_cast<Ctx*>(ctx);
  if (*addrlen < sizeof(Address)) {
    fail(err, errlen, "address buffer too small");
    return -1;
  }
  moelink_ibgda_destroy_qp(ctx, peer);  // a readmitted peer's new process gets a new queue pair
  Qp q;
  q.peer = peer;
  if (!makeQp(c, &q, err, errlen)) return -1;
  std::random_device rd;
  q.psn = rd() & 0xffffff;
  c->qps.push_back(q);
  Address a{};
  a.qpn = q.qp->qp_num;
  a.psn = q.psn;
  a.lid = c->port_attr.lid;
  a.mtu = static_cast<uint8_t>(c->port_attr.active_mtu);
  std::memcpy(a.gid, c->gid.raw, 16);
  std::memcpy(addr, &a, sizeof a);
  *addrlen = sizeof a;
  return 0;
}

__attribute__((visibility("default"))) int moelink_ibgda_connect(void* ctx, int peer, const unsigned char* addr,
                                                                 size_t addrlen, moelink_ibgda_queues* out, char* err,
                                                                 size_t errlen) {
  auto* c = static_cast<Ctx*>(ctx);
  Qp* q = nullptr;
  for (Qp& x : c->qps)
    if (x.peer == peer) q = &x;
  if (q == nullptr || addrlen != sizeof(Address)) {
    fail(err, errlen, q ? "bad queue-pair address" : "no queue pair to this peer");
    return -1;
  }
  Address r;
  std::memcpy(&r, addr, sizeof r);

  ibv_qp_attr at{};
  at.qp_state = IBV_QPS_INIT;
  at.pkey_index = 0;
  at.port_num = c->port;
  at.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  if (ibv_modify_qp(q->qp, &at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) != 0) {
    fail(err, errlen, "RESET -> INIT failed (errno %d: %s)", errno, std::strerror(errno));
    return -1;
  }
  at = ibv_qp_attr{};
  at.qp_state = IBV_QPS_RTR;
  const int mtu = static_cast<int>(c->port_attr.active_mtu);
  at.path_mtu = static_cast<ibv_mtu>(r.mtu < mtu ? r.mtu : mtu);
  at.dest_qp_num = r.qpn;
  at.rq_psn = r.psn;
  at.max_dest_rd_atomic = 1;
  at.min_rnr_timer = 12;
  at.ah_attr.port_num = c->port;
  at.ah_attr.dlid = r.lid;
  if (c->gid_index >= 0) {  // RoCE: routed by GID
    at.ah_attr.is_global = 1;
    std::memcpy(at.ah_attr.grh.dgid.raw, r.gid, 16);
    at.ah_attr.grh.sgid_index = static_cast<uint8_t>(c->gid_index);
    at.ah_attr.grh.hop_limit = 64;
  }
  if (ibv_modify_qp(q->qp, &at,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0) {
    fail(err, errlen, "INIT -> RTR failed (errno %d: %s)", errno, std::strerror(errno));
    return -1;
  }
  at = ibv_qp_attr{};
  at.qp_state = IBV_QPS_RTS;
  at.timeout = 14;
  at.retry_cnt = 7;
  at.rnr_retry = 7;
  at.sq_psn = q->psn;
  at.max_rd_atomic = 1;
  if (ibv_modify_qp(q->qp, &at,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                        IBV_QP_MAX_QP_RD_ATOMIC) != 0) {
    fail(err, errlen, "RTR -> RTS failed (errno %d: %s)", errno, std::strerror(errno));
    return -1;
  }

  mlx5dv_qp dq{};
  mlx5dv_cq dc{};
  if (!queuesOf(q, &dq, &dc, err, errlen)) return -1;
  const auto pow2 = [](uint32_t v) { return v != 0 && (v & (v - 1)) == 0; };
  if (dq.sq.stride != static_cast<uint32_t>(moelink::ep::ibgda::kBasicBlockBytes) || !pow2(dq.sq.wqe_cnt) ||
      dc.cqe_size != static_cast<uint32_t>(moelink::ep::ibgda::kCqeBytes) || !pow2(dc.cqe_cnt) ||
      dc.cqe_cnt < dq.sq.wqe_cnt / 64 + 2 || dq.bf.reg == nullptr) {
    fail(err, errlen, "unexpected queue shapes (SQ stride %u, %u WQEs, CQE size %u, %u CQEs)", dq.sq.stride,
         dq.sq.wqe_cnt, dc.cqe_size, dc.cqe_cnt);
    return -1;
  }
  uint64_t* doorbell = mapDoorbell(c, dq.bf.reg, err, errlen);
  if (doorbell == nullptr) return -1;
  out->wqes = deviceOf<unsigned char>(c, dq.sq.buf);
  out->sq_depth = dq.sq.wqe_cnt;
  out->qpn = q->qp->qp_num;
  out->sq_dbr = deviceOf<uint32_t>(c, dq.dbrec);
  out->doorbell = doorbell;
  out->cqes = deviceOf<unsigned char>(c, dc.buf);
  out->cq_depth = dc.cqe_cnt;
  out->cq_dbr = deviceOf<uint32_t>(c, dc.dbrec);
  if (!out->wqes || !out->sq_dbr || !out->cqes || !out->cq_dbr) {
    fail(err, errlen, "the provider did not place the queues in the parent domain's memory");
    return -1;
  }
  return 0;
}

// Teardown: the GPU's posters are done; post a signaled NOP behind their WQEs from the host
// (through the host's views of the same queues and doorbell) and wait for its completion.
__attribute__((visibility("default"))) int moelink_ibgda_drain(void* ctx, int peer,
                                                               const moelink_ibgda_progress* progress, int timeout_ms,
                                                               char* err, size_t errlen) {
  auto* c = static_cast<Ctx*>(ctx);
  Qp* q = nullptr;
  for (Qp& x : c->qps)
    if (x.peer == peer) q = &x;
  if (q == nullptr || q->qp == nullptr) {
    fail(err, errlen, "no queue pair to this peer");
    return -1;
  }
  if (progress->failed) {
    fail(err, errlen, "the queue pair had failed (an error completion)");
    return -1;
  }
  mlx5dv_qp dq{};
  mlx5dv_cq dc{};
  if (!queuesOf(q, &dq, &dc, err, errlen)) return -1;
  uint64_t tickets = progress->posted, ready = progress->posted, completed = progress->completed;
  moelink::ep::ibgda::QueuePair qp;
  qp.sq.wqes = static_cast<unsigned char*>(dq.sq.buf);
  qp.sq.depth = dq.sq.wqe_cnt;
  qp.sq.qpn = q->qp->qp_num;
  qp.sq.dbr = dq.dbrec;
  qp.sq.doorbell = static_cast<uint64_t*>(dq.bf.reg);
  qp.sq.tickets = &tickets;
  qp.sq.ready = &ready;
  qp.sq.completed = &completed;
  qp.cq.cqes = static_cast<const unsigned char*>(dc.buf);
  qp.cq.depth = dc.cqe_cnt;
  qp.cq.dbr = dc.dbrec;
  qp.cq.consumer = progress->cq_consumer;
  qp.signal_mask = progress->signal_mask;
  if (!moelink::ep::ibgda::drainQp(&qp, std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms))) {
    fail(err, errlen, qp.error ? "an error completion" : "no completion within %d ms", timeout_ms);
    return -1;
  }
  return 0;
}

__attribute__((visibility("default"))) void moelink_ibgda_close(void* ctx) { closeCtx(static_cast<Ctx*>(ctx)); }

}  // extern "C"
