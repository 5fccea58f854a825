// Test driver for csrc/mps/shader_source.h: prints the single-source text
// the MPS backend hands to newLibraryWithSource:, so that tests on Linux can
// inspect it and compile it with the Metal emulator.
//   inline_shaders <path/to/attention.metal>   -> text on stdout, exit 0
//   on error                                   -> message on stderr, exit 1
#include "mps/shader_source.h"

#include <cstdio>
#include <exception>

int main(int argc, char** argv) {
  const bool hash = argc == 3 && std::string(argv[1]) == "--hash";
  if (argc != 2 && !hash) {
    std::fprintf(stderr, "usage: %s SHADER.metal | --hash SHADER_DIR\n", argv[0]);
    return 2;
  }
  try {
    const std::string text = hash ? flash_metal::shader_source::source_tree_hash(argv[2]) + "\n"
                                   : flash_metal::shader_source::inline_local_includes(argv[1]);
    std::fwrite(text.data(), 1, text.size(), stdout);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
