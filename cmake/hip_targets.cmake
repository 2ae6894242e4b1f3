# llmk_default_hip_targets(<out-var>): the AMD targets to build for when LLMK_HIP_ARCHITECTURES is
# not given. A HIP code object runs only on the exact processor it was built for (gfx940 code does
# not load on an MI300X, which is gfx942), so a fixed list would leave users' GPUs out. In order:
#   1. PYTORCH_ROCM_ARCH from the environment (PyTorch's own switch for its extensions; ';' or ' '),
#   2. this machine's GPUs (amdgpu-arch, else rocm_agent_enumerator),
#   3. without a GPU (packaging, CI): the current AMD data-centre and consumer targets this hipcc
#      can compile, with the closest target an older hipcc knows in place of one it does not.
function(llmk_default_hip_targets out)
  set(targets "")
  if(DEFINED ENV{PYTORCH_ROCM_ARCH} AND NOT "$ENV{PYTORCH_ROCM_ARCH}" STREQUAL "")
    string(REPLACE " " ";" targets "$ENV{PYTORCH_ROCM_ARCH}")
    set(source "PYTORCH_ROCM_ARCH")
  endif()
  if(NOT targets)
    get_filename_component(_hip_bin "${LLMK_HIPCC}" DIRECTORY)
    find_program(LLMK_AMDGPU_ARCH NAMES amdgpu-arch rocm_agent_enumerator
                 HINTS "${_hip_bin}" "${_hip_bin}/../llvm/bin" PATHS /opt/rocm/bin /opt/rocm/llvm/bin)
    if(LLMK_AMDGPU_ARCH)
      execute_process(COMMAND "${LLMK_AMDGPU_ARCH}" OUTPUT_VARIABLE _agents ERROR_QUIET TIMEOUT 30)
      string(REGEX MATCHALL "gfx[0-9a-f]+" _agents "${_agents}")
      list(REMOVE_ITEM _agents gfx000)  # rocm_agent_enumerator's name for the CPU agent
      list(REMOVE_DUPLICATES _agents)
      set(targets ${_agents})
      set(source "the GPUs of this machine (${LLMK_AMDGPU_ARCH})")
    endif()
  endif()
  if(NOT targets)
    # MI200, MI300 (X/A), RDNA2, RDNA3, Strix Halo, RDNA4; a ";"-list is "wanted|fallback".
    set(source "the default list, as far as ${LLMK_HIPCC} knows it")
    set(_probe "${CMAKE_BINARY_DIR}/llmk_hip_probe.hip")
    file(WRITE "${_probe}" "#include <hip/hip_runtime.h>\n__global__ void llmk_probe() {}\n")
    set(_unknown "")
    foreach(choice IN ITEMS "gfx90a" "gfx942|gfx940" "gfx1030" "gfx1100" "gfx1151" "gfx1201")
      string(REPLACE "|" ";" _options "${choice}")
      list(GET _options 0 _wanted)
      foreach(arch IN LISTS _options)
        execute_process(COMMAND "${LLMK_HIPCC}" -x hip --offload-arch=${arch} -c "${_probe}"
                                -o "${CMAKE_BINARY_DIR}/llmk_hip_probe.o"
                        RESULT_VARIABLE _rc OUTPUT_QUIET ERROR_QUIET TIMEOUT 120)
        if(_rc EQUAL 0)
          list(APPEND targets ${arch})
          if(NOT arch STREQUAL _wanted)
            message(WARNING "llmk: ${LLMK_HIPCC} cannot target ${_wanted}; building ${arch} instead, "
                            "whose code does not run on ${_wanted} GPUs: use a newer ROCm for those")
          endif()
          break()
        endif()
      endforeach()
      if(NOT _rc EQUAL 0)
        list(APPEND _unknown ${_wanted})
      endif()
    endforeach()
    if(_unknown)
      string(REPLACE ";" ", " _unknown "${_unknown}")
      message(STATUS "llmk: ${LLMK_HIPCC} cannot target ${_unknown}; a newer ROCm can")
    endif()
    file(REMOVE "${_probe}" "${CMAKE_BINARY_DIR}/llmk_hip_probe.o")
  endif()
  if(NOT targets)
    message(FATAL_ERROR "llmk: no AMD target found; pass -DLLMK_HIP_ARCHITECTURES=gfx...")
  endif()
  message(STATUS "llmk HIP targets from ${source}: ${targets}")
  set(${out} ${targets} PARENT_SCOPE)
endfunction()
