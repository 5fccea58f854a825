// Turns the shipped shader sources into the single string Metal's runtime
// compiler needs. MTLCompileOptions has no include path, so
// newLibraryWithSource: cannot resolve `#include "post/attention_tiled.h"`;
// this inlines every local (quoted) include, recursively, each file once.
//
// Portable C++ with no Objective-C, no Metal and no torch, so that a Linux
// test (tests/mps/test_mps_host.py) can compile it into a tiny binary and hand
// its output to the project's Metal emulator. Header-only on purpose: the
// .mm includes it, and setup.py compiles only csrc/mps/*.mm on macOS.
//
// Rules, which the shaders in shaders/ follow:
// - `#include "x"` is local: resolved relative to the including file's
//   directory (shaders/ has family subfolders: "../common/params.h") and
//   inlined. `#include <x>` (metal_stdlib) is left for the compiler.
// - A file is known by its path with "." and "dir/.." segments removed, so
//   "prefill/../common/params.h" and "decode/../common/params.h" are one file.
// - Each local file is inlined once, at its first include; later includes of
//   it are dropped. That equals `#pragma once` as long as local includes are
//   not inside #if blocks (ours never are), and `#pragma once` lines of
//   inlined files are blanked (they would warn in a main file).
// - `#line` markers keep compiler diagnostics pointing at the original files.
//
// Also here: the fingerprint of a shader directory (source_tree_hash), which
// setup.py writes beside the metallib it builds and library.mm recomputes
// from the installed sources, so that a metallib built from other sources
// is never used.
#pragma once

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace flash_metal::shader_source {

// Directory part of a path ("a/b/c.h" -> "a/b"; "c.h" -> ".").
inline std::string directory_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

inline std::string basename_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// `path` with its "." segments and each "name/.." pair removed, textually
// (no file system access; symbolic links are not followed): "a/b/../c.h" ->
// "a/c.h", "./x.h" -> "x.h", "../x.h" stays (nothing to cancel). A leading
// "/" is kept.
inline std::string normalize_path(const std::string& path) {
  const bool absolute = !path.empty() && path[0] == '/';
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find('/', start);
    if (end == std::string::npos) end = path.size();
    const std::string part = path.substr(start, end - start);
    if (part.empty() || part == ".") {
      // nothing
    } else if (part == ".." && !parts.empty() && parts.back() != "..") {
      parts.pop_back();
    } else if (!(part == ".." && absolute)) {  // "/.." is "/"
      parts.push_back(part);
    }
    start = end + 1;
  }
  std::string out = absolute ? "/" : "";
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? "/" : "") + parts[i];
  return out.empty() ? "." : out;
}

namespace detail {

// True if `line` is the preprocessor directive `# <word> ...`; then *rest is
// what follows `word`, leading blanks removed.
inline bool directive(const std::string& line, const char* word, std::string* rest) {
  size_t i = line.find_first_not_of(" \t");
  if (i == std::string::npos || line[i] != '#') return false;
  i = line.find_first_not_of(" \t", i + 1);
  const std::string w(word);
  if (i == std::string::npos || line.compare(i, w.size(), w) != 0) return false;
  const size_t after = i + w.size();
  // "#includefoo" is not "#include": the word must end there.
  if (after < line.size() && line[after] != ' ' && line[after] != '\t' && line[after] != '"' &&
      line[after] != '<') {
    return false;
  }
  const size_t r = line.find_first_not_of(" \t", after);
  *rest = r == std::string::npos ? "" : line.substr(r);
  return true;
}

// `"x.h"` -> x.h for a quoted include; false for <x> and anything else.
inline bool quoted_name(const std::string& rest, std::string* name) {
  if (rest.empty() || rest[0] != '"') return false;
  const size_t close = rest.find('"', 1);
  if (close == std::string::npos) throw std::runtime_error("unterminated #include \"" + rest);
  *name = rest.substr(1, close - 1);
  return true;
}

inline std::string read_file(const std::string& path, const std::string& included_from) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw std::runtime_error("cannot read shader source '" + path + "'" +
                             (included_from.empty() ? "" : " (included from " + included_from + ")"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

inline void inline_into(const std::string& path, const std::string& included_from, std::set<std::string>* seen,
                        std::string* out) {
  seen->insert(path);
  std::istringstream lines(read_file(path, included_from));
  const std::string shown = basename_of(path);
  *out += "#line 1 \"" + shown + "\"\n";
  std::string line, rest, name;
  for (int number = 1; std::getline(lines, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!included_from.empty() && directive(line, "pragma", &rest) && rest.rfind("once", 0) == 0) {
      *out += "\n";  // blank, so the #line numbering below stays exact
      continue;
    }
    if (directive(line, "include", &rest) && quoted_name(rest, &name)) {
      const std::string child = normalize_path(directory_of(path) + "/" + name);
      if (!seen->count(child)) {
        inline_into(child, path, seen, out);
      }
      // Resume the numbering of this file after the inlined text.
      *out += "#line " + std::to_string(number + 1) + " \"" + shown + "\"\n";
      continue;
    }
    *out += line;
    *out += "\n";
  }
}

}  // namespace detail

// The full text of `path` with every local include inlined (see the rules
// above). Throws std::runtime_error naming a file that cannot be read.
// Paths are joined and normalized textually (normalize_path).
inline std::string inline_local_includes(const std::string& path) {
  std::set<std::string> seen;
  std::string out;
  detail::inline_into(normalize_path(path), "", &seen, &out);
  return out;
}

// --- The fingerprint of the shader sources -------------------------------------------------
//
// FNV-1a, 64 bit: it detects a metallib built from other sources (a stale
// build, an edited checkout), not tampering, so a short non-cryptographic
// hash that setup.py can mirror in three lines is enough and needs no crypto
// library on either side. Its two constants are FNV's published 64-bit
// offset basis and prime.
constexpr uint64_t kFnvOffsetBasis = 0xcbf29ce484222325ULL;
constexpr uint64_t kFnvPrime = 0x100000001b3ULL;

inline uint64_t fnv1a64(const std::string& bytes, uint64_t hash = kFnvOffsetBasis) {
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= kFnvPrime;
  }
  return hash;
}

// True for the files setup.py ships as shader sources (and hashes): *.metal and *.h,
// never a dot-file (an AppleDouble "._attention.metal" that macOS leaves beside copies).
inline bool is_shader_file(const std::string& name) {
  if (name.empty() || name[0] == '.') return false;
  auto ends_with = [&](const std::string& tail) {
    return name.size() > tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  return ends_with(".metal") || ends_with(".h");
}

namespace detail {

// Appends to *names the path, relative to `root` and joined with '/', of
// every shader file (is_shader_file) under root/rel, in every subfolder but
// hidden ones (a name starting with '.').
inline void list_shader_files(const std::string& root, const std::string& rel, std::vector<std::string>* names) {
  const std::string dir = rel.empty() ? root : root + "/" + rel;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) throw std::runtime_error("cannot list shader directory '" + dir + "'");
  std::vector<std::string> subdirs;
  while (const dirent* entry = readdir(d)) {
    const std::string name = entry->d_name;
    if (name.empty() || name[0] == '.') continue;  // ".", "..", hidden files and folders
    const std::string child = rel.empty() ? name : rel + "/" + name;
    struct stat st;
    if (stat((root + "/" + child).c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
      subdirs.push_back(child);
    } else if (is_shader_file(name)) {
      names->push_back(child);
    }
  }
  closedir(d);
  for (const std::string& sub : subdirs) list_shader_files(root, sub, names);
}

}  // namespace detail

// The fingerprint of the shader sources under `dir` (its family subfolders
// included), as 16 lowercase hex digits: FNV-1a-64 over, for each *.metal
// and *.h file in byte order of its path relative to `dir` ('/'-separated:
// "common/params.h"), "<path>\n<size in bytes>\n<contents>". setup.py's
// shader_sources_hash computes the same. Throws std::runtime_error if a
// directory or a file cannot be read.
inline std::string source_tree_hash(const std::string& dir) {
  std::vector<std::string> names;
  detail::list_shader_files(dir, "", &names);
  std::sort(names.begin(), names.end());
  uint64_t hash = kFnvOffsetBasis;
  for (const std::string& name : names) {
    const std::string text = detail::read_file(dir + "/" + name, "");
    hash = fnv1a64(name + "\n" + std::to_string(text.size()) + "\n", hash);
    hash = fnv1a64(text, hash);
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(hash));
  return hex;
}

}  // namespace flash_metal::shader_source
