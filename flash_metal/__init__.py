"""flash_metal: exact attention in O(N) memory for PyTorch on Apple GPUs (and CPU).

    import flash_metal
    out = flash_metal.attention(q, k, v, causal=True)

The operator itself is torch.ops.flash_metal.attention_forward; importing this
package loads the compiled extension, which registers it.
"""
import warnings

# torch's own import (torch.export pulls in torch.fx) warns "Failed to
# initialize NumPy" in a venv without NumPy, such as the README's first
# command makes. flash_metal never uses NumPy, so when this package is what
# first imports torch (python -m flash_metal.demo), that one warning is
# filtered; any other warning still shows, and NumPy calls on tensors still
# raise torch's own clear error.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401  (the extension links against torch's libraries)

from . import _C  # noqa: F401  (registers torch.ops.flash_metal.*)
from . import ops as _ops  # noqa: F401  (fake implementations, autograd)
from . import reference
from .cpu_paths import cpu_features, cpu_path
from .flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from .ops import (attention, attention_kvcache_with_lse, attention_varlen, attention_varlen_with_lse,
                  attention_with_lse, explain)
from .quantized_kv import QuantizedKV, dequantize_kv, quantize_kv
from .sdpa import explain_sdpa, patch, scaled_dot_product_attention, sdpa_route, unpatch
from . import hf as _hf
from ._device_info import device_info

_hf.install()  # "metal_attention" for transformers, if installed (never imported otherwise)

__all__ = ["attention", "attention_kvcache_with_lse", "attention_varlen", "attention_varlen_with_lse", "attention_with_lse",
           "cpu_features", "cpu_path", "dequantize_kv", "device_info", "explain",
           "explain_sdpa", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "patch",
           "QuantizedKV", "quantize_kv", "reference", "scaled_dot_product_attention", "sdpa_route", "unpatch"]
__version__ = "0.1.0"
