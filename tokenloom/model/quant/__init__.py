"""Weight formats behind one linear layer, chosen once at load time (model/loader.py's `quantize_model`
swaps the modules in):

- dense (default): the GGUF weights dequantized to float32 (or cast to `dtype`), `F.linear`.
- int4: weight-only 4-bit straight from the GGUF's 4-bit blocks (w = d*q + m per block of 32, q in
  0..15; Q5_0's 5-bit codes as int5 on the C kernels), by the first of these that runs here
  (`gemm.quant_gemm()`, `probe.detect()`): the C kernels (`gemm`), else torch's
  `aten._weight_int4pack_mm_for_cpu` with bfloat16 activations, bit-exact against the dequantized
  weights with float32 scales (tests/test_fast_paths.py).
- int8: per-output-channel int8 (C kernel, else `torch._weight_int8pack_mm`), requantized from the
  dense weights; grouped (a scale per group of 32: the projections a GGUF stores wider than 5 bits) on
  the C kernels, on AVX-512 by VNNI over the int4 kernels' int8 activations.
- int4 + dense prefill (`quantize_model(dense_prefill=True)`; not what `auto` loads): int4 for decode
  rows and short prefill chunks, the same weights dequantized to bfloat16 for long prefill chunks
  through oneDNN, for a bfloat16 copy of every weight (1.5x a Q4 file's size); kept off while it gains
  little (benchmarks/forward_levers.py measures it). Int8 activations keep their outliers in float32:
  without that they cost several points of top-1 agreement (tests/test_fast_paths.py).
- the LM head (`head.RescoredHead`): a few-bit scan of the vocabulary, its best candidates rescored
  exactly in float32.

Every kernel here gives each row of the output the same bits whatever the number of rows (checked in
the tests), so greedy decoding stays batch-invariant as long as one format serves all batch sizes.

Modules, one job each: `formats` (the names, the group size), `layouts` (quantization math and each
kernel's packing), `gemm` (the C kernels' ctypes front and which runs here), `modules` (the quantized
projections), `head` (the rescored LM head), `probe` (what runs here, and the format a load takes).
GGUF's block formats are decoded beside the other GGUF readers (model/gguf_blocks.py).
"""
