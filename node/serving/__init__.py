"""The processes that serve between rounds (imports ``node.engine``, ``node.tasks``,
``node.models``; never the node itself).

One ASGI app (``server_app``) with two routers: the OpenAI API (``openai_api`` is its
command line; ``openai_routes``, ``openai_completion``, ``openai_protocol``,
``openai_state``) and the node's session API (``serve``, ``session_routes``). Shared by both:
``server_cli``, ``server_http`` (auth, body and header deadlines), ``serve_auth`` (tenants),
``fair_gate`` (admission), ``serve_metrics`` (/health, /metrics, the request log),
``served_model(s)`` (what is served), ``serving_cache`` (the KV tiers). Following the trainer:
``param_channel``, ``param_follower``, ``openai_follow``, ``dir_lease``. ``adapters`` exports
and imports PEFT adapters.
"""
