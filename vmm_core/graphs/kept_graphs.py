"""What a graph whose executables vmm_core owns adds to the framework's graph class.

A backend's kept graph (``GraphOps.new_graph(keep=True)``) is the framework's own graph
class with :class:`KeptGraphMixin` first in its bases, so engines capture it exactly as
before (``with torch.cuda.graph(g, pool=handle)``) and replay it with ``g.replay()``.  The
mixin routes both through the owner GraphPool set (its executable cache):

* ``capture_begin`` asks the owner for the key of the capture space open on this thread,
  and, where the owner asks for it, watches the capture's operators through the
  dispatcher (:func:`watch_operators`);
* ``capture_end`` hands the owner the capture, which tells what in it draws random
  numbers: the operators the watch saw, or, where the backend reads kernels, the
  graph's kernels, read at the graph's first replay (or the first look at
  ``vmm_seeded``) rather than in the capture, whose thread an engine's start-up waits
  for;
* ``replay`` launches the executable the owner chose; inside the innermost replay block
  of the graph's key on this thread (:data:`innermost`) a graph that has one launches it
  at once, without a lock: no other thread takes or destroys an executable of a key while
  a replay block of it is open.  ``framework_replay`` is the framework's own replay,
  which graphs drawing random numbers keep using (see below);
* ``reset`` drops the graph's executable, then the framework's graph.

**Random numbers.**  The framework's replay advances the offsets of every generator the
capture registered before it launches (torch: ``CUDAGraph::replay`` runs each generator
state's ``replay_prologue``), and Python cannot reach that step.  A launch of our own
executable would repeat the same random numbers every time, so a graph that draws random
numbers is never launched through vmm_core's executables.  Two ways tell such graphs:
the backend reads the captured graph's kernels (CUDA: a kernel taking torch's
``PhiloxCudaState``, ``Executables.random_kernels``: about one driver call a node); or a
dispatch mode watches every operator of the capture (tagged
``nondeterministic_seeded``, with arguments that draw: attention at ``dropout_p=0`` and
dropout with ``train=False`` draw none, see :func:`draws_random_numbers`), a Python call
per operator.  By default a pool reads kernels where the backend's reading sees the
generator's captured state in any kernel parameter (CUDA), and watches operators
elsewhere (``ExecutablePolicy(random_numbers=...)``).  What the way in use does not see (a
custom operator drawing without the tag; with kernels read, a kernel reading the
generator through a parameter struct) is not told apart.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .exec_residency import KeySlot

__all__ = ["KeptGraphMixin", "watch_operators", "draws_random_numbers", "innermost",
           "read_random_kernels"]

#: the key of a graph not captured (or reset): no GraphPool key is this object
NOT_CAPTURED = object()


class _Innermost(threading.local):
    #: the key slot of the innermost replay block open on this thread (None: none, or a
    #: block of a pool whose executables the framework keeps)
    slot: KeySlot | None = None


#: per thread, set by every replay block (``vmm_core.graphs.exec_blocks.replay_block``)
innermost = _Innermost()

_mode_class = None
#: operator overload -> whether it carries the ``nondeterministic_seeded`` tag
_seeded_operators: dict = {}


def _operator_watch_class():
    """A ``TorchDispatchMode`` that records each operator it sees and forwards it."""
    global _mode_class
    if _mode_class is None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        seeded_tag = torch.Tag.nondeterministic_seeded

        class OperatorWatch(TorchDispatchMode):
            # torch wraps a mode's __torch_dispatch__ in a lazy "disable Dynamo" unless
            # the class opts out; its first call imports torch._dynamo, seconds at the
            # first capture of every process. A watch only reads operator names: it is
            # never traced, so there is nothing to disable.
            @classmethod
            def _should_skip_dynamo(cls) -> bool:
                return False

            def __init__(self) -> None:
                super().__init__()
                # the operator objects: their names are made only when someone reads
                # them (KeptGraphMixin.vmm_operators), not once per operator captured
                self.operators: list = []
                self.seeded: list = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.operators.append(func)
                tagged = _seeded_operators.get(func)
                if tagged is None:  # once per operator overload of the process
                    tagged = _seeded_operators[func] = seeded_tag in getattr(func, "tags", ())
                if tagged and draws_random_numbers(func, args, kwargs or {}):
                    self.seeded.append(func)
                return func(*args, **(kwargs or {}))

        _mode_class = OperatorWatch
    return _mode_class


def draws_random_numbers(func, args, kwargs) -> bool:
    """Whether an operator tagged ``nondeterministic_seeded`` draws random numbers with
    these arguments.  The attention operators carry the tag for their dropout, which
    inference runs at ``dropout_p=0`` (flash and memory-efficient attention then take no
    generator state), and ``native_dropout`` with ``train=False`` draws none either;
    every other tagged operator is taken to draw."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return True
    given = {}
    for index, argument in enumerate(schema.arguments):
        if index < len(args):
            given[argument.name] = args[index]
        elif argument.name in kwargs:
            given[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            given[argument.name] = argument.default_value
    if "dropout_p" in given:
        return not (isinstance(given["dropout_p"], (int, float)) and given["dropout_p"] == 0)
    if given.get("train", True) is False:
        return False
    return True


def read_random_kernels(graph, calls) -> None:
    """Add to ``graph``'s ``vmm_seeded`` the kernels of its capture that draw random
    numbers, as the backend's executables read them; a graph they could not read counts
    as drawing (kept on the framework's replay, which is right either way)."""
    try:
        kernels = tuple(calls.random_kernels(graph))
    except Exception as error:  # noqa: BLE001 - unread: kept on the framework's replay
        kernels = (f"<kernels not read: {error}>",)
    if graph._vmm_other_generators:  # their state is not what the reading looks for
        kernels += ("<a generator registered with register_generator_state>",)
    if kernels:
        graph._vmm_random = tuple(graph._vmm_random) + kernels


def watch_operators():
    """A dispatch mode to enter around a capture; afterwards ``.operators`` lists every
    operator (overload object) the dispatcher saw and ``.seeded`` those drawing random
    numbers."""
    return _operator_watch_class()()


class KeptGraphMixin:
    """Put first in the bases of a framework graph class (see the module docstring).

    The owner (``_vmm_owner``, set by :meth:`GraphPool.new_graph`) implements
    ``capture_begins(graph)`` -> key, ``capture_ended(graph, key)``,
    ``capture_failed(graph)``, ``replay(graph)`` and ``forget(graph)``.  Without an owner
    the graph behaves as the framework's.  After a capture, ``vmm_operators`` lists the
    operators the dispatcher saw in it (empty where it was not watched) and ``vmm_seeded``
    what draws random numbers in it.
    """

    _vmm_owner = None
    _vmm_key: object = NOT_CAPTURED
    _vmm_slot = None  # the key's slot in the owner, once captured
    _vmm_exec = None  # the executable to launch, while the owner keeps one for it
    _vmm_pending = None  # (key, dispatch mode) between capture_begin and capture_end
    #: the operator objects the last capture's watch saw, and those drawing random numbers
    _vmm_watched: tuple = ((), ())
    #: the names of what draws random numbers in the last capture (watched operators,
    #: and kernels the owner read from the graph)
    _vmm_random: tuple = ()
    _vmm_names: tuple | None = None  # their names, once asked for
    #: captured, its kernels not read yet: until they are it replays through the owner,
    #: which reads them first (the fast path needs ``_vmm_slot``, set only once read)
    _vmm_unread = False
    #: a generator was registered with register_generator_state (read kernels: drawing)
    _vmm_other_generators = False

    @property
    def vmm_operators(self) -> tuple:
        """The names of the operators the dispatcher saw in the last capture, in order."""
        if self._vmm_names is None:
            self._vmm_names = tuple(str(op) for op in self._vmm_watched[0])
        return self._vmm_names

    @property
    def vmm_seeded(self) -> tuple:
        """The names of what draws random numbers in the last capture: operators the
        watch saw, kernels the backend read (read now if they were not yet)."""
        if self._vmm_unread and self._vmm_owner is not None:
            self._vmm_owner.read_kernels(self)
        return self._vmm_random

    def _framework(self, name: str):
        """The framework graph class's own ``name`` (the class after this mixin)."""
        return getattr(super(), name)

    def capture_begin(self, *args, **kwargs):
        owner = self._vmm_owner
        if owner is None:
            return self._framework("capture_begin")(*args, **kwargs)
        key = owner.capture_begins(self)
        watch = watch_operators() if owner.watches_operators else None
        if watch is not None:
            watch.__enter__()
        try:
            self._framework("capture_begin")(*args, **kwargs)
        except BaseException:
            if watch is not None:
                watch.__exit__(None, None, None)
            owner.capture_failed(self)
            raise
        self._vmm_pending = (key, watch)

    def capture_end(self):
        pending, self._vmm_pending = self._vmm_pending, None
        if pending is None:
            return self._framework("capture_end")()
        key, watch = pending
        owner = self._vmm_owner
        try:
            self._framework("capture_end")()
        except BaseException:
            if owner is not None:
                owner.capture_failed(self)
            raise
        finally:
            if watch is not None:
                watch.__exit__(None, None, None)
        if watch is None:
            self._vmm_watched, self._vmm_random = ((), ()), ()
        else:
            self._vmm_watched = (tuple(watch.operators), tuple(watch.seeded))
            self._vmm_random = tuple(str(op) for op in watch.seeded)
        self._vmm_names = None
        if owner is not None:
            owner.capture_ended(self, key)

    def capture_abort(self):
        """End a capture whose work raised (the host's capture of a function): the
        framework's capture ends and the owner hears that it failed, so nothing of it is
        counted as captured or made into an executable."""
        pending, self._vmm_pending = self._vmm_pending, None
        try:
            self._framework("capture_end")()
        finally:
            if pending is not None:
                if pending[1] is not None:
                    pending[1].__exit__(None, None, None)
                if self._vmm_owner is not None:
                    self._vmm_owner.capture_failed(self)

    def replay(self):
        slot = self._vmm_slot
        if slot is not None and innermost.slot is slot and slot.blocks:  # still open
            handle = self._vmm_exec
            if handle is not None:
                slot.hits += 1
                slot.launch(handle)
                return
        owner = self._vmm_owner
        if owner is None:
            return self._framework("replay")()
        owner.replay(self)

    def register_generator_state(self, *args, **kwargs):
        """The framework's, noted: reading kernels looks for the default generator's
        state only, so a graph registering another one counts as drawing there."""
        self._vmm_other_generators = True
        return self._framework("register_generator_state")(*args, **kwargs)

    def framework_replay(self):
        """The framework's own replay of this graph (its own executable)."""
        return self._framework("replay")()

    def reset(self):
        owner = self._vmm_owner
        if owner is not None:
            owner.forget(self)
        return self._framework("reset")()
