"""Model families and their weights (imports no other room of ``node``).

``interface.CachedLM`` is the contract every family implements over the cache's public API;
``byte_model`` (a tiny byte-level transformer) and ``llama`` (SmolLM2-135M-Instruct, whose
files ``smollm2`` fetches and checks) implement it. ``lora`` adapts a Llama (FFA-LoRA),
``precision`` converts weights (bf16, weight-only int8), ``chat`` is the chat template.
"""
