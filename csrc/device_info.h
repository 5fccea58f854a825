// flash_metal::metal_device_info's JSON, shared by its two implementations:
// csrc/mps/device_info.mm (macOS builds: what the Metal device and the
// shader library report) and csrc/device_info.cpp (every build: the fallback
// that says there is no device to report on). The keys are documented at the
// schema, in csrc/flash_metal.cpp. Header-only and portable: the MPS host's
// Linux test build (tests/mps_exec) compiles it too.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace flash_metal::device_info {

// The layout version in the "schema" key; bump it when a key changes meaning.
constexpr int kSchemaVersion = 1;

// A JSON string literal (RFC 8259 escaping; bytes >= 0x80 pass through, so
// UTF-8 stays UTF-8).
inline std::string quote(const std::string& text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

// A JSON object built key by key, in insertion order.
class Object {
 public:
  Object& raw(const std::string& key, const std::string& json) {
    body_ += (body_.empty() ? "" : ",") + quote(key) + ":" + json;
    return *this;
  }
  Object& str(const std::string& key, const std::string& value) { return raw(key, quote(value)); }
  Object& num(const std::string& key, int64_t value) { return raw(key, std::to_string(value)); }
  Object& unum(const std::string& key, uint64_t value) { return raw(key, std::to_string(value)); }
  Object& flag(const std::string& key, bool value) { return raw(key, value ? "true" : "false"); }
  Object& null(const std::string& key) { return raw(key, "null"); }
  std::string json() const { return "{" + body_ + "}"; }

 private:
  std::string body_;
};

// The "tensor_ops" object: whether Auto runs the Metal 4 tensor-op kernels
// (issue 21) in this process, and if not why; both sentences come from
// tensor_ops_problem (csrc/metal/plan.h), the rule the routing itself uses, so
// this never disagrees with explain(). reason: why Auto does not ("" when it
// does); forced_reason: why impl='tensor_ops' cannot run ("" when it can);
// family: the Apple GPU family the planner takes the device for (from its
// name, as the routing does), negative without a device.
inline std::string tensor_ops(const std::string& reason, const std::string& forced_reason, int64_t family) {
  Object o;
  o.flag("usable", reason.empty());
  if (reason.empty()) {
    o.null("reason");
  } else {
    o.str("reason", reason);
  }
  if (forced_reason.empty()) {
    o.null("forced_reason");
  } else {
    o.str("forced_reason", forced_reason);
  }
  if (family < 0) {
    o.null("gpu_family");
  } else {
    o.num("gpu_family", family);
  }
  return o.json();
}

// The whole answer when there is no device to describe: every key present,
// "available" false, `reason` saying why. `mps_backend`: whether this build
// has the MPS host at all; `macos`: the "macos" object, or "null".
inline std::string unavailable(const std::string& reason, bool mps_backend, const std::string& macos = "null") {
  return Object()
      .num("schema", kSchemaVersion)
      .flag("available", false)
      .str("reason", reason)
      .flag("mps_backend", mps_backend)
      .raw("macos", macos)
      .null("device")
      .null("library")
      .raw("pipelines", "[]")
      .raw("pipeline_errors", "[]")
      .raw("tensor_ops", tensor_ops("no Metal device: " + reason, "no Metal device: " + reason, -1))
      .json();
}

}  // namespace flash_metal::device_info
