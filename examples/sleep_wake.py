"""Sleep and wake the whole engine (KV arena and weights) while it serves, and check that
generation is unchanged: examples/decode.py with --sleep-every K (default 4).

    python examples/sleep_wake.py [--sleep-every K] [decode.py options]

The library side is `jax_vmm.serving.sleep_wake` (and docs/sleep.md).
"""

import sys

from jax_vmm.serving.cli import decode

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a.startswith("--sleep-every") for a in argv):
        argv = ["--sleep-every", "4", *argv]
    decode.main(argv)
