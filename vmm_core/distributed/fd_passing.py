"""File descriptors between the processes of one node, over Unix domain sockets.

A memfd, or a CUDA handle exported as a POSIX file descriptor, means something only in
the process that holds it; the kernel copies such a descriptor into another process when
it travels as ``SCM_RIGHTS`` ancillary data on a Unix domain socket.  Every rank opens a
:class:`FdMailbox` (a listening socket in the abstract namespace, so there is no file to
clean up and nothing outlives the process), the ranks learn each other's mailbox address
and secret through their ``torch.distributed`` group, and then each one sends its
descriptors straight to the mailboxes of the ranks that need them.

Sending never waits for the receiver: a connection to a listening Unix socket is queued
by the kernel, and the message (with its descriptors) waits in the new socket until the
receiver accepts it.  So all ranks can send first and receive afterwards without any
ordering between them.  Every wait is bounded by a deadline.

The abstract namespace is visible to every process in the network namespace; a message
is accepted only if it carries the receiver's random secret, which travels only through
the process group.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import time

from ..errors import DistributedError

__all__ = ["FdMailbox", "send_fds"]

_HEADER = struct.Struct("!16sII")  # receiver's secret, sender's rank, number of fds
_MAX_FDS = 64


class FdMailbox:
    """A listening Unix socket that receives file descriptors from the other ranks."""

    def __init__(self, backlog: int = 128) -> None:
        self.secret = secrets.token_bytes(16)
        # leading NUL: Linux abstract namespace (no file on disk, gone with the socket)
        self.address = f"\0vmm_core-{os.getpid()}-{secrets.token_hex(8)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(self.address)
            self._sock.listen(backlog)
        except OSError:
            self._sock.close()
            raise

    def close(self) -> None:
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def receive(self, expected: dict[int, int], timeout: float) -> dict[int, list[int]]:
        """Wait for ``expected[rank]`` descriptors from each rank in ``expected``.

        Returns rank -> descriptors (owned by the caller).  Raises DistributedError
        naming the ranks that did not send within ``timeout`` seconds; descriptors
        received until then are closed.
        """
        got: dict[int, list[int]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(got) < len(expected):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(expected) - set(got))
                    raise DistributedError(
                        f"timed out after {timeout:.0f} s waiting for file descriptors from "
                        f"rank(s) {missing}: a rank probably died or failed during setup "
                        f"(see its output); raise the timeout if setup is just slow")
                self._sock.settimeout(remaining)
                try:
                    conn, _ = self._sock.accept()
                except socket.timeout:
                    continue
                with conn:
                    conn.settimeout(max(remaining, 0.1))
                    sender, fds = self._read_one(conn)
                if sender is None:
                    continue  # not one of ours: ignored, its descriptors closed
                if sender not in expected or sender in got or len(fds) != expected[sender]:
                    _close_all(fds)
                    raise DistributedError(
                        f"rank {sender} sent {len(fds)} file descriptor(s) but "
                        f"{expected.get(sender, 0)} were expected from it: the ranks "
                        f"disagree about the layout")
                got[sender] = fds
        except BaseException:
            for fds in got.values():
                _close_all(fds)
            raise
        return got

    def _read_one(self, conn) -> tuple[int | None, list[int]]:
        try:
            msg, fds, flags, _ = socket.recv_fds(conn, _HEADER.size, _MAX_FDS,
                                                 socket.MSG_CMSG_CLOEXEC)
        except (OSError, socket.timeout):
            return None, []
        if len(msg) != _HEADER.size or flags & socket.MSG_CTRUNC:
            _close_all(fds)
            return None, []
        secret, sender, count = _HEADER.unpack(msg)
        if secret != self.secret or count != len(fds):
            _close_all(fds)
            return None, []
        return sender, list(fds)


def send_fds(address: str, secret: bytes, sender: int, fds: list[int], timeout: float) -> None:
    """Send ``fds`` (the caller keeps and closes its copies) to the mailbox at ``address``."""
    if len(fds) > _MAX_FDS:
        raise DistributedError(f"cannot send {len(fds)} file descriptors in one message "
                               f"(at most {_MAX_FDS})")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(address)
            socket.send_fds(sock, [_HEADER.pack(secret, sender, len(fds))], fds)
        except OSError as exc:
            raise DistributedError(
                f"could not pass file descriptors to a peer's socket "
                f"({address.lstrip(chr(0))!r}): {exc}. The peer may have died, or run in "
                f"another network namespace (container) where this abstract socket is "
                f"invisible") from exc


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
