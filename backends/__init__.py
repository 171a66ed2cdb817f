"""Built-in vendor backends of vmm_core (imported as ``vmm_backends``).

Each vendor folder has the same three modules: ``vmm_api`` (the hooks, on the vendor's
driver library), ``allocator_adapter`` (framework pools served by vmm_core) and
``graph_ops`` (the framework's graph API).  Importing any of them never loads a driver
library or imports a vendor framework; that happens on first use.
"""
