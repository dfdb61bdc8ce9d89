"""Shared memory and the rendezvous are closed to others: a file made under a transport's name by another user,
or a symbolic link there, is refused (the run ends with one line naming the file), the owner's own files are
opened and mapped from the descriptor, and the launcher's store listens on loopback only."""

import glob
import os
import pwd
import socket
import subprocess
import types

import pytest
import torch
import torch.distributed as dist

from parallelisms.comm.shm import ShmRefused, open_shared, shm_machine, shm_path
from parallelisms.launch import LaunchError, launch

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
TOKEN = "0123456789abcdef0123456789abcdef"


def _nobody() -> int | None:
    """Another user's uid, where this process may give a file away (root)."""
    try:
        return pwd.getpwnam("nobody").pw_uid if os.geteuid() == 0 else None
    except KeyError:
        return None


def _foreign_file(path: str) -> None:
    """A file under ``path`` another user made (where the machine allows), else one any user may read."""
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    os.chmod(path, 0o666)
    if _nobody() is not None:
        os.chown(path, _nobody(), -1)


def test_a_file_of_another_user_or_a_link_is_refused(tmp_path):
    path = f"/dev/shm/parallelisms-test-{os.getpid()}"
    try:
        _foreign_file(path)
        for create in (True, False, None):
            with pytest.raises(ShmRefused, match="refused"):
                open_shared(path, 4096, create)
        os.unlink(path)
        target = tmp_path / "mine"  # a link to a file of this user's: the run would resize and map it
        target.write_bytes(b"keep")
        os.symlink(target, path)
        for create in (True, False, None):
            with pytest.raises(ShmRefused, match="symbolic link: refused"):
                open_shared(path, 4096, create)
        assert target.read_bytes() == b"keep"
        os.unlink(path)
        made = open_shared(path, 4096, True)  # this user's: made, then opened by a peer, the same memory
        made[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert open_shared(path, 4096, False)[:4].tolist() == [1, 2, 3, 4]
    finally:
        if os.path.lexists(path):
            os.unlink(path)


def _a_ring_name_taken_first(info):
    """Rank 0 draws a known token (in place of a random one) and another user makes the file under its name
    first; the transport's set-up must refuse it."""
    from parallelisms.comm import shm

    if info.rank == 0:
        shm.uuid = types.SimpleNamespace(uuid4=lambda: types.SimpleNamespace(hex=TOKEN))
        _foreign_file(f"{shm_path(TOKEN)}-0")
    transport = shm.SharedMemoryCollectives(dist.group.WORLD, info.rank, info.world_size)
    transport.fits(1024)
    return "mapped another user's file"


@pytest.mark.skipif(not shm_machine(), reason="shared-memory transport needs x86 and /dev/shm")
def test_a_run_whose_shared_file_was_made_by_another_user_ends_with_one_line():
    try:
        with pytest.raises(LaunchError) as failure:
            launch(_a_ring_name_taken_first, 2, threads=1)
    finally:  # the other user's file stays (the launcher removes only the run's own): the test removes it
        for path in glob.glob(f"/dev/shm/parallelisms-*-{TOKEN}-0"):
            os.unlink(path)
    line = str(failure.value)
    assert "\n" not in line and line.startswith("rank 0 failed") and "ShmRefused" in line, line
    assert "exists already, made by another process: refused" in line


def _non_loopback_address() -> str | None:
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3), None)


def _store_reachability(info, address: str):
    port = int(os.environ["MASTER_PORT"])
    result = {}
    for name, host in (("loopback", "127.0.0.1"), ("other", address)):
        with socket.socket() as s:
            s.settimeout(5)
            result[name] = s.connect_ex((host, port)) == 0
    return result


def test_the_rendezvous_store_is_not_reachable_on_another_address():
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    reach = launch(_store_reachability, 2, address, threads=1)[0]
    assert reach == {"loopback": True, "other": False}, reach
