"""``python -m vmm_core``: the ``vmm-core`` command (``info``, ``bench``)."""

import sys

from .cli import main

sys.exit(main())
