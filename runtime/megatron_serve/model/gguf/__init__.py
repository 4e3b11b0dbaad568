"""GGUF checkpoints (llama.cpp's format), served as vLLM serves them: read with the ``gguf`` library, dequantized
at load into the serving dtype. :mod:`.view` makes a file a model directory, :mod:`.metadata` reads its config,
:mod:`.tensors` its weights."""
