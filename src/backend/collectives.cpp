#include "moelink/backend/collectives.h"

#include <map>

#include <c10/util/Exception.h>

namespace moelink::backend {

namespace {

std::map<c10::DeviceType, CollectivesFactory>& factories() {
  static auto* f = new std::map<c10::DeviceType, CollectivesFactory>;  // filled by static initializers
  return *f;
}

}  // namespace

bool registerCollectives(c10::DeviceType type, CollectivesFactory make) {
  factories()[type] = std::move(make);
  return true;
}

std::unique_ptr<Collectives> makeCollectives(c10::DeviceType type, const GroupContext& group) {
  if (type == c10::DeviceType::CPU) return makeCpuCollectives(group);
  auto it = factories().find(type);
  TORCH_CHECK_VALUE(it != factories().end(), "moelink: this build of moelink has no support for ",
                    c10::DeviceTypeName(type, /*lower_case=*/true), " tensors (for CUDA: nvcc was not found when it "
                    "was built); rebuild where it is installed, or use backend 'cpu:ep,cuda:nccl'");
  return it->second(group);
}

}  // namespace moelink::backend
