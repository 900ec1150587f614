"""crypto.seal_io: secret keys pass through scratch files; each must be 0600 in a 0700 directory
whatever the process umask (another local user must not read a key mid-write)."""

from __future__ import annotations

import os
import stat

from crypto import make_secret_context
from crypto.seal_io import seal_save


class _ModeProbe:
    """Saves a real SEAL secret key and records the file's mode right after SEAL wrote it."""

    def __init__(self, key) -> None:  # noqa: ANN001
        self.key, self.mode, self.dir_mode = key, -1, -1

    def save(self, path: str) -> None:
        self.key.save(path)
        self.mode = stat.S_IMODE(os.stat(path).st_mode)
        self.dir_mode = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)


def test_a_secret_key_scratch_file_is_0600_in_a_0700_dir_under_a_permissive_umask() -> None:
    ctx = make_secret_context("fedkv-2048")
    probe = _ModeProbe(ctx.tenseal.secret_key().data)
    old = os.umask(0o022)
    try:
        size = len(seal_save(probe))  # only its length: a failing assert must not print the key
    finally:
        os.umask(old)
    assert size > 0
    assert (oct(probe.mode), oct(probe.dir_mode)) == ("0o600", "0o700")
