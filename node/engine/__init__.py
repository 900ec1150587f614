"""Decoding through the paged KV cache (imports ``node.models`` only).

``generation`` is the request/stream contract; ``scheduler`` (continuous batching, one mixed
forward a step) and ``scheduler_backend`` run it on a thread, ``serial_backend`` one request
at a time (the baseline). ``sampling`` and ``structured_output`` pick tokens; ``sessions``
holds multi-turn chats; ``stop_text`` matches stop strings.
"""
