"""Sharing physical memory between processes (optional): an exported handle imported in
this process, or in a child where the backend allows import only across processes."""

from __future__ import annotations

import pytest

from ..tools import read_bytes, write_bytes

_PAYLOAD = bytes(range(256)) * 16
_CHILD_TIMEOUT = 60.0


def _shared_pair(vmm_backend, vmm_device, size):
    """A shareable handle and its import in this same process (as another process would)."""
    import os

    caps = vmm_backend.capabilities(vmm_device)
    own = vmm_backend.create_shareable_handle(vmm_device, size)
    shareable = vmm_backend.export_handle(vmm_device, own,
                                          [vmm_backend.process_id(vmm_device)])
    try:
        imported = vmm_backend.import_handle(vmm_device, shareable, size)
    except BaseException:
        vmm_backend.release_handle(vmm_device, own)
        raise
    finally:
        if caps.shareable_handles == "fd":
            os.close(shareable)  # the caller owns exported and received descriptors
    return own, imported


def test_contract_exported_handle_aliases_after_import(vmm_backend, vmm_device, granularity):
    """Export, import, map both: one set of bytes seen twice; releasing the imported
    handle leaves the exporter's memory intact.  The import runs in this process, or in a
    child process where the backend declares ``same_process_import=False`` (the backend
    must then be loadable by name, ``vmm_core.get_backend(name)``, in a fresh process)."""
    caps = vmm_backend.capabilities(vmm_device)
    if caps.shareable_handles is None:
        pytest.skip(f"backend {vmm_backend.name!r} declares no shareable handles")
    if not caps.same_process_import:
        _alias_through_child(vmm_backend, vmm_device, granularity)
        return
    size = 2 * granularity
    own, imported = _shared_pair(vmm_backend, vmm_device, size)
    a = vmm_backend.reserve(vmm_device, size, granularity)
    b = vmm_backend.reserve(vmm_device, size, granularity)
    undo = []  # cleanups, run last-in first-out whatever happens
    try:
        vmm_backend.map(vmm_device, a, size, own, 0)
        undo.append(lambda: vmm_backend.unmap(vmm_device, a, size))
        if caps.needs_set_access:
            vmm_backend.set_access(vmm_device, a, size)
        vmm_backend.map(vmm_device, b, size, imported, 0)
        undo.append(lambda: vmm_backend.unmap(vmm_device, b, size))
        vmm_backend.set_access_for(vmm_device, b, size, [vmm_device])
        write_bytes(vmm_backend, vmm_device, a + granularity, _PAYLOAD)
        assert read_bytes(vmm_backend, vmm_device, b + granularity, len(_PAYLOAD)) == _PAYLOAD
        write_bytes(vmm_backend, vmm_device, b, b"from the importer")
        assert read_bytes(vmm_backend, vmm_device, a, 17) == b"from the importer"
        vmm_backend.synchronize(vmm_device)
        undo.pop()()  # unmap b
        vmm_backend.release_handle(vmm_device, imported)
        imported = None
        assert read_bytes(vmm_backend, vmm_device, a + granularity, len(_PAYLOAD)) == _PAYLOAD
    finally:
        vmm_backend.synchronize(vmm_device)
        while undo:
            undo.pop()()
        for handle in (imported, own):
            if handle is not None:
                vmm_backend.release_handle(vmm_device, handle)
        vmm_backend.release_range(vmm_device, a, size)
        vmm_backend.release_range(vmm_device, b, size)


def _alias_through_child(be, dev, g):
    """The aliasing check with the import in a child process, over a socket pair: the
    child sends its process id, gets the shareable handle (a descriptor travels with
    SCM_RIGHTS), maps it, checks and writes bytes, releases its import, reports."""
    import json
    import os
    import socket
    import subprocess
    import sys

    size = 2 * g
    caps = be.capabilities(dev)
    own = be.create_shareable_handle(dev, size)
    a = be.reserve(dev, size, g)
    ours, theirs = socket.socketpair()
    proc = reader = None
    mapped = False
    try:
        be.map(dev, a, size, own, 0)
        mapped = True
        if caps.needs_set_access:
            be.set_access(dev, a, size)
        write_bytes(be, dev, a + g, _PAYLOAD)
        be.synchronize(dev)
        code = "from vmm_core.testing.contract.sharing import _import_child; _import_child()"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, be.name, str(dev), str(size), str(theirs.fileno())],
            pass_fds=[theirs.fileno()])
        theirs.close()
        ours.settimeout(_CHILD_TIMEOUT)
        reader = ours.makefile("r")
        line = reader.readline()
        # a child that fails before it knows its process id sends its report instead
        assert line.strip().isdigit(), "the import child failed before sending its " \
            "process id: " + (json.loads(line).get("error") if line.startswith("{")
                              else "it died")
        pid = int(line)
        shareable = be.export_handle(dev, own, [pid])
        if caps.shareable_handles == "fd":
            try:
                socket.send_fds(ours, [b"fd\n"], [shareable])
            finally:
                os.close(shareable)
        else:
            ours.sendall(f"{shareable}\n".encode())
        report = json.loads(reader.readline() or '{"error": "the import child died"}')
        assert report.get("error") is None, f"the import child failed: {report['error']}"
        assert report["read"] == "ok"
        assert read_bytes(be, dev, a, 17) == b"from the importer"
        # the child released its import (and exited): the exporter's memory is intact
        assert read_bytes(be, dev, a + g, len(_PAYLOAD)) == _PAYLOAD
        assert proc.wait(_CHILD_TIMEOUT) == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(_CHILD_TIMEOUT)
        if reader is not None:
            reader.close()  # else the socket stays open while the failure is kept
        ours.close()
        theirs.close()
        be.synchronize(dev)
        if mapped:
            be.unmap(dev, a, size)
        be.release_handle(dev, own)
        be.release_range(dev, a, size)


def _import_child() -> None:
    """Entry point of the import child (see :func:`_alias_through_child`)."""
    import json
    import os
    import socket
    import sys
    import traceback

    import vmm_core

    name, dev, size, fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    sock = socket.socket(fileno=fd)
    sock.settimeout(_CHILD_TIMEOUT)
    report: dict = {"error": None}
    try:
        be = vmm_core.get_backend(name)
        g = be.capabilities(dev).granularity
        sock.sendall(f"{be.process_id(dev)}\n".encode())
        if be.capabilities(dev).shareable_handles == "fd":
            _, fds, _, _ = socket.recv_fds(sock, 16, 1)
            shareable = fds[0]
        else:
            shareable = int(sock.makefile("r").readline())
        try:
            imported = be.import_handle(dev, shareable, size)
        finally:
            if be.capabilities(dev).shareable_handles == "fd":
                os.close(shareable)
        b = be.reserve(dev, size, g)
        mapped = False
        try:
            be.map(dev, b, size, imported, 0)
            mapped = True
            be.set_access_for(dev, b, size, [dev])
            ok = read_bytes(be, dev, b + g, len(_PAYLOAD)) == _PAYLOAD
            report["read"] = "ok" if ok else "the child read other bytes than were written"
            write_bytes(be, dev, b, b"from the importer")
        finally:
            be.synchronize(dev)
            if mapped:
                be.unmap(dev, b, size)
            be.release_handle(dev, imported)
            be.release_range(dev, b, size)
    except BaseException:
        report["error"] = traceback.format_exc()
    sock.sendall((json.dumps(report) + "\n").encode())
    sock.close()



__all__ = [n for n in list(globals()) if n.startswith("test_contract_")]
