"""What this machine's Metal device reports, as Markdown: reported, never asserted.

The macOS CI runs `python tests/device_report.py >> "$GITHUB_STEP_SUMMARY"` before
its tests, so every run shows the runner's GPU (a paravirtual device on the
hosted runners), its supportsFamily answers, which shader library loaded, and
what the family rules out for these kernels (backends.device_family_gaps; the
mps tests skip with the same reason). The data comes from
torch.ops.flash_metal.metal_device_info(). Exit status 1 only if that op could
not be called at all (the CI step is continue-on-error: reported, not fatal).
"""
import json
import sys


def _yes_no(value):
    return {True: "yes", False: "no", None: "not asked (older macOS)"}.get(value, str(value))


def report(info, error=None, mps_reason=None, torch_version="?"):
    """The Markdown report for metal_device_info's answer `info` (a dict), or for `error` if it failed."""
    lines = ["### Metal device (`torch.ops.flash_metal.metal_device_info()`)", ""]
    if error is not None:
        return "\n".join(lines + [f"**Could not ask the device:** {error}", ""])
    device = info.get("device") or {}
    library = info.get("library") or {}
    macos = info.get("macos") or {}
    rows = [("torch", torch_version), ("macOS", macos.get("version", "?"))]
    if not info.get("available"):
        rows.append(("device", f"none: {info.get('reason')}"))
    else:
        rows += [
            ("device", f"{device.get('name', '?')} (found via {device.get('source', '?')})"),
            ("max threads per threadgroup", device.get("max_threads_per_threadgroup", "?")),
            ("max threadgroup memory", f"{device.get('max_threadgroup_memory_length', '?')} bytes"),
            ("shader library", library.get("origin") or library.get("error") or "?"),
        ]
    rows.append(("mps tests", "run" if mps_reason is None else f"skipped: {mps_reason}"))
    lines += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows] + [""]
    families = device.get("families") or {}
    if families:
        lines += ["| GPU family (`supportsFamily`) | |", "|---|---|"]
        lines += [f"| {name} | {_yes_no(value)} |" for name, value in families.items()] + [""]
    import backends

    gaps = backends.device_family_gaps(info)
    lines.append("**What the GPU family rules out:** " + ("; ".join(gaps) if gaps else "nothing we know of"))
    lines += ["", "<details><summary>raw JSON</summary>", "", "```json", json.dumps(info, indent=2), "```",
              "", "</details>", ""]
    return "\n".join(lines)


def main():
    try:
        import torch

        import backends

        info = backends.metal_device_info()
    except Exception as err:  # noqa: BLE001  (reported, whatever it is)
        print(report(None, error=f"{type(err).__name__}: {err}"))
        return 1
    print(report(info, mps_reason=backends.mps_skip_reason(), torch_version=torch.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
