"""The node: one Flower client that is also a KV-cache node serving a language model.

Four rooms and the node itself, each importing only the rooms listed after it
(``tests/node/test_layout.py`` checks the direction):

* ``node.models`` -- model families and their weights: the byte transformer, SmolLM2's
  Llama (fetched by ``python -m node.models.smollm2 fetch``), LoRA, weight formats, the chat
  template, and ``CachedLM``, the one contract between a model and the rest of the node.
  Imports no other room.
* ``node.tasks`` -- what a node trains on and how: the tasks (digits, byte LM, chat), their
  data, example-level DP-SGD, the served chat workload. Imports ``node.models``.
* ``node.engine`` -- decoding through the paged cache: generation requests, the
  continuous-batching scheduler and the serial baseline, sampling and structured output, chat
  sessions. Imports ``node.models``.
* ``node.serving`` -- the processes that serve between rounds: the one ASGI server (OpenAI
  routes and the session API), its auth, limits and metrics, adapters in and out, the
  channel by which a server follows the trainer's write-backs. Imports ``node.engine``,
  ``node.tasks`` and ``node.models``.
* the node itself, here: ``cache_node`` (the client's state across rounds), ``serve_gate``
  (scoring a new global model before serving it) and ``workload_pass`` (one serving pass
  between rounds). It may import every room; no room imports it.
"""
