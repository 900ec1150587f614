"""Federation glue: Flower ServerApp and ClientApp around ``node``.

The modules here are the app: what runs in a round (``server_app``/``client_app``, ``run``,
``strategy``, the messages, codecs, accounting and the node's own store). Tools a person runs
beside a run live apart: ``federation.deploy`` (SuperLink, SuperNodes, provisioning,
clean-up) and ``federation.tools`` (plots, the configuration reference).
"""
