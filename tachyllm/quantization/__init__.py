"""Weight-only quantization (int8, int4, AWQ, GGUF-native int4) as a module swap after loading."""

from tachyllm.quantization.apply import QuantizationResult, quantize_model, quantized_weight_bytes

__all__ = ["QuantizationResult", "quantize_model", "quantized_weight_bytes"]
