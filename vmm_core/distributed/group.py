"""The few collective steps vmm_core needs from the caller's ``torch.distributed`` group.

Only one collective is used: an all-gather of pickled objects, done with two tensor
``all_gather`` calls on the device the group's backend runs on (the CPU for gloo, our
device for NCCL), so it works with both and needs no numpy.

Each step is an *agreement*: every rank contributes its outcome (a value, or the error
it hit), and every rank then sees the same list, so all ranks take the same decision and
raise the same message.  A rank that died makes the collective itself fail (gloo: the
peer's connection closes; otherwise the group's timeout, set by the caller in
``init_process_group(timeout=...)``); that surfaces as :class:`DistributedError`.
Under NCCL a collective only times out in NCCL's watchdog thread, which by default
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) tears the waiting processes down instead of
raising; with ``TORCH_NCCL_BLOCKING_WAIT=1`` the wait raises, and that becomes the
:class:`DistributedError`.  Failures that a rank *survives* never depend on this: every
rank takes every step, and the failure travels as data.
"""

from __future__ import annotations

from ..errors import DistributedError

__all__ = ["Group", "RankFailure"]


class RankFailure:
    """What a rank reports instead of a value when its local part of a step failed."""

    def __init__(self, exc: BaseException) -> None:
        self.type_name = type(exc).__name__
        self.message = str(exc)

    def __repr__(self) -> str:
        return f"{self.type_name}: {self.message}"


class Group:
    """One process group seen by vmm_core: rank, size, agreements."""

    def __init__(self, group=None, backend=None, device: int | None = None) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedError(
                "torch.distributed is not initialized: call "
                "torch.distributed.init_process_group(...) on every rank first (torchrun "
                "sets the environment it needs)")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise DistributedError("this process is not a member of the given group")
        self._backend = backend
        self._device = device

    def _tensor_device(self):
        """Where the group's collectives take tensors: the CPU if its backend runs there
        (gloo), else a device of the framework (NCCL): our device when it is one the
        framework has, otherwise the current one, as torch's object collectives do.

        Never the error of a bad ``device`` argument: NCCL collectives are only waited
        for by the ranks that enter them, so a rank that raised here would leave the
        others waiting until the group's timeout (and NCCL's watchdog then tears them
        down) instead of joining the agreement that reports its bad argument."""
        import torch

        name = str(self._dist.get_backend(self.group)).lower()
        runs_on = self._dist.Backend.backend_capability.get(name, ["cpu"])
        if "cpu" in runs_on:
            return torch.device("cpu")
        if self._backend is None:  # not tied to a backend: the detected one, current device
            import vmm_core

            from ..memory.tagged import current_device

            self._backend = vmm_core.get_backend()
            self._device = current_device(self._backend)
        ops = self._backend.graph_ops(0)  # the device type (as memory.tagged.current_device)
        if ops is None or ops.device_type not in runs_on:
            raise DistributedError(
                f"the group's backend {name!r} runs on {runs_on}, but vmm_core's device is "
                f"{'the host' if ops is None else ops.device_type}: use a group whose "
                f"backend runs on that device (or gloo)")
        module = getattr(torch, ops.device_type, None)  # torch.cuda, torch.npu, torch.mlu
        index = self._device
        if module is not None and (isinstance(index, bool) or not isinstance(index, int) or
                                   not 0 <= index < module.device_count()):
            index = module.current_device()
        return torch.device(ops.device_type, index)

    def gather(self, obj, step: str) -> list:
        """Every rank's ``obj`` (anything picklable), in rank order.

        Like ``all_gather_object``, but built on tensor ``all_gather`` directly, so it
        needs no numpy and takes its tensors on the device the group's backend uses."""
        import ctypes
        import pickle

        import torch

        try:
            device = self._tensor_device()
            data = pickle.dumps((step, obj))  # the step travels too: see below
            size = torch.tensor([len(data)], dtype=torch.int64, device=device)
            sizes = [torch.empty_like(size) for _ in range(self.size)]
            self._dist.all_gather(sizes, size, group=self.group)
            lengths = [int(s.item()) for s in sizes]
            buf = torch.zeros(max(lengths), dtype=torch.uint8)
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            buf = buf.to(device)
            outs = [torch.empty_like(buf) for _ in range(self.size)]
            self._dist.all_gather(outs, buf, group=self.group)
            host = [o.cpu() for o in outs]
            shared = [pickle.loads(ctypes.string_at(h.data_ptr(), n))
                      for h, n in zip(host, lengths)]
        except DistributedError:
            raise
        except Exception as exc:
            raise DistributedError(
                f"rank {self.rank}: the process group failed during '{step}' "
                f"({type(exc).__name__}: {exc}). Another rank probably died or left the "
                f"collective; see its output") from exc
        # Two different steps (one rank closing a tensor, another in a group sleep) are
        # both these two all-gathers, so they pair up without any error: every rank
        # compares the steps and raises the same error, still in step with the others.
        steps = [s for s, _ in shared]
        if any(s != steps[0] for s in steps):
            listed = "; ".join(f"rank {r}: '{s}'" for r, s in enumerate(steps))
            raise DistributedError(
                f"the ranks are not in the same collective vmm_core call ({listed}); "
                f"nothing was exchanged. Every rank must make the same collective calls "
                f"(mapped_tensor, close, gather/scatter, sleep/wake_up with group=) in the "
                f"same order")
        return [o for _, o in shared]

    def agree(self, step: str, value=None, failure: BaseException | None = None) -> list:
        """Share ``value`` (or the failure) and raise on every rank if any rank failed.

        The raised :class:`DistributedError` has the same message on every rank.
        """
        outcomes = self.gather(RankFailure(failure) if failure is not None else value, step)
        failed = {r: o for r, o in enumerate(outcomes) if isinstance(o, RankFailure)}
        if failed:
            detail = "; ".join(f"rank {r}: {o!r}" for r, o in failed.items())
            raise DistributedError(f"{step} failed on rank(s) {sorted(failed)} of "
                                   f"{self.size}: {detail}")
        return outcomes
