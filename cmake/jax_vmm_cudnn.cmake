# The cuDNN attention backend (ffi/src/ops/attention/cudnn/): cuDNN SDPA graphs inside
# jax_vmm's custom calls, through the header-only cuDNN frontend in dynamic-loading mode,
# so the module never links libcudnn and still imports without it.
#
# JAX_VMM_CUDNN: AUTO (default) builds it when the CUDA kernels are built and both cudnn.h
# and cudnn_frontend.h are found; ON requires it; OFF skips it.
# Header search (first hit wins):
#   cudnn.h            JAX_VMM_CUDNN_INCLUDE (CMake or environment), the nvidia-cudnn wheel
#                      of this Python (nvidia/cudnn/include), the CUDA toolkit, /usr/include
#   cudnn_frontend.h   JAX_VMM_CUDNN_FRONTEND_INCLUDE (CMake or environment), the
#                      nvidia-cudnn-frontend wheel of this Python (its include/ folder)
# Expects jax_vmm_core, _core, _use_cuda, _src and Python_EXECUTABLE from the top-level CMakeLists.txt.
set(JAX_VMM_CUDNN "AUTO" CACHE STRING "Build the cuDNN attention backend: AUTO, ON or OFF")
set_property(CACHE JAX_VMM_CUDNN PROPERTY STRINGS AUTO ON OFF)

function(_jax_vmm_cudnn_skip why)
  if(JAX_VMM_CUDNN STREQUAL "ON")
    message(FATAL_ERROR "jax_vmm: JAX_VMM_CUDNN=ON but ${why}")
  endif()
  message(STATUS "jax_vmm: cuDNN attention backend OFF (${why})")
endfunction()

function(_jax_vmm_python_path code out)
  execute_process(COMMAND "${Python_EXECUTABLE}" -c "${code}"
                  OUTPUT_VARIABLE _p OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE _rc ERROR_QUIET)
  if(_rc EQUAL 0 AND _p)
    set(${out} "${_p}" PARENT_SCOPE)
  else()
    set(${out} "" PARENT_SCOPE)
  endif()
endfunction()

function(_jax_vmm_add_cudnn)
  if(JAX_VMM_CUDNN STREQUAL "OFF")
    message(STATUS "jax_vmm: cuDNN attention backend OFF (JAX_VMM_CUDNN=OFF)")
    return()
  endif()
  if(NOT _use_cuda)
    _jax_vmm_cudnn_skip("the CUDA kernels are not built")
    return()
  endif()

  # cudnn.h
  _jax_vmm_python_path(
    "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'include'))"
    _wheel_cudnn)
  find_path(JAX_VMM_CUDNN_INCLUDE_DIR cudnn.h
            HINTS ${JAX_VMM_CUDNN_INCLUDE} $ENV{JAX_VMM_CUDNN_INCLUDE} ${_wheel_cudnn}
                  ${CUDAToolkit_INCLUDE_DIRS} /usr/include /usr/local/cuda/include
                  /usr/include/x86_64-linux-gnu
            NO_CACHE)
  if(NOT JAX_VMM_CUDNN_INCLUDE_DIR)
    _jax_vmm_cudnn_skip("cudnn.h not found (set JAX_VMM_CUDNN_INCLUDE)")
    return()
  endif()
  file(STRINGS "${JAX_VMM_CUDNN_INCLUDE_DIR}/cudnn_version.h" _major
       REGEX "#define CUDNN_MAJOR [0-9]+")
  string(REGEX MATCH "[0-9]+" _major "${_major}")
  if(NOT _major OR _major LESS 9)
    _jax_vmm_cudnn_skip("${JAX_VMM_CUDNN_INCLUDE_DIR}/cudnn.h is not cuDNN 9 (major '${_major}')")
    return()
  endif()

  # cudnn_frontend.h
  _jax_vmm_python_path(
    "import importlib.metadata as m; print([str(f.locate().parent) for f in m.files('nvidia-cudnn-frontend') if str(f).endswith('include/cudnn_frontend.h')][0])"
    _wheel_frontend)
  find_path(JAX_VMM_CUDNN_FRONTEND_INCLUDE_DIR cudnn_frontend.h
            HINTS ${JAX_VMM_CUDNN_FRONTEND_INCLUDE} $ENV{JAX_VMM_CUDNN_FRONTEND_INCLUDE}
                  ${_wheel_frontend}
            NO_DEFAULT_PATH NO_CACHE)
  if(NOT JAX_VMM_CUDNN_FRONTEND_INCLUDE_DIR)
    _jax_vmm_cudnn_skip("cudnn_frontend.h not found (pip install nvidia-cudnn-frontend, or set JAX_VMM_CUDNN_FRONTEND_INCLUDE)")
    return()
  endif()
  # Frontends from 1.19 include nvrtc.h (their experimental engines): it must be found.
  if(EXISTS "${JAX_VMM_CUDNN_FRONTEND_INCLUDE_DIR}/cudnn_frontend/experimental/nvrtc_shim.h")
    find_path(_nvrtc_dir nvrtc.h HINTS ${CUDAToolkit_INCLUDE_DIRS} NO_CACHE)
    if(NOT _nvrtc_dir)
      _jax_vmm_cudnn_skip("this cuDNN frontend (1.19 or newer) needs nvrtc.h, which the CUDA toolkit lacks: use nvidia-cudnn-frontend 1.18.0")
      return()
    endif()
  endif()

  # The backend lives in the core library (beside the CUDA kernels); _core binds it.
  target_sources(jax_vmm_core PRIVATE
    ${_src}/ops/attention/cudnn/cudnn_attention_cache_cuda.cc
    ${_src}/ops/attention/cudnn/cudnn_attention_cuda.cc
    ${_src}/ops/attention/cudnn/cudnn_library.cc
    ${_src}/ops/attention/cudnn/cudnn_rows.cu
    ${_src}/ops/attention/cudnn/cudnn_sdpa.cc)
  target_sources(_core PRIVATE ${_src}/python/cudnn_bindings.cc)
  target_include_directories(jax_vmm_core SYSTEM PRIVATE ${JAX_VMM_CUDNN_INCLUDE_DIR}
                                                         ${JAX_VMM_CUDNN_FRONTEND_INCLUDE_DIR})
  target_include_directories(_core SYSTEM PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
  # Dynamic loading: every cuDNN call goes through the handle cudnn_library.cc sets, so the
  # library needs no libcudnn to load. No JSON: graph serialization is not used.
  target_compile_definitions(jax_vmm_core PRIVATE NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING=1
                                                  CUDNN_FRONTEND_SKIP_JSON_LIB=1)
  target_compile_definitions(jax_vmm_core PUBLIC JAX_VMM_HAVE_CUDNN=1)
  message(STATUS "jax_vmm: cuDNN attention backend ON (cudnn.h: ${JAX_VMM_CUDNN_INCLUDE_DIR}, "
                 "cudnn_frontend.h: ${JAX_VMM_CUDNN_FRONTEND_INCLUDE_DIR})")
endfunction()

_jax_vmm_add_cudnn()
