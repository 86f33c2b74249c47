# Locate the onnxruntime C API header (onnxruntime_c_api.h) for building normgrad_ops.
#
# normgrad_find_ort_headers(<out_var>) sets <out_var> to a directory that contains
# onnxruntime_c_api.h. Search order:
#   1. ORT_INCLUDE_DIR, as a CMake variable (-DORT_INCLUDE_DIR=...) or environment
#      variable; the directory itself or its onnxruntime/ subdirectory.
#   2. System headers (e.g. /usr/include/onnxruntime from an installed libonnxruntime-dev).
#   3. Debian's libonnxruntime-dev package from the "trixie" suite, downloaded with
#      `apt-get download` and unpacked with `dpkg-deb -x` into the build tree. apt runs
#      with a private sources list, package lists, cache and status file inside the
#      build tree, so nothing is installed or changed system-wide. The archive URI is
#      read from this machine's own apt configuration (/etc/apt/sources.list and
#      /etc/apt/sources.list.d/*.list|*.sources), never hard-coded.
# Set NORMGRAD_ORT_DEBIAN_SUITE to use another suite than trixie.
# Only headers are used: the library never links libonnxruntime.

function(_normgrad_ort_fail reason)
  message(FATAL_ERROR
    "normgrad: cannot find the onnxruntime C API headers (onnxruntime_c_api.h).\n"
    "${reason}\n"
    "onnxruntime's Python wheels ship no headers. Fix: download the headers matching any "
    "onnxruntime >= 1.17 (e.g. the 'include' folder of an onnxruntime release archive from "
    "https://github.com/microsoft/onnxruntime/releases, or Debian/Ubuntu's libonnxruntime-dev) "
    "and set ORT_INCLUDE_DIR to that folder, e.g.\n"
    "    ORT_INCLUDE_DIR=/path/to/onnxruntime/include pip install .\n")
endfunction()

function(_normgrad_header_dir dir out_var)
  set(${out_var} "" PARENT_SCOPE)
  foreach(candidate "${dir}" "${dir}/onnxruntime" "${dir}/onnxruntime/core/session")
    if(EXISTS "${candidate}/onnxruntime_c_api.h")
      set(${out_var} "${candidate}" PARENT_SCOPE)
      return()
    endif()
  endforeach()
endfunction()

# The Debian archive URI and keyring from the machine's apt sources: the first entry of
# Types "deb" whose suites are plain Debian codenames (no -security/-updates) and whose
# URI is not a -security archive.
function(_normgrad_debian_archive uri_var keyring_var)
  set(${uri_var} "" PARENT_SCOPE)
  set(${keyring_var} "" PARENT_SCOPE)
  set(files)
  if(EXISTS "/etc/apt/sources.list")
    list(APPEND files "/etc/apt/sources.list")
  endif()
  file(GLOB list_files "/etc/apt/sources.list.d/*.list")
  file(GLOB deb822_files "/etc/apt/sources.list.d/*.sources")
  list(SORT list_files)
  list(SORT deb822_files)
  list(APPEND files ${list_files})
  set(codenames "bullseye|bookworm|trixie|forky|sid|stable|testing|unstable|oldstable")
  # One-line format: deb [options] URI suite component...
  foreach(f IN LISTS files)
    file(STRINGS "${f}" lines)
    foreach(line IN LISTS lines)
      if(line MATCHES "^[ \t]*deb[ \t]+(\\[([^]]*)\\][ \t]+)?([^ \t]+)[ \t]+([^ \t]+)")
        set(opts "${CMAKE_MATCH_2}")
        set(uri "${CMAKE_MATCH_3}")
        set(suite "${CMAKE_MATCH_4}")
        if(suite MATCHES "^(${codenames})$" AND NOT uri MATCHES "-security/?$")
          set(key "")
          if(opts MATCHES "signed-by=([^ \t]+)")
            set(key "${CMAKE_MATCH_1}")
          endif()
          set(${uri_var} "${uri}" PARENT_SCOPE)
          set(${keyring_var} "${key}" PARENT_SCOPE)
          return()
        endif()
      endif()
    endforeach()
  endforeach()
  # deb822 format: stanzas separated by blank lines.
  foreach(f IN LISTS deb822_files)
    file(READ "${f}" text)
    string(REGEX REPLACE "\n[ \t]*\n" "\n@@STANZA@@\n" text "${text}")
    string(REPLACE ";" "\\;" text "${text}")
    string(REPLACE "\n@@STANZA@@\n" ";" stanzas "${text}")
    foreach(stanza IN LISTS stanzas)
      set(types "")
      set(uris "")
      set(suites "")
      set(key "")
      set(enabled "yes")
      string(REPLACE "\n" ";" slines "${stanza}")
      foreach(sl IN LISTS slines)
        if(sl MATCHES "^Types:[ \t]*(.*)$")
          set(types "${CMAKE_MATCH_1}")
        elseif(sl MATCHES "^URIs:[ \t]*(.*)$")
          set(uris "${CMAKE_MATCH_1}")
        elseif(sl MATCHES "^Suites:[ \t]*(.*)$")
          set(suites "${CMAKE_MATCH_1}")
        elseif(sl MATCHES "^Signed-By:[ \t]*(/[^ \t]+)[ \t]*$")
          set(key "${CMAKE_MATCH_1}")
        elseif(sl MATCHES "^Enabled:[ \t]*(.*)$")
          set(enabled "${CMAKE_MATCH_1}")
        endif()
      endforeach()
      if(NOT types MATCHES "(^| )deb( |$)" OR enabled MATCHES "^[Nn]o")
        continue()
      endif()
      separate_arguments(suite_list UNIX_COMMAND "${suites}")
      separate_arguments(uri_list UNIX_COMMAND "${uris}")
      set(plain FALSE)
      foreach(s IN LISTS suite_list)
        if(s MATCHES "^(${codenames})$")
          set(plain TRUE)
        endif()
      endforeach()
      if(NOT plain)
        continue()
      endif()
      foreach(u IN LISTS uri_list)
        if(NOT u MATCHES "-security/?$")
          set(${uri_var} "${u}" PARENT_SCOPE)
          set(${keyring_var} "${key}" PARENT_SCOPE)
          return()
        endif()
      endforeach()
    endforeach()
  endforeach()
endfunction()

function(_normgrad_fetch_debian_headers out_var)
  set(${out_var} "" PARENT_SCOPE)
  set(suite "trixie")
  if(DEFINED NORMGRAD_ORT_DEBIAN_SUITE)
    set(suite "${NORMGRAD_ORT_DEBIAN_SUITE}")
  endif()
  set(root "${CMAKE_BINARY_DIR}/_ort_headers")
  set(unpacked "${root}/unpacked")
  _normgrad_header_dir("${unpacked}/usr/include" cached)
  if(cached)
    set(${out_var} "${cached}" PARENT_SCOPE)
    return()
  endif()

  find_program(NORMGRAD_APT_GET apt-get)
  find_program(NORMGRAD_DPKG_DEB dpkg-deb)
  if(NOT NORMGRAD_APT_GET OR NOT NORMGRAD_DPKG_DEB)
    _normgrad_ort_fail("No ORT_INCLUDE_DIR, no system headers, and apt-get/dpkg-deb are not available to fetch Debian's libonnxruntime-dev.")
  endif()
  _normgrad_debian_archive(archive keyring)
  if(NOT archive)
    _normgrad_ort_fail("No ORT_INCLUDE_DIR, no system headers, and no Debian archive URI found in /etc/apt/sources.list or /etc/apt/sources.list.d/ to fetch libonnxruntime-dev (${suite}) from.")
  endif()
  # The keyring that signs the suite: the source's Signed-By if it carries the suite's key,
  # else Debian's archive keyring (debian-archive-keyring ships keys of the next release too).
  set(key_candidates)
  if(keyring)
    list(APPEND key_candidates "${keyring}")
  endif()
  list(APPEND key_candidates
    "/usr/share/keyrings/debian-archive-keyring.gpg"
    "/usr/share/keyrings/debian-archive-${suite}-stable.gpg"
    "/usr/share/keyrings/debian-archive-${suite}-automatic.gpg")
  set(signed_by "")
  foreach(k IN LISTS key_candidates)
    if(EXISTS "${k}")
      set(signed_by "${k}")
      break()
    endif()
  endforeach()
  if(NOT signed_by)
    _normgrad_ort_fail("No Debian archive keyring found (looked for ${key_candidates}) to verify ${archive} ${suite}; install debian-archive-keyring or set ORT_INCLUDE_DIR.")
  endif()

  message(STATUS "normgrad: fetching libonnxruntime-dev (${suite}) from ${archive} into ${root}")
  file(REMOVE_RECURSE "${root}")
  file(MAKE_DIRECTORY "${root}/etc/preferences.d" "${root}/lists/partial" "${root}/cache/archives/partial" "${root}/download" "${unpacked}")
  file(WRITE "${root}/etc/sources.list" "deb [signed-by=${signed_by}] ${archive} ${suite} main\n")
  file(WRITE "${root}/status" "")
  set(apt_options
    -o "Dir::Etc::SourceList=${root}/etc/sources.list"
    -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::Etc::Preferences=/dev/null"
    -o "Dir::Etc::PreferencesParts=${root}/etc/preferences.d"
    -o "Dir::State=${root}"
    -o "Dir::State::Lists=${root}/lists"
    -o "Dir::State::Status=${root}/status"
    -o "Dir::Cache=${root}/cache"
    -o "Dir::Cache::pkgcache="
    -o "Dir::Cache::srcpkgcache="
    -o "Debug::NoLocking=1"
    -o "APT::Sandbox::User=root"
    -o "Acquire::Languages=none"
    -o "APT::Get::List-Cleanup=0"
    -q)
  execute_process(COMMAND "${NORMGRAD_APT_GET}" ${apt_options} update
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    _normgrad_ort_fail("`apt-get update` with a private sources list (${archive} ${suite}) failed (${rc}):\n${out}\n${err}")
  endif()
  execute_process(COMMAND "${NORMGRAD_APT_GET}" ${apt_options} download libonnxruntime-dev
    WORKING_DIRECTORY "${root}/download"
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  file(GLOB debs "${root}/download/libonnxruntime-dev_*.deb")
  if(NOT rc EQUAL 0 OR NOT debs)
    _normgrad_ort_fail("`apt-get download libonnxruntime-dev` from ${archive} ${suite} failed (${rc}):\n${out}\n${err}")
  endif()
  list(GET debs 0 deb)
  execute_process(COMMAND "${NORMGRAD_DPKG_DEB}" -x "${deb}" "${unpacked}"
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  _normgrad_header_dir("${unpacked}/usr/include" found)
  if(NOT rc EQUAL 0 OR NOT found)
    _normgrad_ort_fail("Unpacking ${deb} with dpkg-deb -x failed or it holds no onnxruntime_c_api.h (${rc}): ${err}")
  endif()
  # Keep only the headers; drop package lists and the archive.
  file(REMOVE_RECURSE "${root}/lists" "${root}/cache" "${root}/download")
  set(${out_var} "${found}" PARENT_SCOPE)
endfunction()

function(normgrad_find_ort_headers out_var)
  set(dir "")
  if(DEFINED ORT_INCLUDE_DIR AND NOT "${ORT_INCLUDE_DIR}" STREQUAL "")
    set(dir "${ORT_INCLUDE_DIR}")
  elseif(DEFINED ENV{ORT_INCLUDE_DIR} AND NOT "$ENV{ORT_INCLUDE_DIR}" STREQUAL "")
    set(dir "$ENV{ORT_INCLUDE_DIR}")
  endif()
  if(dir)
    _normgrad_header_dir("${dir}" found)
    if(NOT found)
      _normgrad_ort_fail("ORT_INCLUDE_DIR=${dir} does not contain onnxruntime_c_api.h (looked in it and its onnxruntime/ subfolder).")
    endif()
    set(${out_var} "${found}" PARENT_SCOPE)
    return()
  endif()
  find_path(NORMGRAD_SYSTEM_ORT_INCLUDE onnxruntime_c_api.h
    PATH_SUFFIXES onnxruntime onnxruntime/core/session
    PATHS /usr/include /usr/local/include)
  if(NORMGRAD_SYSTEM_ORT_INCLUDE)
    set(${out_var} "${NORMGRAD_SYSTEM_ORT_INCLUDE}" PARENT_SCOPE)
    return()
  endif()
  _normgrad_fetch_debian_headers(found)
  set(${out_var} "${found}" PARENT_SCOPE)
endfunction()
