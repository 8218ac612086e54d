"""``python -m actorllm.topology ROLE ...``: run one child process (see :mod:`.child`)."""

import logging
import os
import sys

from actorllm.topology.child import main

if __name__ == "__main__":
    _code = main()
    # Like multiprocessing's children: skip interpreter finalization, which with torch and
    # transformers loaded takes seconds of freeing memory that the kernel reclaims anyway.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code)
