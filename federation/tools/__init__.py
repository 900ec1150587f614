"""Tools a person runs beside a federation, not part of a run: ``plot`` (a results JSON ->
curves and a CSV) and ``config_doc`` (docs/configuration.md from ``RunConfig``). The
deployment tools (SuperLink, SuperNodes, provisioning, clean-up) are ``federation.deploy``.
Imports ``federation``'s app modules; they never import this."""
