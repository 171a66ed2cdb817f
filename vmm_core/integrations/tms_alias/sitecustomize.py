"""Runs at interpreter start when the torch_memory_saver alias directory is on the path
(the preload library beside it puts it there): arms ``TMS_INIT_ENABLE``'s whole-process
mode before the program allocates anything, then runs the ``sitecustomize`` this file
hides, if the environment has one further down the path."""


def _run() -> None:
    import importlib.machinery
    import importlib.util
    import os
    import sys

    if os.environ.get("TMS_INIT_ENABLE"):
        try:
            from vmm_core.integrations.torch_memory_saver import process_mode

            process_mode.arm()
        except Exception as exc:  # noqa: BLE001 - never stop the interpreter from starting
            print(f"vmm_core: TMS_INIT_ENABLE could not be armed: {exc}", file=sys.stderr)
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_run()
del _run
