# Finds what moelink builds against. Everything here is installed by scripts/install.sh.
find_package(Threads REQUIRED)

# glog: its CMake package where present (Debian's libgoogle-glog-dev 0.6 ships one),
# else the plain library.
find_package(glog CONFIG QUIET)
if(TARGET glog::glog)
  add_library(moelink::glog ALIAS glog::glog)
else()
  find_library(GLOG_LIB glog REQUIRED)
  find_path(GLOG_INC glog/logging.h REQUIRED)
  add_library(moelink::glog INTERFACE IMPORTED)
  target_link_libraries(moelink::glog INTERFACE ${GLOG_LIB})
  target_include_directories(moelink::glog INTERFACE ${GLOG_INC})
endif()

find_package(gflags CONFIG QUIET)

# rdma-core: recorded for the rdma/ transport and IBGDA (built where headers exist).
find_path(MOELINK_IBVERBS_INCLUDE infiniband/verbs.h)
find_library(MOELINK_IBVERBS_LIB ibverbs)
find_library(MOELINK_MLX5_LIB mlx5)
if(MOELINK_IBVERBS_INCLUDE AND MOELINK_IBVERBS_LIB AND MOELINK_MLX5_LIB)
  set(MOELINK_HAVE_RDMA_CORE ON)
  message(STATUS "moelink: rdma-core found (${MOELINK_IBVERBS_LIB}, ${MOELINK_MLX5_LIB})")
else()
  set(MOELINK_HAVE_RDMA_CORE OFF)
  message(STATUS "moelink: rdma-core not found")
endif()

# CUDA: compiled for sm_90 when nvcc is present; the build works without it.
include(CheckLanguage)
if(NOT DEFINED CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
endif()
check_language(CUDA)
if(CMAKE_CUDA_COMPILER AND NOT CMAKE_CUDA_COMPILER STREQUAL "OFF")
  set(CMAKE_CUDA_ARCHITECTURES 90)
  enable_language(CUDA)
  set(MOELINK_HAVE_CUDA ON)
  message(STATUS "moelink: CUDA ${CMAKE_CUDA_COMPILER_VERSION} found, building for sm_90")
else()
  set(MOELINK_HAVE_CUDA OFF)
  message(STATUS "moelink: no CUDA compiler, building CPU-only")
endif()

# libtorch from the installed wheel, with the wheel's C++ ABI and its bundled pybind11.
# Linked directly (as torch.utils.cpp_extension does) rather than through TorchConfig.cmake,
# which on CUDA wheels insists on finding a full CUDA toolkit even for CPU-only code.
macro(moelink_find_torch)
  find_package(Python3 REQUIRED COMPONENTS Interpreter Development.Module)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c
      "import torch,os,sysconfig;d=os.path.dirname(torch.__file__);print(os.path.join(d,'include'));print(os.path.join(d,'lib'));print(int(torch._C._GLIBCXX_USE_CXX11_ABI));print(torch.__version__);print(sysconfig.get_config_var('EXT_SUFFIX'))"
    OUTPUT_VARIABLE _moelink_torch_info OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _moelink_torch_rc)
  if(NOT _moelink_torch_rc EQUAL 0)
    message(FATAL_ERROR "moelink: could not import torch with ${Python3_EXECUTABLE}; run scripts/install.sh")
  endif()
  string(REPLACE "\n" ";" _moelink_torch_info "${_moelink_torch_info}")
  list(GET _moelink_torch_info 0 _torch_inc)
  list(GET _moelink_torch_info 1 MOELINK_TORCH_LIB_DIR)
  list(GET _moelink_torch_info 2 _torch_abi)
  list(GET _moelink_torch_info 3 MOELINK_TORCH_VERSION)
  list(GET _moelink_torch_info 4 MOELINK_PY_SUFFIX)
  set(TORCH_INCLUDE_DIRS ${_torch_inc} ${_torch_inc}/torch/csrc/api/include)
  set(TORCH_LIBRARIES)
  foreach(_lib c10 torch torch_cpu)
    find_library(_moelink_lib_${_lib} ${_lib} PATHS ${MOELINK_TORCH_LIB_DIR} NO_DEFAULT_PATH REQUIRED)
    list(APPEND TORCH_LIBRARIES ${_moelink_lib_${_lib}})
  endforeach()
  set(MOELINK_TORCH_DEFS _GLIBCXX_USE_CXX11_ABI=${_torch_abi} TORCH_EXTENSION_NAME=_C)
  # The CUDA side of libtorch, for the EP buffer (present in CUDA wheels only).
  set(MOELINK_TORCH_CUDA_LIBRARIES)
  if(MOELINK_HAVE_CUDA)
    foreach(_lib c10_cuda torch_cuda)
      find_library(_moelink_lib_${_lib} ${_lib} PATHS ${MOELINK_TORCH_LIB_DIR} NO_DEFAULT_PATH)
      if(NOT _moelink_lib_${_lib})
        message(FATAL_ERROR "moelink: nvcc is present but torch has no ${_lib} (a CPU-only torch?); "
                            "install a CUDA build of torch or configure with -DCMAKE_CUDA_COMPILER=OFF")
      endif()
      list(APPEND MOELINK_TORCH_CUDA_LIBRARIES ${_moelink_lib_${_lib}})
    endforeach()
  endif()
  find_library(MOELINK_TORCH_PYTHON_LIB torch_python PATHS ${MOELINK_TORCH_LIB_DIR} NO_DEFAULT_PATH REQUIRED)
  message(STATUS "moelink: torch ${MOELINK_TORCH_VERSION} (${MOELINK_TORCH_LIB_DIR})")
endmacro()
