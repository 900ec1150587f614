"""The one wall-clock limit a test may put on something it waits for.

A test waits on the thing's own completion signal: a subprocess's exit, a ready line or file, a
condition it polls. A machine under load makes all of them slower, so no test passes or fails by
how fast that signal comes; the limit below only ends a wait that would never end (a hung child),
well before pytest-timeout (pyproject.toml: 1800 s) so that the child is killed and its output
reported. It is not a measure of speed.
"""

HANG_GUARD_S = 1200.0  # 20 min
