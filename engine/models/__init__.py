"""Llama-family models and their checkpoints.

Modules:

* ``config``: the model's shape, read from a Hugging Face ``config.json`` (torch-free).
* ``layers``: tensor-parallel linear, embedding and LM-head layers (the identity at size 1), each
  with a ``weight_loader`` that reads only its rank's part of a checkpoint tensor.
* ``llama``: the decoder (Llama, Mistral, Qwen2, Qwen3) of one rank, for every parallel size.
* ``loader``: the one checkpoint loader (checkpoint name -> parameter and shard id -> weight_loader).
* ``synthetic``: random-weight checkpoints and a locally trained tokenizer, for tests and benchmarks.
"""
