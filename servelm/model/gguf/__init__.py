"""The GGUF CPU backend: reading a GGUF file, and serving its weights in the blocks it stores.

- ``gguf_file``: the GGUF reader (``GGUFFile``): metadata -> transformers config, tensor names ->
  HF names, tensors dequantized to float32 (llama.cpp's Q/K permutation and Gemma's +1 norms undone).
- ``gguf_weights``: ``--quantization auto``/``gguf``: whether a model keeps the file's blocks
  (``resolve_quantization``), and the load that puts them in place of the float weights
  (``load_gguf_model``, ``apply_gguf_blocks``).
- ``gguf_blocks``: ``BlockWeight``, the lossless repack of a GGUF tensor into int8 codes with a
  scale (and offset) per block of 16 or 32 inputs.
- ``gguf_linear``: ``GGUFBlockLinearMethod`` (linears and the LM head on block weights) and
  ``BlockRows`` (the embedding); ``gguf_routes``: the routes a call can take, their quality rules
  and the default ranking (the measured one is ``servelm.model.routes``).
- C++ kernels, each built by its Python module (``CppKernel.beside``, cached per machine):
  ``gguf_kernel`` (``gguf_kernel.cpp`` AVX512-VNNI, ``gguf_kernel_avx2.cpp`` AVX2+FMA: the block
  linear), ``gguf_rows`` (``gguf_rows.cpp``, AVX512-BF16: the rows GEMM), ``gguf_i8gemm``
  (``gguf_i8gemm.cpp`` AVX512-VNNI, ``gguf_i8gemm_avx2.cpp`` AVX2+FMA: the int8 x int8 GEMM for prompt
  rows) and ``lm_head_screen``
  (``lm_head_screen.cpp``: the exact greedy screen of a Q8_0 LM head).

Nothing is imported here: import the module you need (``from servelm.model.gguf.gguf_file import
GGUFFile``).
"""
