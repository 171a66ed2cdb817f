"""``python -m vmm_core.integrations.torch_memory_saver`` prints the alias directory (put
it first on PYTHONPATH); ``--preload`` prints the library to put in LD_PRELOAD."""

import sys

from .alias import alias_path, preload_path

print(preload_path() if "--preload" in sys.argv[1:] else alias_path())
