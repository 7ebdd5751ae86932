"""`python -m cumem_rs.bench`: the benchmark alone (also the entry point of the torch_memory_saver child)."""

import sys

from . import main

sys.exit(main())
