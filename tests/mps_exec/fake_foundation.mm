// Fake Foundation for the execution test: NSObject (manual retain/release),
// NSString, NSArray, NSURL, NSError, NSProcessInfo and NSAutoreleasePool, over the GCC Objective-C
// runtime. Implements the declarations in tests/mps_syntax/stubs/Foundation;
// see fake_runtime.h for the object model. Never shipped.
#include "fake_runtime.h"

#include <cstdio>
#include <mutex>
#include <unordered_map>

// The GCC runtime's C API, declared here because its <objc/objc.h> defines
// BOOL differently from the stubs (unsigned char vs Apple's arm64 bool).
extern "C" id class_createInstance(Class cls, size_t extra_bytes);
extern "C" const char* class_getName(Class cls);
extern "C" const char* object_getClassName(id object);

namespace fm_exec {
namespace {

// Room for the class pointer the runtime stores at offset 0 (the class's own
// instance size is 1 byte: it declares no instance variables), rounded up to
// malloc's alignment. Why 16: 8 bytes of pointer, rounded to 16.
constexpr size_t kObjectBytes = 16;

struct Entry {
  std::string class_name;
  int64_t retain_count = 1;
  bool dead = false;
  NSString* label = nil;  // owned (+1); Metal objects' label property
  std::unique_ptr<Payload> payload;
};

std::mutex& objects_mutex() {
  static std::mutex m;
  return m;
}
// Leaked on purpose: objects may be released during static destruction.
std::unordered_map<const void*, Entry>& objects() {
  static auto* map = new std::unordered_map<const void*, Entry>();
  return *map;
}

thread_local std::vector<std::vector<id>> autorelease_pools;

}  // namespace

id allocate_object(Class cls) {
  id object = class_createInstance(cls, kObjectBytes);
  std::lock_guard<std::mutex> lock(objects_mutex());
  Entry& e = objects()[object];
  e.class_name = class_getName(cls);
  return object;
}

void set_payload(id object, std::unique_ptr<Payload> payload) {
  std::lock_guard<std::mutex> lock(objects_mutex());
  objects().at(object).payload = std::move(payload);
}

Payload* payload_of(id object) {
  std::lock_guard<std::mutex> lock(objects_mutex());
  auto it = objects().find(object);
  return it == objects().end() || it->second.dead ? nullptr : it->second.payload.get();
}

bool check_alive(id object, const char* what) {
  std::string problem;
  {
    std::lock_guard<std::mutex> lock(objects_mutex());
    auto it = objects().find(object);
    if (it == objects().end()) {
      problem = std::string(what) + " sent to an object no fake allocated";
    } else if (it->second.dead) {
      problem = std::string(what) + " sent to a deallocated " + it->second.class_name;
    }
  }
  if (problem.empty()) return true;
  record_error(problem);
  return false;
}

void retain(id object) {
  if (!check_alive(object, "retain")) return;
  std::lock_guard<std::mutex> lock(objects_mutex());
  ++objects().at(object).retain_count;
}

void release(id object) {
  if (!check_alive(object, "release")) return;
  std::unique_ptr<Payload> doomed;  // destroyed outside the lock: payloads may release other objects
  NSString* label = nil;
  {
    std::lock_guard<std::mutex> lock(objects_mutex());
    Entry& e = objects().at(object);
    if (--e.retain_count == 0) {
      e.dead = true;
      doomed = std::move(e.payload);
      std::swap(label, e.label);
    }
  }
  if (label != nil) release(label);
}

void autorelease(id object) {
  if (!check_alive(object, "autorelease")) return;
  if (autorelease_pools.empty()) {
    record_error(std::string("autorelease of a ") + object_getClassName(object) +
                 " with no @autoreleasepool in place: it would leak on macOS");
    return;
  }
  autorelease_pools.back().push_back(object);
}

void push_autorelease_pool() { autorelease_pools.emplace_back(); }

void pop_autorelease_pool() {
  if (autorelease_pools.empty()) {
    record_error("an autorelease pool was drained twice");
    return;
  }
  std::vector<id> drained = std::move(autorelease_pools.back());
  autorelease_pools.pop_back();
  for (id object : drained) release(object);
}

}  // namespace fm_exec

// Live fake objects by class (zombies excluded), for leak checks.
extern "C" __attribute__((visibility("default"))) const char* fm_exec_live_objects_json() {
  static thread_local std::string out;
  std::map<std::string, int64_t> counts;
  {
    std::lock_guard<std::mutex> lock(fm_exec::objects_mutex());
    for (const auto& [address, entry] : fm_exec::objects()) {
      if (!entry.dead) ++counts[entry.class_name];
    }
  }
  out = "{";
  for (const auto& [name, count] : counts) {
    if (out.size() > 1) out += ",";
    out += fm_exec::quote(name) + ":" + std::to_string(count);
  }
  out += "}";
  return out.c_str();
}

@implementation NSObject
+ (instancetype)alloc {
  return fm_exec::allocate_object(self);
}
- (instancetype)init {
  return self;
}
- (instancetype)retain {
  fm_exec::retain(self);
  return self;
}
- (oneway void)release {
  fm_exec::release(self);
}
- (instancetype)autorelease {
  fm_exec::autorelease(self);
  return self;
}
- (NSUInteger)retainCount {
  return static_cast<NSUInteger>(fm_exec::retain_count(self));
}
@end

// What clang's @autoreleasepool becomes under the GCC runtime:
// [[NSAutoreleasePool alloc] init] ... [pool drain].
@implementation NSAutoreleasePool
- (instancetype)init {
  fm_exec::push_autorelease_pool();
  return self;
}
- (void)drain {
  fm_exec::pop_autorelease_pool();
  fm_exec::release(self);
}
@end

namespace {
struct ArrayPayload : fm_exec::Payload {
  std::vector<id> items;  // each owned (+1)
  ~ArrayPayload() override {
    for (id item : items) [item release];
  }
};
struct StringPayload : fm_exec::Payload {
  std::string text;
};
struct URLPayload : fm_exec::Payload {
  std::string path;
};
struct ErrorPayload : fm_exec::Payload {
  NSString* description = nil;  // owned (+1)
  ~ErrorPayload() override { [description release]; }
};
}  // namespace

@implementation NSString
+ (instancetype)stringWithUTF8String:(const char*)nullTerminatedCString {
  NSString* s = [[self alloc] init];
  auto p = std::make_unique<StringPayload>();
  p->text = nullTerminatedCString;
  fm_exec::set_payload(s, std::move(p));
  return [s autorelease];
}
- (const char*)UTF8String {
  if (!fm_exec::check_alive(self, "-[NSString UTF8String]")) return nullptr;
  return fm_exec::payload<StringPayload>(self)->text.c_str();
}
@end

@implementation NSArray
- (NSUInteger)count {
  if (!fm_exec::check_alive(self, "-[NSArray count]")) return 0;
  return fm_exec::payload<ArrayPayload>(self)->items.size();
}
- (id)objectAtIndex:(NSUInteger)index {
  if (!fm_exec::check_alive(self, "-[NSArray objectAtIndex:]")) return nil;
  const auto& items = fm_exec::payload<ArrayPayload>(self)->items;
  if (index >= items.size()) {
    fm_exec::record_error("-[NSArray objectAtIndex:] index " + std::to_string(index) + " beyond " +
                          std::to_string(items.size()) + " (Cocoa raises NSRangeException)");
    return nil;
  }
  return items[index];
}
@end

// The running macOS, from the macos_version knob (100 * major + minor), the
// same version @available answers from.
@implementation NSProcessInfo
+ (NSProcessInfo*)processInfo {
  static NSProcessInfo* shared = [[NSProcessInfo alloc] init];  // a singleton, never released (as Cocoa's)
  return shared;
}
- (NSOperatingSystemVersion)operatingSystemVersion {
  const uint64_t v = fm_exec::knobs().macos_version;
  NSOperatingSystemVersion out{};
  if (!fm_exec::check_alive(self, "-[NSProcessInfo operatingSystemVersion]")) return out;
  out.majorVersion = static_cast<NSInteger>(v / 100);
  out.minorVersion = static_cast<NSInteger>(v % 100);
  return out;
}
@end

@implementation NSURL
+ (NSURL*)fileURLWithPath:(NSString*)path {
  NSURL* url = [[self alloc] init];
  auto p = std::make_unique<URLPayload>();
  p->path = [path UTF8String];
  fm_exec::set_payload(url, std::move(p));
  return [url autorelease];
}
@end

@implementation NSError
- (NSString*)localizedDescription {
  if (!fm_exec::check_alive(self, "-[NSError localizedDescription]")) return nil;
  return fm_exec::payload<ErrorPayload>(self)->description;
}
@end

namespace fm_exec {

std::string url_path(NSURL* url) {
  if (!check_alive(url, "a fake reading an NSURL")) return "";
  return payload<URLPayload>(url)->path;
}

NSError* make_error(const std::string& description) {
  NSError* error = [[NSError alloc] init];
  auto p = std::make_unique<ErrorPayload>();
  p->description = [[NSString stringWithUTF8String:description.c_str()] retain];
  set_payload(error, std::move(p));
  return [error autorelease];
}

NSString* autoreleased_string(const std::string& text) { return [NSString stringWithUTF8String:text.c_str()]; }

NSArray<NSString*>* autoreleased_string_array(const std::vector<std::string>& items) {
  NSArray* array = [[NSArray alloc] init];
  auto p = std::make_unique<ArrayPayload>();
  for (const std::string& item : items) p->items.push_back([autoreleased_string(item) retain]);
  set_payload(array, std::move(p));
  return [array autorelease];
}

NSArray* new_array(const std::vector<id>& items) {
  NSArray* array = [[NSArray alloc] init];
  auto p = std::make_unique<ArrayPayload>();
  for (id item : items) p->items.push_back([item retain]);
  set_payload(array, std::move(p));
  return array;
}

NSString* label_of(id object) {
  if (!check_alive(object, "-label")) return nil;
  std::lock_guard<std::mutex> lock(objects_mutex());
  return objects().at(object).label;
}

void set_label(id object, NSString* label, const char* what) {
  if (!check_alive(object, what)) return;
  // Apple's label property is `copy`: keep an own string.
  NSString* copy = label == nil ? nil : [[NSString stringWithUTF8String:string_of(label).c_str()] retain];
  NSString* old = nil;
  {
    std::lock_guard<std::mutex> lock(objects_mutex());
    old = objects().at(object).label;
    objects().at(object).label = copy;
  }
  [old release];
}

int64_t retain_count(id object) {
  if (!check_alive(object, "-retainCount")) return 0;
  std::lock_guard<std::mutex> lock(objects_mutex());
  return objects().at(object).retain_count;
}

void unmodelled(const std::string& what) {
  record_error(what + " is declared in tests/mps_syntax/stubs but not modelled by the fakes in tests/mps_exec: "
               "model it there if the host now needs it");
}

std::string string_of(NSString* s) {
  if (s == nil || !check_alive(s, "a fake reading an NSString")) return "";
  return payload<StringPayload>(s)->text;
}

}  // namespace fm_exec
