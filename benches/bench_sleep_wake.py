"""Sleep/wake benchmark: `python benches/bench_sleep_wake.py [--backend sim|cuda] [--scale N] [--json PATH]`.

A thin entry point; the benchmark itself is `cumem_rs.bench` (also `python -m cumem_rs bench`), shipped in the
package so that it runs wherever cumem_rs is installed.
"""

import sys

from cumem_rs.bench import main

if __name__ == "__main__":
    sys.exit(main())
