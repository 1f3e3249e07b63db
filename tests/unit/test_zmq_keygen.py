"""`bin/engine zmq-keygen DIR`: the secret key file ends mode 0600 whatever was there, and a
symlink at its path is replaced (atomically), never followed."""

from __future__ import annotations

import os
import stat

from transport.security import read_curve_secret, write_curve_keypair


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_secret_key_over_an_existing_0644_file_ends_0600(tmp_path):
    secret = tmp_path / "zmq_server.key"
    secret.write_text("old\n")
    os.chmod(secret, 0o644)
    public_path, secret_path = write_curve_keypair(str(tmp_path))
    assert secret_path == str(secret)
    assert _mode(secret) == 0o600
    assert len(read_curve_secret(secret_path)) == 40
    assert _mode(public_path) & 0o077 != 0o077  # the public key is plainly readable


def test_a_symlink_at_the_secret_path_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("do not touch\n")
    os.chmod(victim, 0o644)
    keys = tmp_path / "keys"
    keys.mkdir()
    os.symlink(victim, keys / "zmq_server.key")
    os.symlink(victim, keys / "zmq_server.pub")
    public_path, secret_path = write_curve_keypair(str(keys))
    assert victim.read_text() == "do not touch\n"
    assert _mode(victim) == 0o644
    for path in (public_path, secret_path):
        assert not os.path.islink(path)
        assert stat.S_ISREG(os.lstat(path).st_mode)
    assert _mode(secret_path) == 0o600
    assert len(read_curve_secret(secret_path)) == 40


def test_no_temporary_file_is_left_behind(tmp_path):
    write_curve_keypair(str(tmp_path))
    write_curve_keypair(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["zmq_server.key", "zmq_server.pub"]
